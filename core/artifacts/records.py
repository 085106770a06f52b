"""The records artifact operations hand back."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Literal, NamedTuple

ArtifactKind = Literal["tool_output", "agent_output", "file", "oversized"]
TOOL_OUTPUT: ArtifactKind = "tool_output"
AGENT_OUTPUT: ArtifactKind = "agent_output"
FILE: ArtifactKind = "file"
OVERSIZED: ArtifactKind = "oversized"


@dataclass(frozen=True, slots=True)
class ArtifactInfo:
    """One row of the ``artifacts`` table."""

    session_id: str
    kind: str
    local_id: str
    name: str | None
    tool_type: str | None
    size_bytes: int
    media_type: str | None
    created_at: datetime
    created_seq: int
    expires_at: datetime | None = None
    summary: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "session_id": self.session_id,
            "kind": self.kind,
            "local_id": self.local_id,
            "name": self.name,
            "tool_type": self.tool_type,
            "size_bytes": self.size_bytes,
            "media_type": self.media_type,
            "created_at": self.created_at.isoformat(),
            "created_seq": self.created_seq,
            "expires_at": self.expires_at.isoformat() if self.expires_at else None,
            "summary": self.summary,
        }


@dataclass(frozen=True, slots=True)
class AllocatedPath:
    """A tool-output id and the file the caller writes it to."""

    id: str
    path: Path


@dataclass(frozen=True, slots=True)
class AgentOutputSlot:
    """An agent-output id with its markdown file and optional JSONL sidecar."""

    id: str
    md_path: Path
    jsonl_path: Path


@dataclass(frozen=True, slots=True)
class FileWriteResult:
    """The outcome of a path-addressed write or delete, with usage after it."""

    path: str
    size_bytes: int
    replaced_bytes: int
    session_used_bytes: int
    tenant_used_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "size_bytes": self.size_bytes,
            "replaced_bytes": self.replaced_bytes,
            "session_used_bytes": self.session_used_bytes,
            "tenant_used_bytes": self.tenant_used_bytes,
        }


@dataclass(frozen=True, slots=True)
class Usage:
    session_used_bytes: int
    tenant_used_bytes: int


@dataclass(frozen=True, slots=True)
class ArtifactRef:
    """An oversized tool output stored as a TTL artifact."""

    artifact_id: str
    session_id: str
    tool_name: str
    size_bytes: int
    summary: str
    created_at: datetime
    ttl_s: int
    expires_at: datetime

    def to_dict(self) -> dict[str, Any]:
        return {
            "artifact_id": self.artifact_id,
            "session_id": self.session_id,
            "tool_name": self.tool_name,
            "size_bytes": self.size_bytes,
            "summary": self.summary,
            "created_at": self.created_at.isoformat(),
            "ttl_s": self.ttl_s,
            "expires_at": self.expires_at.isoformat(),
        }


@dataclass(frozen=True, slots=True)
class OversizedHint:
    """What the model sees in place of an oversized output."""

    artifact_reference: str
    summary: str
    hint: str
    size_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "artifact_reference": self.artifact_reference,
            "summary": self.summary,
            "hint": self.hint,
            "size_bytes": self.size_bytes,
        }


class OversizedStored(NamedTuple):
    ref: ArtifactRef
    hint: OversizedHint


@dataclass(frozen=True, slots=True)
class ArtifactStats:
    count: int
    total_bytes: int


@dataclass(frozen=True, slots=True)
class ExpireReport:
    """Oversized outputs past their TTL; ``deleted`` is 0 on a dry run."""

    expired: list[tuple[str, str]] = field(default_factory=list)
    deleted: int = 0
    applied: bool = False


@dataclass(frozen=True, slots=True)
class ResolvedResource:
    """The content a URL names."""

    url: str
    content: str
    content_type: str
    size: int
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "content": self.content,
            "content_type": self.content_type,
            "size": self.size,
            "notes": list(self.notes),
        }
