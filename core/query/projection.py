"""The fold: one session's events, in seq order, into a ``Fold`` (its snapshot codec is
``core.query.fold_codec``).

``apply(fold, event)`` is deterministic and does no I/O. It mutates and returns ``fold``:
copying a state per event would make a rebuild quadratic. What it keeps is bounded by what
must survive arbitrary history (the entry tree, counters, small indexes); message *content*
is not kept. ``core.query.state`` reads the content of the few entries that make up the
current context afterwards, which is what keeps a snapshot of a 100,000-event session small.

Bump ``PROJECTION_VERSION`` whenever the fold or the codec changes meaning: snapshots of
other versions are then ignored and rebuilt lazily.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from core.interop.pi import (
    ESCAPED_LINE,
    HEADER_TYPE,
    UNTYPED_LINE,
    escaped_value,
    info_name,
    js_version,
)
from core.journal.usage import INT64_MAX, INT64_MIN, saturate
from core.query.entry_tree import ROOT, EntryTree
from core.records import StoredEvent

# 5: a line kept as its text for a lone surrogate (``ESCAPED_LINE``) is folded as the line
# it keeps (a message in it is in the context, as in pi's)
# 6: such a line kept escaped (its ``value``) is folded as the line too, however long its
# strings (each one its own blob), and a string the fold keeps is read back from its blob
# under ``value`` too
# 7: a session_info name is read as pi's getSessionName reads it (trimmed; empty, missing
# or null clears it)
PROJECTION_VERSION = 7

# where the ids of a kept line without a string type are (``core.interop.pi.UNTYPED_LINE``)
_UNTYPED_IDS = ("/line/id", "/line/parentId")
# Entries that contribute to the conversation context.
CONTEXT_TYPES = frozenset({"message", "custom_message", "branch_summary"})
# The kind of a line kept as its text whose text the fold could not read (stored as a blob,
# being over the inline limit; only lines stored before version 6, or nested too deeply to
# be kept escaped, are kept as their text): ``core.query.state`` reads it, and shows it if
# its line is of a context type.
UNREAD_LINE = "sessionstore.escaped_line:unread"
CONTEXT_KINDS = CONTEXT_TYPES | {UNREAD_LINE}
# Where in its entry each kind of string the fold keeps is read from. The fold folds events
# as stored, so a string stored as a blob is kept as its ref; ``core.query.state`` gives back
# the original of a ref that the session's manifest places at one of its kind's pointers.
_LINE_STRINGS: dict[str, tuple[str, ...]] = {
    "id": ("/id", "/parentId", "/targetId", "/firstKeptEntryId"),
    "label": ("/label",),
    "name": ("/name",),
    "thinking": ("/thinkingLevel",),
    "provider": ("/provider", "/message/provider"),
    "model": ("/modelId", "/message/model"),
    "custom_type": ("/customType",),
    "role": ("/message/role",),
    "cwd": ("/cwd",),
    "parent_session": ("/parentSession",),
}
# a line kept escaped (``ESCAPED_LINE``) holds its strings under ``value``
FOLD_STRINGS: dict[str, frozenset[str]] = {
    kind: frozenset({*pointers, *(f"/value{p}" for p in pointers)})
    for kind, pointers in _LINE_STRINGS.items()
}
FOLD_STRINGS["id"] |= frozenset(_UNTYPED_IDS)
FOLD_POINTERS = frozenset().union(*FOLD_STRINGS.values())
_NUMBERS = (int, float)
_LO, _HI = INT64_MIN, INT64_MAX


def _number(value: Any) -> int | float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value


@dataclass(slots=True)
class TokenUsage:
    """Token usage summed from message ``usage`` objects."""

    input: int | float = 0
    output: int | float = 0
    cache_read: int | float = 0
    cache_write: int | float = 0
    total_tokens: int | float = 0
    cost: int | float = 0

    def add(self, usage: dict[str, Any]) -> None:
        # Unrolled: it runs for every assistant message of every rebuild. ``type(v) in
        # _NUMBERS`` is ``_number`` without the call; it rejects bool as ``_number`` does.
        value: Any = usage.get("input")
        if type(value) in _NUMBERS:
            self.input += value
        value = usage.get("output")
        if type(value) in _NUMBERS:
            self.output += value
        value = usage.get("cacheRead")
        if type(value) in _NUMBERS:
            self.cache_read += value
        value = usage.get("cacheWrite")
        if type(value) in _NUMBERS:
            self.cache_write += value
        value = usage.get("totalTokens")
        if type(value) in _NUMBERS:
            self.total_tokens += value
        value = usage.get("cost")
        if type(value) is dict:
            value = value.get("total")
        if type(value) in _NUMBERS:
            self.cost += value
        # Sums of numbers stored before (or around) write validation can leave int64: clamp
        # them, so the fold and its snapshots never fail on old data (invariant 11).
        if not (
            _LO <= self.input <= _HI
            and _LO <= self.output <= _HI
            and _LO <= self.cache_read <= _HI
            and _LO <= self.cache_write <= _HI
            and _LO <= self.total_tokens <= _HI
            and _LO <= self.cost <= _HI
        ):
            self._saturate()

    def _saturate(self) -> None:
        for name in ("input", "output", "cache_read", "cache_write", "total_tokens", "cost"):
            setattr(self, name, saturate(getattr(self, name), what=f"usage.{name}"))


@dataclass(slots=True)
class Counters:
    """Totals over every event of the session, on every branch."""

    events: int = 0
    entries: int = 0
    messages: int = 0
    tool_calls: int = 0
    tool_results: int = 0
    tool_errors: int = 0
    by_type: dict[str, int] = field(default_factory=dict)
    by_role: dict[str, int] = field(default_factory=dict)
    usage: TokenUsage = field(default_factory=TokenUsage)


@dataclass(slots=True)
class Header:
    """The ``session`` header event of a coding-agent session file, if one was appended as
    the session's first event (seq 1): the line export writes first, which pi's ``getHeader``
    takes. A ``session`` event anywhere else is kept as a line, not read."""

    seq: int | None = None
    session_id: str | None = None
    version: int | None = None
    cwd: str | None = None
    parent_session: str | None = None
    timestamp: str | None = None
    # pi links every entry by ``parentId`` (the header's version is 2 or more, or no number:
    # pi migrates nothing): a missing, null or empty one is a root, and every event but a
    # ``session`` one is an entry, whatever its type
    links: bool = False


@dataclass(frozen=True, slots=True)
class ModelChange:
    ordinal: int
    entry_id: str
    seq: int
    provider: str | None
    model_id: str | None


@dataclass(frozen=True, slots=True)
class ThinkingLevelChange:
    ordinal: int
    entry_id: str
    seq: int
    level: str | None


@dataclass(frozen=True, slots=True)
class CompactionMark:
    ordinal: int
    first_kept_entry_id: str | None
    tokens_before: int | float | None


@dataclass(slots=True)
class Fold:
    """What the fold keeps between events; everything here goes into a snapshot."""

    seq: int = 0
    tree: EntryTree = field(default_factory=EntryTree)
    counters: Counters = field(default_factory=Counters)
    header: Header = field(default_factory=Header)
    name: str | None = None
    model_changes: list[ModelChange] = field(default_factory=list)
    # What decides the model, as pi's ``buildSessionContext`` does: every ``model_change``,
    # and each assistant message whose model differs from the one in effect on its path
    # (the latest mark on a path then names the path's model; see ``_note_model``).
    models: list[ModelChange] = field(default_factory=list)
    thinking_changes: list[ThinkingLevelChange] = field(default_factory=list)
    compactions: list[CompactionMark] = field(default_factory=list)
    # customType -> ordinals of its ``custom`` entries, oldest first
    custom: dict[str, list[int]] = field(default_factory=dict)
    # targetId -> label
    labels: dict[str, str] = field(default_factory=dict)


# applying events ----------------------------------------------------------------------


def apply(fold: Fold, event: StoredEvent) -> Fold:
    """Fold one event into ``fold`` (in place) and return it. Unknown types only count."""
    if event.seq <= fold.seq:
        raise ValueError(f"events must be applied in seq order: {event.seq} after {fold.seq}")
    fold.seq = event.seq
    counters = fold.counters
    counters.events += 1
    kind = event.type
    counters.by_type[kind] = counters.by_type.get(kind, 0) + 1
    payload = event.payload
    if not isinstance(payload, dict):
        return fold
    handler = _HANDLERS.get(kind)
    if handler is not None:
        handler(fold, payload, event.seq)
    elif _is_entry(fold, payload):
        # an entry type this projection does not know yet: keep its place in the tree
        _add_entry(fold, payload, event.seq, kind)
    return fold


def _is_entry(fold: Fold, payload: dict[str, Any]) -> bool:
    """Whether an event of a type without a handler is an entry of the tree: every one of a
    pi file's lines is; elsewhere, one with an id and a parentId."""
    return fold.header.links or (isinstance(payload.get("id"), str) and "parentId" in payload)


def fold_events(events: Iterable[StoredEvent], fold: Fold | None = None) -> Fold:
    fold = fold if fold is not None else Fold()
    for event in events:
        apply(fold, event)
    return fold


def _add_entry(fold: Fold, payload: dict[str, Any], seq: int, kind: str) -> int:
    """Place an entry in the tree, as pi links it: under the entry with its ``parentId``; a
    root if that is null, empty or unknown. In a pi file (a header of version 2 or more) an
    unknown parent may come later, and the entry waits for it; in any other session an
    entry's place is fixed when it is appended. Without such a header, entries of the known
    types join it even without an id or parentId: version-1 sessions were linear and had
    neither."""
    tree = fold.tree
    entry_id = payload.get("id")
    if not isinstance(entry_id, str):
        entry_id = f"seq:{seq}"
    parent_id = payload.get("parentId", ...)
    fold.counters.entries += 1
    if isinstance(parent_id, str) and parent_id:  # pi: ``parentId ? byId.get(...) : root``
        parent = tree.resolve(parent_id)
        if parent == ROOT and fold.header.links:  # not yet: in a pi file, it waits for it
            return tree.add(entry_id, parent, seq, kind, waits_for=parent_id)
    elif parent_id is ... and not fold.header.links:
        parent = tree.leaf  # no parentId at all: a linear (version-1) entry
    else:
        parent = ROOT
    return tree.add(entry_id, parent, seq, kind)


def _on_message(fold: Fold, payload: dict[str, Any], seq: int) -> None:
    ordinal = _add_entry(fold, payload, seq, "message")
    counters = fold.counters
    counters.messages += 1
    message = payload.get("message")
    if not isinstance(message, dict):
        message = {}
    role = message.get("role")
    role = role if isinstance(role, str) else "unknown"
    counters.by_role[role] = counters.by_role.get(role, 0) + 1
    usage = message.get("usage")
    if isinstance(usage, dict):
        counters.usage.add(usage)
    if role == "assistant":
        _note_model(
            fold,
            ModelChange(
                ordinal,
                fold.tree.id_at(ordinal),
                seq,
                _text(message.get("provider")),
                _text(message.get("model")),
            ),
        )
        content = message.get("content")
        if isinstance(content, list):
            for block in content:
                if isinstance(block, dict) and block.get("type") == "toolCall":
                    counters.tool_calls += 1
    elif role == "toolResult":
        counters.tool_results += 1
        if message.get("isError") is True:
            counters.tool_errors += 1


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


class _Marked(Protocol):
    @property
    def ordinal(self) -> int: ...


_M = TypeVar("_M", bound=_Marked)


def latest_on_branch(tree: EntryTree, marks: list[_M]) -> _M | None:
    """Of ``marks`` (in append order), the one nearest the leaf on the active branch."""
    if not tree.late:  # the branch ascends: the last one on it
        return next((m for m in reversed(marks) if tree.on_branch(m.ordinal)), None)
    found = tree.latest_on_branch([m.ordinal for m in marks])
    return None if found is None else marks[found]


def _note_model(fold: Fold, mark: ModelChange) -> None:
    """Record an assistant message's model if it changes the model of its path. The new
    entry is the leaf, so the active branch is its path. Once a parent came after its child
    every one is recorded: a waiting root linked later takes a path it did not have (what
    was left out before stays redundant: linking only puts entries above a root)."""
    tree = fold.tree
    if not tree.late:  # the branch ascends: the last mark on it is the one in effect
        on_branch = tree.on_branch
        current = next((m for m in reversed(fold.models) if on_branch(m.ordinal)), None)
        if current is not None and (current.provider, current.model_id) == (
            mark.provider,
            mark.model_id,
        ):
            return
    fold.models.append(mark)


def _on_compaction(fold: Fold, payload: dict[str, Any], seq: int) -> None:
    ordinal = _add_entry(fold, payload, seq, "compaction")
    first_kept = _text(payload.get("firstKeptEntryId"))
    index = payload.get("firstKeptEntryIndex")
    if first_kept is None and type(index) is int and 1 <= index <= ordinal:
        # A version-1 compaction names the kept entry by its index among the file's lines,
        # the header being index 0: entry ordinal ``index - 1`` (pi's v1 -> v2 migration).
        first_kept = fold.tree.id_at(index - 1)
    fold.compactions.append(
        CompactionMark(ordinal, first_kept, _number(payload.get("tokensBefore")))
    )


def _on_model_change(fold: Fold, payload: dict[str, Any], seq: int) -> None:
    ordinal = _add_entry(fold, payload, seq, "model_change")
    change = ModelChange(
        ordinal,
        fold.tree.id_at(ordinal),
        seq,
        _text(payload.get("provider")),
        _text(payload.get("modelId")),
    )
    fold.model_changes.append(change)
    fold.models.append(change)


def _on_thinking_level(fold: Fold, payload: dict[str, Any], seq: int) -> None:
    ordinal = _add_entry(fold, payload, seq, "thinking_level_change")
    fold.thinking_changes.append(
        ThinkingLevelChange(
            ordinal, fold.tree.id_at(ordinal), seq, _text(payload.get("thinkingLevel"))
        )
    )


def _on_session_info(fold: Fold, payload: dict[str, Any], seq: int) -> None:
    _add_entry(fold, payload, seq, "session_info")
    name = info_name(payload)  # as pi's getSessionName reads it: trimmed; "" clears it
    if name is not None:  # a name pi cannot trim (pi throws) leaves it
        fold.name = name or None


def _on_label(fold: Fold, payload: dict[str, Any], seq: int) -> None:
    _add_entry(fold, payload, seq, "label")
    target = payload.get("targetId")
    if not isinstance(target, str):
        return
    label = payload.get("label")
    if isinstance(label, str) and label:
        fold.labels[target] = label
    else:
        fold.labels.pop(target, None)  # an empty or absent label clears it


def _on_custom(fold: Fold, payload: dict[str, Any], seq: int) -> None:
    ordinal = _add_entry(fold, payload, seq, "custom")
    custom_type = payload.get("customType")
    fold.custom.setdefault(custom_type if isinstance(custom_type, str) else "", []).append(ordinal)


def _on_header(fold: Fold, payload: dict[str, Any], seq: int) -> None:
    # Only the event at seq 1 is the header, as export writes it (when seq 1 is something
    # else, export builds the header from the session row, and pi reads that one).
    if seq != 1:
        return
    version = payload.get("version")
    fold.header = Header(
        seq=seq,
        session_id=_text(payload.get("id")),
        version=version if isinstance(version, int) and not isinstance(version, bool) else None,
        cwd=_text(payload.get("cwd")),
        parent_session=_text(payload.get("parentSession")),
        timestamp=_text(payload.get("timestamp")),
        links=_links_by_parent_id(payload),
    )


def _links_by_parent_id(header: dict[str, Any]) -> bool:
    """Whether pi reads this header's entries as they are, linked by ``parentId``: pi's
    ``(version ?? 1) < 2`` is false (a version-1 file is made a chain first)."""
    try:
        return not js_version(header) < 2  # NaN too
    except TypeError:  # a version pi cannot compare: pi cannot open the file
        return True


def _on_untyped_line(fold: Fold, payload: dict[str, Any], seq: int) -> None:
    """A line of a pi file without a string type: an entry as the line it keeps is one."""
    line = payload.get("line")
    if not isinstance(line, dict):
        line = {}
    if _is_entry(fold, line):
        _add_entry(fold, line, seq, UNTYPED_LINE)


def _on_escaped_line(fold: Fold, payload: dict[str, Any], seq: int) -> None:
    """A line of a pi file holding a lone surrogate, kept escaped (or as its text): folded
    as the line itself (pi reads it), lone surrogates and all (a snapshot keeps them
    escaped). It has its place in the tree by the ``id`` and ``parentId`` the event holds:
    those of the line without a lone surrogate (no snapshot's id chunk holds one)."""
    line = escaped_value(payload)
    placed = {key: payload[key] for key in _LINKS if key in payload}
    if line is None:  # its text (before version 6) is a blob's ref: read by the state
        if _is_entry(fold, placed):
            _add_entry(fold, placed, seq, UNREAD_LINE)
        return
    kind = line.get("type")
    if kind == HEADER_TYPE:  # the header at seq 1; anywhere else, as any ``session`` line
        _on_header(fold, line, seq)
        return
    handler = _HANDLERS.get(kind) if isinstance(kind, str) and kind not in _KEPT_LINES else None
    if handler is not None:
        handler(fold, {**{k: v for k, v in line.items() if k not in _LINKS}, **placed}, seq)
    elif _is_entry(fold, placed):
        _add_entry(fold, placed, seq, ESCAPED_LINE)


_LINKS = ("id", "parentId")
_KEPT_LINES = frozenset({UNTYPED_LINE, ESCAPED_LINE})


def _plain_entry(kind: str) -> Callable[[Fold, dict[str, Any], int], None]:
    def handler(fold: Fold, payload: dict[str, Any], seq: int) -> None:
        _add_entry(fold, payload, seq, kind)

    return handler


_HANDLERS: dict[str, Callable[[Fold, dict[str, Any], int], None]] = {
    "message": _on_message,
    "compaction": _on_compaction,
    "model_change": _on_model_change,
    "thinking_level_change": _on_thinking_level,
    "session_info": _on_session_info,
    "label": _on_label,
    "custom": _on_custom,
    "custom_message": _plain_entry("custom_message"),
    "branch_summary": _plain_entry("branch_summary"),
    "session": _on_header,
    UNTYPED_LINE: _on_untyped_line,
    ESCAPED_LINE: _on_escaped_line,
}
