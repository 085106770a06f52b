"""The ``celery worker`` process: it never ends with status 0 unless it was asked to stop.

After a broker loss, kombu can raise from its restore of unacked messages (an
AttributeError in ``restore_unacked``) while the consumer tears down, and Celery then
returns from ``start`` with no exit code: status 0. A supervisor that restarts only
failed processes would leave the worker dead. A stop nobody asked for (no signal, no
remote shutdown) is a failure here.

Such a stop is also bounded in time. Celery's warm shutdown after an "Unrecoverable error"
waits for the pool and flushes acks through a broker that may just have gone away; seen
here after a broker kill, it never returned, so the process neither worked nor exited and
no supervisor restarted it. After ``UNREQUESTED_STOP_GRACE`` seconds the process exits
with status 1 regardless: its unacknowledged tasks (``acks_late``) are redelivered to the
worker the supervisor starts next.
"""

from __future__ import annotations

import logging
import os
import threading

from celery.apps.worker import Worker as CeleryWorker
from celery.platforms import EX_FAILURE
from celery.worker import state

logger = logging.getLogger(__name__)

UNREQUESTED_STOP_GRACE = 30.0
"""Seconds a stop nobody asked for may take before the process exits anyway."""


def stop_was_requested() -> bool:
    """A signal (warm or cold) or a remote ``shutdown`` asked this worker to stop."""
    return state.should_stop is not None or state.should_terminate is not None


class Worker(CeleryWorker):  # type: ignore[misc]
    def start(self) -> None:
        try:
            super().start()
        finally:
            if not getattr(self, "exitcode", None) and not stop_was_requested():
                logger.critical(
                    "worker stopped without being asked to (broker lost?): exiting non-zero",
                    extra={"hostname": self.hostname},
                )
                self.exitcode = EX_FAILURE

    def stop(self, in_sighandler: bool = False, exitcode: int | None = None) -> None:
        if exitcode not in (None, 0) and not stop_was_requested():
            exit_after(UNREQUESTED_STOP_GRACE)
        super().stop(in_sighandler=in_sighandler, exitcode=exitcode)


def exit_after(seconds: float) -> threading.Timer:
    """Exit the process with status 1 in ``seconds``, whatever it is doing by then."""

    def bail_out() -> None:
        logger.critical(
            "worker did not stop within %.0f s of an unrequested stop: exiting now", seconds
        )
        logging.shutdown()
        os._exit(EX_FAILURE)

    timer = threading.Timer(seconds, bail_out)
    timer.daemon = True
    timer.start()
    return timer
