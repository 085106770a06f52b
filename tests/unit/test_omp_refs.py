"""oh-my-pi blob refs on their own: resolved only to bytes that match their hash, anything
else kept and reported, and written back by the exporter's rule (a round trip)."""

from __future__ import annotations

import base64
import hashlib
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from core.interop.omp import MISSING_KEY, _BlobReader, _BlobWriter, _DirectoryBlobs, list_artifacts


def _ref(data: bytes) -> str:
    return "blob:sha256:" + hashlib.sha256(data).hexdigest()


def test_a_corrupt_blob_is_missing_not_data(tmp_path: Path) -> None:
    good, bad = b"\x89PNG good", b"\x89PNG bad"
    (tmp_path / _ref(good)[12:]).write_bytes(good)
    (tmp_path / _ref(bad)[12:]).write_bytes(b"tampered")
    url = b"\xff\xfe not utf-8"
    (tmp_path / _ref(url)[12:]).write_bytes(url)
    reader = _BlobReader(tmp_path)
    entry = {
        "content": [
            {"type": "image", "data": _ref(good), "mimeType": "image/png"},
            {"type": "image", "data": _ref(bad), "mimeType": "image/png"},
            {"type": "image", "data": "blob:sha256:../../etc/passwd", "mimeType": "x"},
        ],
        "image_url": _ref(url),
    }
    out = reader.resolve(entry)
    assert base64.b64decode(out["content"][0]["data"]) == good
    assert out["content"][1] == {
        "type": "image",
        "data": "",
        "mimeType": "image/png",
        MISSING_KEY: _ref(bad),
    }
    assert out["content"][2][MISSING_KEY] == "blob:sha256:../../etc/passwd"
    assert out["image_url"] == _ref(url)
    assert reader.missing == [_ref(bad), "blob:sha256:../../etc/passwd", _ref(url)]


def test_artifact_listing_skips_what_is_not_an_artifact(tmp_path: Path) -> None:
    names = ["10.bash.log", "2.read.log", "x.bash.log", "a.b.md", "a.b.jsonl", "notes.txt"]
    for name in [*names, ".artifact-2.json"]:
        (tmp_path / name).write_text(name)
    (tmp_path / "sub").mkdir()
    (tmp_path / "3.bash.log").symlink_to(tmp_path / "notes.txt")
    found = [(a.kind, a.artifact_id, a.tool_type) for a in list_artifacts(tmp_path)]
    assert found == [
        ("tool_output", "2", "read"),
        ("tool_output", "10", "bash"),
        ("sidecar", "a.b", None),
        ("agent_output", "a.b", None),
    ]


def test_a_linked_artifacts_directory_is_not_listed(tmp_path: Path) -> None:
    """Its files are not followed when they are links, nor is the directory itself."""
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "1.bash.log").write_text("not the session's")
    (tmp_path / "stem").symlink_to(tmp_path / "elsewhere")
    assert list_artifacts(tmp_path / "stem") == []
    assert [a.artifact_id for a in list_artifacts(tmp_path / "elsewhere")] == ["1"]


_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(
            st.sampled_from(["content", "image_url", "data", "type", "x"]), inner, max_size=4
        )
    ),
    max_leaves=12,
)
_images = st.builds(
    lambda data, small: {
        "type": "image",
        "data": base64.b64encode(data * (1 if small else 400)).decode(),
        "mimeType": "image/png",
    },
    st.binary(min_size=1, max_size=8),
    st.booleans(),
)


_payloads = _images.map(lambda image: {"data": image["data"], "mimeType": "image/webp"})


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.one_of(_images, _values), max_size=5),
    st.lists(st.one_of(_images, _payloads, _values), max_size=3),
    st.text(),
)
def test_write_then_read_gives_the_values_back(
    tmp_path_factory: Any, content: list[Any], images: list[Any], text: str
) -> None:
    root = tmp_path_factory.mktemp("blobs")
    message = {"content": content, "images": images, "frames": images, "note": text}
    entry = {"type": "message", "message": message}
    written = _BlobWriter(_DirectoryBlobs(root).put).externalize(entry)
    reader = _BlobReader(root)
    assert reader.resolve(written) == entry
    assert reader.missing == []
