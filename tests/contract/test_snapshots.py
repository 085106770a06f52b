"""Snapshots: equivalence with a fold from scratch (hypothesis), lazy writing, versions, and
unusable snapshots: ignored, logged once and replaced (never a failed or different state)."""

from __future__ import annotations

import json
import logging
import struct
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import insert, select, update

from core import SessionStore, Settings, exact_json
from core.db import write_transaction
from core.interop import pi
from core.models import SnapshotRow, utcnow
from core.query import entry_tree
from core.query.fold_codec import decode_fold, encode_fold
from core.query.projection import PROJECTION_VERSION, fold_events
from core.query.snapshots import list_snapshots
from core.query.state import build_state, plan_context
from tests.contract.test_projection import SESSION, SessionBuilder, stored
from tests.support import watch_log

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
    "escaped",
)
_CUT = "\ud83d"  # a lone surrogate: a pi line holding one is kept as its text
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
        elif op == "escaped":
            _escaped(b, n, some_id)
    return b.events


def _escaped(b: SessionBuilder, n: int, some_id: str) -> None:
    """A line holding a lone surrogate, kept as its text (``pi.ESCAPED_LINE``): the fold
    reads it as the line, lone surrogates and all, and a snapshot keeps them."""
    kinds: list[tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]] = [
        (b.user, (f"u{_CUT}{n}",), {}),
        (b.assistant, (f"a{n}",), {"model": f"model{_CUT}{n % 3}", "usage": (n % 9, 1)}),
        (b.label, (some_id, f"l{_CUT}{n}"), {}),
        (b.name, (f"name{_CUT}{n}",), {}),
        (b.model_change, (f"prov{_CUT}", f"model{n % 5}"), {}),
        (b.thinking, (f"high{_CUT}",), {}),
        (b.compaction, (some_id,), {"summary": f"sum{_CUT}{n}", "tokens": n}),
        (b.custom, (f"ext{_CUT}", {"n": n}), {}),
        (b.header, (), {"cwd": f"/w{_CUT}{n}"}),
    ]
    add, args, kwargs = kinds[n % len(kinds)]
    add(*args, **kwargs)
    b.events[-1] = pi.escaped_line(b.events[-1])


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
    at_seqs = [min(at_seq, len(events)) for at_seq in at_seqs]  # past the head is refused
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

        starts = fold_starts(store, monkeypatch)
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


# unusable snapshots -------------------------------------------------------------------


def split(data: bytes) -> tuple[dict[str, Any], bytes]:
    """(metadata, id chunks) of an ``SSF2`` snapshot."""
    assert data[:4] == b"SSF2"
    (length,) = struct.unpack_from("<I", data, 8)
    return json.loads(data[12 : 12 + length]), data[12 + length :]


def signed(meta: dict[str, Any], chunks: bytes) -> bytes:
    """An ``SSF2`` snapshot of this metadata with a checksum that matches (as a faulty
    encoder would write it)."""
    encoded = exact_json.dumps(meta)
    body = struct.pack("<I", len(encoded)) + encoded + chunks
    return b"SSF2" + struct.pack("<I", zlib.crc32(body)) + body


def old_format(meta: dict[str, Any], chunks: bytes) -> bytes:
    """An ``SSF1`` snapshot, as written before the checksum."""
    encoded = exact_json.dumps(meta)
    return b"SSF1" + struct.pack("<I", len(encoded)) + encoded + chunks


corruptions = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 10**6), st.integers(0, 7)),
    st.tuples(st.just("zero"), st.integers(0, 10**6), st.integers(1, 40)),
    st.tuples(st.just("replace"), st.integers(0, 10**6), st.binary(min_size=1, max_size=8)),
    st.tuples(st.just("truncate"), st.integers(0, 10**6), st.just(0)),
    st.tuples(st.just("extend"), st.just(0), st.binary(min_size=1, max_size=8)),
)


def corrupt(data: bytes, corruption: tuple[str, int, Any]) -> bytes:
    kind, at, arg = corruption
    at %= len(data)
    if kind == "flip":
        return data[:at] + bytes([data[at] ^ (1 << arg)]) + data[at + 1 :]
    if kind == "zero":
        return data[:at] + bytes(min(arg, len(data) - at)) + data[at + arg :]
    if kind == "replace":
        return data[:at] + bytes(arg) + data[at + len(arg) :]
    if kind == "truncate":
        return data[:at]
    return data + bytes(arg)


_snapshots = SnapshotRow.__table__  # type: ignore[attr-defined]


def snapshot_at(store: SessionStore, session_id: str, seq: int) -> bytes:
    query = select(_snapshots.c.state).where(
        _snapshots.c.session_id == session_id,
        _snapshots.c.version == PROJECTION_VERSION,
        _snapshots.c.seq == seq,
    )
    with write_transaction(store.engine) as conn:
        return bytes(conn.execute(query).scalar_one())


def store_snapshot(store: SessionStore, session_id: str, seq: int, state: bytes) -> None:
    with write_transaction(store.engine) as conn:
        conn.execute(
            update(_snapshots)
            .where(
                _snapshots.c.session_id == session_id,
                _snapshots.c.version == PROJECTION_VERSION,
                _snapshots.c.seq == seq,
            )
            .values(state=state)
        )


def _changed(change: Callable[[dict[str, Any]], object], encode: Any) -> Any:
    def apply(data: bytes) -> bytes:
        meta, chunks = split(data)
        change(meta)
        return bytes(encode(meta, b"" if meta["id_chunks"] == [] else chunks))

    return apply


def _zero_a_sealed_id_chunk(data: bytes) -> bytes:
    _, chunks = split(data)
    at = len(data) - len(chunks) + 2  # inside the first sealed chunk
    return data[:at] + bytes(8) + data[at + 8 :]


UNUSABLE = {
    "a sealed id chunk zeroed": _zero_a_sealed_id_chunk,
    "truncated": lambda data: data[:-5],
    "garbage": lambda data: b"garbage",
    "old format, by_type a list": _changed(lambda m: m["counters"].update(by_type=[1]), old_format),
    "old format, id_chunks []": _changed(lambda m: m.update(id_chunks=[]), old_format),
    "checksummed, labels a list": _changed(lambda m: m.update(labels=[]), signed),
    "checksummed, another seq's fold": _changed(lambda m: m.update(seq=m["seq"] - 1), signed),
}


def fold_starts(store: SessionStore, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The ``after_seq`` of each read of the store's journal from now on: the first is the
    fold's (later reads fetch the context entries)."""
    starts: list[int] = []
    original = store.journal.iter_events

    def spy(session_id: str, **kwargs: Any) -> Any:
        starts.append(kwargs.get("after_seq", 0))
        return original(session_id, **kwargs)

    monkeypatch.setattr(store.journal, "iter_events", spy)
    return starts


@pytest.fixture
def chunked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(entry_tree, "CHUNK", 4)  # so that 40 events seal id chunks


@pytest.mark.usefixtures("chunked")
@pytest.mark.parametrize("unusable", list(UNUSABLE), ids=list(UNUSABLE))
def test_an_unusable_snapshot_is_ignored_logged_once_and_replaced(
    stores: dict[int, SessionStore],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    unusable: str,
) -> None:
    store, plain = stores[10], stores[0]
    session = store.create_session(tenant_id="acme")
    store.append(session.id, _history(10))  # 40 events
    store.state(session.id, at_seq=20)
    store.state(session.id)
    good = snapshot_at(store, session.id, 40)
    store_snapshot(store, session.id, 40, UNUSABLE[unusable](good))
    starts = fold_starts(store, monkeypatch)
    watch_log(caplog, "core.query.snapshots")
    expected = plain.state(session.id, rehydrate=False)
    assert store.state(session.id, rehydrate=False) == expected
    assert starts[0] == 20  # from the snapshot before it
    assert snapshot_at(store, session.id, 40) == good  # replaced
    starts.clear()
    assert store.state(session.id, rehydrate=False) == expected
    assert starts[0] == 40  # the replacement is used
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, caplog.text
    assert (warnings[0].session_id, warnings[0].seq) == (session.id, 40)  # type: ignore[attr-defined]


@pytest.mark.usefixtures("chunked")
def test_unusable_snapshots_below_the_boundary_are_replaced_too(
    stores: dict[int, SessionStore], caplog: pytest.LogCaptureFixture
) -> None:
    store, plain = stores[10], stores[0]
    session = store.create_session(tenant_id="acme")
    store.append(session.id, _history(10))
    for at_seq in (10, 20):
        store.state(session.id, at_seq=at_seq)
    good = {seq: snapshot_at(store, session.id, seq) for seq in (10, 20)}
    for seq in (10, 20):
        store_snapshot(store, session.id, seq, _zero_a_sealed_id_chunk(good[seq]))
    watch_log(caplog, "core.query.snapshots")
    # from the start: both are passed on the way to the boundary at 30
    assert store.state(session.id, at_seq=39, rehydrate=False) == plain.state(
        session.id, at_seq=39, rehydrate=False
    )
    assert {seq: snapshot_at(store, session.id, seq) for seq in (10, 20)} == good
    assert [s for _, s, _ in list_snapshots(store.engine, session.id)] == [10, 20, 30]
    assert caplog.text.count("ignoring an unreadable snapshot") == 2


@pytest.mark.usefixtures("chunked")
def test_an_old_format_snapshot_is_still_used(
    stores: dict[int, SessionStore],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store, plain = stores[10], stores[0]
    session = store.create_session(tenant_id="acme")
    store.append(session.id, _history(10))
    store.state(session.id, at_seq=20)
    old = old_format(*split(snapshot_at(store, session.id, 20)))
    store_snapshot(store, session.id, 20, old)
    starts = fold_starts(store, monkeypatch)
    watch_log(caplog, "core.query.snapshots")
    assert store.state(session.id, at_seq=29, rehydrate=False) == plain.state(
        session.id, at_seq=29, rehydrate=False
    )
    assert starts[0] == 20
    assert snapshot_at(store, session.id, 20) == old  # kept as it is
    assert "snapshot" not in caplog.text


@settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    ops=histories,
    every=st.integers(min_value=1, max_value=6),
    which=st.integers(min_value=0, max_value=100),
    corruption=corruptions,
    at_seqs=st.lists(st.integers(min_value=0, max_value=60), min_size=1, max_size=4),
)
def test_a_corrupt_stored_snapshot_never_fails_or_changes_a_state(
    stores: dict[int, SessionStore],
    ops: list[tuple[str, int]],
    every: int,
    which: int,
    corruption: tuple[str, int, Any],
    at_seqs: list[int],
) -> None:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(entry_tree, "CHUNK", 3)  # so that histories span sealed id chunks
        patch.setattr(entry_tree, "RECENT", 2)  # and branches need the id index
        plain, snapshotting = stores[0], stores[every]
        session = plain.create_session(tenant_id="acme")
        events = random_history(ops)
        at_seqs = [min(at_seq, len(events)) for at_seq in at_seqs]  # past the head is refused
        if events:
            plain.append(session.id, events)
        for at_seq in (*at_seqs, None):
            snapshotting.state(session.id, at_seq=at_seq)
        seqs = [s for _, s, _ in list_snapshots(plain.engine, session.id)]
        if not seqs:
            return
        seq = seqs[which % len(seqs)]
        good = snapshot_at(plain, session.id, seq)
        store_snapshot(plain, session.id, seq, corrupt(good, corruption))
        for at_seq in (*at_seqs, None, seq):
            with_snapshots = snapshotting.state(session.id, at_seq=at_seq, rehydrate=False)
            assert with_snapshots == plain.state(session.id, at_seq=at_seq, rehydrate=False)
        assert snapshot_at(plain, session.id, seq) == good  # a read at its seq replaced it
