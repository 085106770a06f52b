"""The records artifact operations hand back."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Literal, NamedTuple

from core.records import PlainRecord

ArtifactKind = Literal["tool_output", "agent_output", "file", "oversized"]
TOOL_OUTPUT: ArtifactKind = "tool_output"
AGENT_OUTPUT: ArtifactKind = "agent_output"
FILE: ArtifactKind = "file"
OVERSIZED: ArtifactKind = "oversized"

ArtifactState = Literal["complete", "writing", "truncated"]
COMPLETE: ArtifactState = "complete"
# A streamed tool output whose writer has not finalized it: its bytes may be partial.
WRITING: ArtifactState = "writing"
# What a writer that never finalized left, recorded by expiry: not the whole output.
TRUNCATED: ArtifactState = "truncated"


@dataclass(frozen=True, slots=True)
class ArtifactInfo(PlainRecord):
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
    state: str = COMPLETE
    sha256: str | None = None
    sidecar_sha256: str | None = None

    @property
    def complete(self) -> bool:
        return self.state == COMPLETE


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
class FileWriteResult(PlainRecord):
    """The outcome of a path-addressed write or delete, with usage after it."""

    path: str
    size_bytes: int
    replaced_bytes: int
    session_used_bytes: int
    tenant_used_bytes: int


@dataclass(frozen=True, slots=True)
class QuotaUsage:
    session_used_bytes: int
    tenant_used_bytes: int


@dataclass(frozen=True, slots=True)
class ArtifactRef(PlainRecord):
    """An oversized tool output stored as a TTL artifact."""

    artifact_id: str
    session_id: str
    tool_name: str
    size_bytes: int
    summary: str
    created_at: datetime
    ttl_s: int
    expires_at: datetime


@dataclass(frozen=True, slots=True)
class OversizedHint(PlainRecord):
    """What the model sees in place of an oversized output."""

    artifact_reference: str
    summary: str
    hint: str
    size_bytes: int


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
    # (session id, artifact id, error) of those whose file could not be removed: their rows
    # stay, for the next run
    failed: list[tuple[str, str, str]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ResolvedResource:
    """The content a URL names."""

    url: str
    content: str
    content_type: str
    size: int
    notes: list[str] = field(default_factory=list)
    # False only for a tool output read with ``partial``: not the whole output (the notes say why)
    complete: bool = True

    def to_dict(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "content": self.content,
            "content_type": self.content_type,
            "size": self.size,
            "notes": list(self.notes),
            "complete": self.complete,
        }
