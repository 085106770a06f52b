"""URL resolution: ``artifact://<id>``, ``agent://<id>[/<path>|?q=<query>]``, ``art_<16 hex>``
and ``blob:sha256:<64 hex>``, always within one session and its tenant.

The session is checked first: a session of another tenant (or none at all) is "not found",
with the same message either way, and every id is then looked up in that session's rows
only, so another tenant's content is never read (DESIGN invariant 9).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import pybase64
from sqlalchemy import Engine

from core.artifacts import rows
from core.artifacts.inherited import copy_unfinished, read_artifact_file
from core.artifacts.jsonquery import apply_query, path_to_query
from core.artifacts.oversized import OVERSIZED_ID
from core.artifacts.paths import session_dir
from core.artifacts.records import (
    AGENT_OUTPUT,
    OVERSIZED,
    TOOL_OUTPUT,
    WRITING,
    ArtifactInfo,
    ResolvedResource,
)
from core.artifacts.storage import ArtifactStorage, FileArtifactStorage, key_prefix_of
from core.db import read_connection
from core.errors import (
    ArtifactIncomplete,
    BlobNotFound,
    ResolveError,
    ResolveNotFound,
    SessionNotFound,
)

BlobReader = Callable[[str], bytes]
_NUMERIC = re.compile(r"^[0-9]+$")
_BLOB_REF = re.compile(r"^blob:sha256:([0-9a-f]{64})$")


def resolve(
    engine: Engine,
    root: Path,
    url: str,
    *,
    session_id: str,
    tenant_id: str | None = None,
    offset: int | None = None,
    limit: int | None = None,
    blob_reader: BlobReader | None = None,
    storage: ArtifactStorage | None = None,
    partial: bool = False,
) -> ResolvedResource:
    """Resolve ``url`` in the session; ``offset`` (1-based line) and ``limit`` page by lines.

    A tool output whose writer has not finished it (or died) is ``ArtifactIncomplete``;
    with ``partial`` its bytes so far are served instead, with ``complete`` False and a
    note saying so."""
    _check_paging(offset, limit)
    resolver = _Resolver(engine, root, session_id, tenant_id, blob_reader)
    resolver.storage = storage
    paged = offset is not None or limit is not None
    if url.startswith("artifact://"):
        found = resolver.artifact(url, partial=partial)
    elif url.startswith("agent://"):
        found = resolver.agent(url, paged=paged)
    elif url.startswith("art_"):
        found = resolver.oversized(url)
    elif url.startswith("blob:"):
        found = resolver.blob(url)
    else:
        raise ResolveError(
            f"unsupported URL {url[:200]!r}: expected artifact://<id>, agent://<id>, "
            "art_<16 hex> or blob:sha256:<64 hex>"
        )
    return paginate(found, offset, limit) if paged else found


def _check_paging(offset: int | None, limit: int | None) -> None:
    if offset is not None and offset < 1:
        raise ResolveError(f"offset is a 1-based line number, got {offset}")
    if limit is not None and limit < 1:
        raise ResolveError(f"limit must be at least 1, got {limit}")


def paginate(resource: ResolvedResource, offset: int | None, limit: int | None) -> ResolvedResource:
    """Lines ``offset`` .. ``offset + limit - 1`` (1-based, line endings kept)."""
    parts = resource.content.split("\n")
    lines = [p + "\n" for p in parts[:-1]] + ([parts[-1]] if parts[-1] else [])
    total = len(lines)
    start = (offset or 1) - 1
    if start >= total and not (start == 0 and total == 0):
        raise ResolveError(f"offset {offset} is beyond the end ({total} lines)")
    end = total if limit is None else min(total, start + limit)
    content = "".join(lines[start:end])
    notes = [*resource.notes, f"Showing lines {start + 1}-{end} of {total}"]
    if end < total:
        notes.append(f"More available: continue with offset={end + 1}")
    size = len(content.encode("utf-8", "surrogatepass"))
    return replace(resource, content=content, size=size, notes=notes)


def _text(
    url: str, content: str, content_type: str, notes: list[str] | None = None
) -> ResolvedResource:
    size = len(content.encode("utf-8", "surrogatepass"))
    return ResolvedResource(url, content, content_type, size, notes or [])


class _Resolver:
    def __init__(
        self,
        engine: Engine,
        root: Path,
        session_id: str,
        tenant_id: str | None,
        blob_reader: BlobReader | None,
    ) -> None:
        self.engine = engine
        self.session_id = session_id
        self.blob_reader = blob_reader
        with read_connection(engine) as conn:
            try:
                info = rows.session_info(conn, session_id, tenant_id=tenant_id)
            except SessionNotFound as exc:
                # Same answer for "no such session" and "another tenant's session".
                raise ResolveNotFound(f"session not found: {session_id}") from exc
        self.tenant_id = info.tenant_id
        self.root = root
        self.directory = session_dir(root, info.tenant_id, session_id)
        self.storage: ArtifactStorage | None = None  # None: the filesystem at ``root``

    def _rows(self, kind: str, local_id: str) -> tuple[Any, list[str]]:
        with read_connection(self.engine) as conn:
            row = rows.get_artifact(conn, self.session_id, kind, local_id)
            ids = [] if row is not None else rows.local_ids(conn, self.session_id, kind)
        return row, ids

    def _read(self, row: ArtifactInfo) -> str | None:

        own = self.directory / (row.name or "")
        data = read_artifact_file(self.engine, self.root, own, row, self.storage)
        return data.decode("utf-8", "replace") if data is not None else None

    def _require_directory(self) -> None:

        if self._has_directory() or copy_unfinished(self.engine, self.session_id):
            return
        if not self._has_directory():  # again: a copy may have just created it
            raise ResolveNotFound("No artifacts directory found")

    def _has_directory(self) -> bool:
        if self.storage is None or isinstance(self.storage, FileArtifactStorage):
            return self.directory.is_dir()
        return bool(self.storage.keys(key_prefix_of(self.root, self.directory)))

    # artifact://<id> -------------------------------------------------------------------------

    def artifact(self, url: str, *, partial: bool) -> ResolvedResource:
        parts = urlsplit(url)
        artifact_id = parts.netloc
        if not artifact_id:
            raise ResolveError("artifact:// URL requires a numeric ID: artifact://0")
        if not _NUMERIC.match(artifact_id):
            raise ResolveError(f"artifact:// ID must be numeric, got: {artifact_id}")
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            raise ResolveError(f"artifact:// URLs take no path or query: {url}")
        row, ids = self._rows(TOOL_OUTPUT, artifact_id)
        if row is not None and not row.complete:
            return self._incomplete(url, row, partial=partial)
        self._require_directory()
        content = self._read(row) if row is not None else None
        if content is None:
            available = ", ".join(sorted(ids, key=int)) or "none"
            raise ResolveNotFound(f"Artifact {artifact_id} not found. Available: {available}")
        return _text(url, content, "text/plain")

    def _incomplete(self, url: str, row: ArtifactInfo, *, partial: bool) -> ResolvedResource:
        """A tool output that is not whole: refused, or (``partial``) served as what it is."""
        if not partial:
            raise ArtifactIncomplete(url, row.state, row.size_bytes)
        content = self._read(row) or ""
        found = _text(url, content, "text/plain")
        if row.state == WRITING:
            note = (
                f"incomplete: still being written (or its writer died); {found.size:,} bytes so far"
            )
        else:
            note = (
                "incomplete: truncated (its writer died, or this fork was taken while it was "
                f"written); {found.size:,} bytes were saved"
            )
        return replace(found, complete=False, notes=[note])

    # agent://<id>[/<path>|?q=<query>] -------------------------------------------------------------

    def agent(self, url: str, *, paged: bool) -> ResolvedResource:
        parts = urlsplit(url)
        output_id = parts.netloc
        if not output_id:
            raise ResolveError("agent:// URL requires an output ID: agent://<id>")
        query = self._agent_query(parts.query)
        has_path = parts.path not in ("", "/")
        if has_path and query:
            raise ResolveError("agent:// URL cannot combine path extraction with ?q=")
        extracting = has_path or bool(query)
        if extracting and paged:
            raise ResolveError("agent:// JSON extraction does not take offset/limit")
        self._require_directory()
        row, ids = self._rows(AGENT_OUTPUT, output_id)
        content = self._read(row) if row is not None else None
        if content is None:
            raise ResolveNotFound(f"Not found: {output_id}\nAvailable: {', '.join(ids) or 'none'}")
        if not extracting:
            return _text(url, content, "text/markdown")
        return self._extract(
            url, output_id, content, path_to_query(parts.path) if has_path else query
        )

    @staticmethod
    def _agent_query(raw: str) -> str:
        params = parse_qsl(raw, keep_blank_values=True)
        unknown = sorted({k for k, _ in params if k != "q"})
        if unknown:
            raise ResolveError(f"agent:// URL takes only ?q=, got: {', '.join(unknown)}")
        return next((v for k, v in params if k == "q"), "")

    @staticmethod
    def _extract(url: str, output_id: str, content: str, query: str) -> ResolvedResource:
        try:
            data = json.loads(content, parse_constant=_reject_constant)
        except ValueError as exc:
            raise ResolveError(f"Output {output_id} is not valid JSON: {exc}") from exc
        value = apply_query(data, query)
        text = json.dumps(value, indent=2, ensure_ascii=False)
        return _text(url, text, "application/json", [f"Extracted: {query}"])

    # art_<16 hex> ---------------------------------------------------------------------------

    def oversized(self, url: str) -> ResolvedResource:
        if not OVERSIZED_ID.match(url):
            raise ResolveError(f"invalid oversized-output id {url[:80]!r}: expected art_<16 hex>")
        with read_connection(self.engine) as conn:
            row = rows.get_artifact(conn, self.session_id, OVERSIZED, url)
            expired = row is not None and rows.has_expired(conn, row)
        content = self._read(row) if row is not None and not expired else None
        if content is None:
            raise ResolveNotFound(f"Oversized output {url} not found (or expired)")
        return _text(url, content, "text/plain")

    # blob:sha256:<64 hex> ---------------------------------------------------------------------

    def blob(self, url: str) -> ResolvedResource:
        match = _BLOB_REF.match(url)
        if match is None:
            raise ResolveError(
                f"invalid blob ref {url[:100]!r}: expected blob:sha256:<64 lowercase hex>"
            )
        blob_hash = match.group(1)
        with read_connection(self.engine) as conn:
            encoding = rows.blob_encoding_for_tenant(conn, blob_hash, self.tenant_id)
        if encoding is None:
            raise ResolveNotFound(f"blob not found: {url}")
        if self.blob_reader is None:
            raise ResolveError("blob refs cannot be resolved: this store has no blob store")
        try:
            data = self.blob_reader(blob_hash)
        except BlobNotFound as exc:
            raise ResolveNotFound(f"blob not found: {url}") from exc
        # BlobCorrupted goes up as it is: the blob is there, and refused (invariant 13)
        if encoding == "utf8":
            return _text(url, data.decode("utf-8", "replace"), "text/plain")
        note = f"binary content ({len(data)} bytes), base64-encoded"
        return _text(url, pybase64.b64encode_as_string(data), "application/octet-stream", [note])


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")
