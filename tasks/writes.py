"""``sessionstore.append``: the queue path of a write. Retries and dead-lettering live here;
the write itself is ``SessionStore.append``, the same core code as the library path.

Every run ends in exactly one outcome: committed, retried (a transient failure, typed
``StorageUnavailable`` by core), or dead-lettered. If the dead letter itself cannot be
written the message goes back to the queue after a backoff; it is never acked without one
of the three. What the task returns, and all Celery stores, is a small JSON document:
nothing from the write's values (which may be unencodable) is ever serialized.
"""

from __future__ import annotations

import logging
import time
from typing import Any, NoReturn

from celery import Task, states
from celery.exceptions import SoftTimeLimitExceeded

from core.errors import DeliveriesExhausted, IdempotencyKeyReused, InvalidEvent
from core.metrics import metrics
from core.records import AppendResult
from tasks.app import sessionstore_task, settings_of
from tasks.deliveries import delivery_count, forget_deliveries
from tasks.outcomes import (
    APPEND_TASK,
    DIGEST_HEADER,
    NEW_KEY,
    committed,
    dead_lettered,
    digest_in,
    digest_or_none,
    forget_rejection,
    keeps_outcomes,
    replace_outcome,
    write_digest,
    write_task_id,
)
from tasks.producer import validate_write
from tasks.retry import backoff_seconds, is_transient, retry_or_requeue
from tasks.runtime import store_for

logger = logging.getLogger(__name__)

SOFT_LIMIT_RETRIES = 2


class WriteTask(Task):  # type: ignore[misc]
    """The write task's class: what it does once Celery has stored its outcome."""

    def on_success(self, retval: Any, task_id: str, args: Any, kwargs: Any) -> None:
        # Runs after the trace stored ``retval``: nothing of this delivery is stored later.
        if isinstance(retval, dict) and retval.get("status") == "dead_lettered":
            _unless_committed_since(self, retval)


@sessionstore_task(name=APPEND_TASK, bind=True, max_retries=None, base=WriteTask)
def append(
    self: Task,
    session_id: Any,
    events: Any,
    expected_seq: Any = None,
    idempotency_key: Any = None,
) -> dict[str, Any]:
    settings = settings_of(self.app)
    key = str(self.request.id) if idempotency_key is None else idempotency_key
    self.request.sessionstore_write = (session_id, events, key)  # for on_success
    try:
        deliveries = delivery_count(self)
    except SoftTimeLimitExceeded as exc:  # escaping, it would end the write acked as failed
        _retry_later(self, "cut short while counting deliveries, retrying write", exc)
    if deliveries > settings.task_max_deliveries:
        outcome = _given_up(self, key, session_id, events, expected_seq, deliveries)
        return _answer(self, outcome, deliveries)
    refused: Exception | None = None
    try:
        # The producer ran this already; other clients may not have (send_task by name).
        validate_write(settings, session_id, events, expected_seq, key)
        result = store_for(self.app).append(
            session_id, events, expected_seq=expected_seq, idempotency_key=key
        )
    except Exception as exc:
        # Cut short by the soft time limit (a lock wait, a slow store): the write did not
        # commit, or did and its retry is answered as a replay; retried a little, then a
        # write that hits the limit every time is dead-lettered.
        cut_short = isinstance(exc, SoftTimeLimitExceeded)
        retries = SOFT_LIMIT_RETRIES if cut_short else settings.task_max_retries
        if (cut_short or is_transient(exc)) and self.request.retries < retries:
            _retry_later(self, "transient failure, retrying write", exc)
        refused = exc
    try:
        if refused is not None:
            outcome = _dead_letter(self, key, session_id, events, expected_seq, refused)
        else:
            outcome = committed(key, result, _digest_of(self, events))
            _observe_commit(self, result.replayed)
            _clear_rejections(self, session_id, key)
        return _answer(self, outcome, deliveries)
    except SoftTimeLimitExceeded as late:
        # Escaping, the limit would be the write's outcome (a FAILURE, acked) though it
        # committed or was kept: run again, and the key answers it (the letter found again).
        _retry_later(self, "cut short after its outcome was decided, answering it again", late)


def _answer(task: Task, outcome: dict[str, Any], deliveries: int) -> dict[str, Any]:
    """The write's outcome, stored where producers look it up; its deliveries forgotten.
    A rejection is not stored at all where the key has committed already (the same write,
    by another delivery; or other content): that commit answers instead."""
    if outcome.get("status") == "dead_lettered":
        outcome = _commit_of_the_key(task, outcome) or outcome
    _store_under_write_id(task, outcome)
    if deliveries > 1:
        forget_deliveries(task)
    return outcome


def _task_ids(task: Task, session_id: Any, key: Any) -> list[str]:
    """Where the write's outcome is stored: its task id, and the one (session, key) derive."""
    ids = [str(task.request.id)]
    if isinstance(session_id, str) and isinstance(key, str):
        derived = write_task_id(session_id, key)
        ids += [derived] if derived != ids[0] else []
    return ids


def _clear_rejections(task: Task, session_id: Any, key: Any) -> None:
    """A commit's outcome stands over a rejection stored for the same (session, key) before
    it: another delivery of the write (a producer's resend, a client's second send) was
    dead-lettered first, for a cause this one did not meet (a stale ``expected_seq``, the
    session made since). Celery never stores a result over it, so the write, committed,
    would be answered as rejected, and its producer might send it again as new. One read
    of the stored outcome per commit; best effort (the commit stands either way)."""
    if not keeps_outcomes(task.backend):
        return
    for task_id in _task_ids(task, session_id, key):
        try:
            forget_rejection(task.backend, task_id)
        except Exception as exc:
            logger.warning("could not clear an earlier rejection", extra={"error": repr(exc)})


def _unless_committed_since(task: Task, rejected: dict[str, Any]) -> None:
    """Once a rejection is stored: if the journal holds a commit under its (session, key),
    store that commit over it.

    Another delivery of the write may commit between this one's rejection and its outcome
    being stored: that commit's ``_clear_rejections`` found nothing yet, and then Celery
    kept this rejection over its outcome (it stores nothing over a SUCCESS). So the
    journal is asked again after every store of the rejection (``on_success``); a commit
    after the asking finds the rejection and clears it itself. (``_answer`` asks before
    the rejection is stored, too: a commit found then is never shown as a rejection.)"""
    if not keeps_outcomes(task.backend):
        return
    answer = _commit_of_the_key(task, rejected)
    if answer is None:
        return
    session_id, _events, key = task.request.sessionstore_write
    logger.info(
        "a rejected write's key was committed by another delivery meanwhile; answering it",
        extra={"session_id": session_id, "dead_letter_id": rejected.get("dead_letter_id")},
    )
    for task_id in _task_ids(task, session_id, key):
        try:
            replace_outcome(task.backend, task_id, answer)
        except Exception as exc:
            logger.warning("could not store a write's commit", extra={"error": repr(exc)})


def _commit_of_the_key(task: Task, rejected: dict[str, Any]) -> dict[str, Any] | None:
    """The answer a rejected write's (session, key) gives once the key has committed: this
    content's commit, or, for other content under the key (invalid content too: no write
    could hold it), the key's commit as ``_kept_for_the_key`` states it (this write's
    producer is then told ``key_reused``). None while the key holds no commit, or where
    the journal cannot say (the rejection stands: best effort). The dead letter stays (a
    replay of it is answered as the replay it is)."""
    write = getattr(task.request, "sessionstore_write", None)
    if write is None:
        return None
    session_id, events, key = write
    if not isinstance(session_id, str) or not isinstance(key, str):
        return None
    store = store_for(task.app)
    try:
        prior = store.journal.find_write(session_id, key)
        if prior is None:
            return None
        try:
            same = store.committed_write(session_id, events, key)
        except IdempotencyKeyReused as exc:
            reused = exc
        except InvalidEvent:  # content no write could hold: the key's commit is another's
            reused = IdempotencyKeyReused(
                prior.session_id, key, prior.first_seq, prior.last_seq, prior.positions
            )
        else:
            return committed(key, same or prior, _digest_of(task, events))
    except Exception as exc:  # the database away
        logger.debug("no commit found for a rejected write", extra={"error": repr(exc)})
        return None
    answer = _kept_for_the_key(task, reused, rejected)
    return None if answer is rejected else answer


def _given_up(
    task: Task, key: Any, session_id: Any, events: Any, expected_seq: Any, deliveries: int
) -> dict[str, Any]:
    """The outcome of a write delivered too often: committed, if an earlier delivery
    committed it before being killed (a lookup, not the write that hangs), else a dead
    letter saying how often it came back (or why the lookup refused it)."""
    error: Exception = DeliveriesExhausted(deliveries)
    try:
        prior = store_for(task.app).committed_write(session_id, events, key)
        if prior is not None:
            return committed(key, prior, _digest_of(task, events))
    except InvalidEvent as exc:  # bad input, or the key's other content: the letter says so
        error = exc
    except Exception as exc:  # the database stuck too: keep the write
        logger.warning("could not look up a write delivered too often", extra={"error": repr(exc)})
    return _dead_letter(task, key, session_id, events, expected_seq, error)


def _digest_of(task: Task, events: Any) -> str | None:
    """The digest of the write's content for its outcome: the producer's (``DIGEST_HEADER``),
    none for a key the producer made for it, else (a client that sent none) computed."""
    sent = task.request.get(DIGEST_HEADER)
    if sent == NEW_KEY:
        return None
    if digest_in(sent) is not None:
        return str(sent)
    return digest_or_none(events)  # None: no write could hold them (a dead letter's)


def _observe_commit(task: Task, replayed: bool) -> None:
    observed = metrics()
    observed.writes.labels("committed", "replayed" if replayed else "").inc()
    enqueued_at = task.request.get("enqueued_at")
    if isinstance(enqueued_at, (int, float)) and not replayed:
        observed.queue_lag_seconds.observe(max(0.0, time.time() - enqueued_at))


def _retry_later(task: Task, what: str, exc: BaseException) -> NoReturn:
    """Retry with backoff; if the retry cannot even be published, requeue the message."""
    settings = settings_of(task.app)
    delay = backoff_seconds(task.request.retries, settings.task_visibility_timeout)
    metrics().writes.labels("retried", type(exc).__name__).inc()
    logger.warning(
        what, extra={"task_id": task.request.id, "retry_in_s": round(delay, 2), "error": repr(exc)}
    )
    # No exc: Celery would store it, and a driver's exception may not encode. No expires:
    # Celery copies the message's own, and a retry past it was dropped as revoked (a write
    # that started never expires).
    retry_or_requeue(task, delay, max_retries=None, expires=None)


def _dead_letter(
    task: Task, key: Any, session_id: Any, events: Any, expected_seq: Any, error: Exception
) -> dict[str, Any]:
    """Keep a rejected write (bad input, or retries exhausted); never drop it."""
    try:
        letter = store_for(task.app).dead_letters.record(
            idempotency_key=key,
            session_id=session_id,
            events=events,
            expected_seq=expected_seq,
            error=error,
        )
    except Exception as exc:
        # No outcome without the letter: back to the queue, later (the database is away).
        _retry_later(task, "could not dead-letter a write; retrying", exc)
    observed = metrics()
    observed.writes.labels("rejected", letter.error_type).inc()
    observed.dead_letters.labels(letter.error_type).inc()
    logger.error(
        "write dead-lettered",
        extra={
            "session_id": letter.session_id,
            "key": letter.idempotency_key,
            "dead_letter_id": letter.id,
            "error_type": letter.error_type,
            "error": letter.error,
        },
    )
    rejected = dead_lettered(letter, _digest_of(task, events))
    if isinstance(error, IdempotencyKeyReused):
        return _kept_for_the_key(task, error, rejected)
    return rejected


def _kept_for_the_key(
    task: Task, error: IdempotencyKeyReused, rejected: dict[str, Any]
) -> dict[str, Any]:
    """What (session, key) answers after other content under it was refused: the write the
    key committed, with the digest of its own content (read back exactly), so its producer
    is answered and every other content is told ``key_reused``. The key holds one outcome,
    the first stored: a rejection there would stand over the commit, whose own outcome may
    not be stored yet (a worker killed between its commit and its result), for good."""
    prior = AppendResult(
        error.session_id, error.first_seq, error.last_seq, error.positions, replayed=True
    )
    try:
        events = store_for(task.app).read(
            prior.session_id,
            after_seq=prior.first_seq - 1,
            upto_seq=prior.last_seq,
            rehydrate=True,
        )
        digest = write_digest([event.payload for event in events])
    except Exception as exc:  # the database away: the rejection is an answer too
        logger.warning("could not read back a reused key's write", extra={"error": repr(exc)})
        return rejected
    return committed(error.idempotency_key, prior, digest)


def _store_under_write_id(task: Task, outcome: dict[str, Any]) -> None:
    """A client that chose its own task id still finds the outcome by (session, key)."""
    derived = _task_ids(task, outcome.get("session_id"), outcome.get("idempotency_key"))[1:]
    for task_id in derived:  # none when the client's task id is the derived one
        try:
            task.backend.store_result(task_id, outcome, states.SUCCESS)
        except Exception as exc:  # the outcome is in the journal; only a lookup is lost
            logger.warning("could not store an outcome by key", extra={"error": repr(exc)})
