"""The peers' workload is the issue's session, and the same on every run."""

from __future__ import annotations

import base64

import orjson

from bench.peers.drivers.common import digests
from bench.peers.workload import session, split


def test_the_200_turn_session_has_the_issues_shape() -> None:
    first, second = split(session())
    assert len(first) == 1010
    assert 8.5e6 < sum(len(orjson.dumps(e)) for e in first) < 9.5e6
    images = [
        item["data"]
        for e in first
        if e["type"] == "message"
        for item in e["message"]["content"]
        if item["type"] == "image"
    ]
    assert len(images) == 20 and len(set(images)) == 10
    assert all(base64.b64decode(i).startswith(b"\x89PNG") for i in images)
    assert len(second) == 1000


def test_the_workload_is_deterministic_and_the_digest_sees_a_changed_image() -> None:
    a, b = session(20), session(20)
    assert orjson.dumps(a) == orjson.dumps(b)
    before = digests(a)
    shot = next(
        item
        for e in a
        if e["type"] == "message"
        for item in e["message"]["content"]
        if item["type"] == "image"
    )
    data = bytearray(base64.b64decode(shot["data"]))
    data[-20] ^= 1
    shot["data"] = base64.b64encode(bytes(data)).decode()
    after = digests(a)
    assert after["ids"] == before["ids"] and after["image_bytes"] != before["image_bytes"]
