"""The no-walk fast path decides exactly as the walks do.

``validation.plain_json`` lets an event skip the validation walk, and ``Persister.plan``
skips the externalization walk when the event's JSON shows nothing to strip or store as a
blob. Both are pure speed-ups: these properties compare them with the walks alone.
"""

from __future__ import annotations

import contextlib
import datetime
import decimal
import math
import uuid
from collections import OrderedDict
from typing import Any, cast
from unittest import mock

import orjson
import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from core import exact_json
from core.blobs.externalize import Persister
from core.errors import InvalidEvent
from core.journal import validation
from tests.contract.test_rehydrate import IMAGE_MIN, INLINE_LIMIT
from tests.contract.test_rehydrate import events as rich_events

MAX_DEPTH = 6

# Values the walk rejects or that orjson would coerce, next to ordinary ones.
awkward_scalars = st.one_of(
    st.text(max_size=8),  # includes lone surrogates and U+0000
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.none(),
    st.sampled_from(
        [
            datetime.datetime(2026, 11, 21, tzinfo=datetime.UTC),
            uuid.UUID(int=7),
            decimal.Decimal("1.5"),
            b"raw",
            frozenset({1}),
            2**63,
            2**64 - 1,
            2**64,
            -(2**63) - 1,
            -0.0,
            math.nan,
            math.inf,
            -math.inf,
            (1, 2),
            "a\x00b",
            "blob:sha256:" + "a" * 64,
        ]
    ),
)
awkward_keys = st.one_of(
    st.text(max_size=4), st.sampled_from(["type", "image_url", "partialJson", 1, None])
)


def _awkward_containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(awkward_keys, children, max_size=3),
        st.dictionaries(st.text(max_size=3), children, max_size=2).map(OrderedDict),
    )


awkward_values = st.recursive(awkward_scalars, _awkward_containers, max_leaves=10)
awkward_events = st.builds(
    lambda body, kind: {**body, "type": kind},  # a string type: what the fast path is about
    st.dictionaries(st.text(max_size=4), awkward_values, max_size=4),
    st.sampled_from(["message", "m"]),
)


# Ordinary values with one awkward value among them: the one thing to catch is that value
# (above, most events hold several, and any one of them decides).
clean_scalars = st.one_of(
    st.text(st.characters(exclude_categories=["Cs"], exclude_characters="\x00"), max_size=8),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    st.booleans(),
    st.none(),
)
clean_values = st.recursive(
    clean_scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=3), st.dictionaries(st.text(max_size=3), children, max_size=3)
    ),
    max_leaves=10,
)
one_awkward_events = st.builds(
    lambda body, odd, where: {**body, "type": "m", "odd": odd if where else [{"in": odd}]},
    st.dictionaries(st.sampled_from(["a", "b", "c"]), clean_values, max_size=3),
    awkward_scalars,
    st.booleans(),
)


def verdict(event: Any, *, walk_only: bool) -> tuple[str, ...]:
    """What ``check_event`` says: accepted, or the field and reason of its rejection."""
    patch = mock.patch.object(validation, "plain_json", return_value=None)
    with patch if walk_only else contextlib.nullcontext():
        try:
            validation.check_event(event, index=0, max_depth=MAX_DEPTH)
        except InvalidEvent as exc:
            return ("rejected", exc.field, exc.reason)
    return ("accepted",)


# A large event is checked node by node instead of decoded and compared: both ways are held
# to the walk's verdict.
LARGE = "x" * 70_000


@pytest.mark.parametrize("padding", ["", LARGE], ids=["small", "large"])
@hsettings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=st.one_of(awkward_events, one_awkward_events))
def test_validation_fast_path_agrees_with_the_walk(body: dict[str, Any], padding: str) -> None:
    event = {**body, "pad": padding}
    assert verdict(event, walk_only=False) == verdict(event, walk_only=True)
    encoded = validation.plain_json(event, max_depth=MAX_DEPTH)
    if encoded is not None:
        assert verdict(event, walk_only=True) == ("accepted",)
        assert orjson.loads(encoded) == event
        assert encoded == exact_json.dumps(event)  # stored as is: what the journal writes


@pytest.mark.parametrize(
    "value",
    [
        math.nan,
        [1, math.inf],
        (1, 2),
        datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC),
        uuid.UUID(int=1),
        {"k\x00": 1},
        "a\x00b",
        2**64,
        {1: "x"},
    ],
)
@pytest.mark.parametrize("padding", ["", LARGE], ids=["small", "large"])
def test_fast_path_declines_what_it_cannot_vouch_for(value: Any, padding: str) -> None:
    event = {"type": "m", "v": value, "pad": padding}
    assert validation.plain_json(event, max_depth=MAX_DEPTH) is None


@pytest.mark.parametrize("padding", ["", "x" * 70_000])  # a large event is walked
def test_fast_path_depth_limit_is_exact(padding: str) -> None:
    # Many brackets but shallow: still fast; one level too deep: declined.
    wide = {"type": "m", "items": [{"a": [1]} for _ in range(50)], "pad": padding}
    assert validation.plain_json(wide, max_depth=4) is not None
    deep: dict[str, Any] = {"type": "m", "pad": padding}
    node = deep
    for _ in range(3):
        node["x"] = {}
        node = node["x"]
    assert validation.plain_json(deep, max_depth=4) is not None
    node["x"] = {}
    assert validation.plain_json(deep, max_depth=4) is None


def plan_parts(persister: Persister, events: list[dict[str, Any]], *, fast: bool) -> Any:
    encoded = [validation.plain_json(e, max_depth=64) for e in events] if fast else None
    plan = persister.plan(events, encoded)
    slots = [(s.event, s.pointer, s.data, s.encoding) for w in plan.walkers for s in w.slots]
    refs = [(r.event, r.pointer, r.hash) for w in plan.walkers for r in w.input_refs]
    return [exact_json.dumps(p) for p in plan.payloads], slots, refs, plan.encoded


@hsettings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events=st.lists(st.one_of(rich_events, awkward_events), min_size=1, max_size=4))
def test_externalization_fast_path_agrees_with_the_walk(events: list[dict[str, Any]]) -> None:
    events = [e for e in events if verdict(e, walk_only=True) == ("accepted",)]
    persister = Persister(
        cast(Any, None), image_min_base64_chars=IMAGE_MIN, inline_string_limit=INLINE_LIMIT
    )
    try:
        walked = plan_parts(persister, events, fast=False)
    except InvalidEvent as exc:  # a malformed ref in an image block: same error either way
        with pytest.raises(InvalidEvent) as again:
            plan_parts(persister, events, fast=True)
        assert (again.value.field, again.value.reason) == (exc.field, exc.reason)
        return
    fast = plan_parts(persister, events, fast=True)
    assert fast[:3] == walked[:3]
    for payload, encoded in zip(fast[0], fast[3], strict=True):
        assert encoded is None or encoded == payload  # what the journal will store


def test_events_with_something_to_do_are_walked() -> None:
    persister = Persister(cast(Any, None), image_min_base64_chars=4, inline_string_limit=64)
    cases = [
        {"type": "m", "partialJson": "{"},
        {"type": "m", "deep": {"jsonlEvents": []}},
        {"type": "m", "image_url": "data:image/png;base64,AAAA"},
        {"type": "m", "content": [{"type": "image", "data": "AAAA"}]},
        {"type": "m", "text": "x" * 65},
    ]
    for event in cases:
        [as_json] = persister.plan([event], [orjson.dumps(event)]).encoded
        assert as_json is None, event
    plain = {"type": "m", "text": "x" * 40}
    assert persister.plan([plain], [orjson.dumps(plain)]).encoded == [orjson.dumps(plain)]
