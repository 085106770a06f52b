"""Find session files, and follow a directory of them as agents write.

Following is import after import: every pass resumes from the offsets in the database, so
the follower keeps no state that matters. Killed and restarted, it picks up where the
journal is, without doubling anything.
"""

from __future__ import annotations

import errno
import fnmatch
import glob
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from core import nofollow
from core.errors import (
    ImportInterrupted,
    InvalidArtifactPath,
    SessionFileNotStarted,
    SessionStoreError,
    StorageUnavailable,
    SymlinkRefused,
    UnlistableDirectory,
    UnreadableFile,
)
from core.interop.importer import HEADER_WAIT_NS, ImportResult, import_session, written_lately

if TYPE_CHECKING:
    from core.store import SessionStore

log = logging.getLogger(__name__)

DEFAULT_SESSIONS_DIR = Path("~/.pi/agent/sessions")
SUFFIX = ".jsonl"
# watchfiles: wait this long for a burst of writes to settle, and wake at least this often to
# look at the files too (a change notification can be coalesced or, on some filesystems, lost)
_DEBOUNCE_MS = 150
_RESCAN_MS = 1000
_NEVER = 2**63
# what a file that could not be looked at is recorded with: reported once, not again
_UNREADABLE = (-1, -1, -1)
# what Path.is_file takes as "no file" (any other failure: kept, for the import to report)
_GONE = frozenset({errno.ENOENT, errno.ENOTDIR, errno.EBADF, errno.ELOOP})


_Unlisted = dict[Path, UnlistableDirectory]


class _Part(NamedTuple):
    """A part of a glob pattern, as a step of its expansion takes it."""

    text: str
    dirs_only: bool  # only directories match (more parts follow, or the pattern ends in "/")
    more: bool  # more parts follow: what matches is entered


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
    found: dict[str, None] = {}
    unlisted: dict[Path, UnlistableDirectory] = {}
    owners: dict[str, bool] = {}  # directory -> whether it is a session's artifacts
    for raw in paths:
        path = Path(raw).expanduser()
        spelled = str(path)
        if _is_dir(path):
            found.update(dict.fromkeys(_sorted(_walk(spelled, unlisted, _is_artifacts_dir(path)))))
        elif glob.escape(spelled) == spelled or _kind(spelled, unreadable=None) == "file":
            # a name with wildcards is a file's only if it is one for sure: one that cannot
            # be looked at (below a directory that cannot be searched) is a pattern
            found[spelled] = None
        else:
            for match in _sorted({_normal(p) for p in expand_glob(spelled, unlisted)}):
                kind = _kind(match)
                if kind == "dir":
                    below = _walk(match, unlisted, _is_artifacts_dir(Path(match)))
                    found.update(dict.fromkeys(_sorted(below)))
                elif kind == "file":
                    parent = os.path.dirname(match)
                    if parent not in owners:
                        owners[parent] = _is_artifacts_dir(Path(parent))
                    if not owners[parent]:
                        found[match] = None
    return SessionFiles([Path(p) for p in found], list(unlisted.values()))


def _normal(path: str) -> str:
    """``path`` as ``Path`` spells it (no "." part, no separator at the end): most are."""
    dot = f"{os.sep}."
    if path.endswith((os.sep, dot)) or f"{dot}{os.sep}" in path or path.startswith(f".{os.sep}"):
        return str(Path(path))
    return path


def _sorted(paths: Iterable[str]) -> list[str]:
    """Paths spelled as ``Path`` spells them, in ``Path``'s order (part by part), without
    making 45,000 ``Path`` objects to compare."""
    return sorted(paths, key=lambda p: p.split(os.sep))


def expand_glob(pattern: str, unlisted: _Unlisted) -> list[str]:
    """What ``glob.glob(pattern, recursive=True)`` matches, with two differences.

    ``**`` does not enter a linked directory (``Path.rglob``'s rule, and ``_walk``'s): glob
    does, so a loop of links (``up -> ..`` and ``self -> .`` in one directory) made it run
    for ever, and one loop gave each file below it 40 more times, once per link level.
    A step glob is refused (``EACCES``, ``EPERM``: a directory it cannot list, search for
    a literal name, or enter) puts that directory in ``unlisted``: glob passes over it
    without a word, and every session file the pattern would have matched there with it.
    Any other failure is no match, as glob takes it. The steps are taken once: no second
    walk to find the refusals."""
    parts = [part for part in pattern.split(os.sep) if part]
    if not parts:
        return [pattern] if pattern and os.path.isdir(pattern) else []
    dirs_only = pattern.endswith(os.sep)
    # the root as Path spells it: two separators stay two (POSIX leaves their meaning open)
    root = pattern[: len(pattern) - len(pattern.lstrip(os.sep))]
    reached = [root if len(root) == 2 else root[:1]]
    for i, text in enumerate(parts):
        more = i < len(parts) - 1
        part = _Part(text, dirs_only or more, more)
        step = _below if text == "**" else _literal if glob.escape(text) == text else _listed
        reached = [found for directory in reached for found in step(directory, part, unlisted)]
    return [path for path in reached if path]  # not a leading ``**``'s own "" (as glob)


def _literal(directory: str, part: _Part, unlisted: _Unlisted) -> Iterator[str]:
    """``part`` in ``directory``, looked up (glob does not list the directory for it)."""
    path = os.path.join(directory, part.text)
    try:
        os.lstat(path)
        if part.dirs_only and not os.path.isdir(path):
            return
    except PermissionError as exc:
        _refused(directory or os.curdir, exc, unlisted)
        return
    except (OSError, ValueError):  # not there, a name too long, a NUL: no match
        return
    yield path


def _listed(directory: str, part: _Part, unlisted: _Unlisted) -> Iterator[str]:
    """The names in ``directory`` that ``part`` matches (a hidden one only when ``part``
    starts with a dot), directories only where more parts follow; those followed through
    links too, as glob does (the parts that are left bound how deep that goes)."""
    entries = _entries(directory, part.more, unlisted)
    hidden = part.text.startswith(".")
    for entry in entries:
        name = entry.name
        if (hidden or not name.startswith(".")) and fnmatch.fnmatchcase(name, part.text):
            if not part.dirs_only or _entry_leads_to_dir(entry):
                yield os.path.join(directory, entry.name)


def _below(directory: str, part: _Part, unlisted: _Unlisted) -> Iterator[str]:
    """``**``: ``directory`` and every directory below it, passing over links to one and
    hidden ones (and every file below it too when it is the pattern's last part)."""
    yield os.path.join(directory, "")
    pending = [directory]
    while pending:
        current = pending.pop()
        for entry in _entries(current, True, unlisted):
            if entry.name.startswith("."):
                continue
            path = os.path.join(current, entry.name)
            if _entry_is_dir(entry):
                pending.append(path)
                yield os.path.join(path, "") if part.dirs_only else path
            elif not part.dirs_only and not _entry_leads_to_dir(entry):  # a link to one: passed
                yield path


def _entries(directory: str, enter: bool, unlisted: _Unlisted) -> list[os.DirEntry[str]]:
    """``directory``'s entries, or none: a refusal to list it (or, when glob goes on to
    what it lists, ``enter``, to search it) is in ``unlisted``."""
    named = directory or os.curdir
    try:
        with os.scandir(named) as listing:
            entries = list(listing)
        if enter and entries:  # a listable directory that cannot be searched: 0644
            os.stat(os.path.join(named, os.curdir))
    except PermissionError as exc:
        _refused(named, exc, unlisted)
        return []
    except (OSError, ValueError):
        return []
    return entries


def _refused(directory: str, exc: OSError, unlisted: _Unlisted) -> None:
    path = Path(directory)
    unlisted[path] = UnlistableDirectory(str(path), exc.strerror or str(exc))


def _entry_leads_to_dir(entry: os.DirEntry[str]) -> bool:
    """A directory, or a link to one (glob follows those outside ``**``)."""
    try:
        return entry.is_dir()
    except OSError:
        return False


def _walk(directory: str, unlisted: _Unlisted, artifacts: bool) -> Iterator[str]:
    """The session files below ``directory``, as ``Path.rglob("*.jsonl")`` finds them (a
    linked directory is not entered) less the files of a session's artifacts directory
    (``artifacts``: ``directory`` is one, ``_in_artifacts_dir``), but a directory that
    cannot be listed goes into ``unlisted`` (``rglob`` passed over it without a word).
    From the listings alone: no look at each file (a file that cannot be looked at is
    kept, for the import to report it)."""
    try:
        with os.scandir(directory) as listing:
            entries = list(listing)
    except (FileNotFoundError, NotADirectoryError):  # gone since it was found
        return
    except OSError as exc:
        _refused(directory, exc, unlisted)
        return
    kinds = {e.name: _entry_is_file(e) for e in entries if e.name.endswith(SUFFIX)}
    for entry in entries:
        path = os.path.join(directory, entry.name)
        if entry.name in kinds and kinds[entry.name] is not False and not artifacts:
            yield path
        if _entry_is_dir(entry):  # a session's artifacts beside a file that is one for sure
            yield from _walk(path, unlisted, kinds.get(entry.name + SUFFIX) is True)


def _entry_is_file(entry: os.DirEntry[str]) -> bool | None:
    """A file or a link to one (True), or not (False: a link that loops, or leads through
    a file, as ``Path.is_file`` takes it), or None: one that cannot be looked at (a link
    into a directory that cannot be searched), kept as a file for the import to report."""
    try:
        return entry.is_file()
    except OSError as exc:
        return False if exc.errno in _GONE else None


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
    return _is_artifacts_dir(path.parent)


def _is_artifacts_dir(directory: Path) -> bool:
    """Whether ``<directory>.jsonl`` is a file beside it: its files are a session's. (".",
    "" and ".." by the names they stand for: ``sessionstore import .`` in one.)"""
    if directory.name in ("", os.pardir):
        directory = Path(os.path.abspath(directory))
    try:
        return directory.with_name(directory.name + SUFFIX).is_file()
    except (OSError, ValueError):  # not to be looked at: the file is reported as it is
        return False


def _kind(path: str, *, unreadable: str | None = "file") -> str | None:
    """ "dir", "file" (a regular one), or None (gone, or neither), in one look; for one that
    cannot be looked at, ``unreadable``: "file" keeps it, for the import to report it, as
    ``_is_file`` does."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        return None if exc.errno in _GONE else unreadable
    except ValueError:
        return None
    return "dir" if stat.S_ISDIR(mode) else "file" if stat.S_ISREG(mode) else None


def would_follow(directory: Path, path: Path) -> bool:
    """Whether a follow of ``directory`` would import ``path`` once it is there: a session
    file below it, not through a linked directory, not in a session's artifacts."""
    inside, there = os.path.abspath(directory), os.path.abspath(path)
    if os.path.commonpath([there, inside]) != inside or there == inside:
        return False
    above = os.path.dirname(there)
    while above != inside:  # no file where a directory of its path would be
        if os.path.lexists(above) and not os.path.isdir(above):
            return False
        above = os.path.dirname(above)
    return (
        there.endswith(SUFFIX)
        and not _in_linked_dir(Path(inside), Path(there))
        and not _in_artifacts_dir(Path(there))
    )


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


def _signature(path: Path) -> tuple[int, int, int]:
    """A file's size, modification time (ns) and inode: what tells the follower it changed
    (a file renamed over it at its size and time too)."""
    found = path.stat()
    return found.st_size, found.st_mtime_ns, found.st_ino


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
        # each file's signature (``_signature``) when last imported (or failed): a file is
        # imported again when it changes (a rewrite at the same size too)
        self._seen: dict[Path, tuple[int, int, int]] = {}
        self._unlisted: set[Path] = set()
        # new files waiting for a line that gives their header (``header_pending``): each
        # with when the wait is over (a minute after its last write)
        self._waiting: dict[Path, int] = {}
        # the files (and directories) whose last import failed, each with its error: until
        # a pass of the file succeeds, or it is gone
        self.failing: dict[Path, SessionStoreError] = {}

    def run(self, stop: threading.Event | None = None) -> None:
        import watchfiles  # only the follower needs it

        check_followable(self.directory)
        self.scan()
        # the watcher reports absolute paths
        watched = Path(os.path.abspath(self.directory))
        try:
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
                        # named as a scan names it: one file, one record (of what it last
                        # brought, of its failure: said once), one path in what is printed;
                        # not for a change of its mode alone, nor a touch to the same time
                        named = self.directory / os.path.relpath(path, watched)
                        try:
                            seen: tuple[int, int, int] | None = _signature(named)
                        except OSError:  # gone, or not to be looked at: the import says
                            seen = None
                        if seen is None or self._due(named, seen, event=True):
                            self.import_one(named, seen)
                self.scan()
        except RuntimeError as exc:
            if type(exc).__name__ != "WatchfilesRustInternalError":
                raise
            # The notifier cannot pass on a change to a file whose name is not UTF-8 ("Unable
            # to decode path"), and stops. The rescan sees every change anyway (a notification
            # only brings it sooner): follow by rescans alone from here.
            log.warning(
                "%r: the change notifier stopped: following by a rescan every second from now on",
                str(self.directory),
                extra={"path": str(self.directory), "error": (str(exc).splitlines() or [""])[0]},
            )
            self._rescan_until(stop)

    def _rescan_until(self, stop: threading.Event | None) -> None:
        """``scan`` every rescan period until ``stop`` is set (for ever without one)."""
        stop = stop if stop is not None else threading.Event()
        while not stop.wait(_RESCAN_MS / 1000):
            self.scan()

    def scan(self) -> None:
        """Import every file that is due (``_due``); report a directory that cannot be
        listed once (again if it could be listed in between)."""
        found = session_files([self.directory])
        unlisted = {Path(exc.path): exc for exc in found.unlisted}
        for directory in sorted(unlisted.keys() - self._unlisted):
            self._failed(directory, unlisted[directory])
        self._unlisted = set(unlisted)
        listed = set(found.files)
        for gone in self.failing.keys() - listed - self._unlisted:
            del self.failing[gone]
        for gone in self._waiting.keys() - listed:
            del self._waiting[gone]
        for path in found.files:
            try:
                seen = _signature(path)
            except (FileNotFoundError, NotADirectoryError):  # gone since it was listed
                continue
            except OSError as exc:  # in a directory that cannot be searched: said once
                if self._seen.get(path) != _UNREADABLE:
                    self._seen[path] = _UNREADABLE
                    self._failed(path, UnreadableFile(str(path), exc.strerror or str(exc)))
                continue
            if self._due(path, seen):
                self.import_one(path, seen)

    def _due(self, path: Path, seen: tuple[int, int, int], *, event: bool = False) -> bool:
        """Whether ``path`` (``seen``: its signature now) is to be imported: changed since
        its last pass; at the end of its wait for its header's lines; failing as one that
        could not be read (a chmod that mends it changes no signature, and may bring no
        change event); or, on a change event, failing at all (a chmod may have mended it)."""
        failing = self.failing.get(path)
        return (
            self._seen.get(path) != seen
            or self._waiting.get(path, _NEVER) <= time.time_ns()
            or isinstance(failing, UnreadableFile)
            or (event and failing is not None)
        )

    def import_one(
        self, path: Path, seen: tuple[int, int, int] | None = None
    ) -> ImportResult | None:
        """One pass of ``path``; ``seen``: its signature, taken before the file is read
        (a write after it makes the file due again), when the caller has it."""
        if seen is None:
            try:
                seen = _signature(path)
            except OSError:  # gone between the event and now
                return None
        # A file written to a moment ago that gives its session no time nor working directory
        # yet (Claude Code writes a file-history snapshot before the prompt's line) waits for
        # the line that does: the session's header is made once, from the first pass. An
        # older one is what it is (a file of a summary alone).
        young = written_lately(seen[1])
        try:
            result = import_session(
                self.store,
                path,
                tenant_id=self.tenant_id,
                format=self.format,
                wait_for_header=young,
            )
        except (UnreadableFile, OSError) as exc:
            if isinstance(exc, UnreadableFile) and os.path.lexists(path):
                # there, and yet not to be read (no permission, no regular file): said
                # once, as a one-shot import says it, and again once it changes
                self._seen[path] = seen
                self._failed(path, exc)
                return None
            log.info("file unreadable", extra={"path": str(path), "error": str(exc)})
            return None  # the file went away since the event
        except SessionStoreError as exc:
            if not _transient(exc):  # not again until the file changes
                self._seen[path] = seen
            self._waiting.pop(path, None)
            if not isinstance(exc, SessionFileNotStarted):
                self._failed(path, exc)
                return None
            # just made (empty, or its first line still being written), or its header's
            # lines still to come: no failure to report; the write that brings them, or the
            # end of the wait for the header's, brings it back
            if exc.header_pending:
                self._waiting[path] = seen[1] + HEADER_WAIT_NS
            log.info("waiting for the file's first lines", extra={"path": str(path)})
            self.failing.pop(path, None)
            return None
        except Exception as exc:  # a defect of ours: this file's, the others still followed
            log.exception("import failed unexpectedly", extra={"path": str(path)})
            self._seen[path] = seen
            self._failed(path, SessionStoreError(f"{path}: {type(exc).__name__}: {exc}"))
            return None
        self._seen[path] = seen
        self._waiting.pop(path, None)
        self.failing.pop(path, None)
        if self.on_result is not None:  # every pass: one that appends nothing may say a line
            # it ignored, invalid UTF-8, a blob missing (and "unchanged", the file as it was)
            self.on_result(result)
        return result

    def _failed(self, path: Path, exc: SessionStoreError) -> None:
        """Reported to ``on_error`` (the CLI's one line, which names the file), else logged
        as a warning; logged at info level too when reported (a bare "import failed" on
        stderr beside the CLI's line said nothing of which file).

        A failure said already, the file's last, is not said again: a file that grew and
        fails as before, the database away at each rescan, or a file read once more because
        its size was taken before a write that the failed read saw."""
        said = self.failing.get(path)
        self.failing[path] = exc
        if said is not None and (type(said), said.message) == (type(exc), exc.message):
            log.debug("import of %r failed as before", str(path), extra={"path": str(path)})
            return
        level = logging.INFO if self.on_error is not None else logging.WARNING
        log.log(
            level, "import of %r failed", str(path), extra={"path": str(path), "error": exc.message}
        )
        if self.on_error is not None:
            self.on_error(path, exc)
