"""Claude Code transcripts (``~/.claude/projects/<project>/<session>.jsonl``) as pi entries.

One line of the transcript becomes one pi entry, or several when a user line carries tool
results (pi keeps each ``toolResult`` in its own message). The mapping is the table in
``docs/formats.md``; the points that are not obvious:

- ``uuid``/``parentUuid`` become ``id``/``parentId``. A line's extra entries get derived ids
  (``<uuid>#1`` …) and chain before the one that keeps the uuid, so children still find it.
- Claude Code writes one API response over several lines (one per content block) that share
  ``message.id`` and ``requestId``, each with a usage snapshot whose ``output_tokens`` grows.
  Each entry's ``usage`` is what its line adds to the response's running maximum, so the
  entries of one response sum to its final usage exactly once, and an entry never changes
  once imported (a file that grows only appends).
- A ``compact_boundary`` line and the compact-summary user line after it become one
  ``compaction`` entry (parented to the boundary's ``logicalParentUuid``). A boundary that is
  the file's last line is not consumed yet: the summary follows it in the next write.
- A transcript is the session its file names (``<session>.jsonl``). A resumed session's
  file begins with the lines it resumes, which carry the earlier sessions' ``sessionId``:
  the last of those becomes its parent once both are imported (nothing inherited). A file
  not named by a session id (a copy renamed) goes by the last ``sessionId`` in it; a
  subagent's (``agent-<id>.jsonl``) is ``<parent session>/agent-<id>``.
- Everything else (``summary`` titles, ``system`` notes, file-history snapshots, …) becomes a
  ``custom`` entry ``claude-code.<type>`` holding the line, so nothing is lost and pi's
  context ignores it.
- Each entry keeps what pi has no field for under ``claudeCode``: the line without its
  ``message.content`` (``isSidechain``, ``agentId``, ``requestId``, the raw usage, …). The
  content is kept there too (``claudeCode.message.content``) whenever mapping the entries back
  (``_content_back``) would not give it exactly, so no value of a line is ever dropped:
  ``line_content`` reads it back either way.
"""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from core.errors import ImportFormatError
from core.fsio import path_text
from core.interop import pi
from core.interop.importer import register_converter
from core.interop.model import Format, IgnoredLine, ParsedEntry, ParsedSession, SessionHeader

FORMAT: Format = "claude-code"
# what Claude Code names a session's file by (a UUID)
_SESSION_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", re.I)
META_KEY = pi.CLAUDE_CODE_KEY
CUSTOM_PREFIX = "claude-code."
_MESSAGE_TYPES = frozenset({"user", "assistant"})
_KNOWN_TYPES = frozenset(
    {"user", "assistant", "system", "summary", "custom-title", "file-history-snapshot"}
    | {"queue-operation", "attachment", "progress", "last-prompt"}
)
_STOP_REASONS = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "pause_turn": "stop",
    "tool_use": "toolUse",
    "max_tokens": "length",
    "model_context_window_exceeded": "length",
    "refusal": "error",
}
# Claude usage field -> pi usage field
_USAGE_FIELDS = (
    ("input_tokens", "input"),
    ("output_tokens", "output"),
    ("cache_read_input_tokens", "cacheRead"),
    ("cache_creation_input_tokens", "cacheWrite"),
)


@dataclass(frozen=True, slots=True)
class _Line:
    number: int  # 1-based line of the file
    start: int  # byte offset of its first byte
    value: dict[str, Any]


def looks_like_claude_code(path: Path, data: bytes) -> bool:
    """Auto-detection from the file's first lines (whatever their size): Claude Code lines,
    not a pi header. Lines are parsed one at a time, up to the first that decides."""
    values = (v for _, v in pi.iter_objects(pi.first_lines(data, 20)) if isinstance(v, dict))
    try:
        first = next(values, None)
        if first is None or first.get("type") == pi.HEADER_TYPE:
            return False
        for value in itertools.chain([first], values):
            kind = value.get("type")
            if not isinstance(kind, str):
                continue
            if kind in ("user", "assistant", "system") and "uuid" in value and "sessionId" in value:
                return True
            if (kind == "summary" and "leafUuid" in value) or kind in (
                "file-history-snapshot",
                "queue-operation",
            ):
                return True
    except ImportFormatError:  # a line too deep to read decides nothing
        return False
    return False


def parse_claude_code(path: Path, data: bytes) -> ParsedSession:
    """Read a transcript's complete lines into pi-shaped entries (see the module doc).
    Lines that are not JSON objects are skipped, as Claude Code skips them, and reported
    (``ignored_lines``)."""
    raw_lines, complete, incomplete = pi.split_lines(data)
    starts, offset = {}, 0
    for number, raw in raw_lines:
        starts[number] = offset
        offset += len(raw) + 1
    replaced: list[int] = []
    ignored: list[IgnoredLine] = []
    lines = []
    for number, value in pi.iter_objects(raw_lines, path=path, replaced=replaced, ignored=ignored):
        if isinstance(value, dict):  # a typeless object is kept (a custom entry)
            lines.append(_Line(number, starts[number], value))
        else:
            ignored.append(IgnoredLine(number, pi.NOT_AN_OBJECT))
    if lines and not any(_known(line.value.get("type")) for line in lines):
        raise ImportFormatError(str(path), "no line of this file is a Claude Code transcript line")
    converter = _Converter()
    consumed = complete
    for i, line in enumerate(lines):
        nxt = lines[i + 1] if i + 1 < len(lines) else None
        if _is_boundary(line.value) and nxt is None:
            consumed = line.start  # its summary line is still to come
            break
        converter.line(line, nxt)
    return ParsedSession(
        format=FORMAT,
        header=converter.header(path),
        entries=_escaped(converter.entries, raw_lines),
        incomplete_tail=incomplete or consumed < complete,
        consumed_bytes=consumed,
        invalid_utf8_lines=pi.invalid_utf8(path, replaced),
        ignored_lines=pi.ignored_lines(path, ignored),
        # only lines before the transcript's (a summary, a snapshot, a queue operation),
        # which miss the time or the cwd the first turn brings; a file whose turns carry
        # none is what it is
        header_pending=not converter.turns and (converter.started is None or converter.cwd is None),
    )


def _escaped(entries: list[ParsedEntry], raw_lines: list[tuple[int, bytes]]) -> list[ParsedEntry]:
    """The entries the journal cannot hold as they are kept escaped, as such a pi line is
    (``pi.ESCAPED_LINE``), and export writes them back exactly: one holding a lone
    surrogate (a JSON escape: Claude Code's JSON.stringify writes one for a string cut
    inside an emoji; no database text holds one), an image whose data reads as a blob ref
    (the journal would take it for a ref to a stored blob), or a key the journal drops as
    pi's transient state (``partialJson``, ``jsonlEvents``: in a Claude Code line, a tool's
    input or result like any other). Decided on the bytes first: the common case is none."""
    escape = pi.escape_test(raw for _, raw in raw_lines)
    if escape is None:
        return entries
    return [
        ParsedEntry(e.line, pi.escaped_line(e.entry)) if escape(e.entry) else e for e in entries
    ]


def _known(kind: Any) -> bool:
    return isinstance(kind, str) and kind in _KNOWN_TYPES


def _is_boundary(value: dict[str, Any]) -> bool:
    return value.get("type") == "system" and value.get("subtype") == "compact_boundary"


def _is_compact_summary(value: dict[str, Any] | None) -> bool:
    return (
        value is not None
        and value.get("type") == "user"
        and value.get("isCompactSummary") is True
        and _has_content(value)
    )


def _has_content(value: dict[str, Any]) -> bool:
    """A message line pi can map; one without ``message.content`` is kept whole instead."""
    message = value.get("message")
    return isinstance(message, dict) and "content" in message


@dataclass
class _Converter:
    entries: list[ParsedEntry] = field(default_factory=list)
    ids: set[str] = field(default_factory=set)
    aliases: dict[str, str] = field(default_factory=dict)  # uuid -> the entry that stands for it
    leaf: str | None = None
    tool_names: dict[str, str] = field(default_factory=dict)
    usage_seen: dict[str, dict[str, int]] = field(default_factory=dict)
    response_lines: dict[str, int] = field(default_factory=dict)
    session_ids: list[str] = field(default_factory=list)  # in order, the last seen last
    first_session_id: str | None = None
    cwd: str | None = None
    started: str | None = None
    title: str | None = None
    custom_title: str | None = None
    timestamp: str | None = None
    skip_next: bool = False
    turns: bool = False  # a user, assistant or system line was read

    # header ------------------------------------------------------------------------------

    def header(self, path: Path) -> SessionHeader:
        # the file's name as stored text (a name that is not UTF-8 escaped: ``path_text``)
        stem, name = path_text(path.stem), path_text(path.name)
        # Claude Code names a session's file by its id; the lines a resumed session's file
        # begins with carry the ids of the sessions it resumes (the last one last).
        named = _SESSION_ID.fullmatch(stem) is not None
        own = [i for i in self.session_ids if i.lower() == stem.lower()]
        if own:
            session_id = own[0]  # as written inside (a copy may name it in upper case)
        elif named or not self.session_ids:
            session_id = stem  # a resumed session whose own lines are yet to come
        else:
            session_id = self.session_ids[-1]  # a renamed copy, or a subagent's file
        resumed = [i for i in self.session_ids if i.lower() != session_id.lower()]
        # Subagent transcripts (agent-<id>.jsonl) carry their parent's sessionId.
        external = session_id
        subagent = stem != session_id and stem.startswith("agent-")
        if subagent:
            external = f"{session_id}/{stem}"
        # not a pi header: the journal's header event is then built from the fields
        raw = {"source": FORMAT, "sessionId": session_id, "file": name}
        return SessionHeader(
            external_id=external,
            version=3,
            cwd=self.cwd,
            timestamp=self.started,
            title=self.custom_title or self.title,
            raw=raw,
            # the session it resumes: linked as its parent, nothing inherited (as a pi
            # fork's file, this one holds its own copy of the lines)
            parent_id=resumed[-1] if resumed and not subagent else None,
            former_ids=self._former_keys(stem, external),
        )

    def _former_keys(self, stem: str, external: str) -> tuple[str, ...]:
        """The keys an earlier pass over this file may have had: its name, when no line
        then named a session (a file not named by a session id, that began with lines of
        none: a summary); and, until stop 37, the first sessionId in it."""
        keys = [stem, self._first_key(stem)]
        return tuple(dict.fromkeys(k for k in keys if k and k != external))

    def _first_key(self, stem: str) -> str | None:
        """The key a file had when the first sessionId in it decided (before stop 37)."""
        first = self.first_session_id
        if first is None:
            return None
        return f"{first}/{stem}" if stem != first and stem.startswith("agent-") else first

    # lines -------------------------------------------------------------------------------

    def line(self, line: _Line, nxt: _Line | None) -> None:
        if self.skip_next:
            self.skip_next = False
            return
        value = line.value
        self._note_session(value)
        kind = value.get("type")
        self.turns = self.turns or kind in ("user", "assistant", "system")
        if _is_boundary(value):
            summary = nxt if nxt is not None and _is_compact_summary(nxt.value) else None
            self.skip_next = summary is not None
            self._compaction(line, summary)
        elif _is_compact_summary(value):
            self._compaction(None, line)
        elif kind == "assistant" and _has_content(value):
            self._assistant(line)
        elif kind == "user" and _has_content(value):
            self._user(line)
        else:
            self._custom(line)

    def _note_session(self, value: dict[str, Any]) -> None:
        sid = value.get("sessionId")
        if isinstance(sid, str) and self.first_session_id is None:
            self.first_session_id = sid
        if isinstance(sid, str) and (not self.session_ids or self.session_ids[-1] != sid):
            if sid in self.session_ids:
                self.session_ids.remove(sid)
            self.session_ids.append(sid)
        if self.cwd is None and isinstance(value.get("cwd"), str):
            self.cwd = value["cwd"]
        stamp = value.get("timestamp")
        if isinstance(stamp, str):
            self.timestamp = stamp
            self.started = self.started or stamp
        if value.get("type") == "summary" and isinstance(value.get("summary"), str):
            self.title = value["summary"]
        if value.get("type") == "custom-title" and isinstance(value.get("customTitle"), str):
            self.custom_title = value["customTitle"]

    # entry plumbing ------------------------------------------------------------------------

    def _parent(self, uuid: Any) -> str | None:
        if not isinstance(uuid, str):
            return None
        resolved = self.aliases.get(uuid, uuid)
        return resolved if resolved in self.ids else None

    def _unique(self, wanted: Any, line: _Line) -> str:
        entry_id = wanted if isinstance(wanted, str) and wanted else f"cc-line-{line.number}"
        while entry_id in self.ids:  # a uuid repeated in the file (a copied history)
            entry_id = f"{entry_id}~{line.number}"
        return entry_id

    def _emit(self, line: _Line, entry: dict[str, Any]) -> None:
        self.ids.add(entry["id"])
        self.leaf = entry["id"]
        self.entries.append(ParsedEntry(line.number, entry))

    def _base(self, kind: str, entry_id: str, parent: str | None) -> dict[str, Any]:
        return {"type": kind, "id": entry_id, "parentId": parent, "timestamp": self.timestamp}

    def _emit_chain(
        self, line: _Line, messages: list[dict[str, Any]], meta: dict[str, Any]
    ) -> None:
        """One message entry per message; the last keeps the line's uuid and metadata."""
        value = line.value
        uuid = self._unique(value.get("uuid"), line)
        parent = self._parent(value.get("parentUuid"))
        for i, message in enumerate(messages):
            last = i == len(messages) - 1
            entry_id = uuid if last else self._unique(f"{uuid}#{i + 1}", line)
            entry = self._base("message", entry_id, parent)
            entry["message"] = message
            entry[META_KEY] = meta if last else {"partOf": uuid}
            self._emit(line, entry)
            parent = entry_id
        if isinstance(value.get("uuid"), str) and value["uuid"] != uuid:
            self.aliases[value["uuid"]] = uuid

    # user lines ------------------------------------------------------------------------------

    def _user(self, line: _Line) -> None:
        value = line.value
        message = value["message"]
        content = message.get("content")
        millis = _millis(self.timestamp)
        meta = _meta(value)
        messages: list[dict[str, Any]] = []
        if not isinstance(content, list):
            text = content if isinstance(content, str) else json.dumps(content)
            messages.append({"role": "user", "content": text, "timestamp": millis})
        else:
            messages = self._user_blocks(content, millis) or [_empty_user(millis)]
        results = [m for m in messages if m["role"] == "toolResult"]
        if len(results) == 1 and "toolUseResult" in meta:
            results[0]["details"] = meta.pop("toolUseResult")
        _keep_content(meta, messages, content)
        self._emit_chain(line, messages, meta)

    def _user_blocks(self, blocks: list[Any], millis: int) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        pending: list[dict[str, Any]] = []
        for block in blocks:
            if isinstance(block, dict) and block.get("type") == "tool_result":
                if pending:
                    messages.append({"role": "user", "content": pending, "timestamp": millis})
                    pending = []
                messages.append(self._tool_result(block, millis))
                continue
            converted = _user_block(block)
            if converted is not None:
                pending.append(converted)
        if pending:
            messages.append({"role": "user", "content": pending, "timestamp": millis})
        return messages

    def _tool_result(self, block: dict[str, Any], millis: int) -> dict[str, Any]:
        call_id = block.get("tool_use_id")
        raw = block.get("content")
        content: list[dict[str, Any]] = []
        if isinstance(raw, str):
            content = [{"type": "text", "text": raw}]
        elif isinstance(raw, list):
            content = [c for c in map(_user_block, raw) if c is not None]
        return {
            "role": "toolResult",
            "toolCallId": call_id if isinstance(call_id, str) else "",
            "toolName": self.tool_names.get(call_id, "") if isinstance(call_id, str) else "",
            "content": content,
            "isError": block.get("is_error") is True,
            "timestamp": millis,
        }

    # assistant lines ---------------------------------------------------------------------------

    def _assistant(self, line: _Line) -> None:
        value = line.value
        source = value["message"]
        meta = _meta(value)
        blocks = source["content"]
        if isinstance(blocks, str):
            blocks = [{"type": "text", "text": blocks}]
        converted = map(self._assistant_block, blocks if isinstance(blocks, list) else [])
        content = [block for block in converted if block is not None]
        key = _response_key(value)
        if key is not None:
            meta["responseLine"] = self.response_lines.get(key, 0)
            self.response_lines[key] = meta["responseLine"] + 1
        message: dict[str, Any] = {
            "role": "assistant",
            "content": content,
            "api": "anthropic-messages",
            "provider": "anthropic",
            "model": source.get("model") if isinstance(source.get("model"), str) else "",
            "usage": self._usage(key, source.get("usage")),
            "stopReason": _stop_reason(source.get("stop_reason"), content),
            "timestamp": _millis(self.timestamp),
        }
        if value.get("isApiErrorMessage") is True:
            message["stopReason"] = "error"
            message["errorMessage"] = "\n".join(
                b["text"] for b in content if b.get("type") == "text"
            )
        _keep_content(meta, [message], source["content"])
        self._emit_chain(line, [message], meta)

    def _assistant_block(self, block: Any) -> dict[str, Any] | None:
        if not isinstance(block, dict):
            return None
        kind = block.get("type")
        if kind == "text" and isinstance(block.get("text"), str):
            return {"type": "text", "text": block["text"]}
        if kind == "thinking" and isinstance(block.get("thinking"), str):
            out = {"type": "thinking", "thinking": block["thinking"]}
            if isinstance(block.get("signature"), str):
                out["thinkingSignature"] = block["signature"]
            return out
        if kind == "redacted_thinking" and isinstance(block.get("data"), str):
            return {
                "type": "thinking",
                "thinking": "",
                "thinkingSignature": block["data"],
                "redacted": True,
            }
        if kind == "tool_use" and isinstance(block.get("id"), str):
            name = _string(block.get("name"))
            self.tool_names[block["id"]] = name
            arguments = block.get("input")
            return {
                "type": "toolCall",
                "id": block["id"],
                "name": name,
                "arguments": arguments if isinstance(arguments, dict) else {},
            }
        return None

    def _usage(self, key: str | None, raw: Any) -> dict[str, Any]:
        """What this line adds to its response's usage (see the module doc)."""
        now = {
            pi: value if isinstance(value, int) and not isinstance(value, bool) else 0
            for claude, pi in _USAGE_FIELDS
            for value in [raw.get(claude) if isinstance(raw, dict) else None]
        }
        seen = self.usage_seen.get(key, {}) if key is not None else {}
        delta = {f: max(now[f] - seen.get(f, 0), 0) for _, f in _USAGE_FIELDS}
        if key is not None:
            self.usage_seen[key] = {f: max(now[f], seen.get(f, 0)) for _, f in _USAGE_FIELDS}
        return {
            **delta,
            "totalTokens": sum(delta.values()),
            "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0, "total": 0},
        }

    # compactions and the rest ---------------------------------------------------------------

    def _compaction(self, boundary: _Line | None, summary: _Line | None) -> None:
        anchor = summary or boundary
        assert anchor is not None
        bvalue = boundary.value if boundary is not None else {}
        svalue = summary.value if summary is not None else {}
        if summary is not None:
            self._note_session(svalue)
        entry_id = self._unique(svalue.get("uuid") or bvalue.get("uuid"), anchor)
        logical = bvalue.get("logicalParentUuid") if boundary else svalue.get("parentUuid")
        metadata = bvalue.get("compactMetadata")
        metadata = metadata if isinstance(metadata, dict) else {}
        tokens = metadata.get("preTokens")
        entry = self._base("compaction", entry_id, self._parent(logical))
        entry["summary"] = _text_of(svalue.get("message")) if summary else _text_of(bvalue)
        entry["firstKeptEntryId"] = self._first_kept(metadata) or entry_id
        entry["tokensBefore"] = tokens if isinstance(tokens, int) else 0
        kept = _meta(svalue)
        if summary is not None and not _same(entry["summary"], svalue["message"]["content"]):
            kept["message"]["content"] = svalue["message"]["content"]
        entry["details"] = {META_KEY: {"boundary": bvalue or None, "summary": kept}}
        for uuid in (bvalue.get("uuid"), svalue.get("uuid")):
            if isinstance(uuid, str):
                self.aliases[uuid] = entry_id
        self._emit(anchor, entry)

    def _first_kept(self, metadata: dict[str, Any]) -> str | None:
        preserved = metadata.get("preservedMessages")
        uuids = preserved.get("uuids") if isinstance(preserved, dict) else None
        if isinstance(uuids, list) and uuids:
            return self._parent(uuids[0])
        return None

    def _custom(self, line: _Line) -> None:
        value = line.value
        kind = _string(value.get("type")) or "unknown"
        entry_id = self._unique(value.get("uuid"), line)
        parent = self._parent(value["parentUuid"]) if "parentUuid" in value else self.leaf
        entry = self._base("custom", entry_id, parent)
        entry["customType"] = CUSTOM_PREFIX + kind
        entry["data"] = value
        self._emit(line, entry)


# block and field helpers ------------------------------------------------------------------


def _string(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _user_block(block: Any) -> dict[str, Any] | None:
    if isinstance(block, str):
        return {"type": "text", "text": block}
    if not isinstance(block, dict):
        return None
    if block.get("type") == "text" and isinstance(block.get("text"), str):
        return {"type": "text", "text": block["text"]}
    source = block.get("source")
    if block.get("type") == "image" and isinstance(source, dict):
        if source.get("type") == "base64" and isinstance(source.get("data"), str):
            mime = source.get("media_type")
            return {
                "type": "image",
                "data": source["data"],
                "mimeType": mime if isinstance(mime, str) else "application/octet-stream",
            }
    return None


def _empty_user(millis: int) -> dict[str, Any]:
    return {"role": "user", "content": [], "timestamp": millis}


def _meta(value: dict[str, Any]) -> dict[str, Any]:
    """The line without the content pi now holds (``_keep_content`` may put it back)."""
    meta = {k: v for k, v in value.items() if k != "message"}
    message = value.get("message")
    if isinstance(message, dict):
        meta["message"] = {k: v for k, v in message.items() if k != "content"}
    return meta


def _same(a: Any, b: Any) -> bool:
    """The same JSON: key order counts, and 0 is not false nor 1.0 the integer 1."""
    return json.dumps(a) == json.dumps(b)


def _keep_content(meta: dict[str, Any], messages: list[dict[str, Any]], content: Any) -> None:
    """Keep the line's content as written unless its messages map back to it exactly."""
    if not _same(_content_back(messages), content):
        meta["message"]["content"] = content


def line_content(entries: list[dict[str, Any]]) -> Any:
    """A ``user``/``assistant`` line's ``message.content`` as written, from the entries it
    became in journal order (``<uuid>#1`` …, then ``<uuid>``), or a compaction's summary
    line's content from the compaction (see docs/formats.md). An entry kept escaped
    (``pi.ESCAPED_LINE``, for a lone surrogate) is read as the entry it keeps."""
    entries = [pi.line_value(entry) for entry in entries]
    last = entries[-1]
    if last["type"] == "compaction":
        kept = last["details"][META_KEY]["summary"]["message"]
        return kept["content"] if "content" in kept else last["summary"]
    kept = last[META_KEY]["message"]
    if "content" in kept:
        return kept["content"]
    return _content_back([entry["message"] for entry in entries])


def _content_back(messages: list[dict[str, Any]]) -> Any:
    """The Claude Code content a line's pi messages stand for, where the mapping is exact."""
    first = messages[0]
    if len(messages) == 1 and first["role"] == "user" and isinstance(first["content"], str):
        return first["content"]
    blocks: list[Any] = []
    for message in messages:
        if message["role"] == "toolResult":
            blocks.append(_tool_result_back(message))
        else:
            blocks.extend(map(_block_back, message["content"]))
    return blocks


def _tool_result_back(message: dict[str, Any]) -> dict[str, Any]:
    content: Any = [_block_back(block) for block in message["content"]]
    if len(content) == 1 and content[0]["type"] == "text":
        content = content[0]["text"]
    block = {"tool_use_id": message["toolCallId"], "type": "tool_result", "content": content}
    if message["isError"]:
        block["is_error"] = True
    return block


def _block_back(block: dict[str, Any]) -> dict[str, Any]:
    kind = block["type"]
    if kind == "text":
        return {"type": "text", "text": block["text"]}
    if kind == "image":
        source = {"type": "base64", "media_type": block["mimeType"], "data": block["data"]}
        return {"type": "image", "source": source}
    if kind == "toolCall":
        return {
            "type": "tool_use",
            "id": block["id"],
            "name": block["name"],
            "input": block["arguments"],
        }
    if block.get("redacted") is True:
        return {"type": "redacted_thinking", "data": block["thinkingSignature"]}
    thinking = {"type": "thinking", "thinking": block["thinking"]}
    if "thinkingSignature" in block:
        thinking["signature"] = block["thinkingSignature"]
    return thinking


def _response_key(value: dict[str, Any]) -> str | None:
    message = value.get("message")
    message_id = message.get("id") if isinstance(message, dict) else None
    if not isinstance(message_id, str):
        return None
    request = value.get("requestId")
    return f"{message_id}:{request}" if isinstance(request, str) else message_id


def _stop_reason(raw: Any, content: list[dict[str, Any]]) -> str:
    if isinstance(raw, str) and raw in _STOP_REASONS:
        return _STOP_REASONS[raw]
    # Lines written mid-stream have no stop reason yet.
    return "toolUse" if any(b.get("type") == "toolCall" for b in content) else "stop"


def _text_of(message: Any) -> str:
    if not isinstance(message, dict):
        return ""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            b["text"]
            for b in content
            if isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str)
        )
    return ""


def _millis(stamp: Any) -> int:
    """pi's message timestamp (Unix ms); 0 when the line has no readable time. A time
    without an offset is UTC (Claude Code writes UTC, with a ``Z``): never the importing
    machine's zone, so an import gives the same entries wherever it runs."""
    if not isinstance(stamp, str):
        return 0
    try:
        parsed = datetime.fromisoformat(stamp.replace("Z", "+00:00"))
        if parsed.tzinfo is None:
            parsed = parsed.replace(tzinfo=UTC)
        return round(parsed.timestamp() * 1000)
    except (ValueError, OverflowError):
        return 0


register_converter(FORMAT, parse_claude_code, sniff=looks_like_claude_code, priority=40)
