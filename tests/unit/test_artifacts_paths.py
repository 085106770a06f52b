"""The canonical path sanitizer, tool-type/agent-name tokens and session directories."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.artifacts.paths import (
    FILES_DIR,
    contained_path,
    decode_component,
    encode_component,
    sanitize_agent_name,
    sanitize_path,
    sanitize_tool_type,
    session_dir,
)
from core.errors import InvalidArtifactPath

# --- the path rules, at their boundaries ----------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "canonical"),
    [
        ("notes/a.md", "notes/a.md"),
        ("a\\b\\c.txt", "a/b/c.txt"),  # backslashes become /
        ("a//b///c", "a/b/c"),  # repeated separators collapse
        ("a\\\\b", "a/b"),
        ("dir/", "dir"),  # trailing slash dropped
        ("dir///", "dir"),
        ("a.b/c..d/e.", "a.b/c..d/e."),  # dots inside names are fine
        ("CONSOLE.txt", "CONSOLE.txt"),  # only the exact device names are reserved
        ("COM10", "COM10"),
        ("LPT0", "LPT0"),
        ("日本語/ファイル.txt", "日本語/ファイル.txt"),
        ("with space/x y", "with space/x y"),
    ],
)
def test_accepted_paths_are_canonicalized(raw: str, canonical: str) -> None:
    assert sanitize_path(raw) == canonical


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        ("", "empty path"),
        ("///", "absolute"),
        ("/etc/passwd", "absolute"),
        ("\\server\\share", "absolute"),
        ("C:/x", "':'"),
        ("a:b", "':'"),
        ("a/./b", "'.' components"),
        (".", "'.' components"),
        ("a/../b", "'..' components"),
        ("..", "'..' components"),
        ("..\\x", "'..' components"),
        (".env", "hidden component"),
        ("a/.git/config", "hidden component"),
        ("a\x00b", "NUL"),
        ("a\nb", "control character U+000A"),
        ("a\x1fb", "control character U+001F"),
        ("a\x7fb", "control character U+007F"),
        ("a\x85b", "control character U+0085"),
        ("a\ud800b", "unpaired surrogate"),
    ],
)
def test_rejected_paths_name_the_rule(raw: str, reason: str) -> None:
    with pytest.raises(InvalidArtifactPath) as info:
        sanitize_path(raw)
    assert reason in info.value.message
    assert info.value.to_dict()["reason"]


@pytest.mark.parametrize(
    "name",
    [
        "CON",
        "con",
        "Con.txt",
        "PRN.tar.gz",
        "aux",
        "NUL.log",
        "nul",
        "COM1",
        "com9.txt",
        "LPT1",
        "lpt9.md",
        "CON .txt",
        "dir/AUX",
    ],
)
def test_windows_reserved_names_are_rejected(name: str) -> None:
    with pytest.raises(InvalidArtifactPath, match="reserved device name"):
        sanitize_path(name)


def test_path_length_limit_is_256_characters() -> None:
    ok = "/".join(["a" * 127] * 2)  # 255
    assert sanitize_path(ok + "b") == ok + "b"  # 256
    with pytest.raises(InvalidArtifactPath, match="longer than 256 characters"):
        sanitize_path(ok + "bc")  # 257
    # measured on the canonical form: collapsed separators do not count
    assert sanitize_path("a" + "/" * 300 + "b") == "a/b"


def test_component_length_limit_is_128_characters() -> None:
    assert sanitize_path("x" * 128) == "x" * 128
    with pytest.raises(InvalidArtifactPath, match="component longer than 128 characters"):
        sanitize_path("x" * 129)
    with pytest.raises(InvalidArtifactPath, match="component longer than 128"):
        sanitize_path("ok/" + "x" * 129)


def test_component_byte_limit_protects_the_file_name_limit() -> None:
    assert sanitize_path("é" * 127) == "é" * 127  # 254 bytes
    with pytest.raises(InvalidArtifactPath, match="255 bytes"):
        sanitize_path("🙂" * 64)  # 64 characters, 256 bytes


def test_non_string_path_is_rejected() -> None:
    with pytest.raises(InvalidArtifactPath, match="must be a string"):
        sanitize_path(b"a.txt")  # type: ignore[arg-type]


# --- property: nothing accepted escapes the session directory ---------------------------------

_PIECES = st.sampled_from(
    ["..", ".", "", "a", "b.txt", "\\", "/", "//", ":", "CON", ".hidden", "~", "%2e%2e", "…"]
)
_ANY_PATH = st.one_of(
    st.text(max_size=300),
    st.lists(st.one_of(_PIECES, st.text(max_size=8)), max_size=12).map("/".join),
    st.lists(st.one_of(_PIECES, st.text(max_size=8)), max_size=12).map("".join),
)


@settings(max_examples=600, deadline=None)
@given(raw=_ANY_PATH)
def test_no_accepted_path_escapes_the_session_directory(
    raw: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    base = tmp_path_factory.getbasetemp() / "prop" / "acme" / "session" / FILES_DIR
    base.mkdir(parents=True, exist_ok=True)
    try:
        rel = sanitize_path(raw)
    except InvalidArtifactPath:
        return
    real_base = os.path.realpath(base)
    real_target = os.path.realpath(base / rel)
    assert real_target.startswith(real_base + os.sep)
    assert contained_path(base, rel) == base / rel
    assert sanitize_path(rel) == rel  # canonical form is a fixed point


def test_contained_path_refuses_escape_through_a_symlink(tmp_path: Path) -> None:
    base = tmp_path / "files"
    base.mkdir()
    (base / "link").symlink_to(tmp_path)
    with pytest.raises(InvalidArtifactPath, match="outside the session directory"):
        contained_path(base, "link/secret")


# --- tool types and agent names --------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "token"),
    [
        ("bash", "bash"),
        ("my-tool_2", "my-tool_2"),
        ("mcp/server:tool", "mcp_server_tool"),
        ("../../etc", "etc"),
        ("a  b!!c", "a_b_c"),
        ("__x__", "x"),
        ("", "tool"),
        ("///", "tool"),
        ("日本語", "tool"),
        ("x" * 64, "x" * 64),
        ("x" * 65, "x" * 64),
        ("x" * 63 + "/y", "x" * 63),  # cut to 64 ("x…x_"), then stripped of "_"
    ],
)
def test_tool_type_is_sanitized(raw: str, token: str) -> None:
    assert sanitize_tool_type(raw) == token


def test_agent_names_fall_back_to_agent() -> None:
    assert sanitize_agent_name("Explore") == "Explore"
    assert sanitize_agent_name("code review") == "code_review"
    assert sanitize_agent_name("..") == "agent"


# --- tenant and session directory components --------------------------------------------------


@pytest.mark.parametrize(
    "tenant", ["acme", "ACME-co_1", ".", "..", "a/b", "a\\b", "t%20", "é", "~x", " ", "a.b"]
)
def test_tenant_component_is_path_safe_and_reversible(tenant: str) -> None:
    component = encode_component(tenant)
    assert component not in ("", ".", "..")
    assert "/" not in component and "\\" not in component and "." not in component
    assert decode_component(component) == tenant


def test_distinct_tenants_get_distinct_components() -> None:
    names = ["a/b", "a%2Fb", "a_b", "a-b", "A", "a", "..", "%2E%2E"]
    assert len({encode_component(n) for n in names}) == len(names)


def test_long_identifiers_use_a_digest_component() -> None:
    long_tenant = "ü" * 128  # 256 bytes -> 768 percent-encoded characters
    component = encode_component(long_tenant)
    assert component.startswith("~") and len(component) == 65
    assert decode_component(component) is None
    assert encode_component("ü" * 127) != component


def test_empty_identifier_is_refused() -> None:
    with pytest.raises(ValueError):
        encode_component("")


def test_session_dir_is_root_tenant_session(tmp_path: Path) -> None:
    assert session_dir(tmp_path, "acme", "s-1") == tmp_path / "acme" / "s-1"
    assert session_dir(tmp_path, "../x", "s") == tmp_path / "%2E%2E%2Fx" / "s"


def test_a_path_changing_while_it_is_resolved_is_refused_typed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """realpath lstat()s a link, then readlink()s what is by then a directory again: EINVAL.
    The race test met it as an untyped OSError under load."""
    import errno

    def racing(path: object, *args: object, **kwargs: object) -> str:
        raise OSError(errno.EINVAL, "Invalid argument", str(path))

    monkeypatch.setattr(os.path, "realpath", racing)
    with pytest.raises(InvalidArtifactPath, match="changed while it was resolved"):
        contained_path(tmp_path, "notes/plan.md")
