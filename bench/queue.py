"""Queue path throughput: enqueued events/s from enqueue to committed in the journal.

    python -m bench.queue [--repeats 3] [--writes 2000,600,200] [--profile]

One ``celery -A tasks.app worker --pool prefork -c 2`` subprocess (two worker processes, the
app's own at-least-once settings) on Redis (db 8 of 127.0.0.1:6379, flushed before and
after) and a scratch PostgreSQL database (created, migrated, dropped). For writes of 1, 10
and 100 ~1 KB events (``bench.append.event``), the producer streams ``enqueue_append`` calls
while the worker drains them; a run ends when every write's result is stored, which the
task does only after its transaction committed. In the same run, ``bench.noop`` (a Celery
task with the same arguments and a result of the same size, no database) gives the Celery
floor, and ``bench.raw_insert`` (the same, plus psycopg ``executemany`` of the events into the
raw floor's jsonb table in one transaction) the floor of a queue that commits what it carries.
Medians of ``--repeats`` runs, the three interleaved. Each run also records, from
/proc, the CPU each process group spends per write (producer, worker main and pool
processes, Redis, PostgreSQL), which bounds the rate the machine's cores can reach.
``--profile`` adds where the time goes: publish alone, in-task time from the worker's log,
and the append itself.
"""

# `python bench/queue.py` puts bench/ first on sys.path, where this file would shadow the
# standard library's `queue` (kombu imports it): put the repository root there instead.
import sys
from pathlib import Path

_BENCH = Path(__file__).resolve().parent
if sys.path and Path(sys.path[0] or ".").resolve() == _BENCH:
    sys.path[0] = str(_BENCH.parent)

# ruff: noqa: E402
import argparse
import itertools
import os
import re
import signal
import statistics
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

import psycopg
import redis
from celery import Celery
from sqlalchemy import func, select

from bench.append import event
from bench.noop_tasks import NOOP_TASK, RAW_INSERT_TASK
from core import SessionStore, Settings
from core.migrate import upgrade
from core.models import EventRow
from tasks import enqueue_append
from tasks.app import QUEUE, create_app
from tasks.producer import APPEND_TASK

ROOT = _BENCH.parent
ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"
REDIS_URL = "redis://127.0.0.1:6379/8"
BATCHES = (1, 10, 100)
SESSIONS = 32  # writes are spread over this many sessions, round-robin
SINGLE_RATIO_TARGET = 0.6
BATCH100_RAW_TARGET = 0.8  # issue 19's 0.8x, against the floor that commits (RESULTS)
T = TypeVar("T")
_SUCCEEDED = re.compile(r"Task (\S+)\[[^\]]+\] succeeded in ([0-9.e-]+)s")


@dataclass
class Run:
    events: int
    elapsed_s: float  # first enqueue -> last result stored
    enqueue_s: float  # first enqueue -> last enqueue returned
    cpu_ms: dict[str, float] = field(default_factory=dict)  # per write, by process group

    @property
    def rate(self) -> float:
        return self.events / self.elapsed_s


# --- servers ----------------------------------------------------------------------------


@contextmanager
def scratch_database() -> Iterator[str]:
    name = f"ss_bench_queue_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(ADMIN, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        url = f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
        upgrade(url)
        yield url
    finally:
        with psycopg.connect(ADMIN, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextmanager
def flushed_redis(url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(url)
    client.flushdb()
    try:
        yield client
    finally:
        client.flushdb()
        client.close()


def worker_env(settings: Settings) -> dict[str, str]:
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("SESSIONSTORE_")}
    return {
        **inherited,
        "PYTHONPATH": str(ROOT),  # for -I bench.noop_tasks
        "SESSIONSTORE_DATABASE_URL": str(settings.database_url),
        "SESSIONSTORE_BROKER_URL": str(settings.broker_url),
        "SESSIONSTORE_RESULT_BACKEND": str(settings.result_backend),
        "SESSIONSTORE_DATA_DIR": str(settings.data_dir),
    }


@contextmanager
def celery_worker(app: Celery, env: dict[str, str], log: Path, level: str) -> Iterator[int]:
    """``celery worker`` with 2 prefork processes, ready when it answers a ping."""
    node = f"bench-{uuid.uuid4().hex[:6]}@localhost"
    args = [sys.executable, "-m", "celery", "-A", "tasks.app", "worker", "--pool", "prefork"]
    args += ["-c", "2", "-I", "bench.noop_tasks", "-l", level, "-n", node]
    args += ["--without-mingle", "--without-gossip"]
    with log.open("ab") as out:
        proc = subprocess.Popen(
            args, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 60
        while not app.control.ping(destination=[node], timeout=0.5):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"worker did not start; see {log}")
        yield proc.pid
    finally:
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


# --- CPU accounting (/proc) ------------------------------------------------------------

_TICKS = os.sysconf("SC_CLK_TCK")
CPU_GROUPS = ("producer", "worker main process", "worker pool processes", "Redis", "PostgreSQL")


def _proc_stat(pid: int) -> tuple[str, int, float] | None:
    """(command name, parent pid, CPU seconds used) of a live process, from /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    name = stat[stat.index("(") + 1 : stat.rindex(")")]
    fields = stat[stat.rindex(")") + 2 :].split()
    return name, int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICKS


def cpu_by_group(worker_pid: int) -> dict[str, float]:
    """CPU seconds used so far by each process group of a run (Linux; everything else on
    the machine should be idle)."""
    out = dict.fromkeys(CPU_GROUPS, 0.0)
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or (stat := _proc_stat(int(entry))) is None:
            continue
        name, parent, seconds = stat
        pid = int(entry)
        if pid == os.getpid():
            out["producer"] += seconds
        elif pid == worker_pid:
            out["worker main process"] += seconds
        elif parent == worker_pid:
            out["worker pool processes"] += seconds
        elif name.startswith("redis-server"):
            out["Redis"] += seconds
        elif name.startswith("postgres"):
            out["PostgreSQL"] += seconds
    return out


# --- one run ----------------------------------------------------------------------------


def wait_stored(client: redis.Redis, keys: Sequence[bytes], timeout: float = 300.0) -> None:
    """Until every result key exists; cheap to poll (mostly one EXISTS of the last key)."""
    deadline = time.monotonic() + timeout
    remaining = list(keys)
    while remaining:
        if client.exists(remaining[-1]):
            found = client.pipeline(transaction=False)
            for key in remaining:
                found.exists(key)
            remaining = [k for k, hit in zip(remaining, found.execute(), strict=True) if not hit]
            if not remaining:
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(remaining)} writes not finished after {timeout}s")
        time.sleep(0.002)


def batches(batch: int, writes: int) -> list[list[dict[str, Any]]]:
    return [[event(w * batch + j) for j in range(batch)] for w in range(writes)]


def run_queue(
    app: Celery, client: redis.Redis, sessions: list[str], payloads: list[list[dict[str, Any]]]
) -> Run:
    backend = app.backend
    keys = []
    t0 = time.perf_counter()
    for i, events in enumerate(payloads):
        handle = enqueue_append(sessions[i % len(sessions)], events, app=app)
        keys.append(backend.get_key_for_task(handle.task_id))
    t1 = time.perf_counter()
    wait_stored(client, keys)
    t2 = time.perf_counter()
    client.delete(*keys)
    return Run(sum(len(p) for p in payloads), t2 - t0, t1 - t0)


def run_bench_task(
    task: str,
    app: Celery,
    client: redis.Redis,
    sessions: list[str],
    payloads: list[list[dict[str, Any]]],
) -> Run:
    """The same messages (kwargs, task id, queue) sent to ``bench.noop`` or
    ``bench.raw_insert``."""
    backend = app.backend
    keys = []
    t0 = time.perf_counter()
    for i, events in enumerate(payloads):
        key = str(uuid.uuid4())
        app.send_task(
            task,
            kwargs={
                "session_id": sessions[i % len(sessions)],
                "events": events,
                "expected_seq": None,
                "idempotency_key": key,
            },
            task_id=key,
            queue=QUEUE,
        )
        keys.append(backend.get_key_for_task(key))
    t1 = time.perf_counter()
    wait_stored(client, keys)
    t2 = time.perf_counter()
    client.delete(*keys)
    return Run(sum(len(p) for p in payloads), t2 - t0, t1 - t0)


def median_run(runs: list[Run]) -> Run:
    runs = sorted(runs, key=lambda r: r.elapsed_s)
    return runs[len(runs) // 2]


# --- the benchmark ----------------------------------------------------------------------


def with_cpu(worker_pid: int, run: Callable[[], Run], writes: int) -> Run:
    """``run()``, with the CPU each process group spent on it, per write."""
    before = cpu_by_group(worker_pid)
    result = run()
    after = cpu_by_group(worker_pid)
    result.cpu_ms = {g: (after[g] - before[g]) * 1e3 / writes for g in CPU_GROUPS}
    return result


KINDS = ("queue", "no-op", "raw insert")
Results = dict[int, dict[str, Run]]


def measure(
    app: Celery,
    client: redis.Redis,
    sessions: list[str],
    plan: dict[int, int],
    repeats: int,
    worker_pid: int,
) -> Results:
    """batch -> kind -> the median run of that kind (queue, no-op, raw insert)."""
    runners: dict[str, Callable[..., Run]] = {
        "queue": run_queue,
        "no-op": partial(run_bench_task, NOOP_TASK),
        "raw insert": partial(run_bench_task, RAW_INSERT_TASK),
    }
    out: Results = {}
    for batch, writes in plan.items():
        payloads = batches(batch, writes)
        warm = payloads[: max(20, writes // 10)]
        for fn in runners.values():
            fn(app, client, sessions, warm)
        runs: dict[str, list[Run]] = {kind: [] for kind in KINDS}
        for _ in range(repeats):
            for kind, fn in runners.items():
                runs[kind].append(
                    with_cpu(worker_pid, partial(fn, app, client, sessions, payloads), writes)
                )
        out[batch] = {kind: median_run(runs[kind]) for kind in KINDS}
        rates = " / ".join(
            f"{kind} {out[batch][kind].rate:,.0f} ({', '.join(f'{r.rate:,.0f}' for r in rs)})"
            for kind, rs in runs.items()
        )
        print(f"  batch {batch} ev/s: {rates}", file=sys.stderr, flush=True)
    return out


def table(results: Results, plan: dict[int, int]) -> list[str]:
    lines = [
        "| batch | writes/run | queue ev/s | queue writes/s | no-op ev/s | queue / no-op "
        "| raw-insert task ev/s | queue / raw insert "
        "| publish ev/s (queue / no-op run) | target | met |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for batch, by_kind in results.items():
        q, n, r = (by_kind[kind] for kind in KINDS)
        ratio = q.rate / n.rate
        if batch == 1:
            target, met = f">= {SINGLE_RATIO_TARGET}x no-op", ratio >= SINGLE_RATIO_TARGET
        elif batch == 100:
            target = f">= {BATCH100_RAW_TARGET}x raw insert"
            met = q.rate / r.rate >= BATCH100_RAW_TARGET
        else:
            target, met = "-", None
        verdict = "-" if met is None else ("**yes**" if met else "**no**")
        lines.append(
            f"| {batch} | {plan[batch]:,} | {q.rate:,.0f} | {q.rate / batch:,.0f} "
            f"| {n.rate:,.0f} | {ratio:.2f}x | {r.rate:,.0f} | {q.rate / r.rate:.2f}x "
            f"| {q.events / q.enqueue_s:,.0f} / {n.events / n.enqueue_s:,.0f} | {target} "
            f"| {verdict} |"
        )
    return lines


def cpu_table(results: Results) -> list[str]:
    """CPU per write of the median runs, and the rate it allows with every core busy."""
    cores = os.cpu_count() or 1
    lines = [
        "| batch | run | "
        + " | ".join(CPU_GROUPS)
        + f" | total | ev/s if {cores} cores did only this |",
        "|---|---|" + "---|" * (len(CPU_GROUPS) + 2),
    ]
    for batch, by_kind in results.items():
        for kind, run in by_kind.items():
            total = sum(run.cpu_ms.values())
            cells = " | ".join(f"{run.cpu_ms[g]:.2f}" for g in CPU_GROUPS)
            ceiling = cores * 1e3 / total * batch if total else float("nan")
            lines.append(f"| {batch} | {kind} | {cells} | **{total:.2f}** | {ceiling:,.0f} |")
    return lines


def check_journal(store: SessionStore, expected: int) -> None:
    with store.engine.connect() as conn:
        count = conn.execute(select(func.count()).select_from(EventRow)).scalar_one()
    if count != expected:
        raise AssertionError(f"journal holds {count} events, {expected} were enqueued")
    if store.dead_letters.list():
        raise AssertionError("some writes were dead-lettered")


# --- profile ------------------------------------------------------------------------------


def p50_ms(samples: Sequence[float]) -> str:
    return f"{statistics.median(samples) * 1e3:.2f}" if samples else "-"


def timed_each(fn: Callable[[T], object], items: Sequence[T]) -> list[float]:
    out = []
    for item in items:
        t0 = time.perf_counter()
        fn(item)
        out.append(time.perf_counter() - t0)
    return out


def in_task_times(log: Path) -> dict[str, list[float]]:
    """Per-task run time (body + result store) from the worker's INFO log."""
    times: dict[str, list[float]] = {}
    for name, seconds in _SUCCEEDED.findall(log.read_text(errors="replace")):
        times.setdefault(name, []).append(float(seconds))
    return times


@contextmanager
def phase_timers(store: SessionStore) -> Iterator[dict[str, list[float]]]:
    """Time the stages of ``SessionStore.append`` by wrapping them on this instance only."""
    stages = {
        "validate (`check_batch`)": (store._writer, "validate"),
        "plan what to externalize (`Persister.plan`)": (store._writer.persister, "plan"),
        "put blobs (`Persister.put`)": (store._writer.persister, "put"),
        "journal append (one statement)": (store.journal, "append"),
    }
    samples: dict[str, list[float]] = {label: [] for label in stages}

    def wrap(label: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                samples[label].append(time.perf_counter() - t0)

        return timed

    for label, (obj, name) in stages.items():
        setattr(obj, name, wrap(label, getattr(obj, name)))
    try:
        yield samples
    finally:
        for obj, name in stages.values():
            delattr(obj, name)


def profile_direct(
    app: Celery, store: SessionStore, sessions: list[str], payloads: list[list[dict[str, Any]]]
) -> dict[str, str]:
    """Publish alone (no consumer), then the append alone (no Celery), stage by stage."""
    out = {}
    publish = timed_each(
        lambda write: enqueue_append(write[0], write[1], app=app),
        list(zip(itertools.cycle(sessions), payloads)),
    )
    out["producer: `enqueue_append` (no consumer)"] = p50_ms(publish)
    sid = store.create_session(tenant_id="bench").id
    with phase_timers(store) as phases:
        total = timed_each(
            lambda events: store.append(sid, events, idempotency_key=uuid.uuid4().hex), payloads
        )
    out["`SessionStore.append`, one process, no Celery"] = p50_ms(total)
    out |= {f"- {label}": p50_ms(samples) for label, samples in phases.items()}
    return out


def profile(settings: Settings, store: SessionStore, workdir: Path, writes: int) -> list[str]:
    """Where a write's time goes, for batches of 1 and 100 (p50 ms per write)."""
    app = create_app(settings)
    client = redis.Redis.from_url(REDIS_URL)
    sessions = [store.create_session(tenant_id="bench").id for _ in range(SESSIONS)]
    plan = {1: batches(1, writes), 100: batches(100, max(20, writes // 10))}
    columns: dict[int, dict[str, str]] = {}
    try:
        log = workdir / "worker-info.log"
        with celery_worker(app, worker_env(settings), log, "INFO"):
            for batch, payloads in plan.items():
                run_queue(app, client, sessions, payloads)
                run_bench_task(NOOP_TASK, app, client, sessions, payloads)
                times = in_task_times(log)
                log.write_text("")
                columns[batch] = {
                    "worker: `sessionstore.append` in-task": p50_ms(times[APPEND_TASK]),
                    "worker: `bench.noop` in-task": p50_ms(times[NOOP_TASK]),
                }
        for batch, payloads in plan.items():
            columns[batch] |= profile_direct(app, store, sessions, payloads)
            client.delete(QUEUE)
    finally:
        app.close()
        client.close()
    lines = ["| p50 ms per write | batch 1 | batch 100 |", "|---|---|---|"]
    lines += [f"| {label} | {columns[1][label]} | {columns[100][label]} |" for label in columns[1]]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--writes",
        default="2000,600,200",
        help="writes per run for batches 1,10,100 (comma-separated)",
    )
    parser.add_argument("--profile", action="store_true", help="also show where time goes")
    args = parser.parse_args()
    plan = dict(zip(BATCHES, (int(w) for w in args.writes.split(",")), strict=True))

    started = time.perf_counter()
    with (
        tempfile.TemporaryDirectory() as tmp,
        scratch_database() as url,
        flushed_redis(REDIS_URL) as client,
    ):
        workdir = Path(tmp)
        settings = Settings(
            data_dir=workdir / "data",
            database_url=url,
            broker_url=REDIS_URL,
            result_backend=REDIS_URL,
        )
        app = create_app(settings)
        with SessionStore.from_settings(settings) as store:
            sessions = [store.create_session(tenant_id="bench").id for _ in range(SESSIONS)]
            log = workdir / "worker.log"
            with celery_worker(app, worker_env(settings), log, "WARNING") as worker_pid:
                results = measure(app, client, sessions, plan, args.repeats, worker_pid)
            warm = sum(len(p) for b, w in plan.items() for p in batches(b, max(20, w // 10)))
            total = warm + args.repeats * sum(b * w for b, w in plan.items())
            check_journal(store, total)
            lines = table(results, plan)
            lines += ["", "CPU ms per write, by process group (median runs):", ""]
            lines += cpu_table(results)
            if args.profile:
                lines += ["", "Where the time goes:", ""]
                lines += profile(settings, store, workdir, plan[1] // 2)
        app.close()
    print("\n".join(lines))
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"\n(total {time.perf_counter() - started:.0f} s; load average at the end {load})")


if __name__ == "__main__":
    main()
