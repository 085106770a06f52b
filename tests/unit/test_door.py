"""``check_write``: the producer's door and the worker's check are one function.

Every bad-input class raises ``InvalidEvent`` naming where it is; nothing else escapes
(no kombu ``EncodeError``, no ``RecursionError``); a write it accepts encodes as JSON.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from core.errors import InvalidEvent, WriteTooLarge
from core.journal.validation import check_write

LIMITS = {"max_events": 50, "max_depth": 64, "max_bytes": 64 * 1024}


def nest(levels: int) -> Any:
    value: Any = 0
    for _ in range(levels):
        value = [value]
    return value


BAD: list[tuple[str, Any, dict[str, Any], str]] = [
    ("deep", [{"type": "n", "v": nest(900)}], {}, "/v/0/0"),
    ("lone surrogate value", [{"type": "n", "t": "\ud800"}], {}, "/t"),
    ("lone surrogate key", [{"type": "n", "\udc00": 1}], {}, ""),
    ("int key", [{"type": "n", "m": {1: 2}}], {}, "/m"),
    ("NUL key", [{"type": "n", "a\x00": 1}], {}, ""),
    ("NaN", [{"type": "n", "v": float("nan")}], {}, "/v"),
    ("infinity", [{"type": "n", "v": [float("inf")]}], {}, "/v/0"),
    ("set", [{"type": "n", "v": {1, 2}}], {}, "/v"),
    ("object", [{"type": "n", "v": object()}], {}, "/v"),
    ("not a list", {"type": "n"}, {}, ""),
    ("NUL session", [{"type": "n"}], {"session_id": "s\x00"}, "session_id"),
    ("surrogate session", [{"type": "n"}], {"session_id": "s\ud800"}, "session_id"),
    ("int session", [{"type": "n"}], {"session_id": 7}, "session_id"),
    ("NUL key id", [{"type": "n"}], {"idempotency_key": "k\x00"}, "idempotency_key"),
    ("seq above 2^63", [{"type": "n"}], {"expected_seq": 2**63}, "expected_seq"),
    ("negative seq", [{"type": "n"}], {"expected_seq": -1}, "expected_seq"),
    ("bool seq", [{"type": "n"}], {"expected_seq": True}, "expected_seq"),
]


@pytest.mark.parametrize(("case", "events", "fields", "path"), BAD, ids=[b[0] for b in BAD])
def test_each_bad_input_class_is_refused_with_its_path(
    case: str, events: Any, fields: dict[str, Any], path: str
) -> None:
    kwargs: dict[str, Any] = {"session_id": "s", "idempotency_key": "k", **fields}
    session_id = kwargs.pop("session_id")
    with pytest.raises(InvalidEvent) as info:
        check_write(session_id, events, **kwargs, **LIMITS)
    assert info.value.field.startswith(path), (case, info.value.field)


def test_integers_of_any_size_pass_the_door() -> None:
    """Exact values (invariant 11): 2**80 is a value like any other, not bad input."""
    assert check_write("s", [{"type": "n", "v": 2**80, "w": -(2**200)}], **LIMITS) > 0


def test_size_is_checked_on_the_encoded_write() -> None:
    with pytest.raises(WriteTooLarge, match="bytes"):
        check_write("s", [{"type": "n", "p": "x" * 70_000}], **LIMITS)
    size = check_write("s", [{"type": "n", "p": "é"}], **LIMITS)
    assert size == len(
        json.dumps([{"type": "n", "p": "é"}], separators=(",", ":"), ensure_ascii=False).encode()
    )


json_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(2**70), max_value=2**70),
        st.floats(),
        st.text(st.characters(codec="utf-8", exclude_categories=())),
        st.sampled_from(["\ud800", "\x00", "a\udfffb"]),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(
            st.one_of(st.text(max_size=3), st.integers(), st.just("\ud800")), inner, max_size=3
        ),
    ),
    max_leaves=12,
)


@given(value=json_values, depth=st.integers(min_value=0, max_value=120))
def test_accepted_or_invalid_event_nothing_else(value: Any, depth: int) -> None:
    events = [{"type": "n", "v": value, "deep": nest(depth)}]
    try:
        check_write("s", events, idempotency_key="k", **LIMITS)
    except InvalidEvent:
        return
    json.dumps(events, allow_nan=False).encode("utf-8")  # what is accepted encodes
