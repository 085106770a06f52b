"""CLI start-up time against ``celery --help``, side by side in one run.

    python -m bench.startup [--rounds 9]

Each round runs every command once, in a shuffled order (interleaved rounds: the machine's
load hits all of them alike). Reported: median and min-max wall time per command, and its
ratio to the median of ``celery --help``. Targets (issue 18): ``sessionstore --help`` and
``--version`` <= 0.6x, every subcommand's ``--help`` <= 1.0x.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

BIN = Path(sys.executable).parent
BASELINE = "celery --help"
TOP_TARGET = 0.6
SUB_TARGET = 1.0


def commands() -> dict[str, list[str]]:
    from tasks.cli import COMMANDS

    ss = str(BIN / "sessionstore")
    cases = {
        BASELINE: [str(BIN / "celery"), "--help"],
        "sessionstore --help": [ss, "--help"],
        "sessionstore --version": [ss, "--version"],
    }
    for name in COMMANDS:
        cases[f"sessionstore {name} --help"] = [ss, name, "--help"]
    return cases


def run_once(argv: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - started


def measure(cases: dict[str, list[str]], rounds: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in cases}
    names = list(cases)
    for name in names:  # warm the file cache once, unmeasured
        run_once(cases[name])
    for _ in range(rounds):
        random.shuffle(names)
        for name in names:
            times[name].append(run_once(cases[name]))
    return times


def report(times: dict[str, list[float]]) -> tuple[list[str], bool]:
    base = statistics.median(times[BASELINE])
    lines = [
        f"load average {' / '.join(f'{x:.1f}' for x in os.getloadavg())}, "
        f"{len(times[BASELINE])} interleaved rounds",
        "",
        "| command | median s | min-max s | ratio to celery --help | target |",
        "|---|---|---|---|---|",
    ]
    ok = True
    for name, samples in sorted(times.items(), key=lambda kv: statistics.median(kv[1])):
        median = statistics.median(samples)
        ratio = median / base
        if name == BASELINE:
            target = ""
        else:
            limit = TOP_TARGET if name.count(" ") == 1 else SUB_TARGET
            target = f"<= {limit}x {'ok' if ratio <= limit else 'MISSED'}"
            ok = ok and ratio <= limit
        lines.append(
            f"| `{name}` | {median:.3f} | {min(samples):.3f}-{max(samples):.3f} "
            f"| {ratio:.2f}x | {target} |"
        )
    return lines, ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    lines, ok = report(measure(commands(), args.rounds))
    print("\n".join(lines))
    print("all targets met" if ok else "some targets MISSED")


if __name__ == "__main__":
    main()
