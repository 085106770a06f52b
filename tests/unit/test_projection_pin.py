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

from core.blobs.externalize import Persister
from core.interop import pi
from core.query.fold_codec import encode_fold
from core.query.projection import PROJECTION_VERSION, fold_events
from core.records import StoredEvent

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"

# the digest of the corpus's encoded folds at each version since the pin was added
PINNED = {
    5: "fcb14f4d58747719f3724b1be75af71b5b2dfc176b111a78a5496e198ab4853a",
    6: "712f0fcb24af5875f0ea7c6f026b19238f3f1f24ce92603a1716fba56cbf2ce9",
    7: "9e4c915c918ce0a3e47c2715ac909ce19e4108b43eff5b15b5421152fe8ead5e",
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


def _surrogate_lines() -> list[dict[str, Any]]:
    """A pi file whose lines hold lone surrogates: its header, a message, an assistant's
    model, a compaction, a label."""
    header = {"type": "session", "version": 3, "id": "s\ud800", "timestamp": "t", "cwd": "/w"}
    reply = _message("B", "A", "assistant", "cut \ud83d")
    reply["message"].update(provider="p", model="m\udfff")
    return [
        header,
        _message("A", None, "user", "hello \udc80"),
        reply,
        {"type": "compaction", "id": "K", "parentId": "B", "summary": "s\ud800",
         "firstKeptEntryId": "B", "tokensBefore": 7},
        {"type": "label", "id": "L", "parentId": "K", "targetId": "A", "label": "\ud800"},
    ]  # fmt: skip


def _escaped() -> list[dict[str, Any]]:
    """Those lines kept as their text (version 5's rule, how they were stored before version
    6), and a line whose text is a blob's ref (placed, not read)."""
    kept = [
        {"type": pi.ESCAPED_LINE, "id": line["id"], "parentId": line.get("parentId"),
         "json": pi.dumps_exact(line)}
        for line in _surrogate_lines()
    ]  # fmt: skip
    del kept[0]["parentId"], kept[0]["id"]  # the header's id holds one
    unread = {
        "type": pi.ESCAPED_LINE,
        "id": "U",
        "parentId": "L",
        "json": "blob:sha256:" + "0" * 64,
    }
    return [*kept, unread]


def _escaped_long() -> list[dict[str, Any]]:
    """Those lines kept escaped (version 6's rule), then lines over 16 KiB as they are
    stored, each long string a blob's ref: an assistant message with its model and usage,
    a compaction, a label whose label alone is long."""
    long = "x" * 20_000
    usage = {"input": 3, "output": 4, "totalTokens": 7, "cost": {"total": 0.25}}
    reply = _message("C", "L", "assistant", long + "\ud83d")
    reply["message"].update(provider="p2", model="m2", usage=usage)
    lines = [
        *_surrogate_lines(),
        reply,
        {"type": "compaction", "id": "K2", "parentId": "C", "summary": "\udc00" + long,
         "firstKeptEntryId": "C", "tokensBefore": 20_000},
        {"type": "label", "id": "L2", "parentId": "K2", "targetId": "C", "label": long,
         "note": "\ud800"},
    ]  # fmt: skip
    persister = Persister(None, image_min_base64_chars=1024, inline_string_limit=16 * 1024)  # type: ignore[arg-type]
    return persister.planned_payloads(persister.plan([*map(pi.escaped_line, lines)]))


def _corpus() -> list[list[dict[str, Any]]]:
    sessions = []
    for name in ("v1", "v2", "v3"):
        text = (FIXTURES / "pi" / f"{name}.jsonl").read_text()
        sessions.append([json.loads(line) for line in text.splitlines() if line.strip()])
    sessions.append(_headerless())
    header = {"type": "session", "version": 3, "id": "s", "timestamp": "t", "cwd": "/w"}
    sessions.append([header, *_headerless()])
    sessions.append(_escaped())
    sessions.append(_escaped_long())
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
