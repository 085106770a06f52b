"""Bench-only Celery task, loaded into the benchmark's worker with ``-I bench.noop_tasks``.

``bench.noop`` takes the same arguments as ``sessionstore.append`` and returns a result of
about the same size, but touches no database: it is the Celery floor that the queue path is
compared with (same broker, same result backend, same serializer, same worker settings).
"""

from __future__ import annotations

from typing import Any

from tasks.app import sessionstore_task

NOOP_TASK = "bench.noop"


@sessionstore_task(name=NOOP_TASK)
def noop(
    session_id: str,
    events: list[Any],
    expected_seq: int | None = None,
    idempotency_key: str | None = None,
) -> dict[str, Any]:
    n = len(events)
    return {
        "status": "ok",
        "session_id": session_id,
        "first_seq": 1,
        "last_seq": n,
        "positions": list(range(1, n + 1)),
        "replayed": False,
    }
