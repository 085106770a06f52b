"""Blobs on S3: our blob store's put/get against bare obstore put/get of the same bytes.

    python -m bench.blobs --s3 [--repeats 9] [--sizes 65536,4194304] [--database-url URL]
                          [--endpoint http://host:port]

Without ``--endpoint`` a moto S3 server is started as a separate process on a free port
(the standard ``AWS_*`` variables are set for it); with one, the ``AWS_*`` variables of the
environment are used as they are (MinIO, R2, …) and the bucket must exist.

Per round, for text-like (gzip codec) and PNG-like (identity codec) data at each size,
interleaved, alternating which side goes first:

- bare put: ``obstore.put(store, key, data)`` of the content bytes, to a fresh key;
- our put: ``ObjectBlobStore.put(data)`` of new content (sha256, the codec, a conditional
  create, the ``blobs`` row upsert with its presence check, commit);
- bare get: ``obstore.get(store, key).bytes()`` of that key (and a bare HEAD of it, and the
  sha256 of the content, for the arithmetic of what a put must add);
- our get: ``ObjectBlobStore.get(hash)`` (fetch, decode, verify against the hash).

For gzip the bare put sends the raw content and ours sends the compressed form, so that row
also shows a bare put of the compressed bytes (what is on the wire) plus the codec's time.
Figures are MiB of raw content per second: median (min-max) over the rounds.

The floor, measured in the same rounds from bare calls, is what the invariants make any
correct put or get do (see bench/RESULTS.md, "Blobs on S3"):

- put floor = sha256 + the codec + a bare conditional PUT of the stored bytes + a bare HEAD
  of it (invariant 6: the presence re-check once the row lock is held) + a raw registration
  (invariant 2: one ``INSERT … ON CONFLICT DO UPDATE`` and its commit, with the bare driver,
  psycopg or sqlite3, on an open connection to the same database);
- get floor = a raw lookup of the blob's codec (one indexed ``SELECT`` with the bare driver:
  the two codecs live under two keys) + a bare GET of the stored bytes + decoding + sha256
  (invariant 13: nothing unverified is served).
"""

from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import obstore

from core import SessionStore, Settings
from core.blobs.objects import ObjectBlobStore, open_s3_store
from core.blobs.store import DEFAULT_GZIP_LEVEL, sha256_hex
from core.migrate import upgrade

MIB = 1024 * 1024
AWS_LOCAL = {
    "AWS_ACCESS_KEY_ID": "bench",
    "AWS_SECRET_ACCESS_KEY": "bench",
    "AWS_REGION": "us-east-1",
    "AWS_ALLOW_HTTP": "true",
}
COLUMNS = (
    "bare_put",
    "put",
    "bare_get",
    "get",
    "bare_put_stored",
    "codec",
    "bare_head",
    "sha256",
    "register",
    "bare_get_stored",
    "decode",
    "lookup",
)
TARGET = 0.8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def moto_server() -> Iterator[str]:
    """A moto S3 server in its own process (it does not share this process's GIL)."""
    port = _free_port()
    exe = Path(sys.executable).with_name("moto_server")
    proc = subprocess.Popen(
        [str(exe), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{endpoint}/", timeout=2).read()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("moto_server did not start") from None
                time.sleep(0.2)
        yield endpoint
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class RawRegistration:
    """The registration floor: one upsert and commit with the bare driver, on an open
    connection to the journal's database, into a scratch table of the blobs row's shape."""

    def __init__(self, database_url: str) -> None:
        self.postgres = database_url.startswith("postgresql")
        if self.postgres:
            import psycopg

            dsn = database_url.replace("+psycopg", "", 1)
            self.conn: Any = psycopg.connect(dsn)
            self.reader: Any = psycopg.connect(dsn, autocommit=True)  # one read, no BEGIN
        else:
            import sqlite3

            self.conn = sqlite3.connect(database_url.removeprefix("sqlite:///"))
            self.reader = self.conn
            self.conn.execute("PRAGMA journal_mode=WAL")
            self.conn.execute("PRAGMA synchronous=FULL")
        self.conn.execute(
            "CREATE TABLE IF NOT EXISTS bench_floor_blobs (hash TEXT PRIMARY KEY, size BIGINT, "
            "stored_size BIGINT, codec TEXT, created_at TEXT, last_written_at TEXT)"
        )
        self.conn.commit()
        mark = "%s" if self.postgres else "?"
        self.sql = (
            "INSERT INTO bench_floor_blobs VALUES "
            f"({mark}, {mark}, {mark}, {mark}, {mark}, {mark}) "
            "ON CONFLICT (hash) DO UPDATE SET last_written_at = excluded.last_written_at"
        )

    def lookup(self, blob_hash: str) -> None:
        mark = "%s" if self.postgres else "?"
        self.reader.execute(f"SELECT codec FROM blobs WHERE hash = {mark}", (blob_hash,)).fetchone()

    def __call__(self, blob_hash: str, size: int, stored: int) -> None:
        now = time.strftime("%Y-%m-%dT%H:%M:%S")
        self.conn.execute(self.sql, (blob_hash, size, stored, "gzip", now, now))
        self.conn.commit()

    def close(self) -> None:
        self.conn.execute("DROP TABLE IF EXISTS bench_floor_blobs")
        self.conn.commit()
        if self.reader is not self.conn:
            self.reader.close()
        self.conn.close()


def bench_kind(
    ours: ObjectBlobStore,
    bare: Any,
    register: RawRegistration,
    name: str,
    blobs: list[bytes],
    gzip: bool,
) -> dict[str, Any]:
    samples: dict[str, list[float]] = {c: [] for c in COLUMNS}
    for i, data in enumerate(blobs):
        key = f"{uuid.uuid4().hex}.bin"
        stored_key = f"{uuid.uuid4().hex}.stored"
        stored = zlib.compress(data, DEFAULT_GZIP_LEVEL, wbits=31) if gzip else data
        h = sha256_hex(data)
        bare_side = {
            "bare_put": lambda: obstore.put(bare, key, data),  # noqa: B023
            "bare_get": lambda: obstore.get(bare, key).bytes(),  # noqa: B023
        }
        our_side = {
            "put": lambda: ours.put(data),  # noqa: B023  (new content: the first put)
            "get": lambda: ours.get(h),  # noqa: B023
        }
        first, second = (bare_side, our_side) if i % 2 == 0 else (our_side, bare_side)
        for column, fn in [*first.items(), *second.items()]:
            samples[column].append(_timed(fn))
        samples["bare_head"].append(_timed(lambda: obstore.head(bare, key)))  # noqa: B023
        samples["sha256"].append(_timed(lambda: sha256_hex(data)))  # noqa: B023
        samples["bare_put_stored"].append(
            _timed(lambda: obstore.put(bare, stored_key, stored, mode="create"))  # noqa: B023
        )
        samples["bare_get_stored"].append(
            _timed(lambda: obstore.get(bare, stored_key).bytes())  # noqa: B023
        )
        samples["decode"].append(
            _timed(lambda: zlib.decompress(stored, wbits=31)) if gzip else 0.0  # noqa: B023
        )
        samples["lookup"].append(_timed(lambda: register.lookup(h)))  # noqa: B023
        samples["register"].append(
            _timed(lambda: register(h, len(data), len(stored)))  # noqa: B023
        )
        samples["codec"].append(
            _timed(lambda: zlib.compress(data, DEFAULT_GZIP_LEVEL, wbits=31)) if gzip else 0.0  # noqa: B023
        )
    size = len(blobs[0])

    def mbs(seconds: float) -> float:
        return size / MIB / seconds if seconds else float("inf")

    med = {c: statistics.median(v) for c, v in samples.items()}
    # Per round, so the floor and ours share each round's load.
    put_floor = [
        samples["sha256"][i]
        + samples["codec"][i]
        + samples["bare_put_stored"][i]
        + samples["bare_head"][i]
        + samples["register"][i]
        for i in range(len(blobs))
    ]
    get_floor = [
        samples["lookup"][i]
        + samples["bare_get_stored"][i]
        + samples["decode"][i]
        + samples["sha256"][i]
        for i in range(len(blobs))
    ]
    put_floor_ratios = [f / p for f, p in zip(put_floor, samples["put"], strict=True)]
    get_floor_ratios = [f / g for f, g in zip(get_floor, samples["get"], strict=True)]
    return {
        "name": name,
        "size": size,
        "stored": len(zlib.compress(blobs[0], DEFAULT_GZIP_LEVEL, wbits=31)) if gzip else size,
        "gzip": gzip,
        "median": {c: mbs(med[c]) for c in COLUMNS},
        "min": {c: mbs(max(v)) for c, v in samples.items()},
        "max": {c: mbs(min(v)) for c, v in samples.items()},
        "put_ratio": med["bare_put"] / med["put"],
        "get_ratio": med["bare_get"] / med["get"],
        "put_ratio_wire": (med["bare_put_stored"] + med["codec"]) / med["put"],
        "put_floor_ms": statistics.median(put_floor) * 1000,
        "get_floor_ms": statistics.median(get_floor) * 1000,
        "put_floor_ratio": statistics.median(put_floor) / med["put"],
        "get_floor_ratio": statistics.median(get_floor) / med["get"],
        "put_floor_rounds": (min(put_floor_ratios), max(put_floor_ratios)),
        "get_floor_rounds": (min(get_floor_ratios), max(get_floor_ratios)),
        "ms": {c: med[c] * 1000 for c in COLUMNS},
    }


def _cell(r: dict[str, Any], column: str) -> str:
    return f"{r['median'][column]:.0f} ({r['min'][column]:.0f}-{r['max'][column]:.0f})"


def report(results: list[dict[str, Any]]) -> None:
    print(
        "| data | size | bare put | our put | put ratio | bare get | our get | get ratio "
        "| bare put of stored bytes + codec | put ratio to that |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        wire = (
            f"{_cell(r, 'bare_put_stored')} + {r['ms']['codec']:.1f} ms | "
            f"{r['put_ratio_wire']:.2f}x"
            if r["gzip"]
            else "(same bytes) | -"
        )
        print(
            f"| {r['name']} | {r['size'] // 1024} KiB | {_cell(r, 'bare_put')} | {_cell(r, 'put')} "
            f"| **{r['put_ratio']:.2f}x** | {_cell(r, 'bare_get')} | {_cell(r, 'get')} "
            f"| **{r['get_ratio']:.2f}x** | {wire} |"
        )
    print("\nmedian milliseconds per operation:")
    for r in results:
        ms = r["ms"]
        print(
            f"- {r['name']} {r['size'] // 1024} KiB: bare put {ms['bare_put']:.2f}, put "
            f"{ms['put']:.2f}, bare get {ms['bare_get']:.2f}, get {ms['get']:.2f}, bare head "
            f"{ms['bare_head']:.2f}, sha256 {ms['sha256']:.2f}"
            + (f", codec {ms['codec']:.2f}" if r["gzip"] else "")
        )
    print(
        "\nagainst the floor (what the invariants make a put or get do, from bare calls in "
        "the same rounds; ratio of medians, per-round min-max):\n"
    )
    print(
        "| data | size | put floor ms | our put ms | put / floor | get floor ms | our get ms "
        "| get / floor |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        pl, ph = r["put_floor_rounds"]
        gl, gh = r["get_floor_rounds"]
        print(
            f"| {r['name']} | {r['size'] // 1024} KiB | {r['put_floor_ms']:.2f} | "
            f"{r['ms']['put']:.2f} | **{r['put_floor_ratio']:.2f}x** ({pl:.2f}-{ph:.2f}) | "
            f"{r['get_floor_ms']:.2f} | {r['ms']['get']:.2f} | "
            f"**{r['get_floor_ratio']:.2f}x** ({gl:.2f}-{gh:.2f}) |"
        )
    print(f"\ntarget: our put and get >= {TARGET}x bare obstore on the same endpoint")
    for r in results:
        verdict = [
            f"{what} {ratio:.2f}x ({'met' if ratio >= TARGET else 'MISSED'})"
            for what, ratio in (("put", r["put_ratio"]), ("get", r["get_ratio"]))
        ]
        print(f"- {r['name']} {r['size'] // 1024} KiB: " + ", ".join(verdict))
    print(f"proposed (a finding): our put and get >= {TARGET}x their floor")
    for r in results:
        verdict = [
            f"{what} {ratio:.2f}x ({'met' if ratio >= TARGET else 'MISSED'})"
            for what, ratio in (("put", r["put_floor_ratio"]), ("get", r["get_floor_ratio"]))
        ]
        print(f"- {r['name']} {r['size'] // 1024} KiB: " + ", ".join(verdict))


def run(args: Any, corpora: Callable[[int, int], list[tuple[str, list[bytes], bool]]]) -> None:
    endpoint_given = args.endpoint is not None
    with tempfile.TemporaryDirectory(prefix="bench-blobs-s3-") as tmp:
        if endpoint_given:
            os.environ["AWS_ENDPOINT_URL"] = args.endpoint
            _run(args, Path(tmp), args.bucket, corpora)
            return
        with moto_server() as endpoint:
            os.environ.update({**AWS_LOCAL, "AWS_ENDPOINT_URL": endpoint})
            urllib.request.urlopen(
                urllib.request.Request(f"{endpoint}/{args.bucket}", method="PUT")
            ).read()
            _run(args, Path(tmp), args.bucket, corpora)


def _run(
    args: Any,
    root: Path,
    bucket: str,
    corpora: Callable[[int, int], list[tuple[str, list[bytes], bool]]],
) -> None:
    run_id = uuid.uuid4().hex[:8]
    settings = Settings(
        data_dir=root / "data",
        database_url=args.database_url,
        blob_url=f"s3://{bucket}/bench-{run_id}/blobs",
    )
    upgrade(settings.resolved_database_url)
    bare = open_s3_store(f"s3://{bucket}/bench-{run_id}/bare")
    with SessionStore.from_settings(settings) as store:
        ours = store.blobs
        assert isinstance(ours, ObjectBlobStore)
        print(f"journal: {store.engine.dialect.name}; blobs: {settings.resolved_blob_url}")
        print(f"endpoint: {os.environ['AWS_ENDPOINT_URL']}; load average: {os.getloadavg()}")
        print(f"{args.repeats} interleaved rounds; MB/s = MiB of raw content per second\n")
        ours.put(b"warm-up " * 100)  # connections and the schema, outside the samples
        obstore.put(bare, "warm-up", b"warm-up")
        register = RawRegistration(settings.resolved_database_url)
        register("0" * 64, 1, 1)  # warm-up
        results = []
        try:
            for size in (int(x) for x in args.sizes.split(",")):
                for name, blobs, gzip in corpora(size, args.repeats):
                    results.append(bench_kind(ours, bare, register, name, blobs, gzip))
        finally:
            register.close()
        report(results)
        print(f"\nload average at the end: {os.getloadavg()}")
