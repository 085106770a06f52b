"""The producer API: enqueue a write; any Celery client can also ``send_task`` it by name."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import orjson
from celery import Celery, states
from celery.exceptions import TimeoutError as CeleryTimeoutError
from celery.result import AsyncResult

from core.errors import InvalidEvent, WriteRejected, WriteTooLarge
from core.records import AppendResult
from tasks.app import QUEUE, get_app, settings_of

APPEND_TASK = "sessionstore.append"


class AppendHandle:
    """What ``enqueue_append`` returns: the key (also the task id) and the eventual result."""

    def __init__(
        self, result: AsyncResult, idempotency_key: str, send: Callable[[], AsyncResult]
    ) -> None:
        self.result = result
        self.idempotency_key = idempotency_key
        self._send = send

    def resend(self) -> None:
        """Publish the same write again, under the same key (and task id): idempotent.

        The producer's half of at-least-once: kombu's Redis transport pops a message before
        it records it as unacked, so a worker killed in that instant loses a message the
        broker had accepted. A write not confirmed in time is simply sent again.
        """
        self.result.forget()  # get() waits for the new run, not a stale stored result
        self.result = self._send()

    @property
    def id(self) -> str:
        return self.idempotency_key

    def get(self, timeout: float | None = 30.0) -> AppendResult:
        """Wait for the write; raises ``WriteRejected`` if it was dead-lettered.

        Polls the stored result (safe from any thread; see ``tasks.results``).
        """
        outcome = self._wait(timeout)
        if outcome.get("status") == "dead_lettered":
            raise WriteRejected(outcome)
        return AppendResult(
            session_id=outcome["session_id"],
            first_seq=outcome["first_seq"],
            last_seq=outcome["last_seq"],
            positions=list(outcome["positions"]),
            replayed=bool(outcome.get("replayed")),
        )

    def _wait(self, timeout: float | None) -> dict[str, Any]:
        backend = self.result.backend
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.005
        while True:
            meta = backend.get_task_meta(self.idempotency_key)
            state = meta["status"]
            if state == states.SUCCESS:
                outcome: dict[str, Any] = meta["result"]
                return outcome
            if state in states.PROPAGATE_STATES:
                raise backend.exception_to_python(meta["result"])
            if deadline is not None and time.monotonic() >= deadline:
                raise CeleryTimeoutError(
                    f"write {self.idempotency_key} not finished after {timeout}s (state {state})"
                )
            time.sleep(delay)
            delay = min(delay * 1.5, 0.1)


def _encoded_size(events: Sequence[Any]) -> int:
    try:
        return len(orjson.dumps(events))
    except TypeError:  # not JSON: the worker dead-letters it with the reason
        return len(repr(events).encode())


def enqueue_append(
    session_id: str,
    events: Sequence[Any],
    *,
    expected_seq: int | None = None,
    idempotency_key: str | None = None,
    app: Celery | None = None,
) -> AppendHandle:
    """Enqueue one write (a batch of events). The key defaults to a new UUID and is the
    task id, so enqueueing the same key twice writes once."""
    app = app or get_app()
    settings = settings_of(app)
    if isinstance(events, (str, bytes, dict)) or not isinstance(events, Sequence):
        raise InvalidEvent("", "events must be a list of event objects")
    if len(events) > settings.max_batch_events:
        raise WriteTooLarge(
            "", f"{len(events)} events exceed the limit of {settings.max_batch_events} per write"
        )
    size = _encoded_size(events)
    if size > settings.max_write_bytes:
        raise WriteTooLarge(
            "", f"write of {size:,} bytes exceeds the limit of {settings.max_write_bytes:,} bytes"
        )
    key = idempotency_key or str(uuid.uuid4())
    kwargs = {
        "session_id": session_id,
        "events": list(events),
        "expected_seq": expected_seq,
        "idempotency_key": key,
    }

    def send() -> AsyncResult:
        return app.send_task(APPEND_TASK, kwargs=kwargs, task_id=key, queue=QUEUE)

    return AppendHandle(send(), key, send)
