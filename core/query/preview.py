"""Short, human previews of event payloads for the CLI's ``state`` and ``events`` tables.

Blob refs are resolved lazily, one at a time, and only into a preview: an image becomes
``[image 123 KB]`` from the blob index (its bytes are never read), a text blob its first
characters. Only a ref the event's own manifest names is resolved (invariant 9): a string
that merely looks like a ref (a producer may write any text, another tenant's hash
included) previews as the text it is. Nothing here writes.

A text blob's first characters come from ``BlobStore.peek``, in bounded memory whatever
the blob's size: the stored object streams through, inflated a piece at a time, and only
the first ``_PEEK_BYTES`` bytes are kept. It is still read and verified to its end before
any of it is shown. Invariant 13 says a corrupt blob is never served, and a preview that
showed the start of a blob whose tail is damaged (or cut short) would serve its bytes as
good; so a blob that does not verify previews as ``[corrupt blob …]`` (and one that is
gone as ``[missing blob …]``), never as text. The cost of that read is time (the blob's
stored bytes once per previewer; less where this process verified them before, see
``StoredDigests``), never memory.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Collection
from typing import Any

from core.blobs.store import BlobStore, looks_like_ref, parse_ref
from core.errors import BlobCorrupted, BlobNotFound, SessionStoreError

TEXT_PEEK = 60
# Each block of a multi-block content is cut to this, so later blocks stay visible.
BLOCK_WIDTH = 120
# How many bytes of a text blob a preview keeps: enough for TEXT_PEEK characters. The blob
# is read (and verified) to its end all the same, a piece at a time (module docstring).
_PEEK_BYTES = TEXT_PEEK * 4
# A blob that could not be shown (missing, corrupt, unreadable) is tried again after this
# long: a repaired or restored blob shows in a long ``events --follow``, and a page that
# names one bad blob many times still reads it once.
RETRY_FAILED_S = 10.0

log = logging.getLogger(__name__)

BlobSize = Callable[[str], int | None]
# The first bytes of a blob's verified content; ``BlobNotFound``, ``BlobCorrupted`` or another
# ``SessionStoreError`` when there are none to show.
BlobHead = Callable[[str], bytes]


class _Unshown(Exception):
    """A blob the preview cannot show: ``shown`` says why, in its place."""

    def __init__(self, shown: str) -> None:
        super().__init__(shown)
        self.shown = shown


class Previewer:
    """Turns payloads into one-line text. ``size`` looks a blob's size up by hash (``None``
    when it is unknown), ``head`` reads its first bytes (raising when it cannot); results
    are cached, so a blob is read at most once per previewer; one that could not be shown
    at most once per ``RETRY_FAILED_S`` (by ``clock``).

    A previewer resolves no ref until it is ``scoped`` to what the previewed payload's
    manifest references: ``referenced()`` gives those hashes, and is called only once a
    payload holds something that looks like a ref (most hold none: no query for them)."""

    def __init__(
        self, *, size: BlobSize, head: BlobHead, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._size = size
        self._head = head
        self._clock = clock
        self._texts: dict[str, str] = {}
        self._failed: dict[str, tuple[float, str]] = {}  # hash -> (when, what was shown)
        self._referenced: Callable[[], Collection[str]] = frozenset
        self._scope: Collection[str] | None = None

    def scoped(self, referenced: Callable[[], Collection[str]]) -> Previewer:
        """This previewer (its cache shared) for payloads whose manifest holds the hashes
        ``referenced()`` returns."""
        view = copy.copy(self)
        view._referenced, view._scope = referenced, None
        return view

    def _ref(self, value: Any) -> str | None:
        """The hash of ``value`` if it is a ref the manifest names; else None."""
        blob_hash = parse_ref(value) if looks_like_ref(value) else None
        if blob_hash is None:
            return None
        if self._scope is None:
            self._scope = self._referenced()
        return blob_hash if blob_hash in self._scope else None

    def _kb(self, blob_hash: str) -> str:
        size = self._size(blob_hash)
        return "?" if size is None else f"{max(1, round(size / 1024)):,} KB"

    def text(self, value: Any) -> str:
        """``value`` as text, with a blob ref replaced by the first characters of its text."""
        blob_hash = self._ref(value)
        if blob_hash is None:
            return str(value)
        shown = self._texts.get(blob_hash)
        if shown is not None:
            return shown
        failed = self._failed.get(blob_hash)
        if failed is not None and self._clock() - failed[0] < RETRY_FAILED_S:
            return failed[1]
        try:
            shown = self._texts[blob_hash] = self._peek(blob_hash)
        except _Unshown as why:
            self._failed[blob_hash] = (self._clock(), why.shown)
            return why.shown
        self._failed.pop(blob_hash, None)
        return shown

    def _peek(self, blob_hash: str) -> str:
        """The blob's first characters; ``_Unshown`` saying why there are none (never
        unverified bytes)."""
        try:
            head = self._head(blob_hash)
        except BlobCorrupted as exc:
            log.warning(
                "blob is corrupt; previewed as such",
                extra={"blob_hash": blob_hash, "problem": str(exc)},
            )
            raise _Unshown(f"[corrupt blob {blob_hash[:12]}]") from None
        except BlobNotFound:
            raise _Unshown(f"[missing blob {blob_hash[:12]}]") from None
        except SessionStoreError:
            raise _Unshown(f"[unreadable blob {blob_hash[:12]}]") from None
        peek = " ".join(head[:_PEEK_BYTES].decode("utf-8", errors="replace").split())
        return f"{peek[:TEXT_PEEK]}… [text {self._kb(blob_hash)}]"

    def block(self, block: Any) -> str:
        if not isinstance(block, dict):
            return self.text(block)
        kind = block.get("type")
        if kind == "image":
            data = block.get("data")
            blob_hash = self._ref(data)
            if blob_hash is not None:
                return f"[image {self._kb(blob_hash)}]"
            size = len(data) * 3 // 4 if isinstance(data, str) else 0
            return f"[image {max(1, round(size / 1024)):,} KB]"
        if kind in ("toolCall", "tool_use"):
            return f"{block.get('name')}()"
        if kind in ("thinking",):
            return "[thinking] " + self.text(block.get("thinking", ""))
        for key in ("text", "content", "name"):
            if key in block:
                return self.content(block[key])
        return f"[{kind}]"

    def content(self, content: Any) -> str:
        if isinstance(content, list):
            return " | ".join(shorten(self.block(b), BLOCK_WIDTH) for b in content)
        return self.text(content if content is not None else "")

    def message(self, message: dict[str, Any]) -> str:
        text = self.content(message.get("content"))
        if message.get("role") == "toolResult" and message.get("toolName"):
            text = f"{message['toolName']} -> {text}"
        return text

    def payload(self, event_type: str, payload: dict[str, Any]) -> str:
        message = payload.get("message")
        if event_type == "message" and isinstance(message, dict):
            return self.message(message)
        return ", ".join(
            f"{k}={self.text(v) if isinstance(v, str) else v}"
            for k, v in payload.items()
            if k not in {"type", "id", "parentId", "timestamp"}
        )


def for_blobs(blobs: BlobStore) -> Previewer:
    """A previewer reading ``blobs``: sizes from the index, text from the first bytes of the
    verified content, read in bounded memory (``BlobStore.peek``); a missing or corrupt blob
    previews as such rather than failing the listing."""

    def size(blob_hash: str) -> int | None:
        info = blobs.info(blob_hash)
        return None if info is None else info.size

    def head(blob_hash: str) -> bytes:
        return blobs.peek(blob_hash, _PEEK_BYTES)

    return Previewer(size=size, head=head)


def shorten(text: str, width: int) -> str:
    """One line of at most ``width`` characters."""
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def as_stored(value: Any, *, width: int = 60) -> str:
    """``value`` as stored, as compact JSON: blob refs whole (they are what ``--refs`` is
    for), any other string over ``width`` characters cut."""
    from core import exact_json

    def cut(node: Any) -> Any:
        if isinstance(node, str):
            return node if looks_like_ref(node) or len(node) <= width else node[:width] + "…"
        if isinstance(node, list):
            return [cut(item) for item in node]
        if isinstance(node, dict):
            return {key: cut(item) for key, item in node.items()}
        return node

    return exact_json.dumps_str(cut(value))
