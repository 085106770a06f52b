"""SessionStore: the one wiring point and the synchronous library API."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import datetime
from functools import cached_property
from typing import Any

from sqlalchemy import Engine

from core import analytics, maintenance
from core.analytics import EventFilter, Stats
from core.artifacts import (
    ArtifactManager,
    ArtifactStats,
    ExpireReport,
    OversizedOutputs,
    OversizedStored,
    ResolvedResource,
    stats_by_kind,
)
from core.artifacts import resolve as resolve_url
from core.blobs import BlobStats, BlobStore, open_blob_store
from core.db import make_engine
from core.deadletters import DeadLetters
from core.errors import BlobsMissing
from core.journal import Journal
from core.maintenance import GcReport, MaintenanceRuns, Progress
from core.persist import PersistedBatch, Persister, missing_ref_error
from core.records import AppendResult, Page, PreparedEvent, Session, StoredEvent
from core.rehydrate import RehydrateMode, Rehydrator
from core.session_state import SessionState
from core.sessions import CopyReport, DeleteReport, ForkCopier, SessionLifecycle
from core.settings import Settings
from core.snapshots import session_state
from core.validation import check_batch

log = logging.getLogger(__name__)
# An append re-puts blobs GC collected under it at most this many times before giving up.
_APPEND_ATTEMPTS = 3


class SessionStore:
    def __init__(self, settings: Settings, engine: Engine) -> None:
        self.settings = settings
        self.engine = engine
        self.journal = Journal(engine)
        self.dead_letters = DeadLetters(engine)

    @classmethod
    def from_settings(cls, settings: Settings | None = None) -> SessionStore:
        settings = settings or Settings()
        return cls(settings, make_engine(settings.resolved_database_url))

    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self) -> SessionStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # sessions ---------------------------------------------------------------------------

    def create_session(
        self, *, tenant_id: str, title: str | None = None, cwd: str | None = None
    ) -> Session:
        return self.journal.create_session(tenant_id=tenant_id, title=title, cwd=cwd)

    def get_session(self, session_id: str, *, tenant_id: str | None = None) -> Session:
        return self.journal.get_session(session_id, tenant_id=tenant_id)

    def list_sessions(
        self, *, tenant_id: str | None = None, limit: int = 100, cursor: str | None = None
    ) -> Page:
        return self.journal.list_sessions(tenant_id=tenant_id, limit=limit, cursor=cursor)

    # events -----------------------------------------------------------------------------

    def prepare(self, events: Sequence[Any]) -> list[PreparedEvent]:
        """Validate a batch, put its blobs, and turn it into journal-ready events."""
        return self._persist(events).events

    def append(
        self,
        session_id: str,
        events: Sequence[Any],
        *,
        expected_seq: int | None = None,
        idempotency_key: str | None = None,
    ) -> AppendResult:
        """Validate, externalize (blobs are stored before the events commit), then append."""
        plan = self._persister.plan(events, self._check(events))
        if idempotency_key is not None and plan.puts_blobs:
            # A replay (e.g. a Celery redelivery) must not put the batch's blobs again. A
            # batch without blobs needs no pre-check: the append itself answers a replay.
            prior = self.journal.find_write(session_id, idempotency_key)
            if prior is not None:
                return prior
        batch = self._persister.put(plan)
        return self._append_batch(
            session_id, batch, expected_seq=expected_seq, idempotency_key=idempotency_key
        )

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
        if not rehydrate:
            return events
        return self.rehydrate(events, lazy=rehydrate == "lazy")

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

    # --- blobs (issue 3) ---------------------------------------------------------------

    @cached_property
    def blobs(self) -> BlobStore:
        return open_blob_store(self.settings.resolved_blob_url, self.engine)

    @cached_property
    def _persister(self) -> Persister:
        return Persister(
            self.blobs,
            image_min_base64_chars=self.settings.image_min_base64_chars,
            inline_string_limit=self.settings.inline_string_limit,
        )

    def blob_stats(self) -> BlobStats:
        return self.blobs.stats()

    def rehydrate(self, events: Sequence[StoredEvent], *, lazy: bool = False) -> list[StoredEvent]:
        """Restore externalized values from the manifest (exact, or as ``LazyBlob``s)."""
        if not events:
            return list(events)
        manifest = self.journal.manifest([e.position for e in events])
        return Rehydrator(self.blobs).events(events, manifest, lazy=lazy)

    def _check(self, events: Sequence[Any]) -> list[bytes | None]:
        return check_batch(
            events,
            max_events=self.settings.max_batch_events,
            max_depth=self.settings.max_event_depth,
        )

    def _persist(self, events: Sequence[Any]) -> PersistedBatch:
        return self._persister.persist(events, self._check(events))

    def _append_batch(
        self,
        session_id: str,
        batch: PersistedBatch,
        *,
        expected_seq: int | None,
        idempotency_key: str | None,
    ) -> AppendResult:
        """Append; if GC took a blob of ours in between, put it again and retry."""
        attempt = 1
        while True:
            try:
                return self.journal.append(
                    session_id,
                    batch.events,
                    expected_seq=expected_seq,
                    idempotency_key=idempotency_key,
                )
            except BlobsMissing as exc:
                if attempt >= _APPEND_ATTEMPTS:
                    raise
                self._reput_missing(session_id, batch, exc, attempt)
                attempt += 1

    def _reput_missing(
        self, session_id: str, batch: PersistedBatch, exc: BlobsMissing, attempt: int
    ) -> None:
        ref = batch.input_ref_for(exc.hashes)
        if ref is not None:  # the producer's ref: we never had its bytes
            raise missing_ref_error(ref) from exc
        if not exc.hashes <= batch.blobs.keys():
            raise exc
        log.warning(
            "blobs collected before the append committed; putting them again",
            extra={"session_id": session_id, "hashes": sorted(exc.hashes), "attempt": attempt},
        )
        self.blobs.put_many([batch.blobs[h] for h in sorted(exc.hashes)])

    # --- artifacts and resolve (issue 5) -------------------------------------------------

    def artifacts(self, session_id: str, *, tenant_id: str | None = None) -> ArtifactManager:
        """The artifact manager of one session (SessionNotFound if the tenant cannot see it)."""
        self.journal.get_session(session_id, tenant_id=tenant_id)
        return ArtifactManager(self.engine, self.settings, session_id)

    @cached_property
    def oversized(self) -> OversizedOutputs:
        """Oversized tool outputs (TTL artifacts) of every session."""
        return OversizedOutputs(self.engine, self.settings)

    def resolve(
        self,
        url: str,
        *,
        session_id: str,
        tenant_id: str | None = None,
        offset: int | None = None,
        limit: int | None = None,
    ) -> ResolvedResource:
        """artifact://<id>, agent://<id>[/path|?q=], art_<16 hex> or blob:sha256:<hex>."""
        return resolve_url(
            self.engine,
            self.settings.resolved_artifact_root,
            url,
            session_id=session_id,
            tenant_id=tenant_id,
            offset=offset,
            limit=limit,
            blob_reader=self.blobs.get,
        )

    def store_oversized(
        self, session_id: str, content: str, tool_name: str, ttl_s: int | None = None
    ) -> OversizedStored | None:
        """Keep an output over ``oversized_output_chars`` as a TTL artifact (else None)."""
        return self.oversized.store(session_id, content, tool_name, ttl_s)

    def retrieve(
        self, artifact_id: str, *, session_id: str, tenant_id: str | None = None
    ) -> str | None:
        """An oversized output's text; None once expired or if its file is gone."""
        return self.oversized.retrieve(artifact_id, session_id=session_id, tenant_id=tenant_id)

    def artifact_stats(self, *, tenant_id: str | None = None) -> dict[str, ArtifactStats]:
        """Count and bytes of artifacts per kind (all tenants unless one is named)."""
        return stats_by_kind(self.engine, tenant_id=tenant_id)

    def expire_artifacts(self, *, apply: bool = False) -> ExpireReport:
        """Oversized outputs past their TTL; with ``apply``, delete them."""
        return self.oversized.expire(apply=apply)

    # --- state and analysts' queries (issue 8) -------------------------------------------

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

        def load_blobs(events: list[StoredEvent]) -> list[StoredEvent]:
            return self.rehydrate(events, lazy=rehydrate == "lazy")

        return session_state(
            self.journal,
            session_id,
            at_seq=at_seq,
            tenant_id=tenant_id,
            snapshot_every=self.settings.snapshot_every,
            rehydrate=load_blobs if rehydrate else None,
        )

    def list_events(
        self,
        flt: EventFilter | None = None,
        *,
        after_position: int = 0,
        limit: int = 100,
    ) -> Page:
        """A page of events matching ``flt``, by global position (see ``core.analytics``)."""
        return analytics.list_events(self.engine, flt, after_position=after_position, limit=limit)

    def stats(
        self,
        *,
        tenant_id: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        top: int = 10,
    ) -> Stats:
        """Events per type and day, sessions, top sessions, tokens, blob dedup, artifacts."""
        return analytics.stats(self.engine, tenant_id=tenant_id, since=since, until=until, top=top)

    # --- maintenance (issue 7) -----------------------------------------------------------

    def gc_blobs(
        self,
        *,
        apply: bool = False,
        grace: float | None = None,
        batch_size: int = 1000,
        progress: Progress | None = None,
        time_budget_s: float | None = None,
    ) -> GcReport:
        """Collect blobs no event references, written more than ``grace`` seconds ago
        (default ``settings.gc_grace_seconds``), and blob files never registered. A dry run
        unless ``apply``; memory stays bounded by ``batch_size`` whatever the store's size."""
        return maintenance.gc_blobs(
            self.engine,
            self.blobs,
            apply=apply,
            grace_s=self.settings.gc_grace_seconds if grace is None else grace,
            batch_size=batch_size,
            progress=progress,
            time_budget_s=time_budget_s,
        )

    @cached_property
    def maintenance_runs(self) -> MaintenanceRuns:
        """The log of periodic maintenance runs (ran or skipped, with their reports)."""
        return MaintenanceRuns(self.engine)

    # --- fork, move and delete (issue 6) ---

    # Called with a new fork whose artifact copy is pending, after the fork committed; the
    # queue setup sets it to enqueue ``sessionstore.copy_artifacts`` (core never imports
    # tasks). None: the copy runs in this process right after the fork.
    fork_copier: ForkCopier | None = None

    @cached_property
    def lifecycle(self) -> SessionLifecycle:
        return SessionLifecycle(self.journal, self.settings)

    def fork(
        self, session_id: str, *, at_seq: int | None = None, tenant_id: str | None = None
    ) -> Session:
        """A new session with the parent's events 1..``at_seq`` (default: the head), its
        artifacts created up to then, and counters continuing after the parent's ids. The
        artifact files are copied after the commit (``copy_status``: pending → copied)."""
        fork = self.lifecycle.fork(session_id, at_seq=at_seq, tenant_id=tenant_id)
        if fork.copy_status != "pending":
            return fork
        if self.fork_copier is None:
            self.copy_fork_artifacts(fork.id)
            return self.get_session(fork.id)
        try:
            self.fork_copier(fork)
        except Exception as exc:
            # The fork is committed and usable; the reconciler re-enqueues its copy.
            log.warning(
                "could not hand the fork's artifact copy over; the reconciler will retry",
                extra={"fork_id": fork.id, "error": repr(exc)},
            )
        return fork

    def copy_fork_artifacts(self, fork_id: str) -> CopyReport:
        """Copy a fork's inherited artifact files (idempotent; retries a failed copy)."""
        return self.lifecycle.copy_artifacts(fork_id)

    def pending_forks(self, *, older_than_s: float, limit: int = 1000) -> list[str]:
        """Forks whose artifact copy has been pending for longer than ``older_than_s``."""
        return self.lifecycle.pending_forks(older_than_s=older_than_s, limit=limit)

    def move(
        self, session_id: str, *, tenant_id: str | None = None, cwd: str | None = None
    ) -> Session:
        """Move a session to another tenant and/or cwd, with its artifact directory; all or
        nothing (a failed directory move rolls the metadata back and re-raises)."""
        return self.lifecycle.move(session_id, tenant_id=tenant_id, cwd=cwd)

    def delete_session(self, session_id: str, *, tenant_id: str | None = None) -> DeleteReport:
        """Remove a session, its events, manifest rows, artifacts and directory; blobs are
        left for GC, and its forks keep working."""
        return self.lifecycle.delete(session_id, tenant_id=tenant_id)
