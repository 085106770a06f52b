"""Serving the Prometheus metrics of a worker and its prefork children (multiprocess mode).

``serve_metrics`` must run before the first metric is created in this process and before
the pool forks: it points ``PROMETHEUS_MULTIPROC_DIR`` at a fresh directory, where every
process writes its samples, and serves their sum over HTTP.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from core.settings import Settings


def serve_metrics(port: int, directory: Path, *, addr: str = "127.0.0.1") -> int:
    """Start the ``/metrics`` HTTP server on ``addr:port`` (0: any free port); the port."""
    shutil.rmtree(directory, ignore_errors=True)  # samples of an earlier run are stale
    directory.mkdir(parents=True)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(directory)
    from prometheus_client import CollectorRegistry, multiprocess, start_http_server

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
    server, _thread = start_http_server(port, addr=addr, registry=registry)
    return int(server.server_port)


def serve_process_metrics(settings: Settings, port: int, addr: str, *, name: str) -> int:
    """``serve_metrics`` for a command's process (a worker and its children, a watcher),
    its samples under the data directory: ``metrics/<name>``."""
    return serve_metrics(port, settings.data_dir.resolve() / "metrics" / name, addr=addr)
