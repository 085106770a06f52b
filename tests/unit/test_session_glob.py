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

from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from core.interop.watch import SessionFiles, expand_glob, session_files

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
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", code, f"{sessions}/**/*.jsonl", f"{sessions}/**"],
        capture_output=True,
        text=True,
        timeout=60,  # before: still running
        cwd=root,
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
