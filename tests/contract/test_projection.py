"""The fold over realistic coding-agent sessions: tree and branches, compaction, tool calls,
model changes, unknown types; in memory, then through the store on both backends."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from core import SessionStore
from core.errors import InvalidArgument
from core.query.entry_tree import EntryTree
from core.query.fold_codec import decode_fold, encode_fold
from core.query.projection import Fold, apply, fold_events
from core.query.state import SessionState, state_from_events
from core.records import Session, StoredEvent

T0 = datetime(2026, 1, 5, 9, 0, tzinfo=UTC)


class SessionBuilder:
    """Builds coding-agent entries the way an agent appends them: each new entry's parent is
    the current leaf, and ``branch_from`` moves the leaf back to an earlier entry."""

    def __init__(self, prefix: str = "e") -> None:
        self.prefix = prefix
        self.events: list[dict[str, Any]] = []
        self.leaf: str | None = None
        self._ids = itertools.count(1)
        self._calls = itertools.count(1)

    def _entry(self, kind: str, **fields: Any) -> str:
        entry_id = f"{self.prefix}{next(self._ids):07x}"
        stamp = T0 + timedelta(seconds=len(self.events))
        self.events.append(
            {
                "type": kind,
                "id": entry_id,
                "parentId": self.leaf,
                "timestamp": stamp.isoformat().replace("+00:00", "Z"),
                **fields,
            }
        )
        self.leaf = entry_id
        return entry_id

    def header(self, cwd: str = "/work/app") -> None:
        self.events.append(
            {"type": "session", "version": 3, "id": "pi-1", "cwd": cwd, "timestamp": "t"}
        )

    def user(self, text: str) -> str:
        return self._entry("message", message={"role": "user", "content": text})

    def assistant(
        self,
        text: str,
        *,
        tools: list[tuple[str, dict[str, Any]]] = (),  # type: ignore[assignment]
        usage: tuple[int, int] = (100, 20),
        model: str = "claude-sonnet-4-5",
    ) -> tuple[str, list[str]]:
        call_ids = [f"call_{next(self._calls)}" for _ in tools]
        content: list[dict[str, Any]] = [
            {"type": "thinking", "thinking": "let me see"},
            {"type": "text", "text": text},
        ]
        content += [
            {"type": "toolCall", "id": cid, "name": name, "arguments": args}
            for cid, (name, args) in zip(call_ids, tools, strict=True)
        ]
        tokens_in, tokens_out = usage
        message = {
            "role": "assistant",
            "content": content,
            "provider": "anthropic",
            "model": model,
            "usage": {
                "input": tokens_in,
                "output": tokens_out,
                "cacheRead": 10,
                "cacheWrite": 5,
                "totalTokens": tokens_in + tokens_out + 15,
                "cost": {"input": 0.25, "output": 0.125, "total": 0.375},
            },
            "stopReason": "toolUse" if tools else "stop",
        }
        return self._entry("message", message=message), call_ids

    def tool_result(self, call_id: str, name: str, output: str, *, error: bool = False) -> str:
        return self._entry(
            "message",
            message={
                "role": "toolResult",
                "toolCallId": call_id,
                "toolName": name,
                "content": [{"type": "text", "text": output}],
                "isError": error,
            },
        )

    def compaction(self, first_kept: str, summary: str = "summary", tokens: int = 5000) -> str:
        return self._entry(
            "compaction", summary=summary, firstKeptEntryId=first_kept, tokensBefore=tokens
        )

    def branch_from(self, entry_id: str | None) -> None:
        self.leaf = entry_id

    def branch_summary(self, from_id: str, summary: str) -> str:
        return self._entry("branch_summary", fromId=from_id, summary=summary)

    def model_change(self, provider: str, model: str) -> str:
        return self._entry("model_change", provider=provider, modelId=model)

    def thinking(self, level: str) -> str:
        return self._entry("thinking_level_change", thinkingLevel=level)

    def name(self, name: str) -> str:
        return self._entry("session_info", name=name)

    def label(self, target: str, label: str | None) -> str:
        return self._entry("label", targetId=target, label=label)

    def custom(self, custom_type: str, data: Any) -> str:
        return self._entry("custom", customType=custom_type, data=data)

    def custom_message(self, custom_type: str, content: str) -> str:
        return self._entry("custom_message", customType=custom_type, content=content, display=True)

    def turn(self, prompt: str, tool: str = "bash") -> list[str]:
        """user -> assistant calling one tool -> result -> assistant answer."""
        first = self.user(prompt)
        _, (call,) = self.assistant(f"running {tool}", tools=[(tool, {"command": "ls"})])
        self.tool_result(call, tool, "file.txt")
        last, _ = self.assistant("done")
        return [first, last]


def stored(events: list[dict[str, Any]], session_id: str = "s-1") -> list[StoredEvent]:
    return [
        StoredEvent(session_id, seq, seq * 10, e["type"], e, T0 + timedelta(seconds=seq))
        for seq, e in enumerate(events, start=1)
    ]


SESSION = Session(
    id="s-1", tenant_id="acme", head_seq=0, created_at=T0, updated_at=T0, title="row title"
)


def build(events: list[dict[str, Any]], upto: int | None = None) -> SessionState:
    return state_from_events(stored(events)[:upto], session=SESSION)


def roles(state: SessionState) -> list[str]:
    return [m.role for m in state.messages]


# in memory ------------------------------------------------------------------------------


def test_linear_session_with_tool_calls_and_usage() -> None:
    b = SessionBuilder()
    b.header()
    b.turn("list files")
    _, (c1, c2) = b.assistant("two at once", tools=[("read", {"p": "a"}), ("grep", {"q": "x"})])
    b.tool_result(c2, "grep", "no match", error=True)
    b.tool_result(c1, "read", "contents")
    state = build(b.events)

    assert roles(state) == [
        "user",
        "assistant",
        "toolResult",
        "assistant",
        "assistant",
        "toolResult",
        "toolResult",
    ]
    assert state.messages[0].text == "list files"
    assert state.messages[3].text == "done"
    assert [(t.name, t.done, t.is_error) for t in state.tool_calls] == [
        ("bash", True, False),
        ("read", True, False),
        ("grep", True, True),
    ]
    assert state.tool_calls[1].result == [{"type": "text", "text": "contents"}]
    assert state.tool_calls[1].arguments == {"p": "a"}
    assert state.branch == [m.entry_id for m in state.messages]
    assert state.leaf_id == state.messages[-1].entry_id
    c = state.counters
    assert (c.events, c.entries, c.messages, c.tool_calls, c.tool_results, c.tool_errors) == (
        8,
        7,
        7,
        3,
        3,
        1,
    )
    assert c.by_role == {"user": 1, "assistant": 3, "toolResult": 3}
    assert c.by_type == {"session": 1, "message": 7}
    assert (c.usage.input, c.usage.output, c.usage.cache_read, c.usage.total_tokens) == (
        300,
        60,
        30,
        405,
    )
    assert c.usage.cost == pytest.approx(3 * 0.375)
    assert state.info.cwd == "/work/app"
    assert state.info.header_version == 3
    assert state.info.title == "row title"
    assert state.info.model is not None and state.info.model.model_id == "claude-sonnet-4-5"


def test_branching_via_parent_id_switches_the_active_branch() -> None:
    b = SessionBuilder()
    root = b.user("start")
    a1, _ = b.assistant("plan A")
    b.user("go with A")
    b.assistant("did A")
    b.branch_from(a1)  # the user goes back to the plan and asks for B
    b2 = b.user("no, do B instead")
    b.assistant("did B")
    state = build(b.events)

    assert [m.text for m in state.messages] == ["start", "plan A", "no, do B instead", "did B"]
    assert state.tree.children(a1) == [b.events[2]["id"], b2]
    assert state.tree.path(b2) == [root, a1, b2]
    assert state.counters.messages == 6  # counters cover every branch

    # going back to the abandoned branch with a summary of the one being left
    b.branch_from(b.events[3]["id"])
    b.branch_summary(b2, "tried B, it broke the build")
    b.user("continue A")
    state = build(b.events)
    assert [m.text or m.content for m in state.messages] == [
        "start",
        "plan A",
        "go with A",
        "did A",
        "tried B, it broke the build",
        "continue A",
    ]
    assert roles(state)[4] == "branchSummary"

    # a new root (the agent reset its leaf): the branch is just the new entry
    b.branch_from(None)
    b.user("fresh start")
    state = build(b.events)
    assert state.branch == [b.leaf]
    assert state.tree.children(None) == [root, b.leaf]


def test_branch_switch_to_a_distant_abandoned_branch() -> None:
    b = SessionBuilder()
    trunk = [b.user(f"t{i}") for i in range(5)]
    side = [b.user(f"side{i}") for i in range(4)]
    b.branch_from(trunk[2])
    other = [b.user(f"other{i}") for i in range(3)]
    b.branch_from(side[1])  # back onto the first side branch, mid-way
    b.user("resume side")
    state = build(b.events)
    assert [m.text for m in state.messages] == [
        "t0",
        "t1",
        "t2",
        "t3",
        "t4",
        "side0",
        "side1",
        "resume side",
    ]
    b.branch_from(other[-1])
    b.user("resume other")
    assert [m.text for m in build(b.events).messages] == [
        "t0",
        "t1",
        "t2",
        "other0",
        "other1",
        "other2",
        "resume other",
    ]


def test_compaction_keeps_summary_then_kept_entries_then_the_rest() -> None:
    b = SessionBuilder()
    b.turn("first task")
    kept = b.user("second task")
    b.assistant("working on it")
    b.compaction(kept, summary="did the first task", tokens=120_000)
    b.user("third task")
    b.assistant("ok")
    state = build(b.events)

    assert roles(state) == ["compactionSummary", "user", "assistant", "user", "assistant"]
    assert state.messages[0].content == "did the first task"
    assert [m.text for m in state.messages[1:]] == [
        "second task",
        "working on it",
        "third task",
        "ok",
    ]
    assert state.compaction is not None
    assert (state.compaction.first_kept_entry_id, state.compaction.tokens_before) == (
        kept,
        120_000,
    )
    assert state.tool_calls == []  # the compacted tool call is not in the context
    assert state.counters.tool_calls == 1  # but it is counted

    # a later compaction supersedes the first
    kept2 = b.user("fourth task")
    b.compaction(kept2, summary="second summary")
    state = build(b.events)
    assert roles(state) == ["compactionSummary", "user"]
    assert state.messages[0].content == "second summary"

    # branching from before the compaction leaves it off the active branch
    b.branch_from(kept)
    b.user("redo")
    state = build(b.events)
    assert state.compaction is None
    assert [m.text for m in state.messages][-3:] == ["done", "second task", "redo"]


def test_compaction_with_unknown_first_kept_entry_keeps_only_what_follows() -> None:
    b = SessionBuilder()
    b.user("a")
    b.compaction("no-such-entry", summary="s")
    b.user("b")
    assert roles(build(b.events)) == ["compactionSummary", "user"]


def test_tool_results_pair_even_when_the_call_was_compacted() -> None:
    b = SessionBuilder()
    b.user("go")
    _, (call,) = b.assistant("calling", tools=[("bash", {})])
    b.compaction("gone", summary="s")  # keeps nothing before it: the call is compacted away
    b.tool_result(call, "bash", "late output")
    (orphan,) = build(b.events).tool_calls
    assert (orphan.id, orphan.name, orphan.call_seq, orphan.done) == (call, "bash", None, True)


def test_model_and_thinking_changes_follow_the_branch() -> None:
    b = SessionBuilder()
    b.user("hi")
    b.model_change("anthropic", "claude-opus-4")
    b.thinking("high")
    fork_point, _ = b.assistant("hello", model="claude-opus-4")
    b.model_change("openai", "gpt-5")
    b.thinking("low")
    state = build(b.events)
    assert state.info.model is not None
    assert (state.info.model.provider, state.info.model.model_id) == ("openai", "gpt-5")
    assert state.info.thinking_level == "low"
    assert [c.model_id for c in state.info.model_changes] == ["claude-opus-4", "gpt-5"]

    b.branch_from(fork_point)
    b.user("back here")
    state = build(b.events)
    assert state.info.model is not None and state.info.model.model_id == "claude-opus-4"
    assert state.info.thinking_level == "high"
    assert len(state.info.model_changes) == 2  # the history keeps every change


def test_model_falls_back_to_the_last_assistant_message() -> None:
    b = SessionBuilder()
    b.user("hi")
    b.assistant("hello", model="claude-haiku-4-5")
    state = build(b.events)
    assert state.info.model is not None
    assert (state.info.model.provider, state.info.model.model_id) == (
        "anthropic",
        "claude-haiku-4-5",
    )


def test_labels_names_custom_entries_and_custom_messages() -> None:
    b = SessionBuilder()
    first = b.user("hi")
    b.name("Refactor auth")
    b.label(first, "checkpoint-1")
    b.custom("todo-ext", {"items": 1})
    b.custom("todo-ext", {"items": 2})
    b.custom("other-ext", [1, 2])
    b.custom_message("reminder", "remember the tests")
    b.label(first, None)  # clears it
    second = b.user("more")
    b.label(second, "important")
    state = build(b.events)
    assert state.info.title == state.info.name == "Refactor auth"
    assert state.labels == {second: "important"}
    assert {k: v.data for k, v in state.custom.items()} == {
        "todo-ext": {"items": 2},
        "other-ext": [1, 2],
    }
    assert roles(state) == ["user", "custom", "user"]
    assert state.messages[1].content == "remember the tests"


def test_unknown_types_and_odd_shapes_never_break_a_rebuild() -> None:
    b = SessionBuilder()
    b.user("hi")
    events = [
        *b.events,
        {"type": "future_entry", "id": "f1", "parentId": b.leaf, "whatever": [1]},
        {"type": "telemetry", "cpu": 0.5},
        {"type": "message", "id": "m9", "parentId": "f1", "message": "not an object"},
        {"type": "message", "id": "m10", "parentId": "m9", "message": {"role": 7, "usage": "x"}},
        {"type": "compaction", "id": "c1", "parentId": "m10", "tokensBefore": "many"},
        {"type": "label", "id": "l1", "parentId": "c1", "targetId": ["x"]},
        {"type": "model_change", "id": "mc", "parentId": "l1", "provider": None},
        {"type": "session", "version": "three"},
    ]
    state = build(events)
    assert state.counters.events == 9
    assert state.counters.by_type["telemetry"] == 1
    assert state.counters.by_role == {"user": 1, "unknown": 2}
    assert state.tree.kind_at(1) == "future_entry"
    assert state.branch == [b.leaf, "f1", "m9", "m10", "c1", "l1", "mc"]
    assert roles(state) == ["compactionSummary"]  # nothing kept: firstKeptEntryId is missing


def test_version_1_entries_without_ids_chain_linearly() -> None:
    events = [
        {"type": "message", "message": {"role": "user", "content": "a"}},
        {
            "type": "message",
            "message": {"role": "assistant", "content": [{"type": "text", "text": "b"}]},
        },
    ]
    state = build(events)
    assert [m.text for m in state.messages] == ["a", "b"]
    assert state.branch == ["seq:1", "seq:2"]


def test_blob_refs_stay_as_refs_in_memory() -> None:
    ref = "blob:sha256:" + "a" * 64
    b = SessionBuilder()
    b._entry("message", message={"role": "user", "content": [{"type": "image", "data": ref}]})
    assert build(b.events).messages[0].content == [{"type": "image", "data": ref}]


def test_state_at_earlier_seqs() -> None:
    b = SessionBuilder()
    b.turn("one")
    b.turn("two")
    for upto in range(len(b.events) + 1):
        state = build(b.events, upto)
        assert state.seq == upto
        assert len(state.messages) == upto


def test_apply_requires_seq_order() -> None:
    fold = Fold()
    (event,) = stored([{"type": "x"}])
    apply(fold, event)
    with pytest.raises(ValueError, match="seq order"):
        apply(fold, event)


def test_fold_codec_round_trips_and_continues_identically() -> None:
    b = SessionBuilder()
    b.header()
    for i in range(30):
        b.turn(f"task {i}")
        if i % 7 == 6:
            b.compaction(b.events[-3]["id"])
        if i % 5 == 4:
            b.branch_from(b.events[-6]["id"])
            b.model_change("p", f"m{i}")
    events = stored(b.events)
    for cut in (0, 1, 17, 60, len(events)):
        restored = decode_fold(encode_fold(fold_events(events[:cut])))
        assert restored == fold_events(events[:cut])
        assert fold_events(events[cut:], restored) == fold_events(events)


def test_entry_tree_branch_runs_stay_compact() -> None:
    tree = EntryTree()
    previous = -1
    for i in range(1000):
        previous = tree.add(f"n{i}", previous, i + 1, "message")
    assert tree.branch_runs() == [0, 999]
    tree.add("x", 499, 1001, "message")
    assert tree.branch_runs() == [0, 499, 1000, 1000]
    assert tree.on_branch(499) and not tree.on_branch(500) and tree.on_branch(1000)


# through the store, on both backends ----------------------------------------------------


def test_store_state_of_a_realistic_session(store: SessionStore) -> None:
    session = store.create_session(tenant_id="acme", title="t", cwd="/srv")
    b = SessionBuilder()
    b.header(cwd="/work/app")
    b.model_change("anthropic", "claude-sonnet-4-5")
    b.turn("fix the bug", tool="edit")
    kept = b.user("and add a test")
    b.assistant("added")
    b.compaction(kept, summary="fixed the bug")
    b.name("Bug fix")
    b.turn("run the suite")
    store.append(session.id, b.events)

    state = store.state(session.id)
    in_memory = build(b.events)
    assert (state.messages, state.tool_calls, state.counters, state.tree) == (
        in_memory.messages,
        in_memory.tool_calls,
        in_memory.counters,
        in_memory.tree,
    )
    assert state.session_id == session.id and state.tenant_id == "acme"
    assert state.seq == len(b.events)
    assert roles(state) == [
        "compactionSummary",
        "user",
        "assistant",
        "user",
        "assistant",
        "toolResult",
        "assistant",
    ]
    assert state.info.title == "Bug fix" and state.info.cwd == "/work/app"
    assert [t.name for t in state.tool_calls] == ["bash"]
    assert state.counters.tool_calls == 2

    earlier = store.state(session.id, at_seq=4)
    assert earlier.seq == 4 and [m.text for m in earlier.messages] == [
        "fix the bug",
        "running edit",
    ]
    assert store.state(session.id, at_seq=len(b.events)).seq == len(b.events)
    # past the head is refused, as export and fork refuse it (it was clamped to the head)
    with pytest.raises(InvalidArgument, match=f"the head \\({len(b.events)}\\), not 10000"):
        store.state(session.id, at_seq=10_000)
