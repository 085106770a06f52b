"""A session's full content, rehydrated, built once per (session, format, head) into an
expiring artifact: what the ``sessionstore.rehydrate`` task serves to whoever asks.

- **Streamed.** Events are read a page at a time and rehydrated one at a time, written to a
  staging file in the session's directory while hashing, then published as an ``art_…``
  TTL artifact (the oversized-output machinery: ``resolve``, ``sessionstore read`` and beat
  expiry all work on it). Memory does not grow with the session.
- **Deduplicated.** A ``rehydrations`` row per (session, format, head) is claimed by one
  builder; identical requests wait for it and get the same result, and a finished output is
  reused until its artifact expires. A builder that stops heart-beating (a killed worker)
  is taken over; its staged file was never published, so nothing partial is ever served.
- **Safe.** The session is looked up within the caller's tenant; a blob that is missing
  or corrupt stays a ref in the output and is listed in the result.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Literal, cast

from sqlalchemy import insert, select, update
from sqlalchemy.exc import IntegrityError

from core.artifacts import nofollow
from core.artifacts.fsio import StagedFile
from core.artifacts.paths import STAGING_DIR, session_dir
from core.artifacts.staging import ObjectStagedFile, Staged
from core.artifacts.storage import FileArtifactStorage
from core.blobs.externalize import parse_pointer
from core.blobs.store import make_ref
from core.db import read_connection, write_transaction
from core.errors import InvalidEvent, RehydrateInProgress
from core.fsio import fsync_dir
from core.interop import exporter, omp, pi
from core.models import ArtifactRow, RehydrationRow, table_of, utcnow
from core.records import ManifestEntry, Session, StoredEvent

if TYPE_CHECKING:
    from core.store import SessionStore

log = logging.getLogger(__name__)

Format = Literal["pi", "omp", "events"]
FORMATS: tuple[Format, ...] = ("pi", "omp", "events")
BUILDING, DONE = "building", "done"
# A build whose heartbeat is older than this is presumed dead and taken over.
STALE_AFTER_S = 10.0
_HEARTBEAT_S = 1.0
_PROGRESS_EVERY = 50  # events
_rows = table_of(RehydrationRow)
_artifacts = table_of(ArtifactRow)

Progress = Callable[[int, int], None]  # (events written, events in total)


@dataclass(frozen=True, slots=True)
class Request:
    session_id: str
    tenant_id: str
    format: str = "pi"
    at_seq: int | None = None


def rehydrate(
    store: SessionStore,
    request: Request,
    *,
    progress: Progress | None = None,
    wait_s: float | None = None,
) -> dict[str, Any]:
    """The output for ``request``: reused, awaited, or built here. A small JSON result.

    While another builder holds the build, wait for its result, at most ``wait_s`` seconds
    (then ``RehydrateInProgress``: the caller retries later)."""
    if request.format not in FORMATS:
        raise InvalidEvent("format", f"must be one of {', '.join(FORMATS)}")
    session = store.get_session(request.session_id, tenant_id=request.tenant_id)
    head = _head_of(session, request.at_seq)
    key = (session.id, request.format, head)
    builder = uuid.uuid4().hex
    deadline = None if wait_s is None else time.monotonic() + wait_s
    while True:
        found = _usable(store, key)
        if found is not None:
            return {**found, "reused": True}
        if _claim(store, key, builder):
            break
        if deadline is not None and time.monotonic() >= deadline:
            raise RehydrateInProgress(f"session {session.id}: another build is running")
        time.sleep(0.2)  # someone else is building it: wait for their result
    try:
        result = _build(store, session, request.format, head, builder, progress)
    except BaseException:
        _release(store, key, builder)
        raise
    return {**result, "reused": False}


def _head_of(session: Session, at_seq: int | None) -> int:
    if at_seq is None:
        return session.head_seq
    if not 0 <= at_seq <= session.head_seq:
        raise InvalidEvent("at_seq", f"must be from 0 to the head ({session.head_seq})")
    return at_seq


def _usable(store: SessionStore, key: tuple[str, str, int]) -> dict[str, Any] | None:
    """A finished build whose artifact has not expired."""
    with read_connection(store.engine) as conn:
        row = conn.execute(select(_rows).where(*_where(key))).first()
        if row is None or row.status != DONE or row.result is None:
            return None
        expires = conn.execute(
            select(_artifacts.c.expires_at).where(
                _artifacts.c.session_id == key[0], _artifacts.c.local_id == row.artifact_id
            )
        ).scalar()
    if expires is None or expires <= utcnow():
        return None
    return dict(row.result)


def _where(key: tuple[str, str, int]) -> list[Any]:
    return [_rows.c.session_id == key[0], _rows.c.format == key[1], _rows.c.head_seq == key[2]]


def _claim(store: SessionStore, key: tuple[str, str, int], builder: str) -> bool:
    """Become the builder: a new row, or a row whose build finished, expired or died."""
    now = utcnow()
    values = {"status": BUILDING, "builder": builder, "heartbeat_at": now}
    try:
        with write_transaction(store.engine) as conn:
            conn.execute(
                insert(_rows).values(
                    session_id=key[0], format=key[1], head_seq=key[2], builds=0, **values
                )
            )
        return True
    except IntegrityError:
        pass
    stale = now - timedelta(seconds=STALE_AFTER_S)
    # The row is checked again here, not taken from ``_usable``: a build that finished
    # after ``_usable`` looked is served, not built a second time.
    live_output = (
        select(_artifacts.c.local_id)
        .where(
            _artifacts.c.session_id == _rows.c.session_id,
            _artifacts.c.local_id == _rows.c.artifact_id,
            _artifacts.c.expires_at > now,
        )
        .exists()
    )
    dead_build = (_rows.c.status == BUILDING) & (_rows.c.heartbeat_at < stale)
    with write_transaction(store.engine) as conn:
        taken = conn.execute(
            update(_rows)
            .where(*_where(key))
            .where(dead_build | ((_rows.c.status == DONE) & ~live_output))
            .values(**values)
        ).rowcount
    return bool(taken)


def _release(store: SessionStore, key: tuple[str, str, int], builder: str) -> None:
    """A failed build gives its claim up at once (waiters take over without the timeout)."""
    stale = utcnow() - timedelta(seconds=STALE_AFTER_S + 1)
    with write_transaction(store.engine) as conn:
        conn.execute(
            update(_rows)
            .where(*_where(key), _rows.c.builder == builder, _rows.c.status == BUILDING)
            .values(heartbeat_at=stale)
        )


def _heartbeat(store: SessionStore, key: tuple[str, str, int], builder: str) -> None:
    with write_transaction(store.engine) as conn:
        conn.execute(
            update(_rows)
            .where(*_where(key), _rows.c.builder == builder)
            .values(heartbeat_at=utcnow())
        )


def _build(
    store: SessionStore,
    session: Session,
    fmt: str,
    head: int,
    builder: str,
    progress: Progress | None,
) -> dict[str, Any]:
    key = (session.id, fmt, head)
    artifact_root = store.settings.resolved_artifact_root
    root = session_dir(artifact_root, session.tenant_id, session.id)
    staging = root / STAGING_DIR
    name = f"{uuid.uuid4().hex}.tmp"
    missing: list[str] = []
    written = 0
    beat = time.monotonic()

    def events() -> Iterator[StoredEvent]:
        nonlocal written, beat
        source = exporter.rehydrated_with_manifest(store, session, head)
        for event in _noting_missing(source, missing):
            written += 1
            if time.monotonic() - beat >= _HEARTBEAT_S:
                _heartbeat(store, key, builder)
                beat = time.monotonic()
            if progress is not None and written % _PROGRESS_EVERY == 0:
                progress(written, head)
            yield event

    storage = store.oversized.storage
    on_files = isinstance(storage, FileArtifactStorage)
    if on_files:
        fd = nofollow.create_new(artifact_root, staging / name)
    else:  # object storage: spool in the local cache, upload when whole
        spool_dir = store.settings.artifact_spool_dir
        spool_dir.mkdir(parents=True, exist_ok=True)
        fd, spooled = tempfile.mkstemp(prefix="rehydrate-", suffix=".part", dir=spool_dir)
    try:
        with open(fd, "w", encoding="utf-8", errors="surrogatepass") as raw:
            out = _HashingWriter(raw)
            entries = _write(store, session, fmt, events(), cast(IO[str], out))
            raw.flush()
            os.fsync(raw.fileno())
        if on_files:
            fsync_dir(staging)
            staged: Staged = StagedFile.adopt(root, name)
        else:
            staged = ObjectStagedFile(storage, artifact_root, root, local=Path(spooled))
    finally:
        if not on_files:
            Path(spooled).unlink(missing_ok=True)
    ttl = store.settings.rehydrate_ttl_seconds
    summary = f"rehydrated {fmt} export of {session.id} at seq {head}"
    ref = store.oversized.publish_staged(
        session.id,
        staged,
        tool_name=f"rehydrate-{fmt}",
        summary=summary,
        size=out.size,
        ttl_s=ttl,
        media_type="application/x-ndjson",
    )
    result = {
        "ref": ref.artifact_id,
        "session_id": session.id,
        "format": fmt,
        "head_seq": head,
        "size": out.size,
        "sha256": out.sha256.hexdigest(),
        "entries": entries,
        "missing_blobs": sorted(set(missing)),
        "expires_at": ref.expires_at.isoformat(),
    }
    with write_transaction(store.engine) as conn:
        conn.execute(
            update(_rows)
            .where(*_where(key))
            .values(
                status=DONE,
                artifact_id=ref.artifact_id,
                result=result,
                heartbeat_at=utcnow(),
                builds=_rows.c.builds + 1,
            )
        )
    log.info("rehydrated export built", extra={k: result[k] for k in ("ref", "size", "entries")})
    if progress is not None:
        progress(head, head)
    return result


def _write(
    store: SessionStore,
    session: Session,
    fmt: str,
    events: Iterator[StoredEvent],
    out: IO[str],
) -> int:
    if fmt == "pi":
        return exporter.write_pi(session, events, out)
    if fmt == "omp":
        # oh-my-pi's session file, its images as refs into this store's blobs (the same
        # sha256 addresses, so ``resolve blob:sha256:…`` gives their bytes)
        header, entries = exporter.pi_lines(session, events)
        return omp.write_session_file(out, header, entries, lambda data: store.blobs.put(data).ref)
    count = 0
    for event in events:
        line = {
            "seq": event.seq,
            "position": event.position,
            "type": event.type,
            "recorded_at": event.recorded_at.isoformat(),
            "payload": event.payload,
        }
        out.write(pi.dumps_exact(line) + "\n")
        count += 1
    return count


def _noting_missing(
    events: Iterator[tuple[StoredEvent, Sequence[ManifestEntry]]], missing: list[str]
) -> Iterator[StoredEvent]:
    for event, entries in events:
        missing.extend(_unresolved(event, entries))
        yield event


def _unresolved(full: StoredEvent, entries: Sequence[ManifestEntry]) -> list[str]:
    """Blob hashes whose ref is still in place after rehydration (missing or corrupt)."""
    left = []
    for entry in entries:
        node: Any = full.payload
        for token in parse_pointer(entry.pointer):
            node = node[int(token)] if isinstance(node, list) else node.get(token)
        if node == make_ref(entry.hash):
            left.append(entry.hash)
    return left


class _HashingWriter(io.TextIOBase):
    """A text sink that counts and hashes the UTF-8 bytes it passes on."""

    def __init__(self, raw: IO[str]) -> None:
        super().__init__()
        self.raw = raw
        self.size = 0
        self.sha256 = hashlib.sha256()

    def write(self, text: str) -> int:
        data = text.encode("utf-8", "surrogatepass")
        self.size += len(data)
        self.sha256.update(data)
        return self.raw.write(text)
