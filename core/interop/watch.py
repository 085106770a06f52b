"""Find session files, and follow a directory of them as agents write.

Following is import after import: every pass resumes from the offsets in the database, so
the follower keeps no state that matters. Killed and restarted, it picks up where the
journal is, without doubling anything.
"""

from __future__ import annotations

import glob
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from core import nofollow
from core.errors import (
    ImportInterrupted,
    InvalidArtifactPath,
    SessionStoreError,
    StorageUnavailable,
    SymlinkRefused,
    UnlistableDirectory,
    UnreadableFile,
)
from core.interop.importer import ImportResult, import_session

if TYPE_CHECKING:
    from core.store import SessionStore

log = logging.getLogger(__name__)

DEFAULT_SESSIONS_DIR = Path("~/.pi/agent/sessions")
SUFFIX = ".jsonl"
# watchfiles: wait this long for a burst of writes to settle, and wake at least this often to
# look at sizes too (a change notification can be coalesced or, on some filesystems, lost)
_DEBOUNCE_MS = 150
_RESCAN_MS = 1000
# the size a file that could not be looked at is recorded with: reported once, not again
_UNREADABLE = -1


class SessionFiles(NamedTuple):
    files: list[Path]
    # directories below the paths that could not be listed: their files are not in ``files``
    unlisted: list[UnlistableDirectory]


def session_files(paths: Iterable[str | Path]) -> SessionFiles:
    """Files named by ``paths``: a file, a directory (``*.jsonl`` below it), or a glob (the
    files and directories it matches). A path named outright that is none of these (missing,
    a FIFO, a device) is kept, for the import to report it unreadable, and so is a file
    found that cannot be looked at (in a directory that cannot be searched); a directory
    that cannot be listed is in ``unlisted``, for the import to report it."""
    found: dict[Path, None] = {}
    unlisted: dict[Path, UnlistableDirectory] = {}
    for raw in paths:
        path = Path(raw).expanduser()
        if _is_dir(path):
            below = sorted(p for p in _walk(path, unlisted) if _is_session_file(p))
            found.update(dict.fromkeys(below))
        elif _is_file(path) or glob.escape(str(path)) == str(path):
            found[path] = None
        else:
            matches = sorted(Path(p) for p in glob.glob(str(path), recursive=True))
            usable = [m for m in matches if _is_dir(m) or _is_session_file(m)]
            more = session_files(usable)
            found.update(dict.fromkeys(more.files))
            unlisted.update((Path(e.path), e) for e in more.unlisted)
            for directory, part, then in _glob_steps(str(path)):
                _check_step(directory, part, then, unlisted)
    return SessionFiles(list(found), list(unlisted.values()))


def _glob_steps(pattern: str) -> Iterator[tuple[Path, str, bool]]:
    """(directory, part, more) for each step ``glob.glob(pattern, recursive=True)`` takes
    to expand it: the directories the parts before ``part`` name (every one below them for
    ``**``), each listed (a wildcard part) or searched (a literal one) for ``part``; ``more``:
    parts follow it (glob then enters what it lists)."""
    parts = Path(pattern).parts
    reached: dict[str, list[str]] = {}  # ``**``'s directories, for its step and the next
    for i, part in enumerate(parts):
        if i == 0 and Path(pattern).is_absolute():
            continue  # the root itself
        before = os.path.join(*parts[:i]) if i else os.curdir
        if part == "**":
            before = os.path.join(before, "**")
        if glob.escape(before) == before:
            named = [before] if _is_dir(Path(before)) else []
        else:  # directories only (the separator at the end): glob enters nothing else
            if before not in reached:
                reached[before] = glob.glob(os.path.join(before, ""), recursive=True)
            named = reached[before]
        for directory in named:
            yield Path(directory), part, i < len(parts) - 1


def _check_step(
    directory: Path, part: str, more: bool, unlisted: dict[Path, UnlistableDirectory]
) -> None:
    """``directory`` in ``unlisted`` if ``glob`` was refused that step in it (``EACCES``,
    ``EPERM``): ``glob`` passes over a directory it cannot list, search for a literal name,
    or enter (listed, not searchable) without a word, and every session file the pattern
    would have matched there with it. Any other failure is no match, as ``glob`` takes it."""
    try:
        if glob.escape(part) == part:
            os.lstat(directory / part)
            return
        with os.scandir(directory):
            pass
        if more:  # glob enters what it lists there: the directory must be searchable
            os.stat(os.path.join(directory, os.curdir))  # a Path drops the "."
    except PermissionError as exc:
        unlisted[directory] = UnlistableDirectory(str(directory), exc.strerror or str(exc))
    except (OSError, ValueError):  # not there, a name too long, a NUL: no match
        return


def _walk(directory: Path, unlisted: dict[Path, UnlistableDirectory]) -> Iterator[Path]:
    """``*.jsonl`` paths below ``directory``, as ``Path.rglob`` finds them (a linked
    directory is not entered), but a directory that cannot be listed goes into ``unlisted``
    (``rglob`` passed over it without a word)."""
    try:
        with os.scandir(directory) as listing:
            entries = list(listing)
    except (FileNotFoundError, NotADirectoryError):  # gone since it was found
        return
    except OSError as exc:
        unlisted[directory] = UnlistableDirectory(str(directory), exc.strerror or str(exc))
        return
    for entry in entries:
        path = directory / entry.name
        if entry.name.endswith(SUFFIX):
            yield path
        if _entry_is_dir(entry):
            yield from _walk(path, unlisted)


def _entry_is_dir(entry: os.DirEntry[str]) -> bool:
    """A directory to enter: not a link to one, nor one that cannot be looked at."""
    try:
        return entry.is_dir(follow_symlinks=False)
    except OSError:
        return False


def check_followable(directory: Path) -> None:
    """``UnreadableFile`` naming ``directory`` when it is not there to follow (missing, or
    below a file): watchfiles, told to pass over what it cannot read, passes over a missing
    path too, and the follower followed nothing without a word."""
    try:
        os.stat(directory)
    except OSError as exc:
        raise UnreadableFile(str(directory), exc.strerror or str(exc)) from None


def _is_session_file(path: Path) -> bool:
    """A file of its own session (not one of oh-my-pi's subagents, ``_in_artifacts_dir``),
    or one that cannot be looked at: the import reports that one, and the run goes on."""
    return _is_file(path) and not _in_artifacts_dir(path)


def _in_artifacts_dir(path: Path) -> bool:
    """oh-my-pi keeps a subagent's session (``<outputId>.jsonl``) in the artifacts directory
    ``<stem>/`` of ``<stem>.jsonl``: it is part of that session, not one of its own."""
    try:
        return path.parent.with_name(path.parent.name + SUFFIX).is_file()
    except OSError:  # not to be looked at: the file is reported as it is
        return False


def _in_linked_dir(directory: Path, path: Path) -> bool:
    """Whether a directory between ``directory`` and ``path`` is a link. A scan does not
    follow one (``Path.rglob``); the watcher (inotify) does, and its changes there are
    dropped, so that what is followed is what a scan imports."""
    try:
        nofollow.check_path(directory, path, leaf=False)
    except SymlinkRefused:
        return True
    except (InvalidArtifactPath, OSError):  # not below it, or not to be looked at
        pass
    return False


def _is_file(path: Path) -> bool:
    """A regular file, or a path that cannot be looked at (``PermissionError`` from a
    directory above it that cannot be searched): kept, for the import to report it."""
    try:
        return path.is_file()
    except OSError:
        return True


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except OSError:  # one that cannot be looked at is kept as a file, and reported
        return False


def _transient(exc: SessionStoreError) -> bool:
    """A failure the next pass may not meet (a database or store away, busy): the file is
    tried again on the next rescan, not only once it changes."""
    cause = exc.cause if isinstance(exc, ImportInterrupted) else exc
    return isinstance(cause, StorageUnavailable)


OnResult = Callable[[ImportResult], None]
OnError = Callable[[Path, SessionStoreError], None]


class Follower:
    """Imports a directory's session files now and then again whenever they change."""

    def __init__(
        self,
        store: SessionStore,
        directory: Path,
        *,
        tenant_id: str,
        format: str = "auto",
        on_result: OnResult | None = None,
        on_error: OnError | None = None,
    ) -> None:
        self.store = store
        self.directory = directory
        self.tenant_id = tenant_id
        self.format = format
        self.on_result = on_result
        self.on_error = on_error
        self._sizes: dict[Path, int] = {}
        self._unlisted: set[Path] = set()

    def run(self, stop: threading.Event | None = None) -> None:
        import watchfiles  # only the follower needs it

        check_followable(self.directory)
        self.scan()
        # the watcher reports absolute paths
        watched = Path(os.path.abspath(self.directory))
        for changes in watchfiles.watch(
            self.directory,
            stop_event=stop,
            debounce=_DEBOUNCE_MS,
            rust_timeout=_RESCAN_MS,
            yield_on_timeout=True,
            # a directory that cannot be read is not watched (its files are not listed
            # either), instead of ending the follow
            ignore_permission_denied=True,
        ):
            changed = {Path(p) for kind, p in changes if kind != watchfiles.Change.deleted}
            for path in sorted(changed):
                if (
                    path.suffix == SUFFIX
                    and not _in_linked_dir(watched, path)
                    and _is_session_file(path)
                ):
                    self.import_one(path)
            self.scan()

    def scan(self) -> None:
        """Import every file whose size is not the one last seen; report a directory that
        cannot be listed once (again if it could be listed in between)."""
        found = session_files([self.directory])
        unlisted = {Path(exc.path): exc for exc in found.unlisted}
        for directory in sorted(unlisted.keys() - self._unlisted):
            self._failed(directory, unlisted[directory])
        self._unlisted = set(unlisted)
        for path in found.files:
            try:
                size = path.stat().st_size
            except (FileNotFoundError, NotADirectoryError):  # gone since it was listed
                continue
            except OSError as exc:  # in a directory that cannot be searched: said once
                if self._sizes.get(path) != _UNREADABLE:
                    self._sizes[path] = _UNREADABLE
                    self._failed(path, UnreadableFile(str(path), exc.strerror or str(exc)))
                continue
            if self._sizes.get(path) != size:
                self.import_one(path)

    def import_one(self, path: Path) -> ImportResult | None:
        try:
            size = path.stat().st_size
        except OSError:  # gone between the event and now
            return None
        try:
            result = import_session(self.store, path, tenant_id=self.tenant_id, format=self.format)
        except (UnreadableFile, OSError) as exc:  # the file went away since the event
            log.info("file unreadable", extra={"path": str(path), "error": str(exc)})
            return None
        except SessionStoreError as exc:
            if not _transient(exc):  # not again until the file changes
                self._sizes[path] = size
            self._failed(path, exc)
            return None
        except Exception as exc:  # a defect of ours: this file's, the others still followed
            log.exception("import failed unexpectedly", extra={"path": str(path)})
            self._sizes[path] = size
            if self.on_error is not None:
                self.on_error(path, SessionStoreError(f"{path}: {type(exc).__name__}: {exc}"))
            return None
        self._sizes[path] = size
        if self.on_result is not None and result.appended:
            self.on_result(result)
        return result

    def _failed(self, path: Path, exc: SessionStoreError) -> None:
        log.warning("import failed", extra={"path": str(path), "error": exc.message})
        if self.on_error is not None:
            self.on_error(path, exc)
