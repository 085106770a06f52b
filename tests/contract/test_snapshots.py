"""Snapshots: equivalence with a fold from scratch (hypothesis), lazy writing, versions."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import insert

from core import SessionStore, Settings
from core.db import write_transaction
from core.models import SnapshotRow, utcnow
from core.query import entry_tree
from core.query.projection import PROJECTION_VERSION, decode_fold, encode_fold, fold_events
from core.query.snapshots import list_snapshots
from core.query.state import build_state, plan_context
from tests.contract.test_projection import SESSION, SessionBuilder, stored

OPS = (
    "user",
    "assistant",
    "result",
    "compaction",
    "branch",
    "branch_summary",
    "model",
    "thinking",
    "label",
    "custom",
    "custom_message",
    "name",
    "unknown",
    "unknown_entry",
    "header",
)
histories = st.lists(
    st.tuples(st.sampled_from(OPS), st.integers(min_value=0, max_value=10**6)),
    min_size=1,
    max_size=50,
)


def random_history(ops: list[tuple[str, int]]) -> list[dict[str, Any]]:
    """Interpret (op, n) pairs as an agent session: ``n`` picks targets among what exists."""
    b = SessionBuilder(prefix="h")
    pending: list[tuple[str, str]] = []
    for op, n in ops:
        ids = [e["id"] for e in b.events if "parentId" in e]
        some_id = ids[n % len(ids)] if ids else "missing"
        if op == "user":
            b.user(f"u{n}")
        elif op == "assistant":
            tools = [("bash", {"n": n}), ("read", {"p": "x"})][: n % 3]
            _, calls = b.assistant(f"a{n}", tools=tools, usage=(n % 1000, n % 97))
            pending += [(c, t[0]) for c, t in zip(calls, tools, strict=True)]
        elif op == "result" and pending:
            call, tool = pending.pop(n % len(pending))
            b.tool_result(call, tool, f"out{n}", error=n % 2 == 0)
        elif op == "compaction":
            b.compaction(some_id, summary=f"sum{n}", tokens=n)
        elif op == "branch":
            b.branch_from(None if not ids or n % (len(ids) + 1) == len(ids) else some_id)
        elif op == "branch_summary":
            b.branch_summary(some_id, f"bs{n}")
        elif op == "model":
            b.model_change("prov", f"model{n % 5}")
        elif op == "thinking":
            b.thinking(["low", "medium", "high"][n % 3])
        elif op == "label":
            b.label(some_id, None if n % 3 == 0 else f"l{n}")
        elif op == "custom":
            b.custom(f"ext{n % 2}", {"n": n})
        elif op == "custom_message":
            b.custom_message("ext", f"cm{n}")
        elif op == "name":
            b.name(f"name{n}")
        elif op == "unknown":
            b.events.append({"type": "x-telemetry", "n": n})
        elif op == "unknown_entry":
            b._entry("future_kind", payload=n)
        elif op == "header":
            b.header(cwd=f"/w{n}")
    return b.events


# the pure fold: any cut, encoded and decoded, continues to the same fold ------------------


@settings(max_examples=150, deadline=None)
@given(ops=histories, cut=st.integers(min_value=0, max_value=200))
def test_snapshot_codec_equivalence_property(ops: list[tuple[str, int]], cut: int) -> None:
    events = stored(random_history(ops))
    cut = cut % (len(events) + 1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(entry_tree, "CHUNK", 3)  # so that histories span sealed id chunks
        patch.setattr(entry_tree, "RECENT", 2)  # and branches need the id index
        direct = fold_events(events)
        resumed = fold_events(events[cut:], decode_fold(encode_fold(fold_events(events[:cut]))))
        assert resumed == direct
        encoded_midway = fold_events(events[:cut])
        encode_fold(encoded_midway)  # the fold that was snapshotted goes on folding
        assert fold_events(events[cut:], encoded_midway) == direct
        by_seq = {e.seq: e for e in events}
        assert build_state(resumed, plan_context(resumed), by_seq, session=SESSION) == build_state(
            direct, plan_context(direct), by_seq, session=SESSION
        )


# through the database, both backends ------------------------------------------------------


@pytest.fixture
def stores(settings: Settings) -> Iterator[dict[int, SessionStore]]:
    """Stores over one database that differ only in ``snapshot_every`` (0: no snapshots)."""
    opened: dict[int, SessionStore] = {}

    class Lazy(dict[int, SessionStore]):
        def __missing__(self, every: int) -> SessionStore:
            store = SessionStore.from_settings(settings.with_overrides(snapshot_every=every))
            opened[every] = self[every] = store
            return store

    yield Lazy()
    for store in opened.values():
        store.close()


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    ops=histories,
    every=st.integers(min_value=1, max_value=6),
    at_seqs=st.lists(st.integers(min_value=0, max_value=60), min_size=1, max_size=6),
)
def test_state_with_and_without_snapshots_is_equal(
    stores: dict[int, SessionStore],
    ops: list[tuple[str, int]],
    every: int,
    at_seqs: list[int],
) -> None:
    events = random_history(ops)
    plain, snapshotting = stores[0], stores[every]
    session = plain.create_session(tenant_id="acme")
    if events:
        plain.append(session.id, events)
    for at_seq in [*at_seqs, None, *at_seqs]:  # the second round reads the snapshots written
        with_snapshots = snapshotting.state(session.id, at_seq=at_seq, rehydrate=False)
        without = plain.state(session.id, at_seq=at_seq, rehydrate=False)
        assert with_snapshots == without
    versions_and_seqs = [(v, s) for v, s, _ in list_snapshots(plain.engine, session.id)]
    assert all(v == PROJECTION_VERSION and s % every == 0 for v, s in versions_and_seqs)
    if len(events) >= every:
        assert versions_and_seqs, "a read past a boundary stores a snapshot"


def _history(turns: int) -> list[dict[str, Any]]:
    b = SessionBuilder()
    for i in range(turns):
        b.turn(f"task {i}")
    return b.events


def test_snapshots_are_written_by_reads_at_the_last_boundary(settings: Settings) -> None:
    with SessionStore.from_settings(settings.with_overrides(snapshot_every=10)) as store:
        session = store.create_session(tenant_id="acme")
        store.append(session.id, _history(10))  # 40 events
        assert list_snapshots(store.engine, session.id) == []  # appends write none

        store.state(session.id, at_seq=25)
        assert [s for _, s, _ in list_snapshots(store.engine, session.id)] == [20]
        store.state(session.id)
        assert [s for _, s, _ in list_snapshots(store.engine, session.id)] == [20, 40]
        store.state(session.id, at_seq=12)  # an earlier point: a boundary below it is stored
        assert [s for _, s, _ in list_snapshots(store.engine, session.id)] == [10, 20, 40]


def test_the_fold_starts_at_the_latest_snapshot_at_or_before_at_seq(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    with SessionStore.from_settings(settings.with_overrides(snapshot_every=10)) as store:
        session = store.create_session(tenant_id="acme")
        store.append(session.id, _history(10))
        store.state(session.id)
        store.state(session.id, at_seq=20)

        starts: list[int] = []
        original = store.journal.iter_events

        def spy(session_id: str, **kwargs: Any) -> Any:
            starts.append(kwargs.get("after_seq", 0))
            return original(session_id, **kwargs)

        monkeypatch.setattr(store.journal, "iter_events", spy)
        store.state(session.id, at_seq=37)
        assert starts[0] == 20  # the fold; later reads fetch the context entries
        starts.clear()
        store.state(session.id)
        assert starts[0] == 40


def test_snapshots_of_another_version_or_unreadable_are_ignored(
    settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    with SessionStore.from_settings(settings.with_overrides(snapshot_every=10)) as store:
        session = store.create_session(tenant_id="acme")
        events = _history(5)
        store.append(session.id, events)
        expected = store.state(session.id, rehydrate=False)

        # a plausible but wrong fold (another history) under another version, and garbage
        # under the current one
        wrong = encode_fold(fold_events(stored(_history(3))[:10]))
        with write_transaction(store.engine) as conn:
            conn.execute(
                insert(SnapshotRow.__table__),  # type: ignore[attr-defined]
                [
                    {
                        "session_id": session.id,
                        "version": PROJECTION_VERSION + 1,
                        "seq": 10,
                        "state": wrong,
                        "created_at": utcnow(),
                    },
                    {
                        "session_id": session.id,
                        "version": PROJECTION_VERSION,
                        "seq": 10,
                        "state": b"garbage",
                        "created_at": utcnow(),
                    },
                ],
            )
        with caplog.at_level("WARNING", logger="core.query.snapshots"):
            assert store.state(session.id, at_seq=15, rehydrate=False) == store.state(
                session.id, at_seq=15, rehydrate=False
            )
            assert store.state(session.id, rehydrate=False) == expected
        assert "unreadable snapshot" in caplog.text


def test_snapshot_every_zero_reads_and_writes_none(settings: Settings) -> None:
    with SessionStore.from_settings(settings.with_overrides(snapshot_every=0)) as store:
        session = store.create_session(tenant_id="acme")
        store.append(session.id, _history(5))
        store.state(session.id)
        assert list_snapshots(store.engine, session.id) == []
