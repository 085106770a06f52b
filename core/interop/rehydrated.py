"""A session's full content, rehydrated, built once per (session, format, head) into an
expiring artifact: what the ``sessionstore.rehydrate`` task serves to whoever asks.

- **Streamed.** Events are read a page at a time and rehydrated one at a time, written to a
  staging file in the session's directory while hashing, then published as an ``art_…``
  TTL artifact (the oversized-output machinery: ``resolve``, ``sessionstore read`` and beat
  expiry all work on it). Memory does not grow with the session.
- **Deduplicated.** A ``rehydrations`` row per (session, format, head) is claimed by one
  builder; identical requests wait for it and get the same result, and a finished output is
  reused until its artifact expires (with some life left: see ``_reuse_margin``). A
  thread of the build heart-beats the claim whatever the build is doing (a slow blob read,
  an fsync, an upload), as long as the build makes progress: the build notes each page
  read, blob value resolved, line written and chunk uploaded, and the heartbeat stops once
  none was noted for ``rehydrate_stall_seconds``. So a build that keeps moving holds its
  claim however long it runs, and finishes once; a builder that stops heart-beating (a
  killed worker, or one hung that long on a stalled blob read) is taken over, and only the
  builder holding the claim can finish it: one that lost it discards its output and waits
  for the other's, so one request key never yields two artifacts. A staged file is
  published only whole, so nothing partial is ever served.
- **Safe.** The session is looked up within the caller's tenant; a blob that is missing
  or corrupt stays a ref in the output and is listed in the result.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import os
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Literal, cast

from sqlalchemy import Connection, insert, select, update
from sqlalchemy.exc import IntegrityError

from core import nofollow
from core.artifacts import rows as artifact_rows
from core.artifacts.fsio import StagedFile
from core.artifacts.paths import STAGING_DIR, session_dir
from core.artifacts.staging import ObjectStagedFile, Staged
from core.artifacts.storage import FileArtifactStorage
from core.blobs.store import make_ref, sha256_hex
from core.db import read_connection, write_transaction
from core.errors import InvalidArgument, InvalidEvent, RehydrateInProgress
from core.fsio import fsync_dir
from core.interop import exporter, omp, pi
from core.journal.validation import MAX_ID_LENGTH, MAX_TENANT_LENGTH, check_at_seq, check_id
from core.models import REHYDRATION_BUILDING as BUILDING
from core.models import REHYDRATION_DONE as DONE
from core.models import (
    BlobRefRow,
    RehydrationRow,
    database_clock,
    database_now,
    table_of,
)
from core.records import Session, StoredEvent

if TYPE_CHECKING:
    from core.store import SessionStore

log = logging.getLogger(__name__)

Format = Literal["pi", "omp", "events"]
FORMATS: tuple[Format, ...] = ("pi", "omp", "events")
# A build whose heartbeat is older than this is presumed dead and taken over.
STALE_AFTER_S = 10.0
_HEARTBEAT_S = 1.0
# A finished output is reused only while it has this much life left (a quarter of the TTL
# when that is shorter): the caller must still be able to fetch it.
_MIN_LIFE_S = 60.0
_PROGRESS_EVERY = 50  # events
_rows = table_of(RehydrationRow)

Progress = Callable[[int, int], None]  # (events written, events in total)


@dataclass(frozen=True, slots=True)
class Request:
    session_id: str
    tenant_id: str
    format: str = "pi"
    at_seq: int | None = None

    def check(self) -> None:
        """InvalidEvent naming the field unless each is of its kind. The tenant is required:
        ``get_session(tenant_id=None)`` would find the session in any tenant."""
        check_id(self.session_id, "session_id", MAX_ID_LENGTH)
        check_id(self.tenant_id, "tenant_id", MAX_TENANT_LENGTH)
        if self.format not in FORMATS:
            raise InvalidEvent("format", f"must be one of {', '.join(FORMATS)}")
        if self.at_seq is not None and (
            type(self.at_seq) is not int or not 0 <= self.at_seq < 2**63
        ):
            raise InvalidArgument("at_seq", f"must be a seq from 0, not {self.at_seq!r}")


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
    request.check()
    session = store.get_session(request.session_id, tenant_id=request.tenant_id)
    head = check_at_seq(request.at_seq, session.head_seq)
    key = (session.id, request.format, head)
    builder = uuid.uuid4().hex
    deadline = None if wait_s is None else time.monotonic() + wait_s
    while True:
        found = _usable(store, key)
        if found is not None:
            return {**found, "reused": True}
        if _claim(store, key, builder):
            # Read again once claimed: a move since (another cwd forgets the session's
            # builds, the header names it; another tenant, another directory) is built as
            # it is now. SessionNotFound if it moved out of the caller's tenant.
            session = store.get_session(request.session_id, tenant_id=request.tenant_id)
            try:
                with _Heartbeat(store, key, builder) as beat:
                    result = _build(store, session, request.format, head, beat, progress)
            except _ClaimLost:
                log.warning("rehydrate build taken over; waiting for the other's result")
            except Exception:
                _release(store, key, builder)
                if not _moved_since(store, request, session):
                    raise
                log.info("session moved during its rehydrate build; building it again")
                continue
            except BaseException:
                _release(store, key, builder)
                raise
            else:
                return {**result, "reused": False}
        if deadline is not None and time.monotonic() >= deadline:
            raise RehydrateInProgress(f"session {session.id}: another build is running")
        time.sleep(0.2)  # someone else is building it: wait for their result


def _moved_since(store: SessionStore, request: Request, session: Session) -> bool:
    """Whether the session is under another tenant than when its build began (its
    directory renamed under the build: the build failed on it); SessionNotFound if it left
    the caller's tenant."""
    now = store.get_session(request.session_id, tenant_id=request.tenant_id)
    return now.tenant_id != session.tenant_id


def _usable(store: SessionStore, key: tuple[str, str, int]) -> dict[str, Any] | None:
    """A finished build whose artifact has life left."""
    with read_connection(store.engine) as conn:
        row = conn.execute(select(_rows).where(*_where(key))).first()
        if row is None or row.status != DONE or row.result is None:
            return None
        if not _has_life_left(conn, store, key[0], row.artifact_id):
            return None
    return dict(row.result)


def _reuse_margin(store: SessionStore) -> timedelta:
    return timedelta(seconds=min(_MIN_LIFE_S, store.settings.rehydrate_ttl_seconds / 4))


def _has_life_left(
    conn: Connection, store: SessionStore, session_id: str, artifact_id: str | None
) -> bool:
    """The output artifact exists and expires no sooner than the reuse margin from now.

    The one test of both ``_usable`` and ``_claim``: a finished row is either served or
    taken over, never neither (which would leave its waiters waiting)."""
    if artifact_id is None:
        return False
    alive_until = database_now(conn) + _reuse_margin(store)
    alive = artifact_rows.oversized_exists(session_id, artifact_id, expires_after=alive_until)
    return bool(conn.execute(select(alive)).scalar())


def _where(key: tuple[str, str, int]) -> list[Any]:
    return [_rows.c.session_id == key[0], _rows.c.format == key[1], _rows.c.head_seq == key[2]]


def _claim(store: SessionStore, key: tuple[str, str, int], builder: str) -> bool:
    """Become the builder: a new row, or a row whose build finished, expired or died."""
    engine = store.engine
    values = {"status": BUILDING, "builder": builder, "heartbeat_at": database_clock(engine)}
    try:
        with write_transaction(engine) as conn:
            conn.execute(
                insert(_rows).values(
                    session_id=key[0], format=key[1], head_seq=key[2], builds=0, **values
                )
            )
        return True
    except IntegrityError:
        pass
    stale = database_clock(engine, timedelta(seconds=STALE_AFTER_S))
    with write_transaction(engine) as conn:
        # The row locked first (SQLite's write transaction holds the whole database), then
        # checked again here, not taken from ``_usable``: a build that finished after
        # ``_usable`` looked is served, not built a second time. The artifact is looked up
        # in a statement of its own, after the lock: under read committed it then sees
        # what a builder committed while this claim waited for the row.
        row = conn.execute(
            select(
                _rows.c.status, _rows.c.artifact_id, (_rows.c.heartbeat_at < stale).label("dead")
            )
            .where(*_where(key))
            .with_for_update()
        ).first()
        if row is None:
            return False  # removed meanwhile (pruned, or the session deleted): look again
        if row.status == BUILDING:
            takeable = bool(row.dead)
        else:
            takeable = not _has_life_left(conn, store, key[0], row.artifact_id)
        if takeable:
            conn.execute(update(_rows).where(*_where(key)).values(**values))
    return takeable


def _release(store: SessionStore, key: tuple[str, str, int], builder: str) -> None:
    """A failed build gives its claim up at once (waiters take over without the timeout)."""
    stale = database_clock(store.engine, timedelta(seconds=STALE_AFTER_S + 1))
    with write_transaction(store.engine) as conn:
        conn.execute(update(_rows).where(*_holding(key, builder)).values(heartbeat_at=stale))


def _holding(key: tuple[str, str, int], builder: str) -> list[Any]:
    return [*_where(key), _rows.c.builder == builder, _rows.c.status == BUILDING]


class _ClaimLost(Exception):
    """Another builder took this build over (this one's heartbeat had stopped)."""


class _Heartbeat:
    """Keeps a claim alive from a thread of its own, whatever the build is doing (a long
    blob read, an fsync, an upload), and notes when the claim was lost.

    Only while the build makes progress (``moved``, called by the build at each step):
    once it has not moved for ``rehydrate_stall_seconds``, the thread only watches the
    claim. A build hung there (a read from a stalled endpoint, a deadlock) would otherwise
    hold its claim forever, its waiters timing out and no one building; now its claim goes
    stale and is taken over, and the build, if it ever moves again, stops at its next
    check. A build that moves again before anyone took it over is heart-beaten again. How
    long the build runs in all does not matter: a slow one that keeps moving is never taken
    over (taken over, a rebuild as slow would be taken over in turn, for ever)."""

    def __init__(self, store: SessionStore, key: tuple[str, str, int], builder: str) -> None:
        self.store, self.key, self.builder = store, key, builder
        self.lost = False
        self._stall_s = store.settings.rehydrate_stall_seconds
        self._moved_at = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rehydrate-heartbeat", daemon=True)

    def __enter__(self) -> _Heartbeat:
        self.moved()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def check(self) -> None:
        if self.lost:
            raise _ClaimLost

    def moved(self) -> None:
        """The build made progress (called from the build's thread; one float written)."""
        self._moved_at = time.monotonic()

    @property
    def stalled(self) -> bool:
        """No progress for ``rehydrate_stall_seconds``."""
        return time.monotonic() - self._moved_at >= self._stall_s

    def _run(self) -> None:
        was_stalled = False
        where = {"session_id": self.key[0], "format": self.key[1], "at_seq": self.key[2]}
        while not self._stop.wait(_HEARTBEAT_S):
            stalled = self.stalled
            if stalled and not was_stalled:
                log.warning(
                    "rehydrate build made no progress for %gs; its claim is left to be taken over",
                    self._stall_s,
                    extra=where,
                )
            elif was_stalled and not stalled:
                log.info("rehydrate build moves again; heart-beating its claim", extra=where)
            was_stalled = stalled
            try:
                if not (self.held() if stalled else self.beat()):
                    self.lost = True
                    return
            except Exception:  # the database away for a moment: the next beat tries again
                log.warning("rehydrate heartbeat failed", exc_info=True)

    def beat(self) -> bool:
        """Refresh the claim; False when this builder no longer holds it."""
        with write_transaction(self.store.engine) as conn:
            held = conn.execute(
                update(_rows)
                .where(*_holding(self.key, self.builder))
                .values(heartbeat_at=database_clock(self.store.engine))
            ).rowcount
        return bool(held)

    def held(self) -> bool:
        """Whether this builder still holds the claim (without refreshing it)."""
        with read_connection(self.store.engine) as conn:
            row = conn.execute(select(_rows.c.builder).where(*_holding(self.key, self.builder)))
            return row.first() is not None

    def confirm(self) -> None:
        """Before publishing: ``_ClaimLost`` unless this builder still holds the claim,
        which is then refreshed (a build that had stalled too: its output is whole), so a
        waiter does not take over an output about to be served. The publish counts as
        progress from here: one that hangs for the stall bound lets the claim go stale."""
        if self.lost or not self.beat():
            self.lost = True
            raise _ClaimLost
        self.moved()


def _build(
    store: SessionStore,
    session: Session,
    fmt: str,
    head: int,
    beat: _Heartbeat,
    progress: Progress | None,
) -> dict[str, Any]:
    key = (session.id, fmt, head)
    artifact_root = store.settings.resolved_artifact_root
    root = session_dir(artifact_root, session.tenant_id, session.id)
    staging = root / STAGING_DIR
    name = f"{uuid.uuid4().hex}.tmp"
    missing: list[str] = []
    written = 0

    def events() -> Iterator[StoredEvent]:
        nonlocal written
        for event in exporter.rehydrated_events(store, session, head, missing, moved=beat.moved):
            written += 1
            beat.moved()
            beat.check()  # taken over: stop here, the other builder's output is awaited
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
            out = _HashingWriter(raw, on_write=beat.moved)
            entries = _write(store, session, fmt, events(), cast(IO[str], out))
            raw.flush()
            os.fsync(raw.fileno())
        beat.moved()
        if on_files:
            fsync_dir(staging)
            staged: Staged = StagedFile.adopt(root, name)
        else:  # uploaded to a staging key, each chunk a step of progress
            staged = ObjectStagedFile(
                storage, artifact_root, root, local=Path(spooled), on_chunk=beat.moved
            )
    except BaseException:
        if on_files:  # nothing half-written is left for the staging sweep
            with contextlib.suppress(FileNotFoundError):  # moved with its directory
                nofollow.unlink(artifact_root, staging / name)
        raise
    finally:
        if not on_files:
            Path(spooled).unlink(missing_ok=True)
    try:
        beat.confirm()
    except BaseException:
        staged.discard()
        raise
    ttl = store.settings.rehydrate_ttl_seconds
    summary = f"rehydrated {fmt} export of {session.id} at seq {head}"
    ref = store.oversized.publish_staged(
        session.id,
        staged,
        tool_name=f"rehydrate-{fmt}",
        summary=summary,
        size=out.size,
        sha256=out.sha256.hexdigest(),
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
        finished = conn.execute(
            update(_rows)
            .where(*_holding(key, beat.builder))
            .values(
                status=DONE,
                artifact_id=ref.artifact_id,
                result=result,
                heartbeat_at=database_clock(store.engine),
                builds=_rows.c.builds + 1,
            )
        ).rowcount
    if not finished:  # taken over while publishing: the other builder's output stands
        store.oversized.discard(session.id, ref.artifact_id)
        raise _ClaimLost
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
    parent = exporter.parent_file(store, session)
    if fmt == "pi":
        return exporter.write_pi(session, events, out, parent_file=parent)
    if fmt == "omp":
        # oh-my-pi's session file, its images as refs into this store's blobs (the same
        # sha256 addresses, so ``resolve blob:sha256:…`` gives their bytes): only those the
        # session's manifest names, which GC keeps and a tenant's resolve finds; an image
        # the journal kept inline (oh-my-pi externalizes more) stays inline here too.
        named = _manifest_hashes(store, session.id)

        def ref_of(data: bytes) -> str | None:
            blob_hash = sha256_hex(data)
            return make_ref(blob_hash) if blob_hash in named else None

        header, entries = exporter.pi_lines(session, events, parent_file=parent)
        return omp.write_session_file(out, header, entries, ref_of)
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


def _manifest_hashes(store: SessionStore, session_id: str) -> set[str]:
    refs = table_of(BlobRefRow)
    query = select(refs.c.hash).where(refs.c.session_id == session_id).distinct()
    with read_connection(store.engine) as conn:
        return set(conn.execute(query).scalars())


class _HashingWriter(io.TextIOBase):
    """A text sink that counts and hashes the UTF-8 bytes it passes on, and reports each
    write to ``on_write`` (the build's progress)."""

    def __init__(self, raw: IO[str], *, on_write: Callable[[], None]) -> None:
        super().__init__()
        self.raw = raw
        self.size = 0
        self.sha256 = hashlib.sha256()
        self.on_write = on_write

    def write(self, text: str) -> int:
        data = text.encode("utf-8", "surrogatepass")
        self.size += len(data)
        self.sha256.update(data)
        written = self.raw.write(text)
        self.on_write()
        return written
