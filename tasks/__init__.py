"""The Celery layer: tasks take ids and plain data, call into ``core``, and own retries,
locking and scheduling. Producers use ``enqueue_append`` (or ``Producer``) and
``enqueue_rehydrate``.

The names below load on first access (PEP 562): the ``sessionstore`` CLI lives in
``tasks.cli`` and must not pay for Celery and the whole core just to print ``--help``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from core.errors import WriteRejected
    from tasks.producer import AppendHandle, Producer, enqueue_append
    from tasks.rehydrate import RehydrateHandle, enqueue_rehydrate

_WHERE = {
    "AppendHandle": "tasks.producer",
    "Producer": "tasks.producer",
    "RehydrateHandle": "tasks.rehydrate",
    "WriteRejected": "core.errors",
    "enqueue_append": "tasks.producer",
    "enqueue_rehydrate": "tasks.rehydrate",
}

__all__ = [
    "AppendHandle",
    "Producer",
    "RehydrateHandle",
    "WriteRejected",
    "enqueue_append",
    "enqueue_rehydrate",
]


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'tasks' has no attribute {name!r}")
