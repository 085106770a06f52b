"""Import throughput: a directory of pi session files into the journal, vs appending the same
events the way ``sessionstore append`` does (``SessionStore.append`` in batches of 100).

    python -m bench.import_bench [--mb 100] [--rounds 3] [--backend postgres|sqlite|both]

The sessions are generated (not timed): user prompts, assistant answers with tool calls and
usage, tool results of 1-20 KB, and an image now and then. Each round imports the whole
directory into a fresh database and appends the same events into another fresh one; the
rounds alternate which goes first. Reported: medians (min-max) in MB/s of session file, and
import / append.
"""

from __future__ import annotations

import argparse
import base64
import os
import random
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import psycopg

from core import SessionStore, Settings
from core.interop.pi import loads_exact
from core.migrate import upgrade

ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"
APPEND_BATCH = 100  # ``sessionstore append``'s default --batch-size


def _entry(rng: random.Random, n: int, parent: str | None) -> dict[str, Any]:
    kind = n % 3
    message: dict[str, Any]
    if kind == 0:
        content: Any = "Please look at " + "the code " * rng.randrange(5, 60)
        if rng.random() < 0.02:
            image = base64.b64encode(rng.randbytes(6000)).decode()
            content = [
                {"type": "text", "text": content},
                {"type": "image", "data": image, "mimeType": "image/png"},
            ]
        message = {"role": "user", "content": content, "timestamp": 1795000000000 + n}
    elif kind == 1:
        message = {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Running it. " * rng.randrange(5, 40)},
                {
                    "type": "toolCall",
                    "id": f"call_{n}",
                    "name": "bash",
                    "arguments": {"command": f"pytest -k test_{n}"},
                },
            ],
            "provider": "anthropic",
            "model": "claude-sonnet-4-5",
            "usage": {
                "input": rng.randrange(10_000),
                "output": rng.randrange(2_000),
                "cacheRead": 0,
                "cacheWrite": 0,
                "totalTokens": rng.randrange(12_000),
                "cost": {"total": rng.random() / 100},
            },
            "stopReason": "toolUse",
            "timestamp": 1795000000000 + n,
        }
    else:
        output = "".join(
            f"line {i}: {'ok ' * rng.randrange(1, 30)}\n" for i in range(rng.randrange(10, 250))
        )
        message = {
            "role": "toolResult",
            "toolCallId": f"call_{n - 1}",
            "toolName": "bash",
            "content": [{"type": "text", "text": output}],
            "isError": False,
            "timestamp": 1795000000000 + n,
        }
    return {
        "type": "message",
        "id": f"{n:08x}",
        "parentId": parent,
        "timestamp": "2026-11-23T20:00:00.000Z",
        "message": message,
    }


def generate(directory: Path, megabytes: int, *, file_mb: float = 2.0) -> int:
    """Session files totalling ``megabytes``; returns the bytes written."""
    rng = random.Random(7)
    total, target, index = 0, megabytes * 1_000_000, 0
    while total < target:
        path = directory / f"project-{index % 7}" / f"2026-11-23T20-00-00-000Z_s{index:05d}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        header = {
            "type": "session",
            "version": 3,
            "id": f"s{index:05d}",
            "timestamp": "2026-11-23T20:00:00.000Z",
            "cwd": f"/work/{index % 7}",
        }
        lines, size, parent, n = [orjson.dumps(header)], 0, None, 0
        while size < file_mb * 1_000_000 and total + size < target:
            entry = _entry(rng, n, parent)
            line = orjson.dumps(entry)
            lines.append(line)
            size += len(line) + 1
            parent, n = entry["id"], n + 1
        data = b"\n".join(lines) + b"\n"
        path.write_bytes(data)
        total += len(data)
        index += 1
    return total


def _fresh_url(backend: str, tmp: Path) -> tuple[str, Callable[[], None]]:
    if backend == "sqlite":
        path = tmp / f"{uuid.uuid4().hex}.db"
        url = f"sqlite:///{path}"
        upgrade(url)

        def remove() -> None:
            for p in tmp.glob(f"{path.name}*"):
                p.unlink(missing_ok=True)

        return url, remove
    name = f"ss_bench_import_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    upgrade(url)

    def drop() -> None:
        with psycopg.connect(ADMIN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    return url, drop


def _run_import(store: SessionStore, files: list[Path]) -> None:
    for path in files:
        store.import_session(path, tenant_id="bench")


def _run_append(store: SessionStore, files: list[Path]) -> None:
    # what ``sessionstore append SESSION FILE`` does per file: parse lines, batches of 100
    for path in files:
        session = store.create_session(tenant_id="bench")
        events = [loads_exact(line) for line in path.read_bytes().splitlines() if line]
        for start in range(0, len(events), APPEND_BATCH):
            store.append(session.id, events[start : start + APPEND_BATCH])


def _timed(
    backend: str, tmp: Path, run: Callable[[SessionStore, list[Path]], None], files: list[Path]
) -> float:
    url, drop = _fresh_url(backend, tmp)
    try:
        settings = Settings(data_dir=tmp / uuid.uuid4().hex, database_url=url)
        with SessionStore.from_settings(settings) as store:
            start = time.perf_counter()
            run(store, files)
            return time.perf_counter() - start
    finally:
        drop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--backend", choices=["postgres", "sqlite", "both"], default="both")
    args = parser.parse_args()
    backends = ["postgres", "sqlite"] if args.backend == "both" else [args.backend]
    with tempfile.TemporaryDirectory(prefix="import-bench-") as raw:
        tmp = Path(raw)
        sessions = tmp / "sessions"
        total = generate(sessions, args.mb)
        files = sorted(sessions.rglob("*.jsonl"))
        mb = total / 1_000_000
        print(f"{len(files)} files, {mb:.1f} MB; load average {os.getloadavg()}")
        for backend in backends:
            imports: list[float] = []
            appends: list[float] = []
            for round_ in range(args.rounds):
                order = [("import", _run_import), ("append", _run_append)]
                for name, run in order if round_ % 2 == 0 else order[::-1]:
                    seconds = _timed(backend, tmp, run, files)
                    (imports if name == "import" else appends).append(seconds)
                    print(
                        f"  {backend} round {round_ + 1} {name}: {seconds:.1f} s "
                        f"({mb / seconds:.1f} MB/s)"
                    )
            rate = [mb / s for s in imports]
            append_rate = statistics.median([mb / s for s in appends])
            ratio = [a / i for i, a in zip(imports, appends, strict=True)]
            print(
                f"{backend}: import {statistics.median(rate):.1f} MB/s "
                f"({min(rate):.1f}-{max(rate):.1f}); append {append_rate:.1f} MB/s; "
                f"import/append throughput {statistics.median(ratio):.2f}x "
                f"({min(ratio):.2f}-{max(ratio):.2f}); load average {os.getloadavg()}"
            )


if __name__ == "__main__":
    main()
