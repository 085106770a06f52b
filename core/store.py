"""SessionStore: the one wiring point and the synchronous library API."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Engine

from core.db import make_engine
from core.journal import Journal
from core.records import AppendResult, Page, PreparedEvent, Session, StoredEvent
from core.settings import Settings
from core.validation import check_batch


class SessionStore:
    def __init__(self, settings: Settings, engine: Engine) -> None:
        self.settings = settings
        self.engine = engine
        self.journal = Journal(engine)

    @classmethod
    def from_settings(cls, settings: Settings | None = None) -> SessionStore:
        settings = settings or Settings()
        return cls(settings, make_engine(settings.resolved_database_url))

    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self) -> SessionStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # sessions ---------------------------------------------------------------------------

    def create_session(
        self, *, tenant_id: str, title: str | None = None, cwd: str | None = None
    ) -> Session:
        return self.journal.create_session(tenant_id=tenant_id, title=title, cwd=cwd)

    def get_session(self, session_id: str, *, tenant_id: str | None = None) -> Session:
        return self.journal.get_session(session_id, tenant_id=tenant_id)

    def list_sessions(
        self, *, tenant_id: str | None = None, limit: int = 100, cursor: str | None = None
    ) -> Page:
        return self.journal.list_sessions(tenant_id=tenant_id, limit=limit, cursor=cursor)

    # events -----------------------------------------------------------------------------

    def prepare(self, events: Sequence[Any]) -> list[PreparedEvent]:
        """Validate a batch and turn it into journal-ready events."""
        check_batch(
            events,
            max_events=self.settings.max_batch_events,
            max_depth=self.settings.max_event_depth,
        )
        return [PreparedEvent(type=e["type"], payload=e) for e in events]

    def append(
        self,
        session_id: str,
        events: Sequence[Any],
        *,
        expected_seq: int | None = None,
        idempotency_key: str | None = None,
    ) -> AppendResult:
        prepared = self.prepare(events)
        return self.journal.append(
            session_id, prepared, expected_seq=expected_seq, idempotency_key=idempotency_key
        )

    def read(
        self,
        session_id: str,
        *,
        after_seq: int = 0,
        upto_seq: int | None = None,
        limit: int | None = None,
        tenant_id: str | None = None,
    ) -> list[StoredEvent]:
        return self.journal.read(
            session_id, after_seq=after_seq, upto_seq=upto_seq, limit=limit, tenant_id=tenant_id
        )

    def read_all(
        self,
        *,
        after_position: int = 0,
        limit: int = 1000,
        tenant_id: str | None = None,
        types: Sequence[str] | None = None,
    ) -> list[StoredEvent]:
        return self.journal.read_all(
            after_position=after_position, limit=limit, tenant_id=tenant_id, types=types
        )

    # --- blobs (issue 3) ---------------------------------------------------------------

    # --- artifacts and resolve (issue 5) -------------------------------------------------

    # --- state and analysts' queries (issue 8) -------------------------------------------
