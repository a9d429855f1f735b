"""The results store: one JSON record per run under `<results>/<experiment>/`, and the paper's numbers to
compare them with.

Entry points: `load` (an experiment's stored runs as a frame), `save_record` / `stored_record` (a run's
record, validated by `check_record`), `Claims` (one lock per run, so that processes sharing a grid never run
the same key), `compare_with_paper` (ours beside the ProDiGy paper's tables, `paper_results.csv`). The
folder layout is `experiment_dir`'s.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import socket
import stat
import tempfile
import threading
import time
import uuid
import warnings
from collections.abc import Iterable
from importlib.resources import files
from pathlib import Path
from typing import Any, Protocol

import pandas as pd

from prodigy_core import paths
from prodigy_core.config import ConfigError, RunConfig, as_row, field_names
from prodigy_core.names import NO_ATTACK, VARIANTS
from prodigy_core.registry import records_are_data
from prodigy_core.safe_io import create_json_exclusive, quarantine, write_json_atomic

LOCK_HEARTBEAT_S = 30.0  # a claiming process refreshes its locks' mtime this often
LOCK_STALE_S = 600.0  # a lock not refreshed for this long is stale, whoever wrote it
# Columns of paper_results.csv that identify a setting (with defense and attack: one cell of a table).
PAPER_SETTING = ["dataset", "distribution", "dirichlet_alpha", "n_clients", "n_byzantine", "local_momentum",
                 "algorithm", "local_steps", "rounds"]  # fmt: skip
WITHIN_POINTS = 3.0  # a cell "matches" the paper when |ours - paper| <= this many accuracy points


class Grid(Protocol):
    """What the store reads of an experiment (`experiments.Experiment`, which imports this module): the
    results folder's name, the grid's configs in order, and the same grid under another variant."""

    @property
    def results_name(self) -> str: ...

    @property
    def configs(self) -> list[RunConfig]: ...

    def with_variant(self, variant: str) -> Grid: ...


# ------------------------------------------------------------------------------------------- paths


def resolve_results_dir(results_dir: str | os.PathLike | None = None) -> Path:
    """The given folder, else env PRODIGY_RESULTS_DIR, else <project folder>/results (`paths.results_dir`,
    read now, so tests and notebooks can change directory or environment)."""
    if results_dir is not None:
        return Path(results_dir)
    return paths.results_dir()


def experiment_dir(name: str, results_dir: str | os.PathLike | None = None) -> Path:
    """An experiment's folder (smoke runs in `<experiment>-smoke/`, mini ones in `-mini/`). Its layout:

        <key>.json            a finished run: RunResult.to_dict() plus key, experiment, status
        <key>.failed.json     a run that raised: its config and the error (retried on the next grid)
        <key>.lock            a run being worked on: {pid, host, started}; mtime = heartbeat (`Claims`)
        checkpoints/<key>.pt  the training loop's checkpoint, to resume an interrupted run
        <name>.<why>-<time>   a record, lock or checkpoint found invalid, moved aside (`safe_io.quarantine`)

    `key` is `RunConfig.key()`, a hash of every result-affecting field of the resolved config."""
    return resolve_results_dir(results_dir) / name


def record_path(folder: Path, key: str) -> Path:
    return folder / f"{key}.json"


def failure_path(folder: Path, key: str) -> Path:
    return folder / f"{key}.failed.json"


def check_writable(
    folder: Path, what: str = "results", fix: str = "pass --results-dir or set PRODIGY_RESULTS_DIR"
) -> None:
    """Create `folder` and a file in it, or raise an OSError that names the folder and the fix: called
    before training, so that a run's result (or its checkpoints: ``what``) is never lost to a folder it
    cannot be written to."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise OSError(
            e.errno, f"cannot write {what} into {folder} ({e.strerror}); {fix} to a writable folder"
        ) from None


def checkpoint_dir(folder: Path) -> Path:
    """Where `training.run` keeps `<key>.pt` checkpoints (deleted when a run completes)."""
    return folder / "checkpoints"


# ------------------------------------------------------------------------------------------- writing


def save_record(folder: Path, key: str, result: dict[str, Any], experiment: str) -> Path:
    """Store a finished run (a RunResult.to_dict()); then clears an earlier failure record of the same key and
    the run's checkpoint (`checkpoint_dir`), which training leaves until the record is written: a record
    that cannot be written (a full disk) loses no work, the next attempt resumes. Written atomically
    (`safe_io.atomic_write`: a temporary file in the same folder, then os.replace), so a reader or a killed
    writer never sees half a record."""
    path = record_path(folder, key)
    write_json_atomic(path, {"key": key, "experiment": experiment, "status": "done", **result})
    failure_path(folder, key).unlink(missing_ok=True)
    (checkpoint_dir(folder) / f"{key}.pt").unlink(missing_ok=True)
    return path


def check_record(record: Any, path: Path) -> str | None:
    """Why `record`, read from `path`, is not a valid finished run; None when it is one: a JSON object whose
    key matches its file name and its config, status done, final_accuracy in [0, 100], accuracy_curve
    [round, accuracy %] pairs of finite numbers, detection_precision and detection_recall absent, null or in
    [0, 1] (what the reports read). An invalid record is not counted; the grid moves it aside and reruns that
    run (`stored_record`)."""
    if not isinstance(record, dict):
        return f"a record is a JSON object, this is {type(record).__name__}"
    key = path.name.removesuffix(".json")
    if record.get("key") != key:
        return f"its key {record.get('key')!r} is not its file name's {key!r}"
    if record.get("status") != "done":
        return f"status={record.get('status')!r}, not 'done'"
    config = record.get("config")
    if not isinstance(config, dict):
        return "it has no config"
    try:
        config_key = record_config_key(record)
    except (ConfigError, TypeError) as e:
        return f"its config is invalid ({e})"
    except KeyError as e:
        return f"it names the plug-in {e} without its code hash in 'plugins'"
    if config_key != key:
        return f"its config has the key {config_key}, not {key}"
    accuracy = record.get("final_accuracy")
    if isinstance(accuracy, bool) or not isinstance(accuracy, int | float) or not 0 <= accuracy <= 100:
        return f"final_accuracy={accuracy!r} is not a percentage in [0, 100]"
    curve = record.get("accuracy_curve", [])
    if not isinstance(curve, list) or not all(
        isinstance(p, list) and len(p) == 2 and all(map(finite_number, p)) for p in curve
    ):
        return (f"accuracy_curve={short_repr(curve)} is not a list of [round, accuracy %] pairs of finite "
                "numbers")  # fmt: skip
    for name in ("detection_precision", "detection_recall"):
        share = record.get(name)
        if share is not None and not (finite_number(share) and 0 <= share <= 1):
            return f"{name}={short_repr(share)} is not null nor a share in [0, 1]"
    return None


def finite_number(value: Any) -> bool:
    """A JSON number a float holds: no bool, NaN, infinity or integer past a float's range."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer past 1.8e308
        return False


def record_config_key(record: dict[str, Any]) -> str:
    """The key of a record's config, computed from the record alone: no plug-in is imported or read, its
    code hash is the one the record stores (``plugins``; `registry.records_are_data`). ConfigError or
    TypeError for an invalid config, KeyError for a plug-in without a stored hash."""
    plugins, config = record.get("plugins") or {}, record.get("config")
    if not isinstance(config, dict):
        raise ConfigError("it has no config (a mapping of RunConfig fields)")
    if not isinstance(plugins, dict):
        raise ConfigError(f"plugins={short_repr(plugins)} is not a mapping of plug-in: code hash")
    with records_are_data():
        return RunConfig.from_dict(config).key(code=plugins)


def short_repr(value: Any, limit: int = 80) -> str:
    """`value` as repr, at most `limit` characters (an error line's)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


NOT_REGULAR = "not a regular file"
# `safe_io`'s temporary files of a record, a failure, a lock or a checkpoint: .<name>.<random>.tmp
TEMPORARY = re.compile(r"\..+\.(json|lock|pt)\.[a-z0-9_]+\.tmp")


def _read_json(path: Path) -> tuple[Any, str | None]:
    """(content, None), or (None, why) when the file is not UTF-8 JSON or not a regular file (a FIFO, a
    folder, a device, a dangling link: never read, so never a hang); FileNotFoundError when absent."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a FIFO opens without a writer
    except FileNotFoundError:
        if os.path.islink(path):
            return None, f"{NOT_REGULAR} (a symbolic link to nothing)"
        raise
    except IsADirectoryError:  # Windows
        return None, f"{NOT_REGULAR} (a folder)"
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "a device or socket"
        return None, f"{NOT_REGULAR} ({kind})"
    with os.fdopen(fd, "rb") as fh:
        data = fh.read()
    try:
        return json.loads(data.decode("utf-8")), None
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError too; nesting past the recursion limit
        return None, f"not valid JSON ({e})"


def judge_record(folder: Path, key: str) -> tuple[dict[str, Any] | None, str | None]:
    """(the valid finished record of `key`, None), (None, why it is invalid), or (None, None) when there is
    none. Moves and warns nothing: the one judgement of "stored" (`stored_record`, the grid's dry run and
    `read_records`, which the report reads, all apply `check_record`)."""
    path = record_path(folder, key)
    try:
        record, why = _read_json(path)
    except (FileNotFoundError, NotADirectoryError):  # the folder's writability is checked before a run
        return None, None
    why = why or check_record(record, path)
    return (record, None) if why is None else (None, why)


def stored_record(folder: Path, key: str) -> dict[str, Any] | None:
    """The valid finished record of `key`, or None. An invalid one is moved aside with a warning naming its
    path and why, so that the run is done again."""
    path = record_path(folder, key)
    record, why = judge_record(folder, key)
    if why is None:
        return record
    try:
        moved = quarantine(path, "invalid")
    except OSError as e:
        raise ValueError(
            f"{path}: not a valid result record ({why}), and it cannot be moved aside to redo the run: "
            f"{e.strerror or e}; make {folder} writable or pass --results-dir"
        ) from None
    warnings.warn(f"{path}: not a valid result record: {why}; moved to {moved.name}, the run is redone",
                  RuntimeWarning, stacklevel=2)  # fmt: skip
    return None


def save_failure(
    folder: Path, key: str, config: dict[str, Any], error: BaseException, experiment: str
) -> Path:
    """Store a run that raised: its config and the error. It is not a result: the next grid retries it."""
    record = {
        "key": key,
        "experiment": experiment,
        "status": "failed",
        "config": config,
        "error": f"{type(error).__name__}: {error}",
        "traceback": getattr(error, "traceback_text", None),
        "host": socket.gethostname(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    path = failure_path(folder, key)
    write_json_atomic(path, record)
    return path


class Claims:
    """Exclusive claims on the runs of one experiment folder, one lock file per key.

    claim(key) creates `<key>.lock` whole or not at all (`safe_io.create_json_exclusive`): exactly one
    process succeeds, and a process killed while claiming leaves no lock. While it holds locks, a daemon
    thread refreshes their mtime every LOCK_HEARTBEAT_S (the heartbeat). A lock is stale and taken over
    when its process is dead (same host), when its heartbeat is older than LOCK_STALE_S (a killed process
    on another host, a reused pid, a hand-made file), or when it is not a lock record and more than a few
    seconds old. The heartbeat also writes a held lock again when it is gone, and warns once when another
    process holds it now. With skip_done, a key whose record appeared meanwhile is not claimed.
    A finished run's stale lock is removed by `clear_finished` (the grid calls it for its done runs).
    """

    def __init__(self, folder: Path, skip_done: bool = True) -> None:
        self.folder = folder
        self.skip_done = skip_done
        self.host = socket.gethostname()
        self.held: set[str] = set()
        self._written: dict[str, dict[str, Any]] = {}  # the lock content this object wrote, per held key
        folder.mkdir(parents=True, exist_ok=True)
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        self._mutex = threading.Lock()  # between the heartbeat and `release`
        self._replaced: set[str] = set()  # held keys whose lock another process holds now (warned once)

    def _heartbeat(self) -> None:
        while not self._stop.wait(LOCK_HEARTBEAT_S):
            for key in list(self.held):
                self._beat_once(key)

    def _beat_once(self, key: str) -> None:
        """Refresh a held lock's mtime. A lock gone from under a live claim (a take-over killed between its
        rename and its putting back, a hand) is written again; a lock that is another process's now (it
        took this one over as stale, or claimed in the gap) is named in a warning, once: both may be
        training the run."""
        with self._mutex:  # never puts back a lock that `release` is removing
            if key not in self.held:
                return
            path, mine = self.lock_path(key), self._written[key]
            try:
                owner, _ = _read_json(path)
            except FileNotFoundError:
                with contextlib.suppress(OSError):
                    if create_json_exclusive(path, mine):
                        return
                owner = None
            except OSError:  # a passing error: the next beat tries again
                return
            if owner == mine:
                with contextlib.suppress(OSError):
                    os.utime(path)
            elif key not in self._replaced:
                self._replaced.add(key)
                warnings.warn(f"{path}: the lock of a run this process trains is another process's now; both "
                              "may train it", RuntimeWarning, stacklevel=2)  # fmt: skip

    def lock_path(self, key: str) -> Path:
        return self.folder / f"{key}.lock"

    def claim(self, key: str) -> bool:
        path = self.lock_path(key)
        for _ in range(2):
            mine = self._lock_record()
            if not create_json_exclusive(path, mine):
                if not self._take_over_if_stale(path):
                    return False
                continue
            if self.skip_done and stored_record(self.folder, key) is not None:  # finished by another process
                path.unlink()
                return False
            self._written[key] = mine  # before held: the heartbeat reads it for every held key
            self.held.add(key)
            if self._beat is None:
                self._beat = threading.Thread(target=self._heartbeat, name="lock-heartbeat", daemon=True)
                self._beat.start()
            return True
        return False

    def _lock_record(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "host": self.host, "started": time.time()}

    def _take_over_if_stale(self, path: Path) -> bool:
        """Remove the lock at `path` when it is stale (the class's rules); True when it is gone."""
        try:
            seen = _identity(path)
        except FileNotFoundError:
            return True  # released meanwhile: try again
        except OSError:  # a passing NFS error: busy for now
            return False
        unreadable = False
        try:
            owner, why = _read_json(path)
        except FileNotFoundError:
            return True
        except OSError:  # another user's private lock, a passing NFS error: judged by its heartbeat
            owner, why, unreadable = None, None, True
        if why is not None and why.startswith(NOT_REGULAR):  # never a lock of ours (a FIFO, a folder, a link)
            moved = quarantine(path, "invalid")
            warnings.warn(f"{path}: {why}, not a lock; moved to {moved.name}", RuntimeWarning, stacklevel=3)
            return True
        age = time.time() - seen[0] / 1e9
        if isinstance(owner, dict):
            dead = owner.get("host") == self.host and not _pid_alive(owner.get("pid"))
            stale = dead or age > LOCK_STALE_S
        elif unreadable:
            stale = age > LOCK_STALE_S
        else:
            # Garbage (a hand-made file, a crash between create and write where the file system has no hard
            # links), or such a lock being written right now: a fresh one is younger than a few seconds.
            stale = age > 10
        if not stale:
            return False
        # Rename first: of several processes that found the same stale lock, only one wins the rename.
        grave = path.with_name(f"{path.name}.stale.{self.host}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
        try:
            os.rename(path, grave)
        except FileNotFoundError:
            return True
        try:
            moved, _ = _read_json(grave)
        except OSError:
            moved = None
        if _identity(grave) != seen or (not unreadable and moved != owner):
            # Another process took the stale lock over between our look and our rename (or its owner's
            # heartbeat came): this is a live lock. Put it back unless a third has claimed meanwhile (link
            # fails on an existing name).
            with contextlib.suppress(OSError):
                os.link(grave, path)
            grave.unlink()
            return False
        grave.unlink()
        return True

    def clear_finished(self, keys: Iterable[str]) -> None:
        """Remove what killed processes left for these finished runs: a stale lock (`_take_over_if_stale`),
        a checkpoint and a failure record older than the record (a process killed inside `save_record`),
        which no later claim comes to take over; and the store's temporary files untouched for LOCK_STALE_S
        (a writer killed inside `safe_io.atomic_write`). A run claimed meanwhile (a --force rerun) keeps its
        files, and so does the failure of a --force rerun (newer than the record)."""
        for key in keys:
            path = self.lock_path(key)
            if key in self.held or (os.path.lexists(path) and not self._take_over_if_stale(path)):
                continue
            leftovers = [checkpoint_dir(self.folder) / f"{key}.pt"]
            if _failure_outdated(self.folder, key):
                leftovers.append(failure_path(self.folder, key))
            if any(p.exists() for p in leftovers) and create_json_exclusive(path, self._lock_record()):
                for leftover in leftovers:
                    _remove(leftover)
                _remove(path)
        for folder in (self.folder, checkpoint_dir(self.folder)):
            for temporary in folder.glob(".*.tmp"):
                if TEMPORARY.fullmatch(temporary.name) and time.time() - _mtime(temporary) > LOCK_STALE_S:
                    _remove(temporary)

    def release(self, key: str) -> None:
        """Drop the claim on `key`, and its lock when the lock is still ours: a process whose heartbeat
        stopped past LOCK_STALE_S (suspended) may find another's lock there, which it must not remove."""
        with self._mutex:
            if key not in self.held:
                return
            self.held.discard(key)
            mine, path = self._written.pop(key, None), self.lock_path(key)
            try:
                owner, _ = _read_json(path)
            except OSError:  # gone already
                return
            if mine is None or not isinstance(owner, dict) or owner == mine:
                _remove(path)

    def release_all(self) -> None:
        for key in list(self.held):
            self.release(key)
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
            self._beat, self._stop = None, threading.Event()


def lock_state(path: Path) -> str:
    """Why the run of lock `path` was left undone, from the lock itself: its claimant alive (rerun when it
    is done), dead (taken over by the next run), on another host, or the lock gone or unreadable."""
    try:
        owner, why = _read_json(path)
    except FileNotFoundError:
        return f"its lock {path} is gone (its claimant stopped): rerun to do it"
    except OSError as e:
        age = time.time() - _mtime(path)
        return (f"its lock {path} is unreadable ({e.strerror or e}), last heartbeat {age:.0f} s ago (taken "
                f"over after {LOCK_STALE_S:.0f} s without one); rerun when it is done")  # fmt: skip
    if not isinstance(owner, dict):
        return f"its lock {path} is not a lock record ({why}): the next run takes it over"
    pid, host = owner.get("pid"), owner.get("host")
    if host == socket.gethostname():
        if not _pid_alive(pid):
            return f"its claimant (pid {pid}) is dead: its lock {path} is taken over by the next run; rerun"
        return f"claimed by another process ({path}), pid {pid}, alive; rerun when it is done"
    age = time.time() - _mtime(path)
    return (
        f"claimed by another process ({path}), pid {pid} on host {host}, last heartbeat {age:.0f} s ago "
        f"(taken over after {LOCK_STALE_S:.0f} s without one); rerun when it is done"
    )


def _pid_alive(pid: Any) -> bool:
    """Whether process `pid` of this host runs: a killed one that its parent has not reaped yet (a zombie,
    state Z in /proc where there is one) holds no lock, though a signal still reaches its pid."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # the state follows the command's closing parenthesis: "pid (comm) S ..."
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):  # no /proc (macOS), or the process just went
        return True


def _failure_outdated(folder: Path, key: str) -> bool:
    """Whether `key`'s failure record is older than its finished record: history, left by a process killed
    inside `save_record` (a --force rerun that failed after the record was made writes a newer one)."""
    failed, done = _mtime(failure_path(folder, key)), _mtime(record_path(folder, key))
    return 0 < failed <= done


def _identity(path: Path) -> tuple[int, int]:
    """(mtime in ns, size) of `path` itself: this lock after a heartbeat differs, and so does another one,
    with its content (the inode is not used: some network mounts renumber a file that is renamed)."""
    st = os.lstat(path)
    return st.st_mtime_ns, st.st_size


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return 0.0


def _remove(path: Path) -> bool:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    return True


# ------------------------------------------------------------------------------------------- reading


def read_records(folder: Path, include_failed: bool = False) -> list[dict[str, Any]]:
    """Every record in an experiment folder (finished runs; failed ones too with include_failed)."""
    records = []
    for path in sorted(folder.glob("*.json")):
        failed = path.name.endswith(".failed.json")
        key = path.name.removesuffix(".failed.json" if failed else ".json")
        if failed and (not include_failed or _failure_outdated(folder, key)):
            continue  # a finished run's older failure: history
        try:
            record, why = _read_json(path)
        except FileNotFoundError:  # moved aside by another process meanwhile
            continue
        if failed:
            ok = isinstance(record, dict) and record.get("key") == key
            why = why or (None if ok else "not a failure record of its key")
        else:
            why = why or check_record(record, path)
        if why is not None:
            warnings.warn(f"{path}: not a valid result record, left out: {why} (the grid redoes that run)",
                          RuntimeWarning, stacklevel=2)  # fmt: skip
            continue
        records.append(record)
    return records


def load(
    experiment: str | Grid, results_dir: str | os.PathLike | None = None, include_failed: bool = False
) -> pd.DataFrame:
    """The stored runs of an experiment as a frame: one row per run, the config fields as columns, then the
    result fields (final_accuracy in percent, final_loss, accuracy_curve, stand_in, ..., env_* from
    `environment`), plus key and status.

    experiment: an Experiment (only the runs of its current grid, in grid order; smoke runs for a smoke
    experiment) or a results folder name (every record in it).
    """
    grid = not isinstance(experiment, str | os.PathLike)
    name = experiment.results_name if grid else experiment
    records = read_records(experiment_dir(name, results_dir), include_failed)
    if grid:
        order = {c.key(): i for i, c in enumerate(experiment.configs)}
        records = sorted((r for r in records if r.get("key") in order), key=lambda r: order[r["key"]])
    rows = [_flatten(r) for r in records]
    columns = field_names() + ["final_accuracy", "stand_in", "key", "status"]
    if not rows:
        return pd.DataFrame(columns=columns)
    df = pd.DataFrame(rows)
    return df[[c for c in columns if c in df.columns] + [c for c in df.columns if c not in columns]]


def _flatten(record: dict[str, Any]) -> dict[str, Any]:
    row = as_row(record.get("config", {}))
    if isinstance(row.get("record_distances_at"), list):
        row["record_distances_at"] = tuple(row["record_distances_at"])  # hashable, like RunConfig's
    config_fields = set(field_names())
    for name, value in record.items():
        if name == "config":
            continue
        if name == "environment" and isinstance(value, dict):
            row.update({f"env_{k}": v for k, v in value.items()})
        else:
            if name in config_fields:  # a result field named as a config field (attack_params: per round)
                row[SHADOWED + name] = row.get(name)
            row[name] = value
    return row


# The column that keeps a config field's value where a result field of the same name takes its column.
SHADOWED = "config."


def data_source_of(df: pd.DataFrame | None) -> str | None:
    """The one data source of a results frame (``RunConfig.data_source``; None when not recorded).

    Records from different sources (e.g. CIFAR-10's binary batches and its JPEG copy, or two different sets
    of FEMNIST writers) never mix in one table: a frame with several is an error naming them."""
    if df is None or "data_source" not in df.columns:
        return None
    sources = sorted({v for v in df["data_source"].tolist() if isinstance(v, str) and v})
    if len(sources) > 1:
        raise ValueError(
            f"the results mix data sources {', '.join(sources)}; report one at a time "
            f"(select rows with df[df['data_source'] == ...])"
        )
    return sources[0] if sources else None


# A cell of a table or of a comparison with the paper is a mean over seeds only (docs/semantics.md, "Reports
# and the GPU driver's import"): these fields may differ among its runs, every other config field may not.
SEED_FIELDS = ("seed", "data_seed")
MISSING_MEANS = {"precision": "fp32", "variant": "paper"}  # a record without these fields predates them


def precisions_in(df: pd.DataFrame) -> list[str]:
    """The precisions of a results frame's runs, fp32 first (a record without the field predates it and ran
    fp32)."""
    if "precision" not in df.columns:
        return ["fp32"] if len(df) else []
    present = set(df["precision"].fillna("fp32"))
    return sorted(present, key=lambda p: (p != "fp32", p))


def check_one_setting_per_cell(df: pd.DataFrame, cell: list[str], fix: str) -> None:
    """ValueError naming the first config field (other than `cell`'s and `SEED_FIELDS`) that differs among
    the runs of one cell, the runs grouped by the columns `cell`, so that a cell never averages over it;
    `fix` says what to do (put the field in the layout, report one value at a time). A value missing from a
    record (None: a field newer than it, or one `RunConfig.resolved` derives) differs from none, but for
    `MISSING_MEANS`' fields."""
    fields = [c for c in field_names() if c in df.columns and c not in RunConfig.NON_RESULT_FIELDS
              and c not in SEED_FIELDS and c not in cell]  # fmt: skip
    if df.empty or not fields:
        return
    groups = [df[c].map(repr) for c in cell]
    for field in fields:
        missing = repr(MISSING_MEANS[field]) if field in MISSING_MEANS else None
        column = df[SHADOWED + field] if SHADOWED + field in df.columns else df[field]
        shown = column.map(lambda v, m=missing: m if _missing(v) else repr(v))
        counts = shown.groupby(groups, sort=False).nunique() if groups else pd.Series([shown.nunique()])
        if (counts > 1).any():
            values = ", ".join(sorted(set(shown.dropna()))[:6])
            raise ValueError(f"the runs of one cell differ in {field} ({values}): a cell averages over seeds "
                             f"only; {fix}")  # fmt: skip


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and value != value)


# ------------------------------------------------------------------------------------------- the paper


def paper_results() -> pd.DataFrame:
    """Every numeric cell of the paper's five result tables (package copy of paper_results.csv)."""
    with files("prodigy_core").joinpath("data", "paper_results.csv").open() as fh:
        return pd.read_csv(fh)


def load_variants(experiment: Grid, results_dir: str | os.PathLike | None = None) -> pd.DataFrame:
    """The stored runs of an experiment's grid under every variant (`names.VARIANTS`), in that order; a
    ``variant`` column tells them apart."""
    frames = [load(experiment.with_variant(v), results_dir) for v in VARIANTS]
    frames = [f for f in frames if not f.empty]
    return pd.concat(frames, ignore_index=True) if frames else load(experiment, results_dir)


def variants_in(df: pd.DataFrame) -> list[str]:
    """The variants of a results frame's runs, in `names.VARIANTS` order (a record without the field
    predates it and ran the paper's text)."""
    if "variant" not in df.columns:
        return ["paper"] if len(df) else []
    present = set(df["variant"].fillna("paper"))
    return [v for v in VARIANTS if v in present] + sorted(present - set(VARIANTS))


def compare_with_paper(
    df: pd.DataFrame,
    table: str,
    tol: float = 0.5,
    variant: str | None = None,
    match_rounds: bool = True,
) -> pd.DataFrame:
    """Our numbers next to the paper's, one row per cell of paper table `table` (bigtable, femnist_n20, ...),
    for the runs of one ``variant`` (None: the frame must hold one variant only).

    Columns: the paper's setting columns, defense, attack, ours (mean final accuracy over seeds, %), ours_std
    (population std, NaN for one seed), n_seeds, n_diverged (the runs recorded as diverged), paper,
    paper_std, delta = ours - paper, paper_worst (the
    paper's bold cell), ours_worst (our worst case: within `tol` points of our lowest accuracy over the
    attacks of the same defense and setting, "no attack" excluded) and worst_case_match (per defense and
    setting: one of the paper's worst-case attacks is among ours; NA until every attack of the row has run).

    Runs on a stand-in dataset never match a paper cell. Cells we have not run have NaN in ours. The last
    column, ``variant``, names the variant compared. Records from several data sources
    (`RunConfig.data_source`) are an error: they never mix in one comparison; so are runs of one cell that
    differ in a field other than the seed (`check_one_setting_per_cell`: precision, lr, ...).
    With match_rounds=False (the mini scale) a run matches the paper's cell of the same setting at any
    number of rounds; the rounds column is then the paper's.
    """
    present = variants_in(df)
    if variant is None:
        if len(present) > 1:
            raise ValueError(
                f"the runs hold the variants {', '.join(present)}: compare one at a time with "
                f"compare_with_paper(df, {table!r}, variant=...)"
            )
        variant = present[0] if present else "paper"
    if "variant" in df.columns:
        df = df[df["variant"].fillna("paper") == variant]
    paper = paper_results()
    paper = paper[paper["table"] == table].drop(columns="table").reset_index(drop=True)
    if paper.empty:
        tables = ", ".join(dict.fromkeys(paper_results()["table"]))
        raise ValueError(f"table={table!r} is not in paper_results.csv; valid: {tables}")
    # The paper's "noniid" is our Dirichlet split for CIFAR-10 and the natural per-writer split for FEMNIST.
    natural = paper["dataset"] == "femnist"
    paper["distribution"] = paper["distribution"].where(
        paper["distribution"] != "noniid", natural.map({True: "natural", False: "dirichlet"})
    )
    paper = paper.rename(columns={"accuracy_mean": "paper", "accuracy_std": "paper_std",
                                  "worst_case_bold": "paper_worst"})  # fmt: skip
    ignored = {"algorithm"} | (set() if match_rounds else {"rounds"})
    join = [c for c in PAPER_SETTING if c not in ignored] + ["defense", "attack"]
    paper["_alpha"] = paper["dirichlet_alpha"].where(paper["distribution"] == "dirichlet", -1.0)

    ours = df
    data_source_of(ours)
    if "stand_in" in ours.columns:
        ours = ours[ours["stand_in"].isna()]
    if "status" in ours.columns:
        ours = ours[ours["status"].fillna("done") == "done"]
    ours = ours.assign(_alpha=ours["dirichlet_alpha"].where(ours["distribution"] == "dirichlet", -1.0))
    keys = [c if c != "dirichlet_alpha" else "_alpha" for c in join]
    fix = "compare one value at a time (select rows of the frame)"
    check_one_setting_per_cell(ours, [*keys, "dirichlet_alpha"], fix)
    ours = ours.astype({"local_momentum": float, "_alpha": float})
    diverged = ours["diverged"].fillna(False).astype(bool) if "diverged" in ours.columns else False
    grouped = ours.assign(_diverged=diverged).groupby(keys, dropna=False)
    accuracy = grouped["final_accuracy"]
    summary = pd.DataFrame({"ours": accuracy.mean(), "ours_std": accuracy.std(ddof=0),
                            "n_seeds": accuracy.count(), "n_diverged": grouped["_diverged"].sum()}
                           )  # fmt: skip
    summary.loc[summary["n_seeds"] < 2, "ours_std"] = float("nan")
    paper = paper.astype({"local_momentum": float, "_alpha": float})
    out = paper.merge(summary.reset_index(), on=keys, how="left").drop(columns="_alpha")
    out["n_seeds"] = out["n_seeds"].fillna(0).astype(int)
    out["n_diverged"] = out["n_diverged"].fillna(0).astype(int)
    out["delta"] = out["ours"] - out["paper"]

    # One table row within one column block: the same setting and defense, all attacks.
    row = [out[c].fillna(-1) for c in PAPER_SETTING + ["defense"]]
    attacked = out["attack"] != NO_ATTACK
    lowest = out["ours"].where(attacked).groupby(row).transform("min")
    out["ours_worst"] = attacked & (out["ours"] <= lowest + tol)
    complete = (out["ours"].notna() | ~attacked).groupby(row).transform("all")
    hit = (out["ours_worst"] & out["paper_worst"]).groupby(row).transform("any")
    out["worst_case_match"] = hit.astype(object).where(complete, pd.NA)
    out["variant"] = variant
    columns = PAPER_SETTING + ["defense", "attack", "ours", "ours_std", "n_seeds", "n_diverged", "paper",
                               "paper_std", "delta", "paper_worst", "ours_worst", "worst_case_match",
                               "variant"]  # fmt: skip
    return out[columns]


def paper_agreement(comparison: pd.DataFrame) -> dict[str, Any]:
    """How well one `compare_with_paper` frame matches the paper: cells (all, run), the mean absolute
    difference over the cells run (points), those within `WITHIN_POINTS`, and the defense rows (setting +
    defense) whose worst-case attack agrees with the paper's bold cell, of the rows complete. A diverged run
    scores by a convention (chance under ``paper``), so a cell whose every run diverged is never counted
    within, however near the paper's number: its distance compares conventions, or, where the paper's cell
    trained, is a real disagreement. Those cells are listed (`diverged`: "defense / attack (paper X)")."""
    ran = comparison["ours"].notna()
    if "n_diverged" in comparison.columns:  # a frame of an older `compare_with_paper`: none counted
        all_diverged = ran & (comparison["n_diverged"] >= comparison["n_seeds"])
    else:
        all_diverged = ran & False
    delta = comparison.loc[ran, "delta"].abs()
    setting = list(comparison.columns[: comparison.columns.get_loc("attack")])  # ... defense: one table row
    rows = comparison.groupby([comparison[c].fillna(-1) for c in setting], sort=False)["worst_case_match"]
    rows = rows.first().dropna()
    diverged = comparison[all_diverged]
    return {
        "variant": comparison["variant"].iloc[0] if "variant" in comparison and len(comparison) else None,
        "cells": len(comparison),
        "cells_run": int(ran.sum()),
        "mean_abs_delta": float(delta.mean()) if len(delta) else float("nan"),
        "within": int(((delta <= WITHIN_POINTS) & ~all_diverged[ran]).sum()),
        "diverged": [
            f"{d} / {a} (paper {p:.2f})"
            for d, a, p in zip(diverged["defense"], diverged["attack"], diverged["paper"], strict=True)
        ],  # fmt: skip
        "worst_case_agree": int(rows.astype(bool).sum()),
        "worst_case_rows": len(rows),
    }


__all__ = [
    "Claims",
    "compare_with_paper",
    "data_source_of",
    "check_one_setting_per_cell",
    "precisions_in",
    "load_variants",
    "paper_agreement",
    "variants_in",
    "experiment_dir",
    "load",
    "paper_results",
    "read_records",
    "resolve_results_dir",
    "save_failure",
    "save_record",
    "check_record",
    "check_writable",
    "stored_record",
    "judge_record",
]
