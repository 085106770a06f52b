"""The producer API: enqueue a write; any Celery client can also ``send_task`` it by name.

Delivery contract (exactly once, end to end): a write is durable once its handle reports
an outcome (``get`` returns, or raises ``WriteRejected``). Until then the producer owns it:
``Producer`` remembers every write it sent and ``resend_unconfirmed`` publishes again, under
the same (session, key), those without an outcome after a timeout; the journal dedupes.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from celery import Celery, states
from celery.exceptions import TimeLimitExceeded
from celery.result import AsyncResult

from core.errors import InvalidArgument, StorageUnavailable, WriteRejected
from core.journal.validation import check_seconds, check_write
from core.records import AppendResult
from core.settings import Settings
from core.translate import storage_errors
from tasks.app import QUEUE, get_app, settings_of
from tasks.outcomes import (
    APPEND_TASK,
    DIGEST_HEADER,
    KEY_REUSED,
    NEW_KEY,
    answer_for,
    forget_rejection,
    key_reused_error,
    outcome_in,
    write_digest,
    write_task_id,
)
from tasks.results import QueueTimeout

logger = logging.getLogger(__name__)

__all__ = ["APPEND_TASK", "AppendHandle", "Producer", "WriteRejected", "enqueue_append"]


class AppendHandle:
    """What ``enqueue_append`` returns: the write's (session, key) and its eventual outcome."""

    def __init__(
        self,
        result: AsyncResult,
        session_id: str,
        idempotency_key: str,
        send: Callable[[], AsyncResult],
        digest: str | None = None,
    ) -> None:
        self.result = result
        self.session_id = session_id
        self.idempotency_key = idempotency_key
        # the content sent, when the key is the caller's (another write may have used it)
        self.digest = digest
        self.sent_at = time.monotonic()
        self.resends = 0  # publishes after the first: each waits twice as long (Producer)
        self._send = send

    @property
    def id(self) -> str:
        return self.idempotency_key

    @property
    def task_id(self) -> str:
        """Derived from (session, key), so no two sessions share one."""
        return str(self.result.id)

    def resend(self) -> None:
        """Publish the same write again, under the same (session, key): idempotent.

        The producer's half of exactly-once: kombu's Redis transport pops a message before
        it records it as unacked, so a worker killed in that instant loses a message the
        broker had accepted. A write not confirmed in time is simply sent again.
        """
        backend = self.result.backend
        with storage_errors("broker"):
            stored = outcome_in(backend.get_task_meta(self.task_id, cache=False))
        if answer_for(stored, self.digest) is not None:
            return  # it has an outcome: nothing to resend
        if stored is not None:  # a rejection of other content sent under this key
            _forget_rejection(backend, self.task_id)  # would stand over this one's answer
        self.result = self._send()
        self.sent_at = time.monotonic()
        self.resends += 1

    def outcome(self) -> dict[str, Any] | None:
        """The stored outcome (committed, dead-lettered, or ``key_reused``: the key had
        committed other content), or None while there is none."""
        with storage_errors("broker"):
            meta = self.result.backend.get_task_meta(self.task_id)
        return answer_for(outcome_in(meta), self.digest)

    def get(self, timeout: float | None = 30.0) -> AppendResult:
        """Wait for the write; raises ``WriteRejected`` if it was dead-lettered, and
        ``IdempotencyKeyReused`` if its key had committed other content.

        Polls the stored result (safe from any thread; see ``tasks.results``).
        """
        return to_result(self._wait(timeout))

    def _wait(self, timeout: float | None) -> dict[str, Any]:
        backend = self.result.backend
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.005
        while True:
            with storage_errors("broker"):
                meta = backend.get_task_meta(self.task_id)
            state = meta["status"]
            if state == states.SUCCESS:
                outcome = answer_for(meta["result"], self.digest)
                if outcome is not None:
                    return outcome
            if state in states.PROPAGATE_STATES:
                exc = backend.exception_to_python(meta["result"])
                # A run killed at the hard time limit is recorded as a FAILURE, and its
                # message goes back to the queue (task_acks_on_timeout off): not an outcome.
                if not isinstance(exc, TimeLimitExceeded):
                    raise exc
            if deadline is not None and time.monotonic() >= deadline:
                raise QueueTimeout(
                    f"write {self.idempotency_key} not finished after {timeout}s (state {state})"
                )
            time.sleep(delay)
            delay = min(delay * 1.5, 0.1)


def to_result(outcome: dict[str, Any]) -> AppendResult:
    """An outcome document as the library's result; ``WriteRejected`` for a dead letter,
    ``IdempotencyKeyReused`` for a write whose key had committed other content."""
    if outcome.get("status") == "dead_lettered":
        raise WriteRejected(outcome)
    if outcome.get("status") == KEY_REUSED:
        raise key_reused_error(outcome)
    return AppendResult(
        session_id=outcome["session_id"],
        first_seq=outcome["first_seq"],
        last_seq=outcome["last_seq"],
        positions=list(outcome["positions"]),
        replayed=bool(outcome.get("replayed")),
    )


def validate_write(
    settings: Settings, session_id: Any, events: Any, expected_seq: Any, key: Any
) -> None:
    """The one check of a queued write, run by the producer and again by the worker."""
    check_write(
        session_id,
        events,
        expected_seq=expected_seq,
        idempotency_key=key,
        max_events=settings.max_batch_events,
        max_depth=settings.max_event_depth,
        max_bytes=settings.max_write_bytes,
    )


def enqueue_append(
    session_id: str,
    events: Sequence[Any],
    *,
    expected_seq: int | None = None,
    idempotency_key: str | None = None,
    app: Celery | None = None,
) -> AppendHandle:
    """Enqueue one write (a batch of events); the key defaults to a new UUID.

    The write is validated here exactly as the worker will (depth, strings, keys, ids,
    integer ranges, size, JSON): a bad write raises ``InvalidEvent`` naming the offending
    JSON path, and nothing is published. Enqueueing the same (session, key) twice writes
    once.
    """
    app = app or get_app()
    key = str(uuid.uuid4()) if idempotency_key is None else idempotency_key
    validate_write(settings_of(app), session_id, events, expected_seq, key)
    kwargs = {
        "session_id": session_id,
        "events": list(events),
        "expected_seq": expected_seq,
        "idempotency_key": key,
    }
    task_id = write_task_id(session_id, key)
    # A key of the caller's may have carried other content before: the digest tells its
    # outcome from this write's (a new key cannot have; it costs a hash of the write).
    digest = write_digest(events) if idempotency_key is not None else None

    def send() -> AsyncResult:
        # enqueued_at: the worker's queue-lag metric (enqueue to commit)
        headers = {"enqueued_at": time.time(), DIGEST_HEADER: digest or NEW_KEY}
        with storage_errors("broker"):
            return app.send_task(
                APPEND_TASK, kwargs=kwargs, task_id=task_id, queue=QUEUE, headers=headers
            )

    if idempotency_key is not None:  # a key of the caller's may have an answer already
        _forget_rejection(app.backend, task_id)  # (a new one cannot; see resend)
    return AppendHandle(send(), session_id, key, send, digest)


def _forget_rejection(backend: Any, task_id: str) -> None:
    """Drop a rejection stored under this (session, key) before: it is not this send's (a
    stale expected_seq, a dead letter since replayed, other content), and Celery never
    stores a result over it, so the write would commit and still be answered as
    rejected. A committed outcome stays: a send of a write that committed is answered
    with it again (or, for other content, refused by it). Best effort: with the backend
    away, or unable to forget (rpc://), the old answer stays."""
    try:
        with storage_errors("broker"):
            forget_rejection(backend, task_id)
    except (StorageUnavailable, NotImplementedError) as exc:
        # info: the publish that follows says it louder, if the broker is away too
        logger.info("could not clear a write's earlier outcome", extra={"error": repr(exc)})


# The longest wait before a resend, in doublings of the first (16x: the fifth resend on).
RESEND_BACKOFF_DOUBLINGS = 4


def _due(handle: AppendHandle, wait: float, longest: float | None) -> float:
    """How long after its last send ``handle`` is resent: ``wait``, doubled per resend."""
    due = wait * 2.0 ** min(handle.resends, RESEND_BACKOFF_DOUBLINGS)
    return due if longest is None else min(due, longest)


class Producer:
    """Sends writes and remembers which are confirmed, for exactly-once delivery.

    ``append`` enqueues and records the write as pending; ``confirmed`` lists those with an
    outcome; ``resend_unconfirmed`` re-publishes those still without one after
    ``confirm_timeout`` seconds (same keys: the journal dedupes). After a crash of the
    producer itself, its pending writes are lost with it: re-send what your own log says
    you sent but did not see confirmed, under the same (session, key).
    """

    def __init__(
        self,
        app: Celery | None = None,
        *,
        confirm_timeout: float = 30.0,
        keep_confirmed: int = 100_000,
    ) -> None:
        if keep_confirmed < 0:
            raise InvalidArgument("keep_confirmed", "must be 0 or more")
        self.app = app or get_app()
        self.confirm_timeout = check_seconds(confirm_timeout, "confirm_timeout")
        # outcomes kept for ``confirmed``, the oldest dropped past this many (a producer
        # that runs for ever would otherwise keep every outcome): ``pop_confirmed`` drains
        self.keep_confirmed = keep_confirmed
        self._pending: dict[tuple[str, str], AppendHandle] = {}
        self._outcomes: dict[tuple[str, str], dict[str, Any]] = {}
        self._lock = threading.Lock()
        self._confirmations = 0  # outcomes recorded so far (drain's sign of progress)

    def append(
        self,
        session_id: str,
        events: Sequence[Any],
        *,
        expected_seq: int | None = None,
        idempotency_key: str | None = None,
    ) -> AppendHandle:
        handle = enqueue_append(
            session_id,
            events,
            expected_seq=expected_seq,
            idempotency_key=idempotency_key,
            app=self.app,
        )
        with self._lock:
            self._pending[(session_id, handle.idempotency_key)] = handle
        return handle

    def poll(self) -> int:
        """Record the outcomes that arrived; returns how many writes are still pending."""
        with self._lock:
            pending = list(self._pending.items())
        for ident, handle in pending:
            outcome = handle.outcome()
            if outcome is not None:
                with self._lock:
                    self._outcomes.pop(ident, None)  # (re-inserted: the newest)
                    self._outcomes[ident] = outcome
                    if self._pending.pop(ident, None) is not None:
                        self._confirmations += 1
                    while len(self._outcomes) > self.keep_confirmed:
                        del self._outcomes[next(iter(self._outcomes))]
        with self._lock:
            return len(self._pending)

    def resend_unconfirmed(self, *, older_than: float | None = None) -> int:
        """Re-publish writes without an outcome ``older_than`` seconds (``confirm_timeout``
        by default) after their send, backing off: a write resent n times waits 2**n times
        as long (16 times at most: ``RESEND_BACKOFF_DOUBLINGS``). A queue that is behind,
        not losing messages, is not flooded with copies of the writes it has yet to reach."""
        if older_than is not None:
            check_seconds(older_than, "older_than")
        self.poll()
        return self._resend_stale(older_than)

    def _resend_stale(self, older_than: float | None, longest: float | None = None) -> int:
        """Resend the writes due (``longest``: the most any waits, backoff or not). Each is
        claimed under the lock first, so two threads resending at once send it once."""
        wait = self.confirm_timeout if older_than is None else older_than
        now = time.monotonic()
        with self._lock:
            stale = [h for h in self._pending.values() if now - h.sent_at >= _due(h, wait, longest)]
            claimed = [(h, h.sent_at) for h in stale]
            for handle in stale:
                handle.sent_at = now
        for i, handle in enumerate(stale):
            try:
                handle.resend()
            except BaseException:  # the broker away: those not resent are due as they were
                with self._lock:
                    for left, sent_at in claimed[i:]:
                        if left.sent_at == now:
                            left.sent_at = sent_at
                raise
        return len(stale)

    def confirmed(self) -> dict[tuple[str, str], dict[str, Any]]:
        """(session, key) -> outcome, for the writes confirmed so far (the newest
        ``keep_confirmed`` of those not taken by ``pop_confirmed``)."""
        with self._lock:
            return dict(self._outcomes)

    def pop_confirmed(self) -> dict[tuple[str, str], dict[str, Any]]:
        """``confirmed()``, forgetting those outcomes: call it as you record them."""
        with self._lock:
            taken, self._outcomes = self._outcomes, {}
            return taken

    def unconfirmed(self) -> list[AppendHandle]:
        with self._lock:
            return list(self._pending.values())

    def drain(
        self,
        *,
        timeout: float,
        resend_every: float | None = None,
        stall_timeout: float | None = None,
    ) -> None:
        """Wait until every write is confirmed, resending the stale ones meanwhile.

        Raises ``QueueTimeout`` after ``timeout`` seconds, or sooner, after
        ``stall_timeout`` seconds in which no write was confirmed: a deep queue that is
        being worked through may take its time, one that is not moving need not be
        waited for."""
        timeout = check_seconds(timeout, "timeout")
        for name, value in (("resend_every", resend_every), ("stall_timeout", stall_timeout)):
            if value is not None:
                check_seconds(value, name)
        now = time.monotonic()
        deadline = now + timeout
        moved_at, seen = now, self._confirmations
        while left := self.poll():
            now = time.monotonic()
            if self._confirmations != seen:
                moved_at, seen = now, self._confirmations
            if now >= deadline:
                raise QueueTimeout(f"{left} writes not confirmed in {timeout:g} s")
            if stall_timeout is not None and now - moved_at >= stall_timeout:
                raise QueueTimeout(f"{left} writes not confirmed, none for {stall_timeout:g} s")
            # a write is resent within half the stall limit, whatever its backoff: a drain
            # gives up on a write only after resending it (a killed worker lost its copy)
            self._resend_stale(resend_every, None if stall_timeout is None else stall_timeout / 2)
            time.sleep(0.2)
