"""ArtifactManager: the artifacts of one session.

Ids come from the ``counters`` table inside a write transaction, so they are distinct
across threads and processes, never reused, and continue where a previous manager (or a
previous process) stopped. The metadata row is the authority for what exists; files are
written atomically next to it.
"""

from __future__ import annotations

import errno
import logging
import os
import re
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from pathlib import Path

from sqlalchemy import Connection, Engine

from core import nofollow
from core.artifacts import integrity, rows
from core.artifacts.files import SessionFiles
from core.artifacts.inherited import preserve_for_forks
from core.artifacts.oversized import OversizedOutputs
from core.artifacts.paths import (
    agent_output_names,
    encode_component,
    sanitize_agent_name,
    sanitize_tool_type,
    tool_log_name,
)
from core.artifacts.records import (
    AGENT_OUTPUT,
    COMPLETE,
    FILE,
    OVERSIZED,
    TOOL_OUTPUT,
    WRITING,
    AgentOutputSlot,
    AllocatedPath,
    ArtifactInfo,
    ArtifactStats,
    OversizedStored,
)
from core.artifacts.scope import SessionScope
from core.artifacts.sink import OutputSink
from core.artifacts.staging import Staged, staged_in
from core.artifacts.storage import key_of
from core.db import read_connection, write_transaction
from core.errors import ArtifactError, ArtifactNotFound, StorageUnavailable, SymlinkRefused
from core.models import utcnow
from core.settings import Settings
from core.translate import storage_errors

logger = logging.getLogger(__name__)

TOOL_COUNTER = "artifact"
AGENT_COUNTER = "agent"
# <id>.jsonl must stay under the 255-byte file-name limit, with room to spare.
MAX_AGENT_ID_CHARS = 200
_AGENT_ID = re.compile(r"^\d+-[A-Za-z0-9_-]+(\.\d+-[A-Za-z0-9_-]+)*$")
# Ids another agent chose (an import keeps them): safe as a file name, dots only as separators.
_FOREIGN_AGENT_ID = re.compile(r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$")
_NUMBERED = re.compile(r"^(\d+)-")
_COUNTER_MAX = 2**63 - 1  # counters are BIGINT


def agent_counter(parent_id: str | None) -> str:
    """Top-level outputs share one counter; each parent numbers its own children."""
    return AGENT_COUNTER if parent_id is None else f"{AGENT_COUNTER}:{parent_id}"


def stats_by_kind(engine: Engine, *, tenant_id: str | None = None) -> dict[str, ArtifactStats]:
    """Count and bytes of artifacts per kind (all tenants unless one is named)."""
    with read_connection(engine) as conn:
        return {
            kind: rows.stats(conn, kind, tenant_id=tenant_id)
            for kind in (TOOL_OUTPUT, AGENT_OUTPUT, FILE, OVERSIZED)
        }


def _encode(content: str | bytes) -> bytes:
    return content.encode("utf-8", "surrogatepass") if isinstance(content, str) else content


class ArtifactManager:
    """Tool-output logs, agent outputs, path-addressed files and oversized outputs."""

    def __init__(self, engine: Engine, settings: Settings, session_id: str) -> None:
        self._scope = SessionScope.create(engine, settings, session_id)
        self.files = SessionFiles(self._scope)
        self._oversized = OversizedOutputs(engine, settings)

    @property
    def session_id(self) -> str:
        return self._scope.session_id

    def directory(self) -> Path:
        """The session's artifact directory (created lazily by the first write)."""
        return self._scope.directory()

    # tool-output logs --------------------------------------------------------------------

    def allocate_path(self, tool_type: str) -> AllocatedPath:
        """Reserve the next tool-output id; the caller writes ``path``, then ``finalize``s."""
        return self._allocate_tool(tool_type)

    def save(self, content: str | bytes, tool_type: str) -> str:
        """Store a whole tool output; returns its id (``artifact://<id>``)."""
        data = _encode(content)
        tool = sanitize_tool_type(tool_type)
        with (
            self._staged(self.directory(), data) as staged,
            self._locked() as (conn, info, directory),
        ):
            values = self._tool_values(tool, len(data), COMPLETE, integrity.digest(data))
            artifact_id = self._allocate_in(conn, info, TOOL_COUNTER, str, values)
            staged.publish(directory, directory / tool_log_name(artifact_id, tool))
        return artifact_id

    def _allocate_tool(self, tool_type: str) -> AllocatedPath:
        tool = sanitize_tool_type(tool_type)
        # ``writing`` until finalized: a writer killed mid-write leaves a row that says so
        # (readers refuse its bytes as the whole output; expiry settles it, core.artifacts.stale)
        values = self._tool_values(tool, 0, WRITING)
        artifact_id, directory = self._allocate(TOOL_COUNTER, str, values)
        if self._scope.objects is not None:
            # Object storage: the caller streams into a spool file in the local cache;
            # ``finalize_tool_output`` uploads it whole (a crash publishes nothing).
            spool = self._spool_path(tool_log_name(artifact_id, tool))
            spool.parent.mkdir(parents=True, exist_ok=True)
            return AllocatedPath(artifact_id, spool)
        try:
            with storage_errors("artifacts"):
                nofollow.makedirs(self._scope.root, directory)
        except (OSError, SymlinkRefused, StorageUnavailable):
            # The caller never learns the id, so no one else could remove the row: a failed
            # allocation must not leave a row that points at no file.
            self.discard_tool_output(artifact_id)
            raise
        return AllocatedPath(artifact_id, directory / tool_log_name(artifact_id, tool))

    @staticmethod
    def _tool_values(
        tool: str, size: int, state: str, sha256: str | None = None
    ) -> Callable[[str], dict[str, object]]:
        return lambda local_id: {
            "kind": TOOL_OUTPUT,
            "name": tool_log_name(local_id, tool),
            "tool_type": tool,
            "media_type": "text/plain",
            "size_bytes": size,
            "sha256": sha256,
            "state": state,
        }

    def finalize_tool_output(self, artifact_id: str) -> int:
        """The tool-output file the caller wrote is whole: its size and ``complete``, in one
        transaction (on object storage after its upload); returns the size."""
        info = self._require(TOOL_OUTPUT, artifact_id)
        target = self.directory() / (info.name or "")
        objects = self._scope.objects
        # Its size and SHA-256 from one pass over the bytes as they are now; on object
        # storage that pass is the upload, measuring what it sends: the tool may still be
        # writing, and a second read would upload bytes the first did not measure
        if objects is None:
            root, path = self._scope.root, target
        else:
            root, path = self._scope.settings.artifact_spool_dir, self._spool_path(info.name)
        with storage_errors("artifacts"):  # a missing file stays FileNotFoundError
            fd = nofollow.open_file(root, path)  # a planted link is refused
            if fd is None:
                raise FileNotFoundError(errno.ENOENT, "no such tool output", str(path))
            with os.fdopen(fd, "rb") as source:
                if objects is None:
                    size, sha256 = integrity.measure(source)
                else:
                    size, sha256 = objects.put_file(key_of(self._scope.root, target), source)
            if objects is not None:
                nofollow.unlink(root, path)
        with write_transaction(self._scope.engine) as conn:
            rows.finish_tool_output(conn, self.session_id, artifact_id, size, sha256)
        return size

    def _spool_path(self, name: str | None) -> Path:
        """Where a streamed tool output waits for its upload (object storage only). Named
        by the session, not its tenant: a session moved between the allocation and the
        upload finds its bytes where they were written (the upload goes to its new
        directory)."""
        spool = self._scope.settings.artifact_spool_dir
        return spool / encode_component(self.session_id) / (name or "")

    def discard_tool_output(self, artifact_id: str) -> None:
        """Remove a tool output whose content could not be written (its id stays used)."""
        with write_transaction(self._scope.engine) as conn:
            info = rows.session_info(conn, self.session_id)
            row = rows.get_artifact(conn, self.session_id, TOOL_OUTPUT, artifact_id)
            rows.delete_artifact(conn, self.session_id, TOOL_OUTPUT, artifact_id)
        if row is not None and row.name:
            target = self._scope.dir_for(info.tenant_id) / row.name
            if self._scope.objects is not None:
                self._spool_path(row.name).unlink(missing_ok=True)
                self._scope.objects.delete(key_of(self._scope.root, target))
                return
            try:
                with storage_errors("artifacts"):
                    nofollow.unlink(self._scope.root, target)
            except SymlinkRefused as exc:
                logger.warning("discard refused a symlink", extra={"path": exc.path})

    def output_sink(
        self, tool_type: str, *, head_bytes: int = 0, max_columns: int = 0
    ) -> OutputSink:
        """A bounded sink for streaming tool output that spills into this session."""
        return OutputSink(
            target=self,
            tool_type=tool_type,
            spill_bytes=self._scope.settings.output_spill_bytes,
            head_bytes=head_bytes,
            max_columns=max_columns,
        )

    # agent outputs -------------------------------------------------------------------------

    def allocate_agent_output(self, name: str, *, parent_id: str | None = None) -> AgentOutputSlot:
        """Reserve ``<n>-<name>`` (or ``<parent>.<n>-<name>``) for an agent's output."""
        agent = sanitize_agent_name(name)
        prefix = "" if parent_id is None else f"{parent_id}."
        output_id, directory = self._allocate(
            agent_counter(parent_id),
            lambda n: f"{prefix}{n}-{agent}",
            lambda local_id: {
                "kind": AGENT_OUTPUT,
                "name": agent_output_names(local_id)[0],
                "tool_type": agent,
                "media_type": "text/markdown",
            },
            parent_id=parent_id,
        )
        md_name, jsonl_name = agent_output_names(output_id)
        return AgentOutputSlot(output_id, directory / md_name, directory / jsonl_name)

    def write_agent_output(
        self, output_id: str, content: str | bytes, *, jsonl: str | bytes | None = None
    ) -> int:
        """Write (or rewrite) an allocated agent output; returns its size in bytes."""
        self._require(AGENT_OUTPUT, output_id)
        md_name, jsonl_name = agent_output_names(output_id)
        body = _encode(content)
        sidecar = _encode(jsonl) if jsonl is not None else None
        staging = self.directory()
        with (
            self._staged(staging, body) as staged_md,
            self._staged(staging, sidecar)
            if sidecar is not None
            else nullcontext() as staged_jsonl,
            self._locked() as (conn, _info, directory),
        ):
            old = rows.get_artifact(conn, self.session_id, AGENT_OUTPUT, output_id)
            if old is None:
                raise ArtifactNotFound(f"{AGENT_OUTPUT} not found: {output_id}")
            self._preserve_for_forks(conn, old, directory, [jsonl_name, md_name])
            if staged_jsonl is not None:  # the sidecar first: the markdown marks it complete
                staged_jsonl.publish(directory, directory / jsonl_name)
            staged_md.publish(directory, directory / md_name)
            size = len(body) + (len(sidecar) if sidecar is not None else 0)
            rows.set_size(
                conn,
                self.session_id,
                AGENT_OUTPUT,
                output_id,
                size,
                sha256=integrity.digest(body),  # of the markdown: what a reader is served
                sidecar_sha256=(
                    integrity.digest(sidecar) if sidecar is not None else integrity.NO_SIDECAR
                ),
            )
        return size

    def save_agent_output(
        self,
        name: str,
        content: str | bytes,
        *,
        parent_id: str | None = None,
        jsonl: str | bytes | None = None,
    ) -> str:
        """Allocate and write an agent output in one call; returns its id (``agent://<id>``)."""
        slot = self.allocate_agent_output(name, parent_id=parent_id)
        self.write_agent_output(slot.id, content, jsonl=jsonl)
        return slot.id

    # outputs under ids chosen elsewhere (an import keeps the source's ids) ---------------

    def put_tool_output(self, artifact_id: str, tool_type: str, content: str | bytes) -> None:
        """Store (or replace) tool output ``artifact://<artifact_id>`` under that very id; the
        counter then continues after it, so later allocations never reuse it."""
        if not artifact_id.isdecimal() or not artifact_id.isascii():
            raise ArtifactError(f"a tool-output id is a decimal number, got {artifact_id[:60]!r}")
        tool = sanitize_tool_type(tool_type)
        data = _encode(content)
        values = {
            **self._tool_values(tool, len(data), COMPLETE, integrity.digest(data))(artifact_id),
            "local_id": artifact_id,
        }
        self._put(values, {tool_log_name(artifact_id, tool): data})
        self._raise_counter(TOOL_COUNTER, int(artifact_id) + 1)

    def put_agent_output(
        self, output_id: str, content: str | bytes, *, jsonl: str | bytes | None = None
    ) -> None:
        """Store (or replace) agent output ``agent://<output_id>`` under that very id."""
        if len(output_id) > MAX_AGENT_ID_CHARS or not _FOREIGN_AGENT_ID.match(output_id):
            raise ArtifactError(f"not a usable agent-output id: {output_id[:60]!r}")
        md_name, jsonl_name = agent_output_names(output_id)
        files = {md_name: _encode(content)}
        if jsonl is not None:
            files[jsonl_name] = _encode(jsonl)
        values = {
            "kind": AGENT_OUTPUT,
            "local_id": output_id,
            "name": md_name,
            "tool_type": sanitize_agent_name(output_id.rsplit(".", 1)[-1]),
            "media_type": "text/markdown",
            "size_bytes": sum(len(d) for d in files.values()),
            "sha256": integrity.digest(files[md_name]),
            "sidecar_sha256": (
                integrity.digest(files[jsonl_name]) if jsonl is not None else integrity.NO_SIDECAR
            ),
        }
        self._put(values, files)
        parent, _, own = output_id.rpartition(".")
        numbered = _NUMBERED.match(own)
        if numbered:
            self._raise_counter(agent_counter(parent or None), int(numbered.group(1)) + 1)

    def _put(self, values: dict[str, object], files: dict[str, bytes]) -> None:
        staging = self.directory()
        with ExitStack() as stack:
            staged = {
                name: stack.enter_context(self._staged(staging, d)) for name, d in files.items()
            }
            conn, info, directory = stack.enter_context(self._locked())
            # the markdown of an agent output is published last: it marks the output complete
            names = sorted(staged, key=lambda n: n.endswith(".md"))
            kind, local_id = str(values["kind"]), str(values["local_id"])
            old = rows.get_artifact(conn, self.session_id, kind, local_id)
            if old is not None:
                self._preserve_for_forks(conn, old, directory, names)
            for name in names:
                staged[name].publish(directory, directory / name)
            rows.upsert_artifact(
                conn,
                {
                    "session_id": self.session_id,
                    "created_at": utcnow(),
                    "created_seq": info.head_seq,
                    **values,
                },
            )

    def _preserve_for_forks(
        self, conn: Connection, old: ArtifactInfo, directory: Path, names: list[str]
    ) -> None:
        """Copy-on-write before a rewrite: forks whose copy is unfinished keep the content
        they inherited (every file of the artifact, the marker file last)."""
        for name in names:
            preserve_for_forks(
                conn,
                self._scope.root,
                self.session_id,
                old,
                directory / name,
                name=name,
                storage=self._scope.objects,
            )

    def _staged(self, session_root: Path, data: bytes) -> AbstractContextManager[Staged]:
        return staged_in(self._scope.storage(), self._scope.root, session_root, data)

    def _raise_counter(self, counter: str, next_value: int) -> None:
        if next_value > _COUNTER_MAX:
            # An id kept from elsewhere beyond the counter's range (oh-my-pi's file names
            # are free text): allocations never get near it, so nothing needs raising.
            return
        with write_transaction(self._scope.engine) as conn:
            rows.set_counter_floor(conn, self.session_id, counter, next_value)

    # oversized outputs ---------------------------------------------------------------------

    def store_oversized(
        self, content: str, tool_name: str, ttl_s: int | None = None
    ) -> OversizedStored | None:
        return self._oversized.store(self.session_id, content, tool_name, ttl_s)

    def retrieve(self, artifact_id: str) -> str | None:
        return self._oversized.retrieve(artifact_id, session_id=self.session_id)

    def cleanup_oversized(self) -> int:
        return self._oversized.cleanup_session(self.session_id)

    # listing -------------------------------------------------------------------------------

    def list(self, kind: str | None = None) -> list[ArtifactInfo]:
        with read_connection(self._scope.engine) as conn:
            return rows.list_artifacts(conn, self.session_id, kind)

    # internals -----------------------------------------------------------------------------

    def _allocate(
        self,
        counter: str,
        make_id: Callable[[int], str],
        make_values: Callable[[str], dict[str, object]],
        *,
        parent_id: str | None = None,
    ) -> tuple[str, Path]:
        """Allocate an id and insert its row in one write transaction."""
        with write_transaction(self._scope.engine) as conn:
            info = rows.lock_for_write(conn, self.session_id)
            local_id = self._allocate_in(
                conn, info, counter, make_id, make_values, parent_id=parent_id
            )
        return local_id, self._scope.dir_for(info.tenant_id)

    def _allocate_in(
        self,
        conn: Connection,
        info: rows.SessionQuotaRow,
        counter: str,
        make_id: Callable[[int], str],
        make_values: Callable[[str], dict[str, object]],
        *,
        parent_id: str | None = None,
    ) -> str:
        if parent_id is not None and not _AGENT_ID.match(parent_id):
            raise ArtifactNotFound(f"agent output not found: {parent_id}")
        if parent_id is not None and not rows.get_artifact(
            conn, self.session_id, AGENT_OUTPUT, parent_id
        ):
            raise ArtifactNotFound(f"agent output not found: {parent_id}")
        local_id = make_id(rows.next_id(conn, self.session_id, counter))
        if len(local_id) > MAX_AGENT_ID_CHARS:
            raise ArtifactError(f"artifact id too long (nesting too deep): {local_id[:60]}…")
        rows.insert_artifact(
            conn,
            {
                "session_id": self.session_id,
                "local_id": local_id,
                "size_bytes": 0,
                "created_at": utcnow(),
                "created_seq": info.head_seq,
                **make_values(local_id),
            },
        )
        logger.debug(
            "artifact id allocated",
            extra={"session_id": self.session_id, "counter": counter, "local_id": local_id},
        )
        return local_id

    @contextmanager
    def _locked(self) -> Iterator[tuple[Connection, rows.SessionQuotaRow, Path]]:
        """A write transaction holding the session's tenant lock, which a move also takes,
        with the session's directory as of now: files published inside cannot miss a move
        (``SessionMoving`` while one is pending)."""
        with write_transaction(self._scope.engine) as conn:
            info = rows.lock_for_write(conn, self.session_id)
            yield conn, info, self._scope.dir_for(info.tenant_id)

    def _require(self, kind: str, local_id: str) -> ArtifactInfo:
        with read_connection(self._scope.engine) as conn:
            info = rows.get_artifact(conn, self.session_id, kind, local_id)
        if info is None:
            raise ArtifactNotFound(f"{kind} not found: {local_id}")
        return info
