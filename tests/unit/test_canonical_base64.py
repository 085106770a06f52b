"""``canonical_base64`` (``pybase64``) gives the standard library's answer: strict decode,
then encode again and compare. The two libraries' strict decoders differ on their own (the
standard library accepts ``"0000="``, a whole quantum plus a stray pad; ``pybase64`` refuses
it), so the check is of the whole definition, not of the decoder."""

from __future__ import annotations

import base64
import binascii

import pybase64
import pytest
from hypothesis import given
from hypothesis import strategies as st

from core.blobs.externalize import canonical_base64

_ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


def reference(text: str) -> bytes | None:
    """The definition: strict decode, then encode again and compare."""
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return None
    return raw if base64.b64encode(raw) == text.encode("ascii") else None


@st.composite
def almost_base64(draw: st.DrawFn) -> str:
    """Valid encodings, then with the last characters, the padding or the length damaged."""
    text = base64.b64encode(draw(st.binary(max_size=64))).decode()
    for _ in range(draw(st.integers(0, 3))):
        where = draw(st.integers(0, len(text)))
        what = draw(st.sampled_from([*_ALPHABET, "=", "==", "\n", " ", "-", "_", "é", ""]))
        cut = draw(st.integers(0, 2))
        text = text[:where] + what + text[where + cut :]
    return text


@given(almost_base64())
def test_agrees_with_the_definition_near_valid_base64(text: str) -> None:
    assert canonical_base64(text) == reference(text)


@given(st.text(alphabet=_ALPHABET + "=\n é\x00\ud800", max_size=40))
def test_agrees_with_the_definition_on_any_text(text: str) -> None:
    assert canonical_base64(text) == reference(text)


def test_every_last_character_before_padding() -> None:
    for c in _ALPHABET:
        for text in (f"AA{c}=", f"A{c}==", f"AAAAAA{c}="):
            assert canonical_base64(text) == reference(text), text


def test_where_the_two_strict_decoders_differ() -> None:
    with pytest.raises(binascii.Error):  # why the definition is checked whole
        pybase64.b64decode("0000=", validate=True)
    assert base64.b64decode("0000=", validate=True) == b"\xd3M4"
    # the standard library decodes these; encoding again does not give them back
    for text in ("0000=", "QQ===", "AAAA===="):
        assert reference(text) is None
        assert canonical_base64(text) is None, text


@given(st.binary(min_size=1, max_size=200_000))
def test_large_values_round_trip(data: bytes) -> None:
    text = base64.b64encode(data).decode()
    assert canonical_base64(text) == data
    assert canonical_base64(text + "=") is None
