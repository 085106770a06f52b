"""Converted sessions as pi sees them: a Claude Code transcript and an oh-my-pi session,
imported then exported as pi files, open in pi's own ``SessionManager``, and the context pi
builds equals our ``state``, at the leaf and at every entry, on both backends."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from core.query import SessionState
from core.store import SessionStore
from tests.pi_support import as_json, our_context, pi_context

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
CLAUDE = FIXTURES / "claude_code" / "7d3c5e2a-91f4-4b6e-8a0d-2c1f9e8b7a60.jsonl"
OMP = (
    FIXTURES
    / "omp"
    / "agent"
    / "sessions"
    / "--home-dev-webapp--"
    / "2026-01-22T08-30-00-000Z_9b1e4c7a2f3d4e5f.jsonl"
)


def _ours(state: SessionState) -> Any:
    """Our context as JSON, a model's missing fields dropped as JSON.stringify drops pi's
    undefined ones (oh-my-pi's ``model_change`` has ``model``, not provider/modelId)."""
    context = as_json(our_context(state))
    if isinstance(context.get("model"), dict):
        context["model"] = {k: v for k, v in context["model"].items() if v is not None}
    return context


def _compare(store: SessionStore, source: Path, tmp_path: Path) -> None:
    result = store.import_session(source, tenant_id="acme")
    out = io.StringIO()
    store.export_session(result.session_id, out)
    exported = tmp_path / "exported.jsonl"
    exported.write_text(out.getvalue(), encoding="utf-8")
    entries = store.read(result.session_id)[1:]
    sample = list(range(len(entries)))
    oracle = pi_context(exported, sample)
    assert len(oracle["entries"]) == len(entries)
    leaf = store.state(result.session_id, rehydrate=True)
    assert _ours(leaf) == oracle["leaf"]
    for index in sample:
        state = store.state(result.session_id, at_seq=index + 2, rehydrate=True)
        assert _ours(state) == oracle["at"][str(index)], f"at entry {index}"


def test_claude_code_transcript_context_equals_pi(store: SessionStore, tmp_path: Path) -> None:
    _compare(store, CLAUDE, tmp_path)


def test_omp_session_context_equals_pi(store: SessionStore, tmp_path: Path) -> None:
    _compare(store, OMP, tmp_path)
