"""oh-my-pi sessions: a pi version-3 file plus its artifacts directory and a global blob store.

The layout (``docs/blob-artifact-architecture.md`` in oh-my-pi)::

    <sessions>/--<cwd>--/<timestamp>_<id>.jsonl     the session (pi v3 entries)
    <sessions>/--<cwd>--/<timestamp>_<id>/          its artifacts
        <n>.<tool>.log                              tool output, artifact://<n>
        <outputId>.md, <outputId>.jsonl             agent output (and its session), agent://<id>
    ~/.omp/agent/blobs/<sha256>                     bytes behind ``blob:sha256:<sha256>`` refs

oh-my-pi replaces a large image's base64 ``data`` by a ref to the decoded bytes (an image
block of a ``content`` array; newer versions also an image payload under ``images`` or
``frames``: ``isExternalizableImagePosition``), and a provider ``image_url`` data URL by a ref
to its UTF-8 text. Both directions use that one rule (``_image_at``), so an export writes a ref
exactly where the import resolved one. An import puts the values back
(the bytes are checked against their hash first), so our own externalization stores them
under the same hash and a pi export has the images inline. A ref whose blob is missing (or
corrupt) stays in the entry, as oh-my-pi keeps it, under ``missingBlobRef`` (an image's
``data`` must hold bytes we have), and is reported in ``missing_blobs``.

Artifacts are imported with their ids (``put_tool_output`` / ``put_agent_output``), so
``artifact://3`` and ``agent://explore`` resolve here to the same content as in oh-my-pi.
``export_omp`` writes the layout back.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import pybase64

from core import nofollow
from core.artifacts.inherited import read_agent_output, read_artifact_file
from core.artifacts.manager import MAX_AGENT_ID_CHARS
from core.artifacts.paths import contained_path, encode_component
from core.artifacts.records import AGENT_OUTPUT, TOOL_OUTPUT
from core.blobs.externalize import canonical_base64
from core.blobs.store import BLOB_REF_PREFIX, parse_ref
from core.errors import ExportIncomplete, SymlinkRefused, UnreadableFile
from core.fsio import published_text, replace_atomically
from core.interop import exporter, pi
from core.interop.importer import register_converter
from core.interop.model import ArtifactFile, Format, ParsedEntry, ParsedSession

if TYPE_CHECKING:
    from core.store import SessionStore

log = logging.getLogger(__name__)

FORMAT: Format = "omp"
MISSING_KEY = "missingBlobRef"
IMAGE_BLOCK_KEY = "content"
IMAGE_PAYLOAD_KEYS = frozenset({"images", "frames"})
DATA_URL_KEY = "image_url"
# oh-my-pi externalizes an image whose base64 is at least this long (BLOB_EXTERNALIZE_THRESHOLD)
EXTERNALIZE_MIN_CHARS = 1024
_TOOL_LOG = re.compile(r"^(\d+)\.([A-Za-z0-9_-]+)\.log$")
_AGENT_OUTPUT = re.compile(r"^([A-Za-z0-9_-]+(?:\.[A-Za-z0-9_-]+)*)\.(md|jsonl)$")


def default_blobs_dirs(session_file: Path) -> tuple[Path, ...]:
    """Where a blob is looked for, in order: ``<agent dir>/blobs`` when the file sits in
    ``<agent dir>/sessions/<project>/``; else a ``blobs/`` directory beside the file (where
    ``export --format omp -o DIR`` writes them outside an agent directory: its import found
    none of its images), then ``~/.omp/agent/blobs``. A blob is taken from the first that
    holds bytes hashing to its name."""
    resolved = session_file.resolve()
    agent_dir = resolved.parent.parent.parent
    if resolved.parent.parent.name == "sessions" and (agent_dir / "blobs").is_dir():
        return (agent_dir / "blobs",)
    home = Path.home() / ".omp" / "agent" / "blobs"
    beside = resolved.parent / "blobs"
    return (beside, home) if beside.is_dir() and beside != home else (home,)


def artifacts_dir(session_file: Path) -> Path:
    return session_file.with_suffix("")


def sniff_omp(path: Path, data: bytes) -> bool:
    """A pi header, with an artifacts directory next to the file or a blob ref anywhere in
    it (oh-my-pi's header is pi's: a ref far into the file is the only mark of a file
    without artifacts; a byte search of the whole file costs far less than its parse)."""
    if not pi.sniff(data):
        return False
    return artifacts_dir(path).is_dir() or b'"' + BLOB_REF_PREFIX.encode() in data


# reading -------------------------------------------------------------------------------------


def parse_omp(path: Path, data: bytes, *, blobs_dir: Path | None = None) -> ParsedSession:
    """The session file as pi entries with blob refs resolved, plus its artifact files."""
    parsed = pi.parse(path, data, literal_refs=False)
    roots = (blobs_dir,) if blobs_dir is not None else default_blobs_dirs(path)
    blobs = _BlobReader(*roots)
    entries = [_literal(replace(e, entry=blobs.resolve(e.entry))) for e in parsed.entries]
    if blobs.missing:  # at info level: the import's result lists them (the CLI says so)
        log.info(
            "blobs referenced by the session are missing; their refs are kept",
            extra={
                "path": str(path),
                "missing": blobs.missing,
                "blobs_dir": ", ".join(map(str, roots)),
            },
        )
    return replace(
        parsed,
        format=FORMAT,
        entries=entries,
        artifacts=list_artifacts(artifacts_dir(path)),
        missing_blobs=blobs.missing,
    )


def _literal(entry: ParsedEntry) -> ParsedEntry:
    """An entry still holding an image whose data reads as a blob ref (where oh-my-pi puts
    none) kept escaped, as pi's parser keeps one: that is its text, not a ref to a blob of
    the store."""
    if not pi.holds_ref_image(entry.entry):
        return entry
    value = entry.entry
    if value.get("type") == pi.ESCAPED_LINE and isinstance(value.get("value"), dict):
        return replace(entry, entry={**value, "value": pi.escaped_refs(value["value"])})
    return replace(entry, entry=pi.escaped_line(value))


class _BlobReader:
    def __init__(self, *roots: Path) -> None:
        self.roots = roots  # looked in, in order
        self.missing: list[str] = []

    def read(self, ref: str) -> bytes | None:
        """The blob's bytes from the first directory whose copy hashes to the ref (a corrupt
        copy counts as none). A link named as a blob is not followed (logged, the blob
        missing there): it would read a file outside the blobs directory into the store."""
        blob_hash = parse_ref(ref)
        if blob_hash is not None:
            for root in self.roots:
                data = self._read(root, blob_hash)
                if data is not None and hashlib.sha256(data).hexdigest() == blob_hash:
                    return data
        if ref not in self.missing:
            self.missing.append(ref)
        return None

    @staticmethod
    def _read(root: Path, blob_hash: str) -> bytes | None:
        path = root / blob_hash
        try:  # a FIFO or a device named as a blob is no blob: never opened blocking
            return nofollow.read_bytes(root, path)
        except SymlinkRefused:
            log.warning("%r: a blob file is a link: not followed", str(path), extra=_at(path))
        except OSError:
            pass
        return None

    def text(self, ref: str) -> str:
        """A data URL blob's text; the ref itself (reported missing) if it is not UTF-8."""
        data = self.read(ref)
        try:
            return data.decode("utf-8") if data is not None else ref
        except UnicodeDecodeError:
            self.missing.append(ref)
            return ref

    def resolve(self, value: Any, key: str | None = None) -> Any:
        if isinstance(value, list):
            return [self.resolve(v, key) for v in value]
        if not isinstance(value, dict):
            return value
        out: dict[str, Any] = {}
        for child, item in value.items():
            if child == DATA_URL_KEY and _is_ref(item):
                out[child] = self.text(item)
            else:
                out[child] = self.resolve(item, child)
        if _image_at(out, key) and _is_ref(out["data"]):
            data = self.read(out["data"])
            if data is None:
                out[MISSING_KEY] = out["data"]
                out["data"] = ""
            else:
                out["data"] = pybase64.b64encode_as_string(data)
        return out


def _is_ref(value: Any) -> bool:
    return isinstance(value, str) and value.startswith(BLOB_REF_PREFIX)


def _image_at(value: dict[str, Any], key: str | None) -> bool:
    """oh-my-pi's ``isExternalizableImagePosition``: ``value`` (under ``key``, the nearest
    object key, arrays passing it on) is an image block of ``content``, or an image payload
    (an image block, or ``data`` with an ``image/*`` ``mimeType``) under ``images``/``frames``."""
    if not isinstance(value.get("data"), str):
        return False
    block = value.get("type") == "image"
    if key == IMAGE_BLOCK_KEY:
        return block
    mime = value.get("mimeType")
    payload = block or (isinstance(mime, str) and mime.lower().startswith("image/"))
    return key in IMAGE_PAYLOAD_KEYS and payload


def list_artifacts(directory: Path) -> list[ArtifactFile]:
    """Tool outputs by number, then agent outputs and their sidecars by name. Anything else
    (oh-my-pi's ``.artifact-<n>.json`` provenance notes, sub-directories) is skipped. No
    link is followed: not a linked file, nor the directory itself if it is a link."""
    try:
        fd = nofollow.open_dir(directory.parent, directory)
    except SymlinkRefused:
        log.warning(
            "%r: the artifacts directory is a link: not followed",
            str(directory),
            extra=_at(directory),
        )
        return []
    if fd is None:
        return []
    try:
        with os.scandir(fd) as listing:
            names = sorted(e.name for e in listing if e.is_file(follow_symlinks=False))
    finally:
        os.close(fd)
    tools: list[tuple[int, ArtifactFile]] = []
    agents: list[ArtifactFile] = []
    for name in names:
        path = directory / name
        tool = _TOOL_LOG.match(name)
        agent = _AGENT_OUTPUT.match(name)
        if tool:
            artifact = ArtifactFile("tool_output", tool.group(1), path, tool.group(2))
            tools.append((int(tool.group(1)), artifact))
        elif agent and len(agent.group(1)) > MAX_AGENT_ID_CHARS:
            log.warning(
                "%r: skipping an agent output with an overlong id", str(path), extra=_at(path)
            )
        elif agent and agent.group(2) == "md":
            agents.append(ArtifactFile("agent_output", agent.group(1), path))
        elif agent:
            agents.append(ArtifactFile("sidecar", agent.group(1), path))
        else:
            log.debug("skipping a file of the artifacts directory", extra=_at(path))
    return [a for _, a in sorted(tools, key=lambda t: t[0])] + agents


def import_artifacts(store: SessionStore, session_id: str, parsed: ParsedSession) -> int:
    """Put the session's artifact files in under their ids; returns how many were written.
    Those already there with the same bytes are skipped, so a re-import writes nothing, and
    a tool log that grew (a command still running) is replaced."""
    manager = store.artifacts(session_id)
    have = manager.directory()
    sidecars = {a.artifact_id: a.path for a in parsed.artifacts if a.kind == "sidecar"}
    outputs = {a.artifact_id for a in parsed.artifacts if a.kind == "agent_output"}
    written = 0
    for artifact in parsed.artifacts:
        if artifact.kind == "tool_output":
            data = _artifact_bytes(artifact.path)
            if data is None:
                continue
            tool = artifact.tool_type or "tool"
            if _same(have, {f"{artifact.artifact_id}.{tool}.log": data}):
                continue
            manager.put_tool_output(artifact.artifact_id, tool, data)
        elif artifact.kind == "agent_output" or artifact.artifact_id not in outputs:
            md = _artifact_bytes(artifact.path) if artifact.kind == "agent_output" else b""
            if md is None:
                continue
            files = {f"{artifact.artifact_id}.md": md}
            sidecar = sidecars.get(artifact.artifact_id)
            jsonl = _artifact_bytes(sidecar) if sidecar is not None else None
            if jsonl is not None:
                files[f"{artifact.artifact_id}.jsonl"] = jsonl
            if _same(have, files):
                continue
            manager.put_agent_output(artifact.artifact_id, md, jsonl=jsonl)
        else:
            continue  # a sidecar, written with its markdown
        written += 1
    return written


def _artifact_bytes(path: Path) -> bytes | None:
    """An artifact file's bytes, read through no link (``list_artifacts`` follows none): None
    for one a link took the place of since it was listed (logged). A file that went away,
    or is no regular file now, is ``UnreadableFile``, as the session file would be."""
    try:
        data = nofollow.read_bytes(path.parent.parent, path)
    except SymlinkRefused:
        log.warning("%r: an artifact file is a link: not followed", str(path), extra=_at(path))
        return None
    except OSError as exc:
        raise UnreadableFile(str(path), exc.strerror or str(exc)) from None
    if data is None:
        raise UnreadableFile(str(path), "not a regular file")
    return data


def _at(path: Path) -> dict[str, str]:
    return {"path": str(path)}


def _same(directory: Path, files: dict[str, bytes]) -> bool:
    root = nofollow.artifact_root_of(directory)
    for name, data in files.items():
        try:
            # No link followed, and a FIFO planted there is no file (never a hung read).
            if nofollow.read_bytes(root, directory / name) != data:
                return False
        except (OSError, SymlinkRefused):
            return False
    return True


def _after_import(store: SessionStore, session_id: str, parsed: ParsedSession) -> None:
    import_artifacts(store, session_id, parsed)


register_converter(
    FORMAT,
    parse_omp,
    sniff=sniff_omp,
    priority=30,
    after_import=_after_import,
    options=("blobs_dir",),
)


# writing ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class OmpExport:
    session_file: Path
    artifacts_dir: Path
    blobs_dir: Path
    lines: int
    blobs_written: int
    artifacts: int
    # tool outputs left out as not whole (a writer unfinished or dead): (id, state)
    incomplete_artifacts: list[tuple[str, str]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "incomplete_artifacts": [list(a) for a in self.incomplete_artifacts],
            "session_file": str(self.session_file),
            "artifacts_dir": str(self.artifacts_dir),
            "blobs_dir": str(self.blobs_dir),
            "lines": self.lines,
            "blobs_written": self.blobs_written,
            "artifacts": self.artifacts,
        }


def session_file_name(header: dict[str, Any]) -> str:
    """oh-my-pi's ``<timestamp>_<id>.jsonl``, the timestamp with ``:`` and ``.`` as ``-``.

    oh-my-pi makes both parts itself; ours come from a stored header (a Claude Code subagent's
    id holds a ``/``, a hostile one anything), so the stem is made one file name by the
    canonical ``encode_component``: oh-my-pi's own names (ISO time, hex or UUID id) are kept
    as they are, any other character is percent-encoded.
    """
    stamp = re.sub(r"[:.]", "-", str(header.get("timestamp") or ""))
    return encode_component(f"{stamp}_{header.get('id')}") + ".jsonl"


def export_omp(
    store: SessionStore,
    session_ref: str,
    out_dir: Path,
    *,
    blobs_dir: Path,
    at_seq: int | None = None,
    tenant_id: str | None = None,
) -> OmpExport:
    """Write the session as oh-my-pi's layout: its file, its artifacts, its blobs.
    ``ExportIncomplete`` (carrying the ``OmpExport``) once written if a blob could not be
    read."""
    session = store.resolve_session(session_ref, tenant_id=tenant_id)
    missing: list[str] = []
    header, entries = exporter.session_lines(store, session, at_seq=at_seq, missing=missing)
    out_dir.mkdir(parents=True, exist_ok=True)
    blobs_dir.mkdir(parents=True, exist_ok=True)
    # checked as well as encoded: a symlink left in ``out_dir`` is not written through
    target = contained_path(out_dir, session_file_name(header))
    directory = contained_path(out_dir, artifacts_dir(target).name)
    blobs = _DirectoryBlobs(blobs_dir)
    # published whole: oh-my-pi may have this session open, and a failed or killed export
    # must not leave it a truncated file (written in place, it did)
    with published_text(target) as out:
        lines = write_session_file(out, header, entries, blobs.put)
    incomplete: list[tuple[str, str]] = []
    count = _export_artifacts(store, session.id, directory, incomplete)
    done = OmpExport(target, directory, blobs_dir, lines, blobs.written, count, incomplete)
    if missing:
        raise ExportIncomplete(missing, done)
    return done


def write_session_file(
    out: IO[str],
    header: dict[str, Any],
    entries: Iterator[dict[str, Any]],
    put: Callable[[bytes], str | None],
) -> int:
    """oh-my-pi's session file: pi lines whose images are blob refs (``put`` stores the
    bytes somewhere and returns the ref, or None to keep them inline). The number of
    lines."""
    writer = _BlobWriter(put)
    return pi.write(out, header, (writer.externalize(e) for e in entries))


@dataclass
class _DirectoryBlobs:
    """oh-my-pi's global blobs directory: a file per blob, named by its sha256."""

    root: Path
    written: int = 0

    def put(self, data: bytes) -> str:
        blob_hash = hashlib.sha256(data).hexdigest()
        path = self.root / blob_hash
        if not path.exists():
            replace_atomically(path, data)
            self.written += 1
        return BLOB_REF_PREFIX + blob_hash


@dataclass
class _BlobWriter:
    put: Callable[[bytes], str | None]

    def externalize(self, value: Any, key: str | None = None) -> Any:
        """oh-my-pi's persistence rule: images where ``_image_at`` finds them and image data
        URLs become refs; a kept missing ref goes back where oh-my-pi had it."""
        if isinstance(value, list):
            return [self.externalize(v, key) for v in value]
        if not isinstance(value, dict):
            return value
        out: dict[str, Any] = {}
        for child, item in value.items():
            if child == DATA_URL_KEY and isinstance(item, str) and _is_data_url(item):
                out[child] = self.put(item.encode("utf-8", "surrogatepass")) or item
            else:
                out[child] = self.externalize(item, child)
        if MISSING_KEY in out and (out.get("type") == "image" or _image_at(out, key)):
            out["data"] = out.pop(MISSING_KEY)
        elif _image_at(out, key):
            data = out["data"]
            if len(data) >= EXTERNALIZE_MIN_CHARS and not _is_ref(data):
                raw = canonical_base64(data)
                if raw is not None:
                    out["data"] = self.put(raw) or data
        return out


def _is_data_url(value: str) -> bool:
    return value.startswith("data:image/") and ";base64," in value


def _export_artifacts(
    store: SessionStore, session_id: str, directory: Path, incomplete: list[tuple[str, str]]
) -> int:
    """Write the session's tool and agent outputs; a tool output that is not whole goes to
    ``incomplete`` instead (oh-my-pi's layout cannot say so: it would read as the whole)."""
    manager = store.artifacts(session_id)
    own = manager.directory()
    count = 0
    root = store.settings.resolved_artifact_root
    storage = store.artifact_storage
    for row in _exportable(manager.list()):
        if not row.complete:
            incomplete.append((row.local_id, row.state))
            continue
        path = own / (row.name or "")
        jsonl = None
        if row.kind == AGENT_OUTPUT:
            # its sidecar from the same storage, through no link, checked as its markdown
            # is: both of one version, read (and found whole) before either is written
            pair = read_agent_output(store.engine, root, path, row, storage)
            if pair is None:
                continue
            _version, data, jsonl = pair
        else:
            found = read_artifact_file(store.engine, root, path, row, storage)
            if found is None:
                continue
            data = found
        directory.mkdir(parents=True, exist_ok=True)
        if jsonl is not None:
            replace_atomically(contained_path(directory, f"{row.local_id}.jsonl"), jsonl)
        replace_atomically(contained_path(directory, row.name or ""), data)
        count += 1
    return count


def _exportable(rows: list[Any]) -> Iterator[Any]:
    return (r for r in rows if r.kind in (TOOL_OUTPUT, AGENT_OUTPUT))
