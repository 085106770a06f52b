"""The Celery layer: tasks take ids and plain data, call into ``core``, and own retries,
locking and scheduling. Producers use ``enqueue_append`` (or ``Producer``) and
``enqueue_rehydrate``."""

from core.errors import WriteRejected
from tasks.producer import AppendHandle, Producer, enqueue_append
from tasks.rehydrate import RehydrateHandle, enqueue_rehydrate

__all__ = [
    "AppendHandle",
    "Producer",
    "RehydrateHandle",
    "WriteRejected",
    "enqueue_append",
    "enqueue_rehydrate",
]
