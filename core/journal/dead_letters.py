"""Dead letters: queued writes that were rejected, kept verbatim for inspection and replay."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Engine, delete, func, insert, select

from core.db import read_connection, write_transaction
from core.errors import DeadLetterNotFound, SessionStoreError
from core.models import DeadLetterRow, table_of, utcnow
from core.records import AppendResult

_letters = table_of(DeadLetterRow)


@dataclass(frozen=True, slots=True)
class DeadLetter:
    id: int
    idempotency_key: str
    session_id: str
    expected_seq: int | None
    payload: str
    error_type: str
    error: str
    created_at: datetime

    @property
    def events(self) -> Any:
        """The original events. Parsed leniently: NaN and friends come back as they were."""
        return json.loads(self.payload)

    def to_dict(self, *, with_payload: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "idempotency_key": self.idempotency_key,
            "session_id": self.session_id,
            "expected_seq": self.expected_seq,
            "error_type": self.error_type,
            "error": self.error,
            "created_at": self.created_at.isoformat(),
            "payload_bytes": len(self.payload.encode()),
        }
        if with_payload:
            out["events"] = self.events
        return out


def _encode(events: Any) -> str:
    # stdlib json, not orjson: it keeps NaN/Infinity as written and never refuses a value,
    # so whatever the producer sent can be stored and shown (non-JSON values as repr).
    return json.dumps(events, default=repr, ensure_ascii=False)


class DeadLetters:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def record(
        self,
        *,
        idempotency_key: str,
        session_id: str,
        events: Any,
        expected_seq: int | None,
        error: BaseException,
    ) -> DeadLetter:
        message = error.message if isinstance(error, SessionStoreError) else str(error)
        values = {
            "idempotency_key": idempotency_key[:200],
            "session_id": str(session_id)[:36],
            "expected_seq": expected_seq,
            "payload": _encode(events),
            "error_type": type(error).__name__[:64],
            "error": message or type(error).__name__,
            "created_at": utcnow(),
        }
        with write_transaction(self.engine) as conn:
            new_id = conn.execute(
                insert(_letters).values(values).returning(_letters.c.id)
            ).scalar_one()
        return DeadLetter(id=int(new_id), **values)  # type: ignore[arg-type]

    def list(self, *, after_id: int = 0, limit: int = 100) -> list[DeadLetter]:
        query = (
            select(_letters).where(_letters.c.id > after_id).order_by(_letters.c.id).limit(limit)
        )
        with read_connection(self.engine) as conn:
            return [DeadLetter(**row._mapping) for row in conn.execute(query)]

    def count(self) -> int:
        with read_connection(self.engine) as conn:
            return int(conn.execute(select(func.count()).select_from(_letters)).scalar_one())

    def get(self, letter_id: int) -> DeadLetter:
        with read_connection(self.engine) as conn:
            row = conn.execute(select(_letters).where(_letters.c.id == letter_id)).first()
        if row is None:
            raise DeadLetterNotFound(f"no dead letter with id {letter_id}")
        return DeadLetter(**row._mapping)

    def discard(self, letter_id: int) -> None:
        with write_transaction(self.engine) as conn:
            gone = conn.execute(delete(_letters).where(_letters.c.id == letter_id)).rowcount
        if not gone:
            raise DeadLetterNotFound(f"no dead letter with id {letter_id}")

    def replay(
        self,
        letter_id: int,
        append: Callable[..., AppendResult],
        *,
        events: Any = None,
    ) -> AppendResult:
        """Append the letter (or a fixed ``events``) under its original idempotency key.

        The key makes a replay land once, however often it is run; the letter is removed
        only after the write has committed.
        """
        letter = self.get(letter_id)
        result = append(
            letter.session_id,
            letter.events if events is None else events,
            expected_seq=letter.expected_seq,
            idempotency_key=letter.idempotency_key,
        )
        with write_transaction(self.engine) as conn:
            conn.execute(delete(_letters).where(_letters.c.id == letter_id))
        return result
