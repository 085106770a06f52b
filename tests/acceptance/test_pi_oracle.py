"""``state`` equals pi's own ``buildSessionContext`` on every pi fixture, at the leaf and at
a sample of entries, on both backends: the message list, the model and the thinking level."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.store import SessionStore
from tests.fixtures.pi.generate import FIXTURES as GENERATORS
from tests.fixtures.pi.generate import big_tool_output
from tests.pi_support import FIXTURES, as_json, our_context, pi_append, pi_context

TENANT = "acme"


def _compare(store: SessionStore, path: Path, *, every: int = 1) -> int:
    result = store.import_session(path, tenant_id=TENANT)
    entries = store.read(result.session_id)[1:]  # seq 1 is the header
    sample = list(range(0, len(entries), every))
    oracle = pi_context(path, sample)
    assert len(oracle["entries"]) == len(entries)
    leaf = store.state(result.session_id, rehydrate=True)
    assert as_json(our_context(leaf)) == oracle["leaf"]
    for index in sample:
        state = store.state(result.session_id, at_seq=index + 2, rehydrate=True)
        assert state.leaf_id == entries[index].payload["id"]
        assert as_json(our_context(state)) == oracle["at"][str(index)], f"at entry {index}"
    return len(sample)


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_state_equals_pi_context_on_fixture(store: SessionStore, name: str) -> None:
    assert _compare(store, FIXTURES / name) > 5


def test_state_equals_pi_context_with_multi_megabyte_tool_output(
    store: SessionStore, tmp_path: Path
) -> None:
    path = big_tool_output(tmp_path / "big.jsonl", megabytes=3)
    assert path.stat().st_size > 3_000_000
    _compare(store, path)


def test_compaction_keeps_the_model_and_v1_index(store: SessionStore) -> None:
    """The two bugs of issue 17: the model after a compaction, and v1 compactions."""
    result = store.import_session(FIXTURES / "v1.jsonl", tenant_id=TENANT)
    state = store.state(result.session_id)
    assert state.compaction is not None and state.compaction.first_kept_entry_id
    assert state.info.model is not None and state.info.model.model_id == "claude-3-7-sonnet"
    assert state.messages[0].role == "compactionSummary"


def test_round_trip_with_pi(store: SessionStore, tmp_path: Path) -> None:
    """Export; pi opens the file with the same context; pi appends a message through its
    own API; re-import appends exactly that entry, and the contexts still agree."""
    result = store.import_session(FIXTURES / "v3.jsonl", tenant_id=TENANT)
    exported = tmp_path / "exported.jsonl"
    with exported.open("w", encoding="utf-8") as out:
        store.export_session(result.session_id, out)
    ours = store.state(result.session_id, rehydrate=True)
    assert pi_context(exported)["leaf"] == as_json(our_context(ours))

    message = {"role": "user", "content": "Appended by pi.", "timestamp": 1795000099000}
    entry_id = pi_append(exported, message)
    again = store.import_session(exported, tenant_id=TENANT)
    assert (again.session_id, again.appended) == (result.session_id, 1)
    last = store.read(result.session_id, after_seq=ours.seq)
    assert [e.payload["id"] for e in last] == [entry_id]
    assert last[0].payload["message"] == message
    after = store.state(result.session_id, rehydrate=True)
    assert pi_context(exported)["leaf"] == as_json(our_context(after))
