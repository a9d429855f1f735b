"""Crash-safe files: a write that leaves a file either as it was or complete, never half-written, and a bad
file moved aside rather than deleted.

A ground-floor module (it imports no other `prodigy_core` module), shared by everything that writes: the
results store's records (`results`), the training loop's checkpoints (`training`) and the decoded datasets
(`data`).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any


@contextlib.contextmanager
def atomic_write(path: Path, mode: str = "w") -> Iterator[IO[Any]]:
    """Open a temporary file beside `path` and rename it onto `path` once the block succeeds, so that
    `path` holds either its old content or the complete new one, never a mix (records and checkpoints)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        # mkstemp makes the file 0600; the complete file gets the mode a plain open() would give it
        with contextlib.suppress(AttributeError, NotImplementedError):  # no fchmod (Windows before 3.13)
            os.fchmod(fd, 0o666 & ~umask())
        with os.fdopen(fd, mode) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def umask() -> int:
    """This process's umask, read without changing it where the system says it (Linux's /proc; setting
    it to read it back would race with other threads creating files)."""
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write JSON atomically (see `atomic_write`)."""
    with atomic_write(path) as fh:
        json.dump(obj, fh, indent=1, allow_nan=True)
        fh.write("\n")


def quarantine(path: Path, why: str) -> Path:
    """Move an invalid record, lock or checkpoint aside (never delete it) to `<name>.<why>-<time>`, a name
    that no reader of the store matches; returns the new path (`path` itself when it is already gone)."""
    stamp = time.strftime("%Y%m%dT%H%M%S")
    target = path.with_name(f"{path.name}.{why}-{stamp}-{os.getpid()}")
    try:
        os.rename(path, target)
    except FileNotFoundError:  # moved by another process meanwhile
        return path
    return target


__all__ = ["atomic_write", "quarantine", "umask", "write_json_atomic"]
