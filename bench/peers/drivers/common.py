"""What every driver shares. Standard library only: it runs in each peer's own virtualenv.

A driver is started as ``python -m bench.peers.drivers.NAME OP DSN WORKLOAD WORKDIR``, does
one operation on one session, and prints one JSON line:

- ``single``: append the first ``SINGLE_N`` events one call each;
- ``load``: append the 200-turn session in batches of 100;
- ``rebuild``: read the whole session back (rehydrated: the exact original values), timed
  ``READS`` times in this fresh process, with digests of the first read for the check;
- ``grow``: append turns 201-400 in batches of 100.
"""

from __future__ import annotations

import base64
import hashlib
import json
import sys
import time
from collections.abc import Sequence
from typing import Any, Protocol

SINGLE_N = 100
BATCH = 100
READS = 5
SESSION = "0b5e5510-0019-4000-8000-000000000019"


class Driver(Protocol):
    def append(self, events: Sequence[dict[str, Any]]) -> None: ...

    def read(self) -> list[dict[str, Any]]: ...

    def close(self) -> None: ...


def digests(entries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Ids in order, the decoded bytes of every image block, and the whole content."""
    images = hashlib.sha256()
    count = 0
    for entry in entries:
        message = entry.get("message")
        for item in message.get("content", []) if isinstance(message, dict) else []:
            if isinstance(item, dict) and item.get("type") == "image":
                images.update(hashlib.sha256(base64.b64decode(item["data"])).digest())
                count += 1
    ids = "\n".join(str(entry.get("id")) for entry in entries)
    canonical = json.dumps(entries, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return {
        "events": len(entries),
        "ids": hashlib.sha256(ids.encode()).hexdigest(),
        "images": count,
        "image_bytes": images.hexdigest(),
        "content": hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest(),
    }


def batches(events: Sequence[dict[str, Any]], size: int) -> list[Sequence[dict[str, Any]]]:
    return [events[i : i + size] for i in range(0, len(events), size)]


def timed_appends(driver: Driver, chunks: Sequence[Sequence[dict[str, Any]]]) -> dict[str, Any]:
    started = time.perf_counter()
    for chunk in chunks:
        driver.append(chunk)
    seconds = time.perf_counter() - started
    n = sum(len(c) for c in chunks)
    return {"events": n, "seconds": seconds, "ev_s": n / seconds}


def run(op: str, driver: Driver, workload: dict[str, Any]) -> dict[str, Any]:
    first: list[dict[str, Any]] = workload["first"]
    if op == "single":
        return timed_appends(driver, [[e] for e in first[:SINGLE_N]])
    if op == "load":
        return timed_appends(driver, batches(first, BATCH))
    if op == "grow":
        return timed_appends(driver, batches(workload["second"], BATCH))
    if op == "rebuild":
        times = []
        result: dict[str, Any] = {}
        for i in range(READS):
            started = time.perf_counter()
            entries = driver.read()
            times.append(time.perf_counter() - started)
            if i == 0:
                result = digests(entries)
            del entries
        result["first_s"] = times[0]
        result["warm_s"] = sorted(times[1:])[len(times[1:]) // 2]
        return result
    raise SystemExit(f"unknown op {op}")


def main(open_driver: Any) -> None:
    """``open_driver(dsn, workdir) -> Driver``; argv: OP DSN WORKLOAD WORKDIR."""
    op, dsn, workload_path, workdir = sys.argv[1:5]
    with open(workload_path, "rb") as f:
        workload = json.load(f)
    driver = open_driver(dsn, workdir)
    try:
        result = run(op, driver, workload)
    finally:
        driver.close()
    sys.stdout.write(json.dumps(result) + "\n")
