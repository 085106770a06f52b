"""``sessionstore import --watch``: an agent (a subprocess) appends to 3 session files for
10 s while the watcher is SIGKILLed and restarted once. The journal equals the files: nothing
lost, nothing doubled; appended lines arrive within about a second."""

from __future__ import annotations

import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from core.interop.pi import loads_exact
from core.store import SessionStore
from tests.support import as_a_user, clean_env, stored_header, unsearchable, wait_for

EXE = shutil.which("sessionstore") or str(Path(sys.executable).parent / "sessionstore")
ROOT = Path(__file__).parents[2]
TENANT = "watch"
CLAUDE_ID = "7d3c5e2a-91f4-4b6e-8a0d-2c1f9e8b7a60"


def _watcher(directory: Path, settings_env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            [EXE, "import", "--watch", str(directory), "--tenant", TENANT, "--json"],
            env=settings_env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def _file_entries(path: Path) -> list[object]:
    data = path.read_bytes()
    complete = data[: data.rfind(b"\n") + 1]
    return [loads_exact(line) for line in complete.splitlines() if line.strip()]


def _journal_equals_files(store: SessionStore, files: list[Path]) -> bool:
    for path in files:
        session = store.journal.find_external(TENANT, path.stem.rsplit("_", 1)[-1])
        if session is None:
            return False
        if [e.payload for e in store.read(session.id)] != _file_entries(path):
            return False
    return True


@pytest.mark.slow
def test_watch_survives_sigkill_and_doubles_nothing(store: SessionStore, tmp_path: Path) -> None:
    directory = tmp_path / "sessions"
    directory.mkdir()
    env = clean_env(
        store.settings.data_dir, SESSIONSTORE_DATABASE_URL=store.settings.resolved_database_url
    )
    log = tmp_path / "watch.log"
    watcher = _watcher(directory, env, log)
    agent = subprocess.Popen(
        [sys.executable, "-m", "tests.acceptance.pi_agent", str(directory), "10", "3"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
    )
    try:
        # Kill it once it is importing (a loaded CI machine can take seconds to start it),
        # while the agent is still writing: mid-stream, maybe mid-append.
        wait_for(lambda: '"session_id"' in log.read_text(), 30, "the watcher to import")
        time.sleep(1)
        watcher.send_signal(signal.SIGKILL)
        watcher.wait(timeout=10)
        time.sleep(1)  # the agent keeps writing while no watcher runs
        watcher = _watcher(directory, env, log)
        out, _ = agent.communicate(timeout=60)
        assert agent.returncode == 0
        counts = json.loads(out)
        files = sorted(directory.glob("*.jsonl"))
        assert len(files) == 3 and sum(counts) > 100
        finished = time.monotonic()
        wait_for(lambda: _journal_equals_files(store, files), 30, "the journal to equal the files")
        # within about a second on a quiet machine; the bound allows for a loaded one
        assert time.monotonic() - finished < 10
        for path, count in zip(files, counts, strict=True):
            session = store.journal.find_external(TENANT, path.stem.rsplit("_", 1)[-1])
            assert session is not None and session.head_seq == count + 1  # + the header
    finally:
        for process in (watcher, agent):
            if process.poll() is None:
                process.kill()
                process.wait(timeout=10)
        if agent.stdout is not None:  # a failure before communicate() left the pipe open
            agent.stdout.close()
    assert "Traceback" not in log.read_text(errors="replace")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _imported_entries(port: int) -> float:
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
    except OSError:
        return -1.0  # not serving yet
    found = re.search(rb"^sessionstore_import_entries_total ([0-9.e+]+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def test_a_watcher_serves_the_import_metrics(store: SessionStore, tmp_path: Path) -> None:
    """Imports run in the importing process, not in a worker: the dashboard's import
    panels read the worker's counters, which stayed 0 for good (a review of the operator's
    side, stop 39). ``import --watch --metrics-port`` serves them."""
    directory = tmp_path / "sessions"
    directory.mkdir()
    shutil.copyfile(ROOT / "tests" / "fixtures" / "pi" / "v3.jsonl", directory / "a_v3.jsonl")
    env = clean_env(
        store.settings.data_dir, SESSIONSTORE_DATABASE_URL=store.settings.resolved_database_url
    )
    port = _free_port()
    metrics = ["--metrics-port", str(port)]
    log = tmp_path / "watch.log"
    with log.open("ab") as out:
        watcher = subprocess.Popen(
            [EXE, "import", "--watch", str(directory), "--tenant", TENANT, "--json", *metrics],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        lines = len((directory / "a_v3.jsonl").read_text().splitlines())
        wait_for(lambda: _imported_entries(port) >= lines, 60, "the import counted on /metrics")
    finally:
        watcher.kill()
        watcher.wait(timeout=10)
    # a one-shot import ends before any scrape: the port is refused without --watch
    once = subprocess.run(
        [EXE, "import", str(directory), "--metrics-port", str(port)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert once.returncode == 2 and "--watch" in once.stderr


def _store_env(store: SessionStore) -> dict[str, str]:
    return clean_env(
        store.settings.data_dir, SESSIONSTORE_DATABASE_URL=store.settings.resolved_database_url
    )


def _records(log: Path) -> list[dict[str, object]]:
    """The JSON objects a watcher wrote to ``log`` (its stderr lines are in it too)."""
    lines = log.read_text(errors="replace").splitlines()
    return [json.loads(line) for line in lines if line.startswith("{")]


def test_a_watcher_goes_on_past_directories_it_cannot_read(
    store: SessionStore, tmp_path: Path
) -> None:
    """A directory listed but not searchable (its file is reported once, unreadable) and
    one that cannot be listed (not watched, reported once): the watcher follows the
    others. Before, the first ended it at its first scan, the second when it began
    watching (and, once it did not, it was passed over without a word)."""
    sessions = tmp_path / "sessions"
    fixtures = ROOT / "tests" / "fixtures" / "pi"
    for name in ("locked", "unreadable"):
        (sessions / name).mkdir(parents=True)
        shutil.copyfile(fixtures / "v2.jsonl", sessions / name / "x.jsonl")
    shutil.copyfile(fixtures / "v3.jsonl", sessions / "a_v3.jsonl")
    secret = sessions / "c_secret.jsonl"  # a file there that cannot be read: said once
    secret.write_text((fixtures / "v3.jsonl").read_text().replace("0f3c2a10-v3", "secret-v3"))
    secret.chmod(0o000)
    env = _store_env(store)
    log = tmp_path / "watch.log"

    def records() -> list[dict[str, object]]:
        return _records(log)

    def imported(name: str) -> bool:
        return any(r["path"] == str(sessions / name) and r["appended"] for r in records())

    command = [EXE, "import", "--watch", str(sessions), "--tenant", TENANT, "--json"]
    with unsearchable(sessions / "locked", 0o644), unsearchable(sessions / "unreadable", 0o311):
        with log.open("ab") as out:
            watcher = subprocess.Popen(
                as_a_user(command), env=env, stdout=out, stderr=subprocess.STDOUT
            )
        try:
            wait_for(lambda: imported("a_v3.jsonl"), 60, "the readable file imported")
            shutil.copyfile(fixtures / "v1.jsonl", sessions / "b_v1.jsonl")
            wait_for(lambda: imported("b_v1.jsonl"), 60, "a file written since imported")
            wait_for(lambda: any(r["path"] == str(secret) for r in records()), 60, "secret said")
            secret.chmod(0o644)  # mended by a chmod alone (no write): imported (a review's)
            wait_for(lambda: imported("c_secret.jsonl"), 60, "the file, once it can be read")
            assert watcher.poll() is None, log.read_text()
        finally:
            watcher.kill()
            watcher.wait(timeout=10)
    locked = [r for r in records() if r["path"] == str(sessions / "locked" / "x.jsonl")]
    assert [r["status"] for r in locked] == ["error"]
    assert "Permission denied" in str(locked[0]["error"])
    # it was passed over in silence, tried again at every rescan (taken for a file gone)
    unread = [r for r in records() if r["path"] == str(secret)]
    assert [r["status"] for r in unread] == ["error", "created"], unread
    assert str(unread[0]["error"]) == f"cannot read {secret}: Permission denied"
    # listed by no pass, said once (and no file in it imported): it was passed over silently
    unlisted = [r for r in records() if "unreadable" in str(r["path"])]
    assert [(r["path"], r["status"]) for r in unlisted] == [(str(sessions / "unreadable"), "error")]
    assert str(unlisted[0]["error"]).startswith(f"cannot list {sessions / 'unreadable'}: ")
    assert "Traceback" not in log.read_text(errors="replace")


def test_a_follow_ended_by_ctrl_c_exits_with_the_code_of_the_files_still_failed(
    store: SessionStore, tmp_path: Path
) -> None:
    """Ctrl-C ended ``import --watch`` with exit 0 though a file of it had failed (a
    one-shot import exits with the highest code of its failed files). It now exits with
    that of the files whose last import failed: 3 for a file of no format; 0 once the
    file has been imported after all."""
    sessions = tmp_path / "sessions"
    sessions.mkdir()
    junk = sessions / "junk.jsonl"
    junk.write_text('{"no": "format"}\n')
    shutil.copyfile(ROOT / "tests" / "fixtures" / "pi" / "v3.jsonl", sessions / "a_v3.jsonl")
    env = _store_env(store)
    log = tmp_path / "watch.log"

    def records() -> list[dict[str, object]]:
        return _records(log)

    def stopped(watcher: subprocess.Popen[bytes]) -> int:
        watcher.send_signal(signal.SIGINT)
        return watcher.wait(timeout=30)

    watcher = _watcher(sessions, env, log)
    try:
        wait_for(lambda: len(records()) >= 2, 60, "both files passed")
        assert stopped(watcher) == 3, log.read_text()
        assert [r["status"] for r in records() if r["path"] == str(junk)] == ["error"]
        watcher = _watcher(sessions, env, log)
        wait_for(lambda: len(records()) >= 3, 60, "the junk file failed again")
        shutil.copyfile(ROOT / "tests" / "fixtures" / "pi" / "v1.jsonl", junk)
        wait_for(
            lambda: any(r["path"] == str(junk) and r["appended"] for r in records()),
            60,
            "the file imported once it is a session",
        )
        assert stopped(watcher) == 0, log.read_text()
    finally:
        watcher.kill()
        watcher.wait(timeout=10)
    assert "Traceback" not in log.read_text(errors="replace")


def test_a_watched_directory_named_relatively_says_each_failure_once(
    store: SessionStore, tmp_path: Path
) -> None:
    """``import s --watch s``, from the directory above: a file that failed in the import
    before the follow was said again by the follow's first scan, and its code stayed the
    run's after the file was imported; a file written during the follow was said twice, as
    the change event named it (absolute) and as the rescan did (relative). Each failure is
    said once now, by the path as given, and Ctrl-C exits with the code of the files still
    failing."""
    sessions = tmp_path / "s"
    sessions.mkdir()
    first = sessions / "a_junk.jsonl"
    first.write_text('{"no": "format"}\n')
    claude = ROOT / "tests" / "fixtures" / "claude_code" / f"{CLAUDE_ID}.jsonl"
    waiting = sessions / claude.name  # its summary and snapshot so far: no time nor cwd
    waiting.write_bytes(b"".join(claude.read_bytes().splitlines(keepends=True)[:2]))
    log = tmp_path / "watch.log"
    with log.open("ab") as out:
        watcher = subprocess.Popen(
            [EXE, "import", "s", "--watch", "s", "--tenant", TENANT, "--json"],
            env=_store_env(store),
            cwd=tmp_path,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_for(lambda: "following s" in log.read_text(), 60, "the follow begun")
        time.sleep(2.5)  # its first scan, and a rescan
        shutil.copyfile(claude, waiting)  # its prompt's line, with the time and the cwd
        wait_for(lambda: len(_records(log)) >= 2, 60, "the Claude Code file imported")
        (sessions / "b_junk.jsonl").write_text('{"no": "format either"}\n')
        wait_for(lambda: len(_records(log)) >= 3, 60, "the second file said")
        shutil.copyfile(ROOT / "tests" / "fixtures" / "pi" / "v1.jsonl", first)
        wait_for(lambda: len(_records(log)) >= 4, 60, "the first file imported")
        time.sleep(2.5)  # a rescan, which says nothing more
        watcher.send_signal(signal.SIGINT)
        assert watcher.wait(timeout=30) == 3, log.read_text()  # b_junk still fails
    finally:
        watcher.kill()
        watcher.wait(timeout=10)
    said = [(r["path"], r["status"]) for r in _records(log)]
    assert said == [
        ("s/a_junk.jsonl", "error"),
        (f"s/{claude.name}", "created"),
        ("s/b_junk.jsonl", "error"),
        ("s/a_junk.jsonl", "created"),
    ], log.read_text()
    # imported by the follow, which waited for the line that gives the header its time and
    # cwd (the import before the follow made the session from the first two lines)
    header = stored_header(store, TENANT, CLAUDE_ID)
    assert (header["timestamp"], header["cwd"]) == (
        "2026-01-20T09:00:00.000Z",
        "/home/dev/dateparse",
    )
