"""``sessionstore append --enqueue`` refuses bad writes at the door; ``dead-letters`` lets an
operator list (full ids), export (JSONL) and replay (overriding ``expected_seq``)."""

from __future__ import annotations

import json
from pathlib import Path

from core import SessionStore, Settings
from core.errors import ConcurrencyConflict, IdempotencyKeyReused
from tests.acceptance.test_cli import assert_user_error, run


def _letter(data_dir: Path) -> tuple[str, int]:
    """A session with two events and a dead letter rejected on a conflict (head 5)."""
    with SessionStore.from_settings(Settings(data_dir=data_dir)) as store:
        sid = store.create_session(tenant_id="acme").id
        store.append(sid, [{"type": "n", "i": 1}, {"type": "n", "i": 2}])
        letter = store.dead_letters.record(
            idempotency_key="conflicted-write-key-that-is-long-" + "x" * 40,
            session_id=sid,
            events=[{"type": "n", "i": 3}],
            expected_seq=5,
            error=ConcurrencyConflict(sid, 5, 2),
        )
        return sid, letter.id


def test_enqueue_refuses_a_bad_write_before_publishing(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    assert run(data_dir, "db", "upgrade").returncode == 0
    with SessionStore.from_settings(Settings(data_dir=data_dir)) as store:
        sid = store.create_session(tenant_id="acme").id
    deep: object = 1
    for _ in range(100):
        deep = [deep]
    bad = json.dumps({"type": "n", "v": deep}) + "\n"
    result = run(data_dir, "append", sid, "-", "--enqueue", stdin=bad)
    assert_user_error(result, "nested deeper", "stdin line 1")
    queued = list((data_dir / "queue" / "in").glob("*"))
    assert queued == []  # nothing was published


def test_list_export_and_replay_with_expected_seq_override(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    assert run(data_dir, "db", "upgrade").returncode == 0
    sid, letter_id = _letter(data_dir)

    listed = run(data_dir, "dead-letters", "list")
    assert listed.returncode == 0
    assert sid in listed.stdout  # whole ids, on one line
    assert "conflicted-write-key-that-is-long-" + "x" * 40 in listed.stdout

    out = tmp_path / "letters.jsonl"
    exported = run(data_dir, "dead-letters", "export", str(out), "--json")
    assert exported.returncode == 0 and json.loads(exported.stdout)["exported"] == 1
    (line,) = out.read_text().splitlines()
    record = json.loads(line)
    assert (record["id"], record["session_id"], record["expected_seq"]) == (letter_id, sid, 5)
    assert record["events"] == [{"type": "n", "i": 3}]

    again = run(data_dir, "dead-letters", "replay", str(letter_id), "--json")
    assert_user_error(again, "expected head 5")  # as recorded: still a conflict
    replayed = run(
        data_dir, "dead-letters", "replay", str(letter_id), "--no-expected-seq", "--json"
    )
    assert replayed.returncode == 0, replayed.stderr
    assert json.loads(replayed.stdout)["first_seq"] == 3
    assert json.loads(run(data_dir, "dead-letters", "list", "--json").stdout) == []


def test_replay_at_an_explicit_head(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    assert run(data_dir, "db", "upgrade").returncode == 0
    _, letter_id = _letter(data_dir)
    replayed = run(
        data_dir, "dead-letters", "replay", str(letter_id), "--expected-seq", "2", "--json"
    )
    assert replayed.returncode == 0, replayed.stderr
    assert json.loads(replayed.stdout)["last_seq"] == 3


def test_show_prints_a_letter_holding_a_lone_surrogate(tmp_path: Path) -> None:
    """The letters kept are the writes that could not be stored, lone surrogates included:
    the human view shows them escaped, as --json does, instead of failing to encode them."""
    data_dir = tmp_path / "data"
    assert run(data_dir, "db", "upgrade").returncode == 0
    with SessionStore.from_settings(Settings(data_dir=data_dir)) as store:
        sid = store.create_session(tenant_id="acme").id
        letter = store.dead_letters.record(
            idempotency_key="k",
            session_id=sid,
            events=[{"type": "n", "text": "a\ud800b"}],
            expected_seq=None,
            error=ValueError("lone surrogate"),
        )
    shown = run(data_dir, "dead-letters", "show", str(letter.id))
    assert shown.returncode == 0, shown.stderr
    assert "a\\ud800b" in shown.stdout


def test_replay_answers_producers_looking_the_write_up(tmp_path: Path) -> None:
    """After a replay, the outcome stored for (session, key) says committed, no longer the
    rejection a producer was given when the write was dead-lettered."""
    from tasks.app import create_app
    from tasks.outcomes import dead_lettered, store_outcome, stored_outcome

    data_dir = tmp_path / "data"
    assert run(data_dir, "db", "upgrade").returncode == 0
    sid, letter_id = _letter(data_dir)
    app = create_app(Settings(data_dir=data_dir))
    key = "conflicted-write-key-that-is-long-" + "x" * 40
    with SessionStore.from_settings(Settings(data_dir=data_dir)) as store:
        store_outcome(app, sid, key, dead_lettered(store.dead_letters.get(letter_id)))
    rejected = stored_outcome(app, sid, key)
    assert rejected is not None and rejected["status"] == "dead_lettered"
    done = run(data_dir, "dead-letters", "replay", str(letter_id), "--no-expected-seq")
    assert done.returncode == 0, done.stderr
    outcome = stored_outcome(app, sid, key)
    assert outcome is not None and outcome["status"] == "ok" and outcome["last_seq"] == 3


def test_a_send_clears_an_earlier_rejection_but_never_a_commit(tmp_path: Path) -> None:
    """What a send clears under its (session, key) before publishing: a dead letter's
    outcome (not this send's answer), never a committed one (the answer to any resend)."""
    from tasks.app import create_app
    from tasks.outcomes import store_outcome, stored_outcome, write_task_id
    from tasks.producer import _forget_rejection

    app = create_app(Settings(data_dir=tmp_path / "data"))
    committed = {"status": "ok", "session_id": "s", "idempotency_key": "k", "last_seq": 1}
    store_outcome(app, "s", "k", committed)
    _forget_rejection(app.backend, write_task_id("s", "k"))
    assert stored_outcome(app, "s", "k") == committed
    store_outcome(app, "s", "k", {"status": "dead_lettered", "dead_letter_id": 1})
    _forget_rejection(app.backend, write_task_id("s", "k"))
    assert stored_outcome(app, "s", "k") is None


def test_a_letter_refused_for_a_reused_key_replays_under_a_new_key(tmp_path: Path) -> None:
    """A write refused because its key had committed other content cannot land under that
    key (each replay is refused the same way, typed); ``--key`` lands it under a new one,
    and ``append`` with a reused key says so too."""
    data_dir = tmp_path / "data"
    assert run(data_dir, "db", "upgrade").returncode == 0
    with SessionStore.from_settings(Settings(data_dir=data_dir)) as store:
        sid = store.create_session(tenant_id="acme").id
        store.append(sid, [{"type": "n", "i": 1}], idempotency_key="k")
        try:
            store.append(sid, [{"type": "n", "i": 2}], idempotency_key="k")
        except IdempotencyKeyReused as exc:
            refused = exc
        letter = store.dead_letters.record(
            idempotency_key="k",
            session_id=sid,
            events=[{"type": "n", "i": 2}],
            expected_seq=None,
            error=refused,
        )
    again = run(data_dir, "dead-letters", "replay", str(letter.id))
    assert_user_error(again, "idempotency key reused", "seq 1..1")
    landed = run(data_dir, "dead-letters", "replay", str(letter.id), "--key", "k-2", "--json")
    assert landed.returncode == 0, landed.stderr
    assert json.loads(landed.stdout)["first_seq"] == 2
    assert run(data_dir, "dead-letters", "list", "--json").stdout.strip() in ("", "[]")

    first = run(data_dir, "append", sid, "-", "--key", "b", stdin='{"type": "n", "i": 3}\n')
    assert first.returncode == 0, first.stderr
    reused = run(data_dir, "append", sid, "-", "--key", "b", stdin='{"type": "n", "i": 4}\n')
    assert_user_error(reused, "idempotency key reused", "'b:0'")
    with SessionStore.from_settings(Settings(data_dir=data_dir)) as store:
        assert [e.payload["i"] for e in store.read(sid)] == [1, 2, 3]


def test_a_replay_with_fixed_events_answers_the_producer_that_sent_the_letter(
    tmp_path: Path,
) -> None:
    """The producer waiting under (session, key) sent the letter's events; the operator's
    fix landed under its key, so its answer is "committed", not another write's."""
    from tasks.app import create_app
    from tasks.outcomes import answer_for, stored_outcome, write_digest

    data_dir = tmp_path / "data"
    assert run(data_dir, "db", "upgrade").returncode == 0
    sid, letter_id = _letter(data_dir)
    fixed = tmp_path / "fixed.jsonl"
    fixed.write_text('{"type": "n", "i": 33}\n')
    done = run(
        data_dir,
        "dead-letters",
        "replay",
        str(letter_id),
        "--file",
        str(fixed),
        "--json",
        "--no-expected-seq",
    )
    assert done.returncode == 0, done.stderr
    app = create_app(Settings(data_dir=data_dir))
    key = "conflicted-write-key-that-is-long-" + "x" * 40
    answer = answer_for(stored_outcome(app, sid, key), write_digest([{"type": "n", "i": 3}]))
    assert answer is not None and answer["status"] == "ok" and answer["last_seq"] == 3
