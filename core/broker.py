"""The embedded broker: kombu's filesystem transport, made safe to share.

kombu's own filesystem transport (5.7) has two races that lose writes silently:

- ``_put`` creates the message file in the queue folder, then serializes and writes it. A
  consumer polling in that window moves away a file that is empty or half written; its
  JSON does not parse, the exception escapes the consumer, and the worker stops consuming:
  that write and every later one wait forever (seen as a demo write PENDING for a minute
  on a loaded machine).
- ``_get`` claims a message by moving it into the system temp folder. When that is another
  filesystem (a tmpfs ``/tmp``), the move is a copy then an unlink, so two consumers can
  both copy one message, and one of them reads the file while the other truncates it.

Here a message is written under a hidden name and renamed into the queue folder whole, and
a consumer claims it with one ``rename`` inside the broker's own folder (atomic: exactly one
consumer wins). A message file that still does not parse (written by hand, or by an older
producer that crashed mid-write) is set aside in ``bad/`` with a warning, and consuming
goes on. And each broker folder has its own binding state: kombu shares one per process,
so a process that used two data dirs (a test suite, an app with two stores) published the
second one's messages to no queue.

A claimed message stays in ``claimed/`` until it is acked (or rejected, or restored at
shutdown), named by its consumer: kombu's transport dropped it at the claim, so a worker
killed mid-task (SIGKILL, OOM, power) lost the write it was running, where Redis gives it
back. A consumer returns to the queue the claims of a consumer that is gone (on this
machine: same boot, same PID namespace, and that process no longer running), when it
starts and every ``RECLAIM_EVERY_S`` after.

A process that replaces its image (``execv``: Celery's worker restarts so on SIGHUP) keeps
its pid and start time but not the messages the earlier image held, so a claim also names
the image that made it (a token drawn at import, in the claim name's middle field, which
earlier versions read as an opaque uuid). A claim of this very process made by another
image, or without a token (only an exec from a version before tokens leaves one), is
returned; a live process's claims are never taken, whatever their token. A return is
crash-safe at each step (see ``_return``), and hidden staging files older than
``STALE_PART_S``, which killed producers and returners leave, are removed by the scan.

Selected by ``tasks.app`` as ``broker_transport = "core.broker:Transport"`` with the
``filesystem://`` URL; nothing else changes (same folders, same file names, but for the
suffix a returned message's name gains: ``<stamp>_<uuid>+<return>.<queue>.msg``).
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import re
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from queue import Empty
from time import monotonic
from typing import Any, cast

from kombu.exceptions import ChannelError
from kombu.transport import filesystem, virtual
from kombu.utils import json as kombu_json

from core import nofollow
from core.errors import SymlinkRefused

log = logging.getLogger(__name__)

TRANSPORT = "core.broker:Transport"


_dumps = cast(Callable[[Any], str], kombu_json.dumps)
_loads = cast(Callable[[str], Any], kombu_json.loads)


class Channel(filesystem.Channel):
    def _put(self, queue: Any, payload: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        body = _dumps(payload).encode()
        name = f"{round(monotonic() * 1000)}_{uuid.uuid4()}.{queue}.msg"
        folder = Path(self.data_folder_out)
        # A hidden name does not match "<stamp>_<uuid>.<queue>.msg", so no consumer
        # (nor _size, nor _purge) sees the file until the rename publishes it whole.
        staging = folder / f".{name}.part"
        try:
            with open(staging, "xb") as f:
                f.write(body)
            os.replace(staging, folder / name)
        except OSError as exc:
            staging.unlink(missing_ok=True)
            raise ChannelError(f"cannot add a message to {folder}") from exc

    def _get(self, queue: Any, timeout: Any = None) -> Any:
        wanted = f"{queue}.msg"
        inbox = Path(self.data_folder_in)
        claimed = inbox.parent / "claimed"
        if monotonic() >= getattr(self, "_reclaim_at", 0.0):
            self._reclaim_at = monotonic() + RECLAIM_EVERY_S
            reclaim(claimed, inbox, older_than_s=self._visibility_timeout())
        for name in sorted(os.listdir(inbox)):
            if name.partition(".")[2] != wanted:
                continue
            mine = claimed / _claim_name(name)
            try:
                claimed.mkdir(exist_ok=True)
                os.rename(inbox / name, mine)  # atomic: one consumer wins it
            except FileNotFoundError:
                continue  # another consumer claimed it first
            except OSError as exc:
                raise ChannelError(f"cannot claim {name} in {inbox}") from exc
            try:
                body = _message_bytes(mine)
            except OSError as exc:
                raise ChannelError(f"cannot read the message {mine}") from exc
            if body is None:  # a directory, a FIFO, a link: no message, and no reading it
                _set_aside(mine, inbox.parent / "bad", name)
                continue
            try:
                message = _loads(body.decode())
                # what kombu builds from it on delivery, built here: a file that is JSON
                # but no message (a list, no properties, a body its encoding cannot
                # decode) raised there, out of the consumer, and stopped the worker; its
                # claim then stopped each next worker in turn
                self.Message(message, channel=self)  # type: ignore[no-untyped-call]
            except Exception:
                _set_aside(mine, inbox.parent / "bad", name)
                continue
            message[_CLAIM] = str(mine)  # not in what a restore writes back (serializable)
            return message
        raise Empty()

    def decode_body(self, body: Any, encoding: Any = None) -> Any:
        # kombu builds the message again on delivery, from the raw message _get returned:
        # the body _get decoded for its check is not decoded twice (that very object, as
        # decoding it is a pure function of it; the one before forgotten)
        last, self._last_decoded = getattr(self, "_last_decoded", None), None
        if last is not None and last[0] is body and last[1] == encoding:
            return last[2]
        decoded = super().decode_body(body, encoding)  # type: ignore[no-untyped-call]
        self._last_decoded = (body, encoding, decoded)
        return decoded

    def basic_consume(
        self, queue: Any, no_ack: bool, callback: Any, consumer_tag: Any, **kwargs: Any
    ) -> None:
        super().basic_consume(queue, no_ack, callback, consumer_tag, **kwargs)  # type: ignore[no-untyped-call]
        if no_ack:  # never acked (a remote-control mailbox): nothing to hold it for
            deliver = self.connection._callbacks[queue]

            def dropping_claim(raw: Any) -> Any:
                _drop(raw.get(_CLAIM))
                return deliver(raw)

            self.connection._callbacks[queue] = dropping_claim

    def basic_get(self, queue: Any, no_ack: bool = False, **kwargs: Any) -> Any:
        message = super().basic_get(queue, no_ack, **kwargs)  # type: ignore[no-untyped-call]
        if no_ack and message is not None:
            _drop(message._raw.get(_CLAIM))
        return message

    def basic_ack(self, delivery_tag: Any, multiple: bool = False) -> None:
        claim = self._claim_of(delivery_tag)
        super().basic_ack(delivery_tag, multiple)  # type: ignore[no-untyped-call]
        _drop(claim)

    def basic_reject(self, delivery_tag: Any, requeue: bool = False) -> None:
        claim = self._claim_of(delivery_tag)
        super().basic_reject(delivery_tag, requeue)  # type: ignore[no-untyped-call]
        _drop(claim)  # requeued: its claim went back into the queue (gone by now)

    def _restore(self, message: Any) -> None:
        """Give an unacked message back (restored at shutdown, or rejected to the queue),
        its delivery counted: its claim goes back into the queue as a lost consumer's does,
        in one rename (kombu publishes a copy, and the claim was dropped after it: a kill
        between left the message both queued and claimed, delivered twice). An OSError (a
        full disk) leaves the claim, which a scan returns once this process is gone."""
        claim = getattr(message, "_raw", {}).get(_CLAIM)
        if isinstance(claim, str):
            path = Path(claim)
            _return(path, Path(self.data_folder_in), path.name.split(_SEP, 2)[-1])
            return
        if isinstance(message.headers, dict):  # delivered again: counted in the message
            message.headers[DELIVERIES] = delivery_number(message.headers.get(DELIVERIES)) + 1
        super()._restore(message)  # type: ignore[no-untyped-call]

    def _visibility_timeout(self) -> float:
        options = self.connection.client.transport_options or {}
        return float(options.get("visibility_timeout", 3600))

    def _claim_of(self, delivery_tag: Any) -> str | None:
        try:
            message = self.qos.get(delivery_tag)
        except KeyError:
            return None
        claim = getattr(message, "_raw", {}).get(_CLAIM)
        return claim if isinstance(claim, str) else None


RECLAIM_EVERY_S = 30.0
# A hidden staging file (``.<...>.part``) this old was left by a process killed while it
# wrote one: no write of a message takes that long. A scan removes it.
STALE_PART_S = 3600.0
# In a message's headers: which delivery this is, when it is not the first (a restore or a
# return from a lost consumer counts one); tasks.deliveries reads it on this broker.
DELIVERIES = "x-sessionstore-deliveries"
# In a returned message's headers: the file name its return counted a delivery for (a
# returner killed after counting and before the message was back: the next one does not
# count it again)
_COUNTED = "x-sessionstore-counted"
# This broker's own headers of one message's deliveries: a retry (a new message) has none.
DELIVERY_HEADERS = (DELIVERIES, _COUNTED)
_RETURNED = "+"  # in a message's file name: "<stamp>_<uuid>+<return>.<queue>.msg"
_CLAIM = "x-sessionstore-claim"
_SEP = "~"
# This image of the process: an exec (Celery's worker re-execs itself on SIGHUP) keeps the
# pid and start time but not what the earlier image held, so its claims are told apart.
_IMAGE = uuid.uuid4().hex[:16]


def _process_start(pid: int | str) -> str | None:
    """The start time of process ``pid`` (clock ticks since boot), None if there is none
    (or it is dead, a zombie its parent has not reaped yet): a pid reused by a later
    process has another."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError):
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] in ("Z", "X", "x") else fields[19]


def _machine() -> str:
    """This boot and PID namespace, where a process id names one process."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip().replace("-", "")
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:  # no /proc: no claim is judged by its owner, only by its age
        return f"noproc{uuid.uuid4().hex}"
    return f"{boot}{namespace}"


_MACHINE = _machine()


@functools.cache
def _owner(pid: int) -> str:
    """How this process names its claims (per pid: a forked child is another consumer)."""
    return f"{_MACHINE}.{pid}.{_process_start(pid)}"


def _claim_name(name: str) -> str:
    """``<owner>~<image>-<uuid>~<message file>``. The image token sits in the middle field,
    which versions before it read as an opaque uuid: they judge these claims by the owner
    alone, as before, and never take a live process's."""
    return f"{_owner(os.getpid())}{_SEP}{_IMAGE}-{uuid.uuid4().hex}{_SEP}{name}"


def reclaim(claimed: Path, inbox: Path, *, older_than_s: float) -> int:
    """Return to ``inbox`` the messages claimed by consumers that are gone: on this machine
    (same boot and PID namespace) a process no longer running, or an earlier image of this
    very process (it exec'd since); elsewhere (another boot, a volume shared between
    namespaces) a claim older than ``older_than_s``, the visibility timeout after which
    Redis gives a message back. Removes staging files older than ``STALE_PART_S``. Returns
    how many messages went back."""
    try:
        names = os.listdir(claimed)
    except FileNotFoundError:
        return 0
    now, back, me = time.time(), 0, _owner(os.getpid())
    running: dict[str, bool] = {}  # owner -> alive, read from /proc once per scan
    for claim in names:
        owner, _, rest = claim.partition(_SEP)
        token, _, name = rest.partition(_SEP)
        if claim.startswith(".") or not name:
            continue  # a staging file, or an older version's claim (it was read then)
        if owner == me:
            # this process: this image's own, or an earlier image's (a claim without an
            # image token too: only an exec from a version before tokens leaves one)
            if token.partition("-")[0] == _IMAGE:
                continue
        elif not _lost(owner, claimed / claim, running, now - older_than_s):
            continue
        try:
            if not _return(claimed / claim, inbox, name):
                continue  # acked meanwhile, or another consumer took it back first
        except OSError as exc:  # tried again at the next scan; consuming goes on
            log.warning(
                "the embedded broker could not return a message its lost consumer held",
                extra={"file": name, "error": repr(exc)},
            )
            continue
        back += 1
        log.warning("the embedded broker returned a message its lost consumer held: %s", name)
    for folder in (claimed, inbox):
        _remove_stale_parts(folder, now - STALE_PART_S)
    return back


def _lost(owner: str, claim: Path, running: dict[str, bool], claimed_before: float) -> bool:
    """Whether another process's claim is lost: on this machine its process no longer
    runs; elsewhere it was claimed before ``claimed_before``."""
    machine, _, process = owner.partition(".")
    if machine == _MACHINE:
        alive = running.get(owner)
        if alive is None:
            pid, _, start = process.partition(".")
            alive = running[owner] = _process_start(pid) == start
        return not alive
    try:
        return os.stat(claim).st_ctime < claimed_before  # ctime: the claim
    except FileNotFoundError:
        return False


def _remove_stale_parts(folder: Path, before: float) -> None:
    try:
        names = [n for n in os.listdir(folder) if n.startswith(".") and n.endswith(".part")]
    except OSError:
        return
    for name in names:
        try:
            if os.stat(folder / name).st_mtime >= before:
                continue
            os.unlink(folder / name)
        except OSError:
            continue  # renamed in meanwhile, or not ours to remove: the next scan
        log.warning("the embedded broker removed a stale staging file: %s", folder / name)


def held(folder: Path) -> tuple[int, int]:
    """For ``queue status``: messages claimed and not acked yet (running, or held by a lost
    consumer until a scan returns them), and files set aside in ``bad/`` as unreadable, of
    the broker in ``folder`` (its ``in/``, ``claimed/`` and ``bad/``)."""

    def count(folder: Path) -> int:
        try:
            return sum(1 for name in os.listdir(folder) if not name.startswith("."))
        except FileNotFoundError:
            return 0

    return count(folder / "claimed"), count(folder / "bad")


def delivery_number(count: object) -> int:
    """Which delivery a message's ``DELIVERIES`` header says this is (1: the first, or a
    value no restore wrote)."""
    return count if type(count) is int and count >= 1 else 1


def _return(claim: Path, inbox: Path, name: str) -> bool:
    """Put a lost consumer's message back in the queue, its delivery counted (a message
    that kills each consumer that takes it is then given up, typed, as on Redis). False if
    the claim is gone (acked, or taken back by another consumer first); an OSError (a full
    disk) leaves the claim as it was lost, for the next scan.

    Each step leaves a state the next scan completes, if this process is killed there:
    claimed again as this process's first (one returner wins it); then the counted message
    written whole under a hidden name and renamed over that claim, naming in ``_COUNTED``
    the file it goes back as (its place in the queue kept); then the claim renamed into the
    queue, in one step: the message is never both queued and claimed. A returner that finds
    the message counted for another name than its claim's was killed before it was back:
    it is not counted again."""
    mine = claim.with_name(_claim_name(name))
    try:
        os.rename(claim, mine)
    except FileNotFoundError:
        return False
    try:
        os.rename(mine, inbox / _counted(mine, name))
    except OSError:
        os.rename(mine, claim)
        raise
    return True


def _counted(mine: Path, name: str) -> str:
    """Count the delivery in the claim ``mine`` of message file ``name``, unless a return
    killed before it was back counted it; the name it goes back as."""
    body = _message_bytes(mine)  # a read that fails leaves the claim for the next scan
    if body is None:
        return name  # no message file: set aside when it is claimed again
    try:
        message = _loads(body.decode())
        headers = message.get("headers") if isinstance(message, dict) else None
    except Exception:  # not JSON, or kombu's decoders refused it (TypeError, decimal, depth)
        headers = None  # set aside when it is claimed again
    if not isinstance(headers, dict):
        return name
    counted = headers.get(_COUNTED)
    if counted != name and _returned_as(name, counted):
        return cast(str, counted)
    back = _return_name(name)
    message["redelivered"] = True  # as kombu marks a message it restores
    headers[DELIVERIES] = delivery_number(headers.get(DELIVERIES)) + 1
    headers[_COUNTED] = back
    staging = mine.with_name(f".{uuid.uuid4().hex}.part")
    try:
        with open(staging, "xb") as out:
            out.write(_dumps(message).encode())
        os.replace(staging, mine)
    except OSError:
        staging.unlink(missing_ok=True)
        raise
    return back


def _return_name(name: str) -> str:
    """``name`` (``<stamp>_<uuid>.<queue>.msg``) with a suffix of this return: sorted where
    it was, told apart from the name it had when its consumer was lost."""
    head, dot, tail = name.partition(".")
    return f"{head.partition(_RETURNED)[0]}{_RETURNED}{uuid.uuid4().hex[:12]}{dot}{tail}"


def _returned_as(name: str, counted: object) -> bool:
    """Whether ``counted`` is a name a return of the message ``name`` gives it (only such a
    name is ever used as one: a header is not a path)."""
    if not isinstance(counted, str):
        return False
    head, _, tail = name.partition(".")
    base = re.escape(f"{head.partition(_RETURNED)[0]}{_RETURNED}")
    return re.fullmatch(rf"{base}[0-9a-f]{{12}}\.{re.escape(tail)}", counted) is not None


def _drop(claim: Any) -> None:
    if isinstance(claim, str):
        try:
            os.unlink(claim)
        except FileNotFoundError:
            pass


def _message_bytes(path: Path) -> bytes | None:
    """A message file's bytes; None for what is no regular file (a directory, a FIFO, a
    link, planted by hand in the queue folder), never read (``nofollow.open_file``): a
    FIFO's read waited for a writer forever (the worker, then ``queue status``), a
    directory's read failed and stopped the worker. FileNotFoundError if nothing is there."""
    try:
        fd = nofollow.open_file(path.parent, path)
    except SymlinkRefused:
        return None
    if fd is None:
        if not os.path.lexists(path):
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(path))
        return None
    with os.fdopen(fd, "rb") as f:
        return f.read()


def _set_aside(path: Path, bad: Path, name: str) -> None:
    bad.mkdir(exist_ok=True)
    os.replace(path, bad / name)
    log.warning("the embedded broker set aside an unreadable message file: %s", bad / name)


_states: dict[str, virtual.BrokerState] = {}


class Transport(filesystem.Transport):
    Channel = Channel

    def __init__(self, client: Any, **kwargs: Any) -> None:
        super().__init__(client, **kwargs)  # type: ignore[no-untyped-call]
        # kombu keeps one in-memory binding table per process for every folder. A second
        # data dir in the same process then skips writing its queue's binding file (it
        # looks declared already) and its messages go to no queue. One table per folder.
        folder = str(Path(client.transport_options.get("control_folder", "control")).resolve())
        self.state = _states.setdefault(folder, virtual.BrokerState())  # type: ignore[no-untyped-call]
