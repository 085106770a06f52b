"""``import --watch``'s follower (``core.interop.watch.Follower``), in process: what it takes
up, what it tries again, and that one file's failure never ends the following of the
others."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import watchfiles

from core.errors import InvalidEvent, SessionStoreError, StorageUnavailable, UnreadableFile
from core.interop import importer
from core.interop.importer import ImportResult
from core.interop.watch import Follower, session_files
from core.store import SessionStore
from tests.support import stored_header, wait_for

TENANT = "watch"


def header(session_id: str, **more: Any) -> dict[str, Any]:
    return {
        "type": "session",
        "version": 3,
        "id": session_id,
        "timestamp": "2026-01-01T00:00:00.000Z",
        "cwd": "/w",
        **more,
    }


def message(n: int, parent: str | None) -> dict[str, Any]:
    return {
        "type": "message",
        "id": f"m{n}",
        "parentId": parent,
        "timestamp": "2026-01-01T00:00:01.000Z",
        "message": {"role": "user", "content": f"hi {n}", "timestamp": 1},
    }


def write(path: Path, lines: list[dict[str, Any]], mode: str = "w") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open(mode) as out:
        out.writelines(json.dumps(line) + "\n" for line in lines)


def head_of(store: SessionStore, external_id: str) -> int:
    session = store.journal.find_external(TENANT, external_id)
    return -1 if session is None else session.head_seq


@contextmanager
def following(
    store: SessionStore, directory: Path, results: list[ImportResult] | None = None
) -> Iterator[list[SessionStoreError]]:
    errors: list[SessionStoreError] = []
    follower = Follower(
        store,
        directory,
        tenant_id=TENANT,
        on_error=lambda path, exc: errors.append(exc),
        on_result=None if results is None else results.append,
    )
    stop = threading.Event()
    failed: list[BaseException] = []

    def run() -> None:
        try:
            follower.run(stop)
        except BaseException as exc:
            failed.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield errors
    finally:
        stop.set()
        thread.join(10)
    assert not thread.is_alive() and failed == []  # the follower never died


def test_a_subagent_file_in_an_artifacts_directory_is_not_a_session(
    store: SessionStore, tmp_path: Path
) -> None:
    """oh-my-pi's subagent sessions sit in ``<stem>/`` beside ``<stem>.jsonl``: part of that
    session. A directory import skipped them; the follower (on a change event) and a glob
    took them up as sessions of their own."""
    root = tmp_path / "sessions"
    main = root / "p" / "2026-01-01T00-00-00-000Z_main1.jsonl"
    write(main, [header("main1"), message(1, None)])
    sidecar = main.with_suffix("") / "1-explore.jsonl"
    write(sidecar, [header("sub1"), message(1, None)])
    assert session_files([root]).files == [main]
    assert session_files([f"{root}/**/*.jsonl"]).files == [main]
    with following(store, root):
        wait_for(lambda: head_of(store, "main1") == 2, 10, "the session file imported")
        write(sidecar, [message(2, "m1")], mode="a")  # a change event for the sidecar
        write(main, [message(2, "m1")], mode="a")
        wait_for(lambda: head_of(store, "main1") == 3, 10, "the session's new line")
    assert store.journal.find_external(TENANT, "sub1") is None


def test_a_transient_failure_is_tried_again_without_a_change(
    store: SessionStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The database away for a moment while the agent's last lines are imported: the next
    rescan takes them up, though the file never changes again (before, its size counted
    as seen until it changed, so the journal missed the tail while the watcher ran)."""
    root = tmp_path / "sessions"
    path = root / "2026-01-01T00-00-00-000Z_w1.jsonl"
    write(path, [header("w1"), message(1, None)])
    real = store.append
    failures = []

    def away_once(*args: Any, **kwargs: Any) -> Any:
        if not failures:
            failures.append(1)
            raise StorageUnavailable("database")
        return real(*args, **kwargs)

    with following(store, root) as errors:
        wait_for(lambda: head_of(store, "w1") == 2, 10, "the first lines imported")
        monkeypatch.setattr(store, "append", away_once)
        write(path, [message(2, "m1"), message(3, "m2")], mode="a")  # then no more changes
        wait_for(lambda: head_of(store, "w1") == 4, 10, "the tail taken up on a rescan")
    assert failures == [1] and len(errors) == 1


def test_an_unexpected_error_in_one_file_never_stops_the_others(
    store: SessionStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "sessions"
    bad = root / "2026-01-01T00-00-00-000Z_bad.jsonl"
    good = root / "2026-01-01T00-00-01-000Z_good.jsonl"
    write(bad, [header("bad"), message(1, None)])
    write(good, [header("good"), message(1, None)])
    real = importer.import_session

    def defect(store_: SessionStore, path: Path, **kwargs: Any) -> Any:
        if path.name == bad.name:
            raise RuntimeError("a defect")
        return real(store_, path, **kwargs)

    monkeypatch.setattr("core.interop.watch.import_session", defect)
    with following(store, root) as errors:
        wait_for(lambda: head_of(store, "good") == 2, 10, "the good file imported")
        write(good, [message(2, "m1")], mode="a")
        wait_for(lambda: head_of(store, "good") == 3, 10, "the good file followed on")
    assert any("RuntimeError: a defect" in e.message for e in errors)


def test_a_parent_ref_through_a_link_loop_links_nothing(
    store: SessionStore, tmp_path: Path
) -> None:
    """pi's ``parentSession`` naming a path through a loop of symlinks: the session is
    imported unlinked (Path.resolve raised RuntimeError, which the import, and the
    follower, let through)."""
    (tmp_path / "loopA").symlink_to(tmp_path / "loopB")
    (tmp_path / "loopB").symlink_to(tmp_path / "loopA")
    path = tmp_path / "2026-01-01T00-00-00-000Z_c1.jsonl"
    parent = str(tmp_path / "loopA" / "2026-01-01T00-00-00-000Z_p1.jsonl")
    write(path, [header("c1", parentSession=parent), message(1, None)])
    result = store.import_session(path, tenant_id=TENANT)
    assert result.status == "created"
    session = store.get_session(result.session_id)
    assert session.parent_id is None and session.head_seq == 2


def test_a_linked_directory_is_not_followed_as_a_scan_does_not(
    store: SessionStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A scan (``Path.rglob``) does not enter a linked directory; the watcher (inotify)
    does, and the follower imported what changed there: now neither does."""
    root = tmp_path / "sessions"
    main = root / "2026-01-01T00-00-00-000Z_main1.jsonl"
    write(main, [header("main1"), message(1, None)])
    outside = tmp_path / "outside" / "2026-01-01T00-00-00-000Z_out1.jsonl"
    write(outside, [header("out1"), message(1, None)])
    (root / "linked").symlink_to(outside.parent)
    assert session_files([root]).files == [main]
    watching = threading.Event()
    real_watch = watchfiles.watch

    def watch(*args: Any, **kwargs: Any) -> Iterator[Any]:
        for changes in real_watch(*args, **kwargs):
            watching.set()  # its first answer: the watcher is set up
            yield changes

    monkeypatch.setattr(watchfiles, "watch", watch)
    with following(store, root):
        wait_for(lambda: head_of(store, "main1") == 2, 10, "the session file imported")
        wait_for(watching.is_set, 10, "the watcher set up")
        write(outside, [message(2, "m1")], mode="a")  # a change event under the link
        write(main, [message(2, "m1")], mode="a")
        wait_for(lambda: head_of(store, "main1") == 3, 10, "the session's new line")
    assert store.journal.find_external(TENANT, "out1") is None


def test_following_a_missing_directory_is_refused_naming_it(
    store: SessionStore, tmp_path: Path
) -> None:
    """``UnreadableFile`` naming the path, at once: watchfiles passes over a path it cannot
    read (so that a locked sub-directory does not end the follow), a missing one too, and
    the follower followed nothing without a word until stopped."""
    missing = tmp_path / "missing"
    stop = threading.Event()
    timer = threading.Timer(5, stop.set)  # the follow the defect was, ended
    timer.start()
    try:
        with pytest.raises(UnreadableFile) as raised:
            Follower(store, missing, tenant_id=TENANT).run(stop)
    finally:
        timer.cancel()
    assert raised.value.path == str(missing)
    assert raised.value.message == f"cannot read {missing}: No such file or directory"


def test_a_file_name_that_is_not_utf8_never_ends_the_follow(
    store: SessionStore, tmp_path: Path
) -> None:
    """The change notifier (watchfiles) stops on a change to a file whose name is not UTF-8
    ("Unable to decode path"), and the follow ended with its traceback: one such name
    anywhere below the directory (a .txt, a subagent's file) stopped all following. The
    follower now goes on by rescans: later lines of every file are still imported, the
    oddly named session file's too."""
    root = tmp_path / "sessions"
    plain = root / "p" / "plain.jsonl"
    write(plain, [header("plain1"), message(1, None)])
    odd = Path(os.fsdecode(bytes(root / "p") + b"/odd-\xff.jsonl"))
    with following(store, root) as errors:
        wait_for(lambda: head_of(store, "plain1") == 2, 10, "the first file imported")
        Path(os.fsdecode(bytes(root / "p") + b"/caf\xe9.txt")).write_bytes(b"x")
        write(odd, [header("odd1"), message(1, None)])
        wait_for(lambda: head_of(store, "odd1") == 2, 15, "the oddly named file imported")
        write(plain, [message(2, "m1")], mode="a")
        write(odd, [message(2, "m1")], mode="a")
        wait_for(lambda: head_of(store, "plain1") == 3, 15, "the first file's next line")
        wait_for(lambda: head_of(store, "odd1") == 3, 15, "the odd file's next line")
    assert errors == []


def test_a_file_whose_first_line_is_still_coming_is_no_failure(
    store: SessionStore, tmp_path: Path
) -> None:
    """A session file just made (empty), or with its first line half written (a large
    first line is written in pieces), was reported as 'not a session file of a known
    format' on every pass until the line ended. It now waits in silence, and is imported
    once the line is whole. A file whose lines are whole and of no format is still
    reported."""
    root = tmp_path / "sessions"
    root.mkdir()
    empty, half, junk = root / "empty.jsonl", root / "half.jsonl", root / "junk.jsonl"
    empty.touch()
    first = json.dumps(header("half1")) + "\n"
    half.write_text(first[:40])
    bom = root / "bom.jsonl"  # a BOM, then the start of the line: as pi trims, waited on
    bom_first = json.dumps(header("bom1")) + "\n"
    bom.write_bytes(b"\xef\xbb\xbf" + bom_first[:40].encode())
    with following(store, root) as errors:
        time.sleep(2.5)  # two rescans, and the change events of the writes
        assert errors == []
        with half.open("a") as out:
            out.write(first[40:] + json.dumps(message(1, None)) + "\n")
        with bom.open("a") as out:
            out.write(bom_first[40:])
        wait_for(lambda: head_of(store, "half1") == 2, 15, "the file, once its line is whole")
        wait_for(lambda: head_of(store, "bom1") == 1, 15, "the BOM file, once its line is whole")
        junk.write_text('{"no": "format"}\n')
        # no line break, and yet no line still coming: a whole object (pi reads it as a
        # line), a crash's NUL bytes
        (root / "whole.jsonl").write_text('{"no": "format"}')
        (root / "nuls.jsonl").write_bytes(b"\0" * 4096)
        wait_for(lambda: len(errors) >= 3, 15, "the three files of no format reported")
    assert [type(e).__name__ for e in errors] == ["ImportFormatError"] * 3, errors
    assert sorted(Path(e.field).name for e in errors if isinstance(e, InvalidEvent)) == [
        "junk.jsonl",
        "nuls.jsonl",
        "whole.jsonl",
    ]


def test_what_the_follower_logs_names_the_file(
    store: SessionStore, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A CLI follow printed a bare "import failed" (a warning, with no file) beside its
    own line naming the file, and "lines with invalid UTF-8 were read..." with no file
    either. A failure reported to ``on_error`` is logged at info level, naming the file; the
    UTF-8 warning names it."""
    root = tmp_path / "sessions"
    root.mkdir()
    (root / "junk.jsonl").write_text('{"no": "format"}\n')
    bad = root / "bad.jsonl"
    bad.write_bytes(json.dumps(header("bad1")).encode() + b'\n{"type": "x\xff"}\n')
    caplog.set_level("INFO", logger="core.interop")
    with following(store, root) as errors:
        wait_for(lambda: head_of(store, "bad1") == 2 and bool(errors), 15, "both files passed")
    failed = [r for r in caplog.records if "failed" in r.getMessage()]
    assert [(r.levelname, r.getMessage()) for r in failed] == [
        ("INFO", f"import of {str(root / 'junk.jsonl')!r} failed")
    ]
    utf8 = [r.getMessage() for r in caplog.records if "invalid UTF-8" in r.getMessage()]
    assert utf8 and all(m.startswith(f"{str(bad)!r}: ") for m in utf8), utf8


def test_the_follower_knows_which_files_still_fail(store: SessionStore, tmp_path: Path) -> None:
    """``Follower.failing``: the files whose last import failed, with the error (the CLI
    ends a follow with their highest exit code). A file imported since, one with no line
    yet, and one removed no longer count."""
    root = tmp_path / "sessions"
    root.mkdir()
    junk, gone, empty = root / "junk.jsonl", root / "gone.jsonl", root / "empty.jsonl"
    junk.write_text('{"no": "format"}\n')
    gone.write_text('{"no": "format either"}\n')
    empty.write_text('{"no": "x"}\n')  # fails, then is emptied: no line yet
    said: list[tuple[str, str]] = []
    follower = Follower(
        store, root, tenant_id=TENANT, on_error=lambda p, e: said.append((p.name, e.message))
    )
    follower.scan()
    assert sorted(p.name for p in follower.failing) == ["empty.jsonl", "gone.jsonl", "junk.jsonl"]
    assert all(isinstance(e, InvalidEvent) for e in follower.failing.values())
    # a file that grows and fails as before is not said again (nor is one read again
    # because its size was taken before a write its failed read saw): a new failure is
    with junk.open("a") as out:
        out.write('{"still": "no format"}\n')
    write(gone, [header("nul\0id")])  # a session file now, which fails otherwise
    follower.scan()
    no_format = "not a session file of a known format"
    assert sorted(said) == sorted(
        [
            ("empty.jsonl", f"invalid event at {empty}: {no_format}"),
            ("gone.jsonl", f"invalid event at {gone}: {no_format}"),
            (
                "gone.jsonl",
                f"invalid event at /id: {gone}: the session's external_id contains U+0000, "
                "which a session cannot hold",
            ),
            ("junk.jsonl", f"invalid event at {junk}: {no_format}"),
        ]
    )
    write(junk, [header("fixed1"), message(1, None)])  # the agent's session after all
    gone.unlink()
    empty.write_text("")
    follower.scan()
    assert follower.failing == {} and head_of(store, "fixed1") == 2


def test_a_file_rewritten_at_the_same_size_is_imported_again(
    store: SessionStore, tmp_path: Path
) -> None:
    """A rescan compared sizes only: a file rewritten at its size (by then of another
    content) was not imported again until it grew, which, with the change notifier stopped
    (a file name not UTF-8), the follower never learned otherwise. Its time counts too."""
    root = tmp_path / "sessions"
    root.mkdir()
    path = root / "s.jsonl"
    session = (json.dumps(header("same1")) + "\n").encode()
    path.write_bytes(b"{" + b" " * (len(session) - 3) + b"}\n")  # a line of no format
    follower = Follower(store, root, tenant_id=TENANT)
    follower.scan()
    assert list(follower.failing) == [path]
    before = path.stat()
    path.write_bytes(session)  # the same size, as a session file
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000))
    assert path.stat().st_size == before.st_size
    follower.scan()
    assert follower.failing == {} and head_of(store, "same1") == 1


CLAUDE_FIXTURE = (
    Path(__file__).resolve().parents[1]
    / "fixtures"
    / "claude_code"
    / "7d3c5e2a-91f4-4b6e-8a0d-2c1f9e8b7a60.jsonl"
)


@pytest.mark.parametrize("first_lines", [1, 2], ids=["summary", "summary+snapshot"])
def test_a_new_claude_code_file_waits_for_the_line_that_gives_its_header(
    store: SessionStore, tmp_path: Path, first_lines: int
) -> None:
    """Claude Code writes a file's first lines (a summary, a file-history snapshot) before
    the prompt's, and they carry no time nor working directory. A follower's first pass
    made the session from them, and its header (seq 1, never rewritten) kept
    ``"timestamp": null, "cwd": ""`` in every export (``export --format omp`` named the file
    ``_<id>.jsonl``). A file written to a moment ago now waits for the line that gives them;
    an older one (a summary alone, for good) is imported at once, as before."""
    root = tmp_path / "sessions"
    root.mkdir()
    lines = CLAUDE_FIXTURE.read_bytes().split(b"\n")
    path = root / CLAUDE_FIXTURE.name
    path.write_bytes(b"\n".join(lines[:first_lines]) + b"\n")
    said: list[SessionStoreError] = []
    follower = Follower(store, root, tenant_id=TENANT, on_error=lambda p, e: said.append(e))
    follower.scan()
    follower.scan()  # unchanged and still young: waits on (not read again)
    session_id = CLAUDE_FIXTURE.stem
    assert store.journal.find_external(TENANT, session_id) is None
    assert (said, follower.failing) == ([], {})
    path.write_bytes(CLAUDE_FIXTURE.read_bytes())
    follower.scan()
    stored = stored_header(store, TENANT, session_id)
    assert (stored["timestamp"], stored["cwd"]) == (
        "2026-01-20T09:00:00.000Z",
        "/home/dev/dateparse",
    )
    old = root / "old" / "0b9e4f31-5c2d-4e8a-9f17-6a3b2c1d0e9f.jsonl"
    old.parent.mkdir()
    old.write_bytes(lines[0] + b"\n")
    os.utime(old, (time.time() - 7200, time.time() - 7200))  # last written two hours ago
    ahead = root / "ahead" / "1c2d3e4f-5a6b-4c7d-8e9f-0a1b2c3d4e5f.jsonl"
    ahead.parent.mkdir()
    ahead.write_bytes(lines[0] + b"\n")
    os.utime(ahead, (time.time() + 86400, time.time() + 86400))  # a clock ahead: no wait
    ending = root / "ending" / "2d3e4f5a-6b7c-4d8e-9f0a-1b2c3d4e5f6a.jsonl"
    ending.parent.mkdir()
    ending.write_bytes(lines[0] + b"\n")
    os.utime(ending, (time.time() - 59, time.time() - 59))  # its wait ends in a second
    follower.scan()
    for done in (old, ahead):
        aged = store.journal.find_external(TENANT, done.stem)
        assert aged is not None and aged.head_seq == 2, (done, aged)  # header and summary
    assert store.journal.find_external(TENANT, ending.stem) is None
    time.sleep(1.5)
    follower.scan()  # unchanged, but its wait is over: imported as it is
    assert store.journal.find_external(TENANT, ending.stem) is not None
    # a line with a time and no working directory (a queue operation): still waiting
    queued = root / "queued" / CLAUDE_FIXTURE.name
    queued.parent.mkdir()
    user = json.loads(lines[2])
    operation = {"type": "queue-operation", "operation": "dequeue", "sessionId": session_id}
    queued.write_text(json.dumps({**operation, "timestamp": user["timestamp"]}) + "\n")
    follower.tenant_id = "queued"
    follower.scan()
    assert store.journal.find_external("queued", session_id) is None
    with queued.open("a") as out:
        out.write(json.dumps(user) + "\n")
    follower.scan()
    assert stored_header(store, "queued", session_id)["cwd"] == user["cwd"]


def test_what_an_import_before_a_follow_leaves_to_it(tmp_path: Path) -> None:
    """``import PATHS --watch DIR``: the files the follow lists are its own (its first scan
    imports them), named there or through a link; a file it does not list (outside, or in a
    linked directory, which a follow does not enter) is the import's. Compared as text, a
    file named through a link to DIR was said twice and counted after it was imported, and
    one in a linked directory was taken for the follow's, which never saw it."""
    from tasks.cli.interop import _not_followed

    root, other = tmp_path / "s", tmp_path / "other"
    write(root / "a.jsonl", [header("a1")])
    write(other / "b.jsonl", [header("b1")])
    (tmp_path / "ls").symlink_to(root)
    (root / "linked").symlink_to(other)
    named = [tmp_path / "ls" / "a.jsonl", root / "a.jsonl", root / "linked" / "b.jsonl"]
    # a file named below it that is not there yet is the follow's too (it imports it once
    # it is: its "cannot read" was counted after that)
    later, elsewhere = root / "later.jsonl", tmp_path / "nowhere.jsonl"
    # but one the follow would not import (no session file's name, in a linked directory,
    # in a session's artifacts) is the import's, to say it cannot be read (a review's)
    write(root / "a" / "keep.jsonl", [header("k1")])  # a.jsonl's artifacts directory
    never = [
        root / "typo.txt",
        root / "linked" / "new.jsonl",
        root / "a" / "sub.jsonl",
        root / "a.jsonl" / "x.jsonl",  # below a file: never there
    ]
    files, unlisted = _not_followed([*named, other / "b.jsonl", later, elsewhere, *never], [], root)
    assert unlisted == []
    assert files == [root / "linked" / "b.jsonl", other / "b.jsonl", elsewhere, *never]


def test_a_pass_that_appends_nothing_is_said_too(store: SessionStore, tmp_path: Path) -> None:
    """The follower passed on only the passes that appended: a line appended that holds no
    entry (never imported) went unsaid, as did the first pass over a file imported before
    (no record, where a one-shot import says "unchanged"). Every pass is said."""
    root = tmp_path / "sessions"
    path = root / "s.jsonl"
    write(path, [header("quiet1"), message(1, None)])
    store.import_session(path, tenant_id=TENANT)
    results: list[ImportResult] = []
    follower = Follower(store, root, tenant_id=TENANT, on_result=results.append)
    follower.scan()
    assert [(r.status, r.appended) for r in results] == [("unchanged", 0)]
    with path.open("a") as out:
        out.write("not json\n")
    follower.scan()
    assert [(r.status, r.appended) for r in results[1:]] == [("unchanged", 0)]
    assert [(line.line, line.reason) for line in results[1].ignored_lines] == [(3, "not JSON")]


def test_a_change_of_mode_alone_is_no_pass(store: SessionStore, tmp_path: Path) -> None:
    """Every pass is said (d62e926), and a change event brought a pass whatever changed:
    a chmod, or a touch to the same time, printed "unchanged" records (a review's). A
    change event imports a file whose size or time changed, as a rescan does."""
    root = tmp_path / "sessions"
    path = root / "s.jsonl"
    write(path, [header("mode1"), message(1, None)])
    results: list[ImportResult] = []
    with following(store, root, results):
        wait_for(lambda: len(results) == 1, 15, "the first pass said")
        stamp = path.stat()
        path.chmod(0o600)
        path.chmod(0o644)
        os.utime(path, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
        time.sleep(2.5)  # the change events, and two rescans
        assert len(results) == 1, results
        with path.open("a") as out:
            out.write(json.dumps(message(2, "m1")) + "\n")
        wait_for(lambda: len(results) == 2, 15, "the appended line's pass said")
    assert [(r.status, r.appended) for r in results] == [("created", 2), ("appended", 1)]
