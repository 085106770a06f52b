"""Invariant 11: usage numbers cannot break a session (issue 16, item 6), both backends."""

from __future__ import annotations

import math
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from core import SessionStore
from core.errors import InvalidEvent
from core.journal.usage import INT64_MAX, INT64_MIN, check_usage
from core.records import PreparedEvent
from tests.support import watch_log


def assistant(usage: dict[str, Any], entry_id: str = "a1") -> dict[str, Any]:
    return {
        "type": "message",
        "id": entry_id,
        "parentId": None,
        "message": {"role": "assistant", "content": [], "usage": usage},
    }


BAD = [
    ({"input": 2**63}, "/message/usage/input"),
    ({"output": -(2**63) - 1}, "/message/usage/output"),
    ({"cacheRead": 2**70}, "/message/usage/cacheRead"),
    ({"cacheWrite": 1e300}, "/message/usage/cacheWrite"),
    ({"totalTokens": math.inf}, "/message/usage/totalTokens"),
    ({"cost": math.nan}, "/message/usage/cost"),
    ({"cost": {"total": -math.inf}}, "/message/usage/cost/total"),
    ({"cost": {"input": 2**64}}, "/message/usage/cost/input"),
]


@pytest.mark.parametrize(("usage", "field"), BAD)
def test_huge_and_non_finite_usage_is_refused_naming_the_field(
    store: SessionStore, usage: dict[str, Any], field: str
) -> None:
    session = store.create_session(tenant_id="t")
    with pytest.raises(InvalidEvent) as caught:
        store.append(session.id, [assistant({"input": 1}), assistant(usage, "a2")])
    assert caught.value.field == field and caught.value.index == 1
    assert store.get_session(session.id).head_seq == 0


@hsettings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    value=st.one_of(
        st.integers(min_value=-(2**80), max_value=2**80),
        st.floats(allow_nan=True, allow_infinity=True),
    ),
    name=st.sampled_from(["input", "output", "cacheRead", "cacheWrite", "totalTokens", "cost"]),
)
def test_usage_check_accepts_exactly_the_finite_int64_numbers(value: Any, name: str) -> None:
    ok = math.isfinite(value) and INT64_MIN <= value <= INT64_MAX
    try:
        check_usage(assistant({name: value}))
    except InvalidEvent as exc:
        assert not ok and exc.field == f"/message/usage/{name}"
    else:
        assert ok


def _raw(store: SessionStore, session_id: str, texts: list[bytes]) -> None:
    """Old data: events written straight to the journal, around every write check."""
    events = [
        PreparedEvent(type=str(orjson.loads(t)["type"]), payload={}, encoded=t) for t in texts
    ]
    store.journal.append(session_id, events)


def _old_usage(n: int, usage: str) -> bytes:
    return (
        b'{"type":"message","id":"o%d","parentId":null,'
        b'"message":{"role":"assistant","content":[],"usage":%s}}' % (n, usage.encode())
    )


def test_state_and_stats_survive_stored_numbers_that_overflow(
    store: SessionStore, caplog: pytest.LogCaptureFixture
) -> None:
    watch_log(caplog, "core.journal.usage")
    # valid one by one, but their sum overflows int64 (SQLite's sum() raised on it)
    near = store.create_session(tenant_id="t")
    store.append(near.id, [assistant({"input": INT64_MAX}, f"a{i}") for i in range(3)])
    # beyond what the write check allows: written before it existed
    old = store.create_session(tenant_id="t")
    _raw(
        store,
        old.id,
        [
            _old_usage(1, '{"input":18446744073709551615,"cost":{"total":1e308}}'),
            _old_usage(2, '{"input":18446744073709551615,"cost":{"total":1e308}}'),
            _old_usage(3, '{"output":1180591620717411303424,"totalTokens":-1e300}'),
        ],
    )
    ok = store.create_session(tenant_id="u")
    store.append(ok.id, [assistant({"input": 5, "cost": {"total": 0.5}})])

    for session in (near, old, ok):
        for _ in range(2):  # the second call may come from a snapshot
            usage = store.state(session.id).counters.usage
            for value in (usage.input, usage.output, usage.total_tokens, usage.cost):
                assert INT64_MIN <= value <= INT64_MAX
    assert store.state(near.id).counters.usage.input == INT64_MAX
    assert store.state(ok.id).counters.usage.input == 5

    for tenant in (None, "t", "u"):
        tokens = store.stats(tenant_id=tenant).tokens
        for value in (tokens.input, tokens.output, tokens.total_tokens, tokens.cost):
            assert INT64_MIN <= value <= INT64_MAX and not math.isnan(value)
        orjson.dumps(tokens.input)  # what the CLI prints must be encodable
    assert store.stats(tenant_id="t").tokens.input == INT64_MAX
    assert store.stats(tenant_id="u").tokens.input == 5
    assert any("saturated" in r.getMessage() for r in caplog.records)
