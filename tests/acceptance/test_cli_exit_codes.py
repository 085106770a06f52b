"""Exit codes and stderr lines of the real ``sessionstore`` executable (README: Exit codes),
from a CLI review: ``import`` failing each way, a reader gone from the pipe (``| head``),
an export to a directory that does not exist, bad option values, a session whose move is
pending, and lines piped to a script kept whole."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from core import SessionStore, Settings
from core.interop.watch import SessionFiles, session_files
from tests.cli_process import EXE, run_cli
from tests.pi_support import FIXTURES
from tests.support import as_a_user, clean_env, json_lines, spawn, unsearchable, wait_for

Run = Callable[..., subprocess.CompletedProcess[str]]
OMP_SESSIONS = Path(__file__).parents[1] / "fixtures" / "omp" / "agent" / "sessions"
DATABASE_DOWN = "postgresql+psycopg://127.0.0.1:1/nothing_listens_here"


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return clean_env(tmp_path / "data", HOME=str(tmp_path / "home"))


@pytest.fixture
def run(env: dict[str, str]) -> Run:
    def run(*args: str, **more_env: str) -> subprocess.CompletedProcess[str]:
        return run_cli(*args, env={**env, **more_env})

    return run


@pytest.fixture
def session_id(run: Run) -> str:
    """A session of the pi fixture (25 entries)."""
    done = run("import", str(FIXTURES / "v3.jsonl"), "--json")
    assert done.returncode == 0, done.stderr
    return str(json_lines(done.stdout)[0]["session_id"])


def _errors(done: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in done.stderr.splitlines() if line.startswith("error: ")]


def _one_line(done: subprocess.CompletedProcess[str]) -> str:
    """The one line on stderr, an ``error: ...`` line, no traceback and no usage block."""
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    return lines[0]


# --- import: each failure exits as classify() says ------------------------------------------


def test_import_of_a_bad_file_is_bad_input(run: Run, tmp_path: Path) -> None:
    """Exit 3 (it was 1: import chose its own code for everything but an unreadable path);
    a good file beside it is imported all the same."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"type": "nothing we know"}\n')
    done = run("import", str(bad), str(FIXTURES / "v3.jsonl"))
    assert done.returncode == 3, done.stderr
    assert _errors(done) == [
        f"error: invalid event at {bad}: not a session file of a known format"
    ], done.stderr
    assert "created:" in done.stdout


def test_import_of_a_missing_file_is_bad_input(run: Run, tmp_path: Path) -> None:
    done = run("import", str(tmp_path / "missing.jsonl"))
    assert done.returncode == 3, done.stderr
    assert (
        _one_line(done)
        == f"error: cannot read {tmp_path / 'missing.jsonl'}: No such file or directory"
    )


def test_import_watching_a_missing_directory_is_bad_input(
    env: dict[str, str], tmp_path: Path
) -> None:
    """Exit 3 naming the directory, as a missing file named is, before any import and
    without making a journal; --json gives its error object too. It was followed silently
    for ever (watchfiles passes over a path it cannot read, a missing one too)."""
    missing = tmp_path / "missing"
    named = tmp_path / "a.jsonl"
    shutil.copy(FIXTURES / "v3.jsonl", named)
    done = run_cli("import", str(named), "--watch", str(missing), env=env, timeout=30)
    assert done.returncode == 3, done.stderr
    assert _one_line(done) == f"error: cannot read {missing}: No such file or directory"
    assert done.stdout == "" and not Path(env["SESSIONSTORE_DATA_DIR"]).exists()
    done = run_cli("import", "--watch", str(missing), "--json", env=env, timeout=30)
    assert done.returncode == 3, done.stderr
    [found] = json_lines(done.stdout)
    assert (found["path"], found["status"]) == (str(missing), "error")
    assert found["error"] == f"cannot read {missing}: No such file or directory"
    assert _errors(done) == [f"error: cannot read {missing}: No such file or directory"]


def test_import_with_the_database_down_is_storage_unavailable(run: Run, tmp_path: Path) -> None:
    """Exit 6 with the database named and what to check, once: the run stops there (it
    was exit 1 and the same error for every file, without the hint)."""
    files = [str(FIXTURES / "v2.jsonl"), str(FIXTURES / "v3.jsonl")]
    done = run("import", *files, SESSIONSTORE_DATABASE_URL=DATABASE_DOWN)
    assert done.returncode == 6, done.stderr
    [line] = _errors(done)
    assert line.startswith("error: database unavailable: "), line
    assert "(check SESSIONSTORE_DATABASE_URL and that the database runs)" in line
    # --json: the file it stopped at has its error object; the code and the line are the same
    done = run("import", *files, "--json", SESSIONSTORE_DATABASE_URL=DATABASE_DOWN)
    assert done.returncode == 6, done.stderr
    [found] = json_lines(done.stdout)
    assert (found["path"], found["status"]) == (files[0], "error")
    assert found["error"].startswith("database unavailable: ")
    assert [x.startswith("error: database unavailable: ") for x in _errors(done)] == [True]


def test_import_with_a_bad_setting_is_bad_config(run: Run) -> None:
    done = run("import", str(FIXTURES / "v3.jsonl"), SESSIONSTORE_DATABASE_URL="nosuch://")
    assert done.returncode == 5, done.stderr
    assert _one_line(done).startswith("error: bad setting database_url: ")


def test_import_of_a_changed_file_is_a_failure(run: Run, tmp_path: Path) -> None:
    """An ImportConflict (the imported part of the file changed): exit 1, as classify says."""
    copy = tmp_path / "v3.jsonl"
    shutil.copy(FIXTURES / "v3.jsonl", copy)
    assert run("import", str(copy)).returncode == 0
    lines = copy.read_text().splitlines()
    entry = json.loads(lines[3])
    entry["id"] = "changed"
    copy.write_text("\n".join([*lines[:3], json.dumps(entry), *lines[4:]]) + "\n")
    done = run("import", str(copy))
    assert done.returncode == 1, done.stderr
    assert len(_errors(done)) == 1, done.stderr
    # --json names the session that holds the file (its ids were null): nothing written
    first = json.loads(run("import", str(FIXTURES / "v3.jsonl"), "--json").stdout)
    conflict = json.loads(run("import", str(copy), "--json").stdout)
    assert (conflict["status"], conflict["appended"]) == ("error", 0)
    assert (conflict["session_id"], conflict["external_id"]) == (
        first["session_id"],
        first["external_id"],
    )
    assert conflict["session_id"] is not None


def test_a_directory_that_cannot_be_searched_is_reported_and_the_run_goes_on(
    env: dict[str, str], tmp_path: Path
) -> None:
    """A file below a directory listed but not searchable cannot even be looked at: it is
    reported unreadable (exit 3, as a file that cannot be read) and the others are imported
    (``Path.is_file`` raised, outside any file's handling, and nothing was imported)."""
    sessions = tmp_path / "sessions"
    (sessions / "locked").mkdir(parents=True)
    shutil.copy(FIXTURES / "v3.jsonl", sessions / "ok.jsonl")
    shutil.copy(FIXTURES / "v2.jsonl", sessions / "locked" / "x.jsonl")
    with unsearchable(sessions / "locked", 0o644):
        done = _as_a_user(env, "import", str(sessions), "--json")
    assert done.returncode == 3, done.stderr
    records = {r["path"]: r for r in json_lines(done.stdout)}
    assert records[str(sessions / "ok.jsonl")]["status"] == "created"
    failed = records[str(sessions / "locked" / "x.jsonl")]
    assert failed["status"] == "error" and "Permission denied" in str(failed["error"])


def test_a_directory_that_cannot_be_listed_is_reported_and_the_run_goes_on(
    env: dict[str, str], tmp_path: Path
) -> None:
    """A directory that cannot be listed (mode 000, or 0311: searchable, not readable) is
    named with exit 3, as a file that cannot be read is, in text and --json, and the others
    are imported. ``Path.rglob`` passed over it without a word: exit 0, its files unseen."""
    sessions = tmp_path / "sessions"
    closed, unlisted = sessions / "closed", sessions / "deep" / "unlisted"
    for directory in (closed, unlisted):
        directory.mkdir(parents=True)
        shutil.copy(FIXTURES / "v2.jsonl", directory / "x.jsonl")
    shutil.copy(FIXTURES / "v3.jsonl", sessions / "ok.jsonl")
    with unsearchable(closed, 0o000), unsearchable(unlisted, 0o311):
        as_json = _as_a_user(env, "import", str(sessions), "--json")
        as_text = _as_a_user(env, "import", str(sessions))
    assert as_json.returncode == 3, as_json.stderr
    records = {r["path"]: r for r in json_lines(as_json.stdout)}
    assert records[str(sessions / "ok.jsonl")]["status"] == "created"
    for directory in (closed, unlisted):
        assert records[str(directory)]["status"] == "error"
        assert str(records[str(directory)]["error"]).startswith(
            f"cannot list {directory}: Permission denied"
        )
    assert len(records) == 3, as_json.stdout
    assert as_text.returncode == 3, as_text.stderr
    assert sorted(_errors(as_text)) == [
        f"error: cannot list {d}: Permission denied (its session files are not imported)"
        for d in (closed, unlisted)
    ], as_text.stderr
    assert "unchanged:" in as_text.stdout


@pytest.mark.parametrize("pattern", ["*/x.jsonl", "**/*.jsonl", "*/*/*.jsonl"])
def test_a_directory_a_glob_cannot_list_is_reported_and_the_run_goes_on(
    env: dict[str, str], tmp_path: Path, pattern: str
) -> None:
    """The same for a glob: a directory it had to list and could not is named with exit 3
    (its files are not imported), the files it matched elsewhere are. ``glob.glob`` passed
    over it without a word: exit 0, its files unseen."""
    sessions = tmp_path / "sessions"
    depth = pattern.count("/")
    closed = sessions / "closed" if depth == 1 else sessions / "a" / "closed"
    readable = sessions / ("b" if depth == 1 else "a/b")
    for directory in (closed, readable):
        directory.mkdir(parents=True)
        shutil.copy(FIXTURES / "v2.jsonl", directory / "x.jsonl")
    closed_mode = 0o311 if pattern.startswith("**") else 0o000
    with unsearchable(closed, closed_mode):
        done = _as_a_user(env, "import", str(sessions / pattern), "--json")
    assert done.returncode == 3, (done.stdout, done.stderr)
    records = {r["path"]: r for r in json_lines(done.stdout)}
    assert records[str(readable / "x.jsonl")]["status"] == "created"
    assert records[str(closed)]["status"] == "error", records
    assert str(records[str(closed)]["error"]).startswith(f"cannot list {closed}: Permission")
    assert len(records) == 2, done.stdout


@pytest.mark.parametrize("pattern", ["*/*/x.jsonl", "*/*/*.jsonl"])
def test_a_directory_a_glob_lists_but_cannot_enter_is_reported(
    env: dict[str, str], tmp_path: Path, pattern: str
) -> None:
    """A directory listed but not searchable (0644) where the glob goes on below it: glob
    sees its sub-directories and cannot enter them, without a word. Named, exit 3."""
    sessions = tmp_path / "sessions"
    closed = sessions / "a"
    for directory in (closed / "sub", sessions / "b" / "sub"):
        directory.mkdir(parents=True)
        shutil.copy(FIXTURES / "v2.jsonl", directory / "x.jsonl")
    with unsearchable(closed, 0o644):
        done = _as_a_user(env, "import", str(sessions / pattern), "--json")
    assert done.returncode == 3, (done.stdout, done.stderr)
    records = {r["path"]: r for r in json_lines(done.stdout)}
    assert records[str(sessions / "b" / "sub" / "x.jsonl")]["status"] == "created"
    assert str(records[str(closed)]["error"]).startswith(f"cannot list {closed}: Permission")
    assert len(records) == 2, done.stdout


def test_a_glob_step_that_finds_no_match_is_no_error(tmp_path: Path) -> None:
    """Only a refusal is reported: a literal name too long, or holding a NUL (the API's
    callers), is no match, as glob takes it."""
    (tmp_path / "a").mkdir()
    for pattern in (f"{tmp_path}/*/{'n' * 300}.jsonl", f"{tmp_path}/*/x\x00.jsonl"):
        found = session_files([pattern])
        assert found == SessionFiles([], []), pattern


def _as_a_user(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """The CLI run without root's power over file modes (``as_a_user``)."""
    return subprocess.run(
        as_a_user([EXE, *args]), env=env, capture_output=True, text=True, timeout=120, check=False
    )


# --- a session whose move is pending --------------------------------------------------------


def test_a_pending_move_says_so_and_how_it_completes(
    run: Run, env: dict[str, str], tmp_path: Path
) -> None:
    """SessionMoving is not "artifact store unavailable (check SESSIONSTORE_ARTIFACT_URL
    ...)": it names the session, that it is being moved, and what completes the move; the
    code stays 6 (transient: retry), and ``sessions repair SESSION`` repairs that one."""
    sessions = tmp_path / "agent" / "sessions"
    shutil.copytree(OMP_SESSIONS, sessions)
    [session_file] = sessions.glob("*/*.jsonl")
    artifacts = session_file.with_suffix("")
    aside = tmp_path / "aside"
    artifacts.rename(aside)  # imported first without its artifacts: the session exists
    first = run("import", str(session_file), "--json")
    assert first.returncode == 0, first.stderr
    sid = json_lines(first.stdout)[0]["session_id"]
    with SessionStore.from_settings(Settings(data_dir=Path(env["SESSIONSTORE_DATA_DIR"]))) as s:
        s._moves._record_intent(sid, "globex", None)  # a move a crash left at its intent
    aside.rename(artifacts)  # its artifacts now: written to the session under the move

    done = run("import", str(session_file))
    assert done.returncode == 6, done.stderr
    [line] = _errors(done)
    assert f"session {sid} is being moved" in line, line
    assert f"`sessionstore sessions repair {sid}`" in line, line
    assert "SESSIONSTORE_ARTIFACT_URL" not in line and "artifact store" not in line, line

    repaired = run("sessions", "repair", sid, "--json")
    assert repaired.returncode == 0, repaired.stderr
    assert [r["session_id"] for r in json.loads(repaired.stdout)["repaired"]] == [sid]
    assert run("import", str(session_file)).returncode == 0


# --- a reader gone from the pipe: silent exit 141 -------------------------------------------


def _into_closed_pipe(env: dict[str, str], cwd: Path, *args: str) -> tuple[int, str]:
    """Run the executable with stdout a pipe whose reader is gone (``| head`` after it
    read): its exit status and stderr."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run(
            [EXE, *args],
            stdout=write_end,
            stderr=subprocess.PIPE,
            env=env,
            cwd=cwd,
            timeout=120,
            text=True,
        )
    finally:
        os.close(write_end)
    return done.returncode, done.stderr


@pytest.mark.parametrize(
    "argv",
    [
        ("events", "--limit", "1000"),
        ("events", "--limit", "1000", "-o", "jsonl"),
        ("events", "--json"),
        ("export", "{sid}"),
        ("export", "{sid}", "-o", "-"),
        ("sessions", "list"),
        ("sessions", "list", "--json"),
        ("state", "{sid}"),
        ("--help",),
    ],
)
def test_a_closed_pipe_is_a_silent_exit_141(
    env: dict[str, str], session_id: str, argv: tuple[str, ...], tmp_path: Path
) -> None:
    """128 + SIGPIPE and nothing on stderr, as other Unix tools (it was exit 1, or 120 and
    "Exception ignored ... BrokenPipeError" when the output was small)."""
    args = [a.replace("{sid}", session_id) for a in argv]
    assert _into_closed_pipe(env, tmp_path, *args) == (141, "")


def test_a_warning_into_a_closed_stderr_is_dropped(
    env: dict[str, str], session_id: str, tmp_path: Path
) -> None:
    """A warning logged while stderr is a pipe whose reader is gone: the line is dropped
    and the command goes on (a review's finding: the CLI's log handler let the EPIPE end
    the command, exit 141 with nothing on stdout, where the stats were printed before)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run(
            [EXE, "stats", "--json"],
            stdout=subprocess.PIPE,
            stderr=write_end,
            env={**env, "SESSIONSTORE_DATABSE_URL": "x"},  # a mistyped variable: a warning
            cwd=tmp_path,
            timeout=120,
            text=True,
        )
    finally:
        os.close(write_end)
    assert done.returncode == 0
    assert json.loads(done.stdout)["events"] > 0


@pytest.fixture
def big_session(run: Run, tmp_path: Path) -> str:
    """A session whose JSON listing is far larger than a pipe holds (64 KB): 2,000 user
    messages of 200 characters."""
    header = {"type": "session", "version": 3, "id": "big", "timestamp": "2026-01-01T00:00:00Z"}
    message = {"role": "user", "content": "x" * 200, "timestamp": 1}
    lines = [json.dumps({**header, "cwd": "/"})]
    for i in range(2000):
        parent = f"m{i - 1}" if i else None
        entry = {"type": "message", "id": f"m{i}", "parentId": parent, "message": message}
        lines.append(json.dumps({**entry, "timestamp": "2026-01-01T00:00:01.000Z"}))
    path = tmp_path / "big.jsonl"
    path.write_text("\n".join(lines) + "\n")
    done = run("import", str(path))
    assert done.returncode == 0, done.stderr
    return "big"


@pytest.mark.parametrize("unbuffered", ["1", ""])
@pytest.mark.parametrize(
    "argv",
    [("events", "--limit", "2000", "--json"), ("events", "--limit", "1000"), ("export", "big")],
)
def test_a_reader_leaving_in_the_middle_of_one_large_write_is_exit_141(
    env: dict[str, str], big_session: str, argv: tuple[str, ...], unbuffered: str
) -> None:
    """``| head -c 10`` on a document written at once (1.4 MB of JSON, a table): the write
    returns the 64 KB the pipe took, and Python's unbuffered stdout (PYTHONUNBUFFERED, as
    container images set it) dropped the rest in silence, exit 0 (a review's finding; fails
    before). Its buffered stdout, which writes the rest and meets the EPIPE, is kept so."""
    command = " ".join(shlex.quote(a) for a in (EXE, *argv))
    script = f"{command} | head -c 10 >/dev/null; echo ${{PIPESTATUS[0]}}"
    more = {"PYTHONUNBUFFERED": unbuffered} if unbuffered else {}
    base = {k: v for k, v in env.items() if k != "PYTHONUNBUFFERED"}
    done = subprocess.run(
        ["bash", "-c", script],
        env={**base, **more},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert (done.stdout.strip(), done.stderr) == ("141", "")


def test_a_closed_stdout_is_one_line_and_exit_3(env: dict[str, str], session_id: str) -> None:
    """Started with descriptor 1 closed (``>&-``): one line, exit 3 (an output that cannot
    be written), before any file is opened (the first would get descriptor 1). Was a
    traceback and exit 1."""
    script = f"{shlex.quote(EXE)} sessions list >&-; echo $? >&2"
    done = subprocess.run(
        ["bash", "-c", script], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    *lines, status = done.stderr.splitlines()
    assert status == "3", done.stderr
    assert lines == ["error: standard output is closed (redirect it: `> FILE`, `| ...`)"]


@pytest.mark.parametrize(
    ("argv", "started"),
    [(("worker", "--pool", "solo", "--without-mingle"), " ready."), (("beat",), "Starting...")],
)
def test_a_daemon_runs_with_its_stdout_closed(
    env: dict[str, str], tmp_path: Path, argv: tuple[str, ...], started: str
) -> None:
    """A worker or beat, whose output is its log (Celery redirects stdout), runs with
    descriptor 1 closed as it always did (a review's finding: the first fix refused it),
    descriptor 1 on /dev/null so that no file it opens gets it."""
    log = tmp_path / "daemon.log"
    command = " ".join(shlex.quote(a) for a in (EXE, *argv))
    with log.open("wb") as err:
        proc = spawn(["bash", "-c", f"exec {command} >&-"], env=env, stderr=err)
    try:
        wait_for(lambda: started in log.read_text(errors="replace"), 60, f"{argv[0]} to start")
        assert proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(30)
    assert "standard output is closed" not in log.read_text(errors="replace")


def test_a_worker_that_gives_up_exits_non_zero(run: Run, env: dict[str, str]) -> None:
    """``sessionstore worker`` exits with the status of Celery's worker, which
    ``tasks.worker`` makes non-zero for a stop nobody asked for (here: the embedded broker's
    claims folder is a file, an "Unrecoverable error"). It exited 0 (a probe's finding:
    ``app.worker_main`` drops the status), and a supervisor restarting only failed
    processes left the worker dead."""
    assert run("db", "upgrade").returncode == 0
    queue = Path(env["SESSIONSTORE_DATA_DIR"]) / "queue"
    queue.mkdir()
    (queue / "claimed").write_text("")
    done = run_cli("worker", "--pool", "solo", "--without-mingle", env=env)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "Unrecoverable error" in done.stderr


def test_a_journal_file_that_is_not_a_database_is_bad_config(
    env: dict[str, str], tmp_path: Path
) -> None:
    """The embedded journal's path holding another kind of file: one line naming it, exit 5
    (a traceback and exit 1 before, a review's finding); the file is left as it was."""
    data = Path(env["SESSIONSTORE_DATA_DIR"])
    data.mkdir(parents=True)
    (data / "journal.db").write_bytes(b"not a database\n" * 100)
    for args in (("sessions", "list"), ("stats", "--json"), ("import", str(FIXTURES / "v3.jsonl"))):
        done = run_cli(*args, env=env)
        assert done.returncode == 5, (args, done.stderr)
        line = _one_line(done)
        assert f"{data / 'journal.db'} is not a SQLite database" in line, line
    assert (data / "journal.db").read_bytes() == b"not a database\n" * 100


# --- export to a path that cannot be written ------------------------------------------------


def test_export_to_a_missing_directory_names_the_path_given(
    env: dict[str, str], session_id: str, tmp_path: Path
) -> None:
    """Not ``.out.jsonl.4fs182_0.partial`` (the temporary file beside it): the path the user
    gave, exit 3 (a bad value); the same line with --json."""
    for extra in ((), ("--json",)):
        done = run_cli(
            "export", session_id, "-o", "missing_dir/out.jsonl", *extra, env=env, cwd=tmp_path
        )
        assert done.returncode == 3, done.stderr
        line = _one_line(done)
        assert line == "error: cannot write missing_dir/out.jsonl: No such file or directory"
        assert done.stdout == ""


def test_export_to_dash_is_stdout(env: dict[str, str], session_id: str, tmp_path: Path) -> None:
    """``-o -`` wrote a file named ``-`` in the working directory."""
    done = run_cli("export", session_id, "-o", "-", env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    fixture = (FIXTURES / "v3.jsonl").read_text().splitlines()
    assert len(done.stdout.splitlines()) == len(fixture) and not (tmp_path / "-").exists()


# --- bad option values: usage errors, exit 2, one line --------------------------------------


@pytest.mark.parametrize(
    ("argv", "option"),
    [
        (("events", "--after-position", "-1"), "--after-position"),
        (("events", "--after-position", str(2**63)), "--after-position"),
        (("sessions", "fork", "{sid}", "--at-seq", "-1"), "--at-seq"),
        (("sessions", "fork", "{sid}", "--at-seq", str(2**63)), "--at-seq"),
        (("state", "{sid}", "--at-seq", str(2**63)), "--at-seq"),
        (("export", "{sid}", "--at-seq", str(2**63)), "--at-seq"),
        (("sessions", "create", "--tenant", ""), "--tenant"),
        (("sessions", "create", "--tenant", "x" * 129, "--json"), "--tenant"),
        (("import", str(FIXTURES / "v3.jsonl"), "--tenant", ""), "--tenant"),
        (("sessions", "move", "{sid}", "--tenant", ""), "--tenant"),
        (("sessions", "list", "--tenant", "x" * 129), "--tenant"),
        (("events", "--limit", "0"), "--limit"),
        # a dead letter's id, as a position (exit 3, "invalid argument", before)
        (("dead-letters", "list", "--after-id=-1"), "--after-id"),
        (("dead-letters", "list", "--after-id", str(2**63)), "--after-id"),
        (("dead-letters", "show", "--", "-1"), "letter_id"),
        (("dead-letters", "show", str(2**63)), "letter_id"),
        (("dead-letters", "replay", "--", "-1"), "letter_id"),
        (("dead-letters", "discard", "--yes", str(2**63)), "letter_id"),
        (("no-such-command",), "no-such-command"),
    ],
)
def test_a_bad_option_value_is_one_usage_line(
    run: Run, session_id: str, argv: tuple[str, ...], option: str
) -> None:
    """Each bound the option declares (click's ranges, as --limit's): exit 2 and one line
    naming the option and where help is (-1 was exit 2 with a five-line usage block, 2^63
    exit 3, and an empty tenant exit 3 as an "invalid event")."""
    done = run(*(a.replace("{sid}", session_id) for a in argv))
    assert done.returncode == 2, done.stderr
    line = _one_line(done)
    assert option in line and "--help" in line, line
    assert done.stdout == ""


def test_a_fork_point_past_the_head_is_still_a_bad_value(run: Run, session_id: str) -> None:
    """A bound the option cannot know (the session's head): bad input, exit 3, as before."""
    done = run("sessions", "fork", session_id, "--at-seq", "26")
    assert done.returncode == 3
    assert "cannot fork at seq 26; the head is 25" in _one_line(done)


# --- piped output is not wrapped ------------------------------------------------------------


def test_piped_lines_are_not_wrapped(env: dict[str, str], session_id: str, tmp_path: Path) -> None:
    """Off a terminal, without COLUMNS: a line as long as what it holds (rich wrapped it at
    80 columns, splitting ids and paths)."""
    env = {k: v for k, v in env.items() if k != "COLUMNS"}  # pytest may set it: a script does not

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return run_cli(*args, env=env)

    long_dir = tmp_path / ("d" * 90)
    long_dir.mkdir()
    shutil.copy(FIXTURES / "v2.jsonl", long_dir / "v2.jsonl")
    done = run("import", str(long_dir / "v2.jsonl"))
    assert done.returncode == 0, done.stderr
    [line] = done.stdout.splitlines()
    assert line.startswith(f"created: {long_dir / 'v2.jsonl'} -> ") and line.endswith("skipped")
    title = "t" * 120
    made = run("sessions", "create", "--tenant", "tenant-" + "n" * 100, "--title", title)
    assert made.returncode == 0, made.stderr
    listed = run("sessions", "list").stdout.splitlines()
    assert any(title in row and "tenant-" + "n" * 100 in row for row in listed), listed
    shown = run("sessions", "show", session_id).stdout
    assert all(len(x) <= 200 for x in shown.splitlines())
