"""The real ``sessionstore`` executable: import (files, directories, globs; --json),
export by external id, sessions create --id, and external ids accepted by state/events/show."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.cli_process import run_cli
from tests.fixtures.pi.generate import v3_lines, write
from tests.pi_support import FIXTURES
from tests.support import clean_env

Run = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture
def run(sqlite_url: str, tmp_path: Path) -> Run:
    env = clean_env(
        tmp_path / "data", SESSIONSTORE_DATABASE_URL=sqlite_url, HOME=str(tmp_path / "home")
    )

    def run(*args: str, **more_env: str) -> subprocess.CompletedProcess[str]:
        return run_cli(*args, env={**env, **more_env})

    return run


def _objects(text: str) -> list[dict[str, object]]:
    decoder, objects, pos = json.JSONDecoder(), [], 0
    text = text.strip()
    while pos < len(text):
        value, end = decoder.raw_decode(text, pos)
        objects.append(value)
        pos = end
        while pos < len(text) and text[pos].isspace():
            pos += 1
    return objects


def test_import_export_and_external_ids(run: Run, tmp_path: Path) -> None:
    first = run("import", str(FIXTURES), "--json", "--tenant", "acme")
    assert first.returncode == 0, first.stderr
    results = _objects(first.stdout)
    assert {r["external_id"] for r in results} == {"0f3c2a10-v1", "0f3c2a10-v2", "0f3c2a10-v3"}
    assert {r["status"] for r in results} == {"created"}
    assert set(results[0]) == {"path", "session_id", "external_id", "appended", "skipped", "status"}
    again = _objects(run("import", str(FIXTURES / "*.jsonl"), "--json", "--tenant", "acme").stdout)
    assert [r["appended"] for r in again] == [0, 0, 0]

    out = tmp_path / "out.jsonl"
    exported = run("export", "0f3c2a10-v3", "-o", str(out), "--tenant", "acme")
    assert exported.returncode == 0, exported.stderr
    assert [json.loads(x) for x in out.read_text().splitlines()] == [
        json.loads(x) for x in (FIXTURES / "v3.jsonl").read_text().splitlines()
    ]
    state = run("state", "0f3c2a10-v3", "--tenant", "acme", "--json")
    assert json.loads(state.stdout)["info"]["model"]["model_id"] == "gemini-2.5-pro"
    show = run("sessions", "show", "0f3c2a10-v1", "--json")
    assert json.loads(show.stdout)["external_id"] == "0f3c2a10-v1"
    events = run("events", "--session", "0f3c2a10-v2", "--tenant", "acme", "--json")
    assert events.returncode == 0, events.stderr


def test_sessions_create_and_conflict_errors(run: Run, tmp_path: Path) -> None:
    created = run("sessions", "create", "--id", "ext-1", "--title", "T", "--cwd", "/w", "--json")
    assert created.returncode == 0, created.stderr
    session = json.loads(created.stdout)
    assert (session["external_id"], session["title"], session["cwd"]) == ("ext-1", "T", "/w")
    dup = run("sessions", "create", "--id", "ext-1")
    assert dup.returncode == 1 and len(dup.stderr.strip().splitlines()) == 1

    path = tmp_path / "s.jsonl"
    lines = v3_lines()
    write(path, lines)
    assert run("import", str(path)).returncode == 0
    lines[3]["message"]["content"] = "changed"
    write(path, lines)
    conflict = run("import", str(path))
    assert conflict.returncode == 1
    assert f"{path}:4:" in conflict.stderr and "Traceback" not in conflict.stderr


def test_import_reports_lines_of_invalid_utf8(run: Run, tmp_path: Path) -> None:
    """Such lines are kept as pi reads them (U+FFFD), and the report says so."""
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(
        b'{"type":"session","version":3,"id":"s-latin1","timestamp":"2025-01-01Z","cwd":"/"}\n'
        b'{"type":"message","id":"a","parentId":null,"message":{"role":"user","content":"caf\xe9"}}\n'
    )
    done = run("import", str(path), "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert (result["appended"], result["invalid_utf8_lines"]) == (2, 1)
    again = run("import", str(path))
    assert "1 line(s) of invalid UTF-8 read with U+FFFD" in " ".join(again.stdout.split())


def _entries(count: int, parent: str) -> list[dict[str, object]]:
    entries: list[dict[str, object]] = []
    for n in range(count):
        message = {"role": "user", "content": f"more {n}"}
        entries.append({"type": "message", "id": f"m{n}", "parentId": parent, "message": message})
        parent = f"m{n}"
    return entries


def test_import_of_a_bad_line_names_it_and_writes_nothing(run: Run, tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    lines = v3_lines()
    entries = _entries(12, lines[-1]["id"])
    entries[8]["type"] = "t" * 300  # in the pass's third batch of 5
    write(path, [*lines, *entries])
    done = run("import", str(path), "--json", SESSIONSTORE_MAX_BATCH_EVENTS="5")
    assert done.returncode == 1, done.stderr
    [report] = _objects(done.stdout)
    assert (report["status"], report["session_id"], report["appended"]) == ("error", None, 0)
    assert f"{path} line {len(lines) + 9}:" in str(report["error"])
    listed = json.loads(run("sessions", "list", "--json").stdout)
    assert listed["items"] == []  # not even an empty session holds the external id


def test_import_failing_midway_reports_what_it_appended(
    run: Run, tmp_path: Path, sqlite_url: str
) -> None:
    """A batch the database refuses after earlier ones committed: the report names the
    session and what went in; the next pass (the database fine again) continues."""
    path = tmp_path / "s.jsonl"
    lines = v3_lines()
    write(path, [*lines, *_entries(12, lines[-1]["id"])])
    db = sqlite3.connect(sqlite_url.removeprefix("sqlite:///"))
    with db:
        db.execute(
            "CREATE TRIGGER refuse BEFORE INSERT ON events WHEN NEW.payload LIKE '%\"m10\"%' "
            "BEGIN SELECT RAISE(ABORT, 'refused by the test'); END"
        )
    done = run("import", str(path), "--json", SESSIONSTORE_MAX_BATCH_EVENTS="5")
    assert done.returncode == 1, done.stderr
    [report] = _objects(done.stdout)
    appended = 5 * ((len(lines) + 10) // 5)  # the batches before the one holding m10
    assert (report["status"], report["appended"], report["skipped"]) == ("error", appended, 0)
    assert report["external_id"] == lines[0]["id"] and report["session_id"]
    assert str(report["session_id"]) in str(report["error"])
    with db:
        db.execute("DROP TRIGGER refuse")
    db.close()
    again = _objects(run("import", str(path), "--json").stdout)
    assert [(r["session_id"], r["skipped"]) for r in again] == [(report["session_id"], appended)]


def test_import_of_a_path_that_is_not_a_file_is_bad_input(run: Run, tmp_path: Path) -> None:
    """A FIFO (never opened: it would block), a device, a dangling link or a missing path:
    one line each, exit 3 (it once recursed to a RecursionError, or exited 0); the good
    file named with them is imported all the same."""
    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)
    dangling = tmp_path / "dangling.jsonl"
    dangling.symlink_to(tmp_path / "nowhere")
    good = tmp_path / "good.jsonl"
    write(good, v3_lines())
    bad = [str(fifo), "/dev/null", str(dangling), str(tmp_path / "no" / "such.jsonl")]
    for path in bad:
        done = run("import", path)
        assert done.returncode == 3, done.stderr
        assert [line for line in done.stderr.splitlines() if line] == [done.stderr.strip()]
        assert done.stderr.startswith(f"error: cannot read {path}: ")
    mixed = run("import", *bad, str(good), "--json")
    assert mixed.returncode == 3, mixed.stderr
    reports = {str(r["path"]): r for r in _objects(mixed.stdout)}
    assert [reports[p]["status"] for p in bad] == ["error"] * len(bad)
    assert reports[str(good)]["status"] == "created"


def test_import_of_a_directory_or_glob_without_session_files_is_nothing_to_do(
    run: Run, tmp_path: Path
) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    for named in (str(empty), str(tmp_path / "none*.jsonl")):
        done = run("import", named)
        assert done.returncode == 0, done.stderr
        assert "no session files" in done.stderr
