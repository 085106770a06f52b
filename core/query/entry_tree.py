"""The ``id``/``parentId`` entry tree of one session, and its active branch.

Entries are numbered by *ordinal* (0, 1, … in the order they were appended). A parent
almost always has a smaller ordinal than its child, so a root-to-leaf path is strictly
increasing. pi links by id, though, whatever the order of the lines: an entry whose parent
id no entry has yet is a root *waiting* for it (``pending``), and is linked under the entry
that brings that id later (a *late* parent, unless that would close a cycle: pi would
never finish walking one). Once a tree holds a late parent, its active branch is kept as a
plain list (``_path``) instead of the runs below: such files are rare, and only they pay.

The tree goes into every snapshot, and the time to load a snapshot must not grow with the
session (the target is a 100,000-event session within 3x of a 1,000-event one). So nothing
per entry is stored except its id, and ids are loaded lazily:

- parents: an entry's parent is the entry before it, except at branch points and roots,
  which are listed;
- seqs and kinds: runs (a new run starts where ``seq - ordinal`` or the kind changes);
- the active branch: runs of consecutive ordinals (a linear session is one run);
- ids: compressed chunks of ``CHUNK`` ids, each decoded on first use. Appending, and the
  state at the head, touch only the last chunk; looking an id up anywhere (a branch back to an
  old entry) builds the full index once; a parent among the last ``RECENT`` entries is
  found without it.
"""

from __future__ import annotations

import zlib
from bisect import bisect_right
from collections.abc import Iterator
from typing import Any

import orjson

ROOT = -1
CHUNK = 4096
RECENT = 2048  # entries searched for a parent id before building the index


class _Ids:
    """Entry ids by ordinal: sealed compressed chunks plus an uncompressed tail."""

    __slots__ = ("_decoded", "_sealed", "_tail")

    def __init__(self, sealed: list[bytes] | None = None, tail: list[str] | None = None) -> None:
        self._sealed = sealed or []
        self._decoded: dict[int, list[str]] = {}
        self._tail = tail or []

    def __len__(self) -> int:
        return len(self._sealed) * CHUNK + len(self._tail)

    def __getitem__(self, ordinal: int) -> str:
        chunk, offset = divmod(ordinal, CHUNK)
        if chunk < len(self._sealed):
            ids = self._decoded.get(chunk)
            if ids is None:
                ids = self._decoded[chunk] = orjson.loads(zlib.decompress(self._sealed[chunk]))
            return ids[offset]
        return self._tail[ordinal - len(self._sealed) * CHUNK]

    def append(self, entry_id: str) -> None:
        self._tail.append(entry_id)

    def all(self) -> list[str]:
        ids: list[str] = []
        for chunk in range(len(self._sealed)):
            ids += self._decoded.get(chunk) or orjson.loads(zlib.decompress(self._sealed[chunk]))
        return ids + self._tail

    def encode(self) -> list[bytes]:
        """Chunks as stored: full ones are sealed once and then copied as they are."""
        sealed, tail = self._sealed, self._tail
        while len(tail) >= CHUNK:
            self._decoded[len(sealed)] = tail[:CHUNK]
            sealed.append(zlib.compress(orjson.dumps(tail[:CHUNK]), 1))
            tail = tail[CHUNK:]
        self._tail = tail
        return [*sealed, zlib.compress(orjson.dumps(tail), 1)]

    @classmethod
    def decode(cls, chunks: list[bytes], count: int, *, verify: bool) -> _Ids:
        """The ids of ``count`` entries. The tail is decoded now; the sealed chunks on first
        use, unless ``verify`` (a snapshot without a checksum): then each is decoded and
        checked now, since a chunk that failed later would fail the read that touched it."""
        tail = count - (len(chunks) - 1) * CHUNK  # encode seals every full chunk
        if not chunks or not 0 <= tail < CHUNK:
            raise ValueError(f"{len(chunks)} id chunks for {count} entries")
        ids = cls(chunks[:-1], _decode_chunk(chunks[-1], tail))
        if verify:
            for chunk, data in enumerate(ids._sealed):
                ids._decoded[chunk] = _decode_chunk(data, CHUNK)
        return ids


def _decode_chunk(data: bytes, size: int) -> list[str]:
    ids = orjson.loads(zlib.decompress(data))
    if type(ids) is not list or len(ids) != size or not set(map(type, ids)) <= {str}:
        raise ValueError(f"an id chunk is not {size} ids")
    return ids


class _Runs:
    """A value per ordinal that changes rarely: (start ordinal, value) pairs."""

    __slots__ = ("starts", "values")

    def __init__(self, starts: list[int] | None = None, values: list[int] | None = None) -> None:
        self.starts = starts or []
        self.values = values or []

    def at(self, ordinal: int) -> int:
        return self.values[bisect_right(self.starts, ordinal) - 1]

    def append(self, ordinal: int, value: int) -> None:
        if not self.values or self.values[-1] != value:
            self.starts.append(ordinal)
            self.values.append(value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Runs) and (self.starts, self.values) == (
            other.starts,
            other.values,
        )


class EntryTree:
    """An append-only tree of entries; the leaf is the entry appended last."""

    __slots__ = (
        "_count",
        "_hints",
        "_ids",
        "_index",
        "_kind_codes",
        "_kind_names",
        "_kinds",
        "_leaf_id",
        "_parents",
        "_path",
        "_pending",
        "_pos",
        "_runs",
        "_seq_offsets",
    )

    def __init__(self) -> None:
        self._count = 0
        # ordinal -> parent, for entries whose parent is not the entry before them
        self._parents: dict[int, int] = {}
        self._seq_offsets = _Runs()  # seq - ordinal
        self._kinds = _Runs()  # codes into _kind_names
        self._kind_names: list[str] = []
        self._kind_codes: dict[str, int] = {}
        self._ids = _Ids()
        self._leaf_id: str | None = None  # the id every linear append compares with
        self._index: dict[str, int] | None = None
        # the active branch as flat [start0, end0, start1, end1, …] inclusive ordinal runs
        self._runs: list[int] = []
        # parent id -> the roots waiting for an entry with that id, in append order
        self._pending: dict[str, list[int]] = {}
        # once a parent comes after its child: the active branch, root first (then _runs is
        # not kept), and each of its ordinals' position on it
        self._path: list[int] | None = None
        self._pos: dict[int, int] | None = None
        # ordinal -> an ancestor of it nearer its root (``_root_of``'s path compression); not
        # encoded: an entry's ancestors only ever grow, so a hint, once true, stays true
        self._hints: dict[int, int] = {}

    # reading ------------------------------------------------------------------------

    def __len__(self) -> int:
        return self._count

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, EntryTree):
            return NotImplemented
        return (
            self._count == other._count
            and self._parents == other._parents
            and self._seq_offsets == other._seq_offsets
            and self.kinds() == other.kinds()
            and self.branch_runs() == other.branch_runs()
            and self._pending == other._pending
            and self.ids() == other.ids()
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"EntryTree(entries={len(self)}, leaf={self.leaf_id!r})"

    def id_at(self, ordinal: int) -> str:
        return self._ids[ordinal]

    def seq_at(self, ordinal: int) -> int:
        return ordinal + self._seq_offsets.at(ordinal)

    def kind_at(self, ordinal: int) -> str:
        return self._kind_names[self._kinds.at(ordinal)]

    def parent_at(self, ordinal: int) -> int:
        return self._parents.get(ordinal, ordinal - 1)

    def ids(self) -> list[str]:
        """Every entry id, by ordinal."""
        return self._ids.all()

    def kinds(self) -> list[str]:
        return [self.kind_at(o) for o in range(self._count)]

    def find(self, entry_id: str) -> int | None:
        """The ordinal of the most recent entry with this id."""
        if self._index is None:
            # Built once, on the first lookup the leaf shortcut cannot answer.
            ids = self._ids.all()
            self._index = dict(zip(ids, range(len(ids)), strict=True))
        return self._index.get(entry_id)

    @property
    def leaf(self) -> int:
        return self._count - 1

    @property
    def leaf_id(self) -> str | None:
        return self._leaf_id

    def parent_id(self, entry_id: str) -> str | None:
        ordinal = self.find(entry_id)
        if ordinal is None or self.parent_at(ordinal) == ROOT:
            return None
        return self.id_at(self.parent_at(ordinal))

    def children(self, entry_id: str | None) -> list[str]:
        """Ids of the direct children of an entry (``None``: the roots), in append order."""
        target = ROOT if entry_id is None else self.find(entry_id)
        if target is None:
            return []
        found = [o for o, parent in self._parents.items() if parent == target]
        following = target + 1
        if following < self._count and following not in self._parents:
            found.append(following)
        return [self.id_at(o) for o in sorted(found)]

    def path(self, entry_id: str) -> list[str]:
        """Ids from the root down to this entry (empty if the id is unknown)."""
        ordinal = self.find(entry_id)
        chain: list[str] = []
        while ordinal is not None and ordinal != ROOT:
            chain.append(self.id_at(ordinal))
            ordinal = self.parent_at(ordinal)
        chain.reverse()
        return chain

    # the active branch ----------------------------------------------------------------

    def on_branch(self, ordinal: int) -> bool:
        if self._pos is not None:
            return ordinal in self._pos
        runs = self._runs
        i = bisect_right(runs, ordinal) - 1
        # inside a run: ``i`` lands on a start (even index) or on an end equal to ordinal
        return i >= 0 and (i % 2 == 0 or runs[i] == ordinal)

    @property
    def late(self) -> bool:
        """Whether some entry's parent came after it (the branch is then a plain list)."""
        return self._path is not None

    def position(self, ordinal: int) -> int | None:
        """Where an entry is on the active branch (0: the root), None if it is not on it."""
        if self._pos is not None:
            return self._pos.get(ordinal)
        runs, before = self._runs, 0
        for i in range(0, len(runs), 2):
            if runs[i] <= ordinal <= runs[i + 1]:
                return before + ordinal - runs[i]
            before += runs[i + 1] - runs[i] + 1
        return None

    def branch(self, start: int = 0) -> Iterator[int]:
        """Ordinals on the active branch, root to leaf, from position ``start`` on."""
        if self._path is not None:
            yield from self._path[start:]
            return
        runs = self._runs
        for i in range(0, len(runs), 2):
            length = runs[i + 1] - runs[i] + 1
            if start < length:
                yield from range(runs[i] + max(start, 0), runs[i + 1] + 1)
            start -= length

    def branch_reversed(self, before: int) -> Iterator[int]:
        """Ordinals on the active branch before position ``before``, leaf-most first."""
        if self._path is not None:
            yield from reversed(self._path[: max(before, 0)])
            return
        runs, first = self._runs, 0
        starts: list[int] = []
        for i in range(0, len(runs), 2):
            starts.append(first)
            first += runs[i + 1] - runs[i] + 1
        for i in range(len(runs) - 2, -1, -2):
            begin = starts[i // 2]
            if begin < before:
                last = min(runs[i + 1], runs[i] + before - 1 - begin)
                yield from range(last, runs[i] - 1, -1)

    def latest_on_branch(self, ordinals: list[int]) -> int | None:
        """Of ``ordinals`` (ascending), the index of the one latest on the active branch
        (the nearest the leaf), None if none is on it."""
        if self._pos is None:  # the branch ascends: the last one on it
            on_branch = self.on_branch
            return next((i for i in reversed(range(len(ordinals))) if on_branch(ordinals[i])), None)
        pos, found, best = self._pos, None, -1
        for i, ordinal in enumerate(ordinals):
            where = pos.get(ordinal, -1)
            if where > best:
                found, best = i, where
        return found

    def select(self, kinds: frozenset[str], start: int = 0, stop: int | None = None) -> list[int]:
        """Ordinals of entries of these kinds on the active branch, at positions
        ``[start, stop)``."""
        codes = {code for name, code in self._kind_codes.items() if name in kinds}
        count = self._count if stop is None else stop - start
        kind_at = self._kinds.at
        selected: list[int] = []
        for ordinal in self.branch(start):
            count -= 1
            if count < 0:
                break
            if kind_at(ordinal) in codes:
                selected.append(ordinal)
        return selected

    def branch_ids(self) -> list[str]:
        return [self.id_at(o) for o in self.branch()]

    def branch_runs(self) -> list[int]:
        """The active branch as runs of consecutive ordinals, root first."""
        if self._path is None:
            return list(self._runs)
        runs: list[int] = []
        for ordinal in self._path:
            if runs and runs[-1] == ordinal - 1 and self.parent_at(ordinal) == ordinal - 1:
                runs[-1] = ordinal
            else:
                runs.extend((ordinal, ordinal))
        return runs

    def has_pending(self) -> bool:
        """Whether an entry waits for a parent that has not come yet."""
        return bool(self._pending)

    def pending(self) -> dict[str, list[int]]:
        """Parent id -> the roots waiting for an entry with that id."""
        return {k: list(v) for k, v in self._pending.items()}

    # appending ------------------------------------------------------------------------

    def resolve(self, parent_id: str) -> int:
        """Ordinal of a parent id; ``ROOT`` when no entry has it."""
        if parent_id == self._leaf_id:
            return self._count - 1
        if self._index is None:
            # A branch usually goes back a few turns. The most recent occurrence among the
            # last RECENT entries is the most recent overall, so only a miss needs the index.
            oldest = max(0, self._count - RECENT)
            for ordinal in range(self._count - 1, oldest - 1, -1):
                if self._ids[ordinal] == parent_id:
                    return ordinal
            if oldest == 0:
                return ROOT
        found = self.find(parent_id)
        return ROOT if found is None else found

    def add(
        self, entry_id: str, parent: int, seq: int, kind: str, *, waits_for: str | None = None
    ) -> int:
        """Append an entry under ``parent`` (an ordinal or ``ROOT``); it becomes the leaf.
        ``waits_for``: the parent id of a root whose parent no entry has yet; the entry is
        linked under the first entry that brings that id."""
        ordinal = self._count
        code = self._kind_codes.get(kind)
        if code is None:
            code = self._kind_codes[kind] = len(self._kind_names)
            self._kind_names.append(kind)
        self._count += 1
        if parent != ordinal - 1:
            self._parents[ordinal] = parent
        self._seq_offsets.append(ordinal, seq - ordinal)
        self._kinds.append(ordinal, code)
        self._ids.append(entry_id)
        self._leaf_id = entry_id
        if self._index is not None:
            self._index[entry_id] = ordinal
        self._extend_branch(ordinal, parent)
        if self._pending:
            self._link_waiting(ordinal, entry_id)
        if waits_for is not None and parent == ROOT:  # after: an entry never waits for itself
            self._pending.setdefault(waits_for, []).append(ordinal)
        return ordinal

    def _link_waiting(self, ordinal: int, entry_id: str) -> None:
        """Hang the roots waiting for ``entry_id`` under the new entry, as pi links them;
        not one that is an ancestor of it (pi's walk up that path would never end). The new
        entry is the leaf and none of them is on its path: the branch stays as it is."""
        waiting = self._pending.pop(entry_id, None)
        if not waiting:
            return
        # Each waiting entry is a root: the one ancestor of the new entry it can be is the
        # root of the new entry's tree (found in near-constant time, not by walking the
        # path: a file of n entries each waiting for a chain's next link was quadratic).
        root = self._root_of(ordinal)
        for child in waiting:
            if child != root:
                if self._path is None:
                    self._path = list(self.branch())
                    self._pos = {o: i for i, o in enumerate(self._path)}
                self._parents[child] = ordinal

    def _root_of(self, ordinal: int) -> int:
        """The root above ``ordinal`` (itself if it is one), remembering the way up."""
        hints, walked, node = self._hints, [], ordinal
        while True:
            above = hints.get(node)
            if above is None:
                above = self.parent_at(node)
                if above == ROOT:
                    break
            walked.append(node)
            node = above
        for step in walked:
            hints[step] = node
        return node

    def _extend_branch(self, ordinal: int, parent: int) -> None:
        if self._path is not None:
            self._extend_path(ordinal, parent)
            return
        if parent != ROOT and parent == ordinal - 1:
            # the usual append: the parent is the leaf, which always ends the branch
            self._runs[-1] = ordinal
            return
        # A branch switch: walk up from the parent until the path meets the current branch.
        segment: list[int] = []
        node = parent
        while node != ROOT and not self.on_branch(node):
            segment.append(node)
            node = self.parent_at(node)
        self._truncate_branch(node)
        for step in reversed(segment):
            self._append_run(step)
        self._append_run(ordinal)

    def _extend_path(self, ordinal: int, parent: int) -> None:
        """``_extend_branch`` on the plain list of a tree with a late parent."""
        path, pos = self._path, self._pos
        assert path is not None and pos is not None
        segment: list[int] = []
        node = parent
        while node != ROOT and node not in pos:
            segment.append(node)
            node = self.parent_at(node)
        keep = 0 if node == ROOT else pos[node] + 1
        for dropped in path[keep:]:
            del pos[dropped]
        del path[keep:]
        for step in [*reversed(segment), ordinal]:
            pos[step] = len(path)
            path.append(step)

    def _truncate_branch(self, keep_upto: int) -> None:
        """Cut the branch after ordinal ``keep_upto`` (``ROOT``: cut everything)."""
        runs = self._runs
        if keep_upto == ROOT:
            runs.clear()
            return
        i = bisect_right(runs, keep_upto) - 1
        start = i - (i % 2)
        del runs[start + 2 :]
        runs[start + 1] = keep_upto

    def _append_run(self, ordinal: int) -> None:
        # consecutive steps of a path are parent and child, so adjacent ordinals share a run
        runs = self._runs
        if runs and runs[-1] == ordinal - 1:
            runs[-1] = ordinal
        else:
            runs.extend((ordinal, ordinal))

    # snapshot codec ---------------------------------------------------------------------

    def encode(self) -> tuple[dict[str, Any], list[bytes]]:
        """(JSON-able metadata, id chunks) for a snapshot."""
        meta = {
            "count": self._count,
            "parents": [x for pair in self._parents.items() for x in pair],
            "seq_offsets": [self._seq_offsets.starts, self._seq_offsets.values],
            "kinds": [self._kinds.starts, self._kinds.values],
            "kind_names": self._kind_names,
            "runs": self.branch_runs(),
            "pending": [[k, v] for k, v in self._pending.items()],
        }
        return meta, self._ids.encode()

    @classmethod
    def decode(
        cls, meta: dict[str, Any], chunks: list[bytes], *, verify_ids: bool = False
    ) -> EntryTree:
        """The tree ``encode`` gave ``meta`` and ``chunks`` for. Raises ``ValueError`` (or
        ``TypeError``, ``KeyError``) for anything ``encode`` never writes, so that a tree
        that decodes can be read and appended to without failing (invariant 11)."""
        tree = cls()
        count = tree._count = _count(meta["count"])
        pairs = _ints(meta["parents"])
        tree._parents = dict(zip(pairs[::2], pairs[1::2], strict=True))
        for child, parent in tree._parents.items():
            _check(0 <= child < count and ROOT <= parent < count, "a parent")
            _check(parent not in (child - 1, child), "a parent")
        tree._check_acyclic()
        tree._seq_offsets = _runs_of(meta["seq_offsets"], count)
        offsets = tree._seq_offsets.values
        # seqs start at 1 and grow with the ordinal: seq - ordinal never decreases
        _check(not offsets or (offsets[0] >= 1 and _increasing(offsets)), "the entries' seqs")
        tree._kinds = _runs_of(meta["kinds"], count)
        names = meta["kind_names"]
        _check(type(names) is list and set(map(type, names)) <= {str}, "the kinds' names")
        tree._kind_names = list(names)
        tree._kind_codes = {name: i for i, name in enumerate(tree._kind_names)}
        _check(len(tree._kind_codes) == len(names), "the kinds' names")
        codes = tree._kinds.values
        _check(not codes or (min(codes) >= 0 and max(codes) < len(names)), "a kind")
        tree._runs = _ints(meta["runs"])
        if any(parent > child for child, parent in tree._parents.items()):
            tree._path = list(tree._runs_ordinals())
            tree._pos = {o: i for i, o in enumerate(tree._path)}
            _check(len(tree._pos) == len(tree._path), "the branch")
        tree._pending = _pending_of(meta.get("pending", []), tree)
        tree._check_branch()
        tree._ids = _Ids.decode(chunks, count, verify=verify_ids)
        tree._leaf_id = tree._ids[count - 1] if count else None
        return tree

    def _runs_ordinals(self) -> Iterator[int]:
        runs = self._runs
        _check(len(runs) % 2 == 0, "the branch")
        for i in range(0, len(runs), 2):
            _check(0 <= runs[i] <= runs[i + 1] < self._count, "the branch")
            yield from range(runs[i], runs[i + 1] + 1)

    def _check_acyclic(self) -> None:
        """Every path up from a late-linked entry reaches a root (a cycle would hang a walk):
        each entry is walked once (a path that meets a checked one stops there)."""
        checked: set[int] = set()
        for child, parent in self._parents.items():
            if parent < child:
                continue  # a path that only descends in ordinals ends
            walk: set[int] = set()
            node = child
            while node != ROOT and node not in checked:
                _check(node not in walk, "the tree (a cycle)")
                walk.add(node)
                node = self.parent_at(node)
            checked |= walk

    def _check_branch(self) -> None:
        """The active branch is a path from a root to the leaf, in runs of consecutive
        ordinals: each run starts at the child of the previous run's end."""
        runs = self._runs
        _check(len(runs) % 2 == 0, "the branch")
        if not runs:
            _check(self._count == 0, "the branch")
            return
        _check(runs[-1] == self._count - 1, "the branch's leaf")
        previous_end = ROOT
        for i in range(0, len(runs), 2):
            start, end = runs[i], runs[i + 1]
            _check(start <= end and (self.late or previous_end < start), "the branch")
            _check(self.parent_at(start) == previous_end, "the branch's path")
            previous_end = end
        # inside a run, each entry's parent is the entry before it
        starts = set(runs[::2])
        _check(all(o in starts or not self.on_branch(o) for o in self._parents), "the branch")


def _pending_of(value: Any, tree: EntryTree) -> dict[str, list[int]]:
    """Parent id -> waiting roots, as ``encode`` writes them: each a root of the tree, once."""
    _check(type(value) is list, "the waiting entries")
    pending: dict[str, list[int]] = {}
    seen: set[int] = set()
    for item in value:
        _check(type(item) is list and len(item) == 2 and type(item[0]) is str, "a waiting entry")
        ordinals = _ints(item[1])
        _check(bool(ordinals) and item[0] not in pending, "a waiting entry")
        for ordinal in ordinals:
            _check(0 <= ordinal < len(tree) and ordinal not in seen, "a waiting entry")
            _check(tree.parent_at(ordinal) == ROOT, "a waiting entry")
            seen.add(ordinal)
        pending[item[0]] = ordinals
    return pending


def _check(condition: bool, what: str) -> None:
    if not condition:
        raise ValueError(f"{what} does not hold in the snapshot")


def _count(value: Any) -> int:
    _check(type(value) is int and value >= 0, "the entry count")
    count: int = value
    return count


def _ints(value: Any) -> list[int]:
    # by type, in C: a long session's runs hold thousands of numbers
    _check(type(value) is list and set(map(type, value)) <= {int}, "a list of numbers")
    return list(value)


def _increasing(values: list[int]) -> bool:
    return values == sorted(set(values))


def _runs_of(value: Any, count: int) -> _Runs:
    """Runs covering ordinals 0 … count - 1: the first starts at 0, starts increase."""
    _check(type(value) is list and len(value) == 2, "runs")
    starts, values = _ints(value[0]), _ints(value[1])
    _check(len(starts) == len(values), "runs")
    if count == 0:
        _check(not starts, "runs")
    else:
        _check(starts[:1] == [0] and _increasing(starts) and starts[-1] < count, "runs")
    return _Runs(starts, values)
