"""``SessionState``: what a session looks like at one seq, built from a ``Fold``.

Two pure steps, with the I/O between them done by ``core.query.snapshots``:

1. ``plan_context(fold)`` picks, from the fold alone, the entries whose content the state
   shows: the conversation context on the active branch (the latest compaction's summary, the
   entries it kept, everything after it; or the whole branch when nothing was compacted), and
   the latest ``custom`` entry of each type on the branch.
2. ``build_state(fold, plan, events, …)`` turns those entries' events into messages and
   pairs tool calls with their results.

Blob refs (``blob:sha256:…``) inside the content stay as they are unless the caller
rehydrated the events before step 2: into exact values, or into ``LazyBlob`` values
(``state()``'s default). ``Message.text`` reads a lazy value, since text is what it was asked
for; ``to_dict()`` reads none: it gives a lazy value as its ref, so that it is the JSON of the
state as stored (what ``rehydrate=False`` and the CLI's ``state --json`` give), and a read of
a state's metadata never reads the blob store.

The strings the fold keeps (ids, labels, the name, the model, …) are refs where they were
stored as blobs, in the fold and in its snapshots alike. They are plain ``str`` fields, so a
rehydrating caller resolves them exactly in either mode (``fold_refs`` says which; there are
none unless such a string held U+0000 or was over the inline limit) and step 2 puts the
originals it is handed (``FoldStrings``) in their place.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, overload

from core.blobs.rehydrate import as_refs, loaded
from core.blobs.store import looks_like_ref
from core.interop.pi import ESCAPED_LINE, escaped_value
from core.query.entry_tree import EntryTree
from core.query.projection import (
    CONTEXT_KINDS,
    CONTEXT_TYPES,
    FOLD_STRINGS,
    UNREAD_LINE,
    CompactionMark,
    Counters,
    Fold,
    ModelChange,
    ThinkingLevelChange,
    fold_events,
    latest_on_branch,
)
from core.records import Session, StoredEvent


def js_truthy(value: Any) -> bool:
    """JavaScript truthiness, which pi's checks use (an empty list or object is true)."""
    if value is None or value is False:
        return False
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value == value and value != 0  # NaN and 0 are false
    if isinstance(value, str):
        return value != ""
    return True


@dataclass(frozen=True, slots=True)
class Message:
    """One message of the context, in the order the model sees it.

    ``role`` is the message's own role (``user``, ``assistant``, ``toolResult``,
    ``bashExecution``, …) or, for context entries that are not messages, ``custom``
    (``custom_message``), ``branchSummary`` or ``compactionSummary``. ``data`` is the message
    object (or the whole entry for the others), unchanged.
    """

    entry_id: str
    seq: int
    role: str
    content: Any
    timestamp: Any
    data: dict[str, Any]

    @property
    def text(self) -> str:
        """The text blocks (or the string content) joined by newlines. An externalized text
        that is a ``LazyBlob`` is loaded (the ref if its blob cannot be read, logged)."""
        content = loaded(self.content)
        if isinstance(content, str):
            return content
        if not isinstance(content, list):
            return ""
        texts = (
            loaded(block.get("text"))
            for block in content
            if isinstance(block, dict) and block.get("type") == "text"
        )
        return "\n".join(text for text in texts if isinstance(text, str))

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON: a ``LazyBlob`` is given as its ref (see the module's docstring)."""
        return {
            "entry_id": self.entry_id,
            "seq": self.seq,
            "role": self.role,
            "content": as_refs(self.content),
            "timestamp": as_refs(self.timestamp),
            "data": as_refs(self.data),
        }


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A ``toolCall`` block of an assistant message, with its ``toolResult`` if there is one.

    A result whose call is not in the context (compacted away) appears with ``call_seq`` None.
    """

    id: str | None
    name: str | None
    arguments: Any
    call_entry_id: str | None
    call_seq: int | None
    result_entry_id: str | None = None
    result_seq: int | None = None
    is_error: bool | None = None
    result: Any = None

    @property
    def done(self) -> bool:
        return self.result_seq is not None

    def to_dict(self) -> dict[str, Any]:
        return _plain(self)


@dataclass(frozen=True, slots=True)
class Compaction:
    """The compaction in effect on the active branch."""

    entry_id: str
    seq: int
    summary: Any
    first_kept_entry_id: str | None
    tokens_before: int | float | None

    def to_dict(self) -> dict[str, Any]:
        return _plain(self)


@dataclass(frozen=True, slots=True)
class CustomEntry:
    entry_id: str
    seq: int
    custom_type: str
    data: Any

    def to_dict(self) -> dict[str, Any]:
        return _plain(self)


def _plain(item: Any) -> dict[str, Any]:
    """A content-bearing record as plain JSON, a ``LazyBlob`` as its ref (``asdict`` would
    deep-copy the blob store along with it)."""
    return {f.name: as_refs(getattr(item, f.name)) for f in dataclasses.fields(item)}


@dataclass(frozen=True, slots=True)
class ArtifactEntry:
    kind: str
    local_id: str
    name: str | None
    tool_type: str | None
    size: int
    media_type: str | None
    created_seq: int
    expires_at: datetime | None
    # complete, or writing / truncated: a tool output whose bytes are not the whole output
    state: str = "complete"

    def to_dict(self) -> dict[str, Any]:
        return {
            **dataclasses.asdict(self),
            "expires_at": self.expires_at.isoformat() if self.expires_at else None,
        }


@dataclass(frozen=True, slots=True)
class SessionProfile:
    """Who and where: the session row, the header event and the settings entries."""

    title: str | None
    name: str | None
    cwd: str | None
    parent_id: str | None
    forked_from_seq: int | None
    parent_session: str | None
    header_session_id: str | None
    header_version: int | None
    model: ModelChange | None
    thinking_level: str | None
    model_changes: list[ModelChange]
    thinking_level_changes: list[ThinkingLevelChange]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True, slots=True)
class SessionState:
    """A session at ``seq``: equal for equal inputs, whether or not a snapshot was used."""

    session_id: str
    tenant_id: str
    seq: int
    info: SessionProfile
    tree: EntryTree
    leaf_id: str | None
    messages: list[Message]
    tool_calls: list[ToolCall]
    compaction: Compaction | None
    labels: dict[str, str]
    custom: dict[str, CustomEntry]
    counters: Counters
    artifacts: list[ArtifactEntry] = field(default_factory=list)

    # the originals of the refs the fold kept (ids stored as blobs), as ``leaf_id`` and the
    # messages give them: the branch names its entries the same way
    strings: FoldStrings = field(default_factory=lambda: FoldStrings(), repr=False, compare=False)

    @property
    def branch(self) -> list[str]:
        """Entry ids of the active branch, root first, ending at the leaf."""
        ids = self.tree.branch_ids()
        return [self.strings.get("id", i) for i in ids] if self.strings.found else ids

    def to_dict(self) -> dict[str, Any]:
        return {
            "session_id": self.session_id,
            "tenant_id": self.tenant_id,
            "seq": self.seq,
            "info": self.info.to_dict(),
            "entries": len(self.tree),
            "leaf_id": self.leaf_id,
            "branch": self.branch,
            "messages": [m.to_dict() for m in self.messages],
            "tool_calls": [t.to_dict() for t in self.tool_calls],
            "compaction": self.compaction.to_dict() if self.compaction else None,
            "labels": self.labels,
            "custom": {k: v.to_dict() for k, v in self.custom.items()},
            "counters": dataclasses.asdict(self.counters),
            "artifacts": [a.to_dict() for a in self.artifacts],
        }


# step 1: plan ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ContextPlan:
    compaction: CompactionMark | None
    context: list[int]  # ordinals, in context order
    custom: dict[str, int]  # customType -> ordinal of its latest entry on the branch
    model: ModelChange | None
    thinking: ThinkingLevelChange | None

    def seqs(self, tree: EntryTree) -> list[int]:
        """The seqs whose events ``build_state`` needs, ascending."""
        ordinals = [*self.context, *self.custom.values()]
        if self.compaction is not None:
            ordinals.append(self.compaction.ordinal)
        return sorted({tree.seq_at(o) for o in ordinals})


def plan_context(fold: Fold) -> ContextPlan:
    tree = fold.tree
    compaction = latest_on_branch(tree, fold.compactions)
    if compaction is None:
        context = tree.select(CONTEXT_KINDS)
    else:  # positions on the branch: a parent may come after its child (``EntryTree``)
        at = tree.position(compaction.ordinal)
        assert at is not None  # the compaction is on the branch
        kept_from = _find_on_branch(tree, compaction.first_kept_entry_id, at)
        kept = [] if kept_from is None else tree.select(CONTEXT_KINDS, kept_from, at)
        context = kept + tree.select(CONTEXT_KINDS, at + 1)
    custom: dict[str, int] = {}
    for custom_type, ordinals in fold.custom.items():
        latest = tree.latest_on_branch(ordinals)
        if latest is not None:
            custom[custom_type] = ordinals[latest]
    return ContextPlan(
        compaction=compaction,
        context=context,
        custom=custom,
        model=latest_on_branch(tree, fold.models),
        thinking=latest_on_branch(tree, fold.thinking_changes),
    )


def _find_on_branch(tree: EntryTree, entry_id: str | None, before: int) -> int | None:
    """The position on the branch below position ``before`` of the entry with this id; the
    kept part is usually short."""
    if entry_id is None:
        return None
    for position, ordinal in zip(
        range(before - 1, -1, -1), tree.branch_reversed(before), strict=False
    ):
        if tree.id_at(ordinal) == entry_id:
            return position
    return None


# step 2: build --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FoldStrings:
    """The originals of refs the fold kept: ref -> (the string, the pointers at which the
    session's manifest places that blob). A ref is given back only where its kind of string
    is read from (``FOLD_STRINGS``): a label that merely looks like the ref of a stored
    thinking level stays the label it is."""

    found: Mapping[str, tuple[str, frozenset[str]]] = field(default_factory=dict)

    @overload
    def get(self, kind: str, value: str) -> str: ...
    @overload
    def get(self, kind: str, value: str | None) -> str | None: ...
    def get(self, kind: str, value: str | None) -> str | None:
        hit = self.found.get(value) if value is not None and self.found else None
        if hit is None or hit[1].isdisjoint(FOLD_STRINGS[kind]):
            return value
        return hit[0]

    def model(self, change: ModelChange) -> ModelChange:
        if not self.found:
            return change
        return dataclasses.replace(
            change,
            entry_id=self.get("id", change.entry_id),
            provider=self.get("provider", change.provider),
            model_id=self.get("model", change.model_id),
        )

    def thinking(self, change: ThinkingLevelChange) -> ThinkingLevelChange:
        if not self.found:
            return change
        return dataclasses.replace(
            change,
            entry_id=self.get("id", change.entry_id),
            level=self.get("thinking", change.level),
        )

    def counters(self, counters: Counters) -> Counters:
        if not self.found:
            return counters
        by_role = {self.get("role", role): n for role, n in counters.by_role.items()}
        return dataclasses.replace(counters, by_role=by_role)


NO_STRINGS = FoldStrings()


def fold_refs(fold: Fold, plan: ContextPlan) -> set[str]:
    """The ref-like strings among what ``build_state`` takes from the fold (what a caller
    resolves into ``FoldStrings``); none, almost always."""
    tree, header = fold.tree, fold.header
    ordinals = [*plan.context, *plan.custom.values()]
    candidates: list[str | None] = [
        fold.name,
        header.session_id,
        header.cwd,
        header.parent_session,
        tree.leaf_id,
        *fold.labels.keys(),
        *fold.labels.values(),
        *plan.custom.keys(),
        *fold.counters.by_role.keys(),
    ]
    if plan.compaction is not None:
        ordinals.append(plan.compaction.ordinal)
        candidates.append(plan.compaction.first_kept_entry_id)
    candidates += (tree.id_at(o) for o in ordinals)
    for model in (*fold.model_changes, *([plan.model] if plan.model else [])):
        candidates += (model.entry_id, model.provider, model.model_id)
    for thinking in fold.thinking_changes:
        candidates += (thinking.entry_id, thinking.level)
    return {c for c in candidates if c is not None and looks_like_ref(c)}


def build_state(
    fold: Fold,
    plan: ContextPlan,
    events: Mapping[int, StoredEvent],
    *,
    session: Session,
    artifacts: list[ArtifactEntry] | None = None,
    strings: FoldStrings = NO_STRINGS,
) -> SessionState:
    """The state, given the events of ``plan.seqs(fold.tree)`` keyed by seq, and the
    originals of ``fold_refs(fold, plan)`` (as stored without them)."""
    tree = fold.tree
    ids = _entry_ids(tree, strings)

    def entry_at(ordinal: int) -> dict[str, Any]:
        return entry_of(events[tree.seq_at(ordinal)])

    messages: list[Message] = []
    compaction = None
    if plan.compaction is not None:
        mark = plan.compaction
        entry = entry_at(mark.ordinal)
        compaction = Compaction(
            ids(mark.ordinal),
            tree.seq_at(mark.ordinal),
            entry.get("summary"),
            strings.get("id", mark.first_kept_entry_id),
            mark.tokens_before,
        )
        messages.append(
            _summary(ids(mark.ordinal), tree.seq_at(mark.ordinal), entry, "compactionSummary")
        )
    for ordinal in plan.context:
        payload = entry_at(ordinal)
        kind: Any = tree.kind_at(ordinal)
        if kind == UNREAD_LINE:  # a kept line the fold could not read: shown by its type
            kind = payload.get("type")
            if kind not in CONTEXT_TYPES:
                continue
        if kind == "branch_summary" and not js_truthy(payload.get("summary")):
            continue  # pi leaves a branch summary without a summary out of the context
        messages.append(_message(kind, tree.seq_at(ordinal), payload, ids(ordinal)))
    custom = {
        strings.get("custom_type", custom_type): CustomEntry(
            ids(o),
            tree.seq_at(o),
            strings.get("custom_type", custom_type),
            entry_at(o).get("data"),
        )
        for custom_type, o in plan.custom.items()
    }
    header = fold.header
    name = strings.get("name", fold.name)
    info = SessionProfile(
        title=name or session.title,
        name=name,
        cwd=strings.get("cwd", header.cwd) or session.cwd,
        parent_id=session.parent_id,
        forked_from_seq=session.forked_from_seq,
        parent_session=strings.get("parent_session", header.parent_session),
        header_session_id=strings.get("id", header.session_id),
        header_version=header.version,
        model=strings.model(plan.model) if plan.model else None,
        thinking_level=strings.get("thinking", plan.thinking.level) if plan.thinking else None,
        model_changes=[strings.model(c) for c in fold.model_changes],
        thinking_level_changes=[strings.thinking(c) for c in fold.thinking_changes],
    )
    return SessionState(
        session_id=session.id,
        tenant_id=session.tenant_id,
        seq=fold.seq,
        info=info,
        tree=tree,
        leaf_id=strings.get("id", tree.leaf_id),
        messages=messages,
        tool_calls=pair_tool_calls(messages),
        compaction=compaction,
        labels={strings.get("id", k): strings.get("label", v) for k, v in fold.labels.items()},
        custom=custom,
        counters=strings.counters(fold.counters),
        artifacts=list(artifacts or ()),
        strings=strings,
    )


def _entry_ids(tree: EntryTree, strings: FoldStrings) -> Callable[[int], str]:
    if not strings.found:
        return tree.id_at
    return lambda ordinal: strings.get("id", tree.id_at(ordinal))


def entry_of(event: StoredEvent) -> dict[str, Any]:
    """The entry an event holds: for a line kept escaped or as its text (``ESCAPED_LINE``),
    the line itself, lone surrogates and all (the pieces of an escaped string, or the text,
    loaded if they are lazy blobs); the payload if that is no object (a blob that could not
    be read)."""
    payload = event.payload
    if event.type == ESCAPED_LINE:
        line = escaped_value(payload, loaded)
        if line is not None:
            return line
    return payload


def _message(kind: Any, seq: int, entry: dict[str, Any], entry_id: str) -> Message:
    if kind == "branch_summary":
        return _summary(entry_id, seq, entry, "branchSummary")
    if kind == "custom_message":
        return Message(entry_id, seq, "custom", entry.get("content"), entry.get("timestamp"), entry)
    message = entry.get("message")
    if not isinstance(message, dict):
        message = {}
    role = loaded(message.get("role"))  # the role of a lazy rehydration too
    return Message(
        entry_id,
        seq,
        role if isinstance(role, str) else "unknown",
        message.get("content"),
        entry.get("timestamp"),
        message,
    )


def _summary(entry_id: str, seq: int, entry: dict[str, Any], role: str) -> Message:
    return Message(entry_id, seq, role, entry.get("summary"), entry.get("timestamp"), entry)


def pair_tool_calls(messages: Iterable[Message]) -> list[ToolCall]:
    """Tool calls in call order, each with its first result; orphan results at their place."""
    calls: dict[str | int, ToolCall] = {}
    for message in messages:
        if message.role == "assistant" and isinstance(message.content, list):
            for block in message.content:
                if isinstance(block, dict) and block.get("type") == "toolCall":
                    # a lazy rehydration's ids are read: they are what calls pair by
                    call_id = loaded(block.get("id"))
                    call_id = call_id if isinstance(call_id, str) else None
                    name = loaded(block.get("name"))
                    key = call_id if call_id is not None and call_id not in calls else len(calls)
                    calls[key] = ToolCall(
                        call_id,
                        name if isinstance(name, str) else None,
                        block.get("arguments"),
                        message.entry_id,
                        message.seq,
                    )
        elif message.role == "toolResult":
            _attach_result(calls, message)
    return list(calls.values())


def _attach_result(calls: dict[str | int, ToolCall], message: Message) -> None:
    call_id = loaded(message.data.get("toolCallId"))
    call_id = call_id if isinstance(call_id, str) else None
    is_error = message.data.get("isError")
    result = {
        "result_entry_id": message.entry_id,
        "result_seq": message.seq,
        "is_error": is_error if isinstance(is_error, bool) else None,
        "result": message.content,
    }
    if call_id is not None:
        call = calls.get(call_id)
        if call is not None and not call.done:
            calls[call_id] = dataclasses.replace(call, **result)
            return
    name = loaded(message.data.get("toolName"))
    key: str | int = call_id if call_id is not None and call_id not in calls else len(calls)
    calls[key] = ToolCall(
        call_id, name if isinstance(name, str) else None, None, None, None, **result
    )


def state_from_events(events: Iterable[StoredEvent], *, session: Session) -> SessionState:
    """A state built in memory from events already at hand (tests, imports, tooling)."""
    by_seq = {event.seq: event for event in events}
    fold = fold_events(by_seq[seq] for seq in sorted(by_seq))
    plan = plan_context(fold)
    return build_state(fold, plan, by_seq, session=session)
