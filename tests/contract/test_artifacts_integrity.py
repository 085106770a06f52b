"""An artifact's stored bytes are served only when they are what was written: a file or
object overwritten in place, cut short or extended is ``ArtifactCorrupt``, on every read
path (resolve, ``files.get``, ``retrieve``, ``retrieve_chunks``, the CLI), on file:// and
s3://. A rewrite racing a read is served, not reported; partial reads keep working."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import pytest
from sqlalchemy import update

from core import SessionStore, Settings
from core.artifacts import inherited, objects
from core.artifacts.integrity import digest
from core.artifacts.paths import FILES_DIR, oversized_name
from core.artifacts.storage import key_of
from core.errors import ArtifactCorrupt, UnwritableFile
from core.interop import omp
from core.interop.omp import export_omp
from core.models import ArtifactRow, table_of
from tasks.cli import interop
from tests.cli_process import run_cli
from tests.contract.artifact_backends import (  # the file:// and s3:// backends
    RawArtifacts,
    artifact_backend,
    raw,
    settings,
)
from tests.support import store_env

__all__ = ["artifact_backend", "raw", "settings"]

_artifacts = table_of(ArtifactRow)
TEXT = "the whole output, as it was written\n" * 20


def _tamper(raw: RawArtifacts, path: Path, data: bytes) -> None:
    """``data`` in place of what ``path`` holds: the same inode on disk, a new object on S3."""
    if raw.on_files:
        with open(path, "r+b") as out:
            out.write(data)
            out.truncate()
    else:
        raw.storage.put(key_of(raw.root, path), data)


Reader = Callable[[SessionStore, str], object]


def _tool_output(store: SessionStore, sid: str) -> tuple[Path, Reader]:
    manager = store.artifacts(sid)
    artifact_id = manager.save(TEXT, "bash")
    path = manager.directory() / f"{artifact_id}.bash.log"
    return path, lambda s, i: s.resolve(f"artifact://{artifact_id}", session_id=i).content


def _agent_output(store: SessionStore, sid: str) -> tuple[Path, Reader]:
    manager = store.artifacts(sid)
    output_id = manager.save_agent_output("worker", TEXT, jsonl='{"v":1}\n')
    path = manager.directory() / f"{output_id}.md"
    return path, lambda s, i: s.resolve(f"agent://{output_id}", session_id=i).content


def _file(store: SessionStore, sid: str) -> tuple[Path, Reader]:
    manager = store.artifacts(sid)
    manager.files.put("notes/a.txt", TEXT)
    path = manager.directory() / FILES_DIR / "notes" / "a.txt"
    return path, lambda s, i: s.artifacts(i).files.get("notes/a.txt").decode()


def _oversized(store: SessionStore, sid: str) -> tuple[Path, Reader]:
    stored = store.store_oversized(sid, TEXT * 20, "bash")
    assert stored is not None
    ref = stored.ref.artifact_id
    path = store.artifacts(sid).directory() / oversized_name(ref)
    return path, lambda s, i: s.retrieve(ref, session_id=i)


KINDS = {"tool": _tool_output, "agent": _agent_output, "file": _file, "oversized": _oversized}


DAMAGES: dict[str, Callable[[bytes], bytes]] = {
    "overwritten": lambda data: b"EVIL",
    "truncated": lambda data: data[: len(data) // 2],
    "extended": lambda data: data + b"more",
    "same size": lambda data: data.upper(),
}
# The database does not matter here (the race below runs on both).
SQLITE_ONLY = pytest.mark.parametrize("backend", ["sqlite"])


@SQLITE_ONLY
@pytest.mark.parametrize("kind", KINDS)
def test_bytes_overwritten_in_place_are_refused_not_served(
    store: SessionStore, raw: RawArtifacts, kind: str
) -> None:
    sid = store.create_session(tenant_id="acme").id
    path, read = KINDS[kind](store, sid)
    served = read(store, sid)
    assert served is not None and TEXT in str(served)
    original = raw.read(path)
    assert original is not None
    for name, damage in DAMAGES.items():
        _tamper(raw, path, damage(original))
        with pytest.raises(ArtifactCorrupt, match="is corrupt"):
            read(store, sid)
            pytest.fail(f"{name}: served")
    _tamper(raw, path, original)
    assert read(store, sid) == served


@SQLITE_ONLY
def test_a_row_without_a_digest_still_has_its_size_checked(
    store: SessionStore, raw: RawArtifacts
) -> None:
    """Rows written before digests were recorded (NULL): a size that changed is caught."""
    sid = store.create_session(tenant_id="acme").id
    path, read = _tool_output(store, sid)
    with store.engine.begin() as conn:
        conn.execute(update(_artifacts).values(sha256=None))
    _tamper(raw, path, TEXT.encode()[:-1])
    with pytest.raises(ArtifactCorrupt, match="bytes stored"):
        read(store, sid)


@SQLITE_ONLY
@pytest.mark.parametrize("how", ["write", "put"])
def test_a_damaged_sidecar_is_refused_by_the_export_and_nothing_of_it_served(
    store: SessionStore, raw: RawArtifacts, tmp_path: Path, how: str
) -> None:
    """An agent output's JSONL sidecar is checked against the digest its row records, as
    its markdown is: the oh-my-pi export served it damaged, unchecked (the row's digest
    covered the markdown only). Refused typed, before either file of the output is written;
    a sidecar gone since it was written is refused too."""
    sid = store.create_session(tenant_id="acme").id
    manager = store.artifacts(sid)
    sidecar = b'{"type":"message","text":"the agent\'s own transcript"}\n' * 10
    if how == "write":
        output_id = manager.save_agent_output("worker", TEXT, jsonl=sidecar)
    else:  # an import keeps the source's id
        output_id = "0-worker"
        manager.put_agent_output(output_id, TEXT, jsonl=sidecar)
    path = manager.directory() / f"{output_id}.jsonl"

    def export(name: str) -> Path:
        done = export_omp(store, sid, tmp_path / name, blobs_dir=tmp_path / "blobs")
        return done.artifacts_dir

    exported = export("fine")
    assert (exported / f"{output_id}.jsonl").read_bytes() == sidecar
    for name, damage in DAMAGES.items():
        _tamper(raw, path, damage(sidecar))
        with pytest.raises(ArtifactCorrupt, match="sidecar"):
            export(name)
            pytest.fail(f"{name}: served")
        assert not any((tmp_path / name).rglob(f"{output_id}.*")), name
    raw.delete(path)
    with pytest.raises(ArtifactCorrupt, match="sidecar"):
        export("gone")
    raw.storage.put(key_of(raw.root, path), sidecar)
    assert (export("back") / f"{output_id}.jsonl").read_bytes() == sidecar


@SQLITE_ONLY
@pytest.mark.parametrize("how", ["write", "put"])
def test_an_output_rewritten_without_a_sidecar_is_exported_without_the_old_one(
    store: SessionStore, tmp_path: Path, how: str
) -> None:
    """A rewrite with no sidecar left the earlier write's file where it was, and its row
    recorded no digest (as a row from before digests): the export paired the new markdown
    with the old transcript, unchecked. The row now says the output has none."""
    sid = store.create_session(tenant_id="acme").id
    manager = store.artifacts(sid)
    if how == "write":
        output_id = manager.save_agent_output("worker", "first", jsonl=b'{"v":"old"}\n')
        manager.write_agent_output(output_id, "second, no transcript")
    else:
        output_id = "0-worker"
        manager.put_agent_output(output_id, "first", jsonl=b'{"v":"old"}\n')
        manager.put_agent_output(output_id, "second, no transcript")
    exported = export_omp(store, sid, tmp_path / "out", blobs_dir=tmp_path / "b").artifacts_dir
    assert (exported / f"{output_id}.md").read_bytes() == b"second, no transcript"
    assert not (exported / f"{output_id}.jsonl").exists()


@SQLITE_ONLY
def test_an_export_never_pairs_one_versions_markdown_with_anothers_sidecar(
    store: SessionStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rewrite between the export's read of the markdown and of the sidecar: the sidecar
    read moved on to the new version and the markdown stayed the old one (exported as a
    pair, no error). Both are read again until they are of one version."""
    sid = store.create_session(tenant_id="acme").id
    manager = store.artifacts(sid)
    output_id = manager.save_agent_output("worker", "answer v1", jsonl=b'{"v":1}\n')
    real, raced = inherited.read_sidecar, []

    def racing(*args: Any, **kwargs: Any) -> bytes | None:
        if not raced:
            raced.append(True)
            manager.write_agent_output(output_id, "answer v2", jsonl=b'{"v":2}\n')
        return real(*args, **kwargs)

    monkeypatch.setattr(inherited, "read_sidecar", racing)
    monkeypatch.setattr(omp, "read_sidecar", racing, raising=False)  # where it was imported
    exported = export_omp(store, sid, tmp_path / "out", blobs_dir=tmp_path / "b").artifacts_dir
    pair = [(exported / f"{output_id}.{ext}").read_bytes() for ext in ("md", "jsonl")]
    assert raced and pair == [b"answer v2", b'{"v":2}\n']


@pytest.mark.parametrize("kind", ["file", "tool", "agent"])
def test_a_rewrite_racing_a_read_is_served_not_called_corrupt(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """The reader has the old row when the rewrite lands (its file renamed in place, its
    row committed): the mismatch is read again with the row as it is now, and the new
    content served."""
    sid = store.create_session(tenant_id="acme").id
    manager = store.artifacts(sid)
    _path, read = KINDS[kind](store, sid)
    new = "rewritten, longer than before " * 40
    rewrite = {
        "file": lambda: manager.files.put("notes/a.txt", new),
        "tool": lambda: manager.put_tool_output("0", "bash", new),
        "agent": lambda: manager.put_agent_output("0-worker", new),
    }[kind]
    real = inherited.read_own_file
    calls: list[Path] = []

    def racing(root: Path, path: Path, storage: object) -> bytes | None:
        if not calls:
            rewrite()  # after the row was read, before its file is
        calls.append(path)
        return real(root, path, storage)  # type: ignore[arg-type]

    monkeypatch.setattr(inherited, "read_own_file", racing)
    assert str(read(store, sid)).startswith(new)
    assert len(calls) == 2  # read again once


def test_rewrites_racing_each_read_of_one_request_are_served_not_called_corrupt(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rewrite lands before each file read of one request (the first read, then its
    re-read): the re-read happened with a row read before the second rewrite, so a good
    file was reported corrupt. Only a row unchanged across a mismatching read is."""
    sid = store.create_session(tenant_id="acme").id
    files = store.artifacts(sid).files
    files.put("notes/a.txt", "v1 " * 100)
    real = inherited.read_own_file
    calls: list[Path] = []

    def racing(root: Path, path: Path, storage: object) -> bytes | None:
        if len(calls) < 3:
            files.put("notes/a.txt", f"v{len(calls) + 2} " * (100 + len(calls)))
        calls.append(path)
        return real(root, path, storage)  # type: ignore[arg-type]

    monkeypatch.setattr(inherited, "read_own_file", racing)
    assert files.get("notes/a.txt") == b"v4 " * 102
    assert len(calls) == 4


def test_a_partial_read_is_not_checked_and_a_finalized_output_is(
    store: SessionStore, raw: RawArtifacts
) -> None:
    """A tool output still being written is served with ``partial`` (its row's size is not
    its bytes' yet); once finalized, its size and digest are recorded and checked."""
    sid = store.create_session(tenant_id="acme").id
    manager = store.artifacts(sid)
    slot = manager.allocate_path("bash")
    with open(slot.path, "wb") as out:
        out.write(b"so far\n")
    url = f"artifact://{slot.id}"
    if raw.on_files:  # on S3 the bytes wait in the local spool until finalized
        assert store.resolve(url, session_id=sid, partial=True).content == "so far\n"
    with open(slot.path, "ab") as out:
        out.write(b"the rest\n")
    assert manager.finalize_tool_output(slot.id) == len(b"so far\nthe rest\n")
    assert store.resolve(url, session_id=sid).content == "so far\nthe rest\n"
    (row,) = manager.list()
    assert row.sha256 is not None and row.complete
    _tamper(raw, manager.directory() / f"{slot.id}.bash.log", b"so far\nthe REST\n")
    with pytest.raises(ArtifactCorrupt):
        store.resolve(url, session_id=sid)


class _GrowingSpool:
    """The tool output's file as ``finalize_tool_output`` reads it, with the tool still
    writing: ``more`` is appended to it at the first read that returns bytes ("while")
    or at the first one that finds its end ("at its end")."""

    def __init__(self, inner: BinaryIO, path: Path, more: bytes, growth: str) -> None:
        self._inner, self._path, self._more, self._growth = inner, path, more, growth

    def read(self, size: int = -1) -> bytes:
        data = self._inner.read(size)
        if self._more and (not data if self._growth == "at its end" else bool(data)):
            with open(self._path, "ab") as out:
                out.write(self._more)
            self._more = b""
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __enter__(self) -> _GrowingSpool:
        return self

    def __exit__(self, *exc: object) -> None:
        self._inner.close()


@SQLITE_ONLY
@pytest.mark.parametrize(
    ("artifact_backend", "growth", "multipart"),
    [
        ("file", "while", False),
        ("s3", "while", False),
        ("s3", "at its end", False),
        ("s3", "at its end", True),
    ],
)
def test_a_tool_output_growing_while_finalized_is_recorded_as_stored(
    store: SessionStore,
    raw: RawArtifacts,
    monkeypatch: pytest.MonkeyPatch,
    growth: str,
    multipart: bool,
) -> None:
    """Finalize reads the tool's file once: the size and digest it records are of the very
    bytes stored (on S3: uploaded). It read the spool twice, to measure it, then to upload
    it: bytes the tool wrote in between were uploaded but not measured, and every later
    read of the output was ``ArtifactCorrupt``. (On file:// the tool writes the stored
    file itself: bytes written after finalize change the output, and are refused.)"""
    sid = store.create_session(tenant_id="acme").id
    manager = store.artifacts(sid)
    slot = manager.allocate_path("bash")
    slot.path.write_bytes(b"so far\n" * 1000)
    if multipart:
        monkeypatch.setattr(objects, "_SINGLE_PUT_BYTES", 0)
    real_fdopen = os.fdopen

    def growing(fd: int, *args: Any, **kwargs: Any) -> Any:
        opened = real_fdopen(fd, *args, **kwargs)
        if os.path.samefile(f"/proc/self/fd/{fd}", slot.path):
            return _GrowingSpool(opened, slot.path, b"late\n", growth)
        return opened

    monkeypatch.setattr(os, "fdopen", growing)
    size = manager.finalize_tool_output(slot.id)
    monkeypatch.undo()
    stored = raw.read(manager.directory() / f"{slot.id}.bash.log")
    assert stored is not None and stored.startswith(b"so far\n" * 1000)
    (row,) = manager.list()
    assert (size, row.size_bytes, row.sha256) == (len(stored), len(stored), digest(stored))
    served = store.resolve(f"artifact://{slot.id}", session_id=sid).content
    assert served == stored.decode()


@SQLITE_ONLY
def test_streamed_chunks_are_checked_at_their_end(store: SessionStore, raw: RawArtifacts) -> None:
    """``retrieve_chunks`` yields a chunk at a time, lazily, and raises once the last one
    passed if the bytes are not what was stored."""
    sid = store.create_session(tenant_id="acme").id
    path, _ = _oversized(store, sid)
    ref = path.name.removesuffix(".txt")
    whole = (TEXT * 20).encode()
    chunks = store.oversized.retrieve_chunks(ref, session_id=sid, chunk_bytes=1000)
    assert chunks is not None
    got = list(chunks)
    assert b"".join(got) == whole and len(got) == -(-len(whole) // 1000)
    assert all(len(c) <= 1000 for c in got)
    _tamper(raw, path, whole[:-10] + b"0123456789")
    chunks = store.oversized.retrieve_chunks(ref, session_id=sid, chunk_bytes=1000)
    assert chunks is not None
    passed: list[bytes] = []
    with pytest.raises(ArtifactCorrupt):
        for chunk in chunks:
            passed.append(chunk)
    assert len(b"".join(passed)) == len(whole)  # every chunk passed before the verdict


@SQLITE_ONLY
def test_streamed_chunks_close_their_source_however_they_end(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The file (or S3 reader) ``retrieve_chunks`` opened is closed by ``close()`` and by
    leaving a ``with`` block, iterated or not, and by the export's caller when it fails
    before its first chunk. A generator closed its source only once its body had run: a
    caller that never started it (an error first) held it open as long as it held it."""
    sid = store.create_session(tenant_id="acme").id
    path, _ = _oversized(store, sid)
    ref = path.name.removesuffix(".txt")
    opened: list[BinaryIO] = []
    real = inherited.open_own_file

    def recorded(root: Path, path: Path, storage: Any) -> BinaryIO | None:
        source = real(root, path, storage)
        if source is not None:
            opened.append(source)
        return source

    monkeypatch.setattr(inherited, "open_own_file", recorded)

    def chunks() -> Any:
        got = store.retrieve_chunks(ref, session_id=sid)
        assert got is not None and not opened[-1].closed
        return got

    never_started = chunks()
    never_started.close()
    assert opened[-1].closed
    started = chunks()
    assert next(started)
    started.close()
    assert opened[-1].closed
    with chunks() as unused:
        pass
    assert opened[-1].closed
    with chunks() as partly:
        assert next(partly)
    with chunks() as whole:
        assert b"".join(whole) == (TEXT * 20).encode()
    # the export's caller (``export --via-queue``): its output cannot be written
    with pytest.raises(UnwritableFile):
        interop._write_export(store, ref, sid, tmp_path / "no such directory" / "out.jsonl")
    assert len(opened) == 6 and all(source.closed for source in opened)
    assert unused is not None  # held to the end: closing is not left to the collector


@SQLITE_ONLY
def test_the_cli_read_of_a_corrupt_artifact_prints_nothing_and_exits_1(
    store: SessionStore, settings: Settings, raw: RawArtifacts
) -> None:
    sid = store.create_session(tenant_id="acme").id
    path, _ = _tool_output(store, sid)
    env = store_env(settings, SESSIONSTORE_ARTIFACT_URL=settings.resolved_artifact_url)
    fine = run_cli("read", "artifact://0", "--session", sid, env=env)
    assert fine.returncode == 0 and fine.stdout == TEXT, fine.stderr
    _tamper(raw, path, b"EVIL")
    refused = run_cli("read", "artifact://0", "--session", sid, env=env)
    assert refused.returncode == 1, refused.stderr
    assert refused.stdout == "" and "EVIL" not in refused.stderr
    line = refused.stderr.splitlines()[-1]  # after the warning logged for the operator
    assert line.startswith("error: tool_output '0' of session") and "is corrupt" in line
