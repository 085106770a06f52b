"""The ``celery worker`` process: it never ends with status 0 unless it was asked to stop.

After a broker loss, kombu can raise from its restore of unacked messages (an
AttributeError in ``restore_unacked``) while the consumer tears down, and Celery then
returns from ``start`` with no exit code: status 0. A supervisor that restarts only
failed processes would leave the worker dead. A stop nobody asked for (no signal, no
remote shutdown) is a failure here.
"""

from __future__ import annotations

import logging

from celery.apps.worker import Worker as CeleryWorker
from celery.platforms import EX_FAILURE
from celery.worker import state

logger = logging.getLogger(__name__)


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
