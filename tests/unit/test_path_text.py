"""A file name as text a database stores and a terminal shows (``core.fsio.path_text``): a
byte that is not UTF-8 as ``\\xff``, as Python's ``backslashreplace`` decoding writes it."""

from __future__ import annotations

import os

from hypothesis import given
from hypothesis import strategies as st

from core.fsio import path_text


@given(st.binary(max_size=64))
def test_a_name_from_its_bytes_is_its_backslashreplace_decoding(name: bytes) -> None:
    text = path_text(os.fsdecode(name))
    assert text == name.decode("utf-8", "backslashreplace")  # the independent oracle
    text.encode("utf-8")  # no lone surrogate left: strict UTF-8 encodes it


@given(st.text(st.characters(exclude_categories=())))  # lone surrogates too
def test_a_utf8_name_is_unchanged(name: str) -> None:
    lone = any(0xD800 <= ord(c) <= 0xDFFF for c in name)
    assert (path_text(name) == name) is not lone


def test_other_lone_surrogates_are_escaped_as_code_points() -> None:
    assert path_text("a\ud800b\udfff") == "a\\ud800b\\udfff"
    assert path_text("\udc7f\udc80") == "\\udc7f\\x80"  # U+DC7F is no byte os.fsdecode makes
