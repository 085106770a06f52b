"""Rehydration from S3 with and without read-ahead (``core.blobs.rehydrate._ReadAhead``).

    python -m bench.read_ahead [--rounds 8] [--rtt-ms 0,20]

The peers' 200-turn session (``bench.peers.workload``: 1,010 events, 33 distinct blobs) is
appended to a fresh PostgreSQL database with its blobs on a moto S3 server (its own
process). Each round reads the session back exactly (``rehydrate=True``) with a reader that
has verified nothing yet (every blob is fetched), once one blob at a time (``read_ahead``
1, the code before) and once with the store's read-ahead, interleaved, alternating which
goes first. moto answers in about a millisecond on this machine; a real S3 round trip is
tens of milliseconds, so ``--rtt-ms`` adds that wait to every GET (a ``time.sleep`` in
``ObjectBlobStore._get``, before the request) to show what the overlap is worth there.
Medians with min-max, in ms.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.blobs_s3 import AWS_LOCAL, moto_server
from bench.peers.workload import session, split
from bench.pgdb import scratch_database, url
from core import SessionStore, Settings
from core.blobs import objects
from core.blobs.rehydrate import Rehydrator

BUCKET = "bench-read-ahead"
SESSION = "0b5e5510-0019-4000-8000-0000000000a8"


def _delayed(rtt: float) -> Callable[..., Any]:
    real = objects.ObjectBlobStore._get

    def get(self: objects.ObjectBlobStore, key: str) -> bytes | None:
        time.sleep(rtt)
        return real(self, key)

    return get


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--rtt-ms", default="0,20")
    args = parser.parse_args()
    first, _ = split(session())
    real_get = objects.ObjectBlobStore._get
    with moto_server() as endpoint, scratch_database("ahead", migrate=True) as name:
        os.environ.update({**AWS_LOCAL, "AWS_ENDPOINT_URL": endpoint})
        urllib.request.urlopen(urllib.request.Request(f"{endpoint}/{BUCKET}", method="PUT")).read()
        with tempfile.TemporaryDirectory(prefix="bench-ahead-") as tmp:
            settings = Settings(
                database_url=url(name), data_dir=Path(tmp), blob_url=f"s3://{BUCKET}/blobs"
            )
            with SessionStore.from_settings(settings) as store:
                store.journal.create_session(tenant_id="bench", session_id=SESSION)
                for i in range(0, len(first), 100):
                    store.append(SESSION, first[i : i + 100])
                default = store.blobs.read_ahead
                for rtt_ms in [float(x) for x in args.rtt_ms.split(",")]:
                    objects.ObjectBlobStore._get = _delayed(rtt_ms / 1e3) if rtt_ms else real_get  # type: ignore[method-assign]
                    times: dict[int, list[float]] = {1: [], default: []}
                    for rnd in range(args.rounds):
                        order = [1, default] if rnd % 2 == 0 else [default, 1]
                        for window in order:
                            store._rehydrator = Rehydrator(store.blobs, read_ahead=window)
                            started = time.perf_counter()
                            events = store.read(SESSION, rehydrate=True)
                            times[window].append(time.perf_counter() - started)
                            assert [e.payload for e in events] == first
                    objects.ObjectBlobStore._get = real_get  # type: ignore[method-assign]
                    seq, ahead = (statistics.median(times[w]) for w in (1, default))
                    print(
                        f"added wait per GET {rtt_ms:g} ms: one at a time "
                        f"{seq * 1e3:.0f} ms ({min(times[1]) * 1e3:.0f}-"
                        f"{max(times[1]) * 1e3:.0f}), read-ahead {default} "
                        f"{ahead * 1e3:.0f} ms ({min(times[default]) * 1e3:.0f}-"
                        f"{max(times[default]) * 1e3:.0f}): {seq / ahead:.2f}x"
                    )


if __name__ == "__main__":
    main()
