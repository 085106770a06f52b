"""A change in what the fold means must come with a new ``PROJECTION_VERSION``.

Snapshots store encoded folds under the version; a fold whose meaning changed while the
version stayed (as once happened: a rule for sessions without a pi header changed after a
bump) let an old snapshot be reused and ``state()`` differ from a fold from scratch. The
encoded folds of every prefix of a fixed corpus are pinned to the version: a change to
them fails here until the version is bumped and the pin renewed with it.
"""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from core.interop import pi
from core.query.fold_codec import encode_fold
from core.query.projection import PROJECTION_VERSION, fold_events
from core.records import StoredEvent

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"

# the digest of the corpus's encoded folds at each version since the pin was added
PINNED = {
    5: "fcb14f4d58747719f3724b1be75af71b5b2dfc176b111a78a5496e198ab4853a",
}


def _message(eid: str, parent: str | None, role: str, text: str) -> dict[str, Any]:
    return {
        "type": "message",
        "id": eid,
        "parentId": parent,
        "message": {"role": role, "content": [{"type": "text", "text": text}]},
    }


def _headerless() -> list[dict[str, Any]]:
    """No pi header: entries whose parent is unknown, one that comes later, a fork of the
    tree, a label, a compaction, a model change, an untyped line and a custom entry."""
    return [
        _message("X", "zzz", "user", "unrelated"),
        _message("A", None, "user", "hello A"),
        _message("C", "B", "user", "waits for B"),
        _message("B", "A", "assistant", "reply to A"),
        {"type": "label", "id": "L", "parentId": "B", "targetId": "A", "label": "start"},
        {"type": "model_change", "id": "M", "parentId": "L", "provider": "p", "modelId": "m1"},
        {
            "type": "compaction",
            "id": "K",
            "parentId": "M",
            "summary": "s",
            "firstKeptEntryId": "B",
            "tokensBefore": 1e16,
        },
        {"line": {"id": "U", "parentId": "K"}, "type": "sessionstore.untyped_line"},
        {"type": "custom", "id": "Q", "parentId": "K", "customType": "x", "data": {"a": -0.0}},
        _message("D", "A", "user", "a branch"),
    ]


def _escaped() -> list[dict[str, Any]]:
    """A pi file whose lines hold lone surrogates, kept as escaped lines (version 5's rule):
    its header, a message, an assistant's model, a compaction, a label, and a line whose
    text is a blob's ref (placed, not read)."""
    header = {"type": "session", "version": 3, "id": "s\ud800", "timestamp": "t", "cwd": "/w"}
    reply = _message("B", "A", "assistant", "cut \ud83d")
    reply["message"].update(provider="p", model="m\udfff")
    lines = [
        header,
        _message("A", None, "user", "hello \udc80"),
        reply,
        {"type": "compaction", "id": "K", "parentId": "B", "summary": "s\ud800",
         "firstKeptEntryId": "B", "tokensBefore": 7},
        {"type": "label", "id": "L", "parentId": "K", "targetId": "A", "label": "\ud800"},
    ]  # fmt: skip
    unread = {
        "type": pi.ESCAPED_LINE,
        "id": "U",
        "parentId": "L",
        "json": "blob:sha256:" + "0" * 64,
    }
    return [*map(pi.escaped_line, lines), unread]


def _corpus() -> list[list[dict[str, Any]]]:
    sessions = []
    for name in ("v1", "v2", "v3"):
        text = (FIXTURES / "pi" / f"{name}.jsonl").read_text()
        sessions.append([json.loads(line) for line in text.splitlines() if line.strip()])
    sessions.append(_headerless())
    header = {"type": "session", "version": 3, "id": "s", "timestamp": "t", "cwd": "/w"}
    sessions.append([header, *_headerless()])
    sessions.append(_escaped())
    return sessions


def _digest() -> str:
    h = hashlib.sha256()
    at = datetime(2026, 1, 1, tzinfo=UTC)
    for n, payloads in enumerate(_corpus()):
        events = [
            StoredEvent(f"s{n}", seq, seq, str(p["type"]), p, at)
            for seq, p in enumerate(payloads, start=1)
        ]
        for upto in range(1, len(events) + 1):
            h.update(encode_fold(fold_events(events[:upto])))
    return h.hexdigest()


def test_the_fold_of_the_corpus_is_pinned_to_the_projection_version() -> None:
    digest = _digest()
    assert PROJECTION_VERSION in PINNED, (
        f"PROJECTION_VERSION {PROJECTION_VERSION} has no pin: add {digest!r} to PINNED"
    )
    assert digest == PINNED[PROJECTION_VERSION], (
        "the fold's encoding of the corpus changed: if what the fold means changed, bump "
        f"PROJECTION_VERSION and pin {digest!r} under it; else find what changed it"
    )
