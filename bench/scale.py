"""Does the cost of per-session operations stay flat as the journal grows?

    python -m bench.scale [--sizes 10000:1000,100000:5000,1000000:20000] [--repeats 5]

For each size (events:sessions) a fresh PostgreSQL database is migrated and filled with COPY:
sessions over 10 tenants and 30 days, events in a realistic mix (user / assistant with usage /
tool results / model changes / custom), one manifest row every 20 events onto a pool of
registered blobs (one blob per 200 events), and 1,000 more registered blobs that nothing
references, written a day ago, with their files: GC's candidates. Then one real 200-turn
session (`bench.peers.workload`, 1,010 events with screenshots) is appended through the
library, and the database is analyzed. All sizes are filled first and kept open; then each
of ``--repeats`` rounds measures every size (in a rotated order), so load drift on a shared
machine hits all sizes alike. Per round and size: append p50 (of 20 single events into
existing sessions), ``state()`` of the 200-turn session, ``list_sessions`` first page and a
deep cursor (half way), ``list_events`` pages with a ``since`` filter on the recorded and
on the entry time (``events --recorded-since`` and ``--since``) and ``stats()``; at the end
one ``gc_blobs(apply=True)`` per size collects the 1,000 candidates. Reported: medians, their
ratio to the first size, and the median (min-max) of the per-round ratios largest / first.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import random
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path
from typing import Any

import orjson
import psycopg

from bench.peers.workload import session as workload_session
from bench.peers.workload import split
from bench.pgdb import dsn, scratch_database, url
from core import SessionStore, Settings
from core.journal.sessions import _encode_cursor
from core.query import rollups, timeblocks
from core.query.analytics import EventFilter

CANDIDATES = 1000
DAYS = 30
TENANTS = [f"tenant-{i}" for i in range(10)]
EPOCH = datetime(2026, 10, 1, tzinfo=UTC)


def templates(rng: random.Random) -> list[tuple[str, bytes]]:
    """Payloads in the pi format (type, JSON text with an ``@ID@`` slot), sizes ~0.1-3 KB."""
    words = "the a test run fix file read write retry upload storage session error ok".split()

    def text(n: int) -> str:
        return " ".join(rng.choice(words) for _ in range(n))

    out: list[tuple[str, bytes]] = []
    for i in range(200):
        kind = i % 10
        if kind in (0, 5):
            payload: dict[str, Any] = {
                "type": "message",
                "message": {"role": "user", "content": [{"type": "text", "text": text(30)}]},
            }
        elif kind in (1, 3, 6, 8):
            payload = {
                "type": "message",
                "message": {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": text(rng.randrange(20, 200))},
                        {"type": "toolCall", "id": f"t{i}", "name": "bash", "arguments": {}},
                    ],
                    "model": "claude-sonnet-4",
                    "usage": {"input": rng.randrange(10**5), "output": rng.randrange(10**3)},
                },
            }
        elif kind in (2, 4, 7):
            payload = {
                "type": "message",
                "message": {
                    "role": "toolResult",
                    "toolCallId": f"t{i}",
                    "toolName": "bash",
                    "content": [{"type": "text", "text": text(rng.randrange(20, 500))}],
                },
            }
        elif i % 20 == 9:
            payload = {"type": "model_change", "provider": "anthropic", "modelId": "claude-4"}
        else:
            payload = {"type": "custom", "customType": "bench", "data": {"k": text(5)}}
        payload["id"] = "@ID@"
        payload["timestamp"] = "@TS@"  # the entry's own time: its recorded time, in pi's form
        out.append((payload["type"], orjson.dumps(payload)))
    return out


def copy_text(value: bytes) -> bytes:
    """Escape for COPY's text format (orjson output holds no raw tab or newline)."""
    return value.replace(b"\\", b"\\\\")


def blob_hash(i: int) -> str:
    return hashlib.sha256(f"scale blob {i}".encode()).hexdigest()


def fill(
    url: str, blob_root: Path, events: int, sessions: int, seed: int = 5, *, spread: bool = False
) -> None:
    """COPY sessions, events, blobs and manifest rows; write the blob files.

    Each event goes to one of the sessions created around its time (a window of 1% of the
    sessions: ~200 live at once at 20k sessions, each active for ~7 hours of the 30 days), as
    agents run; with ``spread``, to any session (each session active on every day: the worst
    case for the stats rollup, one row per session, day and type)."""
    rng = random.Random(seed)
    tpl = templates(rng)
    ids = [str(uuid.UUID(int=rng.getrandbits(128))) for _ in range(sessions)]
    span = timedelta(days=DAYS).total_seconds()
    created = sorted(EPOCH + timedelta(seconds=rng.random() * span) for _ in ids)
    referenced = max(1, events // 200)
    old = datetime.now(UTC) - timedelta(days=1)
    heads = [0] * sessions
    with psycopg.connect(url) as conn:
        with conn.cursor().copy(
            "COPY sessions (id, tenant_id, head_seq, created_at, updated_at) FROM STDIN"
        ) as cp:
            for i, sid in enumerate(ids):
                # head_seq is fixed below, after the events are known
                cp.write_row((sid, TENANTS[i % len(TENANTS)], 0, created[i], created[i]))
        buf = io.BytesIO()
        with conn.cursor().copy(
            "COPY events (position, session_id, seq, type, payload, recorded_at) FROM STDIN"
        ) as cp:
            window = max(1, sessions // 200)
            for p in range(1, events + 1):
                if spread:
                    s = rng.randrange(sessions)
                else:
                    near = p * sessions // (events + 1) + rng.randrange(-window, window + 1)
                    s = min(sessions - 1, max(0, near))
                heads[s] += 1
                kind, body = tpl[p % len(tpl)]
                when = EPOCH + timedelta(seconds=span * p / events)
                row = b"\t".join(
                    (
                        str(p).encode(),
                        ids[s].encode(),
                        str(heads[s]).encode(),
                        kind.encode(),
                        copy_text(
                            body.replace(b"@ID@", f"{p:012x}".encode()).replace(
                                b"@TS@", when.strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3].encode() + b"Z"
                            )
                        ),
                        when.isoformat().encode(),
                    )
                )
                buf.write(row + b"\n")
                if buf.tell() > 1 << 20:
                    cp.write(buf.getvalue())
                    buf = io.BytesIO()
            cp.write(buf.getvalue())
        # where each event went: manifest rows need (position, session) pairs; recompute
        conn.execute("SELECT setval(pg_get_serial_sequence('events', 'position'), %s)", (events,))
        with conn.cursor().copy(
            "COPY blobs (hash, size, stored_size, codec, created_at, last_written_at) FROM STDIN"
        ) as cp:
            for i in range(referenced + CANDIDATES):
                cp.write_row((blob_hash(i), 1, 1, "identity", old, old))
        conn.execute(
            "INSERT INTO blob_refs (position, session_id, pointer, hash, size, encoding) "
            "SELECT position, session_id, '/message/content/1/data', "
            "encode(sha256(convert_to('scale blob ' || ((position / 20) %% %s), 'UTF8')), "
            "'hex'), 1, 'base64' FROM events WHERE position %% 20 = 0",
            (referenced,),
        )
        conn.execute(
            "UPDATE sessions s SET head_seq = e.head FROM (SELECT session_id, max(seq) AS head "
            "FROM events GROUP BY session_id) e WHERE s.id = e.session_id"
        )
        conn.commit()
    for i in range(referenced + CANDIDATES):
        h = blob_hash(i)
        directory = blob_root / h[0:2] / h[2:4]
        directory.mkdir(parents=True, exist_ok=True)
        (directory / f"{h}.blob").write_bytes(b"x")


def timed(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


class Journal:
    """One filled journal, open for measuring: the store, its 200-turn session, a deep cursor."""

    def __init__(
        self, name: str, root: Path, events: int, sessions: int, skip: Sequence[str] = ()
    ) -> None:
        self.events, self.sessions = events, sessions
        settings = Settings(
            data_dir=root, database_url=url(name), blob_url=(root / "blobs").as_uri()
        )
        self.store = SessionStore.from_settings(settings)
        self.big = self.store.journal.create_session(tenant_id=TENANTS[0], title="200 turns").id
        first, _ = split(workload_session(200))
        for i in range(0, len(first), 100):
            self.store.append(self.big, first[i : i + 100])
        started = time.perf_counter()
        timeblocks.summarize(self.store.engine)  # what the first `events --since` would do
        self.summarized_s = time.perf_counter() - started
        started = time.perf_counter()
        rollups.roll_up(self.store.engine)  # what the first `stats` would do
        self.rolled_up_s = time.perf_counter() - started
        with psycopg.connect(dsn(name), autocommit=True) as conn:
            conn.execute("VACUUM ANALYZE")
            row = conn.execute(
                "SELECT created_at, id FROM sessions ORDER BY created_at, id OFFSET %s LIMIT 1",
                (sessions // 2,),
            ).fetchone()
        assert row is not None
        self.deep = _encode_cursor(row[0], row[1])
        self.targets = [s.id for s in self.store.list_sessions(limit=100).items]
        self.appended = 0
        self.ops: dict[str, Callable[[], object]] = {
            "state() 200 turns": lambda: self.store.state(self.big),
            "list_sessions first page": lambda: self.store.list_sessions(),
            "list_sessions deep cursor": lambda: self.store.list_sessions(cursor=self.deep),
            "events --recorded-since page": lambda: self.store.list_events(
                EventFilter(since=EPOCH + timedelta(days=DAYS / 2)), limit=100
            ),
            "events --since page (entry time)": lambda: self.store.list_events(
                EventFilter(entry_since=EPOCH + timedelta(days=DAYS / 2)), limit=100
            ),
            "stats": lambda: self.store.stats(),
        }
        self.ops = {k: v for k, v in self.ops.items() if k not in skip}
        for op in self.ops.values():
            op()  # warm-up: imports, prepared statements, the first snapshot of state()

    def round(self) -> dict[str, float]:
        """One sample of every operation (append: the p50 of 20 single-event appends)."""
        lat = []
        for _ in range(20):
            self.appended += 1
            target = self.targets[self.appended % len(self.targets)]
            event = {"type": "custom", "id": f"a{self.appended}"}
            lat.append(timed(partial(self.store.append, target, [event])))
        out = {"append p50": statistics.median(lat)}
        out.update({name: timed(op) for name, op in self.ops.items()})
        return out

    def gc(self) -> tuple[float, int]:
        started = time.perf_counter()
        report = self.store.gc_blobs(apply=True, grace=3600)
        return time.perf_counter() - started, report.deleted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10000:1000,100000:5000,1000000:20000")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--skip", type=lambda v: v.split(","), default=[], help="operations to leave out: stats"
    )
    parser.add_argument(
        "--spread",
        action="store_true",
        help="every session active on every day (the stats rollup's worst case)",
    )
    args = parser.parse_args()
    sizes = [tuple(int(x) for x in s.split(":")) for s in args.sizes.split(",")]
    with ExitStack() as stack:
        journals = []
        for events, sessions in sizes:
            name = stack.enter_context(scratch_database("scale", migrate=True))
            root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="scale-")))
            started = time.perf_counter()
            fill(dsn(name), root / "blobs", events, sessions, spread=args.spread)
            print(f"filled {events:,} events in {time.perf_counter() - started:.0f} s", flush=True)
            journals.append(Journal(name, root, events, sessions, skip=args.skip))
            print(
                f"  summarized its time blocks (once, as the first `events --since` does) in "
                f"{journals[-1].summarized_s:.2f} s; rolled up its stats (once, as the first "
                f"`stats` does) in {journals[-1].rolled_up_s:.2f} s",
                flush=True,
            )
            stack.callback(journals[-1].store.close)
        # rounds interleave the sizes (rotated), so load drift hits every size alike
        samples: list[dict[str, list[float]]] = [{} for _ in journals]
        loads = []
        for r in range(args.repeats):
            order = list(range(len(journals)))
            order = order[r % len(order) :] + order[: r % len(order)]
            for i in order:
                for key, value in journals[i].round().items():
                    samples[i].setdefault(key, []).append(value)
            loads.append(os.getloadavg()[0])
            print(f"round {r + 1} done (load {loads[-1]:.1f})", flush=True)
        gcs = [j.gc() for j in journals]
    head = " | ".join(f"{e:,} ev / {s:,} sessions" for e, s in sizes)
    print(f"\n| operation | {head} | per-round ratio largest / first, median (min-max) |")
    print("|---|" + "---|" * (len(sizes) + 1))
    base = samples[0]
    for m in base:
        cells = " | ".join(
            f"{statistics.median(x[m]) * 1e3:.1f} ms "
            f"({statistics.median(x[m]) / statistics.median(base[m]):.2f}x)"
            for x in samples
        )
        per = [a / b for a, b in zip(samples[-1][m], base[m], strict=True)]
        print(
            f"| {m} | {cells} | **{statistics.median(per):.2f}x** ({min(per):.2f}-{max(per):.2f}) |"
        )
    cells = " | ".join(f"{t * 1e3:.0f} ms ({t / gcs[0][0]:.2f}x)" for t, _ in gcs)
    print(f"| GC of 1,000 candidates (once) | {cells} | {gcs[-1][0] / gcs[0][0]:.2f}x |")
    print(
        f"\nload average after each round: {' / '.join(f'{x:.1f}' for x in loads)}; "
        f"GC deleted {' / '.join(str(d) for _, d in gcs)}"
    )


if __name__ == "__main__":
    main()
