"""The neutral records that cross the storage boundary."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

BlobEncoding = Literal["base64", "utf8"]

# A fork's artifact copy status (``sessions.copy_status``); None for a session that is no fork.
COPY_PENDING = "pending"
COPY_DONE = "copied"
COPY_FAILED = "failed"


@dataclass(frozen=True, slots=True)
class StoredEvent:
    session_id: str
    seq: int
    position: int
    type: str
    payload: dict[str, Any]
    recorded_at: datetime


@dataclass(frozen=True, slots=True)
class ManifestEntry:
    """One externalized value: where it sits in the payload (JSON pointer) and which blob."""

    pointer: str
    hash: str
    size: int
    encoding: BlobEncoding


@dataclass(frozen=True, slots=True)
class PreparedEvent:
    """An event that passed validation and externalization, ready for the journal."""

    type: str
    payload: dict[str, Any]
    refs: tuple[ManifestEntry, ...] = ()
    # the payload as compact JSON, when validation already produced it
    encoded: bytes | None = None


@dataclass(frozen=True, slots=True)
class AppendResult:
    session_id: str
    first_seq: int
    last_seq: int
    positions: list[int]
    replayed: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "session_id": self.session_id,
            "first_seq": self.first_seq,
            "last_seq": self.last_seq,
            "positions": list(self.positions),
            "replayed": self.replayed,
        }


@dataclass(frozen=True, slots=True)
class Session:
    id: str
    tenant_id: str
    head_seq: int
    created_at: datetime
    updated_at: datetime
    parent_id: str | None = None
    forked_from_seq: int | None = None
    title: str | None = None
    cwd: str | None = None
    copy_status: str | None = None
    copy_error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "tenant_id": self.tenant_id,
            "head_seq": self.head_seq,
            "parent_id": self.parent_id,
            "forked_from_seq": self.forked_from_seq,
            "title": self.title,
            "cwd": self.cwd,
            "copy_status": self.copy_status,
            "copy_error": self.copy_error,
            "created_at": self.created_at.isoformat(),
            "updated_at": self.updated_at.isoformat(),
        }


@dataclass(frozen=True, slots=True)
class Page:
    """One page of a cursor-paginated listing; pass ``next_cursor`` back for the next."""

    items: list[Any] = field(default_factory=list)
    next_cursor: str | None = None
