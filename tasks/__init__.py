"""The Celery layer: tasks take ids and plain data, call into ``core``, and own retries,
locking and scheduling. Producers use ``enqueue_append``."""

from core.errors import WriteRejected
from tasks.producer import AppendHandle, Producer, enqueue_append

__all__ = ["AppendHandle", "Producer", "WriteRejected", "enqueue_append"]
