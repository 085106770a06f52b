"""The real ``sessionstore`` executable: import (files, directories, globs; --json),
export by external id, sessions create --id, and external ids accepted wherever a session
id is."""

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
from tests.support import clean_env, json_lines

Run = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture
def run(sqlite_url: str, tmp_path: Path) -> Run:
    env = clean_env(
        tmp_path / "data", SESSIONSTORE_DATABASE_URL=sqlite_url, HOME=str(tmp_path / "home")
    )

    def run(*args: str, **more_env: str) -> subprocess.CompletedProcess[str]:
        return run_cli(*args, env={**env, **more_env})

    return run


def test_import_export_and_external_ids(run: Run, tmp_path: Path) -> None:
    first = run("import", str(FIXTURES), "--json", "--tenant", "acme")
    assert first.returncode == 0, first.stderr
    results = json_lines(first.stdout)
    assert {r["external_id"] for r in results} == {"0f3c2a10-v1", "0f3c2a10-v2", "0f3c2a10-v3"}
    assert {r["status"] for r in results} == {"created"}
    assert set(results[0]) == {"path", "session_id", "external_id", "appended", "skipped", "status"}
    again = json_lines(
        run("import", str(FIXTURES / "*.jsonl"), "--json", "--tenant", "acme").stdout
    )
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


def test_an_external_id_of_several_tenants_asks_for_the_tenant(run: Run, tmp_path: Path) -> None:
    """The same file imported for two tenants: a command given its external id alone says
    which tenants it names and to pass --tenant (it said "session not found"), and every
    command that takes a session takes --tenant (show, fork, delete, copy-artifacts and
    append had none; move's is --from-tenant)."""
    for tenant in ("acme", "globex"):
        assert run("import", str(FIXTURES / "v3.jsonl"), "--tenant", tenant).returncode == 0
    ambiguous = run("sessions", "show", "0f3c2a10-v3")
    assert ambiguous.returncode == 3 and "Traceback" not in ambiguous.stderr
    assert "several tenants (acme, globex): give its tenant too" in ambiguous.stderr
    shown = json.loads(
        run("sessions", "show", "0f3c2a10-v3", "--tenant", "globex", "--json").stdout
    )
    assert shown["tenant_id"] == "globex"
    events = tmp_path / "more.jsonl"
    events.write_text(json.dumps({"type": "label", "id": "L1", "label": "x"}) + "\n")
    for argv in (
        ["append", "0f3c2a10-v3", str(events), "--tenant", "acme"],
        ["sessions", "fork", "0f3c2a10-v3", "--tenant", "acme", "--inline"],
        ["sessions", "copy-artifacts", "0f3c2a10-v3", "--tenant", "acme"],
        ["sessions", "move", "0f3c2a10-v3", "--from-tenant", "acme", "--cwd", "/elsewhere"],
        ["sessions", "delete", "0f3c2a10-v3", "--tenant", "globex", "--yes"],
    ):
        done = run(*argv)
        assert done.returncode == 0, (argv, done.stderr)
    assert run("sessions", "show", "0f3c2a10-v3", "--json").returncode == 0  # one left


def test_every_command_that_takes_a_session_takes_its_external_id(run: Run, tmp_path: Path) -> None:
    """read, append, sessions fork / move / copy-artifacts / delete (they answered "not
    found", where state, events, show and export took it)."""
    created = run("sessions", "create", "--id", "ext-all", "--tenant", "acme", "--json")
    assert created.returncode == 0, created.stderr
    sid = json.loads(created.stdout)["id"]
    events = tmp_path / "events.jsonl"
    big = "x" * 40_000  # stored as a blob: what read resolves
    events.write_text(json.dumps({"type": "note", "text": big}) + "\n")
    appended = run("append", "ext-all", str(events), "--json")
    assert appended.returncode == 0, appended.stderr
    assert json.loads(appended.stdout)[0]["session_id"] == sid
    listed = run("events", "--session", "ext-all", "--json")
    ref = json.loads(listed.stdout)["items"][0]["payload"]["text"]
    read = run("read", ref, "--session", "ext-all", "--tenant", "acme")
    assert read.returncode == 0 and read.stdout.strip() == big, read.stderr
    fork = run("sessions", "fork", "ext-all", "--inline", "--json")
    assert fork.returncode == 0, fork.stderr
    fork_id = json.loads(fork.stdout)["id"]
    assert json.loads(fork.stdout)["parent_id"] == sid
    copied = run("sessions", "copy-artifacts", fork_id, "--json")
    assert copied.returncode == 0, copied.stderr
    moved = run("sessions", "move", "ext-all", "--cwd", "/elsewhere", "--json")
    assert moved.returncode == 0, moved.stderr
    assert json.loads(moved.stdout)["cwd"] == "/elsewhere"
    deleted = run("sessions", "delete", "ext-all", "--yes", "--json")
    assert deleted.returncode == 0, deleted.stderr
    assert run("sessions", "show", sid).returncode == 4


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
    # said once, by the result: the library's log of it (a warning, the bare message on
    # stderr) is at info level
    assert again.stderr == "", again.stderr


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
    entries[8]["k\x00"] = 1  # in the pass's third batch of 5: no database text holds it
    write(path, [*lines, *entries])
    done = run("import", str(path), "--json", SESSIONSTORE_MAX_BATCH_EVENTS="5")
    assert done.returncode == 3, done.stderr
    [report] = json_lines(done.stdout)
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
    [report] = json_lines(done.stdout)
    appended = 5 * ((len(lines) + 10) // 5)  # the batches before the one holding m10
    assert (report["status"], report["appended"], report["skipped"]) == ("error", appended, 0)
    assert report["external_id"] == lines[0]["id"] and report["session_id"]
    assert str(report["session_id"]) in str(report["error"])
    with db:
        db.execute("DROP TRIGGER refuse")
    db.close()
    again = json_lines(run("import", str(path), "--json").stdout)
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
    reports = {str(r["path"]): r for r in json_lines(mixed.stdout)}
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


def test_import_reports_lines_holding_no_entry(run: Run, tmp_path: Path) -> None:
    """Not imported, and never silently: --json lists each line with why, as does the
    human line."""
    path = tmp_path / "s.jsonl"
    header = '{"type":"session","version":3,"id":"s-odd","timestamp":"2025-01-01Z","cwd":"/"}'
    entry = '{"type":"label","id":"l","parentId":null}'
    path.write_text("\n".join([header, entry, '{"type":"label",BROKEN', "42", '{"type":5}']) + "\n")
    done = run("import", str(path), "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["appended"] == 3  # the header, the label and the line without a string type
    assert result["ignored_lines"] == [
        {"line": 3, "reason": "not JSON"},
        {"line": 4, "reason": "not a JSON object"},
    ]
    # said once, by the result: not also a warning per line and one for the file on stderr
    assert done.stderr == "", done.stderr
    human = run("import", str(path))
    again = " ".join(human.stdout.split())
    assert "2 line(s) holding no entry not imported: 3 (not JSON), 4 (not a JSON object)" in again
    assert human.stderr == "", human.stderr


def test_import_json_says_a_last_line_waits(run: Run, tmp_path: Path) -> None:
    """A half-written last line is not imported yet: --json says so, as the human line
    does. A whole entry without its newline is imported, as pi reads it; what is appended
    after it (its newline, then entries) comes in the next pass."""
    path = tmp_path / "s.jsonl"
    header = '{"type":"session","version":3,"id":"s-tail","timestamp":"2025-01-01Z","cwd":"/"}'
    label = '{"type":"label","id":"l","parentId":null}'
    path.write_text(header + "\n" + label[:-1])
    result = json.loads(run("import", str(path), "--json").stdout)
    assert (result["appended"], result["incomplete_tail"]) == (1, True)
    path.write_text(header + "\n" + label)
    result = json.loads(run("import", str(path), "--json").stdout)
    assert result["appended"] == 1 and "incomplete_tail" not in result
    path.write_text(path.read_text() + "\n" + label.replace('"l"', '"m"') + "\n")
    result = json.loads(run("import", str(path), "--json").stdout)
    assert result["appended"] == 1 and "incomplete_tail" not in result
    events = json.loads(run("events", "--session", result["session_id"], "--json").stdout)
    assert [e["payload"].get("id") for e in events["items"]][1:] == ["l", "m"]


def test_a_file_with_no_line_yet_is_a_skip_not_a_failure(run: Run, tmp_path: Path) -> None:
    """A session file an agent has just opened (empty), or whose first line it is still
    writing, failed the whole import (exit 3: "not a session file of a known format"), so
    an import of ~/.claude/projects while Claude Code ran failed. Such a file holds no
    session yet, as pi reads it: it is said (status empty / unfinished), nothing is
    imported, the run exits 0, and a later import takes the file once its line is whole.
    A whole line of no format still fails."""
    d = tmp_path / "d"
    d.mkdir()
    (d / "a_empty.jsonl").write_bytes(b"")
    (d / "b_blank.jsonl").write_bytes(b"\xef\xbb\xbf \r\t")
    first = json.dumps({"type": "session", "version": 3, "id": "s-half", "cwd": "/"}) + "\n"
    (d / "c_half.jsonl").write_text(first[:30])
    (d / "d_half_bom.jsonl").write_bytes(b"\xef\xbb\xbf" + first[:30].encode())
    (d / "z_good.jsonl").write_bytes((FIXTURES / "v3.jsonl").read_bytes())
    done = run("import", str(d), "--json", "--format", "pi")
    assert done.returncode == 0, done.stderr
    reports = {Path(str(r["path"])).name: r for r in json_lines(done.stdout)}
    assert {name: r["status"] for name, r in reports.items()} == {
        "a_empty.jsonl": "empty",
        "b_blank.jsonl": "empty",
        "c_half.jsonl": "unfinished",
        "d_half_bom.jsonl": "unfinished",
        "z_good.jsonl": "created",
    }
    assert reports["a_empty.jsonl"] == {
        "path": str(d / "a_empty.jsonl"),
        "session_id": None,
        "external_id": None,
        "appended": 0,
        "skipped": 0,
        "status": "empty",
        "reason": "the file is empty",
    }
    human = run("import", str(d / "c_half.jsonl"))
    assert human.returncode == 0 and human.stderr == "", human.stderr
    assert human.stdout == (
        f"unfinished: {d / 'c_half.jsonl'}: its first line is not complete (still being "
        "written, or cut short), nothing imported\n"
    )
    assert run("sessions", "list", "--json").stdout.count('"s-half"') == 0
    (d / "c_half.jsonl").write_text(first)
    later = json.loads(run("import", str(d / "c_half.jsonl"), "--json").stdout)
    assert (later["status"], later["external_id"]) == ("created", "s-half")
    assert json.loads(run("import", str(d / "b_blank.jsonl"), "--json").stdout)["reason"] == (
        "the file holds only white space"
    )
    # no line break, and yet no line to come: text that no more text makes an object
    for name, text in {
        "e_whole": b'{"no": "format"}',  # whole (pi reads it as a line)
        "f_nuls": b'{"type": "session"}\0\0\0',  # a crash's NULs
        "g_cr": b'{"type": "session", "id": "x"}\r{"type": "label"}\r',  # CR line ends
        "h_two": b'{"a": 1} {"b": 2}',
        "i_junk": b"{garbage",
        "j_utf16": '{"a": 1}'.encode("utf-16-le"),
    }.items():
        (d / f"{name}.jsonl").write_bytes(text)
        failed = run("import", str(d / f"{name}.jsonl"), "--json")
        assert failed.returncode == 3, (name, failed.stdout)
        assert json.loads(failed.stdout)["status"] == "error", name


def test_a_new_claude_code_file_without_its_header_lines_waits_for_them(
    run: Run, tmp_path: Path
) -> None:
    """A one-shot import of a Claude Code file written to a moment ago that holds only its
    first lines (a summary, a file-history snapshot: no time nor working directory) made
    the session from them, its header for good "timestamp": null, "cwd": "" (a probe's
    finding; --watch waits on such a file). It is unfinished now, nothing imported, exit 0;
    the next import, once the prompt's line is there, makes the session with them. An old
    such file is imported as it is."""
    fixture = Path(__file__).parents[1] / "fixtures" / "claude_code"
    source = fixture / "7d3c5e2a-91f4-4b6e-8a0d-2c1f9e8b7a60.jsonl"
    d = tmp_path / "cc"
    d.mkdir()
    path = d / source.name
    path.write_bytes(b"".join(source.read_bytes().splitlines(keepends=True)[:2]))
    first = run("import", str(path), "--json")
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout) == {
        "path": str(path),
        "session_id": None,
        "external_id": None,
        "appended": 0,
        "skipped": 0,
        "status": "unfinished",
        "reason": "no line gives the session its time and working directory yet",
    }
    path.write_bytes(source.read_bytes())
    made = json.loads(run("import", str(path), "--json").stdout)
    assert made["status"] == "created"
    out = tmp_path / "out.jsonl"
    assert run("export", made["session_id"], "-o", str(out)).returncode == 0
    header = json.loads(out.read_text().splitlines()[0])
    assert (header["timestamp"], header["cwd"]) == (
        "2026-01-20T09:00:00.000Z",
        "/home/dev/dateparse",
    )
    old = d / "0b9e4f31-5c2d-4e8a-9f17-6a3b2c1d0e9f.jsonl"
    old.write_bytes(source.read_bytes().splitlines(keepends=True)[0])
    os.utime(old, (1_700_000_000, 1_700_000_000))
    assert json.loads(run("import", str(old), "--json").stdout)["status"] == "created"


def test_an_odd_file_fails_alone_and_the_run_goes_on(run: Run, tmp_path: Path) -> None:
    """Odd values that aborted the whole run with an untyped error: each file now gets its
    record (imported as pi or Claude Code would read it, or a typed error), and the files
    after it are imported."""
    d = tmp_path / "d"
    d.mkdir()
    cc = {"type": "user", "uuid": "u1", "parentUuid": None, "sessionId": "cc-ts"}
    cc |= {"timestamp": "0001-01-01T00:00:00", "message": {"role": "user", "content": "hi"}}
    (d / "a_cc_year1.jsonl").write_text(json.dumps(cc) + "\n")
    hex_version = '"0x' + "f" * 300 + '"'  # pi: Number() is Infinity, version 3
    (d / "b_hex.jsonl").write_text(f'{{"type":"session","version":{hex_version},"id":"hex"}}\n')
    deep = "[" * 990 + "]" * 990  # pi: String() is "", version 0: migrated from v1
    (d / "c_deep.jsonl").write_text(f'{{"type":"session","version":{deep},"id":"deep"}}\n')
    (d / "d_cc_list.jsonl").write_text('{"type":["user"],"uuid":"u2"}\n')
    (d / "z_good.jsonl").write_bytes((FIXTURES / "v3.jsonl").read_bytes())
    done = run("import", str(d), "--json", "--format", "auto")
    reports = {Path(str(r["path"])).name: r for r in json_lines(done.stdout)}
    assert done.returncode == 3, done.stderr  # d_cc_list is not a session file: bad input
    assert "Traceback" not in done.stderr
    assert [reports[n]["status"] for n in sorted(reports)] == [
        "created",
        "created",
        "created",
        "error",
        "created",
    ]
    assert "not a session file" in str(reports["d_cc_list.jsonl"]["error"])
    listed = run("import", str(d / "d_cc_list.jsonl"), "--format", "claude-code", "--json")
    assert listed.returncode == 3 and "Traceback" not in listed.stderr
    error = json.loads(listed.stdout)["error"]
    assert "no line of this file is a Claude Code transcript line" in str(error)
