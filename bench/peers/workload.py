"""The peers' workload: a deterministic pi-format coding session, 400 turns long.

The first 200 turns are the issue's session (1,010 events, ~9 MB of JSON, 20 screenshots of
which 10 are distinct); turns 201-400 continue it the same way (another 20 screenshots, 10
new distinct ones) so storage growth can be measured. The same seed gives the same bytes.
"""

from __future__ import annotations

import random
from typing import Any

from tasks.cli.samples import EntryBuilder, png_bytes

TURNS = 200
HEADER_EVENTS = 10
WORDS = (
    "def return self if else for in import from class await async with try except raise "
    "None True False result value items config path session event store append read "
    "payload blob hash json encode decode retry timeout upload storage client request "
    "response status error message token cursor offset limit index query commit"
).split()


def screenshot(seed: int, width: int = 640, height: int = 400) -> bytes:
    """A PNG of ~165 KB: flat UI bands plus a noisy picture region that does not compress,
    as real screenshots with photos or anti-aliased text do not."""
    rng = random.Random(seed)
    rows = []
    for y in range(height):
        if 120 <= y < 205:
            rows.append(b"\x00" + rng.randbytes(width * 3))
        else:
            band = (y // 20 + seed) % 7
            pixel = bytes((40 + band * 30, 60 + (seed * 37) % 150, 90 + band * 20))
            rows.append(b"\x00" + pixel * width)
    return png_bytes(width, height, rows)


def code_text(rng: random.Random, size: int) -> str:
    """Code-like text of about ``size`` characters (compresses ~3-4x, as source does)."""
    lines: list[str] = []
    total = 0
    while total < size:
        indent = "    " * rng.randrange(4)
        line = indent + " ".join(rng.choice(WORDS) for _ in range(rng.randrange(3, 12)))
        line += f"  # {rng.randrange(10**6)}"
        lines.append(line)
        total += len(line) + 1
    return "\n".join(lines)


def session(turns: int = 2 * TURNS, *, seed: int = 19) -> list[dict[str, Any]]:
    """``turns`` turns of a coding session (5 events a turn) after 10 header events.

    Screenshots: one every 10 turns, a new distinct one every 20 turns (each shown twice).
    """
    rng = random.Random(seed)
    b = EntryBuilder()
    events: list[dict[str, Any]] = [
        {"type": "session", "version": 3, "id": "s-bench-19", "timestamp": "2026-11-21T09:00:00Z"}
    ]
    events.append(b.model_change("anthropic", "claude-sonnet-4"))
    events.append(b.thinking_level("medium"))
    events.append(b.session_info("bench: fix the flaky upload test"))
    while len(events) < HEADER_EVENTS:
        events.append(b._entry("custom", customType="bench.setup", data={"n": len(events)}))
    shots: dict[int, bytes] = {}
    for turn in range(turns):
        images: list[bytes] = []
        if turn % 10 == 5:
            distinct = turn // 20
            if distinct not in shots:
                shots[distinct] = screenshot(1000 + distinct)
            images = [shots[distinct]]
        events.append(b.user(code_text(rng, rng.randrange(80, 400)), images=images))
        call = f"toolu_{turn:05d}_a"
        events.append(
            b.assistant(
                code_text(rng, rng.randrange(200, 900)),
                thinking=code_text(rng, rng.randrange(100, 600)),
                tool_calls=[(call, "read", {"path": f"src/app/mod_{turn % 37}.py"})],
                tokens=(1500 + 40 * turn, rng.randrange(100, 900)),
            )
        )
        events.append(b.tool_result(call, "read", code_text(rng, rng.randrange(6000, 18000))))
        call = f"toolu_{turn:05d}_b"
        events.append(
            b.assistant(
                code_text(rng, rng.randrange(100, 500)),
                tool_calls=[(call, "bash", {"command": f"pytest -x tests/test_{turn % 11}.py"})],
                tokens=(1600 + 40 * turn, rng.randrange(100, 600)),
            )
        )
        events.append(b.tool_result(call, "bash", code_text(rng, rng.randrange(3000, 11500))))
    return events


def split(events: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The 200-turn session and the events of turns 201-400."""
    cut = HEADER_EVENTS + 5 * TURNS
    return events[:cut], events[cut:]
