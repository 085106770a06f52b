"""A crash at every step of an import pass leaves nothing doubled and nothing lost: the next
pass completes it. Steps: create session, insert offset row, each append batch, offset
update, fork link. Both backends."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import core.interop.importer as importer
from core.errors import ImportInterrupted, StorageUnavailable
from core.settings import Settings
from core.store import SessionStore
from tests.fixtures.pi.generate import v3_lines, write

TENANT = "acme"
# append:N dies before the N-th batch's append, append:N+ right after it committed
STEPS = [
    "_create",
    "_new_offset",
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


def test_a_write_failure_midway_says_what_was_appended(
    small_batches: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure while writing (here the database, at the second batch) keeps the first
    batch, and the error says so: which session, how many events; the next pass continues."""
    path = tmp_path / "s.jsonl"
    lines = v3_lines()
    write(path, lines)
    with SessionStore.from_settings(small_batches) as store:
        real = store.append
        calls = {"n": 0}

        def append(*args: Any, **kwargs: Any) -> Any:
            calls["n"] += 1
            if calls["n"] == 2:
                raise StorageUnavailable("database", "connection lost")
            return real(*args, **kwargs)

        with monkeypatch.context() as patch:
            patch.setattr(store, "append", append)
            with pytest.raises(ImportInterrupted) as caught:
                store.import_session(path, tenant_id=TENANT)
        failed = caught.value
        session = store.resolve_session(lines[0]["id"], tenant_id=TENANT)
        assert (failed.session_id, failed.appended, failed.skipped) == (session.id, 10, 0)
        assert isinstance(failed.cause, StorageUnavailable)
        assert "connection lost" in failed.message and session.id in failed.message
        assert store.get_session(session.id).head_seq == 10
        result = store.import_session(path, tenant_id=TENANT)
        assert (result.appended, result.skipped) == (len(lines) - 10, 10)


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
