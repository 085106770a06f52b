"""Reading a fork's inherited artifacts while its artifact copy is unfinished.

Until a fork's copy completes (pending, or failed and not yet retried) it reads the files
it inherited from the ancestor that still holds the identical artifact row, so a parent's
later rewrite never shows through.

No clock decides it: several hosts share the database and the artifact store (a bucket, or
a shared filesystem), and a file's write time against the fork's creation compared the
writer's clock (or the file server's) with the forking host's: one ahead made an unchanged
file look rewritten (the fork's copy failed, its inherited files lost), one behind let a
rewrite pass. The identical row pins the content instead (every rewrite changes the row:
its SHA-256, or its creation time), the parent's writes give each unfinished fork its own
copy before they replace or remove a file (``preserve_for_forks``), every read is checked
against the row, and every copy made for a fork is checked against it before it takes the
fork's name (``copy_object_for_fork``; on the file store the fork's copy).
"""

from __future__ import annotations

import errno
import logging
import os
import uuid
from collections.abc import Callable
from contextlib import suppress
from dataclasses import replace
from pathlib import Path, PurePosixPath
from typing import BinaryIO, NamedTuple, TypeVar

from sqlalchemy import Connection, Engine, select

from core import nofollow
from core.artifacts import integrity, rows
from core.artifacts.paths import STAGING_DIR, agent_output_names, encode_component, session_dir
from core.artifacts.records import ArtifactInfo
from core.artifacts.storage import ArtifactStorage, FileArtifactStorage, key_of
from core.db import read_connection
from core.errors import SessionNotFound, StorageUnavailable, SymlinkRefused
from core.journal import Journal
from core.models import ArtifactRow, SessionRow, table_of
from core.records import COPY_FAILED, COPY_PENDING, Session
from core.translate import storage_errors

log = logging.getLogger(__name__)

_MAX_ANCESTORS = 64  # forks of forks walked to find an inherited file
# Where a parent holds what a fork inherited when the fork's own directory could not take
# it (a planted link there): ``<parent>/.tmp/forks/<fork>/<name>``, until the fork's copy.
HELD_DIR = "forks"
_UNFINISHED = (COPY_PENDING, COPY_FAILED)
_sessions = table_of(SessionRow)
_artifacts = table_of(ArtifactRow)
_T = TypeVar("_T")


def copy_unfinished(engine: Engine, session_id: str) -> bool:
    """Whether the session is a fork whose artifact copy is pending or failed."""
    with read_connection(engine) as conn:
        status = conn.execute(
            select(_sessions.c.copy_status).where(_sessions.c.id == session_id)
        ).scalar()
    return status in _UNFINISHED


class Found(NamedTuple):
    """Where an inherited artifact's bytes are: ``path`` (None: nowhere), and whether they
    are still the content the fork inherited."""

    path: Path | None
    inherited: bool


def read_own_file(root: Path, path: Path, storage: ArtifactStorage | None) -> bytes | None:
    """The bytes at ``path`` below ``root`` in the artifact storage (local files when
    ``storage`` is None or the file backend: no link followed), None when absent; nothing
    inherited is looked for."""
    if storage is None or isinstance(storage, FileArtifactStorage):
        with storage_errors("artifacts"):  # a failing disk, as on S3
            return nofollow.read_bytes(root, path)
    return storage.read(key_of(root, path))


def open_own_file(root: Path, path: Path, storage: ArtifactStorage | None) -> BinaryIO | None:
    """``read_own_file``, open for a streamed read instead of read whole."""
    if storage is None or isinstance(storage, FileArtifactStorage):
        with storage_errors("artifacts"):
            fd = nofollow.open_file(root, path)
        return None if fd is None else os.fdopen(fd, "rb")
    try:
        return storage.open_read(key_of(root, path))
    except FileNotFoundError:
        return None


def read_artifact_file(
    engine: Engine,
    root: Path,
    own: Path,
    row: ArtifactInfo,
    storage: ArtifactStorage | None = None,
) -> bytes | None:
    """The bytes of ``row``'s file at ``own`` (the session's own copy); for a fork whose
    artifact copy is unfinished, what it inherited instead. None: neither is there.

    The bytes are checked against the row (``integrity``): bytes that are not what it
    recorded are read once more with the row as it is now (a rewrite may have renamed its
    file into place before its row committed), and are ``ArtifactCorrupt`` if they still
    are not."""
    objects = None if isinstance(storage, FileArtifactStorage) else storage

    def read(path: Path) -> bytes | None:
        return read_own_file(root, path, objects)

    data = own_or_inherited(engine, root, own, row, objects, read)
    if data is None or (reason := integrity.check(row, data)) is None:
        return data
    # Corrupt only when the row did not change across a read that mismatched it: every
    # rewrite holds the quota lock from its file's rename to its row's commit, so a row read
    # under that lock after the read is the same one only if no rewrite touched the file
    # meanwhile (one rewrite racing the first read, then another racing the second, made a
    # good file look corrupt).
    fresh = integrity.fresh_row(engine, row)
    for _ in range(_REREADS):
        if fresh is None:  # removed meanwhile
            return None
        if fresh.name and row.name and fresh.name != row.name:  # a tool output put anew
            own = own.parents[len(PurePosixPath(row.name).parts) - 1] / fresh.name
            row = fresh
        data = own_or_inherited(engine, root, own, fresh, objects, read)
        if data is None or (reason := integrity.check(fresh, data)) is None:
            return data
        after = integrity.fresh_row(engine, fresh)
        if after == fresh:
            break
        fresh = after
    assert fresh is not None and reason is not None
    raise integrity.corrupt(fresh, reason)


_REREADS = 8  # rewrites racing one read this often in a row: taken for corruption


def read_sidecar(
    engine: Engine,
    root: Path,
    own: Path,
    row: ArtifactInfo,
    storage: ArtifactStorage | None = None,
) -> bytes | None:
    """The JSONL sidecar file of the agent output ``row`` whose markdown is at ``own``,
    found as its markdown is (a fork with its copy unfinished reads the one it inherited);
    None when there is none. Unchecked: ``read_agent_output`` checks it."""
    objects = None if isinstance(storage, FileArtifactStorage) else storage
    name = agent_output_names(row.local_id)[1]

    def read(markdown: Path) -> bytes | None:
        return read_own_file(root, markdown.with_name(name), objects)

    return own_or_inherited(engine, root, own, row, objects, read)


def read_agent_output(
    engine: Engine,
    root: Path,
    own: Path,
    row: ArtifactInfo,
    storage: ArtifactStorage | None = None,
) -> tuple[ArtifactInfo, bytes, bytes | None] | None:
    """An agent output's markdown and JSONL sidecar as one version of it: (the row they
    are, markdown, sidecar); None: gone. Both are checked against one row (the sidecar
    against its ``sidecar_sha256``; none for a row written without one, whatever file an
    earlier write left). A mismatch is read again with the row as it is now (a rewrite
    racing the reads: one read before it and one after paired two versions), and is
    ``ArtifactCorrupt`` once the row did not change across it."""
    objects = None if isinstance(storage, FileArtifactStorage) else storage

    def read(path: Path) -> bytes | None:
        return read_own_file(root, path, objects)

    for _ in range(_REREADS):
        markdown = own_or_inherited(engine, root, own, row, objects, read)
        if markdown is None:
            return None
        sidecar = None
        if row.sidecar_sha256 != integrity.NO_SIDECAR:
            sidecar = read_sidecar(engine, root, own, row, storage)
        reason = integrity.check(row, markdown) or integrity.sidecar_mismatch(row, sidecar)
        if reason is None:
            return row, markdown, sidecar
        fresh = integrity.fresh_row(engine, row)
        if fresh is None:  # removed meanwhile
            return None
        if fresh == row:
            raise integrity.corrupt(row, reason)
        row = fresh
    raise integrity.corrupt(row, "rewritten during every read of it")


def open_artifact_file(
    engine: Engine,
    root: Path,
    own: Path,
    row: ArtifactInfo,
    storage: ArtifactStorage | None = None,
) -> BinaryIO | None:
    """``read_artifact_file``'s file, open for a streamed read (unchecked: pass it through
    ``integrity.verified_chunks``)."""
    objects = None if isinstance(storage, FileArtifactStorage) else storage
    return own_or_inherited(
        engine, root, own, row, objects, lambda path: open_own_file(root, path, objects)
    )


def own_or_inherited(
    engine: Engine,
    root: Path,
    own: Path,
    row: ArtifactInfo,
    storage: ArtifactStorage | None,
    fetch: Callable[[Path], _T | None],
) -> _T | None:
    """``fetch`` of the own file at ``own``; for a fork whose artifact copy is unfinished,
    of what it inherited instead. The own file wins, and is fetched again when the fallback
    comes up empty: the copy may have completed in between (files are copied before the
    status changes). With an object ``storage``, the paths below ``root`` name its keys."""
    found = fetch(own)
    if found is not None:
        return found
    with read_connection(engine) as conn:
        source = inherited_source(conn, root, row.session_id, row, storage)
    found = fetch(source) if source is not None else None
    return found if found is not None else fetch(own)


def inherited_source(
    conn: Connection,
    root: Path,
    session_id: str,
    row: ArtifactInfo,
    storage: ArtifactStorage | None = None,
) -> Path | None:
    """Where a fork reads an inherited artifact from until its copy completes (pending, or
    failed and not yet retried: the fork stays as usable as its ancestors allow).

    Only an ancestor that still holds the identical row (same name, size, creation) and a
    file not modified since the fork is used, so a parent that rewrote or removed the
    artifact after the fork never shows through. None: not an unfinished fork, not
    inherited, or no longer available.
    """
    ancestors = Ancestors(conn, Journal(conn.engine))
    session = ancestors.session(session_id)
    if session is None or session.copy_status not in _UNFINISHED:
        return None
    return ancestor_file(ancestors, root, session, row, storage).path


class Ancestors:
    """The ancestor sessions and artifact rows ``ancestor_file`` looks up, through one
    connection. ``every_row``: an ancestor's rows are read all at once, the first time one
    is asked for, and its session once (a fork copy's plan asks about each of the fork's
    rows: queries by ancestor, not by row); otherwise each row is read when asked for (a
    read of one artifact)."""

    def __init__(self, conn: Connection, journal: Journal, *, every_row: bool = False) -> None:
        self._conn = conn
        self._journal = journal
        self._every_row = every_row
        self._sessions: dict[str, Session | None] = {}
        self._rows: dict[str, dict[tuple[str, str], ArtifactInfo]] = {}
        self._inherited: dict[str, set[tuple[str, str]]] = {}

    def session(self, session_id: str) -> Session | None:
        if session_id not in self._sessions:
            self._sessions[session_id] = _session_or_none(self._conn, self._journal, session_id)
        return self._sessions[session_id]

    def row(self, session_id: str, kind: str, local_id: str) -> ArtifactInfo | None:
        if not self._every_row:
            return rows.get_artifact(self._conn, session_id, kind, local_id)
        if session_id not in self._rows:
            listed = rows.list_artifacts(self._conn, session_id)
            self._rows[session_id] = {(r.kind, r.local_id): r for r in listed}
        return self._rows[session_id].get((kind, local_id))

    def inherited(self, session_id: str, kind: str, local_id: str) -> bool:
        """Whether the session got this row from its own parent (``artifacts.inherited``);
        a session's marks are read once."""
        if session_id not in self._inherited:
            self._inherited[session_id] = rows.inherited_keys(self._conn, session_id)
        return (kind, local_id) in self._inherited[session_id]


def ancestor_file(
    ancestors: Ancestors,
    root: Path,
    session: Session,
    row: ArtifactInfo,
    storage: ArtifactStorage | None = None,
) -> Found:
    """The file holding the content ``session`` inherited for one of its rows.

    The ancestor must hold the identical row (the module's docstring). Walks up through
    ancestors whose own copy is unfinished, who have no file of their own for it and who
    inherited the row themselves: a fork of a pending fork reads from the grandparent. A
    row an ancestor allocated itself and never wrote has no file anywhere (``Found(None,
    True)``: nothing was lost). A row the session did not inherit is its own, whatever an
    ancestor's says: one it took as its own at the fork (an output unfinished then) can be
    identical to the parent's later (expiry settles a silent writer's row the same way),
    and what the parent's writer writes after the fork is not the fork's.
    """
    if not ancestors.inherited(session.id, row.kind, row.local_id):
        return Found(None, False)
    current = session
    for _ in range(_MAX_ANCESTORS):
        parent = ancestors.session(current.parent_id) if current.parent_id else None
        if parent is None:
            return Found(None, False)
        parent_dir = session_dir(root, parent.tenant_id, parent.id)
        # Kept for this fork by a rewrite or delete since (checked then, as below).
        kept = _held_for(root, parent_dir, current.id, row.name, storage)
        if kept is not None:
            return Found(kept, True)
        held = ancestors.row(parent.id, row.kind, row.local_id)
        if held is None or replace(held, session_id=row.session_id) != row or not held.name:
            return Found(None, False)
        path = parent_dir / held.name
        try:
            if _present(root, path, storage):
                return Found(path, True)
        except SymlinkRefused:
            return Found(path, True)  # whoever opens it refuses (and reports) it
        if parent.copy_status not in _UNFINISHED:
            break
        if not ancestors.inherited(parent.id, row.kind, row.local_id):
            break  # the parent's own row, its file not written: none further up either
        current = parent
    return Found(None, True)


def held_dir(parent_dir: Path, fork_id: str) -> Path:
    """Where the parent at ``parent_dir`` holds the files it kept for the fork ``fork_id``."""
    return parent_dir / STAGING_DIR / HELD_DIR / encode_component(fork_id)


def _held_for(
    root: Path,
    parent_dir: Path,
    fork_id: str,
    name: str | None,
    storage: ArtifactStorage | None,
) -> Path | None:
    """The copy the parent kept for the fork, if any."""
    if not name or (storage is not None and not isinstance(storage, FileArtifactStorage)):
        return None  # object storage has no links: the fork always gets its own copy
    path = held_dir(parent_dir, fork_id) / name
    try:
        return path if _present(root, path, None) else None
    except SymlinkRefused:
        return None


def _present(root: Path, path: Path, storage: ArtifactStorage | None) -> bool:
    """Whether a regular file (an object) is at ``path``; a link there is refused."""
    if storage is None or isinstance(storage, FileArtifactStorage):
        with storage_errors("artifacts"):
            return nofollow.mtime(root, path) is not None
    return storage.size(key_of(root, path)) is not None


def _session_or_none(conn: Connection, journal: Journal, session_id: str) -> Session | None:
    try:
        return journal.session_in(conn, session_id)
    except SessionNotFound:
        return None


def preserve_for_forks(
    conn: Connection,
    root: Path,
    session_id: str,
    row: ArtifactInfo,
    path: Path,
    *,
    name: str | None = None,
    storage: ArtifactStorage | None = None,
) -> list[str]:
    """Before the session replaces or removes ``row``'s file at ``path`` (``row.name``, or
    ``name`` for another file of the same artifact: an agent output's JSONL sidecar): give
    each fork whose copy is unfinished and that inherited exactly this content its own link
    to it.

    Copy-on-write for the fork point: the parent's writes rename over or move aside, never
    write in place, so a hard link keeps the inherited bytes whatever the parent does next;
    on object storage, which has no links, a copy checked against the row
    (``copy_object_for_fork``). Forks that already have the file, or that inherited other
    content (another row), are left alone. Returns the forks served.
    """
    found = conn.execute(
        select(_sessions.c.id, _sessions.c.tenant_id)
        .join(_artifacts, _artifacts.c.session_id == _sessions.c.id)
        .where(
            _sessions.c.parent_id == session_id,
            _sessions.c.copy_status.in_(_UNFINISHED),
            _artifacts.c.kind == row.kind,
            _artifacts.c.local_id == row.local_id,
            _artifacts.c.inherited,  # a row the fork took as its own is not served
        )
    ).all()
    if not found or not row.name:  # the common case: no storage call at all
        return []
    objects = None if isinstance(storage, FileArtifactStorage) else storage
    if objects is None and not _present(root, path, None):
        return []
    served: list[str] = []
    for fork_id, tenant_id in found:
        held = rows.get_artifact(conn, fork_id, row.kind, row.local_id)
        if held is None or replace(held, session_id=session_id) != row:
            continue
        target = session_dir(root, tenant_id, fork_id) / (name or row.name)
        if objects is not None:
            if _preserve_object(objects, root, path, target, row):
                served.append(fork_id)
        elif _preserve_file(root, path, target, fork_id, name or row.name):
            served.append(fork_id)
    return served


class SourceChanged(OSError):
    """What a fork's copy read is not the content the fork inherited: rewritten since."""


def copy_object_for_fork(
    objects: ArtifactStorage, root: Path, source: Path, target: Path, row: ArtifactInfo
) -> int | None:
    """Copy ``source`` to a fork's ``target`` (one file of the artifact ``row``), only as
    the content the row recorded: bytes copied, or None when the target had (or got
    meanwhile) an object of its own, which it keeps. ``SourceChanged``: the source is not
    that content; ``FileNotFoundError``: there is no source.

    A server-side copy to a staging key of the fork's, read back and checked against the
    row, then copied to its name: a parent rewriting while a copy runs (its own write
    first gives the fork a copy of the old object, ``preserve_for_forks``) never leaves the
    new content under the fork's name. The staging key is removed, or swept by expiry when
    a crash or an outage leaves it."""
    src, dst = key_of(root, source), key_of(root, target)
    if objects.size(dst) is not None:
        return None
    fork_dir = root.joinpath(*target.relative_to(root).parts[:2])
    staged = key_of(root, fork_dir / STAGING_DIR / f"{uuid.uuid4().hex}.tmp")
    try:
        objects.copy(src, staged)
        with objects.open_read(staged) as copied:
            size, digest = integrity.measure(copied)
        reason = integrity.file_mismatch(row, target.name, size, digest)
        if objects.size(dst) is not None:
            return None  # the fork's own (the parent's write kept it one): no other over it
        if reason is not None:
            raise SourceChanged(errno.ESTALE, f"not the content the fork inherited: {reason}")
        objects.copy(staged, dst)
        return size
    finally:
        with suppress(StorageUnavailable, FileNotFoundError):
            objects.delete(staged)


def _preserve_object(
    objects: ArtifactStorage, root: Path, source: Path, target: Path, row: ArtifactInfo
) -> bool:
    try:
        return copy_object_for_fork(objects, root, source, target, row) is not None
    except FileNotFoundError:
        return False
    except SourceChanged as exc:
        log.warning(
            "not kept for a fork: the parent's object is not what its row recorded",
            extra={"session_id": row.session_id, "key": key_of(root, source), "error": str(exc)},
        )
        return False


def _preserve_file(root: Path, path: Path, target: Path, fork_id: str, name: str) -> bool:
    """Link the parent's file into the fork's directory. A link planted on the way there is
    never written through, and does not fail the parent's write: the file is held beside
    the parent instead (``held_dir``), where the fork's copy, still pending, finds it once
    the link is removed."""
    try:
        return _link_new(root, path, target)
    except SymlinkRefused as exc:
        parent_dir = root.joinpath(*path.relative_to(root).parts[:2])
        log.warning(
            "a pending fork's artifact path is a symlink: its inherited file is held beside "
            "the parent until the link is removed",
            extra={"fork_id": fork_id, "path": exc.path},
        )
        return _link_new(root, path, held_dir(parent_dir, fork_id) / name)


@storage_errors("artifacts")
def _link_new(root: Path, source: Path, target: Path) -> bool:
    """``target`` as a new name of ``source``'s inode, never replacing a file already there
    (neither path followed through a link)."""
    try:
        nofollow.link(root, source, target)
    except FileExistsError:
        return False
    except SymlinkRefused:
        raise
    except OSError:
        # no hard links here: a copy, with the same times as a link would have
        if nofollow.exists(root, target):
            return False
        fd = nofollow.open_file(root, source)
        if fd is None:
            return False
        with os.fdopen(fd, "rb") as handle:
            data, times = handle.read(), os.fstat(handle.fileno())
        # A name of its own (a fixed one, left by a write a crash or a moved directory cut
        # short, made every later copy to this target fail for good), in the session's
        # staging directory, where the expiry sweep removes what a killed process left
        # (beside the target, nothing ever did).
        session_root = root.joinpath(*target.relative_to(root).parts[:2])
        tmp = session_root / STAGING_DIR / f"{uuid.uuid4().hex}.copy"
        nofollow.write_new(root, tmp, data)
        try:
            with nofollow.parent_dir(root, tmp) as (dir_fd, name):
                os.utime(name, ns=(times.st_atime_ns, times.st_mtime_ns), dir_fd=dir_fd)
            # never over a file made since the check above (the fork's own, say)
            nofollow.rename_new(root, tmp, target)
        except FileExistsError:
            _remove_quietly(root, tmp)
            return False
        except BaseException:
            _remove_quietly(root, tmp)
            raise
    return True


def _remove_quietly(root: Path, path: Path) -> None:
    with suppress(OSError, SymlinkRefused):
        nofollow.unlink(root, path)
