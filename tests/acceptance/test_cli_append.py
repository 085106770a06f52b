"""``sessionstore append`` (and its neighbours) through the real CLI: a whole input checked
before any write, what committed said when a later write fails, option values refused as
usage errors, and no journal made for a mistyped data dir."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

from core import SessionStore, Settings
from core.errors import InvalidEvent
from tasks.cli.failures import ExitCode
from tests.acceptance.test_cli import data_dir, run, session_id
from tests.acceptance.test_cli_first_run import one_line_error

__all__ = ["data_dir", "session_id"]  # the fixtures, used by name


def _line(n: int) -> bytes:
    return json.dumps({"type": "custom", "n": n}).encode() + b"\n"


def _head(data_dir: Path, session_id: str) -> int:
    shown = json.loads(run(data_dir, "sessions", "show", session_id, "--json").stdout)
    return int(shown["head_seq"])


def test_a_bad_line_anywhere_in_the_input_writes_nothing(
    data_dir: Path, session_id: str, tmp_path: Path
) -> None:
    """Line 150 of 250 refused by the journal, or a byte that is not UTF-8 on line 250 of
    300: one error naming the file and line, and nothing written (the batches before it
    committed, unsaid, and a re-run after the fix duplicated them)."""
    refused = tmp_path / "refused.jsonl"
    refused.write_bytes(
        b"".join(_line(n) if n != 150 else b'{"type": 123}\n' for n in range(1, 251))
    )
    done = run(data_dir, "append", session_id, str(refused))
    one_line_error(done, ExitCode.BAD_INPUT, f"{refused} line 150", "/type")
    not_utf8 = tmp_path / "bytes.jsonl"
    not_utf8.write_bytes(
        b"".join(_line(n) if n != 250 else b'{"type":"x","s":"\xff"}\n' for n in range(1, 301))
    )
    done = run(data_dir, "append", session_id, str(not_utf8))
    one_line_error(done, ExitCode.BAD_INPUT, f"{not_utf8} line 250", "not UTF-8", "0xff")
    assert _head(data_dir, session_id) == 0


def test_a_write_failing_after_others_committed_says_which_did(
    data_dir: Path, session_id: str, tmp_path: Path
) -> None:
    """The database refuses the third batch: stderr and the --json document say batches
    1..100 and 101..200 committed and where the rest starts; the same command with the same
    --key, the database fine again, writes only the rest."""
    source = tmp_path / "events.jsonl"
    source.write_bytes(b"\n".join(_line(n) for n in range(1, 251)))  # a blank line each
    db = sqlite3.connect(
        Settings(data_dir=data_dir).resolved_database_url.removeprefix("sqlite:///")
    )
    with db:
        db.execute(
            "CREATE TRIGGER refuse BEFORE INSERT ON events WHEN NEW.payload LIKE '%\"n\":201%' "
            "BEGIN SELECT RAISE(ABORT, 'refused by the test'); END"
        )
    argv = ("append", session_id, str(source), "--key", "k", "--json")
    done = run(data_dir, *argv)
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    report = json.loads(done.stdout)
    assert report["complete"] is False
    assert [(w["first_seq"], w["last_seq"]) for w in report["committed"]] == [(1, 100), (101, 200)]
    assert report["resume_from_line"] == 401  # event 201, with a blank line after each
    assert "committed 200 events in 2 write(s)" in done.stderr, done.stderr
    assert "seq 1..200" in done.stderr and "same --key" in done.stderr
    with db:
        db.execute("DROP TRIGGER refuse")
    db.close()
    again = run(data_dir, *argv)
    assert again.returncode == 0, again.stderr
    assert [w["replayed"] for w in json.loads(again.stdout)] == [True, True, False]
    assert _head(data_dir, session_id) == 250


def test_idempotency_key_values(data_dir: Path, session_id: str) -> None:
    """An empty --key turned idempotency off (each run wrote again); a key too long for
    KEY:N was refused as an invalid event. Both are usage errors naming --key, up front."""
    events = "".join(_line(n).decode() for n in range(1, 6))
    for key, needle in (("", "must not be empty"), ("k" * 191, "at most 190 characters")):
        done = run(data_dir, "append", session_id, "-", "--key", key, stdin=events)
        assert done.returncode == int(ExitCode.USAGE), done.stderr
        assert "--key" in done.stderr and needle in done.stderr, done.stderr
    for _ in range(2):
        done = run(data_dir, "append", session_id, "-", "--key", "k" * 190, stdin=events)
        assert done.returncode == 0, done.stderr
    assert _head(data_dir, session_id) == 5
    assert "KEY:N" in run(data_dir, "append", "--help").stdout


def test_the_cli_key_limit_leaves_room_for_the_batch_suffix() -> None:
    """The CLI's --key limit is a literal (``--help`` loads no validation module): it is the
    journal's key limit less ":" and the nine digits of the largest batch number."""
    from core.journal.validation import MAX_KEY_LENGTH
    from tasks.cli.writes import MAX_APPEND_KEY_LENGTH

    assert MAX_APPEND_KEY_LENGTH == MAX_KEY_LENGTH - len(":") - len(str(10**9 - 1))


def test_option_values_out_of_range_are_usage_errors(data_dir: Path, session_id: str) -> None:
    """--expected-seq -1 and --batch-size above the batch limit were refused as invalid
    events (exit 3) by the journal; export --at-seq 0 was refused where state and fork
    take it."""
    one = '{"type": "x"}\n'
    for option, value in (
        ("--expected-seq", "-1"),
        ("--expected-seq", str(2**63)),
        ("--batch-size", "1001"),
    ):
        done = run(data_dir, "append", session_id, "-", option, value, stdin=one)
        assert done.returncode == int(ExitCode.USAGE), (option, value, done.stderr)
        assert option in done.stderr, done.stderr
    assert (
        run(data_dir, "append", session_id, "-", "--batch-size", "1000", stdin=one).returncode == 0
    )
    exported = run(data_dir, "export", session_id, "--at-seq", "0")
    assert exported.returncode == 0, exported.stderr
    assert [json.loads(line)["type"] for line in exported.stdout.splitlines()] == ["session"]


def test_dead_letters_export_to_stdout_is_only_the_lines(data_dir: Path, session_id: str) -> None:
    """`dead-letters export - --json` wrote a JSON summary after the lines on stdout (no
    longer JSON Lines), and a progress bar on a stderr that is no terminal."""
    with SessionStore.from_settings(Settings(data_dir=data_dir)) as store:
        store.dead_letters.record(
            idempotency_key="poison",
            session_id=session_id,
            events=[{"type": ["no"]}],
            expected_seq=None,
            error=InvalidEvent("/type", "must be a string, got list", index=0),
        )
    done = run(data_dir, "dead-letters", "export", "-", "--json")
    assert done.returncode == 0, done.stderr
    assert [json.loads(line)["idempotency_key"] for line in done.stdout.splitlines()] == ["poison"]
    assert done.stderr == ""
    plain = run(data_dir, "dead-letters", "export", "-")
    assert len(plain.stdout.splitlines()) == 1
    assert plain.stderr.strip() == "exported 1 dead letter(s)"


def test_a_mistyped_data_dir_gets_no_journal(tmp_path: Path) -> None:
    """`append` and `import` of a missing file made an empty journal in a data dir that did
    not exist, then said "session not found" or the file's error."""
    typo = tmp_path / "typo-dir"
    done = run(typo, "append", "18d93def-0287-4690-b506-80061eaa5fb7", "-", stdin='{"type":"x"}\n')
    one_line_error(done, ExitCode.DATABASE_MISSING, "no database at")
    done = run(typo, "import", str(tmp_path / "nonexist.jsonl"))
    assert done.returncode == int(ExitCode.BAD_INPUT), done.stderr
    assert "cannot read" in done.stderr
    assert not typo.exists()


def test_a_file_that_cannot_be_opened_is_named_with_why(
    data_dir: Path, session_id: str, tmp_path: Path
) -> None:
    """append of a missing file (or a directory) and dead-letters export into a missing
    directory said Python's "[Errno 2] No such file or directory: '...'": now what could
    not be read or written, and why, as import and export say it."""
    missing = tmp_path / "nonexist.jsonl"
    into = tmp_path / "no-such-dir" / "letters.jsonl"
    for args, said in (
        (["append", session_id, str(missing)], f"cannot read {missing}: No such file"),
        (["append", session_id, str(tmp_path)], f"cannot read {tmp_path}: Is a directory"),
        (["dead-letters", "export", str(into)], f"cannot write {into}: No such file"),
    ):
        error = one_line_error(run(data_dir, *args), ExitCode.BAD_INPUT, said)
        assert "Errno" not in error, error
    assert _head(data_dir, session_id) == 0


def test_dead_letters_export_publishes_its_file_whole(data_dir: Path, tmp_path: Path) -> None:
    """The export wrote into the file it was given as it went: a run that failed (here: no
    database) left an empty file under that name, over what was there. It is now written
    beside it and renamed over it once whole."""
    (tmp_path / "out").mkdir()
    kept = tmp_path / "out" / "letters.jsonl"
    kept.write_text("earlier export\n")
    done = run(tmp_path / "typo-dir", "dead-letters", "export", str(kept))
    one_line_error(done, ExitCode.DATABASE_MISSING, "no database at")
    assert kept.read_text() == "earlier export\n"
    assert [p.name for p in kept.parent.iterdir()] == ["letters.jsonl"]
    done = run(data_dir, "dead-letters", "export", str(kept))
    assert done.returncode == 0, done.stderr
    assert kept.read_text() == ""  # no dead letter: an empty file, whole
