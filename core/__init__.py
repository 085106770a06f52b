"""sessionstore core: events, blobs, artifacts and state. Never imports ``tasks``.

Nothing is built at import: call ``SessionStore.from_settings(Settings())``.
"""

from core.errors import (
    ConcurrencyConflict,
    InvalidEvent,
    SessionNotFound,
    SessionStoreError,
)
from core.records import AppendResult, Page, Session, StoredEvent
from core.settings import Settings
from core.store import SessionStore

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
