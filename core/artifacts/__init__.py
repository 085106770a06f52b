"""Session artifacts: tool-output logs, agent outputs, path-addressed files with quotas,
oversized outputs with a TTL, the OutputSink, and artifact:// / agent:// resolution."""

from core.artifacts.manager import ArtifactManager, agent_counter, stats_by_kind
from core.artifacts.oversized import OversizedOutputs
from core.artifacts.paths import sanitize_path, sanitize_tool_type, session_dir
from core.artifacts.records import (
    AgentOutputSlot,
    AllocatedPath,
    ArtifactInfo,
    ArtifactRef,
    ArtifactStats,
    ExpireReport,
    FileWriteResult,
    OversizedHint,
    OversizedStored,
    QuotaUsage,
    ResolvedResource,
)
from core.artifacts.resolve import resolve
from core.artifacts.rows import counter_values, set_counter_floor
from core.artifacts.sink import OutputSink, SinkSummary

__all__ = [
    "AgentOutputSlot",
    "AllocatedPath",
    "ArtifactInfo",
    "ArtifactManager",
    "ArtifactRef",
    "ArtifactStats",
    "ExpireReport",
    "FileWriteResult",
    "OutputSink",
    "OversizedHint",
    "OversizedOutputs",
    "OversizedStored",
    "QuotaUsage",
    "ResolvedResource",
    "SinkSummary",
    "agent_counter",
    "counter_values",
    "resolve",
    "sanitize_path",
    "sanitize_tool_type",
    "session_dir",
    "set_counter_floor",
    "stats_by_kind",
]
