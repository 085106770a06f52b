"""The neutral records that cross the storage boundary."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import PurePath
from typing import Any, Literal, TypeVar

BlobEncoding = Literal["base64", "utf8"]
_R = TypeVar("_R")


def to_plain(record: Any) -> dict[str, Any]:
    """A dataclass record's fields as JSON-ready values: datetimes in ISO 8601, paths as
    text, sequences as lists; everything else as it is."""
    return {f.name: _plain(getattr(record, f.name)) for f in dataclasses.fields(record)}


def _plain(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, PurePath):
        return str(value)
    if isinstance(value, tuple):
        return list(value)
    return value


class PlainRecord:
    """Mixin for dataclass records: ``to_dict`` gives the fields as JSON-ready values."""

    __slots__ = ()

    def to_dict(self) -> dict[str, Any]:
        return to_plain(self)


def from_row(cls: type[_R], row: Any) -> _R:
    """A dataclass record from a database row with (at least) its fields' names."""
    names = [f.name for f in dataclasses.fields(cls) if f.init]  # type: ignore[arg-type]
    return cls(**{name: getattr(row, name) for name in names})


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
class Session(PlainRecord):
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


@dataclass(frozen=True, slots=True)
class Page:
    """One page of a cursor-paginated listing; pass ``next_cursor`` back for the next."""

    items: list[Any] = field(default_factory=list)
    next_cursor: str | None = None
