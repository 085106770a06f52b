"""Dead letters: queued writes that were rejected, kept verbatim for inspection and replay."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Engine, delete, func, insert, select

from core.db import read_connection, write_transaction
from core.errors import DeadLetterNotFound, SessionStoreError
from core.journal.validation import check_limit, check_seq
from core.models import DeadLetterRow, table_of, utcnow
from core.records import AppendResult
from core.translate import translated

_letters = table_of(DeadLetterRow)


class Keep:
    """The default of ``replay(expected_seq=...)``: keep the letter's own."""


KEEP = Keep()


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
    raw_body: bytes | None = None
    content_type: str | None = None
    content_encoding: str | None = None

    @property
    def events(self) -> Any:
        """The original events. Parsed leniently: NaN and friends come back as they were.
        None for a message that could not be decoded (see ``raw_body``)."""
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
        if self.raw_body is not None:
            out["content_type"] = self.content_type
            out["content_encoding"] = self.content_encoding
            out["raw_bytes"] = len(self.raw_body)
        if with_payload:
            out["events"] = self.events
            if self.raw_body is not None:
                out["raw_body_base64"] = base64.b64encode(self.raw_body).decode()
        return out


def _encode(events: Any) -> str:
    # stdlib json, not orjson: it keeps NaN/Infinity as written and never refuses a value,
    # so whatever the producer sent can be stored and shown (non-JSON values as repr).
    # ASCII only: lone surrogates and NUL stay as \u escapes, which every backend stores.
    try:
        return json.dumps(events, default=repr, ensure_ascii=True)
    except (RecursionError, ValueError) as exc:  # too deep, or circular
        return json.dumps({"unencodable": f"{type(exc).__name__}: {exc}"[:300]})


def storable(text: Any, limit: int | None = None) -> str:
    """``text`` as a string every backend stores: NUL and lone surrogates escaped."""
    value = text if isinstance(text, str) else repr(text)
    value = value.replace("\x00", "\\x00").encode("utf-8", "backslashreplace").decode()
    return value[:limit] if limit else value


_INT64 = range(-(2**63), 2**63)


class DeadLetters:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @translated
    def record(
        self,
        *,
        idempotency_key: str,
        session_id: str,
        events: Any,
        expected_seq: int | None,
        error: BaseException,
    ) -> DeadLetter:
        """Keep a rejected write. Never refuses a value: ids and messages are escaped,
        an ``expected_seq`` no column can hold is noted in the error instead."""
        message = error.message if isinstance(error, SessionStoreError) else str(error)
        message = message or type(error).__name__
        if expected_seq is not None and (
            type(expected_seq) is not int or expected_seq not in _INT64
        ):
            message += f" (expected_seq was {storable(expected_seq, 100)})"
            expected_seq = None
        return self._insert(
            idempotency_key=storable(idempotency_key, 200),
            session_id=storable(session_id, 36),
            expected_seq=expected_seq,
            payload=_encode(events),
            error_type=type(error).__name__[:64],
            error=storable(message),
        )

    @translated
    def record_raw(
        self,
        *,
        body: bytes,
        content_type: str | None,
        content_encoding: str | None,
        reason: str,
        message_id: str = "",
        session_id: str = "",
    ) -> DeadLetter:
        """Keep a message that never reached the task (undecodable, wrong arity), verbatim."""
        return self._insert(
            idempotency_key=storable(message_id or "-", 200),
            session_id=storable(session_id or "-", 36),
            expected_seq=None,
            payload="null",
            error_type="UndeliverableMessage",
            error=storable(reason),
            raw_body=bytes(body),
            content_type=storable(content_type or "", 128) or None,
            content_encoding=storable(content_encoding or "", 64) or None,
        )

    def _insert(self, **values: Any) -> DeadLetter:
        values["created_at"] = utcnow()
        with write_transaction(self.engine) as conn:
            if same := self._same_letter(conn, values):
                return same
            new_id = conn.execute(
                insert(_letters).values(values).returning(_letters.c.id)
            ).scalar_one()
        return DeadLetter(id=int(new_id), **values)

    def _same_letter(self, conn: Connection, values: dict[str, Any]) -> DeadLetter | None:
        """The letter already kept for this write and this reason: a message dead-lettered
        and then redelivered (its worker lost before the ack) is kept once, not per
        delivery. Another reason, or other events, is another letter. A message kept raw
        (it never reached the task) is the same letter only with the same bytes, content
        type and encoding, and reason."""
        names = ["idempotency_key", "session_id", "error_type", "payload"]
        if "raw_body" in values:
            names += ["error", "raw_body"]
        match = [getattr(_letters.c, name) == values[name] for name in names]
        match.append(_letters.c.expected_seq.is_not_distinct_from(values["expected_seq"]))
        for name in ("content_type", "content_encoding"):
            if name in values:
                match.append(getattr(_letters.c, name).is_not_distinct_from(values[name]))
        row = conn.execute(select(_letters).where(*match).order_by(_letters.c.id).limit(1)).first()
        return DeadLetter(**row._mapping) if row is not None else None

    @translated
    def list(self, *, after_id: int = 0, limit: int = 100) -> list[DeadLetter]:
        check_seq(after_id, "after_id")
        check_limit(limit)
        query = (
            select(_letters).where(_letters.c.id > after_id).order_by(_letters.c.id).limit(limit)
        )
        with read_connection(self.engine) as conn:
            return [DeadLetter(**row._mapping) for row in conn.execute(query)]

    def count(self) -> int:
        with read_connection(self.engine) as conn:
            return int(conn.execute(select(func.count()).select_from(_letters)).scalar_one())

    def iter_all(self, *, batch: int = 500) -> Iterator[DeadLetter]:
        """Every letter, oldest first, read in pages."""
        after = 0
        while page := self.list(after_id=after, limit=batch):
            yield from page
            after = page[-1].id

    @translated
    def get(self, letter_id: int) -> DeadLetter:
        check_seq(letter_id, "letter_id")
        with read_connection(self.engine) as conn:
            row = conn.execute(select(_letters).where(_letters.c.id == letter_id)).first()
        if row is None:
            raise DeadLetterNotFound(f"no dead letter with id {letter_id}")
        return DeadLetter(**row._mapping)

    @translated
    def discard(self, letter_id: int) -> None:
        check_seq(letter_id, "letter_id")
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
        expected_seq: int | Keep | None = KEEP,
        idempotency_key: str | None = None,
    ) -> AppendResult:
        """Append the letter (or a fixed ``events``) under its original idempotency key.

        The key makes a replay land once, however often it is run; the letter is removed
        only after the write has committed. ``expected_seq`` overrides the letter's (an int)
        or drops it (None), for a write rejected on a conflict. ``idempotency_key``
        replaces the letter's, for a write refused because its key had committed other
        content (``IdempotencyKeyReused``).
        """
        letter = self.get(letter_id)
        result = append(
            letter.session_id,
            letter.events if events is None else events,
            expected_seq=letter.expected_seq if isinstance(expected_seq, Keep) else expected_seq,
            idempotency_key=letter.idempotency_key if idempotency_key is None else idempotency_key,
        )
        with write_transaction(self.engine) as conn:
            conn.execute(delete(_letters).where(_letters.c.id == letter_id))
        return result
