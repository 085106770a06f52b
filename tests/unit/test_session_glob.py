"""``import``'s glob expansion (``core.interop.watch.expand_glob``) against ``glob.glob``.

Where the tree holds no links, the two match the same paths for every pattern: glob is the
oracle. Below ``**`` a linked directory is not entered (glob enters it, so two link loops
made ``import 'sessions/**/*.jsonl'`` run for ever).
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from core.interop.watch import SessionFiles, expand_glob, session_files
from tests.support import as_a_user, unsearchable

ROOT = Path(__file__).resolve().parents[2]

NAMES = ["a", "b", ".h", "a.jsonl", "b.jsonl", ".h.jsonl", "ab"]
PARTS = ["*", "**", "a", "b*", ".h", "*.jsonl", "?", "[ab]", ".*", "a.jsonl", "[!a]*", "x"]

# a tree: each name is a file (None) or a directory (its own tree), three levels at most
trees = st.recursive(
    st.none(),
    lambda below: st.dictionaries(st.sampled_from(NAMES), below, max_size=4),
    max_leaves=12,
).filter(lambda t: isinstance(t, dict))
patterns = st.tuples(st.lists(st.sampled_from(PARTS), min_size=1, max_size=4), st.booleans()).map(
    lambda p: "/".join(p[0]) + ("/" if p[1] else "")
)


def _make(root: Path, tree: dict[str, object]) -> None:
    for name, below in tree.items():
        if isinstance(below, dict):
            (root / name).mkdir()
            _make(root / name, below)
        else:
            (root / name).write_text("{}\n")


@hsettings(max_examples=300, deadline=None)
@given(tree=trees, pattern=patterns)
def test_the_same_matches_as_glob_where_there_are_no_links(
    tree: dict[str, object], pattern: str
) -> None:
    with tempfile.TemporaryDirectory() as top:
        root = Path(top) / "s"
        root.mkdir()
        _make(root, tree)
        for spelled in (f"{root}/{pattern}", pattern):  # absolute, and relative to the cwd
            cwd = os.getcwd()
            os.chdir(top if spelled == pattern else cwd)
            try:
                unlisted: dict[Path, object] = {}
                ours = {Path(p) for p in expand_glob(spelled, unlisted)}  # type: ignore[arg-type]
                # glob yields "a/" for "a/**" when there is no "a": no match, here
                theirs = {Path(p) for p in glob.glob(spelled, recursive=True) if os.path.lexists(p)}
            finally:
                os.chdir(cwd)
            assert ours == theirs, spelled
            assert unlisted == {}


def test_link_loops_below_double_star_end_and_give_each_file_once(tmp_path: Path) -> None:
    """``up -> ..`` and ``self -> .`` in a session directory: ``glob.glob`` walks 2**40
    paths (it did not end), and with one loop found each file 41 times. The CLI is run in
    a subprocess with a time limit: the expansion before would hang the test run."""
    sessions = tmp_path / "s"
    (sessions / "day").mkdir(parents=True)
    (sessions / "day" / "a.jsonl").write_text("{}\n")
    (sessions / "day" / "up").symlink_to("..")
    (sessions / "day" / "self").symlink_to(".")
    code = (
        "import sys; from core.interop.watch import session_files\n"
        "print('\\n'.join(map(str, session_files(sys.argv[1:]).files)))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, f"{sessions}/**/*.jsonl", f"{sessions}/**"],
        capture_output=True,
        text=True,
        timeout=60,  # before: still running
        cwd=ROOT,
        check=True,
    )
    assert done.stdout.split() == [str(sessions / "day" / "a.jsonl")]


def test_a_link_named_by_a_wildcard_is_followed_as_glob_does(tmp_path: Path) -> None:
    """Outside ``**`` a link to a directory is followed (the pattern's parts bound how far):
    ``sessions/*/x.jsonl`` finds the file through ``linked -> real`` as through ``real``."""
    real = tmp_path / "real"
    real.mkdir()
    (real / "x.jsonl").write_text("{}\n")
    (tmp_path / "linked").symlink_to(real)
    found = session_files([f"{tmp_path}/*/x.jsonl"])
    assert found == SessionFiles([tmp_path / "linked" / "x.jsonl", real / "x.jsonl"], [])


def test_links_that_lead_nowhere_are_no_session_files(tmp_path: Path) -> None:
    """A link that loops, or leads through a file, is no file (as ``Path.is_file`` takes it):
    not imported (reported unreadable, exit 3, after the listings replaced the look at each
    file), and ``x.jsonl`` as such a link makes no artifacts directory of ``x/`` (its real
    session was passed over)."""
    (tmp_path / "x").mkdir()
    (tmp_path / "a.jsonl").write_text("{}\n")
    (tmp_path / "x" / "sub.jsonl").write_text("{}\n")
    (tmp_path / "loop.jsonl").symlink_to("loop.jsonl")
    (tmp_path / "afile").write_text("")
    (tmp_path / "through.jsonl").symlink_to("afile/x")
    (tmp_path / "x.jsonl").symlink_to("x.jsonl")
    expected = [tmp_path / "a.jsonl", tmp_path / "x" / "sub.jsonl"]
    assert session_files([tmp_path]) == SessionFiles(expected, [])
    assert session_files([f"{tmp_path}/**/*.jsonl"]) == SessionFiles(expected, [])


def test_a_link_that_cannot_be_looked_at_is_kept_and_makes_no_artifacts_directory(
    tmp_path: Path,
) -> None:
    """``y.jsonl`` linked into a directory that cannot be searched is kept (the import
    reports it), and ``y/`` beside it is no artifacts directory: its session is found."""
    sessions, locked = tmp_path / "s", tmp_path / "locked"
    (sessions / "y").mkdir(parents=True)
    locked.mkdir()
    (locked / "f").write_text("{}\n")
    (sessions / "top.jsonl").write_text("{}\n")
    (sessions / "y" / "sub.jsonl").write_text("{}\n")
    (sessions / "y.jsonl").symlink_to(locked / "f")
    code = (
        "import sys; from core.interop.watch import session_files\n"
        "print('\\n'.join(map(str, session_files(sys.argv[1:]).files)))"
    )
    with unsearchable(locked, 0o000):
        done = subprocess.run(
            as_a_user([sys.executable, "-c", code, str(sessions)]),
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
            check=True,
        )
    names = ["top.jsonl", "y.jsonl", "y/sub.jsonl"]
    assert sorted(done.stdout.split()) == [str(sessions / n) for n in names]


def test_the_current_directory_is_named_by_what_it_stands_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``import .`` (or ``'*.jsonl'``) inside a session's artifacts directory: its subagent
    files are that session's, as when the directory is named any other way (``Path(".")``
    has no name: the check was passed over, and the subagent imported as a session)."""
    stem = tmp_path / "stem"
    stem.mkdir()
    (tmp_path / "stem.jsonl").write_text("{}\n")
    (stem / "sub1.jsonl").write_text("{}\n")
    monkeypatch.chdir(stem)
    for named in (".", "*.jsonl", "./*.jsonl", str(stem), "../stem"):
        assert session_files([named]) == SessionFiles([], []), named
    monkeypatch.chdir(tmp_path)
    assert session_files(["*.jsonl"]).files == [Path("stem.jsonl")]


def test_a_pattern_spelled_with_two_leading_separators_keeps_them(tmp_path: Path) -> None:
    """``//tmp/...`` as ``Path`` spells it (POSIX leaves a leading ``//`` its own meaning)."""
    (tmp_path / "a.jsonl").write_text("{}\n")
    [found] = session_files([f"/{tmp_path}/*.jsonl"]).files
    assert str(found) == f"/{tmp_path}/a.jsonl"


def test_a_pattern_below_a_directory_that_cannot_be_searched_is_expanded(
    tmp_path: Path,
) -> None:
    """``s/rd/*.jsonl`` with ``rd`` listable, not searchable (0444): the pattern could not
    be looked at, and was kept as a file named ``*.jsonl`` (the import reported that name
    unreadable). Expanded, it names the file it matches (which the import reports), and a
    file that is literally named with a wildcard is still a file."""
    listed = tmp_path / "rd"
    listed.mkdir()
    (listed / "b.jsonl").write_text("{}\n")
    (tmp_path / "[x].jsonl").write_text("{}\n")
    code = (
        "import sys; from core.interop.watch import session_files\n"
        "print('\\n'.join(map(str, session_files(sys.argv[1:]).files)))"
    )
    patterns = [f"{listed}/*.jsonl", f"{tmp_path}/[x].jsonl"]
    with unsearchable(listed, 0o444):
        done = subprocess.run(
            as_a_user([sys.executable, "-c", code, *patterns]),
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
            check=True,
        )
    assert done.stdout.split() == [str(listed / "b.jsonl"), str(tmp_path / "[x].jsonl")]
