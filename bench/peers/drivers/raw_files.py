"""The floor of this project's design: raw ``executemany`` plus the same blob files.

The raw floor (``raw.py``) keeps every byte in PostgreSQL and pays no file durability. This
one does the least a store that keeps large values in files durably must do, with bare
library calls and nothing else: per call, find what this project externalizes (image data of
at least 1,024 base64 characters, decoded; strings over 16 KiB of UTF-8), hash it (SHA-256),
gzip-6 the text, write each new file into a two-level fan-out directory (all written, then
fsynced, renamed, and each directory synced once, new fan-out directories' parents too),
put a ref in its place, and ``executemany`` the compact rows in one transaction. No
validation, no manifest table, no idempotency, no lock: what is left of this project's batch
time over this floor is what its guarantees cost beyond the physics. Rebuild walks every
payload for refs and reads the files back.
"""

from __future__ import annotations

import base64
import hashlib
import os
import tempfile
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.peers.drivers.common import main
from bench.peers.drivers.raw import Raw

IMAGE_MIN_BASE64 = 1024
INLINE_LIMIT = 16 * 1024
IMAGE, TEXT = "blob:b64:", "blob:utf8:"


class RawFiles(Raw):
    def __init__(self, dsn: str, workdir: str) -> None:
        super().__init__(dsn, workdir)
        self.root = Path(workdir) / "blobs"
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, digest: str) -> Path:
        return self.root / digest[:2] / digest[2:4] / digest

    def _out(self, value: Any, new: dict[str, bytes], *, image: bool = False) -> Any:
        if isinstance(value, str):
            if image and len(value) >= IMAGE_MIN_BASE64:
                return IMAGE + self._keep(base64.b64decode(value), new, text=False)
            if len(value) > INLINE_LIMIT // 4 and len(value.encode()) > INLINE_LIMIT:
                return TEXT + self._keep(value.encode(), new, text=True)
            return value
        if isinstance(value, dict):
            is_image = value.get("type") == "image"
            return {k: self._out(v, new, image=is_image and k == "data") for k, v in value.items()}
        if isinstance(value, list):
            return [self._out(v, new) for v in value]
        return value

    def _keep(self, data: bytes, new: dict[str, bytes], *, text: bool) -> str:
        digest = hashlib.sha256(data).hexdigest()
        if digest not in new and not self._path(digest).exists():
            new[digest] = zlib.compress(data, 6, wbits=31) if text else data
        return digest

    def _write(self, new: dict[str, bytes]) -> None:
        if not new:
            return
        created: set[Path] = set()
        fds: list[tuple[int, str, Path]] = []
        for digest, data in new.items():
            path = self._path(digest)
            for directory in (path.parent.parent, path.parent):
                if not directory.exists():
                    directory.mkdir()
                    created.add(directory.parent)
            fd, tmp = tempfile.mkstemp(dir=path.parent)
            fds.append((fd, tmp, path))
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        for fd, _tmp, _path in fds:
            os.fsync(fd)
            os.close(fd)
        for _fd, tmp, path in fds:
            os.replace(tmp, path)
        for directory in {path.parent for _fd, _tmp, path in fds} | created:
            dfd = os.open(directory, os.O_RDONLY)
            os.fsync(dfd)
            os.close(dfd)

    def append(self, events: Sequence[dict[str, Any]]) -> None:
        new: dict[str, bytes] = {}
        compact = [self._out(event, new) for event in events]
        self._write(new)
        super().append(compact)

    def _in(self, value: Any) -> Any:
        if isinstance(value, str):
            if value.startswith(IMAGE):
                return base64.b64encode(self._path(value[len(IMAGE) :]).read_bytes()).decode()
            if value.startswith(TEXT):
                stored = self._path(value[len(TEXT) :]).read_bytes()
                return zlib.decompress(stored, wbits=31).decode()
            return value
        if isinstance(value, dict):
            return {k: self._in(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self._in(v) for v in value]
        return value

    def read(self) -> list[dict[str, Any]]:
        return [self._in(event) for event in super().read()]


if __name__ == "__main__":
    main(RawFiles)
