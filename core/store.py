"""SessionStore: the one wiring point and the synchronous library API.

A facade: it builds the pieces from ``Settings`` and each method hands the work, in a line
or two, to the module that owns it. No logic of its own lives here.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import IO, Any, ParamSpec, TypeVar

from sqlalchemy import Engine

from core import migrate
from core.artifacts import (
    ArtifactManager,
    ArtifactStats,
    OversizedOutputs,
    OversizedStored,
    ResolvedResource,
    stats_by_kind,
)
from core.artifacts import resolve as resolve_url
from core.artifacts.integrity import VerifiedChunks
from core.artifacts.storage import ArtifactStorage, artifact_storage_for
from core.blobs import BlobStats, BlobStore, blob_store_for
from core.blobs.rehydrate import RehydrateMode, Rehydrator
from core.db import close_engine
from core.interop.exporter import export_pi
from core.interop.importer import ImportResult, import_session
from core.journal import DeadLetters, Journal
from core.journal.validation import CheckedEvents, check_name
from core.maintenance import (
    ExpireRunReport,
    GcReport,
    GcResume,
    MaintenanceRuns,
    Progress,
    expire_artifacts,
    gc_blobs,
)
from core.query import EventFilter, SessionState, Stats, analytics
from core.query import stats as query_stats
from core.query.snapshots import session_state
from core.records import AppendResult, Page, PreparedEvent, Session, StoredEvent
from core.sessions import (
    CopyReport,
    DeleteReport,
    ForkCopier,
    ForkCopies,
    Forks,
    MoveRepair,
    Moves,
    SessionLifecycle,
)
from core.settings import Settings
from core.writes import Writer

# The arguments that name something stored (an id, a tenant, a path): a U+0000 in one is
# refused by name (check_name). PostgreSQL's text cannot hold it, so such a lookup failed
# inside the driver (a raw DataError on some paths), where SQLite matched nothing.
_NAMES = frozenset({"session_id", "session_ref", "ref", "fork_id", "tenant_id", "cwd"})

P = ParamSpec("P")
R = TypeVar("R")


def _no_nul(method: Callable[P, R]) -> Callable[P, R]:
    checked = [(i, n) for i, n in enumerate(inspect.signature(method).parameters) if n in _NAMES]

    @functools.wraps(method)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        for i, name in checked:
            check_name(args[i] if i < len(args) else kwargs.get(name), name)
        return method(*args, **kwargs)

    return wrapper


class SessionStore:
    # Hands a new fork's pending artifact copy to the queue (set by ``tasks``; core never
    # imports tasks). None: the copy runs in this process right after the fork.
    fork_copier: ForkCopier | None = None

    def __init__(self, settings: Settings, engine: Engine) -> None:
        self.settings = settings
        self.engine = engine
        self.journal = Journal(engine)
        self.dead_letters = DeadLetters(engine)

    @classmethod
    def from_settings(
        cls, settings: Settings | None = None, *, create: bool = True
    ) -> SessionStore:
        """Open the configured journal. Embedded SQLite: the schema is created or upgraded
        here (``create=False``: a missing database file is DatabaseMissing, never a new
        empty one). PostgreSQL: SchemaNotCurrent unless ``db upgrade`` brought it to head."""
        settings = settings or Settings()
        return cls(settings, migrate.open_engine(settings.resolved_database_url, create=create))

    def close(self) -> None:
        """Close the store's connections; using it afterwards raises ``StoreClosed``."""
        close_engine(self.engine)

    def __enter__(self) -> SessionStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # the pieces, built on first use ------------------------------------------------------

    @cached_property
    def artifact_storage(self) -> ArtifactStorage:
        return artifact_storage_for(self.settings)

    @cached_property
    def blobs(self) -> BlobStore:
        return blob_store_for(self.settings, self.engine)

    @cached_property
    def _rehydrator(self) -> Rehydrator:
        """Shared by this store's reads: its cache of verified blob values lives as long."""
        return Rehydrator(self.blobs)

    @cached_property
    def _writer(self) -> Writer:
        return Writer(self.journal, self.blobs, self.settings)

    @cached_property
    def oversized(self) -> OversizedOutputs:
        """Oversized tool outputs (TTL artifacts) of every session."""
        return OversizedOutputs(self.engine, self.settings)

    @cached_property
    def maintenance_runs(self) -> MaintenanceRuns:
        """The log of periodic maintenance runs (ran or skipped, with their reports)."""
        return MaintenanceRuns(self.engine)

    @cached_property
    def _forks(self) -> Forks:
        return Forks(self.journal, self.settings)

    @cached_property
    def _fork_copies(self) -> ForkCopies:
        return ForkCopies(self.journal, self.settings)

    @cached_property
    def _moves(self) -> Moves:
        return Moves(self.journal, self.settings)

    @cached_property
    def _lifecycle(self) -> SessionLifecycle:
        return SessionLifecycle(self.journal, self.settings)

    # sessions ---------------------------------------------------------------------------

    def create_session(
        self,
        *,
        tenant_id: str,
        title: str | None = None,
        cwd: str | None = None,
        external_id: str | None = None,
    ) -> Session:
        """A new session; ``external_id`` is the id an agent knows it by (unique per tenant,
        accepted wherever a session id is)."""
        return self.journal.create_session(
            tenant_id=tenant_id, title=title, cwd=cwd, external_id=external_id
        )

    @_no_nul
    def get_session(self, session_id: str, *, tenant_id: str | None = None) -> Session:
        return self.journal.get_session(session_id, tenant_id=tenant_id)

    @_no_nul
    def resolve_session(self, ref: str, *, tenant_id: str | None = None) -> Session:
        """A session by id, or by external id (the agent's own id) within the tenant."""
        return self.journal.resolve_session(ref, tenant_id=tenant_id)

    @_no_nul
    def import_session(
        self,
        path: str | Path,
        *,
        tenant_id: str,
        format: str = "auto",
        blobs_dir: str | Path | None = None,
        wait_for_header: bool = False,
    ) -> ImportResult:
        """Import or continue importing an agent's session file (pi v1-v3, oh-my-pi, Claude
        Code); idempotent, see ``core.interop.importer``. ``blobs_dir``: oh-my-pi's global
        blob directory (default: next to its sessions directory, else ~/.omp/agent/blobs).
        ``wait_for_header``: see ``import_session``."""
        options = {"blobs_dir": Path(blobs_dir)} if blobs_dir is not None else None
        return import_session(
            self,
            path,
            tenant_id=tenant_id,
            format=format,
            options=options,
            wait_for_header=wait_for_header,
        )

    @_no_nul
    def export_session(
        self,
        session_id: str,
        out: IO[str],
        *,
        at_seq: int | None = None,
        tenant_id: str | None = None,
    ) -> int:
        """Write the session as a version-3 pi file; returns the number of lines."""
        return export_pi(self, session_id, out, at_seq=at_seq, tenant_id=tenant_id)

    @_no_nul
    def list_sessions(
        self, *, tenant_id: str | None = None, limit: int = 100, cursor: str | None = None
    ) -> Page:
        return self.journal.list_sessions(tenant_id=tenant_id, limit=limit, cursor=cursor)

    @_no_nul
    def fork(
        self, session_id: str, *, at_seq: int | None = None, tenant_id: str | None = None
    ) -> Session:
        """A new session with the parent's events 1..``at_seq`` (default: the head), its
        artifacts created up to then, and counters continuing after the parent's ids. The
        artifact files are copied after the commit (``copy_status``: pending → copied)."""
        fork = self._forks.fork(session_id, at_seq=at_seq, tenant_id=tenant_id)
        return self._fork_copies.hand_over(fork, self.fork_copier)

    @_no_nul
    def copy_fork_artifacts(self, fork_id: str) -> CopyReport:
        """Copy a fork's inherited artifact files (idempotent; retries a failed copy).
        ``StorageUnavailable`` when an outage keeps the copy pending: retry later."""
        return self._fork_copies.copy_artifacts(fork_id)

    def pending_forks(self, *, older_than_s: float, limit: int = 1000) -> list[str]:
        """Forks whose artifact copy has been pending for longer than ``older_than_s``."""
        return self._fork_copies.pending_forks(older_than_s=older_than_s, limit=limit)

    @_no_nul
    def move(
        self, session_id: str, *, tenant_id: str | None = None, cwd: str | None = None
    ) -> Session:
        """Move a session to another tenant and/or cwd, with its artifact directory; all or
        nothing (a failed directory move rolls the metadata back and re-raises)."""
        return self._moves.move(session_id, tenant_id=tenant_id, cwd=cwd)

    def repair_moves(
        self, *, session_id: str | None = None, older_than_s: float = 0.0
    ) -> list[MoveRepair]:
        """Complete or roll back moves a crash left half done (invariant 12): every one, or
        that of ``session_id``."""
        return self._moves.repair(session_id=session_id, older_than_s=older_than_s)

    @_no_nul
    def delete_session(self, session_id: str, *, tenant_id: str | None = None) -> DeleteReport:
        """Remove a session, its events, manifest rows, artifacts and directory; blobs are
        left for GC, and its forks keep working. A move of it a crash left half done (its
        intent older than ``fork_copy_timeout_seconds``, as the reconciler judges it) is
        finished or rolled back first, so the directory removed is where its files are; a
        younger one may be live, and a crashed one the reconciler's repair finds deleted
        names both tenants' directories for the expiry run."""
        self.journal.get_session(session_id, tenant_id=tenant_id)  # visible before anything
        self._moves.repair(
            session_id=session_id, older_than_s=self.settings.fork_copy_timeout_seconds
        )
        return self._lifecycle.delete(session_id, tenant_id=tenant_id)

    # events -----------------------------------------------------------------------------

    def append(
        self,
        session_id: str,
        events: Sequence[Any] | CheckedEvents,
        *,
        expected_seq: int | None = None,
        idempotency_key: str | None = None,
    ) -> AppendResult:
        """Validate, externalize (blobs are stored before the events commit), then append.
        ``CheckedEvents`` (``core.journal.validation.checked``) are not checked again."""
        return self._writer.append(
            session_id, events, expected_seq=expected_seq, idempotency_key=idempotency_key
        )

    def committed_write(
        self, session_id: str, events: Sequence[Any], idempotency_key: str
    ) -> AppendResult | None:
        """The answer ``append`` would give ``events`` under ``idempotency_key`` as a replay
        (nothing is written or stored): None if the key has committed nothing in the
        session; ``IdempotencyKeyReused`` if it committed other content."""
        return self._writer.committed_write(session_id, events, idempotency_key)

    def prepare(self, events: Sequence[Any]) -> list[PreparedEvent]:
        """Validate a batch, put its blobs, and turn it into journal-ready events."""
        return self._writer.prepare(events)

    @_no_nul
    def read(
        self,
        session_id: str,
        *,
        after_seq: int = 0,
        upto_seq: int | None = None,
        limit: int | None = None,
        tenant_id: str | None = None,
        rehydrate: RehydrateMode = False,
    ) -> list[StoredEvent]:
        """Events in seq order. ``rehydrate``: False (refs as stored), True (the exact
        original values) or ``"lazy"`` (``LazyBlob`` values that read the store on access).
        """
        events = self.journal.read(
            session_id, after_seq=after_seq, upto_seq=upto_seq, limit=limit, tenant_id=tenant_id
        )
        return self.rehydrate(events, lazy=rehydrate == "lazy") if rehydrate else events

    @_no_nul
    def read_all(
        self,
        *,
        after_position: int = 0,
        limit: int = 1000,
        tenant_id: str | None = None,
        types: Sequence[str] | None = None,
    ) -> list[StoredEvent]:
        return self.journal.read_all(
            after_position=after_position, limit=limit, tenant_id=tenant_id, types=types
        )

    def rehydrate(self, events: Sequence[StoredEvent], *, lazy: bool = False) -> list[StoredEvent]:
        """Restore externalized values from the manifest (exact, or as ``LazyBlob``s)."""
        return self._rehydrator.read(self.journal, events, lazy=lazy)

    # state and analysts' queries ----------------------------------------------------------

    @_no_nul
    def state(
        self,
        session_id: str,
        *,
        at_seq: int | None = None,
        tenant_id: str | None = None,
        rehydrate: RehydrateMode = "lazy",
    ) -> SessionState:
        """The session's state after ``at_seq`` (default: the head), from the latest snapshot
        plus a fold of the rest. Blob values in the shown content are ``LazyBlob``s by
        default (``rehydrate=False``: refs as stored; ``True``: exact values)."""
        return session_state(
            self.journal,
            session_id,
            at_seq=at_seq,
            tenant_id=tenant_id,
            snapshot_every=self.settings.snapshot_every,
            rehydrate=self._rehydrator.loader(self.journal, rehydrate),
        )

    def list_events(
        self, flt: EventFilter | None = None, *, after_position: int = 0, limit: int = 100
    ) -> Page:
        """A page of events matching ``flt``, by global position (see ``core.query``)."""
        return analytics.list_events(self.engine, flt, after_position=after_position, limit=limit)

    @_no_nul
    def stats(
        self,
        *,
        tenant_id: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        top: int = 10,
        include_inherited: bool = False,
        progress: Progress | None = None,
    ) -> Stats:
        """Events per type and day, sessions, top sessions, tokens, blob dedup, artifacts;
        each event once across a fork tree unless ``include_inherited`` (per session).
        ``progress``: the first call after a bulk load rolls up the journal (once)."""
        return query_stats.stats(
            self.engine,
            tenant_id=tenant_id,
            since=since,
            until=until,
            top=top,
            include_inherited=include_inherited,
            progress=progress,
        )

    # blobs and artifacts ----------------------------------------------------------------

    def blob_stats(self) -> BlobStats:
        return self.blobs.stats()

    @_no_nul
    def artifacts(self, session_id: str, *, tenant_id: str | None = None) -> ArtifactManager:
        """The artifact manager of one session (SessionNotFound if the tenant cannot see it)."""
        self.journal.get_session(session_id, tenant_id=tenant_id)
        return ArtifactManager(self.engine, self.settings, session_id)

    @_no_nul
    def resolve(
        self,
        url: str,
        *,
        session_id: str,
        tenant_id: str | None = None,
        offset: int | None = None,
        limit: int | None = None,
        partial: bool = False,
    ) -> ResolvedResource:
        """artifact://<id>, agent://<id>[/path|?q=], art_<16 hex> or blob:sha256:<hex>.

        A tool output not whole (its writer unfinished or dead) is ``ArtifactIncomplete``,
        or with ``partial`` its bytes so far, ``complete`` False."""
        return resolve_url(
            self.engine,
            self.settings.resolved_artifact_root,
            url,
            session_id=session_id,
            tenant_id=tenant_id,
            offset=offset,
            limit=limit,
            blob_reader=self.blobs.get,
            storage=self.artifact_storage,
            partial=partial,
        )

    def store_oversized(
        self, session_id: str, content: str, tool_name: str, ttl_s: int | None = None
    ) -> OversizedStored | None:
        """Keep an output over ``oversized_output_chars`` as a TTL artifact (else None)."""
        return self.oversized.store(session_id, content, tool_name, ttl_s)

    @_no_nul
    def retrieve(
        self, artifact_id: str, *, session_id: str, tenant_id: str | None = None
    ) -> str | None:
        """An oversized output's text; None once expired or if its file is gone."""
        return self.oversized.retrieve(artifact_id, session_id=session_id, tenant_id=tenant_id)

    @_no_nul
    def retrieve_chunks(
        self, artifact_id: str, *, session_id: str, tenant_id: str | None = None
    ) -> VerifiedChunks | None:
        """An oversized output's bytes a chunk at a time (memory bounded whatever its size);
        None once expired or if its file is gone. Checked against what was stored as they
        pass: ``ArtifactCorrupt`` after the last chunk if they are not it. Its file stays
        open until the last chunk: close it (``with``) however the reading ends."""
        return self.oversized.retrieve_chunks(
            artifact_id, session_id=session_id, tenant_id=tenant_id
        )

    @_no_nul
    def artifact_stats(self, *, tenant_id: str | None = None) -> dict[str, ArtifactStats]:
        """Count and bytes of artifacts per kind (all tenants unless one is named)."""
        return stats_by_kind(self.engine, tenant_id=tenant_id)

    # maintenance ------------------------------------------------------------------------

    def gc_blobs(
        self,
        *,
        apply: bool = False,
        grace: float | None = None,
        batch_size: int = 1000,
        progress: Progress | None = None,
        time_budget_s: float | None = None,
        resume: GcResume | None = None,
    ) -> GcReport:
        """Collect blobs no event references, written more than ``grace`` seconds ago
        (default ``settings.gc_grace_seconds``), and blob files never registered. A dry run
        unless ``apply``; memory stays bounded by ``batch_size`` whatever the store's size.
        ``resume``: start where a run ``time_budget_s`` cut short stopped (its ``resume``)."""
        return gc_blobs(
            self.engine,
            self.blobs,
            apply=apply,
            grace_s=self.settings.gc_grace_seconds if grace is None else grace,
            batch_size=batch_size,
            progress=progress,
            time_budget_s=time_budget_s,
            resume=resume,
        )

    def expire_artifacts(
        self, *, apply: bool = False, batch_size: int = 1000, progress: Progress | None = None
    ) -> ExpireRunReport:
        """Oversized outputs past their TTL, in bounded batches until none is due; with
        ``apply``, delete them (and stale staging files, and the directories of deleted
        sessions their delete left behind). The beat job and CLI run this too."""
        return expire_artifacts(
            self.engine,
            self.oversized,
            apply=apply,
            batch_size=batch_size,
            progress=progress,
            lifecycle=self._lifecycle,
        )
