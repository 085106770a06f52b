"""oh-my-pi's layout through the importer, on both backends: artifact ids kept, blob refs
resolved to the original bytes, a missing blob kept and reported, re-imports, a failed
artifact write retried, and ``export_omp`` reproducing the layout."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import shutil
from pathlib import Path

import pytest

from core.artifacts import ArtifactManager
from core.errors import ImportInterrupted, InvalidArtifactPath, ResolveNotFound
from core.interop import omp
from core.interop.model import ArtifactFile
from core.interop.omp import export_omp, parse_omp
from core.store import SessionStore
from tests.support import watch_log

AGENT = Path(__file__).resolve().parents[1] / "fixtures" / "omp" / "agent"
STEM = "2026-01-22T08-30-00-000Z_9b1e4c7a2f3d4e5f"
PROJECT = AGENT / "sessions" / "--home-dev-webapp--"
SESSION_FILE = PROJECT / f"{STEM}.jsonl"
ARTIFACTS = PROJECT / STEM
BLOBS = AGENT / "blobs"
IMAGE_REF = "blob:sha256:3d07e0dd108320931e76e4142395ffd27981c97de8d2ec5981bc43e0629ca270"
URL_REF = "blob:sha256:9acaebe98b9e02bd1ccc8601586b893f1ae40b3e4b4c2f61c6c9eaa45027004e"
MISSING_REF = "blob:sha256:" + hashlib.sha256(b"gone").hexdigest()
TENANT = "acme"


@pytest.fixture
def layout(tmp_path: Path) -> Path:
    """A writable copy of the fixture's agent directory; returns its session file."""
    shutil.copytree(AGENT, tmp_path / "agent")
    return tmp_path / "agent" / "sessions" / "--home-dev-webapp--" / f"{STEM}.jsonl"


def test_detection_and_blob_resolution_without_a_store() -> None:
    from core.interop.importer import detect_format

    assert detect_format(SESSION_FILE, SESSION_FILE.read_bytes()[:65536]) == "omp"
    parsed = parse_omp(SESSION_FILE, SESSION_FILE.read_bytes())
    assert parsed.missing_blobs == [MISSING_REF]
    image = parsed.entries[3].entry["message"]["content"][1]
    assert base64.b64decode(image["data"]) == (BLOBS / IMAGE_REF[12:]).read_bytes()
    kinds = [(a.kind, a.artifact_id) for a in parsed.artifacts]
    assert kinds == [
        ("tool_output", "0"),
        ("tool_output", "1"),
        ("sidecar", "explore"),
        ("agent_output", "explore"),
    ]


def test_detected_by_a_blob_ref_far_into_the_file(store: SessionStore, tmp_path: Path) -> None:
    """No artifacts directory and the first ref past 64 KiB: still oh-my-pi (its header is
    pi's), so the ref is resolved instead of failing as plain pi's unknown blob."""
    project = tmp_path / "agent" / "sessions" / "--w--"
    project.mkdir(parents=True)
    (tmp_path / "agent" / "blobs").mkdir()
    raw = bytes(range(256)) * 12
    blob_hash = hashlib.sha256(raw).hexdigest()
    (tmp_path / "agent" / "blobs" / blob_hash).write_bytes(raw)
    image = {"type": "image", "data": f"blob:sha256:{blob_hash}", "mimeType": "image/png"}
    lines = [
        {"type": "session", "version": 3, "id": "late-ref", "timestamp": "2026-01-01Z"},
        {"type": "message", "id": "a1", "parentId": None, "message": {"content": "y" * 70_000}},
        {"type": "message", "id": "a2", "parentId": "a1", "message": {"content": [image]}},
    ]
    path = project / "2026_late-ref.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = store.import_session(path, tenant_id=TENANT)
    assert (result.format, result.missing_blobs) == ("omp", [])
    last = store.read(result.session_id, rehydrate=True)[-1].payload
    assert base64.b64decode(last["message"]["content"][0]["data"]) == raw


def test_import_keeps_artifact_ids_and_resolves_refs(store: SessionStore) -> None:
    result = store.import_session(SESSION_FILE, tenant_id=TENANT)
    assert (result.format, result.appended, result.missing_blobs) == ("omp", 14, [MISSING_REF])
    sid = result.session_id
    for url, name in (("artifact://0", "0.bash.log"), ("artifact://1", "1.read.log")):
        assert store.resolve(url, session_id=sid).content == (ARTIFACTS / name).read_text()
    assert store.resolve("agent://explore", session_id=sid).content == (
        (ARTIFACTS / "explore.md").read_text()
    )
    sidecar = store.artifacts(sid).directory() / "explore.jsonl"
    assert sidecar.read_bytes() == (ARTIFACTS / "explore.jsonl").read_bytes()
    # our refs are oh-my-pi's refs: the same hash of the same bytes
    stored = store.read(sid, after_seq=4, upto_seq=5)[0].payload
    assert stored["message"]["content"][1]["data"] == IMAGE_REF
    assert store.blobs.get(IMAGE_REF[12:]) == (BLOBS / IMAGE_REF[12:]).read_bytes()
    shown = store.resolve(IMAGE_REF, session_id=sid).content
    assert base64.b64decode(shown) == (BLOBS / IMAGE_REF[12:]).read_bytes()
    custom = store.read(sid, after_seq=9, upto_seq=10)[0].payload
    assert custom["data"]["screenshot"]["image_url"] == URL_REF
    assert store.resolve(URL_REF, session_id=sid).content == (BLOBS / URL_REF[12:]).read_text()
    # the missing blob's ref is kept with its image
    missing = store.read(sid, after_seq=11, upto_seq=12)[0].payload["message"]["content"][1]
    assert missing == {
        "type": "image",
        "data": "",
        "mimeType": "image/png",
        "missingBlobRef": MISSING_REF,
    }
    # later tool outputs continue after the imported ids
    assert store.artifacts(sid).save("new output", "bash") == "2"


def test_a_linked_artifacts_directory_is_not_read(store: SessionStore, layout: Path) -> None:
    """``<stem>/`` a link to a directory elsewhere: its files are not the session's (a
    linked file in it never was; the linked directory was read through)."""
    artifacts = layout.with_suffix("")
    elsewhere = layout.parents[3] / "elsewhere"
    artifacts.rename(elsewhere)
    artifacts.symlink_to(elsewhere)
    result = store.import_session(layout, tenant_id=TENANT)
    assert (result.format, result.appended) == ("omp", 14)
    for url in ("artifact://0", "agent://explore"):
        with pytest.raises(ResolveNotFound):
            store.resolve(url, session_id=result.session_id)


def test_an_artifact_swapped_for_a_link_after_the_listing_is_not_read(
    store: SessionStore, layout: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = layout.parents[3] / "secret.txt"
    secret.write_text("SECRET")
    listed = omp.list_artifacts

    def list_then_swap(directory: Path) -> list[ArtifactFile]:
        found = listed(directory)
        (directory / "0.bash.log").unlink()
        (directory / "0.bash.log").symlink_to(secret)
        return found

    monkeypatch.setattr(omp, "list_artifacts", list_then_swap)
    result = store.import_session(layout, tenant_id=TENANT)
    with pytest.raises(ResolveNotFound):
        store.resolve("artifact://0", session_id=result.session_id)
    assert store.resolve("artifact://1", session_id=result.session_id).content == (
        (ARTIFACTS / "1.read.log").read_text()
    )


def test_a_blob_file_that_is_a_link_is_not_read(
    store: SessionStore, layout: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A link in the blobs directory, named as the image's blob, to a file outside it with
    those bytes: not followed (read_file opened it, and the outside file went into the
    store as the image). The ref is kept and reported missing, and a warning names it."""
    image = layout.parents[2] / "blobs" / IMAGE_REF[12:]
    outside = layout.parents[3] / "outside.png"
    image.rename(outside)
    image.symlink_to(outside)
    watch_log(caplog, "core.interop.omp")
    result = store.import_session(layout, tenant_id=TENANT)
    assert sorted(result.missing_blobs) == sorted([IMAGE_REF, MISSING_REF])
    stored = store.read(result.session_id, after_seq=4, upto_seq=5)[0].payload
    assert stored["message"]["content"][1]["missingBlobRef"] == IMAGE_REF
    assert store.blobs.info(IMAGE_REF[12:]) is None
    linked = [
        r for r in caplog.records if r.getMessage().endswith("a blob file is a link: not followed")
    ]
    assert [getattr(r, "path", None) for r in linked] == [str(image)]


def test_reimport_writes_nothing_and_picks_up_a_grown_tool_log(
    store: SessionStore, layout: Path
) -> None:
    first = store.import_session(layout, tenant_id=TENANT)
    log = store.artifacts(first.session_id).directory() / "0.bash.log"
    mtime = log.stat().st_mtime_ns
    again = store.import_session(layout, tenant_id=TENANT)
    assert (again.status, again.appended) == ("unchanged", 0)
    assert log.stat().st_mtime_ns == mtime  # not rewritten
    with (layout.with_suffix("") / "0.bash.log").open("a") as out:
        out.write("  ok 313 still running\n")
    store.import_session(layout, tenant_id=TENANT)
    assert store.resolve("artifact://0", session_id=first.session_id).content.endswith(
        "still running\n"
    )


def test_a_failed_artifact_write_is_retried_by_the_next_pass(
    store: SessionStore, layout: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = ArtifactManager.put_agent_output

    def failing(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ArtifactManager, "put_agent_output", failing)
    with pytest.raises(ImportInterrupted) as caught:
        store.import_session(layout, tenant_id=TENANT)
    # the report says the entries went in, and where
    assert (caught.value.appended, caught.value.skipped) == (14, 0)
    assert isinstance(caught.value.cause, OSError)
    monkeypatch.setattr(ArtifactManager, "put_agent_output", real)
    second = store.import_session(layout, tenant_id=TENANT)
    assert second.appended == 0  # the entries were in; only the artifacts were missing
    assert store.resolve("agent://explore", session_id=second.session_id).content.startswith(
        "# Login form CSS"
    )


def test_artifact_ids_beyond_64_bits_are_kept_as_they_are(
    store: SessionStore, layout: Path
) -> None:
    """oh-my-pi's artifact names are text: a number no counter holds is kept as the id it
    is (it once failed with OverflowError after the entries committed, on every re-run)."""
    huge = "9" * 23
    (layout.with_suffix("") / f"{huge}.bash.log").write_text("huge\n")
    (layout.with_suffix("") / f"{huge}-task.md").write_text("# task\n")
    first = store.import_session(layout, tenant_id=TENANT)
    sid = first.session_id
    assert store.resolve(f"artifact://{huge}", session_id=sid).content == "huge\n"
    assert store.resolve(f"agent://{huge}-task", session_id=sid).content == "# task\n"
    again = store.import_session(layout, tenant_id=TENANT)
    assert (again.status, again.appended) == ("unchanged", 0)
    assert store.artifacts(sid).save("new output", "bash") == "2"  # after the fixture's 0, 1


def test_blobs_dir_option(store: SessionStore, layout: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    shutil.move(layout.parents[2] / "blobs", elsewhere)
    lost = store.import_session(layout, tenant_id="t1")
    assert sorted(lost.missing_blobs) == sorted([IMAGE_REF, URL_REF, MISSING_REF])
    found = store.import_session(layout, tenant_id="t2", blobs_dir=elsewhere)
    assert found.missing_blobs == [MISSING_REF]


def test_blobs_found_after_the_import_are_reported_with_what_to_do(
    store: SessionStore, layout: Path, tmp_path: Path
) -> None:
    """The journal is append-only: entries imported without their blobs keep the refs when
    a later pass finds the blobs. Every pass lists every ref the session lacks (not only the
    ones missing from the directory it was given), and which of them it found (a fresh
    import stores them); a fresh import has them."""
    lost = store.import_session(layout, tenant_id=TENANT, blobs_dir=tmp_path / "nowhere")
    assert sorted(lost.missing_blobs) == sorted([IMAGE_REF, URL_REF, MISSING_REF])
    for _ in range(2):
        later = store.import_session(layout, tenant_id=TENANT)  # the blobs dir beside it
        assert (later.status, later.appended) == ("unchanged", 0)
        assert sorted(later.missing_blobs) == sorted([IMAGE_REF, URL_REF, MISSING_REF])
        assert sorted(later.found_late_blobs) == sorted([IMAGE_REF, URL_REF])
    assert lost.found_late_blobs == []
    exported = io.StringIO()
    store.export_session(lost.session_id, exported)
    assert exported.getvalue().count('"missingBlobRef"') == 2  # the image refs, kept
    store.delete_session(lost.session_id, tenant_id=TENANT)
    fresh = store.import_session(layout, tenant_id=TENANT)
    assert (fresh.status, fresh.missing_blobs, fresh.found_late_blobs) == (
        "created",
        [MISSING_REF],
        [],
    )


def test_export_reproduces_the_layout(store: SessionStore, tmp_path: Path, backend: str) -> None:
    result = store.import_session(SESSION_FILE, tenant_id=TENANT)
    out = export_omp(store, result.session_id, tmp_path / "sessions", blobs_dir=tmp_path / "blobs")
    assert out.session_file.name == SESSION_FILE.name
    lines = out.session_file.read_bytes().splitlines()
    assert [json.loads(x) for x in lines] == [
        json.loads(x) for x in SESSION_FILE.read_bytes().splitlines()
    ]
    if backend == "sqlite":  # jsonb does not keep key order (see the report of issue 17)
        assert out.session_file.read_bytes() == SESSION_FILE.read_bytes()
    exported = {p.name: p.read_bytes() for p in out.artifacts_dir.iterdir()}
    original = {p.name: p.read_bytes() for p in ARTIFACTS.iterdir() if not p.name.startswith(".")}
    assert exported == original
    assert {p.name: p.read_bytes() for p in (tmp_path / "blobs").iterdir()} == {
        p.name: p.read_bytes() for p in BLOBS.iterdir()
    }
    assert out.blobs_written == 2
    # and it imports again as the same session content
    again = store.import_session(out.session_file, tenant_id="other", blobs_dir=tmp_path / "blobs")
    ours = [e.payload for e in store.read(result.session_id)]
    assert [e.payload for e in store.read(again.session_id)] == ours


def test_an_export_to_a_plain_directory_imports_with_its_images(
    store: SessionStore, tmp_path: Path
) -> None:
    """export --format omp -o DIR (no agent directory) writes its blobs to DIR/blobs, and an
    import of DIR's file looked for them in ~/.omp/agent/blobs: every image came back empty
    (its ref listed as missing, exit 0). The blobs beside the file are now the default."""
    result = store.import_session(SESSION_FILE, tenant_id=TENANT)
    out = export_omp(
        store, result.session_id, tmp_path / "out", blobs_dir=tmp_path / "out" / "blobs"
    )
    again = store.import_session(out.session_file, tenant_id="other")
    assert (again.missing_blobs, again.found_late_blobs) == ([MISSING_REF], [])
    ours = [e.payload for e in store.read(result.session_id)]
    assert [e.payload for e in store.read(again.session_id)] == ours


def test_a_blob_not_beside_the_file_is_still_read_from_the_home_directory(
    store: SessionStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``blobs/`` beside the file is looked in first, and ~/.omp/agent/blobs after it, blob
    by blob: a copied session file next to an export's ``blobs/`` that lacks its images
    still finds them at home (the first directory found was the only one looked in)."""
    home = tmp_path / "home"
    shutil.copytree(BLOBS, home / ".omp" / "agent" / "blobs")
    monkeypatch.setenv("HOME", str(home))
    folder = tmp_path / "copied"
    (folder / "blobs").mkdir(parents=True)
    shutil.copy(SESSION_FILE, folder / SESSION_FILE.name)
    shutil.copytree(ARTIFACTS, folder / STEM)
    done = store.import_session(folder / SESSION_FILE.name, tenant_id=TENANT)
    assert done.missing_blobs == [MISSING_REF]
    again = store.import_session(SESSION_FILE, tenant_id="other")
    ours = [e.payload for e in store.read(done.session_id)]
    assert ours == [e.payload for e in store.read(again.session_id)]


def test_export_does_not_write_through_a_symlink_in_the_directory(
    store: SessionStore, tmp_path: Path
) -> None:
    result = store.import_session(SESSION_FILE, tenant_id=TENANT)
    outside = tmp_path / "outside.jsonl"
    outside.write_text("kept\n")
    (tmp_path / "sessions").mkdir()
    (tmp_path / "sessions" / SESSION_FILE.name).symlink_to(outside)
    with pytest.raises(InvalidArtifactPath, match="outside"):
        export_omp(store, result.session_id, tmp_path / "sessions", blobs_dir=tmp_path / "blobs")
    assert outside.read_text() == "kept\n"


def test_a_failed_export_leaves_the_session_file_as_it_was(
    store: SessionStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The session file is published whole: an export that fails part way (a blob write
    failing, a disk filling up) over a file oh-my-pi has open leaves that file as it was,
    and no temporary file behind. Written in place, it was left truncated."""
    result = store.import_session(SESSION_FILE, tenant_id=TENANT)
    sessions = tmp_path / "sessions"
    sessions.mkdir()
    existing = sessions / SESSION_FILE.name
    existing.write_bytes(SESSION_FILE.read_bytes() + b'{"type":"label","id":"mine"}\n')
    before = existing.read_bytes()

    def full_disk(self: object, data: bytes) -> str:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(omp._DirectoryBlobs, "put", full_disk)
    with pytest.raises(OSError, match="No space"):
        export_omp(store, result.session_id, sessions, blobs_dir=tmp_path / "blobs")
    assert existing.read_bytes() == before
    assert sorted(p.name for p in sessions.iterdir()) == [SESSION_FILE.name]
    monkeypatch.undo()
    out = export_omp(store, result.session_id, sessions, blobs_dir=tmp_path / "blobs")
    assert out.session_file == existing and existing.read_bytes() != before
    assert [json.loads(x) for x in existing.read_bytes().splitlines()] == [
        json.loads(x) for x in SESSION_FILE.read_bytes().splitlines()
    ]


def test_export_writes_refs_back_exactly_where_the_import_resolved_them(
    store: SessionStore, tmp_path: Path, backend: str
) -> None:
    """Newer oh-my-pi also externalizes image payloads under ``images`` and ``frames``; an
    image elsewhere stays inline in its file, and so in the export."""
    blobs, project = tmp_path / "agent" / "blobs", tmp_path / "agent" / "sessions" / "p"
    blobs.mkdir(parents=True)
    project.mkdir(parents=True)

    def ref(seed: bytes) -> str:
        data = seed * 900
        (blobs / hashlib.sha256(data).hexdigest()).write_bytes(data)
        return "blob:sha256:" + hashlib.sha256(data).hexdigest()

    inline = base64.b64encode(b"i" * 900).decode()
    header = {
        "type": "session",
        "version": 3,
        "id": "s-img",
        "timestamp": "2025-01-01T00:00:00.000Z",
    }
    result_message = {
        "role": "toolResult",
        "toolCallId": "c",
        "toolName": "browser",
        "content": [{"type": "image", "data": ref(b"c"), "mimeType": "image/png"}],
        "images": [{"type": "image", "data": ref(b"i"), "mimeType": "image/png"}],
        "details": {"shot": {"type": "image", "data": inline, "mimeType": "image/png"}},
    }
    compaction = {"snapcompact": {"frames": [{"data": ref(b"f"), "mimeType": "image/png"}]}}
    lines = [
        {**header, "cwd": "/w"},
        {"type": "message", "id": "a1", "parentId": None, "message": result_message},
        {"type": "custom", "id": "a2", "parentId": "a1", "customType": "x", "data": compaction},
    ]
    session_file = project / "2025-01-01T00-00-00-000Z_s-img.jsonl"
    session_file.write_text("".join(json.dumps(x, separators=(",", ":")) + "\n" for x in lines))
    result = store.import_session(session_file, tenant_id=TENANT)
    assert result.missing_blobs == []
    stored = store.read(result.session_id, rehydrate=True)[1].payload["message"]
    assert base64.b64decode(stored["images"][0]["data"]) == b"i" * 900

    out = export_omp(store, result.session_id, tmp_path / "out", blobs_dir=tmp_path / "b2")
    assert [json.loads(x) for x in out.session_file.read_bytes().splitlines()] == lines
    if backend == "sqlite":  # jsonb does not keep key order
        assert out.session_file.read_bytes() == session_file.read_bytes()
    assert sorted(p.name for p in (tmp_path / "b2").iterdir()) == sorted(
        p.name for p in blobs.iterdir()
    )
