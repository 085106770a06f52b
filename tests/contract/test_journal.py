"""The journal contract, run against every backend (invariants 1, 3, 4, 5, 8)."""

from __future__ import annotations

import base64
import io
import math
import multiprocessing
import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event, func, select, text

from core import ConcurrencyConflict, InvalidEvent, SessionNotFound, SessionStore, Settings
from core.errors import IdempotencyKeyReused
from core.journal import journal as journal_module
from core.journal.postgres import PG_APPEND
from core.models import EventRow, WriteRow
from tests.pi_support import FIXTURES

MP = multiprocessing.get_context("spawn")


def _msg(i: int = 0, **extra: Any) -> dict[str, Any]:
    return {
        "type": "message",
        "id": f"e{i}",
        "message": {"role": "user", "content": f"hi {i}"},
        **extra,
    }


def _count_events(store: SessionStore) -> int:
    with store.engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(EventRow)).scalar_one())


# child-process helpers (module level so spawn can import them) -----------------------------


def _append_many(url: str, data_dir: str, session_id: str, count: int, start: Any) -> None:
    start.wait()
    with SessionStore.from_settings(Settings(database_url=url, data_dir=Path(data_dir))) as store:
        for i in range(count):
            store.append(session_id, [_msg(i)])


def _append_then_die(url: str, data_dir: str, session_id: str, key: str) -> None:
    with SessionStore.from_settings(Settings(database_url=url, data_dir=Path(data_dir))) as store:
        store.append(session_id, [_msg(1), _msg(2)], idempotency_key=key)
    os.kill(os.getpid(), signal.SIGKILL)


class JournalContract:
    """Each backend supplies ``store`` (and ``url``); everything else is shared."""

    @pytest.fixture
    def url(self) -> str:
        raise NotImplementedError

    @pytest.fixture
    def store(self, url: str, tmp_path: Path) -> Iterator[SessionStore]:
        settings = Settings(database_url=url, data_dir=tmp_path / "data")
        with SessionStore.from_settings(settings) as store:
            yield store

    # sessions -------------------------------------------------------------------------

    def test_create_and_get_session(self, store: SessionStore) -> None:
        s = store.create_session(tenant_id="acme", title="t", cwd="/w")
        got = store.get_session(s.id)
        assert (got.tenant_id, got.title, got.cwd, got.head_seq) == ("acme", "t", "/w", 0)
        assert got.created_at.tzinfo is not None
        with pytest.raises(SessionNotFound):
            store.get_session("missing")
        with pytest.raises(SessionNotFound):
            store.get_session(s.id, tenant_id="other")

    def test_list_sessions_paginates_by_cursor(self, store: SessionStore) -> None:
        ids = [store.create_session(tenant_id="acme").id for _ in range(7)]
        store.create_session(tenant_id="other")
        seen: list[str] = []
        cursor = None
        pages = 0
        while True:
            page = store.list_sessions(tenant_id="acme", limit=3, cursor=cursor)
            seen += [s.id for s in page.items]
            pages += 1
            cursor = page.next_cursor
            if cursor is None:
                break
        assert sorted(seen) == sorted(ids) and len(seen) == 7 and pages == 3
        with pytest.raises(InvalidEvent, match="cursor"):
            store.list_sessions(cursor="garbage!")

    def test_expected_seq_must_be_an_int_on_every_backend(self, store: SessionStore) -> None:
        s = store.create_session(tenant_id="acme")
        store.append(s.id, [_msg()])
        for bad in (True, "1", 1.0, -1, 2**63):
            with pytest.raises(InvalidEvent, match="expected_seq"):
                store.append(s.id, [_msg(2)], expected_seq=bad)
        assert store.get_session(s.id).head_seq == 1

    def test_out_of_range_cursors_are_invalid_not_a_driver_error(self, store: SessionStore) -> None:
        store.append(store.create_session(tenant_id="acme").id, [_msg()])
        naive = base64.urlsafe_b64encode(b"2024-01-01T00:00:00|x").decode()  # well formed, no zone
        # a session id no session holds, which PostgreSQL refused where SQLite read a page
        nul = base64.urlsafe_b64encode(b"2024-01-01T00:00:00+00:00|x\x00").decode()
        for cursor in (naive, nul):
            with pytest.raises(InvalidEvent, match="not a cursor this store issued") as caught:
                store.list_sessions(cursor=cursor)
            assert caught.value.field == "cursor"
            assert str(caught.value).startswith("invalid argument cursor")  # not "event"
        # a forged cursor of 100 KB is named, not echoed whole (a line of 100 KB before)
        with pytest.raises(InvalidEvent, match="100,000 characters") as caught:
            store.list_sessions(cursor="A" * 100_000)
        assert len(str(caught.value)) < 200
        for position in (2**63, -1, True):
            with pytest.raises(InvalidEvent, match="after_position"):
                store.list_events(after_position=position)
        assert store.list_events(after_position=2**63 - 1).items == []

    # append and read ------------------------------------------------------------------

    def test_append_assigns_gapless_seqs_and_increasing_positions(
        self, store: SessionStore
    ) -> None:
        s = store.create_session(tenant_id="acme")
        r1 = store.append(s.id, [_msg(1), _msg(2)])
        r2 = store.append(s.id, [_msg(3)])
        assert (r1.first_seq, r1.last_seq, r2.first_seq, r2.last_seq) == (1, 2, 3, 3)
        assert r1.positions[0] < r1.positions[1] < r2.positions[0]
        events = store.read(s.id)
        assert [e.seq for e in events] == [1, 2, 3]
        assert events[2].payload == _msg(3)
        assert store.get_session(s.id).head_seq == 3

    def test_read_windows(self, store: SessionStore) -> None:
        s = store.create_session(tenant_id="acme")
        store.append(s.id, [_msg(i) for i in range(10)])
        assert [e.seq for e in store.read(s.id, after_seq=3, upto_seq=6)] == [4, 5, 6]
        assert [e.seq for e in store.read(s.id, after_seq=8, limit=5)] == [9, 10]
        assert store.read(s.id, after_seq=10) == []
        with pytest.raises(SessionNotFound):
            store.read("missing")
        with pytest.raises(SessionNotFound):
            store.read(s.id, tenant_id="intruder")

    def test_read_all_filters_by_tenant_and_type(self, store: SessionStore) -> None:
        a = store.create_session(tenant_id="a")
        b = store.create_session(tenant_id="b")
        store.append(a.id, [_msg(1), {"type": "label", "label": "x"}])
        store.append(b.id, [_msg(2)])
        assert [e.session_id for e in store.read_all(tenant_id="b")] == [b.id]
        assert [e.type for e in store.read_all(types=["label"])] == ["label"]
        everything = store.read_all()
        assert [e.position for e in everything] == sorted(e.position for e in everything)
        assert store.read_all(after_position=everything[-1].position) == []
        assert len(store.read_all(limit=2)) == 2

    def test_expected_seq_conflict_carries_current_head(self, store: SessionStore) -> None:
        s = store.create_session(tenant_id="acme")
        store.append(s.id, [_msg(1)], expected_seq=0)
        with pytest.raises(ConcurrencyConflict) as info:
            store.append(s.id, [_msg(2)], expected_seq=0)
        assert info.value.current_seq == 1 and info.value.expected_seq == 0
        assert store.append(s.id, [_msg(2)], expected_seq=1).last_seq == 2

    def test_append_to_unknown_session(self, store: SessionStore) -> None:
        with pytest.raises(SessionNotFound):
            store.append("nope", [_msg(1)])

    # idempotency (invariant 5) --------------------------------------------------------

    def test_idempotency_key_replay_writes_nothing(self, store: SessionStore) -> None:
        s = store.create_session(tenant_id="acme")
        first = store.append(s.id, [_msg(1), _msg(2)], idempotency_key="k-1")
        again = store.append(s.id, [_msg(1), _msg(2)], idempotency_key="k-1")
        assert again.replayed and not first.replayed
        assert (again.first_seq, again.last_seq, again.positions) == (
            first.first_seq,
            first.last_seq,
            first.positions,
        )
        assert _count_events(store) == 2 and store.get_session(s.id).head_seq == 2

    def test_idempotency_replay_after_writer_process_died(
        self, store: SessionStore, url: str, tmp_path: Path
    ) -> None:
        s = store.create_session(tenant_id="acme")
        child = MP.Process(target=_append_then_die, args=(url, str(tmp_path), s.id, "k-dead"))
        child.start()
        child.join(60)
        assert child.exitcode == -signal.SIGKILL
        replay = store.append(s.id, [_msg(1), _msg(2)], idempotency_key="k-dead")
        assert replay.replayed and (replay.first_seq, replay.last_seq) == (1, 2)
        assert _count_events(store) == 2

    @pytest.mark.parametrize(
        "other",
        [
            [_msg(1), _msg(3)],  # another event
            [_msg(1)],  # fewer events
            [_msg(1), _msg(2), _msg(3)],  # more events
            [_msg(1), _msg(2, n=1)],  # a field more
            [_msg(1), {**_msg(2), "type": "custom"}],  # another type
            [_msg(1), dict(reversed(_msg(2).items()))],  # the same fields in another order
        ],
        ids=["event", "fewer", "more", "field", "type", "key-order"],
    )
    def test_a_key_reused_for_other_content_is_refused_and_nothing_lost(
        self, store: SessionStore, other: list[dict[str, Any]]
    ) -> None:
        """Answering other content under a committed key as a replay dropped that content
        without a word (the key is the producer's, and producers reuse them by mistake)."""
        s = store.create_session(tenant_id="acme")
        first = store.append(s.id, [_msg(1), _msg(2)], idempotency_key="k")
        with pytest.raises(IdempotencyKeyReused) as caught:
            store.append(s.id, other, idempotency_key="k")
        error = caught.value
        assert isinstance(error, InvalidEvent) and error.field == "idempotency_key"
        assert (error.session_id, error.idempotency_key) == (s.id, "k")
        assert (error.first_seq, error.last_seq) == (first.first_seq, first.last_seq)
        assert error.to_dict()["error"] == "IdempotencyKeyReused"
        assert _count_events(store) == 2 and store.get_session(s.id).head_seq == 2
        # the write it repeats is still answered as a replay, and a new key lands the rest
        assert store.append(s.id, [_msg(1), _msg(2)], idempotency_key="k").replayed
        assert store.append(s.id, other, idempotency_key="k2").first_seq == 3

    def test_a_key_used_in_another_session_is_its_own(self, store: SessionStore) -> None:
        """Keys are scoped by session: the same key in another session is a new write."""
        a, b = store.create_session(tenant_id="acme"), store.create_session(tenant_id="acme")
        store.append(a.id, [_msg(1)], idempotency_key="k")
        assert store.append(b.id, [_msg(2)], idempotency_key="k").replayed is False

    def test_idempotency_record_commits_with_the_events(self, store: SessionStore) -> None:
        s = store.create_session(tenant_id="acme")
        with pytest.raises(InvalidEvent):
            store.append(s.id, [_msg(1), {"no": "type"}], idempotency_key="k-bad")
        with store.engine.connect() as conn:
            assert conn.execute(select(func.count()).select_from(WriteRow)).scalar_one() == 0
        assert store.append(s.id, [_msg(1)], idempotency_key="k-bad").replayed is False

    # bad input (invariant 8) ----------------------------------------------------------

    @pytest.mark.parametrize(
        ("event", "field", "reason"),
        [
            ("not an object", "", "JSON object"),
            ({"message": "no type"}, "/type", "missing"),
            ({"type": 7}, "/type", "string"),
            ({"type": ""}, "/type", "characters"),
            ({"type": "m", "x": math.nan}, "/x", "not a JSON number"),
            ({"type": "m", "x": [1, math.inf]}, "/x/1", "not a JSON number"),
            ({"type": "m", "blob": b"raw"}, "/blob", "bytes is not a JSON value"),
            ({"type": "m", "tags": {"a", "b"}}, "/tags", "set is not a JSON value"),
            ({"type": "m", "a/b": {1: "x"}}, "/a~1b", "not a string"),
            ({"type": "m", "s": "bad \ud800 surrogate"}, "/s", "Unicode"),
            ({"type": "m", "k\x00": 1}, "/k\x00", "U+0000"),
        ],
    )
    def test_bad_input_is_rejected_naming_the_field(
        self, store: SessionStore, event: Any, field: str, reason: str
    ) -> None:
        s = store.create_session(tenant_id="acme")
        with pytest.raises(InvalidEvent) as info:
            store.append(s.id, [_msg(0), event])
        assert info.value.field == field and reason in info.value.reason
        assert info.value.index == 1
        assert store.read(s.id) == [] and store.get_session(s.id).head_seq == 0

    def test_nesting_limit(self, store: SessionStore) -> None:
        s = store.create_session(tenant_id="acme")
        limit = store.settings.max_event_depth
        ok: dict[str, Any] = {"type": "m"}
        node = ok
        for _ in range(limit - 1):
            node["x"] = {}
            node = node["x"]
        store.append(s.id, [ok])
        node["x"] = {}
        with pytest.raises(InvalidEvent, match="deeper than the limit"):
            store.append(s.id, [ok])
        assert store.get_session(s.id).head_seq == 1

    def test_batch_limits(self, store: SessionStore) -> None:
        s = store.create_session(tenant_id="acme")
        too_many = [_msg(i) for i in range(store.settings.max_batch_events + 1)]
        with pytest.raises(InvalidEvent, match="exceeds the limit"):
            store.append(s.id, too_many)
        with pytest.raises(InvalidEvent, match="at least one"):
            store.append(s.id, [])
        with pytest.raises(InvalidEvent, match="list of objects"):
            store.append(s.id, _msg(1))  # type: ignore[arg-type]
        assert _count_events(store) == 0

    # concurrency (invariants 3 and 4) -------------------------------------------------

    def test_threads_appending_to_one_session_get_gapless_seqs(self, store: SessionStore) -> None:
        s = store.create_session(tenant_id="acme")
        start = threading.Barrier(8)
        errors: list[BaseException] = []

        def writer() -> None:
            start.wait()
            try:
                for i in range(500):
                    store.append(s.id, [_msg(i)])
            except BaseException as exc:  # surfaced by the assertion below
                errors.append(exc)

        threads = [threading.Thread(target=writer) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert [e.seq for e in store.read(s.id)] == list(range(1, 4001))

    def test_processes_appending_to_one_session_get_gapless_seqs(
        self, store: SessionStore, url: str, tmp_path: Path
    ) -> None:
        s = store.create_session(tenant_id="acme")
        start = MP.Event()
        procs = [
            MP.Process(target=_append_many, args=(url, str(tmp_path), s.id, 1000, start))
            for _ in range(4)
        ]
        for p in procs:
            p.start()
        start.set()
        for p in procs:
            p.join(300)
        assert [p.exitcode for p in procs] == [0, 0, 0, 0]
        assert [e.seq for e in store.read(s.id)] == list(range(1, 4001))

    def test_racing_expected_seq_has_exactly_one_winner(self, store: SessionStore) -> None:
        s = store.create_session(tenant_id="acme")
        store.append(s.id, [_msg(0)])
        start = threading.Barrier(10)
        wins: list[int] = []
        conflicts: list[ConcurrencyConflict] = []

        def writer(i: int) -> None:
            start.wait()
            try:
                wins.append(store.append(s.id, [_msg(i), _msg(i)], expected_seq=1).last_seq)
            except ConcurrencyConflict as exc:
                conflicts.append(exc)

        threads = [threading.Thread(target=writer, args=(i,)) for i in range(10)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert wins == [3] and len(conflicts) == 9
        assert all(c.current_seq == 3 and c.expected_seq == 1 for c in conflicts)

    def test_follower_sees_every_event_once_in_position_order(self, store: SessionStore) -> None:
        # Sleep inside each write transaction, after its inserts and before its commit: if
        # positions could commit out of order, the follower would skip the slower one.
        rng = random.Random(4)

        @event.listens_for(store.engine, "commit")
        def _slow_commit(conn: Any) -> None:
            time.sleep(rng.uniform(0, 0.002))

        sessions = [store.create_session(tenant_id="acme").id for _ in range(4)]
        per_writer, done = 600, threading.Event()
        seen: list[int] = []

        def writer(session_id: str) -> None:
            for i in range(per_writer // 3):
                store.append(session_id, [_msg(i), _msg(i), _msg(i)])

        def follower() -> None:
            last = 0
            while True:
                finished = done.is_set()
                page = store.read_all(after_position=last, limit=200)
                seen.extend(e.position for e in page)
                if page:
                    last = page[-1].position
                elif finished:
                    return

        tail = threading.Thread(target=follower)
        tail.start()
        writers = [threading.Thread(target=writer, args=(sid,)) for sid in sessions]
        for t in writers:
            t.start()
        for t in writers:
            t.join()
        done.set()
        tail.join()
        all_positions = [e.position for e in store.read_all(limit=10_000)]
        assert len(all_positions) == 4 * per_writer
        assert seen == all_positions  # every event, once, in position order

    @pytest.mark.parametrize("first", ["append", "fork"])
    def test_a_writer_held_before_its_commit_holds_back_later_positions(
        self, store: SessionStore, first: str
    ) -> None:
        """Deterministic invariant 4: while one write (a transactional append, or a fork's
        copied rows) sits between its inserts and its commit, another append cannot commit a
        later position; a follower polling then and after sees every event."""
        a = store.create_session(tenant_id="acme")
        b = store.create_session(tenant_id="acme")
        store.append(a.id, [_msg(0)])
        start = store.read_all()[-1].position
        target = threading.get_ident()
        held: list[threading.Thread] = []
        seen: list[int] = []

        @event.listens_for(store.engine, "commit")
        def _hold(conn: Any) -> None:
            if threading.get_ident() != target or held:
                return
            other = threading.Thread(target=store.append, args=(b.id, [_msg(2)]))
            held.append(other)
            other.start()
            other.join(timeout=1.0)  # long enough to commit, were it not held back
            seen.extend(e.position for e in store.read_all(after_position=start))

        if first == "append":  # ``before`` makes it a transaction on every backend
            prepared = store._writer.prepare([_msg(1)])
            store.journal.append(a.id, prepared, before=lambda conn: ())
        else:
            store.fork(a.id)
        event.remove(store.engine, "commit", _hold)
        assert held
        held[0].join()
        last = seen[-1] if seen else start
        later = [e.position for e in store.read_all(after_position=last)]
        everything = [e.position for e in store.read_all(after_position=start)]
        assert len(everything) == 2  # a's new event (or the fork's copy of seq 1), b's
        assert seen + later == everything

    # append-only (invariant 1) --------------------------------------------------------

    def test_no_code_path_updates_or_deletes_single_events(
        self, store: SessionStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        statements: list[str] = []

        @event.listens_for(store.engine, "before_cursor_execute")
        def _record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
            statements.append(statement.upper())

        # PostgreSQL's append runs on the driver's cursor, unseen by SQLAlchemy's events
        appended: list[str] = []
        real_run_append = journal_module.run_append

        def _run_append(conn: Any, keyed: bool, refs: bool, params: Any) -> Any:
            appended.append(PG_APPEND[keyed, refs].upper())
            return real_run_append(conn, keyed, refs, params)

        monkeypatch.setattr(journal_module, "run_append", _run_append)

        s = store.create_session(tenant_id="acme")
        store.append(s.id, [_msg(1)])
        store.append(s.id, [_msg(2)], idempotency_key="k")
        store.append(s.id, [_msg(2)], idempotency_key="k")
        store.read(s.id)
        store.read_all()
        # every other path that touches a session's events: fork (and its copy), move,
        # state with snapshots, export, import, stats, GC and expiry
        fork = store.fork(s.id)
        store.copy_fork_artifacts(fork.id)
        store.append(fork.id, [_msg(3)])
        store.move(s.id, tenant_id="globex", cwd="/elsewhere")
        with SessionStore.from_settings(
            store.settings.model_copy(update={"snapshot_every": 1})
        ) as snapshotting:
            snapshotting.state(s.id)
            snapshotting.state(fork.id, at_seq=1)
        store.export_session(fork.id, io.StringIO())
        store.import_session(FIXTURES / "v3.jsonl", tenant_id="acme")
        store.stats()
        store.gc_blobs(apply=True, grace=0)
        store.expire_artifacts(apply=True)
        if store.engine.dialect.name == "postgresql":
            assert len(appended) >= 5  # the journal's appends, the import's too
        statements += appended
        touching = [q for q in statements if ("UPDATE EVENTS" in q or "DELETE FROM EVENTS" in q)]
        assert touching == []
        # the one statement that deletes events takes a whole session's: no seq, no position
        store.delete_session(fork.id)
        deletes = [q for q in statements if "DELETE FROM EVENTS" in q]
        assert len(deletes) == 1 and "SESSION_ID" in deletes[0], deletes
        assert not any(word in deletes[0] for word in ("SEQ", "POSITION", " OR ", " IN ")), deletes
        assert not any("UPDATE EVENTS" in q for q in statements)
        assert [e.seq for e in store.read(s.id)] == [1, 2]

    # numbered writes (an import's batches, keyed by their first file event) ------------

    def test_the_latest_numbered_write_below_a_number(self, store: SessionStore) -> None:
        """Of the keys ``prefix<n>``, the latest write (by first_seq) whose n is below the
        bound, with n: numbers compare as numbers (9 < 10); a key with other text after the
        prefix (not a number, a leading zero), another prefix or session is none of them."""
        s, other = (store.create_session(tenant_id="acme") for _ in range(2))
        prefix = "sessionstore.import:"
        keys = ["0", "9", None, "x", "10", "011", "12", "1\n", "1%"]
        for n, key in enumerate(keys):
            named = "other:5" if key is None else prefix + key
            store.append(s.id, [_msg(n)], idempotency_key=named)
        store.append(other.id, [_msg()], idempotency_key=f"{prefix}11")

        def latest(below: int) -> tuple[int, int] | None:
            found = store.journal.latest_numbered_write(s.id, prefix, below=below)
            return None if found is None else (found[0], found[1].first_seq)

        assert [latest(b) for b in (0, 1, 9, 10, 11, 12, 13, 10**30)] == [
            None,
            (0, 1),
            (0, 1),
            (9, 2),
            (10, 5),  # not 011 (seq 6) nor x (seq 4)
            (10, 5),  # not the other session's 11
            (12, 7),  # not 1\n (seq 8) nor 1% (seq 9)
            (12, 7),
        ]


class TestSQLiteJournal(JournalContract):
    @pytest.fixture
    def url(self, sqlite_url: str) -> str:
        return sqlite_url

    def test_wal_mode_and_busy_timeout(self, store: SessionStore) -> None:
        with store.engine.connect() as conn:
            assert conn.execute(text("PRAGMA journal_mode")).scalar() == "wal"
            assert conn.execute(text("PRAGMA busy_timeout")).scalar() == 60000


@pytest.mark.postgres
class TestPostgresJournal(JournalContract):
    @pytest.fixture
    def url(self, pg_url: str) -> str:
        return pg_url

    def test_payload_is_exact_json_text(self, store: SessionStore) -> None:
        s = store.create_session(tenant_id="acme")
        store.append(s.id, [{"type": "message", "message": {"role": "assistant"}}])
        with store.engine.connect() as conn:
            role = conn.execute(
                text("SELECT payload->'message'->>'role' FROM events WHERE session_id = :s"),
                {"s": s.id},
            ).scalar()
            kind = conn.execute(
                text("SELECT pg_typeof(payload)::text FROM events LIMIT 1")
            ).scalar()
        assert (role, kind) == ("assistant", "json")  # the text as written (migration 0009)

    def test_a_streamed_read_is_the_whole_read(
        self, store: SessionStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Reads come in chunks of rows, decoded as they arrive; every window, across chunk
        boundaries and with TOASTed payloads among small ones, is what one fetch gives."""
        from core.journal import postgres

        assert postgres._chunked(), "this libpq has no chunked rows mode: the test is moot"
        s = store.create_session(tenant_id="acme")
        rng = random.Random(19)
        events = [_msg(i, text="x" * rng.choice((0, 10, 5000, 15_000, 70_000))) for i in range(300)]
        store.append(s.id, events)
        windows = [(0, None, None), (63, 129, None), (1, None, 64), (250, None, 1), (299, None, 5)]
        streamed = [store.read(s.id, after_seq=a, upto_seq=u, limit=n) for a, u, n in windows]
        monkeypatch.setattr(postgres, "_chunked", lambda: False)
        whole = [store.read(s.id, after_seq=a, upto_seq=u, limit=n) for a, u, n in windows]
        assert streamed == whole
        assert [e.payload for e in store.read(s.id, rehydrate=True)] == events
        assert [len(w) for w in streamed] == [300, 66, 64, 1, 1]

    def test_the_latest_numbered_write_is_read_along_the_index(self, store: SessionStore) -> None:
        """The query reads the session's writes latest first along
        ``ix_writes_session_first_seq`` (migration 0024) and stops at the first that
        answers, whatever the session's number of writes; without the index PostgreSQL
        read every write of the session and sorted them."""
        with store.engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO sessions (id, tenant_id, head_seq, created_at, updated_at) "
                    "SELECT 's' || n, 'acme', 0, now(), now() FROM generate_series(1, 40) n"
                )
            )
            conn.execute(
                text(
                    "INSERT INTO writes (session_id, idempotency_key, first_seq, last_seq, "
                    "positions, created_at) SELECT 's' || (n % 40 + 1), "
                    "'sessionstore.import:' || n, n, n, '[]', now() "
                    "FROM generate_series(1, 20000) n"
                )
            )
            conn.execute(text("ANALYZE writes"))
        query = journal_module.numbered_write_query("s7", "sessionstore.import:", 15_000)
        compiled = query.compile(store.engine, compile_kwargs={"literal_binds": True})
        with store.engine.connect() as conn:
            plan = "\n".join(conn.execute(text(f"EXPLAIN {compiled}")).scalars())
        assert "Index Scan Backward using ix_writes_session_first_seq on writes" in plan, plan
        assert "Sort" not in plan, plan
        found = store.journal.latest_numbered_write("s7", "sessionstore.import:", below=15_000)
        assert found is not None and found[0] == 14_966  # the latest of s7's below 15000

    @pytest.mark.timeout(60)  # the defect it guards against is a hang
    def test_a_read_that_fails_mid_stream_leaves_its_connection_usable(
        self, store: SessionStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """An error while rows are still arriving: the query is cancelled and drained, the
        transaction rolled back, and the same pooled connection serves the next read."""
        from core.journal import postgres

        s = store.create_session(tenant_id="acme")
        store.append(s.id, [_msg(i, text="y" * 3000) for i in range(500)])
        backends = set()

        @event.listens_for(store.engine, "checkout")
        def _seen(dbapi_conn: Any, record: Any, proxy: Any) -> None:
            backends.add(dbapi_conn.info.backend_pid)

        real = postgres.StoredEvent

        def failing(*args: Any) -> Any:
            if args[1] == 70:  # the second chunk: the server is still sending
                raise RuntimeError("decoder failed")
            return real(*args)

        monkeypatch.setattr(postgres, "StoredEvent", failing)
        with pytest.raises(RuntimeError, match="decoder failed"):
            store.read(s.id)
        monkeypatch.setattr(postgres, "StoredEvent", real)
        assert [e.seq for e in store.read(s.id)] == list(range(1, 501))
        assert store.append(s.id, [_msg(501)]).first_seq == 501
        assert len(backends) == 1, backends  # not a new connection: the old one was sound


def test_a_closed_store_refuses_use_and_leaves_no_connection_behind(settings: Settings) -> None:
    """Used after ``close()``, a store used to open a fresh pool that nothing closed; the
    garbage collector then found its connections open, much later."""
    from core.errors import StoreClosed

    store = SessionStore.from_settings(settings)
    sid = store.create_session(tenant_id="acme").id
    store.close()
    with pytest.raises(StoreClosed, match="closed"):
        store.get_session(sid)
    with pytest.raises(StoreClosed):
        store.append(sid, [{"type": "custom", "data": 1}])
    store.close()  # closing twice is fine
    with SessionStore.from_settings(settings) as again:
        assert again.get_session(sid).id == sid
