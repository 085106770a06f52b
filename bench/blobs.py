"""Blob store speed vs the raw hash + codec work, and journal bytes of an image-heavy session.

    python bench/blobs.py [--repeats 7] [--sizes 65536,4194304] [--database-url URL]
    python bench/blobs.py --s3 [--endpoint URL] …   (see bench/blobs_s3.py)

In one run, for text-like data (gzip) and PNG-like data (identity), at each size:
- raw put work: hashlib.sha256 + the codec (zlib gzip level 6 / nothing);
- FileBlobStore.put of new content (durable write + registration in the ``blobs`` table);
- raw get work (codec decode + sha256) vs FileBlobStore.get (read + decode + verify);
- a re-put of existing content;
- the floor a durable write costs: write + fsync of the stored bytes to the same disk.
Then an image-heavy, realistic session goes through SessionStore.append and its journal bytes
are compared with its input bytes. Every figure is a median of ``--repeats`` runs.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import os
import random
import statistics
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from core import SessionStore, Settings
from core.blobs.store import DEFAULT_GZIP_LEVEL, BlobStore, sha256_hex
from core.migrate import upgrade

PNG = b"\x89PNG\r\n\x1a\n"
WORDS = (
    "def return self import from class if else for while try except raise with as None True "
    "False async await lambda yield print len range dict list str int bytes error warning info "
    "debug session event blob store journal append read write commit rollback index table "
    "the a of to and in is it that this on at by be are was were have has had not or"
).split()
MIB = 1024 * 1024


def text_corpus(size: int, seed: int = 1) -> bytes:
    """Code- and log-like text that gzip shrinks about 3-4x, like real tool output."""
    rng = random.Random(seed)
    lines: list[str] = []
    total = 0
    while total < size:
        indent = " " * rng.choice((0, 4, 8, 12))
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))
        line = f"{indent}{words} {rng.randint(0, 99999)} x{rng.getrandbits(32):08x}\n"
        lines.append(line)
        total += len(line)
    return "".join(lines).encode()[:size]


def variants(base: bytes, count: int) -> list[bytes]:
    """Distinct contents of the same size and compressibility (so none is deduplicated)."""
    step = max(1, len(base) // (count + 1))
    return [
        (f"variant {i}\n".encode() + base[i * step :] + base[: i * step])[: len(base)]
        for i in range(count)
    ]


def png_like(size: int, count: int) -> list[bytes]:
    return [PNG + os.urandom(size - len(PNG)) for _ in range(count)]


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def write_fsync(path: Path, data: bytes) -> None:
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def bench_kind(
    store: BlobStore, floor_dir: Path, name: str, blobs: list[bytes], gzip: bool
) -> dict[str, Any]:
    encoded = [zlib.compress(b, DEFAULT_GZIP_LEVEL, wbits=31) if gzip else b for b in blobs]

    def raw_put(data: bytes) -> None:
        hashlib.sha256(data).hexdigest()
        if gzip:
            zlib.compress(data, DEFAULT_GZIP_LEVEL, wbits=31)

    def raw_get(stored: bytes) -> None:
        hashlib.sha256(zlib.decompress(stored, wbits=31) if gzip else stored).hexdigest()

    samples: dict[str, list[float]] = {}
    for data, stored in zip(blobs, encoded, strict=True):
        # Interleaved, so noise from the shared machine hits every column alike.
        h = sha256_hex(data)
        run = {
            "raw_put": lambda: raw_put(data),  # noqa: B023
            "put": lambda: store.put(data),  # noqa: B023  (new content: the first put)
            "reput": lambda: store.put(data),  # noqa: B023
            "raw_get": lambda: raw_get(stored),  # noqa: B023
            "get": lambda: store.get(h),  # noqa: B023
            "floor": lambda: write_fsync(floor_dir / "floor", stored),  # noqa: B023
        }
        for key, fn in run.items():
            samples.setdefault(key, []).append(timed(fn))
        (floor_dir / "floor").unlink()
    med = {k: statistics.median(v) for k, v in samples.items()}
    size = len(blobs[0])
    return {
        "name": name,
        "size": size,
        "stored": len(encoded[0]),
        "mbs": {k: size / MIB / v for k, v in med.items()},
        "put_vs_raw": med["raw_put"] / med["put"],
        "get_vs_raw": med["raw_get"] / med["get"],
        "reput_speedup": med["put"] / med["reput"],
        "put_vs_raw_plus_floor": (med["raw_put"] + med["floor"]) / med["put"],
    }


def corpora(size: int, count: int) -> list[tuple[str, list[bytes], bool]]:
    """Distinct text-like (gzip) and PNG-like (identity) contents of one size."""
    return [
        ("text (gzip)", variants(text_corpus(size), count), True),
        ("PNG (identity)", png_like(size, count), False),
    ]


# an image-heavy, realistic session ------------------------------------------------------


def _image_block(raw: bytes) -> dict[str, Any]:
    return {"type": "image", "data": base64.b64encode(raw).decode(), "mimeType": "image/png"}


def realistic_session(turns: int, rng: random.Random) -> list[dict[str, Any]]:
    """A coding-agent session: screenshots (some repeated), file reads, thinking, tool calls."""
    corpus = text_corpus(256 * 1024, seed=3).decode()
    shots = [PNG + rng.randbytes(rng.randint(120_000, 400_000)) for _ in range(max(1, turns // 4))]
    events: list[dict[str, Any]] = [
        {"type": "session_info", "name": "fix the login page"},
        {"type": "model_change", "provider": "anthropic", "modelId": "claude-sonnet"},
    ]
    for turn in range(turns):
        user: list[dict[str, Any]] = [{"type": "text", "text": f"turn {turn}: look at this"}]
        if turn % 2 == 0:
            user.append(_image_block(rng.choice(shots)))
        events.append({"type": "message", "message": {"role": "user", "content": user}})
        start = rng.randrange(0, len(corpus) - 60_000)
        read = corpus[start : start + rng.choice((2_000, 8_000, 30_000, 60_000))]
        call = {"type": "toolCall", "id": f"c{turn}", "name": "read", "arguments": {"path": "a.py"}}
        events.append(
            {
                "type": "message",
                "message": {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": corpus[start : start + 1500]},
                        {"type": "text", "text": "Let me read the file."},
                        {**call, "partialJson": '{"path": "a.'},
                    ],
                },
            }
        )
        result: list[dict[str, Any]] = [{"type": "text", "text": read}]
        if turn % 3 == 0:
            result.append(_image_block(rng.choice(shots)))  # a screenshot tool's output
        events.append(
            {
                "type": "message",
                "message": {"role": "toolResult", "toolCallId": f"c{turn}", "content": result},
            }
        )
    return events


def bench_session(store: SessionStore, turns: int) -> dict[str, Any]:
    events = realistic_session(turns, random.Random(5))
    before = store.blob_stats()  # the journal may be shared with the runs above
    session = store.create_session(tenant_id="bench")
    input_bytes = len(orjson.dumps(events))
    took = timed(
        lambda: [store.append(session.id, events[i : i + 10]) for i in range(0, len(events), 10)]
    )
    stored = store.read(session.id)
    payload_bytes = sum(len(orjson.dumps(e.payload)) for e in stored)
    manifest = store.journal.manifest([e.position for e in stored])
    rows = [m for entries in manifest.values() for m in entries]
    # A manifest row: position, session id, pointer, hash, size, encoding (+ row id).
    manifest_bytes = sum(8 + 36 + len(m.pointer) + 64 + 8 + len(m.encoding) + 8 for m in rows)
    stats = store.blob_stats()
    back = store.read(session.id, rehydrate=True)
    assert len(back) == len(events)
    return {
        "events": len(events),
        "input_bytes": input_bytes,
        "payload_bytes": payload_bytes,
        "manifest_rows": len(rows),
        "manifest_bytes": manifest_bytes,
        "journal_bytes": payload_bytes + manifest_bytes,
        "blob_count": stats.blob_count - before.blob_count,
        "raw_bytes": stats.raw_bytes - before.raw_bytes,
        "stored_bytes": stats.stored_bytes - before.stored_bytes,
        "saved_by_dedup": stats.saved_by_dedup - before.saved_by_dedup,
        "append_mbs": input_bytes / MIB / took,
    }


# report ---------------------------------------------------------------------------------


def report_kind(r: dict[str, Any]) -> None:
    m = r["mbs"]
    print(
        f"| {r['name']} | {r['size'] // 1024} KiB | {m['raw_put']:.0f} | {m['put']:.0f} "
        f"| **{r['put_vs_raw']:.2f}x** | {m['reput']:.0f} | **{r['reput_speedup']:.1f}x** "
        f"| {m['raw_get']:.0f} | {m['get']:.0f} | {r['get_vs_raw']:.2f}x "
        f"| {m['floor']:.0f} | {r['put_vs_raw_plus_floor']:.2f}x |"
    )


def report_targets(results: list[dict[str, Any]]) -> None:
    print("\ntargets: put >= 0.8x raw hash+codec; re-put >= 10x faster than the first put")
    for r in results:
        put = "met" if r["put_vs_raw"] >= 0.8 else "MISSED"
        reput = "met" if r["reput_speedup"] >= 10 else "MISSED"
        print(
            f"- {r['name']} {r['size'] // 1024} KiB: put {r['put_vs_raw']:.2f}x ({put}), "
            f"re-put {r['reput_speedup']:.1f}x ({reput})"
        )


def report_session(s: dict[str, Any]) -> None:
    print(f"\nimage-heavy session: {s['events']} events, appended at {s['append_mbs']:.0f} MB/s")
    print(f"- input (JSON as sent):         {s['input_bytes']:>12,} bytes")
    print(f"- journal payloads:             {s['payload_bytes']:>12,} bytes")
    print(f"- manifest ({s['manifest_rows']} rows, est.):     {s['manifest_bytes']:>12,} bytes")
    ratio = s["journal_bytes"] / s["input_bytes"]
    print(f"- journal total:                {s['journal_bytes']:>12,} bytes = {ratio:.4f}x input")
    saved_compression = s["raw_bytes"] - s["stored_bytes"]
    print(
        f"- blob store: {s['blob_count']} blobs, raw {s['raw_bytes']:,}, "
        f"stored {s['stored_bytes']:,}; saved by dedup {s['saved_by_dedup']:,}, "
        f"by compression {saved_compression:,}"
    )
    total = (s["journal_bytes"] + s["stored_bytes"]) / s["input_bytes"]
    print(f"- journal + blobs:              {total:.3f}x input")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--sizes", default=f"{64 * 1024},{4 * MIB}")
    parser.add_argument("--turns", type=int, default=60)
    parser.add_argument("--database-url", default=None, help="default: SQLite in a temp dir")
    parser.add_argument("--s3", action="store_true", help="blobs on s3:// vs bare obstore")
    parser.add_argument("--endpoint", default=None, help="--s3: default, a moto server")
    parser.add_argument("--bucket", default="bench-blobs", help="--s3: the bucket")
    args = parser.parse_args()
    if args.s3:
        from bench import blobs_s3

        blobs_s3.run(args, corpora)
        return
    with tempfile.TemporaryDirectory(prefix="bench-blobs-") as tmp:
        root = Path(tmp).resolve()
        settings = Settings(data_dir=root / "data", database_url=args.database_url)
        upgrade(settings.resolved_database_url)
        with SessionStore.from_settings(settings) as store:
            print(f"journal: {store.engine.dialect.name}; blobs: {settings.resolved_blob_url}")
            print(f"medians of {args.repeats}; MB/s = MiB of raw content per second\n")
            print(
                "| data | size | raw hash+codec | put | put/raw | re-put | re-put speedup "
                "| raw decode+hash | get | get/raw | write+fsync floor | put/(raw+floor) |"
            )
            print("|---|---|---|---|---|---|---|---|---|---|---|---|")
            results = []
            for size in (int(x) for x in args.sizes.split(",")):
                text = variants(text_corpus(size), args.repeats)
                results.append(bench_kind(store.blobs, root, "text (gzip)", text, True))
                report_kind(results[-1])
                png = png_like(size, args.repeats)
                results.append(bench_kind(store.blobs, root, "PNG (identity)", png, False))
                report_kind(results[-1])
            report_targets(results)
            report_session(bench_session(store, args.turns))


if __name__ == "__main__":
    main()
