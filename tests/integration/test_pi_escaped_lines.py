"""pi lines holding a lone surrogate (kept escaped, ``pi.ESCAPED_LINE``) come back exactly
from the journal, on both backends, whatever they hold: lone surrogates in keys and values
at any depth, NUL, integers beyond 64 bits, -0.0, strings long enough to be blobs (a lone
surrogate in them too), and objects shaped like the escape itself."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from core.blobs.externalize import TRANSIENT_FIELDS
from core.exact_json import same_value
from core.interop import pi
from core.settings import Settings
from core.store import SessionStore
from tests.support import store_examples
from tests.unit.test_pi_format import with_lone_surrogates

_LIMIT = 64  # the inline string limit here: the long strings below are blobs
_CUT = "\ud83d"
# what the escape's own form, and the externalizer, read in an object's keys
_NAMES = st.sampled_from([pi.ESCAPED_STRING, pi.ESCAPED_OBJECT, *sorted(TRANSIENT_FIELDS)])
_short = with_lone_surrogates(st.text(st.characters(codec="utf-8"), max_size=8))  # NUL too
_long = st.builds(
    lambda before, cut, n: before + "x" * n + cut,
    _short,
    st.sampled_from(["", _CUT, "\x00", "\udc80y"]),
    st.integers(_LIMIT, 2 * _LIMIT),
)
_text = _short | _long
_key = _text | _NAMES
_scalar = (
    st.none()
    | st.booleans()
    | st.integers(-(2**200), 2**200)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.just(-0.0)
    | _text
)
_pieces = st.lists(_text | st.integers(0xD800, 0xDFFF) | st.integers(), max_size=3)


def _shaped(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Objects that look like an escape: one of its names over a list of pieces or of
    keys and values, or over anything."""
    members = st.lists(st.tuples(_key, inner), max_size=2).map(lambda m: [*sum(m, ())])
    return st.builds(lambda name, value: {name: value}, _NAMES, _pieces | members | inner)


_json = st.recursive(
    _scalar,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(_key, inner, max_size=3) | _shaped(inner)
    ),
    max_leaves=12,
) | st.builds(  # nested deep (its escape well inside the journal's max_event_depth)
    lambda depth, leaf: _nested(depth, leaf), st.integers(10, 25), _text
)
_FIXED = ("type", "id", "parentId", "timestamp", "message")
_extra = st.dictionaries(_key.filter(lambda k: k not in _FIXED), _json, max_size=2)
_counter = itertools.count()


def _nested(depth: int, leaf: Any) -> Any:
    for n in range(depth):
        leaf = [leaf] if n % 2 else {f"k{_CUT}" if n % 3 else "k": leaf}
    return leaf


@pytest.fixture
def small_store(settings: Settings) -> Any:
    with SessionStore.from_settings(settings.with_overrides(inline_string_limit=_LIMIT)) as s:
        yield s


@pytest.mark.slow
@store_examples(25)
@given(
    lines=st.lists(st.tuples(_text, _json, _extra), min_size=1, max_size=3),
)
def test_escaped_lines_come_back_exactly(
    small_store: SessionStore, tmp_path: Path, lines: list[tuple[str, Any, dict[str, Any]]]
) -> None:
    """Every line holds a lone surrogate (so it is kept escaped): the fold and the state
    read each message as pi does (the line itself, long as it is), the export writes the
    file back byte for byte, and a session imported from the export exports those bytes
    again."""
    store = small_store
    sid = f"s-{next(_counter)}"
    header = pi.new_header(sid, timestamp="2026-01-01T00:00:00.000Z", cwd="/w")
    entries: list[dict[str, Any]] = []
    for n, (text, data, extra) in enumerate(lines):
        message = {"role": "user", "content": [{"type": "text", "text": text}], "data": data}
        entries.append(
            {
                "type": "message",
                "id": f"m{n}",
                "parentId": f"m{n - 1}" if n else None,
                "timestamp": "2026-01-01T00:00:01.000Z",
                "message": message,
                "cut": _CUT,
                **extra,
            }
        )
    path = tmp_path / f"{sid}.jsonl"
    path.write_text("".join(pi.dumps_exact(line) + "\n" for line in [header, *entries]))
    result = store.import_session(path, tenant_id="acme")
    stored = store.read(result.session_id)[1:]
    assert all(e.type == pi.ESCAPED_LINE and "value" in e.payload for e in stored)
    state = store.state(result.session_id, rehydrate=True)
    assert len(state.messages) == state.counters.messages == len(entries)  # folded too
    for read, entry in zip(state.messages, entries, strict=True):
        assert same_value(read.data, entry["message"])
    exported = tmp_path / f"{sid}-out.jsonl"
    with exported.open("w", encoding="utf-8") as out:
        store.export_session(result.session_id, out)
    assert exported.read_bytes() == path.read_bytes()
    again = store.import_session(exported, tenant_id="other")
    twice = tmp_path / f"{sid}-twice.jsonl"
    with twice.open("w", encoding="utf-8") as out:
        store.export_session(again.session_id, out)
    assert twice.read_bytes() == path.read_bytes()
