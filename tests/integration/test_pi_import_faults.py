"""A crash at every step of an import pass leaves nothing doubled and nothing lost: the next
pass completes it. Steps: create session, insert offset row, each append batch, offset
update, fork link. Both backends."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import core.interop.importer as importer
from core.settings import Settings
from core.store import SessionStore
from tests.fixtures.pi.generate import v3_lines, write

TENANT = "acme"
# append:N dies before the N-th batch's append, append:N+ right after it committed
STEPS = [
    "_create",
    "_insert_offset",
    "append:1",
    "append:2",
    "append:1+",
    "append:2+",
    "_save_offset",
    "_link_parent",
]


class Crash(Exception):
    pass


@pytest.fixture
def small_batches(settings: Settings) -> Settings:
    return settings.model_copy(update={"max_batch_events": 10})


@pytest.mark.parametrize("step", STEPS)
def test_crash_at_each_step_then_resume(
    small_batches: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    path = tmp_path / "s.jsonl"
    lines = v3_lines()
    write(path, lines)
    with SessionStore.from_settings(small_batches) as store:
        with monkeypatch.context() as patch:
            _arm(patch, store, step)
            with pytest.raises(Crash):
                store.import_session(path, tenant_id=TENANT)
        result = store.import_session(path, tenant_id=TENANT)
        again = store.import_session(path, tenant_id=TENANT)
        assert again.appended == 0
        events = store.read(result.session_id, rehydrate=True)
        assert [e.payload for e in events] == lines


def test_a_pass_dies_after_a_batch_then_a_direct_append_then_resume(
    small_batches: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batch that committed without its offset update is found by its key, not by the
    head (which a direct append has moved): nothing doubled, nothing skipped."""
    path = tmp_path / "s.jsonl"
    lines = v3_lines()
    write(path, lines)
    with SessionStore.from_settings(small_batches) as store:
        with monkeypatch.context() as patch:
            _arm(patch, store, "append:1+")
            with pytest.raises(Crash):
                store.import_session(path, tenant_id=TENANT)
        session = store.resolve_session(lines[0]["id"], tenant_id=TENANT)
        label = {"type": "label", "id": "L1", "parentId": lines[9]["id"], "label": "mine"}
        store.append(session.id, [label])
        result = store.import_session(path, tenant_id=TENANT)
        assert (result.appended, result.skipped) == (len(lines) - 10, 10)
        events = store.read(session.id, rehydrate=True)
        assert [e.payload for e in events] == [*lines[:10], label, *lines[10:]]


def _arm(patch: pytest.MonkeyPatch, store: SessionStore, step: str) -> None:
    if step.startswith("append:"):
        fail_at = int(step.split(":")[1].rstrip("+"))
        committed = step.endswith("+")
        calls = {"n": 0}
        real = store.append

        def append(*args: Any, **kwargs: Any) -> Any:
            calls["n"] += 1
            if calls["n"] == fail_at:
                if committed:
                    real(*args, **kwargs)
                raise Crash(step)
            return real(*args, **kwargs)

        patch.setattr(store, "append", append)
        return
    real_step = getattr(importer, step)

    def after(*args: Any, **kwargs: Any) -> Any:
        real_step(*args, **kwargs)  # the step happened; the process died right after it
        raise Crash(step)

    patch.setattr(importer, step, after)
