"""Crash-safe files: a write that leaves a file either as it was or complete, never half-written, and a bad
file moved aside rather than deleted.

A ground-floor module (it imports no other `prodigy_core` module), shared by everything that writes: the
results store's records and locks (`results`), the training loop's checkpoints (`training`) and the decoded
datasets (`data`).
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


def _temporary_beside(path: Path) -> tuple[int, str]:
    """A new temporary file in `path`'s folder (so that a rename or link onto `path` stays on one file
    system), with the mode a plain open() would give `path` (mkstemp makes it 0600)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    # no fchmod (Windows before 3.13), or a file system that refuses modes (some FUSE mounts): as it is
    with contextlib.suppress(AttributeError, NotImplementedError, OSError):
        os.fchmod(fd, 0o666 & ~umask())
    return fd, tmp


@contextlib.contextmanager
def atomic_write(path: Path, mode: str = "w") -> Iterator[IO[Any]]:
    """Open a temporary file beside `path` and rename it onto `path` once the block succeeds, so that
    `path` holds either its old content or the complete new one, never a mix (records and checkpoints)."""
    fd, tmp = _temporary_beside(path)
    try:
        with os.fdopen(fd, mode) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def create_json_exclusive(path: Path, obj: Any) -> bool:
    """Create `path` holding `obj` as JSON, or return False when it exists: of several processes, exactly
    one succeeds, and `path` never exists empty or half-written (the results store's locks). The content
    is written to a temporary file first and hard-linked onto `path`, which fails on an existing name; a
    process killed meanwhile leaves only the temporary file. Where the file system has no hard links, the
    file is created with O_EXCL and then written (a kill between the two leaves it empty)."""
    fd, tmp = _temporary_beside(path)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(obj, fh)
        try:
            os.link(tmp, path)
        except OSError as e:
            if os.stat(tmp).st_nlink == 2:  # NFS: a retried link says EEXIST for the link it made (open(2))
                return True
            if isinstance(e, FileExistsError):
                return False
            return _create_then_write(path, obj)  # no hard links here (e.g. FAT, some network shares)
        return True
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _create_then_write(path: Path, obj: Any) -> bool:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)  # the umask decides
    except FileExistsError:
        return False
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(obj, fh)
    except BaseException:  # e.g. a full disk: leave no empty file behind
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        raise
    return True


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


__all__ = ["atomic_write", "create_json_exclusive", "quarantine", "umask", "write_json_atomic"]
