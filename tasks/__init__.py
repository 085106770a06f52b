"""The Celery layer: tasks take ids and plain data, call into ``core``, and own retries,
locking and scheduling. Producers use ``enqueue_append``."""

from core.errors import WriteRejected
from tasks.producer import AppendHandle, enqueue_append
from tasks.rehydrate import RehydrateHandle, enqueue_rehydrate

__all__ = [
    "AppendHandle",
    "RehydrateHandle",
    "WriteRejected",
    "enqueue_append",
    "enqueue_rehydrate",
]
