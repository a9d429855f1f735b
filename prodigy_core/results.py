"""The results store: one JSON record per run, and the paper's numbers to compare them with.

Layout under the results directory (default `<repo>/results`, env PRODIGY_RESULTS_DIR):

    <experiment>/<key>.json            a finished run: RunResult.to_dict() plus key, experiment, status
    <experiment>/<key>.failed.json     a run that raised: its config and the error (retried on the next grid)
    <experiment>/<key>.lock            a run being worked on: {pid, host, started}
    <experiment>/checkpoints/<key>.pt  the training loop's checkpoint, to resume an interrupted run

`key` is `RunConfig.key()`, a hash of every result-affecting field of the resolved config. Records are
written atomically (a temporary file in the same folder, then os.replace), so a reader or a killed writer
never sees half a record. A run is claimed with a lock file created with O_CREAT | O_EXCL, so two processes
working on the same grid never run the same key; a lock whose process is dead (same host) is stale and taken
over. Smoke runs live in `<experiment>-smoke/`.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import tempfile
import time
from collections.abc import Iterator
from importlib.resources import files
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import pandas as pd

from prodigy_core.config import VARIANTS, field_names

if TYPE_CHECKING:
    from prodigy_core.experiments import Experiment

RESULTS_DIR = Path(__file__).resolve().parents[1] / "results"  # default; env PRODIGY_RESULTS_DIR wins
NO_ATTACK = "none"
# Columns of paper_results.csv that identify a setting (with defense and attack: one cell of a table).
PAPER_SETTING = ["dataset", "distribution", "dirichlet_alpha", "n_clients", "n_byzantine", "local_momentum",
                 "algorithm", "local_steps", "rounds"]  # fmt: skip
WITHIN_POINTS = 3.0  # a cell "matches" the paper when |ours - paper| <= this many accuracy points


# ------------------------------------------------------------------------------------------- paths


def resolve_results_dir(results_dir: str | os.PathLike | None = None) -> Path:
    """The given folder, else env PRODIGY_RESULTS_DIR (read now, so tests and notebooks can set it), else
    RESULTS_DIR."""
    if results_dir is not None:
        return Path(results_dir)
    return Path(os.environ.get("PRODIGY_RESULTS_DIR", RESULTS_DIR))


def experiment_dir(name: str, results_dir: str | os.PathLike | None = None) -> Path:
    return resolve_results_dir(results_dir) / name


def record_path(folder: Path, key: str) -> Path:
    return folder / f"{key}.json"


def failure_path(folder: Path, key: str) -> Path:
    return folder / f"{key}.failed.json"


def checkpoint_dir(folder: Path) -> Path:
    """Where `training.run` keeps `<key>.pt` checkpoints (deleted when a run completes)."""
    return folder / "checkpoints"


# ------------------------------------------------------------------------------------------- writing


@contextlib.contextmanager
def atomic_write(path: Path, mode: str = "w") -> Iterator[IO[Any]]:
    """Open a temporary file beside `path` and rename it onto `path` once the block succeeds, so that
    `path` holds either its old content or the complete new one, never a mix (records and checkpoints)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
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


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write JSON atomically (see `atomic_write`)."""
    with atomic_write(path) as fh:
        json.dump(obj, fh, indent=1, allow_nan=True)
        fh.write("\n")


def save_record(folder: Path, key: str, result: dict[str, Any], experiment: str) -> Path:
    """Store a finished run (a RunResult.to_dict()); clears an earlier failure record of the same key."""
    path = record_path(folder, key)
    write_json_atomic(path, {"key": key, "experiment": experiment, "status": "done", **result})
    with contextlib.suppress(FileNotFoundError):
        failure_path(folder, key).unlink()
    return path


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

    claim(key) creates `<key>.lock` with O_CREAT | O_EXCL: exactly one process succeeds. A lock left by a dead
    process on this host is stale and taken over; a lock from another host is respected (delete it by hand
    if that host is gone). With skip_done, a key whose record appeared meanwhile is not claimed.
    """

    def __init__(self, folder: Path, skip_done: bool = True) -> None:
        self.folder = folder
        self.skip_done = skip_done
        self.host = socket.gethostname()
        self.held: set[str] = set()
        folder.mkdir(parents=True, exist_ok=True)

    def lock_path(self, key: str) -> Path:
        return self.folder / f"{key}.lock"

    def claim(self, key: str) -> bool:
        path = self.lock_path(key)
        for _ in range(2):
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                if not self._take_over_if_stale(path):
                    return False
                continue
            with os.fdopen(fd, "w") as fh:
                json.dump({"pid": os.getpid(), "host": self.host, "started": time.time()}, fh)
            if self.skip_done and record_path(self.folder, key).exists():  # finished by another process
                path.unlink()
                return False
            self.held.add(key)
            return True
        return False

    def _take_over_if_stale(self, path: Path) -> bool:
        try:
            owner = json.loads(path.read_text())
        except FileNotFoundError:
            return True  # released meanwhile: try again
        except (OSError, ValueError):
            # Being written right now, or garbage from a crash between create and write: a fresh lock is
            # younger than a few seconds.
            return time.time() - _mtime(path) > 10 and _remove(path)
        if owner.get("host") != self.host or _pid_alive(owner.get("pid")):
            return False
        # Rename first: of several processes that found the same stale lock, only one wins the rename.
        grave = path.with_name(f"{path.name}.stale.{os.getpid()}")
        try:
            os.rename(path, grave)
        except FileNotFoundError:
            return True
        grave.unlink()
        return True

    def release(self, key: str) -> None:
        if key in self.held:
            self.held.discard(key)
            with contextlib.suppress(FileNotFoundError):
                self.lock_path(key).unlink()

    def release_all(self) -> None:
        for key in list(self.held):
            self.release(key)


def _pid_alive(pid: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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
        if failed and not include_failed:
            continue
        try:
            records.append(json.loads(path.read_text()))
        except ValueError as e:
            raise ValueError(
                f"{path}: not a valid result record ({e}); delete it to rerun that run"
            ) from None
    return records


def load(
    experiment: str | Experiment, results_dir: str | os.PathLike | None = None, include_failed: bool = False
) -> pd.DataFrame:
    """The stored runs of an experiment as a frame: one row per run, the config fields as columns, then the
    result fields (final_accuracy in percent, final_loss, accuracy_curve, stand_in, ..., env_* from
    `environment`), plus key and status.

    experiment: an Experiment (only the runs of its current grid, in grid order; smoke runs for a smoke
    experiment) or a results folder name (every record in it).
    """
    from prodigy_core.experiments import Experiment

    name = experiment.results_name if isinstance(experiment, Experiment) else experiment
    records = read_records(experiment_dir(name, results_dir), include_failed)
    if isinstance(experiment, Experiment):
        order = {c.key(): i for i, c in enumerate(experiment.configs)}
        records = sorted((r for r in records if r.get("key") in order), key=lambda r: order[r["key"]])
    rows = [_flatten(r) for r in records]
    columns = field_names() + ["final_accuracy", "stand_in", "key", "status"]
    if not rows:
        return pd.DataFrame(columns=columns)
    df = pd.DataFrame(rows)
    return df[[c for c in columns if c in df.columns] + [c for c in df.columns if c not in columns]]


def _flatten(record: dict[str, Any]) -> dict[str, Any]:
    row = dict(record.get("config", {}))
    if isinstance(row.get("record_distances_at"), list):
        row["record_distances_at"] = tuple(row["record_distances_at"])  # hashable, like RunConfig's
    for name, value in record.items():
        if name == "config":
            continue
        if name == "environment" and isinstance(value, dict):
            row.update({f"env_{k}": v for k, v in value.items()})
        else:
            row[name] = value
    return row


# ------------------------------------------------------------------------------------------- the paper


def paper_results() -> pd.DataFrame:
    """Every numeric cell of the paper's five result tables (package copy of paper_results.csv)."""
    with files("prodigy_core").joinpath("data", "paper_results.csv").open() as fh:
        return pd.read_csv(fh)


def load_variants(experiment: Experiment, results_dir: str | os.PathLike | None = None) -> pd.DataFrame:
    """The stored runs of an experiment's grid under every variant (`config.VARIANTS`), in that order; a
    ``variant`` column tells them apart."""
    frames = [load(experiment.with_variant(v), results_dir) for v in VARIANTS]
    frames = [f for f in frames if not f.empty]
    return pd.concat(frames, ignore_index=True) if frames else load(experiment, results_dir)


def variants_in(df: pd.DataFrame) -> list[str]:
    """The variants of a results frame's runs, in `config.VARIANTS` order (a record without the field
    predates it and ran the paper's text)."""
    if "variant" not in df.columns:
        return ["paper"] if len(df) else []
    present = set(df["variant"].fillna("paper"))
    return [v for v in VARIANTS if v in present] + sorted(present - set(VARIANTS))


def compare_with_paper(
    df: pd.DataFrame, table: str, tol: float = 0.5, variant: str | None = None
) -> pd.DataFrame:
    """Our numbers next to the paper's, one row per cell of paper table `table` (bigtable, femnist_n20, ...),
    for the runs of one ``variant`` (None: the frame must hold one variant only).

    Columns: the paper's setting columns, defense, attack, ours (mean final accuracy over seeds, %), ours_std
    (population std, NaN for one seed), n_seeds, paper, paper_std, delta = ours - paper, paper_worst (the
    paper's bold cell), ours_worst (our worst case: within `tol` points of our lowest accuracy over the
    attacks of the same defense and setting, "no attack" excluded) and worst_case_match (per defense and
    setting: one of the paper's worst-case attacks is among ours; NA until every attack of the row has run).

    Runs on a stand-in dataset never match a paper cell. Cells we have not run have NaN in ours. The last
    column, ``variant``, names the variant compared.
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
    join = [c for c in PAPER_SETTING if c != "algorithm"] + ["defense", "attack"]
    paper["_alpha"] = paper["dirichlet_alpha"].where(paper["distribution"] == "dirichlet", -1.0)

    ours = df
    if "stand_in" in ours.columns:
        ours = ours[ours["stand_in"].isna()]
    if "status" in ours.columns:
        ours = ours[ours["status"].fillna("done") == "done"]
    ours = ours.assign(_alpha=ours["dirichlet_alpha"].where(ours["distribution"] == "dirichlet", -1.0))
    keys = [c if c != "dirichlet_alpha" else "_alpha" for c in join]
    ours = ours.astype({"local_momentum": float, "_alpha": float})
    grouped = ours.groupby(keys, dropna=False)["final_accuracy"]
    summary = pd.DataFrame(
        {"ours": grouped.mean(), "ours_std": grouped.std(ddof=0), "n_seeds": grouped.count()}
    )
    summary.loc[summary["n_seeds"] < 2, "ours_std"] = float("nan")
    paper = paper.astype({"local_momentum": float, "_alpha": float})
    out = paper.merge(summary.reset_index(), on=keys, how="left").drop(columns="_alpha")
    out["n_seeds"] = out["n_seeds"].fillna(0).astype(int)
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
    columns = PAPER_SETTING + ["defense", "attack", "ours", "ours_std", "n_seeds", "paper", "paper_std",
                               "delta", "paper_worst", "ours_worst", "worst_case_match",
                               "variant"]  # fmt: skip
    return out[columns]


def paper_agreement(comparison: pd.DataFrame) -> dict[str, Any]:
    """How well one `compare_with_paper` frame matches the paper: cells (all, run), the mean absolute
    difference over the cells run (points), the cells run within `WITHIN_POINTS`, and the defense rows
    (setting + defense) whose worst-case attack agrees with the paper's bold cell, of the rows complete."""
    ran = comparison["ours"].notna()
    delta = comparison.loc[ran, "delta"].abs()
    setting = list(comparison.columns[: comparison.columns.get_loc("attack")])  # ... defense: one table row
    rows = comparison.groupby([comparison[c].fillna(-1) for c in setting], sort=False)["worst_case_match"]
    rows = rows.first().dropna()
    return {
        "variant": comparison["variant"].iloc[0] if "variant" in comparison and len(comparison) else None,
        "cells": len(comparison),
        "cells_run": int(ran.sum()),
        "mean_abs_delta": float(delta.mean()) if len(delta) else float("nan"),
        "within": int((delta <= WITHIN_POINTS).sum()),
        "worst_case_agree": int(rows.astype(bool).sum()),
        "worst_case_rows": len(rows),
    }


__all__ = [
    "RESULTS_DIR",
    "Claims",
    "compare_with_paper",
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
    "atomic_write",
    "write_json_atomic",
]
