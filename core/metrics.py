"""Prometheus metrics: what operators scrape from workers (``sessionstore worker
--metrics-port N``).

The metrics are created on first use, not at import: prometheus_client picks its
multiprocess mode from ``PROMETHEUS_MULTIPROC_DIR`` when the first metric is built, and the
worker sets that variable before its prefork children start, so every child writes its
samples where the serving process collects them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
_LAG_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


@dataclass(frozen=True, slots=True)
class Metrics:
    writes: Any  # Counter{outcome, reason}: committed, rejected, retried
    events_appended: Any  # Counter
    append_seconds: Any  # Histogram: one SessionStore append (validate → commit)
    queue_lag_seconds: Any  # Histogram: enqueue → commit, queued writes
    dead_letters: Any  # Counter{reason}
    blob_bytes_put: Any  # Counter: bytes of new blobs written
    blob_bytes_deduplicated: Any  # Counter: bytes of puts that found their blob stored
    rehydrate_misses: Any  # Counter{reason}: missing or corrupt blobs left as refs
    fork_copy_seconds: Any  # Histogram
    fork_copy_bytes: Any  # Counter
    maintenance_runs: Any  # Counter{job}
    maintenance_removed: Any  # Counter{job}: blobs deleted by GC, artifacts by expiry
    import_bytes: Any  # Counter: session-file bytes imported
    import_entries: Any  # Counter: entries appended by imports


@functools.cache
def metrics() -> Metrics:
    from prometheus_client import Counter, Histogram

    return Metrics(
        writes=Counter("sessionstore_writes", "Queued writes by outcome", ["outcome", "reason"]),
        events_appended=Counter("sessionstore_events_appended", "Events appended"),
        append_seconds=Histogram(
            "sessionstore_append_seconds", "Append latency", buckets=_LATENCY_BUCKETS
        ),
        queue_lag_seconds=Histogram(
            "sessionstore_queue_lag_seconds", "Enqueue to commit", buckets=_LAG_BUCKETS
        ),
        dead_letters=Counter("sessionstore_dead_letters", "Writes dead-lettered", ["reason"]),
        blob_bytes_put=Counter("sessionstore_blob_bytes_put", "Bytes of new blobs stored"),
        blob_bytes_deduplicated=Counter(
            "sessionstore_blob_bytes_deduplicated", "Bytes of puts whose blob was stored"
        ),
        rehydrate_misses=Counter(
            "sessionstore_rehydrate_misses", "Blob refs left unresolved", ["reason"]
        ),
        fork_copy_seconds=Histogram(
            "sessionstore_fork_copy_seconds", "Fork artifact copy time", buckets=_LAG_BUCKETS
        ),
        fork_copy_bytes=Counter("sessionstore_fork_copy_bytes", "Bytes copied into forks"),
        maintenance_runs=Counter("sessionstore_maintenance_runs", "GC/expiry runs", ["job"]),
        maintenance_removed=Counter(
            "sessionstore_maintenance_removed", "Blobs or artifacts removed", ["job"]
        ),
        import_bytes=Counter("sessionstore_import_bytes", "Session-file bytes imported"),
        import_entries=Counter("sessionstore_import_entries", "Entries imported"),
    )
