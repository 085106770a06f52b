"""Realistic coding-agent session material in the pi entry format, for the demo and benches.

Deterministic: the same seed gives the same bytes, so repeated screenshots deduplicate.
"""

from __future__ import annotations

import base64
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any


def screenshot_png(seed: int, width: int = 320, height: int = 200) -> bytes:
    """A small, valid PNG that looks like a UI: bands of colour, different per seed."""
    rows = []
    for y in range(height):
        band = (y // 20 + seed) % 7
        base = (40 + band * 30, 60 + (seed * 37) % 150, 90 + band * 20)
        row = bytearray([0])  # filter: none
        for x in range(width):
            shade = 30 if (x // 40 + y // 20) % 5 == 0 else 0
            row += bytes(((base[0] + shade) % 256, (base[1] + shade) % 256, base[2] % 256))
        rows.append(bytes(row))
    return png_bytes(width, height, rows)


def png_bytes(width: int, height: int, rows: Sequence[bytes]) -> bytes:
    """An RGB PNG from its filtered scanlines (each row: a filter byte, then 3 bytes a pixel)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(b"".join(rows), 6))
        + chunk(b"IEND", b"")
    )


def image_block(png: bytes) -> dict[str, Any]:
    return {"type": "image", "mimeType": "image/png", "data": base64.b64encode(png).decode()}


def pytest_log(tests: int = 900) -> str:
    """A long pytest run with one flaky failure near the end (~100 KB)."""
    lines = [
        "============================= test session starts =============================",
        "platform linux -- Python 3.11.7, pytest-8.3.2, pluggy-1.5.0",
        f"collected {tests} items",
        "",
    ]
    for i in range(tests):
        module = f"tests/test_{['upload', 'auth', 'billing', 'search', 'api'][i % 5]}.py"
        lines.append(f"{module}::test_case_{i:04d} PASSED{' ' * 20}[{100 * (i + 1) // tests:3d}%]")
    lines += [
        "",
        "=================================== FAILURES ===================================",
        "___________________________ test_upload_retries_once ___________________________",
        "    def test_upload_retries_once(client, storage):",
        ">       assert storage.calls == 1",
        "E       assert 2 == 1",
        "E        +  where 2 = <FakeStorage calls=2>.calls",
        "tests/test_upload.py:88: AssertionError",
        f"{'=' * 27} 1 failed, {tests - 1} passed in 41.20s {'=' * 27}",
    ]
    return "\n".join(lines) + "\n"


def grep_output(matches: int = 700) -> str:
    """A wide search result (~50 KB): the kind of output that becomes a TTL artifact."""
    return "".join(
        f"src/app/{['upload', 'storage', 'retry', 'client'][i % 4]}.py:{10 + i}:"
        f"    result = storage.put(key=f'user/{{uid}}/{i}', data=payload, retries=RETRIES)\n"
        for i in range(matches)
    )


SUBAGENT_REPORT = """# Exploration: where uploads are retried

- `src/app/retry.py` wraps every storage call in `with_retries(max_attempts=3)`.
- `src/app/upload.py` *also* retries on `TimeoutError`, so a slow first attempt that
  eventually succeeds is retried once more by the outer loop: two calls.
- The flaky test depends on timing: the fake storage sleeps 50 ms, the outer timeout is 50 ms.

**Recommendation:** remove the outer retry; keep `with_retries` as the single policy.
"""


@dataclass
class EntryBuilder:
    """Builds pi-format entries with ``id``/``parentId`` links and increasing timestamps."""

    start: datetime = field(default_factory=lambda: datetime(2026, 11, 21, 9, 0, tzinfo=UTC))
    counter: int = 0
    leaf: str | None = None

    def _entry(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.counter += 1
        entry_id = f"{self.counter:08x}"
        stamp = self.start + timedelta(seconds=7 * self.counter)
        entry = {
            "type": kind,
            "id": entry_id,
            "parentId": self.leaf,
            "timestamp": stamp.isoformat().replace("+00:00", "Z"),
            **fields,
        }
        self.leaf = entry_id
        return entry

    def branch_from(self, entry_id: str) -> None:
        """Continue the tree from an earlier entry (a new branch)."""
        self.leaf = entry_id

    def model_change(self, provider: str, model_id: str) -> dict[str, Any]:
        return self._entry("model_change", provider=provider, modelId=model_id)

    def thinking_level(self, level: str) -> dict[str, Any]:
        return self._entry("thinking_level_change", thinkingLevel=level)

    def session_info(self, name: str) -> dict[str, Any]:
        return self._entry("session_info", name=name)

    def user(self, text: str, images: Sequence[bytes] = ()) -> dict[str, Any]:
        content: list[dict[str, Any]] = [{"type": "text", "text": text}]
        content += [image_block(png) for png in images]
        return self._entry("message", message={"role": "user", "content": content})

    def assistant(
        self,
        text: str,
        *,
        thinking: str | None = None,
        tool_calls: Sequence[tuple[str, str, dict[str, Any]]] = (),
        tokens: tuple[int, int] = (1500, 300),
    ) -> dict[str, Any]:
        content: list[dict[str, Any]] = []
        if thinking:
            content.append({"type": "thinking", "thinking": thinking, "thinkingSignature": "sig"})
        if text:
            content.append({"type": "text", "text": text})
        content += [
            {"type": "toolCall", "id": call_id, "name": name, "arguments": args}
            for call_id, name, args in tool_calls
        ]
        usage = {
            "input": tokens[0],
            "output": tokens[1],
            "cacheRead": 0,
            "cacheWrite": 0,
            "totalTokens": sum(tokens),
        }
        return self._entry(
            "message",
            message={
                "role": "assistant",
                "content": content,
                "provider": "anthropic",
                "model": "claude-sonnet-4",
                "usage": usage,
                "stopReason": "toolUse" if tool_calls else "stop",
            },
        )

    def tool_result(
        self,
        call_id: str,
        tool_name: str,
        text: str,
        *,
        images: Sequence[bytes] = (),
        is_error: bool = False,
        details: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        content: list[dict[str, Any]] = [{"type": "text", "text": text}]
        content += [image_block(png) for png in images]
        message: dict[str, Any] = {
            "role": "toolResult",
            "toolCallId": call_id,
            "toolName": tool_name,
            "content": content,
            "isError": is_error,
        }
        if details:
            message["details"] = details
        return self._entry("message", message=message)
