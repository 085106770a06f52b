"""Where artifacts live on disk, and the one canonical sanitizer for user-supplied paths.

Everything that turns untrusted text into a filesystem location goes through this module
(DESIGN invariant 9): the tenant and session directory components, tool types and agent
names inside file names, and path-addressed files.

Layout of one session directory::

    <root>/<tenant component>/<session component>/
        <id>.<toolType>.log          tool-output logs        artifact://<id>
        <id>.md, <id>.jsonl          agent outputs           agent://<id>
        files/<sanitized path>       path-addressed files
        oversized/art_<16 hex>.txt   oversized outputs (TTL)
        .tmp/                        staging for atomic writes

User paths only ever land under ``files/``, so they can never collide with the rest.
"""

from __future__ import annotations

import hashlib
import os
import re
import unicodedata
from pathlib import Path

from core.errors import InvalidArtifactPath

MAX_PATH_CHARS = 256
MAX_COMPONENT_CHARS = 128
# Filesystems limit a name in bytes (ext4, APFS: 255); 128 characters of 4-byte UTF-8 exceed it.
MAX_COMPONENT_BYTES = 255
MAX_TOKEN_CHARS = 64

FILES_DIR = "files"
OVERSIZED_DIR = "oversized"
STAGING_DIR = ".tmp"

_KEEP = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")
# A percent-encoded component longer than this is replaced by its digest (NAME_MAX safety).
_MAX_ENCODED_COMPONENT = 128
_HASHED_PREFIX = "~"
_TOKEN_RUN = re.compile(r"[^A-Za-z0-9_-]+")
_WINDOWS_RESERVED = frozenset(
    {"CON", "PRN", "AUX", "NUL"}
    | {f"COM{i}" for i in range(1, 10)}
    | {f"LPT{i}" for i in range(1, 10)}
)


# --- directory components -----------------------------------------------------------------


def encode_component(value: str) -> str:
    """A reversible, path-safe directory name for an identifier (tenant id, session id).

    ``[A-Za-z0-9_-]`` is kept; every other UTF-8 byte becomes ``%XX``, so the result is never
    empty, ``.`` or ``..`` and never contains a separator. An encoding too long for a file
    name becomes ``~`` + SHA-256 of the value: ``~`` cannot come out of the percent form, so
    the two forms never collide.
    """
    if not value:
        raise ValueError("an identifier used as a directory name must not be empty")
    encoded = "".join(
        chr(b) if chr(b) in _KEEP else f"%{b:02X}" for b in value.encode("utf-8", "surrogatepass")
    )
    if len(encoded) > _MAX_ENCODED_COMPONENT:
        return _HASHED_PREFIX + hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()
    return encoded


def decode_component(component: str) -> str | None:
    """The identifier a component encodes, or None for the digest form (not reversible)."""
    if component.startswith(_HASHED_PREFIX):
        return None
    raw = bytearray()
    i = 0
    while i < len(component):
        if component[i] == "%":
            raw.append(int(component[i + 1 : i + 3], 16))
            i += 3
        else:
            raw.append(ord(component[i]))
            i += 1
    return raw.decode("utf-8", "surrogatepass")


def session_dir(root: Path, tenant_id: str, session_id: str) -> Path:
    """The one place a session's artifact directory is named (a session move renames it)."""
    return root / encode_component(tenant_id) / encode_component(session_id)


# --- names inside the session directory ---------------------------------------------------


def sanitize_token(value: str, fallback: str) -> str:
    """Runs of ``[^A-Za-z0-9_-]`` become ``_``; cut to 64 chars; ``_`` stripped; never empty."""
    token = _TOKEN_RUN.sub("_", value)[:MAX_TOKEN_CHARS].strip("_")
    return token or fallback


def sanitize_tool_type(tool_type: str) -> str:
    return sanitize_token(tool_type, "tool")


def sanitize_agent_name(name: str) -> str:
    return sanitize_token(name, "agent")


def tool_log_name(artifact_id: str, tool_type: str) -> str:
    return f"{artifact_id}.{tool_type}.log"


def agent_output_names(output_id: str) -> tuple[str, str]:
    """The markdown file and the optional JSONL sidecar of an agent output."""
    return f"{output_id}.md", f"{output_id}.jsonl"


def oversized_name(artifact_id: str) -> str:
    return f"{OVERSIZED_DIR}/{artifact_id}.txt"


_OVERSIZED_FILE = re.compile(r"^(art_[0-9a-f]{16})\.txt$")


def oversized_id_of(file_name: str) -> str | None:
    """The artifact id in an oversized output's file name; None for any other name."""
    match = _OVERSIZED_FILE.match(file_name)
    return match.group(1) if match else None


def file_name(sanitized_path: str) -> str:
    return f"{FILES_DIR}/{sanitized_path}"


# --- the canonical path sanitizer ---------------------------------------------------------


def sanitize_path(path: str) -> str:
    """Validate and canonicalize a user path for a path-addressed file.

    Backslashes become ``/``, repeated separators collapse and a trailing slash is dropped.
    Rejected: empty or absolute paths, any ``:``, ``.``/``..`` or hidden components, NUL and
    control characters, Windows reserved device names (any case, with or without an
    extension), paths over 256 characters and components over 128 characters (or over
    255 UTF-8 bytes, the file-name limit). Returns the canonical relative POSIX path.
    """
    if not isinstance(path, str):
        raise InvalidArtifactPath(repr(path), "must be a string")
    _reject_characters(path)
    normalized = path.replace("\\", "/")
    if normalized.startswith("/"):
        raise InvalidArtifactPath(path, "absolute paths are not allowed")
    parts = [p for p in normalized.split("/") if p]
    if not parts:
        raise InvalidArtifactPath(path, "empty path")
    canonical = "/".join(parts)
    if len(canonical) > MAX_PATH_CHARS:
        raise InvalidArtifactPath(path, f"longer than {MAX_PATH_CHARS} characters")
    for part in parts:
        _check_component(path, part)
    return canonical


def _reject_characters(path: str) -> None:
    for ch in path:
        if ch == "\x00":
            raise InvalidArtifactPath(path, "NUL character")
        category = unicodedata.category(ch)
        if category == "Cc":
            raise InvalidArtifactPath(path, f"control character U+{ord(ch):04X}")
        if category == "Cs":
            # A lone surrogate cannot be encoded as a file name.
            raise InvalidArtifactPath(path, f"unpaired surrogate U+{ord(ch):04X}")
        if ch == ":":
            raise InvalidArtifactPath(path, "':' is not allowed")


def _check_component(path: str, part: str) -> None:
    if part in (".", ".."):
        raise InvalidArtifactPath(path, f"{part!r} components are not allowed")
    if part.startswith("."):
        raise InvalidArtifactPath(path, f"hidden component {part!r}")
    if len(part) > MAX_COMPONENT_CHARS:
        raise InvalidArtifactPath(path, f"component longer than {MAX_COMPONENT_CHARS} characters")
    if len(part.encode("utf-8", "surrogatepass")) > MAX_COMPONENT_BYTES:
        raise InvalidArtifactPath(path, f"component longer than {MAX_COMPONENT_BYTES} bytes")
    # Windows maps "CON", "con.txt" and "CON .log" alike to the device.
    stem = part.split(".", 1)[0].rstrip(" ").upper()
    if stem in _WINDOWS_RESERVED:
        raise InvalidArtifactPath(path, f"reserved device name {part!r}")


def contained_path(base: Path, relative: str) -> Path:
    """``base / relative``, refusing anything that resolves outside ``base``.

    Defense in depth behind the sanitizer: the check uses the resolved real paths.
    """
    target = base / relative
    try:
        real_base = os.path.realpath(base)
        real_target = os.path.realpath(target)
    except OSError as exc:
        # A component changed between realpath's lstat and readlink (a link swapped back
        # for a directory reads as EINVAL): the path is moving under us, so it is refused.
        raise InvalidArtifactPath(relative, f"changed while it was resolved ({exc})") from exc
    if os.path.commonpath([real_base, real_target]) != real_base or real_target == real_base:
        raise InvalidArtifactPath(relative, "resolves outside the session directory")
    return target
