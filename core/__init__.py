"""sessionstore core: events, blobs, artifacts and state. Never imports ``tasks``.

Nothing is built at import: call ``SessionStore.from_settings(Settings())``. The public
names load on first access (PEP 562), so importing one light submodule (``core.errors``,
as the CLI does at start-up) does not import the whole store, SQLAlchemy and pydantic.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from core.errors import (
        ConcurrencyConflict,
        InvalidEvent,
        SessionNotFound,
        SessionStoreError,
    )
    from core.records import AppendResult, Page, Session, StoredEvent
    from core.settings import Settings
    from core.store import SessionStore

_WHERE = {
    "AppendResult": "core.records",
    "ConcurrencyConflict": "core.errors",
    "InvalidEvent": "core.errors",
    "Page": "core.records",
    "Session": "core.records",
    "SessionNotFound": "core.errors",
    "SessionStore": "core.store",
    "SessionStoreError": "core.errors",
    "Settings": "core.settings",
    "StoredEvent": "core.records",
}

__all__ = [
    "AppendResult",
    "ConcurrencyConflict",
    "InvalidEvent",
    "Page",
    "Session",
    "SessionNotFound",
    "SessionStore",
    "SessionStoreError",
    "Settings",
    "StoredEvent",
]


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'core' has no attribute {name!r}")
