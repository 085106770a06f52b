"""The write path, one way: validate → externalize (blobs durable first) → journal append.

Shared step for step by the library (``SessionStore.append``) and the queue (the
``sessionstore.append`` task calls the same method).
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Collection, Mapping, Sequence
from functools import partial
from typing import Any

from sqlalchemy import Connection

from core import exact_json
from core.blobs.externalize import (
    PersistedBatch,
    Persister,
    PersistPlan,
    holds_blob,
    missing_ref_error,
    set_at_pointer,
    value_at_pointer,
)
from core.blobs.rehydrate import Rehydrator, holds_ref
from core.blobs.store import BlobStore, StagedPuts, count_puts
from core.errors import (
    BlobError,
    BlobsMissing,
    IdempotencyKeyReused,
    InvalidEvent,
    StorageUnavailable,
    SymlinkRefused,
)
from core.journal import Journal, check_batch
from core.journal.validation import (
    MAX_ID_LENGTH,
    MAX_KEY_LENGTH,
    CheckedEvents,
    check_batch_size,
    check_id,
    check_seq,
)
from core.metrics import metrics
from core.records import AppendResult, ManifestEntry, PreparedEvent, StoredEvent
from core.settings import Settings

log = logging.getLogger(__name__)

# An append re-puts blobs GC collected under it at most this many times before giving up.
_APPEND_ATTEMPTS = 3


class Writer:
    """Appends batches of raw events to sessions of one journal and blob store."""

    def __init__(self, journal: Journal, blobs: BlobStore, settings: Settings) -> None:
        self.journal = journal
        self.blobs = blobs
        self.settings = settings
        self.persister = Persister(
            blobs,
            image_min_base64_chars=settings.image_min_base64_chars,
            inline_string_limit=settings.inline_string_limit,
        )

    def validate(self, events: Sequence[Any]) -> list[bytes | None]:
        """Check a batch (raises ``InvalidEvent``); the events' JSON where it was computed."""
        return check_batch(
            events,
            max_events=self.settings.max_batch_events,
            max_depth=self.settings.max_event_depth,
        )

    def prepare(self, events: Sequence[Any]) -> list[PreparedEvent]:
        """Validate a batch, put its blobs, and turn it into journal-ready events."""
        return self.persister.persist(events, self.validate(events)).events

    def append(
        self,
        session_id: str,
        events: Sequence[Any] | CheckedEvents,
        *,
        expected_seq: int | None = None,
        idempotency_key: str | None = None,
    ) -> AppendResult:
        started = time.perf_counter()
        result = self._append(
            session_id, events, expected_seq=expected_seq, idempotency_key=idempotency_key
        )
        observed = metrics()
        observed.append_seconds.observe(time.perf_counter() - started)
        if not result.replayed:
            observed.events_appended.inc(result.last_seq - result.first_seq + 1)
        return result

    def _append(
        self,
        session_id: str,
        events: Sequence[Any] | CheckedEvents,
        *,
        expected_seq: int | None,
        idempotency_key: str | None,
    ) -> AppendResult:
        # typed, naming the field, before anything reads or stores them (as the queue's path
        # checks them): an int failed untyped, and a NUL key was kept by SQLite only
        check_id(session_id, "session_id", MAX_ID_LENGTH)
        if idempotency_key is not None:
            check_id(idempotency_key, "idempotency_key", MAX_KEY_LENGTH)
        if expected_seq is not None:
            check_seq(expected_seq, "expected_seq", error=InvalidEvent)
        if isinstance(events, CheckedEvents):  # each event checked already: the batch's size
            check_batch_size(events.events, max_events=self.settings.max_batch_events)
            encoded = list(events.encoded)
            events = events.events
        else:
            encoded = self.validate(events)
        plan = self.persister.plan(events, encoded)
        if idempotency_key is not None and plan.puts_blobs:
            # A replay (e.g. a Celery redelivery) must not put the batch's blobs again. A
            # batch without blobs needs no pre-check: the append itself answers a replay.
            prior = self._replay_of(session_id, plan, idempotency_key)
            if prior is not None:
                self._restore_carried(plan)
                return prior
        tenant_id = self._tenant_of(session_id) if plan.has_input_refs else None
        # The new blobs are stored now and registered in the append's own transaction.
        batch = self.persister.put(plan, tenant_id=tenant_id, register=False)
        result = self._append_batch(
            session_id, batch, expected_seq=expected_seq, idempotency_key=idempotency_key
        )
        if result.replayed and idempotency_key is not None:
            payloads = [event.payload for event in batch.events]
            return self._same_write(result, idempotency_key, plan, payloads)
        return result

    def committed_write(
        self, session_id: str, events: Sequence[Any], idempotency_key: str
    ) -> AppendResult | None:
        """What appending ``events`` under ``idempotency_key`` would answer as a replay,
        found without writing or storing anything: None if the key committed nothing."""
        check_id(session_id, "session_id", MAX_ID_LENGTH)
        check_id(idempotency_key, "idempotency_key", MAX_KEY_LENGTH)
        plan = self.persister.plan(events, self.validate(events))
        return self._replay_of(session_id, plan, idempotency_key)

    def _replay_of(self, session_id: str, plan: PersistPlan, key: str) -> AppendResult | None:
        prior = self.journal.find_write(session_id, key)
        if prior is None:
            return None
        return self._same_write(prior, key, plan, self.persister.planned_payloads(plan))

    def _same_write(
        self,
        prior: AppendResult,
        key: str,
        plan: PersistPlan,
        payloads: Sequence[dict[str, Any]],
    ) -> AppendResult:
        """``prior``, the write committed under ``key``, if the batch ``plan`` walked (stored
        as ``payloads``) is its content: a replay. Other content under the same key raises
        ``IdempotencyKeyReused``.

        The stored JSON decides when it is the same. Where it differs, the batch may still
        be the same write stored under other settings (a value a blob holds one time and
        inline the other, or in another encoding): both are compared as sent, the
        committed events rehydrated exactly (invariant 11) and the batch's values put back.
        """
        committed = self.journal.read(
            prior.session_id, after_seq=prior.first_seq - 1, upto_seq=prior.last_seq
        )
        stored = [exact_json.dumps(event.payload) for event in committed]
        if stored != [exact_json.dumps(payload) for payload in payloads] and (
            len(stored) != len(payloads) or not self._same_as_sent(committed, plan)
        ):
            raise IdempotencyKeyReused(
                prior.session_id, key, prior.first_seq, prior.last_seq, prior.positions
            )
        return prior

    def _same_as_sent(self, committed: list[StoredEvent], plan: PersistPlan) -> bool:
        """Whether ``committed``, rehydrated exactly, is the batch of ``plan`` as sent.

        A committed blob lost or corrupted since cannot make a replay look like other
        content: a blob the batch carries is read from the batch, and one the store cannot
        give back is compared by its hash (content-addressed, as the store is), the value
        the batch has in its place the same only if it hashes to it. A producer's ref the
        store cannot read raises its typed error (``BlobNotFound``, ``BlobCorrupted``)."""
        carried = plan.carried()
        unreadable: set[str] = set()

        def get(blob_hash: str) -> bytes:
            if blob_hash in carried:
                return carried[blob_hash]
            try:
                return self.blobs.get(blob_hash)
            except BlobError:  # rehydration keeps the ref (logged) and goes on
                unreadable.add(blob_hash)
                raise

        sent = self.persister.sent_payloads(plan, get)
        manifest = self.journal.manifest_of(committed)
        shown = [e.payload for e in Rehydrator(self.blobs, get=get).events(committed, manifest)]
        if unreadable and not _fill_by_hash(committed, manifest, unreadable, shown, sent):
            return False
        return [exact_json.dumps(p) for p in shown] == [exact_json.dumps(p) for p in sent]

    def _restore_carried(self, plan: PersistPlan) -> None:
        """A replay carries the bytes of its blobs: put again each one the store has lost
        or holds damaged since (a registered blob, so referenced: the replayed write's own,
        or another session's that holds the same content), as a re-put of the content
        repairs it (invariant 13). A check only, without writing, where all are intact.
        Best effort: a store that cannot be read now does not fail the replay's answer."""
        try:
            damaged = {
                blob_hash: data
                for blob_hash, data in sorted(plan.carried().items())
                if self.blobs.index.registered(blob_hash)
                and (
                    not self.blobs.has_stored(blob_hash)
                    or self.blobs.check_stored(blob_hash, len(data)) is not None
                )
            }
            if damaged:
                log.warning(
                    "a replayed write carried blobs the store had lost or damaged; put again",
                    extra={"hashes": list(damaged)},
                )
                self.blobs.put_many(list(damaged.values()))
        except (StorageUnavailable, SymlinkRefused, OSError) as exc:
            log.warning("could not check a replayed write's blobs", extra={"error": str(exc)})

    def _tenant_of(self, session_id: str) -> str:
        # Refs without bytes are scoped by the session's tenant (invariant 9).
        return self.journal.get_session(session_id).tenant_id

    def _append_batch(
        self,
        session_id: str,
        batch: PersistedBatch,
        *,
        expected_seq: int | None,
        idempotency_key: str | None,
    ) -> AppendResult:
        """Append, registering the batch's staged blobs in the same transaction; if GC
        took a blob of ours in between, put it again and retry."""
        staged = batch.staged
        # Rows a backend registered while staging (in a commit of its own) are share-locked
        # by the append like any ref; the others are upserted, and held, by its transaction.
        register = None
        if staged is not None and not staged.registered:
            register = partial(self._register_in_append, staged)
        attempt = 1
        while True:
            try:
                result = self.journal.append(
                    session_id,
                    batch.events,
                    expected_seq=expected_seq,
                    idempotency_key=idempotency_key,
                    before=register,
                )
                if staged is not None:
                    count_puts(staged.results())
                return result
            except BlobsMissing as exc:
                if attempt >= _APPEND_ATTEMPTS:
                    raise
                self._reput_missing(session_id, batch, exc, attempt)
                attempt += 1

    def _register_in_append(self, staged: StagedPuts, conn: Connection) -> Collection[str]:
        self.blobs.register_staged(conn, staged)
        return staged.unique.keys()

    def _reput_missing(
        self, session_id: str, batch: PersistedBatch, exc: BlobsMissing, attempt: int
    ) -> None:
        ref = batch.input_ref_for(exc.hashes - batch.blobs.keys())
        if ref is not None:  # the producer's ref: we never had its bytes
            raise missing_ref_error(ref) from exc
        if not exc.hashes <= batch.blobs.keys():
            raise exc
        log.warning(
            "blobs collected before the append committed; putting them again",
            extra={"session_id": session_id, "hashes": sorted(exc.hashes), "attempt": attempt},
        )
        self.blobs.put_many([batch.blobs[h] for h in sorted(exc.hashes)])


def _fill_by_hash(
    events: Sequence[StoredEvent],
    manifest: Mapping[int, Sequence[ManifestEntry]],
    hashes: Collection[str],
    shown: list[dict[str, Any]],
    sent: Sequence[dict[str, Any]],
) -> bool:
    """Put in ``shown`` (the events rehydrated, refs left where a blob of ``hashes`` could
    not be read) the value ``sent`` has in each such place, if it is that blob's value:
    its bytes hash to the ref. False where it is not (or ``sent`` has none there): the
    events differ. A manifest entry whose place does not hold its ref was left as stored
    by the rehydration, and is compared as stored."""
    for index, event in enumerate(events):
        entries = [
            e
            for e in manifest.get(event.position, ())
            if e.hash in hashes and holds_ref(shown[index], e)
        ]
        if not entries:
            continue
        shown[index] = copy.deepcopy(shown[index])
        for entry in entries:
            value = value_at_pointer(sent[index], entry.pointer)
            if not holds_blob(value, entry.hash, entry.encoding):
                return False
            set_at_pointer(shown[index], entry.pointer, value)
    return True
