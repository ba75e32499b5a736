"""Files that several processes may create at once: an exclusive lock around the work, a unique temporary name,
fsync and an atomic rename to publish, and a content hash recorded beside a file so that reuse checks what it
reads (how pip, safetensors and the HF cache publish files).

Two servers started cold on an empty cache both want to join the same GGUF and dequantize the same target: the
first takes the lock and does the work, the second waits for it and then finds the finished file.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import tempfile
from pathlib import Path
from typing import Callable, Iterator

HASH_SUFFIX = ".sha256"


@contextlib.contextmanager
def file_lock(path: str | Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on `path` + '.lock' (created if needed) for the block. The lock goes with
    the process: a killed holder never leaves it taken."""
    lock = Path(str(path) + ".lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def sha256_file(path: str | Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def fsync_dir(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _HashingWriter:
    """A binary file that also feeds what is written into a hash."""

    def __init__(self, f, h) -> None:
        self.f, self.h = f, h

    def write(self, data: bytes) -> int:
        self.h.update(data)
        return self.f.write(data)


def publish_file(out: str | Path, write: Callable[[object], None], record_hash: bool = True) -> str:
    """Write a file through write(binary file object) under a unique temporary name beside `out`, fsync it, and
    rename it over `out`; with record_hash, its sha256 goes to `out` + '.sha256' (published the same way, after
    the file). Returns the sha256. A failure removes the temporary file and leaves `out` as it was."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    try:
        h = hashlib.sha256()
        with os.fdopen(fd, "wb") as f:
            write(_HashingWriter(f, h))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
        digest = h.hexdigest()
        if record_hash:
            publish_file(Path(str(out) + HASH_SUFFIX), lambda g: g.write((digest + "\n").encode()),
                         record_hash=False)
        fsync_dir(out.parent)
        return digest
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def recorded_hash_matches(path: str | Path) -> bool:
    """Whether `path` exists and its sha256 equals the one recorded beside it."""
    path = Path(path)
    rec = Path(str(path) + HASH_SUFFIX)
    if not (path.is_file() and rec.is_file()):
        return False
    return rec.read_text().strip() == sha256_file(path)
