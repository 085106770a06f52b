"""Acceptance tests: the real ``sessionstore`` executable in a subprocess, embedded defaults."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from core import SessionStore, Settings
from core.errors import InvalidEvent
from tasks.app import create_app
from tasks.producer import enqueue_append
from tests.cli_process import EXE, run_cli
from tests.support import clean_env, spawn, wait_for


def run(data_dir: Path, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, env=clean_env(data_dir), input=stdin)


def assert_user_error(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr and "Traceback" not in result.stdout
    for needle in needles:
        assert needle in result.stderr, result.stderr


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "data"
    assert run(folder, "db", "upgrade").returncode == 0
    return folder


@pytest.fixture
def session_id(data_dir: Path) -> str:
    with SessionStore.from_settings(Settings(data_dir=data_dir)) as store:
        return store.create_session(tenant_id="acme").id


def _jsonl(*events: object) -> str:
    return "".join(json.dumps(e) + "\n" for e in events)


@pytest.mark.smoke
def test_db_commands(data_dir: Path) -> None:
    assert run(data_dir, "db", "check").returncode == 0
    current = json.loads(run(data_dir, "db", "current", "--json").stdout)
    assert current["current"] == current["head"] is not None


def test_bad_values_for_db_and_worker_are_one_line_not_a_traceback(data_dir: Path) -> None:
    """A revision Alembic cannot find (exit 3, naming it), a port out of range (usage, exit
    2): each was a 56-100 line traceback."""
    for argv in (["db", "upgrade", "nosuch"], ["db", "downgrade", "nosuch", "--yes"]):
        done = run(data_dir, *argv)
        assert done.returncode == 3, (argv, done.stderr)
        assert_user_error(done, "revision", "nosuch")
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    for port in ("99999", "0", "-1"):
        done = run(data_dir, "worker", "--metrics-port", port)
        assert done.returncode == 2, (port, done.stderr)
        assert_user_error(done, "--metrics-port")


def test_a_question_is_asked_on_stderr_and_no_answer_is_a_usage_error(
    data_dir: Path, session_id: str
) -> None:
    """Without --yes: the question goes to stderr (it was on stdout, breaking --json), a
    piped answer counts, and no answer at all (stdin closed: a script) is exit 2 saying to
    pass --yes, nothing done (it was "Aborted!", exit 1)."""
    argv = ("sessions", "delete", session_id, "--json")
    for stdin in ("", "n\n"):
        done = run(data_dir, *argv, stdin=stdin)
        assert done.stdout == "" and "delete session" in done.stderr, done
        if stdin:
            assert done.returncode == 1  # answered no
        else:
            assert done.returncode == 2 and "pass --yes" in done.stderr, done.stderr
    assert run(data_dir, "sessions", "show", session_id).returncode == 0  # still there
    done = run(data_dir, *argv, stdin="y\n")
    assert done.returncode == 0 and json.loads(done.stdout)["events"] == 0, done.stderr
    done = run(data_dir, "db", "downgrade", "base", stdin="")
    assert done.returncode == 2 and "pass --yes" in done.stderr
    assert run(data_dir, "db", "check").returncode == 0  # not downgraded
    closed = subprocess.run(  # descriptor 0 closed (a shell's <&-): Python's stdin is None
        [EXE, "dead-letters", "discard", "1"],
        env=clean_env(data_dir),
        stdin=None,
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=lambda: os.close(0),
    )
    assert closed.returncode == 2 and "pass --yes" in closed.stderr, closed.stderr


def test_an_argument_that_is_not_utf8_is_named_before_any_sql(
    data_dir: Path, session_id: str
) -> None:
    """A byte that is not UTF-8 in an id or a tenant (Python reads it as a lone surrogate):
    bad input naming the argument, on every command, where the database's codec error
    named neither ("invalid event at /: the database refused a value: 'utf-8' codec...")."""
    bad = os.fsdecode(b"x\xff")
    for argv, field in (
        (["sessions", "show", bad], "ref"),
        (["state", bad], "ref"),
        (["export", bad], "session_id"),
        (["sessions", "create", "--tenant", bad], "tenant_id"),
        (["stats", "--tenant", bad], "tenant_id"),
        (["events", "--tenant", bad], "tenant_id"),
        (["sessions", "list", "--tenant", bad], "tenant_id"),
    ):
        done = run(data_dir, *argv)
        assert done.returncode == 3, (argv, done.stderr)
        assert_user_error(done, f"invalid argument {field}: is not UTF-8 text")


def test_contradicting_or_unknown_options_are_usage_errors(data_dir: Path, tmp_path: Path) -> None:
    """Exit 2 before any work: import --format bogus failed each file (exit 1), and
    --expected-seq with --no-expected-seq was bad input (exit 3)."""
    source = tmp_path / "s.jsonl"
    source.write_text(_jsonl({"type": "session", "version": 3, "id": "s1"}))
    done = run(data_dir, "import", str(source), "--format", "bogus")
    assert done.returncode == 2 and "unknown format 'bogus'" in done.stderr, done.stderr
    done = run(data_dir, "dead-letters", "replay", "1", "--expected-seq", "3", "--no-expected-seq")
    assert done.returncode == 2 and "not both" in done.stderr, done.stderr


def test_append_from_file_and_stdin_then_read_back(
    data_dir: Path, session_id: str, tmp_path: Path
) -> None:
    source = tmp_path / "events.jsonl"
    source.write_text(_jsonl({"type": "message", "n": 1}, {"type": "label", "label": "x"}) + "\n")
    first = run(data_dir, "append", session_id, str(source), "--json")
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout)[0]["last_seq"] == 2
    second = run(data_dir, "append", session_id, "-", stdin=_jsonl({"type": "custom", "n": 3}))
    assert second.returncode == 0 and "seq 3..3" in second.stdout
    shown = json.loads(run(data_dir, "sessions", "show", session_id, "--json").stdout)
    assert shown["head_seq"] == 3
    listed = json.loads(run(data_dir, "sessions", "list", "--json").stdout)
    assert [s["id"] for s in listed["items"]] == [session_id]


@pytest.mark.smoke
def test_invalid_jsonl_line_names_its_line(data_dir: Path, session_id: str, tmp_path: Path) -> None:
    source = tmp_path / "bad.jsonl"
    source.write_text('{"type": "message"}\n{"type": "message"}\n{not json\n')
    assert_user_error(run(data_dir, "append", session_id, str(source)), "line 3", "not valid JSON")
    invalid = tmp_path / "invalid.jsonl"
    invalid.write_text('{"type": "message"}\n\n{"type": 7}\n')
    assert_user_error(run(data_dir, "append", session_id, str(invalid)), "line 3", "/type")
    shown = json.loads(run(data_dir, "sessions", "show", session_id, "--json").stdout)
    assert shown["head_seq"] == 0  # nothing of a rejected batch was written


def test_unknown_session_and_bad_urls_are_one_line_errors(data_dir: Path, session_id: str) -> None:
    assert_user_error(
        run(data_dir, "sessions", "show", "no-such-session"), "session not found: no-such-session"
    )
    for extra in ([], ["--enqueue"]):  # refused here, not dead-lettered by the queue
        done = run(data_dir, "append", "no-such-session", "-", *extra, stdin=_jsonl({"type": "m"}))
        assert done.returncode == 4, (extra, done.stderr)
        assert_user_error(done, "session not found")
    empty = run(data_dir, "append", "no-such-session", "-", stdin="")  # nothing to write, still
    assert empty.returncode == 4 and "session not found" in empty.stderr
    with SessionStore.from_settings(Settings(data_dir=data_dir)) as store:
        assert store.dead_letters.list() == []
    assert_user_error(
        run(data_dir, "read", "artifact://abc", "--session", session_id),
        "artifact:// ID must be numeric, got: abc",
    )
    assert_user_error(run(data_dir, "read", "ftp://x", "--session", session_id))
    assert_user_error(run(data_dir, "append", session_id, "/no/such/file.jsonl"), "No such file")


def test_usage_errors_exit_2_without_traceback(data_dir: Path) -> None:
    result = run(data_dir, "events", "--limit", "0")
    assert result.returncode == 2 and "Traceback" not in result.stderr


def test_enqueue_dead_letter_and_replay_through_the_cli(
    data_dir: Path, session_id: str, tmp_path: Path
) -> None:
    ok = run(
        data_dir, "append", session_id, "-", "--enqueue", stdin=_jsonl({"type": "message", "n": 1})
    )
    assert ok.returncode == 0, ok.stderr
    poison = run(
        data_dir,
        "append",
        session_id,
        "-",
        "--enqueue",
        stdin=_jsonl({"type": "message"}, {"type": ["not", "a", "string"]}),
    )
    assert_user_error(poison, "stdin line 2", "must be a string")  # refused at the door
    assert list((data_dir / "queue" / "in").glob("*")) == []  # nothing published
    with SessionStore.from_settings(Settings(data_dir=data_dir)) as store:  # as sent by name
        store.dead_letters.record(
            idempotency_key="poison",
            session_id=session_id,
            events=[{"type": "message"}, {"type": ["not", "a", "string"]}],
            expected_seq=None,
            error=InvalidEvent("/type", "must be a string, got list", index=1),
        )
    letters = json.loads(run(data_dir, "dead-letters", "list", "--json").stdout)
    assert len(letters) == 1 and letters[0]["error_type"] == "InvalidEvent"
    letter_id = str(letters[0]["id"])
    shown = json.loads(run(data_dir, "dead-letters", "show", letter_id, "--json").stdout)
    assert shown["events"][1] == {"type": ["not", "a", "string"]}
    fixed = tmp_path / "fixed.jsonl"
    fixed.write_text(_jsonl({"type": "message"}, {"type": "label", "label": "fixed"}))
    replay = run(data_dir, "dead-letters", "replay", letter_id, "--file", str(fixed), "--json")
    assert replay.returncode == 0, replay.stderr
    assert json.loads(replay.stdout)["last_seq"] == 3
    assert_user_error(run(data_dir, "dead-letters", "replay", letter_id), "no dead letter")
    assert (
        json.loads(run(data_dir, "sessions", "show", session_id, "--json").stdout)["head_seq"] == 3
    )


@pytest.mark.redis
def test_worker_and_beat_commands_run_celery_with_our_app(
    data_dir: Path, session_id: str, redis_url: str, tmp_path: Path
) -> None:
    env = clean_env(data_dir, SESSIONSTORE_BROKER_URL=redis_url, SESSIONSTORE_EXPIRE_SCHEDULE="1")
    log = tmp_path / "worker.log"
    with log.open("wb") as out:
        worker = spawn(
            [EXE, "worker", "--pool", "solo", "--without-mingle"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        beat = spawn([EXE, "beat"], env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        app = create_app(Settings(data_dir=data_dir, broker_url=redis_url))
        wait_for(lambda: bool(app.control.ping(timeout=0.5)), 60, "the worker to answer a ping")
        handle = enqueue_append(session_id, [{"type": "message", "n": 1}], app=app)
        assert handle.get(timeout=30).last_seq == 1
        wait_for(
            lambda: "sessionstore.expire_artifacts" in log.read_text(errors="replace"),
            60,
            "beat to send the expiry job",
        )
    finally:
        for proc in (beat, worker):
            proc.terminate()
            proc.wait(30)
