"""Artifacts stored under ids chosen elsewhere (what an import keeps), on both backends."""

from __future__ import annotations

import pytest

from core.errors import ArtifactError
from core.store import SessionStore


def test_put_keeps_ids_and_counters_continue_after_them(store: SessionStore) -> None:
    session = store.create_session(tenant_id="acme")
    manager = store.artifacts(session.id)
    manager.put_tool_output("7", "bash", "seven\n")
    manager.put_agent_output("3-explore", "# found", jsonl='{"type":"session"}\n')
    manager.put_agent_output("reviewer.critic", "nested")
    assert store.resolve("artifact://7", session_id=session.id).content == "seven\n"
    assert store.resolve("agent://3-explore", session_id=session.id).content == "# found"
    assert store.resolve("agent://reviewer.critic", session_id=session.id).content == "nested"
    assert manager.save("next", "bash") == "8"
    assert manager.allocate_agent_output("explore").id == "4-explore"
    manager.put_tool_output("7", "bash", "seven, longer now\n")  # replaced, not duplicated
    assert store.resolve("artifact://7", session_id=session.id).content == "seven, longer now\n"
    assert [a.local_id for a in manager.list("tool_output")].count("7") == 1


@pytest.mark.parametrize("bad", ["", "-1", "1.5", "٣", "../1", "1 "])
def test_a_tool_output_id_is_a_decimal_number(store: SessionStore, bad: str) -> None:
    manager = store.artifacts(store.create_session(tenant_id="acme").id)
    with pytest.raises(ArtifactError):
        manager.put_tool_output(bad, "bash", "x")


@pytest.mark.parametrize("bad", ["", ".hidden", "a/b", "a..b", "../x", "x" * 201, "a b"])
def test_an_agent_output_id_must_be_a_safe_name(store: SessionStore, bad: str) -> None:
    manager = store.artifacts(store.create_session(tenant_id="acme").id)
    with pytest.raises(ArtifactError):
        manager.put_agent_output(bad, "x")
    assert manager.list() == []
