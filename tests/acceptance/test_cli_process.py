"""``tests.cli_process.run_cli`` (a child forked from a process that imported the CLI) gives
what the executable gives in a fresh interpreter: the same stdout, stderr and exit status."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tests import cli_process
from tests.cli_process import EXE, run_cli
from tests.support import clean_env


def _exec(*args: str, env: dict[str, str], cwd: Path, input: str | None = None) -> tuple:
    done = subprocess.run(
        [EXE, *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        input="" if input is None else input,
        timeout=120,
        check=False,
    )
    return done.returncode, done.stdout, done.stderr


def _forked(*args: str, env: dict[str, str], cwd: Path, input: str | None = None) -> tuple:
    done = run_cli(*args, env=env, cwd=cwd, input=input)
    return done.returncode, done.stdout, done.stderr


@pytest.fixture(autouse=True)
def _fork_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner under test, whatever SESSIONSTORE_TEST_CLI the suite runs with."""
    monkeypatch.setenv("SESSIONSTORE_TEST_CLI", "fork")


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return clean_env(tmp_path / "data", COLUMNS="60")


def test_the_same_output_and_exit_status_as_the_executable(
    env: dict[str, str], tmp_path: Path
) -> None:
    """Each command runs both ways on two identical copies of one data directory."""
    env["SESSIONSTORE_DATA_DIR"] = "data"  # relative: the copies print the same
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    (first / "events.jsonl").write_text('{"type": "message", "n": 1}\n')
    assert run_cli("db", "upgrade", env=env, cwd=first).returncode == 0
    made = run_cli("sessions", "create", "--tenant", "acme", "--json", env=env, cwd=first)
    assert made.returncode == 0, made.stderr
    sid = json.loads(made.stdout)["id"]
    shutil.copytree(first, second)
    commands: list[tuple[tuple[str, ...], str | None]] = [
        (("--version",), None),
        (("append", sid, "events.jsonl"), None),  # a path relative to the working directory
        (("append", sid, "-", "--json"), '{"type": "label", "label": "x"}\n'),  # stdin
        (("append", sid, "-"), "not json\n"),  # bad input: one line, exit 4
        (("sessions", "show", "ses_nope"), None),  # not found
        (("no-such-command",), None),  # usage error, exit 2
        (("--debug", "append", sid, "missing.jsonl"), None),  # a traceback
        (("sessions", "list"), None),  # a table as wide as COLUMNS
        (("state", sid, "--json"), None),
        # stdin is a pipe, as the executable's is: never read as a regular file
        (("import", "/dev/stdin", "--tenant", "acme"), '{"type": "session"}\n'),
    ]
    codes, stderr = set(), ""
    for args, stdin in commands:
        expected = _exec(*args, env=env, cwd=first, input=stdin)
        assert _forked(*args, env=env, cwd=second, input=stdin) == expected, args
        codes.add(expected[0])
        stderr += expected[2]
    # the comparison covered failures too: usage, not found, bad input, a traceback
    assert codes == {0, 2, 3, 4} and "Traceback" in stderr, codes


def test_each_command_is_a_process_of_its_own(env: dict[str, str], tmp_path: Path) -> None:
    """Nothing one command does is seen by the next: settings come from each one's env."""
    other = {**env, "SESSIONSTORE_DATA_DIR": str(tmp_path / "other")}
    for e in (env, other):
        assert run_cli("db", "upgrade", env=e).returncode == 0
    run_cli("sessions", "create", "--tenant", "acme", env=env)
    listed = [json.loads(run_cli("sessions", "list", "--json", env=e).stdout) for e in (env, other)]
    assert [len(x["items"]) for x in listed] == [1, 0]


def test_a_command_past_its_timeout_is_killed(env: dict[str, str]) -> None:
    assert run_cli("db", "upgrade", env=env).returncode == 0
    with pytest.raises(subprocess.TimeoutExpired):
        run_cli("events", "--follow", env=env, timeout=1)
    assert run_cli("--version", env=env).returncode == 0  # the next command still runs


def test_what_python_reads_at_start_up_gets_a_fresh_interpreter(
    env: dict[str, str], tmp_path: Path
) -> None:
    """A forked child would not run a sitecustomize on PYTHONPATH: such a command execs."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import sys\nprint('STARTED-FRESH', file=sys.stderr)\n")
    done = run_cli("--version", env={**env, "PYTHONPATH": str(site)})
    assert done.returncode == 0 and "STARTED-FRESH" in done.stderr


def test_a_dead_zygote_is_replaced(env: dict[str, str]) -> None:
    assert run_cli("--version", env=env).returncode == 0
    assert cli_process._idle
    dead = list(cli_process._idle)
    for zygote in dead:
        zygote.proc.kill()
        zygote.proc.wait()
    assert run_cli("--version", env=env).returncode == 0
    # a new zygote ran it (not the executable, as a fallback would), and is idle and alive
    fresh = [z for z in cli_process._idle if z not in dead]
    assert [z.answered for z in fresh] == [1]
    assert fresh[0].proc.poll() is None
    assert not any(z in cli_process._idle for z in dead)


def test_tmpdir_comes_from_the_commands_environment(env: dict[str, str], tmp_path: Path) -> None:
    own = tmp_path / "own-tmp"
    own.mkdir()
    done = run_cli("demo", "--keep", "--json", env={**env, "TMPDIR": str(own)})
    assert done.returncode == 0, done.stderr
    assert str(own) in done.stderr and any(own.iterdir())


def test_a_working_directory_is_checked_and_resolved_as_subprocess_does(
    env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(FileNotFoundError):
        run_cli("--version", env=env, cwd=tmp_path / "missing")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "e.jsonl").write_text('{"type": "message"}\n')
    monkeypatch.chdir(tmp_path)  # after the zygote started: "sub" is the test's sub
    assert run_cli("db", "upgrade", env=env).returncode == 0
    sid = json.loads(run_cli("sessions", "create", "--tenant", "a", "--json", env=env).stdout)["id"]
    done = run_cli("append", sid, "e.jsonl", env=env, cwd="sub")
    assert done.returncode == 0, done.stderr
