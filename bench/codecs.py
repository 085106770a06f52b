"""zstd for the journal's text (issue 19, item 4): what it would save, what reads would pay.

    python -m bench.codecs [--rounds 5]

Stores the 200-turn session of ``bench.peers`` with this project (PostgreSQL, blobs on disk),
then measures, on the very rows and blobs it stored, in a virtualenv of its own with
``zstandard`` (``bench/peers/.venvs/codecs``; zstandard is not a dependency of the project):

- **blobs**: every gzip-coded blob (the externalized text) re-encoded with gzip-6 (today's
  codec), zstd-3, zstd-9 and zstd-19: bytes, and the time to decode all of them;
- **the events table**: the payloads as stored today (``json``, pglz TOAST) against
  - ``json`` with every string value of >= 2 KiB as ``{"$zstd": base64}`` (zstd for large
    text values only: the rest of the payload stays in reach of SQL),
  - ``bytea`` of each payload's zstd-3 and zstd-19 (``STORAGE EXTERNAL``: no pglz on top),
  - ``bytea`` of each payload's zstd-3 with a dictionary trained on the session's payloads
    (the dictionary's bytes are counted);
  each with the full read (every row in seq order, decoded, ``orjson.loads``; interleaved
  rounds, median and min-max) and the client-side encode time of all payloads.

Totals add every other table of the database and the blob files, as a ratio to the workload's
raw JSON, as ``bench.peers`` counts storage.
"""

from __future__ import annotations

import argparse
import base64
import json
import lzma
import os
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import psycopg

ROOT = Path(__file__).resolve().parents[1]
PINS = ("zstandard==0.25.0", "psycopg[binary]==3.3.9", "orjson==3.13.0")
VENV = ROOT / "bench" / "peers" / ".venvs" / "codecs"
LARGE_TEXT = 2048  # bytes of UTF-8: PostgreSQL's TOAST threshold
ZKEY = "$zstd"


# --- in the project's interpreter: store the session, export what the measure needs -------


def orchestrate(rounds: int) -> None:
    from bench.peers.drivers.common import BATCH, batches
    from bench.peers.drivers.sessionstore import Ours
    from bench.peers.workload import session, split
    from bench.pgdb import dsn, scratch_database

    ensure_venv()
    first, _ = split(session())
    raw = sum(len(orjson.dumps(e)) for e in first)
    with scratch_database("ss_codecs") as name, tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        ours = Ours(dsn(name), str(workdir / "store"))
        for chunk in batches(first, BATCH):
            ours.append(chunk)
        decoded = workdir / "decoded"
        decoded.mkdir()
        with psycopg.connect(dsn(name), autocommit=True) as conn:
            conn.execute("VACUUM ANALYZE")
            blobs = conn.execute("SELECT hash, codec, stored_size FROM blobs").fetchall()
            other = conn.execute(
                "SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0) FROM pg_class c "
                "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.relkind IN ('r', 'm') "
                "AND n.nspname = 'public' AND c.relname <> 'events'"
            ).fetchone()
            events = conn.execute("SELECT pg_total_relation_size('events')").fetchone()
        manifest = []
        for blob_hash, codec, stored_size in blobs:
            (decoded / blob_hash).write_bytes(ours.store.blobs.get(blob_hash))
            manifest.append({"hash": blob_hash, "codec": codec, "stored": stored_size})
        ours.close()
        files = sum(p.stat().st_size for p in (workdir / "store").rglob("*") if p.is_file())
        spec = {
            "raw": raw,
            "other_tables": int(other[0] if other else 0),
            "events_table": int(events[0] if events else 0),
            "blob_files": files,
            "blobs": manifest,
            "decoded": str(decoded),
            "rounds": rounds,
        }
        (workdir / "spec.json").write_text(json.dumps(spec))
        print(f"workload: {len(first)} events, {raw / 1e6:.2f} MB of JSON; load {os.getloadavg()}")
        cmd = [str(VENV / "bin" / "python"), "-m", "bench.codecs", "--measure"]
        subprocess.run([*cmd, dsn(name), str(workdir / "spec.json")], cwd=ROOT, check=True)


def ensure_venv() -> None:
    marker = VENV / "bench-pins.txt"
    if marker.exists() and marker.read_text() == "\n".join(PINS):
        return
    print(f"creating {VENV} ({', '.join(PINS)})", flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(VENV)], check=True)
    pip = [str(VENV / "bin" / "pip"), "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, *PINS], check=True)
    marker.write_text("\n".join(PINS))


# --- in the codecs virtualenv: the measurements --------------------------------------------


def _ms(samples: list[float]) -> str:
    ms = sorted(s * 1e3 for s in samples)
    return f"{statistics.median(ms):.1f} ({ms[0]:.1f}-{ms[-1]:.1f})"


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(dsn: str, spec_path: str) -> None:
    import zstandard

    spec = json.loads(Path(spec_path).read_text())
    raw, rounds = int(spec["raw"]), int(spec["rounds"])
    decoded = Path(spec["decoded"])

    # Blobs: the text ones (codec gzip) re-encoded; identity ones (media) stay as they are.
    texts = [(decoded / b["hash"]).read_bytes() for b in spec["blobs"] if b["codec"] == "gzip"]
    kept = sum(int(b["stored"]) for b in spec["blobs"] if b["codec"] != "gzip")
    stored_gzip = sum(int(b["stored"]) for b in spec["blobs"] if b["codec"] == "gzip")
    overhead = int(spec["blob_files"]) - kept - stored_gzip  # file-level bytes (none today)
    codecs: dict[str, tuple[Callable[[bytes], bytes], Callable[[bytes], bytes]]] = {
        "gzip-6 (today)": (
            lambda d: zlib.compress(d, 6, wbits=31),
            lambda s: zlib.decompress(s, wbits=31),
        ),
    }
    for level in (3, 9, 19):
        cctx = zstandard.ZstdCompressor(level=level)
        codecs[f"zstd-{level}"] = (cctx.compress, zstandard.ZstdDecompressor().decompress)
    encoded = {name: [enc(t) for t in texts] for name, (enc, _dec) in codecs.items()}
    decode_times: dict[str, list[float]] = {name: [] for name in codecs}
    for _ in range(rounds):
        for name, (_enc, dec) in codecs.items():
            blobs = encoded[name]
            start = time.perf_counter()
            for blob in blobs:
                dec(blob)
            decode_times[name].append(time.perf_counter() - start)
    blob_totals = {name: kept + overhead + sum(map(len, encoded[name])) for name in codecs}
    print(
        f"\ntext blobs: {len(texts)}, {sum(map(len, texts)) / 1e6:.2f} MB decoded "
        f"(stored gzip today {stored_gzip / 1e6:.2f} MB); media blobs {kept / 1e6:.2f} MB"
    )
    print("| blob codec (text blobs) | text blobs | all blob files | decode all, ms |")
    print("|---|---|---|---|")
    for name in codecs:
        size = sum(map(len, encoded[name]))
        print(
            f"| {name} | {size / 1e6:.2f} MB | {blob_totals[name] / 1e6:.2f} MB "
            f"| {_ms(decode_times[name])} |"
        )

    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT position, session_id, seq, type, payload::text, recorded_at FROM events "
            "ORDER BY seq"
        ).fetchall()
        texts_json = [r[4].encode() for r in rows]
        trained = zstandard.train_dictionary(112_640, texts_json)
        dictionary = trained.as_bytes()
        z3 = zstandard.ZstdCompressor(level=3)
        z19 = zstandard.ZstdCompressor(level=19)
        zd = zstandard.ZstdCompressor(level=3, dict_data=trained)
        plain = zstandard.ZstdDecompressor()
        with_dict = zstandard.ZstdDecompressor(dict_data=trained)

        def large_out(value: Any) -> Any:
            if isinstance(value, str) and len(value.encode("utf-8", "surrogatepass")) >= LARGE_TEXT:
                packed = z3.compress(value.encode("utf-8", "surrogatepass"))
                return {ZKEY: base64.b64encode(packed).decode()}
            if isinstance(value, dict):
                return {k: large_out(v) for k, v in value.items()}
            if isinstance(value, list):
                return [large_out(v) for v in value]
            return value

        def large_in(value: Any) -> Any:
            if isinstance(value, dict):
                if len(value) == 1 and ZKEY in value:
                    return plain.decompress(base64.b64decode(value[ZKEY])).decode()
                return {k: large_in(v) for k, v in value.items()}
            if isinstance(value, list):
                return [large_in(v) for v in value]
            return value

        # (label, column type, storage, encode one payload's JSON text, decode one column value)
        variants: list[tuple[str, str, str, Callable[[bytes], Any], Callable[[Any], Any]]] = [
            ("json, pglz (today)", "json", "EXTENDED", bytes.decode, orjson.loads),
            (
                f"json, strings >= {LARGE_TEXT} B as zstd-3",
                "json",
                "EXTENDED",
                lambda t: orjson.dumps(large_out(orjson.loads(t))).decode(),
                lambda v: large_in(orjson.loads(v)),
            ),
            (
                "bytea, zstd-3 per payload",
                "bytea",
                "EXTERNAL",
                z3.compress,
                lambda v: orjson.loads(plain.decompress(v)),
            ),
            (
                "bytea, zstd-19 per payload",
                "bytea",
                "EXTERNAL",
                z19.compress,
                lambda v: orjson.loads(plain.decompress(v)),
            ),
            (
                "bytea, zstd-3 + session dictionary",
                "bytea",
                "EXTERNAL",
                zd.compress,
                lambda v: orjson.loads(with_dict.decompress(v)),
            ),
        ]
        expected = [orjson.loads(t) for t in texts_json]
        encode_s: list[float] = []
        sizes: list[int] = []
        datums: list[int] = []
        for i, (label, kind, storage, encode, decode) in enumerate(variants):
            conn.execute(
                f"CREATE TABLE c{i} (position BIGINT PRIMARY KEY, session_id VARCHAR(36), "
                f"seq BIGINT, type VARCHAR(256), payload {kind}, recorded_at TIMESTAMPTZ, "
                "UNIQUE (session_id, seq))"
            )
            conn.execute(f"ALTER TABLE c{i} ALTER COLUMN payload SET STORAGE {storage}")
            start = time.perf_counter()
            values = [encode(t) for t in texts_json]
            encode_s.append(time.perf_counter() - start)
            with conn.cursor() as cur:
                cur.executemany(
                    f"INSERT INTO c{i} VALUES (%s, %s, %s, %s, %s, %s)",
                    [(r[0], r[1], r[2], r[3], v, r[5]) for r, v in zip(rows, values, strict=True)],
                )
            conn.execute(f"VACUUM ANALYZE c{i}")
            row = conn.execute(
                f"SELECT pg_total_relation_size('c{i}'), sum(pg_column_size(payload)) FROM c{i}"
            ).fetchone()
            extra = len(dictionary) if "dictionary" in label else 0
            sizes.append(int(row[0] if row else 0) + extra)
            datums.append(int(row[1] if row else 0) + extra)
            column = "payload::text" if kind == "json" else "payload"
            query = f"SELECT {column} FROM c{i} ORDER BY seq"
            got = [decode(v) for (v,) in conn.execute(query)]
            assert got == expected, f"variant {i} does not round-trip"
        reads: dict[int, list[float]] = {i: [] for i in range(len(variants))}
        for _ in range(rounds):  # interleaved: every variant once per round
            for i, (_label, kind, _s, _e, decode) in enumerate(variants):
                column = "payload::text" if kind == "json" else "payload"

                def read(i: int = i, column: str = column, decode: Any = decode) -> None:
                    for (value,) in conn.execute(f"SELECT {column} FROM c{i} ORDER BY seq"):
                        decode(value)

                reads[i].append(_timed(read))
    # The variants' tables carry the payload and the unique key only: the journal's own events
    # table (its other columns and indexes) is today's size, and each variant adds its payload
    # difference to it.
    other = int(spec["other_tables"])
    events_today = int(spec["events_table"])
    journal = [events_today + size - sizes[0] for size in sizes]
    best = min(blob_totals, key=lambda name: blob_totals[name])
    print(
        f"\nraw JSON {raw / 1e6:.2f} MB; events table today {events_today / 1e6:.2f} MB; "
        f"other tables {other / 1e6:.2f} MB; blob files today "
        f"{blob_totals['gzip-6 (today)'] / 1e6:.2f} MB, "
        f"with {best} {blob_totals[best] / 1e6:.2f} MB"
    )
    print(
        f"| events payload | payload datums | payload table | journal | total, blobs today | x raw "
        f"| total, {best} blobs "
        "| x raw | full read ms | encode ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for i, (label, *_rest) in enumerate(variants):
        today = journal[i] + other + blob_totals["gzip-6 (today)"]
        better = journal[i] + other + blob_totals[best]
        print(
            f"| {label} | {datums[i] / 1e6:.2f} MB | {sizes[i] / 1e6:.2f} MB "
            f"| {journal[i] / 1e6:.2f} MB "
            f"| {today / 1e6:.2f} MB | {today / raw:.3f}x "
            f"| {better / 1e6:.2f} MB | {better / raw:.3f}x | {_ms(reads[i])} "
            f"| {encode_s[i] * 1e3:.0f} |"
        )
    # What no per-row codec can beat: every payload in one stream (no random access).
    stream = b"\n".join(texts_json)
    whole = {
        "zstd-19": len(zstandard.ZstdCompressor(level=19).compress(stream)),
        "xz-9": len(lzma.compress(stream, preset=9)),
    }
    floor = events_today - sizes[0] + min(whole.values()) + other + blob_totals[best]
    print(
        f"\nall {len(texts_json)} payloads ({len(stream) / 1e6:.2f} MB) as one stream: "
        + ", ".join(f"{name} {size / 1e6:.2f} MB" for name, size in whole.items())
        + f"; with the journal's other bytes and the blob files: {floor / 1e6:.2f} MB, "
        f"{floor / raw:.3f}x raw (a lower bound for any per-row codec)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--measure", nargs=2, metavar=("DSN", "SPEC"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        measure(*args.measure)
    else:
        orchestrate(args.rounds)


if __name__ == "__main__":
    main()
