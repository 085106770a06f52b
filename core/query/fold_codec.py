"""The snapshot codec: a ``Fold`` as bytes, and back.

A snapshot is read by every later ``state()`` of its session at or after its seq, so a
snapshot that decoded into a fold that failed later would fail all of them (invariant 11).
``decode_fold`` therefore returns a fold that can be folded on, planned and built from, or
raises ``SnapshotFormatError`` (the caller then ignores the snapshot and replaces it):

- ``SSF2`` (the format written): the magic, a CRC-32 of everything after it, the length of
  the JSON metadata, the metadata, the entry ids in compressed chunks. The id chunks are
  decoded lazily (a read at the head touches only the last), so a corrupt one would fail
  the read that touched it long after the snapshot was accepted: the checksum catches it
  when the snapshot is loaded. It costs 0.04 ms for the 276 KiB snapshot of a
  100,000-event session; decoding every chunk to check it instead costs about 7 ms.
- ``SSF1`` (written before; still read, so that existing snapshots stay in use): the same
  without the checksum. Its sealed id chunks are decoded and checked when it is loaded.

In both, the metadata is checked for every type, range and cross-reference the fold relies
on (ordinals within the tree, seqs within the snapshot's, the branch a path of the tree,
counters that add up), so that even a snapshot whose bytes are intact, written by a faulty
encoder, cannot make a read fail (of ``SSF2``, the id chunks' bytes are trusted once the
checksum matches: decoding them all is what the checksum saves).
"""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Sequence
from dataclasses import asdict, astuple
from typing import Any

from core import exact_json
from core.errors import SnapshotFormatError
from core.journal.usage import INT64_MAX, INT64_MIN
from core.query.entry_tree import EntryTree
from core.query.projection import (
    PROJECTION_VERSION,
    CompactionMark,
    Counters,
    Fold,
    Header,
    ModelChange,
    ThinkingLevelChange,
    TokenUsage,
)

_MAGIC = b"SSF2"
_MAGIC_V1 = b"SSF1"
_UINT32 = struct.Struct("<I")
_USAGE = ("input", "output", "cache_read", "cache_write", "total_tokens", "cost")
_COUNTS = ("events", "entries", "messages", "tool_calls", "tool_results", "tool_errors")


def encode_fold(fold: Fold) -> bytes:
    """Snapshot bytes (``SSF2``): magic, checksum, metadata length, metadata, id chunks."""
    tree_meta, chunks = fold.tree.encode()
    meta = {
        "version": PROJECTION_VERSION,
        "seq": fold.seq,
        "tree": tree_meta,
        "id_chunks": [len(c) for c in chunks],
        "counters": asdict(fold.counters),
        "header": asdict(fold.header),
        "name": fold.name,
        "model_changes": [list(astuple(c)) for c in fold.model_changes],
        "models": [list(astuple(c)) for c in fold.models],
        "thinking_changes": [list(astuple(c)) for c in fold.thinking_changes],
        "compactions": [list(astuple(c)) for c in fold.compactions],
        "custom": fold.custom,
        "labels": fold.labels,
    }
    # exact_json: folded values (usage sums, custom data) may be integers beyond 64 bits
    encoded = exact_json.dumps(meta)
    body = (_UINT32.pack(len(encoded)), encoded, *chunks)
    checksum = 0
    for part in body:
        checksum = zlib.crc32(part, checksum)
    return b"".join((_MAGIC, _UINT32.pack(checksum), *body))


def decode_fold(data: bytes) -> Fold:
    """The fold ``encode_fold`` encoded (``SSF2``, or ``SSF1`` from before); raises
    ``SnapshotFormatError`` for anything else."""
    try:
        meta, chunks, verify_ids = _unpack(data)
        return _fold(meta, chunks, verify_ids=verify_ids)
    except SnapshotFormatError:
        raise
    except (
        KeyError,
        IndexError,
        TypeError,
        ValueError,
        RecursionError,
        struct.error,
        zlib.error,
    ) as exc:
        raise SnapshotFormatError(f"unreadable snapshot: {exc!r}") from exc


def _unpack(data: bytes) -> tuple[dict[str, Any], list[bytes], bool]:
    """(metadata, id chunks, whether the chunks must be checked: no checksum covers them)."""
    magic = data[:4]
    if magic == _MAGIC:
        (checksum,) = _UINT32.unpack_from(data, 4)
        if zlib.crc32(memoryview(data)[8:]) != checksum:
            raise SnapshotFormatError("unreadable snapshot: its checksum does not match")
        start, verify_ids = 8, False
    elif magic == _MAGIC_V1:
        start, verify_ids = 4, True
    else:
        raise SnapshotFormatError("not a sessionstore fold snapshot")
    (length,) = _UINT32.unpack_from(data, start)
    start += _UINT32.size
    if start + length > len(data):
        raise SnapshotFormatError("unreadable snapshot: truncated metadata")
    meta = exact_json.loads(data[start : start + length])
    if type(meta) is not dict:
        raise SnapshotFormatError("unreadable snapshot: its metadata is not an object")
    if meta.get("version") != PROJECTION_VERSION:
        raise SnapshotFormatError(f"snapshot of projection version {meta.get('version')!r:.20}")
    return meta, _chunks(data, start + length, meta["id_chunks"]), verify_ids


def _chunks(data: bytes, offset: int, sizes: Any) -> list[bytes]:
    _check(type(sizes) is list and all(type(s) is int and s >= 0 for s in sizes), "id_chunks")
    chunks = []
    for size in sizes:
        chunks.append(data[offset : offset + size])
        offset += size
    _check(offset == len(data), "the snapshot's length")
    return chunks


def _fold(meta: dict[str, Any], chunks: list[bytes], *, verify_ids: bool) -> Fold:
    seq = meta["seq"]
    _check(type(seq) is int and seq >= 0, "seq")
    tree_meta = meta["tree"]
    _check(type(tree_meta) is dict, "tree")
    tree = EntryTree.decode(tree_meta, chunks, verify_ids=verify_ids)
    count = len(tree)
    _check(count == 0 or tree.seq_at(count - 1) <= seq, "the entries' seqs")
    # Marks are checked by column, with C-level checks: a 100,000-event session has about
    # a thousand, and a check per mark in Python would double the time to decode.
    model_changes = _marks(meta["model_changes"], count, (_ID, _INT, _TEXT, _TEXT))
    models = _marks(meta["models"], count, (_ID, _INT, _TEXT, _TEXT))
    thinking = _marks(meta["thinking_changes"], count, (_ID, _INT, _TEXT))
    compactions = _marks(meta["compactions"], count, (_TEXT, _NUMBER))
    _check(all(math.isfinite(c[2]) for c in compactions if type(c[2]) is float), "tokensBefore")
    header = _header(meta["header"], seq)
    # only a pi file (its header links by parentId) keeps entries waiting for a later parent
    _check(header.links or not tree.has_pending(), "the entries waiting for a parent")
    return Fold(
        seq=seq,
        tree=tree,
        counters=_counters(meta["counters"], seq, count),
        header=header,
        name=_optional_text(meta["name"], "name"),
        model_changes=[ModelChange(*m) for m in model_changes],
        models=[ModelChange(*m) for m in models],
        thinking_changes=[ThinkingLevelChange(*t) for t in thinking],
        compactions=[CompactionMark(*c) for c in compactions],
        custom=_custom(meta["custom"], count),
        labels=_labels(meta["labels"]),
    )


_Types = frozenset[type[Any]]
_ID: _Types = frozenset({str})
_INT: _Types = frozenset({int})
_TEXT: _Types = frozenset({str, type(None)})
_NUMBER: _Types = frozenset({int, float, type(None)})


def _marks(value: Any, count: int, columns: tuple[_Types, ...]) -> list[list[Any]]:
    """Rows of (ordinal, *columns): ordinals of entries, increasing (the fold appends them
    in entry order); each column's values of one of its types."""
    rows = _list(value)
    width = 1 + len(columns)
    _check(set(map(type, rows)) <= {list} and set(map(len, rows)) <= {width}, "marks")
    if rows:
        ordinals, *others = zip(*rows, strict=True)
        _check(_ordinals(ordinals, count), "the ordinals of marks")
        for column, types in zip(others, columns, strict=True):
            _check(set(map(type, column)) <= types, "marks")
    return rows


def _ordinals(values: Sequence[Any], count: int) -> bool:
    """Whether ``values`` are increasing ordinals of the tree's entries."""
    return not values or (
        set(map(type, values)) <= _INT
        and 0 <= values[0]
        and values[-1] < count
        and list(values) == sorted(set(values))
    )


def _counters(value: Any, seq: int, entries: int) -> Counters:
    _check(type(value) is dict, "counters")
    counts = {name: value[name] for name in _COUNTS}
    _check(all(type(n) is int and n >= 0 for n in counts.values()), "counters")
    by_type, by_role = _counts(value["by_type"]), _counts(value["by_role"])
    # every event is counted once by type, every message once by role; entries are the tree
    _check(
        counts["events"] == sum(by_type.values()) <= seq
        and counts["entries"] == entries <= counts["events"]
        and counts["messages"] == sum(by_role.values()) <= entries,
        "counters",
    )
    usage = value["usage"]
    _check(type(usage) is dict, "usage")
    sums = {name: usage[name] for name in _USAGE}
    # the fold clamps the sums to int64 (and NaN fails the comparison)
    _check(
        all(type(v) in (int, float) and INT64_MIN <= v <= INT64_MAX for v in sums.values()),
        "usage",
    )
    return Counters(**counts, by_type=by_type, by_role=by_role, usage=TokenUsage(**sums))


def _counts(value: Any) -> dict[str, int]:
    _check(type(value) is dict and all(type(n) is int and n > 0 for n in value.values()), "counts")
    counts: dict[str, int] = value
    return counts


def _header(value: Any, seq: int) -> Header:
    _check(type(value) is dict, "header")
    header_seq, version = value["seq"], value["version"]
    # only the event at seq 1 is the header
    _check(header_seq is None or (type(header_seq) is int and header_seq == 1 <= seq), "header")
    _check(version is None or type(version) is int, "header")
    links = value["links"]
    _check(type(links) is bool and (header_seq is not None or not links), "header")
    return Header(
        seq=header_seq,
        session_id=_optional_text(value["session_id"], "header"),
        version=version,
        cwd=_optional_text(value["cwd"], "header"),
        parent_session=_optional_text(value["parent_session"], "header"),
        timestamp=_optional_text(value["timestamp"], "header"),
        links=links,
    )


def _custom(value: Any, count: int) -> dict[str, list[int]]:
    _check(type(value) is dict, "custom")
    _check(all(type(o) is list and _ordinals(o, count) for o in value.values()), "custom")
    custom: dict[str, list[int]] = value
    return custom


def _labels(value: Any) -> dict[str, str]:
    _check(type(value) is dict and set(map(type, value.values())) <= _ID, "labels")
    _check(all(value.values()), "labels")  # an empty label removes the entry's
    labels: dict[str, str] = value
    return labels


def _optional_text(value: Any, what: str) -> str | None:
    _check(value is None or type(value) is str, what)
    text: str | None = value
    return text


def _list(value: Any) -> list[Any]:
    _check(type(value) is list, "a list")
    items: list[Any] = value
    return items


def _check(condition: bool, what: str) -> None:
    if not condition:
        raise SnapshotFormatError(f"unreadable snapshot: {what} is not as encoded")
