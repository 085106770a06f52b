"""The entry tree links a pi file's entries as pi does, whatever the order of its lines.

pi (``SessionManager``: ``_buildIndex``, ``getBranch``, ``buildSessionContext``) maps every
entry by its id, takes the last line as the leaf and walks ``parentId`` up from it: a
missing, null or empty ``parentId`` is a root, and a parent may come later in the file than
its child. ``pi_tree`` below is that walk; the fold must give the same parent for every
entry, the same branch, context and model, at every prefix of the file, with a snapshot
taken anywhere. ``tests/acceptance/test_pi_oracle.py`` holds the same cases against pi
itself.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.errors import SnapshotFormatError
from core.interop import pi
from core.query import entry_tree
from core.query.entry_tree import EntryTree
from core.query.fold_codec import decode_fold, encode_fold
from core.query.projection import Fold, fold_events
from core.query.state import plan_context
from tests.contract.test_projection import stored

HEADER = {"type": "session", "version": 3, "id": "h", "timestamp": "2026-01-01T00:00:00Z"}


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(entry_tree, "CHUNK", 3)  # so that trees span sealed id chunks
    monkeypatch.setattr(entry_tree, "RECENT", 2)  # and parents need the id index


def pi_tree(entries: list[dict[str, Any]]) -> tuple[dict[str, str | None], list[str]]:
    """(id -> parent id, the branch from the root to the last entry) as pi walks them."""
    by_id = {e.get("id"): e for e in entries}

    def parent(entry: dict[str, Any]) -> dict[str, Any] | None:
        parent_id = entry.get("parentId")
        return by_id.get(parent_id) if parent_id else None

    parents = {}
    for entry in entries:
        found = parent(entry)
        parents[entry["id"]] = None if found is None else found["id"]
    path: list[str] = []
    current: dict[str, Any] | None = entries[-1] if entries else None
    while current is not None:
        path.insert(0, current["id"])
        current = parent(current)
    return parents, path


def pi_model(entries: list[dict[str, Any]], path: list[str]) -> tuple[str, str] | None:
    by_id = {e["id"]: e for e in entries}
    model = None
    for entry in (by_id[i] for i in path):
        if entry.get("type") == "model_change":
            model = (entry["provider"], entry["modelId"])
        elif entry.get("type") == "message" and entry["message"]["role"] == "assistant":
            model = (entry["message"]["provider"], entry["message"]["model"])
    return model


def pi_context_ids(entries: list[dict[str, Any]], path: list[str]) -> list[str]:
    """The ids of the messages in pi's context (``buildSessionContext``), in its order."""
    by_id = {e["id"]: e for e in entries}
    on_path = [by_id[i] for i in path]
    compactions = [i for i, e in enumerate(on_path) if e.get("type") == "compaction"]
    if not compactions:
        return [e["id"] for e in on_path if e.get("type") == "message"]
    at = compactions[-1]
    first_kept = on_path[at].get("firstKeptEntryId")
    kept_from = next((i for i, e in enumerate(on_path[:at]) if e["id"] == first_kept), at)
    chosen = on_path[kept_from:at] + on_path[at + 1 :]
    return [e["id"] for e in chosen if e.get("type") == "message"]


def fold_file(lines: list[dict[str, Any]], split: int) -> Fold:
    """The fold of a pi file of ``lines`` (header first) as imported, through a snapshot
    taken after ``split`` events."""
    data = "\n".join(json.dumps(line) for line in lines).encode() + b"\n"
    parsed = pi.parse(Path("s.jsonl"), data)
    events = stored([pi.header_event(parsed.header), *(e.entry for e in parsed.entries)])
    split %= len(events) + 1
    fold = decode_fold(encode_fold(fold_events(events[:split])))
    return fold_events(events[split:], fold)


def check(entries: list[dict[str, Any]], fold: Fold) -> None:
    tree: EntryTree = fold.tree
    parents, path = pi_tree(entries)
    assert {i: tree.parent_id(i) for i in parents} == parents
    assert tree.branch_ids() == path
    assert tree.path(path[-1]) == path
    plan = plan_context(fold)
    assert [tree.id_at(o) for o in plan.context] == pi_context_ids(entries, path)
    model = None if plan.model is None else (plan.model.provider, plan.model.model_id)
    assert model == pi_model(entries, path)


def entry(kind: str, entry_id: str, parent: Any, n: int) -> dict[str, Any]:
    line: dict[str, Any] = {} if kind == "untyped" else {"type": kind}
    line["id"] = entry_id
    if parent is not ...:
        line["parentId"] = parent
    if kind == "message":
        role = "assistant" if n % 2 else "user"
        line["message"] = {"role": role, "content": f"m{n}", "provider": "p", "model": f"m{n % 3}"}
    elif kind == "model_change":
        line.update(provider="q", modelId=f"x{n}")
    elif kind == "compaction":
        line.update(summary="S", firstKeptEntryId=f"e{n // 2}", tokensBefore=n)
    elif kind == "untyped":
        line["note"] = n
    return line


@st.composite
def shuffled_trees(draw: st.DrawFn) -> list[dict[str, Any]]:
    """A random tree of entries whose lines come in a random order; a root says so in any
    way pi reads as a root (no parentId, null, empty, an id no entry has)."""
    count = draw(st.integers(1, 12))
    parents = [draw(st.none() | st.integers(0, i - 1)) if i else None for i in range(count)]
    order = draw(st.permutations(range(count)))
    kinds = st.sampled_from(["message", "message", "model_change", "compaction", "untyped"])
    roots = st.sampled_from([..., None, "", "absent"])
    lines = []
    for n in order:
        parent = f"e{parents[n]}" if parents[n] is not None else draw(roots)
        lines.append(entry(draw(kinds), f"e{n}", parent, n))
    return lines


@settings(max_examples=300, deadline=None)
@given(shuffled_trees(), st.integers(0, 100))
def test_every_prefix_links_as_pi(entries: list[dict[str, Any]], split: int) -> None:
    """At every prefix of the file (a state at an earlier seq: pi opening the file as it was
    then), with a snapshot taken anywhere."""
    for end in range(1, len(entries) + 1):
        check(entries[:end], fold_file([HEADER, *entries[:end]], split))


def test_a_parent_after_its_child_is_linked_when_it_comes() -> None:
    a = entry("message", "a", None, 0)
    c = entry("message", "c", "b", 1)
    b = entry("message", "b", "a", 2)
    d = entry("message", "d", "c", 3)
    fold = fold_file([HEADER, a, c, b, d], 2)
    assert fold.tree.branch_ids() == ["a", "b", "c", "d"]
    check([a, c, b, d], fold)


@pytest.mark.parametrize("root", [..., None, ""])
def test_an_entry_without_a_parent_is_a_root(root: Any) -> None:
    """pi's ``parentId ? byId.get(parentId) : undefined``: a version-2+ entry without a
    parentId is a root, not the child of the line before it (only version 1 is a chain)."""
    a, b = entry("message", "a", None, 0), entry("message", "b", root, 1)
    fold = fold_file([HEADER, a, b], 0)
    assert fold.tree.branch_ids() == ["b"]
    check([a, b], fold)


def test_an_entry_with_an_empty_id_is_no_parent() -> None:
    a, b = entry("message", "", None, 0), entry("message", "b", "", 1)
    fold = fold_file([HEADER, a, b], 0)
    assert fold.tree.parent_id("b") is None


def test_a_cycle_through_late_parents_is_cut() -> None:
    """pi never finishes walking a cycle; the fold links the entries but the one that
    would close it, which stays a root waiting (every read ends)."""
    a = entry("message", "a", "b", 0)
    b = entry("message", "b", "a", 1)
    c = entry("message", "c", "c", 2)  # its own parent
    fold = fold_file([HEADER, a, b, c], 1)
    assert fold.tree.parent_id("a") is None and fold.tree.parent_id("b") == "a"
    assert fold.tree.parent_id("c") is None
    assert fold.tree.branch_ids() == ["c"]
    decode_fold(encode_fold(fold))


def test_the_lines_kept_as_events_are_in_the_tree() -> None:
    """A line without a string type is kept (``UNTYPED_LINE``) where pi keeps it: as the
    leaf, it is the branch (pi's context is then empty)."""
    a = entry("message", "a", None, 0)
    odd = {"id": "x", "parentId": "a", "type": None}
    fold = fold_file([HEADER, a, odd], 0)
    assert fold.tree.branch_ids() == ["a", "x"]
    assert fold.tree.kind_at(1) == pi.UNTYPED_LINE
    loose = {"no": "type"}
    fold = fold_file([HEADER, a, loose], 0)
    assert fold.tree.branch_ids() == ["seq:3"]
    assert plan_context(fold).context == []


def test_without_a_pi_header_a_parent_appended_later_does_not_adopt_an_entry() -> None:
    """Waiting for a later parent is pi's rule for its files. A session written through the
    store (no pi header) kept an entry with an unknown parent a root for good; the linking
    change made it wait there too, and the appended parent then moved it onto the branch
    (the branch of this session became a, b, c, zzz instead of c, zzz)."""

    def message(entry_id: str, parent: str | None) -> dict[str, Any]:
        return {"type": "message", "id": entry_id, "parentId": parent, "message": {}}

    events = [
        message("a", None),
        message("c", "b"),  # b is appended next: c stays a root
        message("b", "a"),
        message("d", "zzz"),
        message("zzz", "c"),
    ]
    fold = fold_events(stored(events))
    assert fold.tree.branch_ids() == ["c", "zzz"]
    assert not fold.header.links


def test_linking_late_parents_walks_each_path_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """n roots each waiting for the next link of a chain that comes after them: every link
    walked all of its ancestors to rule out a cycle, n²/2 steps (a 16,000-entry file folded
    in 10.7 s, a 100,000-entry one in minutes). Counted in steps, not timed."""
    n = 2000
    waiting = [{"type": "message", "id": f"w{i}", "parentId": f"x{i}"} for i in range(n)]
    chain = [
        {"type": "message", "id": f"x{i}", "parentId": f"x{i - 1}" if i else None} for i in range(n)
    ]
    steps = 0
    real_parent_at = EntryTree.parent_at

    def counted(self: EntryTree, ordinal: int) -> int:
        nonlocal steps
        steps += 1
        return real_parent_at(self, ordinal)

    monkeypatch.setattr(EntryTree, "parent_at", counted)
    fold = fold_events(stored([{**HEADER}, *waiting, *chain]))
    assert fold.header.links and fold.tree.branch_ids() == [f"x{i}" for i in range(n)]
    assert fold.tree.path(f"w{n - 1}")[:2] == ["x0", "x1"]  # each linked under its parent
    assert steps < 20 * n, steps


def test_a_snapshot_with_waiting_entries_in_a_session_that_does_not_wait_is_refused() -> None:
    """Only a pi file's entries wait for a later parent. A snapshot of another session that
    holds waiting entries was folded by a rule that no longer holds (an older fold of the
    same version): decoded, it would adopt them again; it is refused as unreadable, so the
    state is folded from the events instead."""
    waiting = {"type": "message", "id": "c", "parentId": "later", "message": {"role": "user"}}
    fold = fold_events(stored([{**HEADER}, waiting]))
    assert fold.header.links and fold.tree.pending() == {"later": [0]}
    assert decode_fold(encode_fold(fold)).tree.pending() == {"later": [0]}
    fold.header.links = False  # the headerless session an older fold made wait
    with pytest.raises(SnapshotFormatError, match="waiting for a parent"):
        decode_fold(encode_fold(fold))
