"""Usage numbers (``message.usage``) that cannot break a session (invariant 11).

At write, every usage number must be finite and inside int64, or the write is refused with
``InvalidEvent`` naming the field: these values are summed by folds, snapshots and SQL
stats, where a 2^70 or an infinity would fail every later read of the session. Data stored
before this check (or written around it) is still read: sums saturate at the int64 bounds,
with a warning, instead of failing.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from core.errors import InvalidEvent

log = logging.getLogger(__name__)

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
# float(INT64_MAX) rounds up to 2**63, outside the range: the largest float inside it.
_FLOAT_MAX = math.nextafter(float(2**63), 0.0)
TOKEN_FIELDS = ("input", "output", "cacheRead", "cacheWrite", "totalTokens")


def _bad_number(value: Any) -> str | None:
    """Why ``value`` cannot be a usage number; None if it can (or is not a number at all)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None  # not a number: folds and stats ignore it
    if isinstance(value, float) and not math.isfinite(value):
        return f"{value!r} is not a finite number"
    if not INT64_MIN <= value <= INT64_MAX:
        return "usage number outside the signed 64-bit range"
    return None


def check_usage(event: dict[str, Any], *, index: int | None = None) -> None:
    """Refuse a message event whose ``message.usage`` holds a number that sums cannot hold."""
    if event.get("type") != "message":
        return
    message = event.get("message")
    usage = message.get("usage") if isinstance(message, dict) else None
    if not isinstance(usage, dict):
        return
    for name in TOKEN_FIELDS:
        _check(usage.get(name), f"/message/usage/{name}", index)
    cost = usage.get("cost")
    if isinstance(cost, dict):
        for key, value in cost.items():
            _check(value, f"/message/usage/cost/{key}", index)
    else:
        _check(cost, "/message/usage/cost", index)


def _check(value: Any, field: str, index: int | None) -> None:
    reason = _bad_number(value)
    if reason is not None:
        raise InvalidEvent(field, reason, index=index)


def saturate(value: int | float, *, what: str) -> int | float:
    """``value`` clamped to int64 (NaN counts as 0), with a warning when it was outside."""
    if INT64_MIN <= value <= INT64_MAX:
        return value
    if isinstance(value, float) and math.isnan(value):
        clamped: int | float = 0.0
    else:
        bound = INT64_MAX if value > 0 else INT64_MIN
        clamped = (
            (_FLOAT_MAX if value > 0 else float(INT64_MIN)) if isinstance(value, float) else bound
        )
    log.warning(
        "usage sum out of range; saturated",
        extra={"field": what, "value": repr(value), "saturated_to": clamped},
    )
    return clamped
