"""A simulated agent: appends pi entries to session files in DIR for SECONDS, as pi does
(one JSON line per entry), sometimes pausing in the middle of a line.

    python -m tests.acceptance.pi_agent DIR SECONDS FILES
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path


def main(directory: Path, seconds: float, files: int) -> None:
    rng = random.Random(17)
    paths = [directory / f"2026-11-23T20-00-0{n}-000Z_agent-{n}.jsonl" for n in range(files)]
    parents: list[str | None] = [None] * files
    counts = [0] * files
    for n, path in enumerate(paths):
        header = {
            "type": "session",
            "version": 3,
            "id": f"agent-{n}",
            "timestamp": "2026-11-23T20:00:00.000Z",
            "cwd": f"/work/{n}",
        }
        path.write_text(json.dumps(header) + "\n")
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        n = rng.randrange(files)
        counts[n] += 1
        entry_id = f"{n}{counts[n]:07x}"
        entry = {
            "type": "message",
            "id": entry_id,
            "parentId": parents[n],
            "timestamp": "2026-11-23T20:00:01.000Z",
            "message": {
                "role": "user",
                "content": f"line {counts[n]} " + "x" * rng.randrange(200),
                "timestamp": 1795000000000 + counts[n],
            },
        }
        text = json.dumps(entry) + "\n"
        with paths[n].open("a") as out:
            if rng.random() < 0.1:  # a write caught half-way
                cut = rng.randrange(1, len(text) - 1)
                out.write(text[:cut])
                out.flush()
                time.sleep(rng.uniform(0.05, 0.3))
                out.write(text[cut:])
            else:
                out.write(text)
        parents[n] = entry_id
        time.sleep(rng.uniform(0.005, 0.05))
    print(json.dumps(counts))


if __name__ == "__main__":
    main(Path(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]))
