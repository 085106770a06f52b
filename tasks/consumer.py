"""The worker's consumer hooks: no message is acked without an outcome.

A message can fail before any task function runs: its body cannot be decoded, it is no
task at all, its arguments do not fit the task, or it is nested so deep that the prefork
pool cannot hand it to a child (the child dies on it, and on every redelivery). Celery
logs and acks such messages. Here, in the worker's main process and before the pool, they
are dead-lettered byte for byte with their content type, encoding and a reason; only then
acked. If the dead letter cannot be written the message is rejected and requeued after a
backoff, never acked.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import orjson
from celery import Celery, Task
from celery.utils.time import maybe_iso8601
from celery.utils.time import timezone as celery_timezone
from celery.worker import state as worker_state
from celery.worker.consumer import Consumer as CeleryConsumer
from celery.worker.strategy import default as default_strategy

from core.metrics import metrics
from tasks.app import settings_of
from tasks.outcomes import APPEND_TASK, DIGEST_HEADER, dead_lettered, digest_in, write_task_id
from tasks.retry import backoff_seconds
from tasks.runtime import store_for

logger = logging.getLogger(__name__)

JSON = "application/json"
# args, kwargs and the events list sit above an event's own nesting
ENVELOPE_DEPTH = 3
_failures = {"consecutive": 0}


def keep_undeliverable(app: Celery, message: Any, reason: str, connection_errors: Any) -> None:
    """Dead-letter ``message`` verbatim, then ack it; or requeue it after a backoff."""
    headers = message.headers if isinstance(message.headers, dict) else {}
    task_id = str(headers.get("id") or "")
    body = message.body
    raw = body.encode("utf-8", "surrogatepass") if isinstance(body, str) else bytes(body or b"")
    hints = _hints(body, task_id)
    try:
        letter = store_for(app).dead_letters.record_raw(
            body=raw,
            content_type=message.content_type,
            content_encoding=message.content_encoding,
            reason=reason,
            **hints,
        )
    except Exception as exc:
        _failures["consecutive"] += 1
        delay = backoff_seconds(_failures["consecutive"], settings_of(app).task_visibility_timeout)
        logger.error(
            "could not dead-letter an undeliverable message; requeued",
            extra={"task_id": task_id, "reason": reason, "error": repr(exc), "retry_in_s": delay},
        )
        time.sleep(delay)  # the database is away: do not spin on the message
        message.reject_log_error(logger, connection_errors, requeue=True)
        return
    _failures["consecutive"] = 0
    observed = metrics()
    observed.writes.labels("rejected", "undeliverable").inc()
    observed.dead_letters.labels("undeliverable").inc()
    logger.error(
        "undeliverable message dead-lettered",
        extra={"task_id": task_id, "dead_letter_id": letter.id, "reason": reason},
    )
    # Where producers look: the message's task id, and (session, key) when the body names
    # them (as the task stores a write's outcome; a client may have chosen its own id).
    answered = {task_id} if task_id else set()
    digest = digest_in(headers.get(DIGEST_HEADER))
    if hints["session_id"] and hints["message_id"] != task_id:  # the body named both
        answered.add(write_task_id(hints["session_id"], hints["message_id"]))
    for answer_id in answered:
        try:
            app.backend.store_result(answer_id, dead_lettered(letter, digest), "SUCCESS")
        except Exception as exc:  # the letter is kept; only the producer's wait is lost
            logger.warning("could not store an outcome", extra={"error": repr(exc)})
    message.ack_log_error(logger, connection_errors)


def _hints(body: Any, task_id: str) -> dict[str, str]:
    """The write's session and key when the body is readable enough to name them, so the
    letter is found by (session, key) like any other; else the task id."""
    hints = {"message_id": task_id, "session_id": ""}
    try:
        kwargs = json.loads(body)[1]
    except Exception:  # undecodable, too deep, or not [args, kwargs, embed]
        return hints
    for field, name in (("message_id", "idempotency_key"), ("session_id", "session_id")):
        if isinstance(kwargs, dict) and isinstance(kwargs.get(name), str):
            hints[field] = kwargs[name]
    return hints


def header_problem(headers: Any, visibility_timeout: float) -> str | None:
    """Why a protocol-2 message's headers would make the worker drop, loop on or die on
    it, or None. Celery builds its request from these before any task runs: a missing
    ``id`` raised a KeyError the consumer took for a lost connection (the message put back
    and read again, for ever, the whole queue behind it); a ``task`` that is no string or a
    ``timelimit`` that is no pair of numbers killed the worker, on every redelivery; an
    ``eta`` it cannot convert was failed and dropped; a write's ``expires`` dropped it as
    revoked once passed. Only protocol 2 (a ``task`` header) is checked here; the rest
    goes Celery's way."""
    if not isinstance(headers, dict) or "task" not in headers:
        return None
    name = headers["task"]
    if not isinstance(name, str):
        return f"the task header is not a string: {_shown(name)}"
    if not _utf8_text(headers.get("id")):
        # the result backend keys the outcome by it: a lone surrogate cannot be stored
        return f"the id header is missing or not UTF-8 text: {_shown(headers.get('id'))}"
    if not _time_limits(headers.get("timelimit")):
        return (
            "the timelimit header is not [soft, hard] in positive seconds (or null): "
            f"{_shown(headers.get('timelimit'))}"
        )
    eta = headers.get("eta")
    if eta is not None:
        ahead = _seconds_ahead(eta)
        if ahead is None:
            return f"the eta header is not a time the worker can schedule: {_shown(eta)}"
        if ahead > visibility_timeout:
            # held unacked past the visibility timeout, the broker delivers it again
            return (
                f"the eta header is more than the visibility timeout ({visibility_timeout:g}"
                f" s) ahead: {_shown(eta)}"
            )
    if name == APPEND_TASK:
        if headers.get("expires") is not None:
            return f"a write never expires: expires header {_shown(headers['expires'])}"
        if headers["id"] in worker_state.revoked:
            return "revoked: the write was revoked before it ran (kept, not dropped)"
    return None


def _shown(value: Any) -> str:
    return repr(value)[:120]


def _utf8_text(value: Any) -> bool:
    if not isinstance(value, str) or not value:
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _time_limits(value: Any) -> bool:
    if value is None:
        return True
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        return False
    return all(
        limit is None
        or (isinstance(limit, (int, float)) and not isinstance(limit, bool) and _seconds(limit))
        for limit in value
    )


def _seconds(limit: float) -> bool:
    """A positive, finite number of seconds (an integer too large for a float raised)."""
    try:
        return math.isfinite(limit) and limit > 0
    except OverflowError:
        return False


def _seconds_ahead(eta: Any) -> float | None:
    """How far ahead ``eta`` is, read and converted as Celery's strategy will (ISO 8601,
    naive taken as UTC); None where that conversion fails."""
    try:
        at = maybe_iso8601(eta)
        if at.tzinfo is None:
            at = at.replace(tzinfo=UTC)
        celery_timezone.to_system(at)  # what the strategy converts: raises as there
        return float((at - datetime.now(UTC)).total_seconds())
    except (AttributeError, TypeError, ValueError, OverflowError):
        return None


def undeliverable_reason(task: Task, message: Any, max_depth: int) -> str | None:
    """Why ``message`` must not reach the pool, or None if the task can take it."""
    if message.content_type != JSON:
        return f"content type {message.content_type!r} is not accepted (JSON only)"
    body = message.body
    try:
        if isinstance(body, bytes) and message.content_encoding not in (None, "utf-8", "utf8"):
            body = body.decode(message.content_encoding)
        decoded = _loads(body)
    except (ValueError, LookupError, RecursionError) as exc:
        return f"undecodable body ({type(exc).__name__}: {str(exc)[:200]})"
    if not (
        isinstance(decoded, list)
        and len(decoded) == 3
        and isinstance(decoded[0], list)
        and isinstance(decoded[1], dict)
        and (decoded[2] is None or isinstance(decoded[2], dict))
    ):
        return "not a task message: the body must be [args, kwargs, embed]"
    embed = decoded[2] or {}
    for field in ("callbacks", "errbacks", "chain", "chord"):
        # the pool merges these into the request, and the tracer calls them after the write
        if embed.get(field) is not None and not isinstance(embed[field], (list, dict)):
            return f"not a task message: embed {field} is {_shown(embed[field])}"
    args, kwargs = decoded[0], decoded[1]
    try:
        task.__header__(*args, **kwargs)
    except TypeError as exc:
        return f"arguments do not fit {task.name}: {exc}"
    if _deeper_than(decoded, max_depth + ENVELOPE_DEPTH):
        return f"nested deeper than the limit of {max_depth} levels"
    return None


def _loads(body: Any) -> Any:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        # orjson is strict (no NaN, no lone surrogates); kombu's json is not. The task
        # reports those with a path: only a body neither can read stays here.
        return json.loads(body)


def _deeper_than(value: Any, limit: int) -> bool:
    """orjson refuses more than 255 levels in C; only then is the value walked in Python.
    (Values between ``limit`` and 255 deep reach the task, which rejects them itself.)"""
    try:
        orjson.dumps(value)
    except TypeError:
        return _depth(value) > limit
    return False


def _depth(value: Any) -> int:
    """Nesting depth without recursion (the value may be deeper than the stack allows)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in item)
    return deepest


def checked_strategy(task: Task, app: Celery, consumer: Any, **kwargs: Any) -> Callable[..., Any]:
    """Celery's default strategy, behind a check in the worker's main process."""
    handler = default_strategy(task, app, consumer, **kwargs)
    max_depth = settings_of(app).max_event_depth

    def task_message_handler(
        message: Any, body: Any, ack: Any, reject: Any, callbacks: Any, **kw: Any
    ) -> Any:
        if body is None:  # protocol 2: the body is still as the broker delivered it
            reason = undeliverable_reason(task, message, max_depth)
            if reason is not None:
                keep_undeliverable(app, message, reason, consumer.connection_errors)
                return None
        return handler(message, body, ack, reject, callbacks, **kw)

    return task_message_handler


class Consumer(CeleryConsumer):  # type: ignore[misc]
    """Celery's consumer, except that what it would log and drop is dead-lettered."""

    def create_task_handler(self, *args: Any, **kwargs: Any) -> Callable[[Any], Any]:
        handler = super().create_task_handler(*args, **kwargs)
        visibility = settings_of(self.app).task_visibility_timeout

        def on_task_received(message: Any) -> Any:
            reason = header_problem(message.headers, visibility)
            if reason is not None:
                return keep_undeliverable(self.app, message, reason, self.connection_errors)
            return handler(message)

        return on_task_received

    def on_decode_error(self, message: Any, exc: Exception) -> None:
        reason = f"undecodable message ({type(exc).__name__}: {str(exc)[:200]})"
        keep_undeliverable(self.app, message, reason, self.connection_errors)

    def on_unknown_message(self, body: Any, message: Any) -> None:
        keep_undeliverable(self.app, message, "not a task message", self.connection_errors)

    def on_unknown_task(self, body: Any, message: Any, exc: Exception) -> None:
        reason = f"unknown task ({str(exc)[:200]})"
        keep_undeliverable(self.app, message, reason, self.connection_errors)

    def on_invalid_task(self, body: Any, message: Any, exc: Exception) -> None:
        reason = f"invalid task message ({type(exc).__name__}: {str(exc)[:200]})"
        keep_undeliverable(self.app, message, reason, self.connection_errors)
