"""A real Celery worker inside this process, for the embedded setup (no Redis, no servers).

Messages still go through the broker (the filesystem transport by default): serialization,
acks and retries are the real ones. This is not eager mode.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from celery import Celery
from celery.result import _set_task_join_will_block
from celery.worker import WorkController

from core.errors import SessionStoreError


class _Controller(WorkController):  # type: ignore[misc]
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.ready = threading.Event()
        super().__init__(*args, **kwargs)

    def on_consumer_ready(self, consumer: Any) -> None:
        self.ready.set()


@contextmanager
def embedded_worker(
    app: Celery,
    *,
    concurrency: int = 2,
    ready_timeout: float = 30.0,
    remote_control: bool = True,
) -> Iterator[WorkController]:
    """Run a thread-pool worker consuming ``app``'s queue until the block exits.
    ``remote_control=False``: no remote-control mailbox (a worker that lives as long as one
    command: on the filesystem broker each one it bound stayed bound after it, and every
    later broadcast, ``queue status``, wrote messages for it that nothing read)."""
    app.finalize()
    # Pool threads look tasks up through celery's current app, which falls back to the
    # process default: make it this app.
    app.set_default()
    remote_before = app.conf.worker_enable_remote_control
    app.conf.worker_enable_remote_control = remote_control and remote_before
    worker = _Controller(
        app=app,
        pool_cls="threads",
        concurrency=concurrency,
        loglevel="WARNING",
        without_heartbeat=True,
        without_mingle=True,
        without_gossip=True,
        hostname=f"embedded-{threading.get_ident()}@localhost",
    )
    thread = threading.Thread(target=worker.start, name="sessionstore-worker", daemon=True)
    thread.start()
    if not worker.ready.wait(ready_timeout):
        worker.stop()
        raise SessionStoreError("the embedded worker did not start in time")
    # The worker marks this process as "inside a task"; the producer side of this same
    # process must still be able to wait for results (celery.contrib.testing does the same).
    _set_task_join_will_block(False)
    try:
        yield worker
    finally:
        worker.stop(in_sighandler=False)
        thread.join(30)
        app.conf.worker_enable_remote_control = remote_before
