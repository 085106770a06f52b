"""Strings the fold keeps (ids, labels, the name, model, thinking level, custom types, header
fields) come back from ``state`` as they were written when they were stored as blobs (a
U+0000, or over the inline limit): at the head, at an earlier seq and from a snapshot. The
fold and its snapshots keep the refs; a string that merely looks like a ref stays one."""

from __future__ import annotations

from typing import Any

import pytest

from core import SessionStore, Settings
from core.blobs.rehydrate import RehydrateMode
from core.blobs.store import make_ref, sha256_hex
from core.query.snapshots import list_snapshots
from core.query.state import SessionState

BIG = "x" * (16 * 1024 + 1)  # over the default inline limit
USER = "u\x00ser"
ASSISTANT = "a" + BIG
RESULT = "r\x00"
CALL = "call\x00" + BIG
LEVEL = "hi\x00gh"
# looks like a ref, and is the ref of a value the session stores as a blob (the level)
LITERAL = make_ref(sha256_hex(LEVEL.encode()))


def history() -> list[dict[str, Any]]:
    return [
        {
            "type": "session",
            "version": 3,
            "id": "hdr\x00",
            "timestamp": "2026-01-01T00:00:00.000Z",
            "cwd": "/work\x00" + BIG,
            "parentSession": "parent\x00",
        },
        {
            "type": "message",
            "id": USER,
            "parentId": None,
            "message": {"role": "user", "content": "hi"},
        },
        {
            "type": "message",
            "id": ASSISTANT,
            "parentId": USER,
            "message": {
                "role": "assistant",
                "provider": "prov\x00",
                "model": "model\x00" + BIG,
                "content": [
                    {"type": "toolCall", "id": CALL, "name": "bash", "arguments": {"c": "ls"}}
                ],
            },
        },
        {
            "type": "message",
            "id": RESULT,
            "parentId": ASSISTANT,
            "message": {
                "role": "toolResult",
                "toolCallId": CALL,
                "toolName": "bash",
                "content": [{"type": "text", "text": "ok"}],
            },
        },  # seq 4
        {"type": "label", "id": "l1", "parentId": RESULT, "targetId": USER, "label": "n\x00b"},
        {"type": "label", "id": "l2", "parentId": "l1", "targetId": RESULT, "label": LITERAL},
        {"type": "session_info", "id": "i", "parentId": "l2", "name": "title " + BIG},
        {"type": "thinking_level_change", "id": "t", "parentId": "i", "thinkingLevel": LEVEL},
        {
            "type": "model_change",
            "id": "m\x00",
            "parentId": "t",
            "provider": "p\x00",
            "modelId": "m" + BIG,
        },
        {"type": "custom", "id": "c", "parentId": "m\x00", "customType": "ct\x00", "data": {}},
        {
            "type": "compaction",
            "id": "k\x00",
            "parentId": "c",
            "summary": "s",
            "firstKeptEntryId": ASSISTANT,
            "tokensBefore": 5,
        },  # seq 11
    ]


def check_head(state: SessionState) -> None:
    info = state.info
    assert (info.header_session_id, info.cwd, info.parent_session) == (
        "hdr\x00",
        "/work\x00" + BIG,
        "parent\x00",
    )
    assert info.name == info.title == "title " + BIG
    assert info.thinking_level == LEVEL
    assert [c.entry_id for c in info.thinking_level_changes] == ["t"]
    assert info.model is not None
    assert (info.model.entry_id, info.model.provider, info.model.model_id) == (
        "m\x00",
        "p\x00",
        "m" + BIG,
    )
    assert [(c.entry_id, c.provider, c.model_id) for c in info.model_changes] == [
        ("m\x00", "p\x00", "m" + BIG)
    ]
    assert state.labels == {USER: "n\x00b", RESULT: LITERAL}
    assert list(state.custom) == ["ct\x00"]
    assert (state.custom["ct\x00"].custom_type, state.custom["ct\x00"].entry_id) == ("ct\x00", "c")
    assert state.compaction is not None
    assert (state.compaction.entry_id, state.compaction.first_kept_entry_id) == ("k\x00", ASSISTANT)
    assert [m.entry_id for m in state.messages] == ["k\x00", ASSISTANT, RESULT]
    assert state.leaf_id == "k\x00"
    # the branch names its entries as the leaf and the messages do (it gave the refs)
    assert state.branch[-1] == state.leaf_id and state.to_dict()["branch"] == state.branch
    assert USER in state.branch and ASSISTANT in state.branch
    check_tool_call(state)


def check_earlier(state: SessionState) -> None:
    """At seq 4: the model is the assistant message's, and nothing is compacted."""
    assert state.seq == 4
    assert state.info.model is not None
    assert (state.info.model.entry_id, state.info.model.provider, state.info.model.model_id) == (
        ASSISTANT,
        "prov\x00",
        "model\x00" + BIG,
    )
    assert state.info.name is None and state.labels == {}
    assert [m.entry_id for m in state.messages] == [USER, ASSISTANT, RESULT]
    assert state.leaf_id == RESULT
    check_tool_call(state)


def check_tool_call(state: SessionState) -> None:
    [call] = state.tool_calls
    assert (call.id, call.name, call.call_entry_id, call.result_entry_id) == (
        CALL,
        "bash",
        ASSISTANT,
        RESULT,
    )


@pytest.mark.parametrize("mode", [True, "lazy"])
def test_state_gives_the_fold_strings_as_written(store: SessionStore, mode: RehydrateMode) -> None:
    s = store.create_session(tenant_id="acme")
    store.append(s.id, history())
    check_head(store.state(s.id, rehydrate=mode))
    check_earlier(store.state(s.id, at_seq=4, rehydrate=mode))


def test_snapshots_keep_refs_and_state_gives_the_strings(settings: Settings) -> None:
    with SessionStore.from_settings(settings.with_overrides(snapshot_every=2)) as store:
        s = store.create_session(tenant_id="acme")
        store.append(s.id, history())
        for _ in range(2):  # the first read writes the snapshots, the second starts from one
            check_head(store.state(s.id, rehydrate=True))
            check_earlier(store.state(s.id, at_seq=4, rehydrate=True))
        assert [seq for _, seq, _ in list_snapshots(store.engine, s.id)] == [4, 10]
        # what a snapshot holds is the ref, as the journal does
        assert store.state(s.id, rehydrate=False).info.thinking_level == make_ref(
            sha256_hex(LEVEL.encode())
        )
