"""The snapshot codec refuses what it did not write, when the snapshot is loaded.

- Any change to a snapshot's bytes (bit flips, zeroed or replaced runs, truncation,
  extension; hypothesis) is a ``SnapshotFormatError`` from ``decode_fold``: the checksum
  covers the id chunks, which are decoded lazily, long after the snapshot was accepted.
- A snapshot whose bytes are intact but whose structure is wrong (a faulty encoder: the
  metadata changed and the checksum recomputed), or an old-format snapshot (no checksum)
  changed in any way, is refused or decodes into a fold that folds on, plans and builds a
  state without failing (invariant 11).
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.errors import SnapshotFormatError
from core.query import entry_tree
from core.query.fold_codec import decode_fold, encode_fold
from core.query.projection import Fold, fold_events
from core.query.state import build_state, plan_context
from core.records import StoredEvent
from tests.contract.test_projection import SESSION, stored
from tests.contract.test_snapshots import (
    corrupt,
    corruptions,
    histories,
    old_format,
    random_history,
    signed,
    split,
)


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(entry_tree, "CHUNK", 3)  # so that histories span sealed id chunks
    monkeypatch.setattr(entry_tree, "RECENT", 2)  # and branches need the id index


def resume(fold: Fold, events: list[StoredEvent]) -> None:
    """What a read does with a loaded fold: fold the rest, plan, build, serialize."""
    by_seq = {e.seq: e for e in events}
    fold_events([e for e in events if e.seq > fold.seq], fold)
    state = build_state(fold, plan_context(fold), by_seq, session=SESSION)
    json.dumps(state.to_dict(), default=str)
    assert state.branch == fold.tree.path(fold.tree.leaf_id) if fold.tree.leaf_id else True
    fold.tree.ids()
    fold.tree.kinds()


def cut_history(ops: list[tuple[str, int]], cut: int) -> tuple[list[StoredEvent], Fold]:
    events = stored(random_history(ops))
    return events, fold_events(events[: cut % (len(events) + 1)])


# bytes --------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(ops=histories, cut=st.integers(0, 200), corruption=corruptions)
def test_any_change_to_a_snapshots_bytes_is_refused_when_it_is_decoded(
    ops: list[tuple[str, int]], cut: int, corruption: tuple[str, int, Any]
) -> None:
    _, fold = cut_history(ops, cut)
    data = encode_fold(fold)
    bad = corrupt(data, corruption)
    if bad == data:
        return
    with pytest.raises(SnapshotFormatError):
        decode_fold(bad)


@settings(max_examples=200, deadline=None)
@given(ops=histories, cut=st.integers(0, 200), corruption=corruptions)
def test_a_changed_old_format_snapshot_is_refused_or_never_fails_later(
    ops: list[tuple[str, int]], cut: int, corruption: tuple[str, int, Any]
) -> None:
    events, fold = cut_history(ops, cut)
    data = old_format(*split(encode_fold(fold)))
    assert decode_fold(data) == fold  # the old format is still read
    _decoded_resumes(corrupt(data, corruption), fold.seq, events)


def _decoded_resumes(data: bytes, seq: int, events: list[StoredEvent]) -> None:
    try:
        fold = decode_fold(data)
    except SnapshotFormatError:
        return
    if fold.seq != seq:
        return  # refused by its reader (core.query.snapshots)
    resume(fold, events)


# structure ----------------------------------------------------------------------------

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-3, 40)
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=6,
)


def paths(value: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield prefix
    if isinstance(value, dict):
        for key, item in value.items():
            yield from paths(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from paths(item, (*prefix, index))


def mutate(meta: dict[str, Any], path: tuple[Any, ...], how: str, value: Any) -> None:
    parent: Any = meta
    for step in path[:-1]:
        parent = parent[step]
    key = path[-1]
    if how == "delete":
        del parent[key]
    elif how == "nudge" and type(parent[key]) is int:
        parent[key] += 1 if value else -1
    elif how == "duplicate" and isinstance(parent, list):
        parent.insert(key, parent[key])
    else:
        parent[key] = value


@settings(max_examples=400, deadline=None)
@given(
    ops=histories,
    cut=st.integers(0, 200),
    choice=st.integers(0, 10**6),
    how=st.sampled_from(["delete", "nudge", "duplicate", "replace"]),
    value=json_values,
    checksummed=st.booleans(),
)
def test_a_snapshot_of_the_wrong_structure_is_refused_or_never_fails_later(
    ops: list[tuple[str, int]],
    cut: int,
    choice: int,
    how: str,
    value: Any,
    checksummed: bool,
) -> None:
    events, fold = cut_history(ops, cut)
    meta, chunks = split(encode_fold(fold))
    # The id chunks' sizes are the checksum's to cover: with a matching one, the chunks
    # are not decoded until used. An old-format snapshot has its chunks checked at once.
    candidates = [
        p for p in paths(meta) if p and not (checksummed and p[0] in ("id_chunks", "version"))
    ]
    mutate(meta, candidates[choice % len(candidates)], how, value)
    _decoded_resumes((signed if checksummed else old_format)(meta, chunks), fold.seq, events)


@pytest.mark.parametrize(
    "change",
    [
        lambda m: m.update(id_chunks=[]),
        lambda m: m.update(tree={}),
        lambda m: m["counters"].update(by_type=[1]),
        lambda m: m.update(labels=[]),
        lambda m: m["tree"].update(runs=[0, 0]),
        lambda m: m["tree"].update(parents=[5, 7]),
        lambda m: m["counters"]["usage"].update(cost=float("nan")),
    ],
)
def test_the_reviewers_structural_changes_are_refused(change: Any) -> None:
    # 8 entries: two sealed id chunks and a tail; a branch back to the start at entry 6
    events = stored(
        [
            {"type": "message", "id": f"m{i}", "parentId": f"m{i - 1}" if i % 6 else None}
            for i in range(8)
        ]
    )
    meta, chunks = split(encode_fold(fold_events(events)))
    change(meta)
    for encode in (signed, old_format):
        with pytest.raises(SnapshotFormatError):
            decode_fold(encode(meta, chunks))


def test_a_corrupt_sealed_chunk_of_an_old_format_snapshot_is_refused_when_loaded() -> None:
    events = stored([{"type": "message", "id": f"m{i}", "parentId": None} for i in range(8)])
    meta, chunks = split(encode_fold(fold_events(events)))
    first = meta["id_chunks"][0]
    bad = zlib.compress(b'["m0", "m1"]')  # readable, but not the chunk's 3 ids
    meta["id_chunks"][0] = len(bad)
    with pytest.raises(SnapshotFormatError):
        decode_fold(old_format(meta, bad + chunks[first:]))
    with pytest.raises(SnapshotFormatError):  # and without the checksum's help
        decode_fold(old_format(meta, bytes(len(bad)) + chunks[first:]))
