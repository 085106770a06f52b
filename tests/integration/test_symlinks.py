"""Invariant 9: no symlink under the data root is ever followed (issue 16, item 3).

A property test plants a symlink (absolute, relative, to a directory, to ``..``) at every
artifact path kind and at directory components, then runs resolve, get, put, delete, fork
copy, move, expire and session delete. Sentinel files outside the session directory (outside
the data root, and in another tenant's session) keep their content, mtime and existence,
and no file appears next to them.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from core import SessionStore
from core.artifacts import inherited, session_dir
from core.artifacts.fsio import sweep_staging
from core.artifacts.paths import OVERSIZED_DIR, STAGING_DIR, oversized_name
from core.blobs.files import FileBlobStore
from core.blobs.store import CORRUPT_DIR, sha256_hex
from core.blobs.verify import verify_blobs
from core.errors import BlobCorrupted, ForkCopyBlocked, SessionStoreError, SymlinkRefused
from core.models import utcnow
from core.records import Session
from tests.contract.test_fork import defer_copies
from tests.support import blobs_in_distinct_fanouts, watch_log

# where the link goes (relative to the session directory), and what it replaces
PLACES = {
    "tool_log": "0.bash.log",
    "agent_output": "AGENT",  # filled in: the agent output's file name
    "file": "files/notes/plan.md",
    "oversized": "OVERSIZED",  # filled in: oversized/<art_id>.txt
    "files_component": "files/notes",
    "files_dir": "files",
    "staging_dir": STAGING_DIR,
    "oversized_dir": OVERSIZED_DIR,
    "session_dir": "",
    "fork_files_dir": "FORK/files",  # in the pending fork's (not yet copied) directory
    "move_target_tenant": "MOVE_TARGET",  # the tenant directory a move renames into
}
LINK_KINDS = ["absolute_file", "absolute_dir", "relative_dir", "dotdot", "dotdot_dotdot"]


def _snapshot(*roots: Path) -> dict[str, tuple[bytes, int]]:
    seen: dict[str, tuple[bytes, int]] = {}
    for root in roots:
        for path in sorted(root.rglob("*")):
            if path.is_file() and not path.is_symlink():
                seen[str(path)] = (path.read_bytes(), path.stat().st_mtime_ns)
            elif path.is_dir() and not path.is_symlink():
                seen[str(path)] = (b"<dir>", 0)
    return seen


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def _plant(link: Path, kind: str, outside: Path) -> None:
    _remove(link)
    link.parent.mkdir(parents=True, exist_ok=True)
    target: str
    if kind == "absolute_file":
        target = str(outside / "secret.txt")
    elif kind == "absolute_dir":
        target = str(outside)
    elif kind == "relative_dir":
        target = os.path.relpath(outside, link.parent)
    elif kind == "dotdot":
        target = ".."
    else:
        target = "../.."
    os.symlink(target, link)


def _quietly(action: Callable[[], Any]) -> None:
    try:
        action()
    except (SessionStoreError, OSError):
        pass  # refused: what matters is what did (not) happen outside


@pytest.mark.slow
@hsettings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(place=st.sampled_from(sorted(PLACES)), kind=st.sampled_from(LINK_KINDS))
def test_a_planted_symlink_never_leads_outside_the_session_directory(
    store: SessionStore, tmp_path_factory: pytest.TempPathFactory, place: str, kind: str
) -> None:
    root = store.settings.resolved_artifact_root
    outside = tmp_path_factory.mktemp("outside")
    (outside / "secret.txt").write_text("SECRET")
    (outside / "files" / "notes").mkdir(parents=True)
    (outside / "files" / "notes" / "plan.md").write_text("OUTSIDE PLAN")
    (outside / "0.bash.log").write_text("OUTSIDE LOG")
    (outside / "left-over.tmp").write_text("NOT A STAGING FILE")
    neighbour = store.create_session(tenant_id="neighbour")
    store.artifacts(neighbour.id).files.put("notes/plan.md", "NEIGHBOUR PLAN")
    store.artifacts(neighbour.id).save("NEIGHBOUR LOG", "bash")
    neighbour_dir = session_dir(root, "neighbour", neighbour.id)

    session = store.create_session(tenant_id="acme")
    artifacts = store.artifacts(session.id)
    assert artifacts.save("tool output", "bash") == "0"
    agent_id = artifacts.save_agent_output("review", "# review", jsonl='{"a": 1}\n')
    artifacts.files.put("notes/plan.md", "the plan")
    stored = store.store_oversized(session.id, "z" * 13_000, "grep")
    assert stored is not None
    oversized = stored.ref.artifact_id
    defer_copies(store)
    fork = store.fork(session.id)
    own = session_dir(root, "acme", session.id)
    agent_file = next(p.name for p in own.iterdir() if p.name.endswith(".md"))
    move_tenant = f"target-{os.urandom(4).hex()}"

    relative = PLACES[place]
    if place == "agent_output":
        link = own / agent_file
    elif place == "oversized":
        link = own / oversized_name(oversized)
    elif place == "fork_files_dir":
        link = session_dir(root, "acme", fork.id) / "files"
    elif place == "move_target_tenant":
        link = session_dir(root, move_tenant, session.id).parent
    else:
        link = own / relative if relative else own
    before = _snapshot(outside, neighbour_dir)
    _plant(link, kind, outside)

    steps: list[Callable[[], Any]] = [
        lambda: store.resolve("artifact://0", session_id=session.id),
        lambda: store.resolve(f"agent://{agent_id}", session_id=session.id),
        lambda: store.resolve(oversized, session_id=session.id),
        lambda: store.retrieve(oversized, session_id=session.id),
        lambda: store.artifacts(session.id).files.get("notes/plan.md"),
        lambda: store.artifacts(fork.id).files.get("notes/plan.md"),
        lambda: store.resolve("artifact://0", session_id=fork.id),
        lambda: store.artifacts(session.id).files.put("notes/plan.md", "REWRITTEN"),
        lambda: store.artifacts(session.id).files.put("notes/new.md", "NEW"),
        lambda: store.artifacts(session.id).save("MORE OUTPUT", "bash"),
        lambda: store.copy_fork_artifacts(fork.id),
        lambda: store.artifacts(session.id).files.delete("notes/plan.md"),
        lambda: store.move(session.id, tenant_id=move_tenant),
        lambda: store.oversized.expire(now=utcnow() + timedelta(days=365), apply=True),
        lambda: store.expire_artifacts(apply=True),  # also sweeps staging directories
        lambda: store.delete_session(fork.id),
        lambda: store.delete_session(session.id),
    ]
    for step in steps:
        _quietly(step)

    assert _snapshot(outside, neighbour_dir) == before
    assert (outside / "secret.txt").read_text() == "SECRET"
    assert store.artifacts(neighbour.id).files.get("notes/plan.md") == b"NEIGHBOUR PLAN"


def _forked_with_a_secret_beside(
    store: SessionStore, tmp_path: Path
) -> tuple[Path, Session, Session]:
    """A parent with a file and a saved tool output, forked with its copy deferred, and
    ``tmp_path/secret.txt`` outside the artifact root to point links at."""
    (tmp_path / "secret.txt").write_text("SECRET")
    parent = store.create_session(tenant_id="acme")
    store.artifacts(parent.id).files.put("notes/plan.md", "the plan")
    store.artifacts(parent.id).save("tool output", "bash")
    defer_copies(store)
    return store.settings.resolved_artifact_root, parent, store.fork(parent.id)


def test_fork_copy_skips_a_symlink_and_says_so(store: SessionStore, tmp_path: Path) -> None:
    root, parent, fork = _forked_with_a_secret_beside(store, tmp_path)
    log = session_dir(root, "acme", parent.id) / "0.bash.log"
    log.unlink()
    os.symlink(tmp_path / "secret.txt", log)

    report = store.copy_fork_artifacts(fork.id)

    assert len(report.skipped_symlinks) == 1 and "0.bash.log" in report.skipped_symlinks[0]
    assert report.to_dict()["skipped_symlinks"] == report.skipped_symlinks
    fork_dir = session_dir(root, "acme", fork.id)
    assert not (fork_dir / "0.bash.log").exists()
    assert (fork_dir / "files" / "notes" / "plan.md").read_text() == "the plan"
    with pytest.raises(SessionStoreError):
        store.resolve("artifact://0", session_id=parent.id)


def _reconcile(store: SessionStore, fork_id: str) -> dict[str, Any]:
    """What the reconciler does for a pending fork: find it, run its copy."""
    assert fork_id in store.pending_forks(older_than_s=0)
    return store.copy_fork_artifacts(fork_id).to_dict()


def test_a_linked_fork_directory_is_no_copy_and_the_copy_ends_once_it_is_removed(
    store: SessionStore,
) -> None:
    """The fork's directory is a link to another tenant's session directory holding a file
    of the same name: that file is neither taken for the fork's copy nor read nor served,
    the copy stays pending, and once the link is removed it completes with the parent's
    bytes."""
    root = store.settings.resolved_artifact_root
    neighbour = store.create_session(tenant_id="other")
    store.artifacts(neighbour.id).files.put("notes/plan.md", "NEIGHBOUR PLAN")
    parent = store.create_session(tenant_id="acme")
    store.artifacts(parent.id).files.put("notes/plan.md", "the plan")
    defer_copies(store)
    fork = store.fork(parent.id)
    fork_dir = session_dir(root, "acme", fork.id)
    fork_dir.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(session_dir(root, "other", neighbour.id), fork_dir)
    before = _snapshot(session_dir(root, "other", neighbour.id))

    report = store.copy_fork_artifacts(fork.id)

    assert (report.status, report.copied, report.already_present) == ("pending", 0, 0)
    assert len(report.skipped_symlinks) == 1 and str(fork_dir) in report.skipped_symlinks[0]
    assert "symlink" in (store.get_session(fork.id).copy_error or "")
    with pytest.raises(SessionStoreError):
        store.artifacts(fork.id).files.get("notes/plan.md")
    assert _snapshot(session_dir(root, "other", neighbour.id)) == before

    fork_dir.unlink()  # the README's remedy
    again = _reconcile(store, fork.id)

    assert (again["status"], again["copied"], again["skipped_symlinks"]) == ("copied", 1, [])
    assert store.get_session(fork.id).copy_error is None
    assert store.artifacts(fork.id).files.get("notes/plan.md") == b"the plan"
    assert (fork_dir / "files" / "notes" / "plan.md").read_text() == "the plan"
    assert store.artifacts(neighbour.id).files.get("notes/plan.md") == b"NEIGHBOUR PLAN"


@pytest.mark.parametrize("action", ["delete", "move"])
def test_a_fork_copy_blocked_by_a_link_names_it_to_the_parent_s_delete_and_move(
    store: SessionStore, tmp_path: Path, action: str
) -> None:
    """The parent cannot go (or move) before its fork has its files, and a link planted in
    the fork's directory keeps that copy pending: the delete or move says so, naming the fork
    and the link (it said "fork copies kept starting; retry", which no retry could help),
    and changes nothing. Once the link is removed it succeeds and the fork has its files."""
    root, parent, fork = _forked_with_a_secret_beside(store, tmp_path)
    fork_dir = session_dir(root, "acme", fork.id)
    fork_dir.mkdir(parents=True)
    os.symlink(tmp_path / "secret.txt", fork_dir / "0.bash.log")

    def act() -> None:
        if action == "delete":
            store.delete_session(parent.id)
        else:
            store.move(parent.id, tenant_id="elsewhere")

    with pytest.raises(ForkCopyBlocked) as info:
        act()
    assert info.value.fork_id == fork.id and "0.bash.log" in info.value.paths[0]
    assert fork.id in info.value.message and "symlink" in info.value.message
    assert f"cannot {action}" in info.value.message
    kept = store.get_session(parent.id)
    assert (kept.tenant_id, kept.head_seq) == ("acme", parent.head_seq)
    assert (session_dir(root, "acme", parent.id) / "0.bash.log").exists()
    assert (tmp_path / "secret.txt").read_text() == "SECRET"

    (fork_dir / "0.bash.log").unlink()
    act()
    assert store.artifacts(fork.id).files.get("notes/plan.md") == b"the plan"
    assert (fork_dir / "0.bash.log").read_text() == "tool output"


def test_a_fork_copy_blocked_by_a_link_and_failed_elsewhere_still_blocks_the_delete(
    store: SessionStore, tmp_path: Path
) -> None:
    """The copy skips a linked directory and fails on another file (changed in the parent):
    its status is then "failed", not "pending", and the parent's delete went through,
    taking the only copy of what the link kept the fork from. It is refused the same way."""
    root = store.settings.resolved_artifact_root
    parent = store.create_session(tenant_id="acme")
    store.artifacts(parent.id).files.put("a.md", "A")
    store.artifacts(parent.id).files.put("sub/b.md", "B (only copy)")
    defer_copies(store)
    fork = store.fork(parent.id)
    fork_files = session_dir(root, "acme", fork.id) / "files"
    fork_files.mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    os.symlink(tmp_path / "outside", fork_files / "sub")
    # a.md: "changed in the parent" (its bytes, behind its row) since the fork
    (session_dir(root, "acme", parent.id) / "files" / "a.md").write_bytes(b"Z")

    with pytest.raises(ForkCopyBlocked):
        store.delete_session(parent.id)
    assert store.get_session(fork.id).copy_status == "failed"
    (fork_files / "sub").unlink()
    assert store.artifacts(fork.id).files.get("sub/b.md") == b"B (only copy)"
    store.delete_session(parent.id)  # the link gone, b.md is copied: nothing is lost
    assert store.artifacts(fork.id).files.get("sub/b.md") == b"B (only copy)"


def test_what_a_parent_held_for_a_fork_goes_with_the_fork(
    store: SessionStore, tmp_path: Path
) -> None:
    """A parent's rewrite held the inherited file for a fork whose directory was a link;
    deleting the fork before its copy completes removes that held copy too (it stayed in
    the parent for good, found by nothing, counted by no quota)."""
    root = store.settings.resolved_artifact_root
    (tmp_path / "outside").mkdir()
    parent = store.create_session(tenant_id="acme")
    store.artifacts(parent.id).files.put("big.bin", b"x" * 50_000)
    defer_copies(store)
    fork = store.fork(parent.id)
    fork_dir = session_dir(root, "acme", fork.id)
    fork_dir.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(tmp_path / "outside", fork_dir)
    store.artifacts(parent.id).files.put("big.bin", b"y" * 10)  # held for the fork
    _rewritten_after_the_fork(session_dir(root, "acme", parent.id), "files/big.bin")
    held = inherited.held_dir(session_dir(root, "acme", parent.id), fork.id)
    assert [p.name for p in held.rglob("*") if p.is_file()] == ["big.bin"]
    fork_dir.unlink()

    store.delete_session(fork.id)

    assert not held.exists()
    assert store.artifacts(parent.id).files.get("big.bin") == b"y" * 10


def test_a_link_at_one_fork_file_skips_that_file_only(store: SessionStore, tmp_path: Path) -> None:
    """A link planted where one inherited file goes (pointing outside the session
    directory) skips that file; the others are copied, the copy stays pending, and once the
    link is removed the reconciler's run copies the parent's bytes."""
    root, _, fork = _forked_with_a_secret_beside(store, tmp_path)
    fork_dir = session_dir(root, "acme", fork.id)
    fork_dir.mkdir(parents=True)
    os.symlink(tmp_path / "secret.txt", fork_dir / "0.bash.log")

    report = store.copy_fork_artifacts(fork.id)

    assert (report.status, report.copied, report.already_present) == ("pending", 1, 0)
    assert len(report.skipped_symlinks) == 1 and "0.bash.log" in report.skipped_symlinks[0]
    assert (fork_dir / "files" / "notes" / "plan.md").read_text() == "the plan"
    assert (tmp_path / "secret.txt").read_text() == "SECRET"
    with pytest.raises(SessionStoreError):
        store.resolve("artifact://0", session_id=fork.id)

    (fork_dir / "0.bash.log").unlink()
    again = _reconcile(store, fork.id)

    assert (again["status"], again["copied"], again["already_present"]) == ("copied", 1, 1)
    assert store.resolve("artifact://0", session_id=fork.id).content == "tool output"
    assert (fork_dir / "0.bash.log").read_text() == "tool output"
    assert (tmp_path / "secret.txt").read_text() == "SECRET"


def test_the_staging_sweep_never_follows_a_linked_staging_directory(
    store: SessionStore, tmp_path: Path
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.tmp").write_text("PRECIOUS")
    root = store.settings.resolved_artifact_root
    session = store.create_session(tenant_id="acme")
    store.artifacts(session.id).files.put("a.txt", "a")
    staging = session_dir(root, "acme", session.id) / STAGING_DIR
    _remove(staging)
    os.symlink(outside, staging)
    files, _ = sweep_staging(root, older_than_s=0, apply=True, now=time.time() + 10**6)
    assert files == 0
    assert (outside / "precious.tmp").read_text() == "PRECIOUS"


# The directory components a racing attacker swaps for a link, relative to the session
# directory ("" is the session directory itself).
RACED = {"files_component": "files/notes", "staging_dir": STAGING_DIR, "session_dir": ""}


@pytest.mark.slow
@pytest.mark.parametrize("place", sorted(RACED))
def test_a_directory_swapped_for_a_link_mid_operation_is_never_followed(
    store: SessionStore, tmp_path: Path, place: str
) -> None:
    """No time-of-check/time-of-use window: a thread keeps swapping a directory component
    between the real directory and a link to an outside directory while writes, rewrites,
    deletes, spills, expiry and a fork copy run. Nothing outside is ever created, changed
    or removed; the operations either succeed or fail with a typed error."""
    import threading

    outside = tmp_path / "outside"
    (outside / "notes").mkdir(parents=True)
    (outside / "notes" / "plan.md").write_bytes(b"outside: must stay")
    (outside / "sentinel").write_bytes(b"outside")
    before = _snapshot(outside)

    sid = store.create_session(tenant_id="acme").id
    store.append(sid, [{"type": "custom", "n": 1}])
    artifacts = store.artifacts(sid)
    artifacts.files.put("notes/plan.md", b"inside v0")
    artifacts.save("tool output at the fork", "bash")
    directory = session_dir(store.settings.resolved_artifact_root, "acme", sid)
    target = directory / RACED[place] if RACED[place] else directory
    target.mkdir(parents=True, exist_ok=True)
    aside = target.with_name(target.name + ".real")
    stop = threading.Event()
    swaps = 0

    def swap() -> None:
        nonlocal swaps
        while not stop.is_set():
            try:
                os.rename(target, aside)
            except OSError:  # not there at this instant
                time.sleep(0.0002)
                continue
            try:
                os.symlink(outside, target)
            except FileExistsError:
                pass  # the store made the directory again at once
            time.sleep(0.0005)
            while True:  # put the real directory back, whatever the store made meanwhile
                try:
                    if target.is_symlink():
                        target.unlink()
                    elif target.exists():
                        shutil.rmtree(target, ignore_errors=True)
                    os.rename(aside, target)
                    break
                except OSError:
                    continue
            swaps += 1
            time.sleep(0.0002)

    errors: list[str] = []

    def attempt(action: Callable[[], Any]) -> None:
        try:
            action()
        except (SessionStoreError, OSError) as exc:
            errors.append(f"{type(exc).__name__}: {exc}")

    swapper = threading.Thread(target=swap)
    swapper.start()
    try:
        deadline = time.monotonic() + 3.0
        n = 0
        while time.monotonic() < deadline:
            n += 1
            attempt(lambda n=n: artifacts.files.put("notes/plan.md", f"inside v{n}".encode()))
            attempt(lambda n=n: artifacts.files.put(f"notes/new-{n}.md", b"new"))
            attempt(lambda n=n: artifacts.files.delete(f"notes/new-{n}.md"))
            attempt(lambda: artifacts.save("x" * 200, "bash"))
            attempt(lambda: store.store_oversized(sid, "y" * 13_000, "grep", ttl_s=1))
            attempt(lambda: store.expire_artifacts(apply=True))
            if n % 10 == 0:
                defer_copies(store)
                fork = store.fork(sid)
                attempt(lambda: store.copy_fork_artifacts(fork.id))  # noqa: B023
    finally:
        stop.set()
        swapper.join()
        if target.is_symlink():
            target.unlink()
        if aside.exists() and not target.exists():
            os.rename(aside, target)
    assert _snapshot(outside) == before
    assert not any(p.is_symlink() for p in outside.rglob("*"))
    assert swaps > 20, f"the race barely ran ({swaps} swaps)"
    typed = (
        "SymlinkRefused",
        "InvalidArtifactPath",  # the path check that resolves it met the link
        "ArtifactNotFound",
        "FileNotFoundError",  # a directory vanished under the operation (moved aside)
        "NotADirectoryError",
    )
    assert [e for e in errors if not e.startswith(typed)] == []


# blobs: the same rule under the blob root --------------------------------------------------


def _blob_root(store: SessionStore) -> Path:
    assert isinstance(store.blobs, FileBlobStore)
    return store.blobs.root


def _swap_for_link(directory: Path, outside: Path) -> Path:
    """Move ``directory`` to ``outside`` and leave a link to it in its place."""
    moved = outside / directory.name
    shutil.move(directory, moved)
    os.symlink(moved, directory)
    return moved


@pytest.mark.parametrize("level", [1, 2])
def test_a_blob_write_never_follows_a_linked_fanout_directory(
    store: SessionStore, tmp_path: Path, level: int
) -> None:
    """A planted link as a fan-out directory (``<root>/ab`` or ``<root>/ab/cd``): the put is
    refused with ``SymlinkRefused`` and writes nothing outside; nothing is registered."""
    outside = tmp_path / "outside"
    outside.mkdir()
    content = b"planted fan-out link " * 100
    blob_hash = sha256_hex(content)
    link = _blob_root(store).joinpath(*[blob_hash[0:2], blob_hash[2:4]][:level])
    link.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(outside, link)

    with pytest.raises(SymlinkRefused):
        store.blobs.put(content)
    with pytest.raises(SymlinkRefused):
        store.blobs.get(blob_hash)
    assert list(outside.rglob("*")) == []
    assert store.blobs.info(blob_hash) is None


def test_gc_never_deletes_through_a_linked_fanout_directory(
    store: SessionStore, tmp_path: Path
) -> None:
    """An unreferenced, registered blob whose fan-out directory was swapped for a link to
    a directory outside: GC reports the refusal and keeps the row; the file outside, an
    unregistered blob file and a stale temporary file beside it all stay."""
    outside = tmp_path / "outside"
    outside.mkdir()
    result = store.blobs.put(b"unreferenced content " * 200)
    assert isinstance(store.blobs, FileBlobStore)
    directory = store.blobs.path_for(result.hash, result.codec).parent
    orphan = b"never registered " * 300
    (directory / (sha256_hex(orphan) + ".blob")).write_bytes(orphan)
    (directory / ".tmp-abandoned.part").write_bytes(b"partial")
    old = time.time() - 10 * 3600
    for path in directory.iterdir():
        os.utime(path, (old, old))
    moved = _swap_for_link(directory, outside)
    before = _snapshot(outside)

    report = store.gc_blobs(apply=True, grace=0)
    assert report.deleted == 0 and report.orphans == 0 and report.temp_files == 0
    assert report.error_count == 1 and "refusing a symlink" in report.errors[0]
    assert _snapshot(outside) == before and len(list(moved.iterdir())) == 3
    assert store.blobs.info(result.hash) is not None
    with pytest.raises(SymlinkRefused):
        store.blobs.quarantine_file(result.hash)
    with pytest.raises(SymlinkRefused):
        store.blobs.purge_quarantined([directory / f"{result.hash}.blob.gz.gc"])
    assert _snapshot(outside) == before


def test_blob_verify_never_moves_a_corrupt_blob_through_a_linked_corrupt_directory(
    store: SessionStore, tmp_path: Path
) -> None:
    """``<blob root>/corrupt`` is a planted link: verify reports the link and the blob as
    corrupt, and the corrupt file stays where it is, out of service; nothing lands outside."""
    outside = tmp_path / "outside"
    outside.mkdir()
    result = store.blobs.put(b"some text content " * 200)
    assert isinstance(store.blobs, FileBlobStore)
    path = store.blobs.path_for(result.hash, result.codec)
    data = bytearray(path.read_bytes())
    data[20:24] = b"XXXX"
    path.write_bytes(bytes(data))
    os.symlink(outside, _blob_root(store) / CORRUPT_DIR)

    report = verify_blobs(store.blobs)
    [refused] = report.symlinks  # the link itself, which the quarantine's target is below
    assert refused == str(_blob_root(store) / CORRUPT_DIR)
    assert report.corrupt == [result.hash] and report.quarantined == []
    assert not report.healthy
    assert list(outside.iterdir()) == []
    assert path.read_bytes() == bytes(data)
    with pytest.raises(BlobCorrupted):
        store.blobs.get(result.hash)


def test_blob_verify_reports_a_linked_first_level_directory_once_under_its_own_path(
    store: SessionStore, tmp_path: Path
) -> None:
    """Three blobs under one first-level fan-out directory, which is swapped for a link: one
    link is reported, at that directory (it was three, one per second-level directory
    below it, none of them a link)."""
    blobs = store.blobs
    assert isinstance(blobs, FileBlobStore)
    by_first: dict[str, list[bytes]] = {}
    n = 0
    while not any(len(v) == 3 for v in by_first.values()):
        data = b"blob %d" % n
        n += 1
        digest = sha256_hex(data)
        seconds = {sha256_hex(d)[2:4] for d in by_first.get(digest[:2], [])}
        if digest[2:4] not in seconds:
            by_first.setdefault(digest[:2], []).append(data)
    first, chosen = next((k, v) for k, v in by_first.items() if len(v) == 3)
    for data in chosen:
        blobs.put(data)
    (tmp_path / "outside").mkdir()
    _swap_for_link(blobs.root / first, tmp_path / "outside")

    report = verify_blobs(blobs)

    assert report.symlinks == [str(blobs.root / first)]
    assert report.counts["symlinks"] == 1 and not report.healthy


def test_blob_verify_reports_each_symlink_and_checks_every_other_blob(
    store: SessionStore, tmp_path: Path
) -> None:
    """A link at one blob's file and a linked fan-out directory over another: each is
    reported once (the report is unhealthy), a corrupt blob is still found and quarantined,
    and the good blobs are checked and ok; nothing outside is read or changed."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_bytes(b"not a blob")
    blobs = store.blobs
    assert isinstance(blobs, FileBlobStore)
    contents = [_content(i) for i in range(5)]
    linked_file, linked_dir, corrupt, *good = blobs_in_distinct_fanouts(blobs, contents)
    file_link = blobs.path_for(linked_file.hash, linked_file.codec)
    file_link.unlink()
    os.symlink(outside / "secret.txt", file_link)
    fanout = blobs.path_for(linked_dir.hash, linked_dir.codec).parent
    _swap_for_link(fanout, outside)
    damaged = blobs.path_for(corrupt.hash, corrupt.codec)
    damaged.write_bytes(damaged.read_bytes()[:40])
    before = _snapshot(outside)

    report = verify_blobs(blobs)
    assert sorted(report.symlinks) == sorted([str(file_link), str(fanout)])
    assert report.counts["symlinks"] == 2 and not report.healthy
    assert report.corrupt == [corrupt.hash] and report.counts["quarantined"] == 1
    assert (report.checked, report.ok, report.missing) == (5, 2, [])
    assert report.to_dict()["symlinks_count"] == 2
    assert _snapshot(outside) == before
    assert file_link.is_symlink() and fanout.is_symlink()  # left for the operator
    assert [blobs.get(put.hash) for put in good] == [_content(i) for i in range(3, 5)]


def _rewritten_after_the_fork(parent_dir: Path, *names: str) -> None:
    """Date the parent's rewritten files an hour ahead, so they are newer than the fork
    exactly: the kernel stamps a file from its coarse clock, and a write just after the
    fork may get an earlier time than the fork's (a sleep made that only unlikely). What
    a rewrite held for the fork is the old inode, under another name, and keeps its time."""
    later = time.time() + 3600
    for name in names:
        path = parent_dir / name
        assert path.is_file() and not path.is_symlink(), path
        os.utime(path, (later, later))


def _content(i: int) -> bytes:
    return b"blob %d: " % i + b"the quick brown fox jumps over the lazy dog " * 50


def test_a_linked_pending_fork_directory_never_fails_the_parents_write(
    store: SessionStore, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The parent rewrites (and deletes) artifacts a pending fork inherited while the
    fork's directory is a planted link: the parent's writes succeed, nothing is written
    through the link (its target is unchanged), a warning is logged, the fork's copy stays
    pending, and once the link is removed it completes with the parent's content from
    before the writes."""
    watch_log(caplog, inherited.__name__)
    root = store.settings.resolved_artifact_root
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("SECRET")
    parent = store.create_session(tenant_id="acme")
    artifacts = store.artifacts(parent.id)
    artifacts.files.put("notes/plan.md", "the plan")
    artifacts.files.put("notes/old.md", "old notes")
    artifacts.put_tool_output("0", "bash", "tool output")
    artifacts.put_agent_output("explore", "# findings", jsonl='{"turn": 1}\n')
    defer_copies(store)
    fork = store.fork(parent.id)
    fork_dir = session_dir(root, "acme", fork.id)
    fork_dir.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(outside, fork_dir)
    before = _snapshot(outside)

    artifacts.files.put("notes/plan.md", "the new plan")
    artifacts.files.delete("notes/old.md")
    artifacts.put_tool_output("0", "bash", "new tool output")
    artifacts.put_agent_output("explore", "# new findings", jsonl='{"turn": 2}\n')
    rewritten = ("files/notes/plan.md", "0.bash.log", "explore.md", "explore.jsonl")
    _rewritten_after_the_fork(session_dir(root, "acme", parent.id), *rewritten)

    assert _snapshot(outside) == before
    assert "symlink" in caplog.text and fork.id in str(
        [getattr(r, "fork_id", "") for r in caplog.records]
    )
    assert store.get_session(fork.id).copy_status == "pending"
    assert artifacts.files.get("notes/plan.md") == b"the new plan"

    fork_dir.unlink()  # the README's remedy
    mine = store.artifacts(fork.id)
    assert mine.files.get("notes/plan.md") == b"the plan"  # inherited, while still pending
    again = _reconcile(store, fork.id)

    assert (again["status"], again["skipped_symlinks"]) == ("copied", []), again
    assert mine.files.get("notes/plan.md") == b"the plan"
    assert mine.files.get("notes/old.md") == b"old notes"
    assert store.resolve("artifact://0", session_id=fork.id).content == "tool output"
    assert store.resolve("agent://explore", session_id=fork.id).content == "# findings"
    assert (fork_dir / "explore.jsonl").read_text() == '{"turn": 1}\n'
    assert (fork_dir / "files" / "notes" / "plan.md").read_text() == "the plan"
    assert store.resolve("artifact://0", session_id=parent.id).content == "new tool output"
    assert (
        not (session_dir(root, "acme", parent.id) / STAGING_DIR / "forks")
        .joinpath(fork.id)
        .exists()
    )  # what the parent held for the fork is gone
    assert _snapshot(outside) == before
