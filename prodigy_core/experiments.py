"""Experiments: a params file (one table or figure of the ProDiGy paper) expanded into run configs, and the
executors that run its grid into the results store (`prodigy_core.results`), resumably, locally or on a Ray
cluster.

Entry points: `load_experiment` (a params file at a scale: "paper", "smoke" or "mini"; the format is
`ParamsSpec`'s), `run_grid` (every run without a record, then the results frame), `select` (some rows and
columns of a grid), `undone` (the runs still without a record).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import os
import re
import sys
import time
import traceback
import warnings
from collections import deque
from collections.abc import Generator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from prodigy_core import paths
from prodigy_core import results as store
from prodigy_core.config import ConfigError, RunConfig, SettingsUpdate, field_names
from prodigy_core.names import FIGURES, did_you_mean
from prodigy_core.registry import is_plugin

PARAMS_DIR = paths.package_folder("params")  # the package's own; a project's params/ comes first
TOP_LEVEL_KEYS = ("experiment", "title", "paper_table", "base", "grid", "seeds", "mini", "report")
MINI_KEYS = ("rounds",)
REPORT_KEYS = ("rows", "columns", "blocks", "figures")
EXECUTORS = ("local", "ray")
# A grid of more runs than this announces its size and its expansion time (timed on the first
# LARGE_GRID_SAMPLE runs) before it is expanded: 10,000 runs take seconds, a million minutes.
LARGE_GRID, LARGE_GRID_SAMPLE = 1000, 16
SCALES = paths.SCALES


def scale_folder(name: str, scale: str) -> str:
    """An experiment's folder under the results directory at `scale`: smoke and mini runs never mix with
    paper-scale ones (`<name>-smoke/`, `<name>-mini/`, `<name>/`)."""
    return name if scale == "paper" else f"{name}-{scale}"


# Smoke profile: the one place that says how a grid is shrunk (see smoke_profile).
SMOKE_ROUNDS = 3
SMOKE_LOCAL_STEPS = 2
SMOKE_MAX_CLIENTS = 10
SMOKE_MAX_RUNS = 12
SMOKE_DEFENSES = ("none", "nnm+trimmed_mean", "prodigy")
SMOKE_ATTACKS = ("alie", "sf")


@dataclass
class Experiment:
    """One params file, expanded: the run configs in grid order and how to report them."""

    name: str
    title: str
    paper_table: str | None
    configs: list[RunConfig]
    report: dict[str, Any] = field(default_factory=dict)
    smoke: bool = False
    stand_in: str | None = None  # "digits (offline stand-in for cifar10)", ...; None for the real datasets
    source: Path | None = None
    stand_ins: dict[str, str] = field(default_factory=dict, repr=False)  # run key -> stand-in label
    mini: bool = False
    mini_spec: dict[str, Any] = field(default_factory=dict, repr=False)  # the params file's `mini` section

    @property
    def scale(self) -> str:
        """The scale: "smoke", "mini" or "paper" (SCALES)."""
        return "smoke" if self.smoke else "mini" if self.mini else "paper"

    @property
    def results_name(self) -> str:
        """Folder under the results directory (`scale_folder`)."""
        return scale_folder(self.name, self.scale)

    def stand_in_for(self, config: RunConfig) -> str | None:
        """The stand-in label of one run (None when it runs on the dataset the params file names)."""
        return self.stand_ins.get(config.key())

    def with_variant(self, variant: str) -> Experiment:
        """The same grid with every run under `variant` (``paper`` or ``authors``: other result keys)."""
        configs = [c.replace(variant=variant) for c in self.configs]
        pairs = zip(self.configs, configs, strict=True)
        stand_ins = {
            new.key(): self.stand_ins[old.key()] for old, new in pairs if old.key() in self.stand_ins
        }
        return dataclasses.replace(self, configs=configs, stand_ins=stand_ins)


def check_experiment(experiment: Any, caller: str) -> None:
    """A TypeError naming the fix when ``experiment`` is not an `Experiment` (a params name, a RunConfig)."""
    if not isinstance(experiment, Experiment):
        call = f"load_experiment({experiment!r})" if isinstance(experiment, str) else "load_experiment(...)"
        raise TypeError(f"{caller} takes an Experiment, e.g. {call}; got {type(experiment).__name__}")


def select(experiment: Experiment, only: dict[str, list[Any]]) -> Experiment:
    """The runs of `experiment` whose field `name` takes one of `only[name]`'s values, for every name (e.g.
    {"defense": ["prodigy"], "attack": ["none", "alie"]}: some rows and columns of a table). One value alone
    ("prodigy") is a list of one. A value that no run of the grid takes, or no value at all (an empty list),
    is an error listing the values it does take."""
    check_experiment(experiment, "select")
    configs = experiment.configs
    for name, values in only.items():
        if name not in field_names():
            raise ConfigError(f"--only {name}: not a run field{did_you_mean(name, field_names())}")
        values = list(values) if isinstance(values, list | tuple | set) else [values]
        taken = list(dict.fromkeys(getattr(c, name) for c in experiment.configs))
        if not values:
            raise ConfigError(
                f"--only {name}: no value given (an empty list); give one or more of: "
                + ", ".join(str(v) for v in taken)
            )
        values = [_as_stored(experiment.configs, name, v) for v in values]
        for value in values:
            if value not in taken:
                raise ConfigError(
                    f"--only {name}={value}: no run of {experiment.name} has it; its values: "
                    + ", ".join(str(v) for v in taken)
                )
        configs = [c for c in configs if getattr(c, name) in values]
    return dataclasses.replace(experiment, configs=configs)


def _as_stored(configs: Sequence[RunConfig], name: str, value: Any) -> Any:
    """`value` as a RunConfig stores field `name` (`--set`'s normalisation: defense and attack in lower
    case, 1 as 1.0 in a float field, ...): set into one of the grid's runs that accepts it."""
    for config in configs[:64]:
        with contextlib.suppress(ConfigError, TypeError):
            return getattr(config.replace(**{name: value}), name)
    return value


# ------------------------------------------------------------------------------------------- loading


def resolve_params(path_or_name: str | os.PathLike) -> Path:
    """A params file by path, or by name (`table1_cifar10` or `table1_cifar10.yaml`) in the project's
    params/, then in the package's (`paths.params_dirs`)."""
    path = Path(path_or_name)
    if path.is_file():
        return path
    folders = paths.params_dirs()
    for folder in folders:
        for candidate in (folder / path.name, folder / f"{path.name}.yaml"):
            if candidate.is_file():
                return candidate
    available = sorted({p.stem for folder in folders for p in folder.glob("*.yaml")})
    raise FileNotFoundError(
        f"params file {str(path_or_name)!r} not found (as a path or in {', '.join(map(str, folders))}); "
        f"available: {', '.join(available)}"
    )


def check_scale(scale: str | None, smoke: bool = False) -> str:
    """The scale asked for by `scale` or by the `smoke` flag; an unknown or contradictory one is an error."""
    if scale is None:
        return "smoke" if smoke else "paper"
    if scale not in SCALES:
        raise ValueError(f"scale={scale!r} is unknown; valid: {', '.join(SCALES)}")
    if smoke and scale != "smoke":
        raise ValueError(f"smoke=True and scale={scale!r}: give one of them")
    return scale


# The top-level keys that hold a list or a mapping, what they hold and an example: an override given as text
# (papermill's -p) is refused naming them, not reported later as the params file's mistake.
STRUCTURED_KEYS = {
    "seeds": ("a list of seeds", "[0, 1, 2]"),
    "base": ("a mapping of run fields", "{rounds: 50}"),
    "grid": ("a mapping of axes", "{attack: [alie, sf]}"),
    "mini": ("a mapping", "{rounds: 100}"),
    "report": ("a mapping", "{rows: defense, columns: attack}"),
}


def load_experiment(
    path_or_name: str | os.PathLike,
    smoke: bool = False,
    overrides: dict[str, Any] | None = None,
    fields: dict[str, Any] | None = None,
    scale: str | None = None,
) -> Experiment:
    """Load, validate and expand a params file at a scale ("paper" by default, "smoke" also by smoke=True,
    "mini").

    Three scales (`scale=`, SCALES): "paper" (the file as written); "smoke" (the same grid shrunk to seconds
    for CI, see `smoke_profile`); "mini" (every run of the paper's grid with its N, f, E, beta, split,
    defenses and attacks, but the params file's `mini` rounds and one seed, see `mini_profile`). Smoke and
    mini runs are stored apart from paper-scale ones (`results/<experiment>-smoke/`, `-mini/`) and say so in
    every title.

    overrides: top-level YAML keys to change (the notebooks' papermill parameters): a mapping (base, grid,
    mini, report) merges into the file's key by key (``{"base": {"rounds": 50}}`` keeps the rest of the
    file's base), any other value replaces it; a value of None is ignored. fields: RunConfig fields to pin in
    every run (`--set key=value`): they go into `base` and the grid axis of the same name, if any, is
    dropped.
    """
    scale = check_scale(scale, smoke)
    path = resolve_params(path_or_name)
    try:
        spec = safe_load_strict(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text ({e}); save it as UTF-8") from None
    except yaml.YAMLError as e:
        mark, problem = getattr(e, "problem_mark", None), getattr(e, "problem", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        what = " ".join(str(problem or e).split())  # one line
        raise ConfigError(f"{path}: not valid YAML{at}: {what}") from None
    if not isinstance(spec, dict):
        raise ConfigError(
            f"{path}: expected a mapping of {', '.join(TOP_LEVEL_KEYS)}, got {type(spec).__name__}"
        )
    for key, value in (overrides or {}).items():
        if value is None:
            continue
        if isinstance(value, str) and key in STRUCTURED_KEYS:  # papermill's -p passes text
            raise ConfigError(
                f"{key}={value!r} (a notebook parameter or override) is text where {path.name}'s {key} is "
                f'{STRUCTURED_KEYS[key][0]}: give it as YAML, with papermill -y "{key}: '
                f'{STRUCTURED_KEYS[key][1]}" instead of -p'
            )
        mappings = isinstance(value, Mapping) and isinstance(spec.get(key), Mapping)
        spec[key] = {**spec[key], **value} if mappings else value
    return experiment_from_spec(spec, source=path, fields=fields, scale=scale)


MAX_TITLE = 500  # characters
MAX_YAML_NODES = 100_000  # a params file is a few hundred; aliases may not expand past this


class _StrictLoader(yaml.SafeLoader):
    """yaml.SafeLoader that rejects a key given twice in one mapping (YAML keeps the last one silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set[Any] = set()
        for key_node, _ in node.value:  # the keys written here; `<<: *defaults` may be overridden
            if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                continue
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, str | int | float | bool) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (give each key once)", key_node.start_mark
                )
            with contextlib.suppress(TypeError):
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


def safe_load_strict(text: str) -> Any:
    """yaml.safe_load without duplicate keys and without aliases that expand past MAX_YAML_NODES nodes (an
    alias bomb: a few lines that expand to billions of values)."""
    loader = _StrictLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        sizes: dict[int, int] = {}

        def size(n: yaml.Node) -> int:  # nodes once every alias is expanded; each distinct node counted once
            if id(n) not in sizes:
                sizes[id(n)] = 0  # a recursive alias counts as one
                children = n.value if isinstance(n, yaml.SequenceNode) else []
                if isinstance(n, yaml.MappingNode):
                    children = [c for pair in n.value for c in pair]
                sizes[id(n)] = min(1 + sum(size(c) for c in children), MAX_YAML_NODES + 1)
            return sizes[id(n)]

        if size(node) > MAX_YAML_NODES:
            raise yaml.YAMLError(f"aliases expand to more than {MAX_YAML_NODES:,} values (an alias bomb?)")
        return loader.construct_document(node)
    finally:
        loader.dispose()


def experiment_from_spec(
    spec: dict[str, Any],
    source: Path | str = "params",
    smoke: bool = False,
    fields: dict[str, Any] | None = None,
    scale: str | None = None,
) -> Experiment:
    """Validate a params mapping (as read from YAML) and expand its grid; see `load_experiment`."""
    scale = check_scale(scale, smoke)
    return expand_params(ParamsSpec.parse(spec, source, fields), scale)


@dataclass(frozen=True)
class ParamsSpec:
    """A params mapping, validated (`parse`) and not yet expanded (`expand_params`): every key checked, the
    grid's fields known, `--set` fields pinned. Its runs are not built yet: a value that RunConfig rejects
    is found by the expansion, which names the params key that set it.

    A params file (params/*.yaml) has these top-level keys:

        experiment: table1_cifar10      # results/<experiment>/, outputs/<experiment>.*
        title: "Table I: ..."
        paper_table: bigtable           # value of `table` in paper_results.csv, or null
        base: {dataset: cifar10, ...}   # RunConfig fields shared by every run
        grid: {defense: [...], ...}     # Cartesian product of the listed values; or a LIST of such
                                        # mappings, whose products are joined (one field tied to another)
        seeds: [0, 1, 2]                # sets RunConfig.seed; every grid point runs once per seed
        mini: {rounds: 30}              # the mini scale's rounds (an int, or {paper rounds: mini rounds})
        report: {rows: defense, columns: attack, blocks: [...], figures: [...]}

    Unknown keys (with a "did you mean"), wrong types and impossible runs are ConfigErrors that name the
    file, the key and the value.
    """

    where: str  # the source as error messages name it
    source: Path | None  # the params file, when read from one
    name: str
    title: str
    paper_table: str | None
    base: dict[str, Any]  # RunConfig fields of every run (`--set` fields included, no seed)
    grids: tuple[tuple[str, dict[str, list]], ...]  # (label, {field: values}) per grid mapping
    seeds: tuple[int, ...]
    report: dict[str, Any]
    mini: dict[str, Any]  # the `mini` section, its rounds checked

    @classmethod
    def parse(
        cls, spec: dict[str, Any], source: Path | str = "params", fields: dict[str, Any] | None = None
    ) -> ParamsSpec:
        """Check a params mapping: a ConfigError naming the source, the key and the value at the first
        problem. `fields`: RunConfig fields pinned in every run (`--set`), see `load_experiment`."""
        where, fields = str(source), fields or {}
        for key in spec:
            if key not in TOP_LEVEL_KEYS:
                raise ConfigError(f"{where}: unknown key {key!r}{did_you_mean(key, TOP_LEVEL_KEYS)}")
        name, title, paper_table = _header(spec, source, where)
        base = _mapping(spec.get("base") or {}, f"{where}: base")
        base.update({k: v.merged_into(base.get(k)) if isinstance(v, SettingsUpdate) else v
                     for k, v in fields.items()})  # fmt: skip
        grids = _grid_mappings(spec.get("grid"), where)
        seeds = _seeds(spec.get("seeds"), base, fields, where)
        report = _mapping(spec.get("report") or {}, f"{where}: report", names=REPORT_KEYS, check_fields=False)
        mini = _mapping(spec.get("mini") or {}, f"{where}: mini", names=MINI_KEYS, check_fields=False)
        if "rounds" in mini:
            mini["rounds"] = _mini_rounds(mini["rounds"], f"{where}: mini.rounds")
        _check_report_types(report, where)
        _check_report_fields(report, where)
        names = field_names()
        for key in base:
            if key not in names:
                raise ConfigError(f"{where}: base.{key} is not a run field{did_you_mean(key, names)}")
        labelled = [("grid" if len(grids) == 1 else f"grid[{i}]", grid) for i, grid in enumerate(grids)]
        axes = tuple((label, _axes(grid, label, fields, where)) for label, grid in labelled)
        return cls(where, source if isinstance(source, Path) else None, name, title, paper_table, base, axes,
                   tuple(seeds), report, mini)  # fmt: skip


def _header(spec: dict[str, Any], source: Path | str, where: str) -> tuple[str, str, str | None]:
    """The params file's experiment name (its file name by default), title and paper table, checked."""
    name = spec.get("experiment") or (Path(source).stem if isinstance(source, Path) else None)
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name) or ".." in name:
        raise ConfigError(
            f"{where}: experiment={name!r} must be a folder name: letters, digits, '_', '-' or '.', starting "
            "with a letter or digit, no '..' (e.g. table1_cifar10)"
        )
    title = spec.get("title") or name
    if not isinstance(title, str) or len(title) > MAX_TITLE:
        shown = repr(title) if isinstance(title, str | int | float) else type(title).__name__
        raise ConfigError(f"{where}: title={shown[:60]} must be a string of at most {MAX_TITLE} characters")
    paper_table = spec.get("paper_table")
    if paper_table is not None and not isinstance(paper_table, str):
        raise ConfigError(f"{where}: paper_table={paper_table!r} must be a table name or null")
    return name, title, paper_table


def _grid_mappings(grids: Any, where: str) -> list[dict]:
    """The `grid` key as a list of mappings ([{}] without one: `base` runs alone)."""
    if grids is not None and not grids:
        raise ConfigError(
            f"{where}: grid={grids!r} is empty: give field: [values] (e.g. grid: {{defense: [prodigy]}}), or "
            "leave `grid` out to run `base` alone"
        )
    if isinstance(grids, list) and any(isinstance(g, dict) and not g for g in grids):
        raise ConfigError(f"{where}: grid={grids!r} has an empty mapping; give each one field: [values]")
    grids = [{}] if grids is None else [grids] if isinstance(grids, dict) else grids
    if not isinstance(grids, list):
        raise ConfigError(f"{where}: grid must be a mapping of field: [values] or a list of such mappings")
    return [_mapping(g, f"{where}: grid[{i}]") for i, g in enumerate(grids)]


def _seeds(seeds: Any, base: dict[str, Any], fields: dict[str, Any], where: str) -> list[int]:
    """The seeds every grid point runs with; a seed in `base` (from `--set seed=...`, or a file without
    `seeds`) is taken out of it and replaces them."""
    if "seed" in fields or (seeds is None and "seed" in base):
        seeds = [base.pop("seed")]  # --set seed=... replaces the file's seeds
    elif "seed" in base:
        raise ConfigError(
            f"{where}: base.seed={base['seed']!r} and seeds={seeds!r}: list the seeds in `seeds`"
        )
    seeds = [RunConfig.seed] if seeds is None else seeds
    if not isinstance(seeds, list) or not seeds or not all(type(s) is int for s in seeds):
        raise ConfigError(f"{where}: seeds={seeds!r} must be a non-empty list of integers, e.g. [0, 1, 2]")
    return seeds


def _axes(grid: dict, label: str, fields: dict[str, Any], where: str) -> dict[str, list]:
    """One grid mapping's axes {field: values}, checked; a field pinned by `--set` is no axis."""
    names = field_names()
    axes = {}
    for key, values in grid.items():
        if key not in names:
            raise ConfigError(f"{where}: {label}.{key} is not a run field{did_you_mean(key, names)}")
        if key == "seed":
            raise ConfigError(f"{where}: {label}.seed: list the seeds in the top-level `seeds` key")
        if isinstance(fields.get(key), SettingsUpdate) and isinstance(values, list):
            values = [fields[key].merged_into(v) for v in values]  # --set defense_params.tau=5: into each
        elif key in fields:
            continue  # pinned by --set
        if not isinstance(values, list) or not values:
            raise ConfigError(
                f"{where}: {label}.{key}={values!r} must be a non-empty list of values (e.g. [{values}])"
            )
        axes[key] = values
    return axes


def expand_params(params: ParamsSpec, scale: str = "paper") -> Experiment:
    """A validated params mapping's Experiment at `scale` (SCALES): every grid mapping's Cartesian product
    once per seed, in grid order, a run that two mappings give kept once (by key); then `smoke_profile` or
    `mini_profile`. A grid of more than LARGE_GRID runs announces its size and expansion time first."""
    where, seeds = params.where, params.seeds
    size = len(seeds) * sum(math.prod(len(v) for v in axes.values()) for _, axes in params.grids)
    configs: dict[str, RunConfig] = {}
    started, built = time.perf_counter(), 0
    for label, axes in params.grids:
        for point in itertools.product(*axes.values()):
            chosen = dict(zip(axes, point, strict=True))
            for seed in seeds:
                config = _build(params.base, chosen, seed, where, label)
                configs.setdefault(config.key(), config)  # the union of products may repeat a run
                built += 1
                if size > LARGE_GRID and built == LARGE_GRID_SAMPLE:  # announced at once, timed on a sample
                    rate = (time.perf_counter() - started) / built
                    print(f"{where}: the grid expands to {size:,} runs, about {rate * size:.0f} s to expand "
                          f"(~{rate * 1e3:.2f} ms a run); checking them...", file=sys.stderr)  # fmt: skip
    experiment = Experiment(
        name=params.name, title=params.title, paper_table=params.paper_table, configs=list(configs.values()),
        report=dict(params.report), source=params.source, mini_spec=dict(params.mini),
    )  # fmt: skip
    return {"smoke": smoke_profile, "mini": mini_profile}.get(scale, lambda e: e)(experiment)


def _check_report_types(report: dict[str, Any], where: str) -> None:
    """The report layout's types: rows and columns one field name, blocks one or a list of them, figures a
    list of `names.FIGURES` (a string is not split into letters)."""
    for key in ("rows", "columns"):
        if key in report and not isinstance(report[key], str):
            raise ConfigError(
                f"{where}: report.{key}={report[key]!r} must be one run field name (e.g. defense)"
            )
    blocks = report.get("blocks")
    if blocks is not None and not isinstance(blocks, str) and not _strings(blocks):
        raise ConfigError(f"{where}: report.blocks={blocks!r} must be a run field name or a list of them")
    figures = report.get("figures")
    if figures is not None:
        if not _strings(figures):
            raise ConfigError(
                f"{where}: report.figures={figures!r} must be a list of figure names, e.g. [heatmap, curves]"
                f"; valid: {', '.join(FIGURES)}"
            )
        for name in figures:
            if name not in FIGURES:
                raise ConfigError(f"{where}: report.figures: unknown {name!r}{did_you_mean(name, FIGURES)}")


def _check_report_fields(report: dict[str, Any], where: str) -> None:
    """The report layout's rows, columns and blocks name run fields."""
    for key in ("rows", "columns", "blocks"):
        for value in [report[key]] if isinstance(report.get(key), str) else report.get(key) or []:
            if value not in field_names():
                raise ConfigError(
                    f"{where}: report.{key}={value!r} is not a run field{did_you_mean(value, field_names())}"
                )


def _strings(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _mini_rounds(rounds: Any, where: str) -> Any:
    """mini.rounds checked: a positive integer or {paper rounds: mini rounds}. Keys written as decimal text
    are rounds too: papermill's injected cell and JSON turn the YAML's 2000 into "2000"."""
    if rounds is None:
        return None
    ok = type(rounds) is int and rounds > 0
    if isinstance(rounds, dict):
        rounds = {int(k) if isinstance(k, str) and k.isascii() and k.isdigit() else k: v
                  for k, v in rounds.items()}  # fmt: skip
        ok = bool(rounds) and all(type(k) is int and type(v) is int and v > 0 for k, v in rounds.items())
    if not ok:
        raise ConfigError(
            f"{where}={rounds!r} must be a positive integer (e.g. 30) or a mapping of the paper's rounds "
            "to mini rounds (e.g. {2000: 60, 1000: 30})"
        )
    return rounds


def _mapping(value: Any, where: str, names: Iterable[str] | None = None, check_fields: bool = True) -> dict:
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be a mapping (key: value), got {value!r}")
    for key in value:
        if names is not None and key not in names:
            raise ConfigError(f"{where}: unknown key {key!r}{did_you_mean(key, names)}")
    return dict(value)


def _build(base: dict, chosen: dict, seed: int, where: str, label: str) -> RunConfig:
    """One RunConfig; on a ConfigError say which params key set the offending field and to what."""
    values = {**base, **chosen, "seed": seed}
    try:
        return RunConfig.from_dict(values)
    except ConfigError as e:
        message = str(e).removeprefix("config: ")
        culprit = re.match(r"(\w+)=", message)
        name = culprit.group(1) if culprit else None
        if name in chosen:
            origin = f"{label}.{name}={chosen[name]!r}"
        elif name in base:
            origin = f"base.{name}={base[name]!r}"
        elif name == "seed":
            origin = f"seeds: {seed!r}"
        else:
            origin = f"{name} (default)" if name else "run"
        point = ", ".join(f"{k}={v!r}" for k, v in chosen.items())
        raise ConfigError(
            f"{where}: {origin}: {message}" + (f" [grid point: {point}]" if point else "")
        ) from None


# ------------------------------------------------------------------------------------------- smoke


def smoke_profile(experiment: Experiment) -> Experiment:
    """The experiment shrunk to seconds (CI, a first look), clearly labelled as such.

    The rule, applied to the expanded runs:
      1. seeds: the first seed only.
      2. block axes (every field that varies across the runs, except defense and attack): the value of the
         first run only (for a list-of-mappings grid, the first mapping's first point).
      3. defense x attack: kept whole when it has at most SMOKE_MAX_RUNS runs; otherwise the defenses in
         SMOKE_DEFENSES and the attacks in SMOKE_ATTACKS that the grid has (the grid's first three defenses /
         first two attacks when it has none of them), and every plug-in (`my_rules.py:MyRule`: the rule or
         attack being tried out is what a first look is for).
      4. per run: rounds <= SMOKE_ROUNDS, local_steps <= SMOKE_LOCAL_STEPS, eval_every <= rounds,
         record_distances_at clipped to the last round; cifar10 runs on real CIFAR-10 when this machine has
         it (`data.resolve_data_source`) and on the embedded digits otherwise; femnist keeps at most
         SMOKE_MAX_CLIENTS writers of the LEAF folder found (`data.default_femnist_dir`), digits without one;
         on digits, n_clients <= SMOKE_MAX_CLIENTS; f scaled to keep f/N (at least 2 if the grid has ProDiGy).
         The replacement is named in `stand_in`: in every record, the results frame and the report.
    """
    if experiment.smoke:
        return experiment
    configs = experiment.configs
    first = configs[0]
    varying = {n for n in field_names() if len({getattr(c, n) for c in configs}) > 1}
    blocks = varying - {"defense", "attack", "seed"}
    kept = [
        c for c in configs if c.seed == first.seed and all(getattr(c, n) == getattr(first, n) for n in blocks)
    ]
    defenses = list(dict.fromkeys(c.defense for c in kept))
    attacks = list(dict.fromkeys(c.attack for c in kept))
    if len(kept) > SMOKE_MAX_RUNS:
        chosen = [d for d in defenses if d in SMOKE_DEFENSES] or defenses[:3]
        defenses = [d for d in defenses if d in chosen or is_plugin(d)]
        chosen = [a for a in attacks if a in SMOKE_ATTACKS] or attacks[:2]
        attacks = [a for a in attacks if a in chosen or is_plugin(a)]
        kept = [c for c in kept if c.defense in defenses and c.attack in attacks]

    # One f per original (N, f) for the whole table, so that a row is not split by a per-defense f.
    min_byzantine = 2 if any("prodigy" in c.defense for c in kept) else 1
    stand_ins: dict[str, str] = {}
    smoke_configs: dict[str, RunConfig] = {}
    for config in kept:
        small, label = _smoke_config(config, min_byzantine)
        key = small.key()
        smoke_configs.setdefault(key, small)
        if label:
            stand_ins[key] = label
    labels = sorted(set(stand_ins.values()))
    return dataclasses.replace(
        experiment,
        title=f"{experiment.title} [SMOKE: {SMOKE_ROUNDS} rounds"
        + (f"; {'; '.join(labels)}]" if labels else "]"),
        configs=list(smoke_configs.values()),
        smoke=True,
        stand_in="; ".join(labels) or None,
        stand_ins=stand_ins,
    )


def _smoke_config(config: RunConfig, min_byzantine: int) -> tuple[RunConfig, str | None]:
    rounds = min(config.rounds, SMOKE_ROUNDS)
    changes: dict[str, Any] = {
        "rounds": rounds,
        "local_steps": min(config.local_steps, SMOKE_LOCAL_STEPS),
        "eval_every": min(config.eval_every, rounds),
        "lr_decay_at": None if config.lr_decay_at is None else min(config.lr_decay_at, rounds),
        "record_distances_at": sorted({min(r, rounds) for r in config.record_distances_at}),
    }
    label = None
    if config.dataset == "femnist":
        from prodigy_core.data import default_femnist_dir, eligible_writers, leaf_writer_counts

        n = min(config.n_clients, SMOKE_MAX_CLIENTS)
        k = config.femnist_min_writer_samples
        subset = Path(config.data_dir) if config.data_dir else default_femnist_dir(n, k)
        try:
            enough = subset is not None and len(eligible_writers(leaf_writer_counts(subset), k)) >= n
        except ValueError:  # a malformed folder found by default: the stand-in; one named: its error
            if config.data_dir:
                raise
            enough = False
        if enough:
            f = _scaled_byzantine(config, n, min_byzantine)
            changes.update(n_clients=n, n_byzantine=f, data_dir=str(subset), data_source=None)
            if n < config.n_clients:
                label = f"FEMNIST, {n} writers of {subset.name} (stand-in for N={config.n_clients})"
        else:
            label = "digits (offline stand-in for femnist)"
            if config.data_dir:
                label = f"digits (stand-in for femnist: {subset.name} has fewer than {n} eligible writers)"
            changes.update(dataset="digits", distribution="dirichlet", data_dir=None, data_source=None)
    if config.dataset == "cifar10" and config.resolved().data_source is None:
        label = "digits (offline stand-in for cifar10)"
        changes.update(dataset="digits", data_dir=None, download=False, data_source=None)
    if changes.get("dataset") == "digits":
        n = min(config.n_clients, SMOKE_MAX_CLIENTS)
        changes.update(n_clients=n, n_byzantine=_scaled_byzantine(config, n, min_byzantine))
    return config.replace(**changes), label


def _scaled_byzantine(config: RunConfig, n: int, min_byzantine: int) -> int:
    """f for n clients keeping the fraction f/N, at least min_byzantine (2 when ProDiGy runs), below n/2."""
    if config.n_byzantine == 0:
        return 0
    return min(max(round(config.n_byzantine * n / config.n_clients), min_byzantine), (n - 1) // 2)


# ------------------------------------------------------------------------------------------- mini


def mini_profile(experiment: Experiment) -> Experiment:
    """The paper's grid at fewer rounds and one seed: a comparison with the paper that one GPU can afford.

    Every run of the paper's grid keeps its dataset, split, N, f, E, beta, defense and attack; only these
    change: seeds -> the first seed; rounds -> the params file's `mini.rounds` (one number, or one per paper
    rounds value: {2000: 60, 1000: 30}); an explicit lr_decay_at and record_distances_at scale with the rounds
    (an unset lr_decay_at is already 2/3 of them); eval_every <= rounds. No stand-in data: the runs need the
    real datasets.
    """
    if experiment.mini:
        return experiment
    if experiment.smoke:
        raise ValueError(f"{experiment.name}: a smoke experiment has no mini scale; reload its params file")
    where = str(experiment.source or experiment.name)
    rounds = experiment.mini_spec.get("rounds")
    if rounds is None:
        raise ConfigError(
            f"{where}: no mini scale: add a `mini` section with the rounds, e.g. `mini: {{rounds: 30}}`"
        )
    paper_rounds = list(dict.fromkeys(c.rounds for c in experiment.configs))
    table = rounds if isinstance(rounds, dict) else dict.fromkeys(paper_rounds, rounds)
    missing = [r for r in paper_rounds if r not in table]
    if missing:
        raise ConfigError(f"{where}: mini.rounds={rounds!r} gives no mini rounds for the paper's {missing}")
    too_many = {r: table[r] for r in paper_rounds if table[r] > r}
    if too_many:
        raise ConfigError(f"{where}: mini.rounds={rounds!r}: more rounds than the paper's ({too_many})")
    seed = experiment.configs[0].seed
    configs: dict[str, RunConfig] = {}
    for config in experiment.configs:
        if config.seed == seed:
            small = _mini_config(config, table[config.rounds])
            configs.setdefault(small.key(), small)
    label = " / ".join(f"{table[r]} of {r}" for r in paper_rounds)
    return dataclasses.replace(
        experiment,
        title=f"{experiment.title} [MINI: {label} rounds, seed {seed}]",
        configs=list(configs.values()),
        mini=True,
    )


def _mini_config(config: RunConfig, rounds: int) -> RunConfig:
    def scaled(r: int) -> int:
        return min(max(round(r * rounds / config.rounds), 1), rounds)

    return config.replace(
        rounds=rounds,
        eval_every=min(config.eval_every, rounds),
        lr_decay_at=None if config.lr_decay_at is None else scaled(config.lr_decay_at),
        record_distances_at=sorted({scaled(r) for r in config.record_distances_at}),
    )


# ------------------------------------------------------------------------------------------- running


@dataclass(frozen=True)
class Task:
    """One run to execute: what a worker needs, picklable (process pools, Ray)."""

    config: dict[str, Any]
    checkpoint_dir: str
    stand_in: str | None
    folder: str | None = None  # where the record goes: written by whoever finishes the run
    experiment: str = ""
    resume: bool = True  # False (--force): ignore an existing checkpoint
    key: str = ""  # the run's key when planned ("": computed from config); its record is stored under it

    def run_key(self) -> str:
        """The key the record goes under: the planned one, computed before training (a plug-in edited while
        the run trains never moves its record; `results.check_record` then finds it stale)."""
        return self.key or RunConfig.from_dict(self.config).key()


def execute(task: Task, threads: int | None = None) -> dict[str, Any]:
    """Run one task in this process, store its record in `task.folder` (when given) and return it
    (RunResult.to_dict() with stand_in set). The worker writes the record itself, so a run finished while
    its driver died is not lost."""
    import torch

    from prodigy_core import training

    if threads:
        torch.set_num_threads(threads)
    config = RunConfig.from_dict(task.config)
    key = task.run_key()
    # the checkpoint goes once the record is stored (`store.save_record`, here or in the driver)
    result = training.run(config, progress=False, checkpoint_dir=task.checkpoint_dir, resume=task.resume,
                          keep_checkpoint=True)  # fmt: skip
    result.stand_in = task.stand_in
    record = result.to_dict()
    if task.folder is not None:
        store.save_record(Path(task.folder), key, record, task.experiment)
    return record


Outcome = dict[str, Any] | BaseException
PROGRESS_ENV = "PRODIGY_PROGRESS"  # "text": run_grid draws a text bar even in a notebook kernel (reproduce)


def execute_group(tasks: list[Task], threads: int | None = None) -> list[tuple[str, Outcome]]:
    """Run compatible tasks as one batched group (`prodigy_core.groups`) in this process: [(key, record or
    error)] in the order they finished; a crash of the group itself fails every unfinished run."""
    if threads:
        import torch

        torch.set_num_threads(threads)
    return list(_group_outcomes(tasks))


def _group_outcomes(tasks: list[Task]) -> Iterator[tuple[str, Outcome]]:
    from prodigy_core import groups

    configs = [RunConfig.from_dict(t.config) for t in tasks]
    keys = [t.run_key() for t in tasks]
    pending = set(keys)
    for task, key in zip(tasks, keys, strict=True):
        if not task.resume:  # --force: the group starts from round 0, its checkpoints are replaced
            with contextlib.suppress(FileNotFoundError):
                (Path(task.checkpoint_dir) / f"{key}.pt").unlink()
    try:
        for i, outcome in groups.iter_group(
            configs, checkpoint_dir=tasks[0].checkpoint_dir, keep_checkpoints=True
        ):
            pending.discard(keys[i])
            if isinstance(outcome, BaseException):
                yield keys[i], _with_traceback(outcome)
            else:
                outcome.stand_in = tasks[i].stand_in
                record = outcome.to_dict()
                if tasks[i].folder is not None:  # written by whoever finished the run
                    store.save_record(Path(tasks[i].folder), keys[i], record, tasks[i].experiment)
                yield keys[i], record
    except Exception as e:
        for key in keys:
            if key in pending:
                yield key, _with_traceback(e)


def run_grid(
    experiment: Experiment,
    executor: str = "local",
    jobs: int | str = 1,
    force: bool = False,
    results_dir: str | os.PathLike | None = None,
    progress: bool = True,
    address: str | None = None,
    num_cpus: float = 1,
    num_gpus: float = 0,
    batch_runs: int | str = "auto",
) -> pd.DataFrame:
    """Run every run of the experiment that has no record yet (all of them with force) and return the
    results frame (`results.load`). A run's record is written as it finishes, by the worker that ran it
    (and by this process if that one could not); a record that fails `results.check_record` is moved aside
    and its run redone. A run claimed by another live process is left to it and listed as undone in the
    summary (`undone`). A run that raises is recorded as failed (`<key>.failed.json`) and the grid goes on.
    A run interrupted earlier resumes from its checkpoint (one exists only for an unfinished run: training
    deletes it when the run completes); with force, checkpoints are ignored and replaced.

    executor="local": in this process for jobs=1, a pool of `jobs` processes otherwise; jobs="auto": one
    single-threaded process per CPU core when the runs train on the CPU (`auto_jobs`), 1 on a GPU.
    executor="ray": each run a Ray task with `num_cpus`/`num_gpus` (fractions allowed: 0.25 GPU runs four per
    GPU), retried once on failure; `address` joins an existing cluster (e.g. "auto" or "ray://host:10001"),
    otherwise a local Ray runtime with `jobs` CPUs is started (jobs is ignored with an address).
    batch_runs: up to this many compatible runs train as one batched group (`prodigy_core.groups`; each
    run's record is the one it gets alone), in this process, in a pool worker or in one Ray task; "auto"
    (default) stacks where it is faster (`groups.batch_size_for`), 1 trains one run at a time.

    On a Ray cluster (docs/usage.md "On a cluster (Ray)") every node needs the same Python environment
    (`pip install "prodigy-fl[ray]"`), and the results folder and the datasets on a shared filesystem: a
    run's checkpoints are written by the node that trains it, which also writes its record. Stop and rerun
    at will: finished runs are skipped.

    The steps: `plan_grid` (which runs, as which tasks and work items), `execute_grid` (training them,
    recording each outcome), `grid_summary` (the closing lines, printed with progress).
    """
    from prodigy_core.progress import line_stream

    plan = plan_grid(experiment, executor, jobs, force, results_dir, batch_runs)
    finished, failed = execute_grid(plan, executor, progress, address, num_cpus, num_gpus)
    if progress:
        print("\n".join(grid_summary(plan, finished, failed)), file=line_stream())
    return store.load(experiment, results_dir)


@dataclass
class GridPlan:
    """What `run_grid` is to do (`plan_grid`): the runs without a record as tasks, in work items."""

    experiment: Experiment
    folder: Path  # its results folder
    todo: list[RunConfig]  # the runs to train: without a valid record (all of them with force)
    tasks: dict[str, Task]  # by run key
    batches: list[list[str]]  # the work items' run keys: a run alone or a group (`groups.make_groups`)
    jobs: int
    threads: int | None  # torch threads per run, in a pool worker or in this process (None: as they are in
    # this process, a pool worker's the machine's cores shared among the jobs)
    force: bool
    varying: list[str]  # the fields that differ between the grid's runs: a run's name in the progress lines

    def describe(self, config: RunConfig) -> str:
        """A run's name in the progress lines: its varying fields (its key when none varies)."""
        return " ".join(f"{n}={getattr(config, n)}" for n in self.varying) or config.key()


def check_code_is_keyed(configs: Iterable[RunConfig]) -> None:
    """A ValueError for a rule or an attack registered by name from outside the package: a stored run keys
    its name, not its code, so an edited class would find the old records; a plug-in spec keys its code."""
    from prodigy_core.aggregators import RULES, split_defense
    from prodigy_core.attacks import ATTACKS

    for c in configs:
        for registry, name in ((RULES, split_defense(c.defense)[1]), (ATTACKS, c.attack)):
            cls = registry.unkeyed_class(name)
            if cls is None:
                continue
            kind, module, cls_name = registry.kind, cls.__module__, cls.__name__
            raise ValueError(
                f"{kind} {name!r} is registered by name from {module}: a stored run's key would hold its "
                f"name, not its code (an edited {cls_name} would find the old records); save it in a file "
                f"and name it as a plug-in ({kind}: my_code.py:{cls_name}), whose code the key holds, or "
                "train it without a store (training.run)"
            )


def plan_grid(
    experiment: Experiment, executor: str, jobs: int | str, force: bool, results_dir: Any, batch_runs: Any
) -> GridPlan:
    """Which runs of the experiment to train (`run_grid`'s arguments, their defaults there, checked; the
    femnist writers counted, the results folder writable when there is a run to do), as tasks grouped into
    work items, and with how many worker processes. Trains nothing and claims nothing."""
    from prodigy_core import groups

    check_experiment(experiment, "run_grid")
    if executor not in EXECUTORS:
        raise ValueError(f"executor={executor!r} is unknown; valid: {', '.join(EXECUTORS)}")
    if jobs != "auto" and (isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1):
        raise ValueError(f"jobs={jobs!r} must be 'auto' or an integer >= 1")
    check_code_is_keyed(experiment.configs)
    folder = store.experiment_dir(experiment.results_name, results_dir)
    todo = [c for c in experiment.configs if force or store.stored_record(folder, c.key()) is None]
    check_writers(todo)
    if todo:
        store.check_writable(folder)
    # Each task gets the data source its key was computed with: a worker never loads another one.
    tasks = {
        c.key(): Task(
            c.replace(data_source=c.resolved().data_source).to_dict(),
            str(store.checkpoint_dir(folder)),
            experiment.stand_in_for(c),
            str(folder),
            experiment.results_name,
            resume=not force,
            key=c.key(),
        )
        for c in todo
    }
    batches = [[c.key() for c in g] for g in groups.make_groups(todo, batch_runs)]
    threads = None  # a pool worker's: this machine's cores shared among the workers
    if jobs == "auto":
        jobs, threads = auto_jobs(todo, len(batches))
    varying = [n for n in field_names() if len({getattr(c, n) for c in experiment.configs}) > 1]
    return GridPlan(experiment, folder, todo, tasks, batches, int(jobs), threads, force, varying)


def execute_grid(
    plan: GridPlan,
    executor: str = "local",
    progress: bool = True,
    address: str | None = None,
    num_cpus: float = 1,
    num_gpus: float = 0,
) -> tuple[int, int]:
    """Train the plan's work items that this process can claim, on `executor` (see `run_grid`), each run's
    outcome recorded as it comes (`_record_outcome`) under a progress bar; returns (finished, failed)."""
    from prodigy_core.progress import bar_class, line_stream

    # a widget bar in JupyterLab with ipywidgets; text in a terminal, without ipywidgets, and under papermill
    # (PROGRESS_ENV: a widget bar would go unseen); the per-run lines on stdout in a notebook, else stderr
    tqdm = bar_class(text=os.environ.get(PROGRESS_ENV) == "text")
    lines = line_stream()
    tasks, batches, jobs = plan.tasks, plan.batches, plan.jobs
    claims = store.Claims(plan.folder, skip_done=not plan.force)
    claims.clear_finished(c.key() for c in plan.experiment.configs if c.key() not in tasks)
    finished = failed = 0
    total = len(plan.experiment.configs)
    bar = tqdm(total=total, initial=total - len(plan.todo), unit="run", desc=plan.experiment.results_name,
               disable=not progress, file=lines, dynamic_ncols=True)  # fmt: skip
    try:
        if executor == "ray":
            outcomes = _ray_outcomes(tasks, batches, claims, jobs, address, num_cpus, num_gpus)
        elif jobs == 1:
            outcomes = _inline_outcomes(tasks, batches, claims, plan.threads)
        else:
            outcomes = _pool_outcomes(tasks, batches, claims, jobs, plan.threads)
        for key, outcome, seconds in outcomes:
            done, line = _record_outcome(plan, key, outcome, seconds)
            if done:
                finished += 1
            else:
                failed += 1
            claims.release(key)
            bar.update(1)
            if progress:
                bar.write(line, file=lines)
    finally:
        claims.release_all()
        bar.close()
    return finished, failed


def _record_outcome(plan: GridPlan, key: str, outcome: Outcome, seconds: float) -> tuple[bool, str]:
    """Store one run's outcome: a failure record for an error, the record when its worker could not write
    it; returns (whether it finished, its progress line)."""
    folder, name, task = plan.folder, plan.experiment.results_name, plan.tasks[key]
    what = plan.describe(RunConfig.from_dict(task.config))
    if isinstance(outcome, BaseException):
        store.save_failure(folder, key, task.config, outcome, name)
        return False, f"FAILED {what}: {type(outcome).__name__}: {outcome}"
    if store.stored_record(folder, key) is None:  # a worker that could not write it
        store.save_record(folder, key, outcome, name)
    flag = " [stand-in]" if outcome.get("stand_in") else ""
    return True, f"done   {what}: {outcome['final_accuracy']:.2f}% in {seconds:.1f}s{flag}"


def grid_summary(plan: GridPlan, finished: int, failed: int) -> list[str]:
    """The lines `run_grid` ends with: each run of the plan left undone (claimed by another process, with
    its lock's state), then the counts (`finished` and `failed` here; the runs another process stored
    meanwhile) and where the records are."""
    folder, experiment = plan.folder, plan.experiment
    skipped = len(experiment.configs) - len(plan.todo)
    stored = [store.stored_record(folder, c.key()) is not None for c in plan.todo]
    busy = [c for c, done in zip(plan.todo, stored, strict=True)
            if not done and not store.failure_path(folder, c.key()).exists()]  # fmt: skip
    elsewhere = sum(stored) - finished  # trained by another process working on the same grid
    lines = [f"undone {plan.describe(c)}: {store.lock_state(folder / f'{c.key()}.lock')}" for c in busy]
    lines.append(
        f"{experiment.results_name}: {plural(finished, 'run')} trained"
        + (f", {elsewhere} by another process" if elsewhere > 0 else "")
        + f", {skipped} already stored, {failed} failed"
        + (f", {len(busy)} left undone (claimed, see above)" if busy else "")
        + f"; records in {folder}"
    )
    return lines


def plural(n: int, noun: str) -> str:
    """ "1 run", "6 runs"."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def auto_jobs(configs: Sequence[RunConfig], work_items: int) -> tuple[int, int | None]:
    """jobs="auto": (worker processes, threads each). Runs on the CPU: one process per core, one thread each,
    at most one per work item (a run or a group). A CPU step of these small CNNs does not use two threads
    well (benchmarks/grid.py, docs/usage.md "Many runs as one batched computation"). A run's result can
    differ in its last bits with the thread count, so every auto run on a CPU uses one thread: the same
    numbers whatever the machine's core count. Runs on a GPU: one process (its groups fill the card),
    threads as they are."""
    from prodigy_core.seeding import resolve_device

    def on_gpu(device: str) -> bool:
        try:
            return resolve_device(device).type != "cpu"
        except ValueError:  # e.g. cuda asked for on a machine without: the run reports it
            return False

    if any(on_gpu(d) for d in {c.device for c in configs}):
        return 1, None
    return max(1, min(os.cpu_count() or 1, work_items)), 1


def check_writers(configs: Iterable[RunConfig]) -> None:
    """Fail before the first run when a femnist run's LEAF folder is there but has too few eligible writers
    (e.g. Table III's N=100 on a 24-writer folder): the DataError gives the count and the LEAF command. A
    missing folder is left to the runs, which record it as their failure."""
    from prodigy_core.data import default_femnist_dir, eligible_writers, leaf_writer_counts, too_few_writers

    seen = set()
    for c in configs:
        need = (c.data_dir, c.n_clients, c.femnist_min_writer_samples)
        if c.dataset != "femnist" or need in seen:
            continue
        seen.add(need)
        k = c.femnist_min_writer_samples
        leaf = Path(c.data_dir) if c.data_dir else default_femnist_dir(c.n_clients, k)
        if leaf is None or not (leaf / "train").is_dir() or not (leaf / "test").is_dir():
            continue
        counts = leaf_writer_counts(leaf)
        if len(eligible_writers(counts, k)) < c.n_clients:
            raise too_few_writers(leaf, counts, c.n_clients, k)


def undone(experiment: Experiment, results_dir: str | os.PathLike | None = None) -> list[RunConfig]:
    """The runs of the experiment without a valid record (failed, or left to another process)."""
    folder = store.experiment_dir(experiment.results_name, results_dir)
    return [c for c in experiment.configs if store.stored_record(folder, c.key()) is None]


def _inline_outcomes(
    tasks: dict[str, Task], batches: list[list[str]], claims: store.Claims, threads: int | None = None
) -> Iterator[tuple[str, Outcome, float]]:
    """Every work item in this process; with `threads` (jobs="auto": 1) torch uses that many threads while
    they train, as a pool worker would, and as many as before afterwards."""
    with torch_threads(threads):
        yield from _inline_batches(tasks, batches, claims)


@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """torch.set_num_threads(threads) for the duration (nothing when None), the previous count restored."""
    if not threads:
        yield
        return
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _inline_batches(
    tasks: dict[str, Task], batches: list[list[str]], claims: store.Claims
) -> Iterator[tuple[str, Outcome, float]]:
    for batch in batches:
        claimed = [tasks[key] for key in batch if claims.claim(key)]
        start = time.perf_counter()
        if len(claimed) > 1:  # records stream out as the group's runs finish
            for key, outcome in _group_outcomes(claimed):
                yield key, outcome, time.perf_counter() - start
            continue
        for task in claimed:
            key = task.run_key()
            try:
                outcome: Outcome = execute(task)
            except Exception as e:  # recorded as a failed run; the grid goes on
                outcome = _with_traceback(e)
            yield key, outcome, time.perf_counter() - start


def _work(tasks: list[Task], threads: int | None = None) -> list[tuple[str, Outcome]]:
    """One pool or Ray work item: a single run, or a group of runs."""
    if len(tasks) > 1:
        return execute_group(tasks, threads)
    return [(tasks[0].run_key(), execute(tasks[0], threads))]


def _ray_work(folder: str, tasks: list[Task]) -> list[tuple[str, Outcome]]:
    """A Ray work item, run from the driver's folder `folder` where this node has it: a worker of a
    `ray start` cluster starts in the folder `ray start` ran from, where a plug-in named by a relative path
    (`my_defense.py:Closest`, part of the run's key as written) is not; a node without that folder (no
    shared disk) keeps its own, and such a plug-in then needs a path that exists on every node."""
    if os.path.isdir(folder):
        os.chdir(folder)
    return _work(tasks)


def _pool_outcomes(
    tasks: dict[str, Task], batches: list[list[str]], claims: store.Claims, jobs: int, threads: int | None
) -> Iterator[tuple[str, Outcome, float]]:
    """A pool of `jobs` processes, each taking a run or a group; at most `jobs` claimed at a time (the rest
    stay free for others). threads: each worker's torch threads (None: the cores shared among the jobs).

    A worker that dies (killed, or out of memory) breaks the whole pool, and every run in flight with it:
    those are given to a fresh pool once more, each alone (they resume from their checkpoints), and a run
    whose worker dies again is recorded as failed with that reason; the grid goes on."""
    from concurrent.futures import FIRST_COMPLETED, wait
    from concurrent.futures.process import BrokenProcessPool

    threads = threads or max(1, (os.cpu_count() or 1) // jobs)
    pending: deque[list[str]] = deque(batches)
    again: deque[list[str]] = deque()  # claimed work items whose pool broke under them
    retried: set[str] = set()
    while pending or again:
        broken: list[tuple[list[str], float]] = []
        with worker_pool(jobs) as pool:
            running: dict[Any, tuple[list[str], float]] = {}

            def fill(pool: Any = pool, running: dict = running, broken: list = broken) -> None:
                while len(running) < jobs and (again or pending):
                    retry = bool(again)
                    if retry and running:  # a retry runs alone: a worker that dies again is its own
                        return
                    claimed = again.popleft() if retry else [k for k in pending.popleft() if claims.claim(k)]
                    if claimed:
                        try:
                            work = pool.submit(_work, [tasks[k] for k in claimed], threads)
                        except BrokenProcessPool:
                            broken.append((claimed, time.perf_counter()))
                            return
                        running[work] = (claimed, time.perf_counter())
                        if retry:
                            return

            try:
                fill()
                while running and not broken:
                    done, _ = wait(running, return_when=FIRST_COMPLETED)
                    for future in done:
                        keys, start = running.pop(future)
                        error = future.exception()
                        if isinstance(error, BrokenProcessPool):
                            broken.append((keys, start))
                            continue
                        pairs = [(k, error) for k in keys] if error is not None else future.result()
                        for key, outcome in pairs:
                            yield key, outcome, time.perf_counter() - start
                    if not broken:
                        fill()
            finally:
                for future in running:
                    future.cancel()
            broken += running.values()  # the pool's other work items die with it
        for keys, start in broken:
            keys = yield from _stored_before_dying(tasks, keys, claims, start)
            if not keys:
                continue
            if retried.isdisjoint(keys):
                retried.update(keys)
                again.append(keys)
                continue
            died = RuntimeError("its worker process died twice (killed, or out of memory?)")
            for key in keys:
                yield key, died, time.perf_counter() - start


def _stored_before_dying(
    tasks: dict[str, Task], keys: list[str], claims: store.Claims, start: float
) -> Generator[tuple[str, Outcome, float], None, list[str]]:
    """Yields, as done, the runs of a dead worker that stored their records before it died (a group writes
    them, then its worker is killed), so that they are not trained again; returns the others' keys. Not
    under --force, where a record predates the run."""
    left = []
    for key in keys:
        record = store.stored_record(Path(tasks[key].folder), key) if claims.skip_done else None
        if record is None:
            left.append(key)
        else:
            yield key, record, time.perf_counter() - start
    return left


PARENT_POLL_S = 1.0  # how often a pool worker checks that its parent is alive


def worker_pool(jobs: int) -> Any:
    """A process pool whose workers exit when this process dies (`_exit_with_parent`), leaving their runs'
    locks stale and their checkpoints to resume from. spawn, not fork: forking a process that has started
    torch's thread pools can deadlock."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    return ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_exit_with_parent, initargs=(os.getpid(),))  # fmt: skip


def _exit_with_parent(parent: int) -> None:
    """Pool-worker initializer: exit as soon as the parent process dies (kill -9 included), instead of
    training on for a driver that is gone. Linux: the kernel's parent-death signal; everywhere: a daemon
    thread that polls os.getppid() (a dead parent's children are re-parented)."""
    import threading

    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # died before the signal was armed
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _ray_outcomes(
    tasks: dict[str, Task],
    batches: list[list[str]],
    claims: store.Claims,
    jobs: int,
    address: str | None,
    num_cpus: float,
    num_gpus: float,
) -> Iterator[tuple[str, Outcome, float]]:
    """Every claimed run or group as a Ray task (`_ray_work`); yields them as they complete (the worker
    writes each record, `_record_outcome` the failures and those a worker could not write)."""
    try:
        import ray
    except ImportError:
        raise ImportError('executor="ray" needs Ray: pip install "prodigy-fl[ray]"') from None
    started_here = not ray.is_initialized()
    address = address or os.environ.get("RAY_ADDRESS") or None  # `ray job submit` sets it: join that cluster
    if started_here:
        try:
            if address:
                ray.init(address=address, log_to_driver=False)
            else:
                ray.init(num_cpus=jobs, include_dashboard=False, log_to_driver=False)
        except Exception as e:  # Ray's own errors name no fix: one line that does
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            where = f"at {address}" if address else "on this machine"
            hint = (" (a Ray cluster runs here: join it with --address auto)"
                    if not address and "existing cluster" in first else "")  # fmt: skip
            fix = "run without Ray: --executor local (the default)"
            raise ValueError(f"Ray could not start {where} ({first}){hint}; {fix}") from None
    nodes = [node.get("Resources", {}) for node in ray.nodes() if node.get("Alive")]
    short = _ray_shortfall(nodes, num_cpus, num_gpus)
    if short and started_here and not address:  # a local cluster never grows: the tasks would wait forever
        ray.shutdown()
        raise ValueError(f"Ray on this machine: {short}; ask for less (--num-cpus/--num-gpus) or join a "
                         "cluster that has it (--address)")  # fmt: skip
    if short:  # a cluster's autoscaler may add such a node: say so, then wait as Ray does
        warnings.warn(f"the Ray cluster has {short}: the runs wait for one", RuntimeWarning, stacklevel=2)
    # The one retry is ours, not Ray's (max_retries): a run stored before its worker died is not redone.
    remote = ray.remote(max_retries=0)(_ray_work)
    here = os.getcwd()  # a worker runs from the driver's folder, where a plug-in's relative path points
    refs: dict[Any, tuple[list[str], float]] = {}
    retried: set[str] = set()

    def submit(keys: list[str], start: float | None = None) -> None:
        ref = remote.options(num_cpus=num_cpus, num_gpus=num_gpus).remote(here, [tasks[k] for k in keys])
        refs[ref] = (keys, time.perf_counter() if start is None else start)

    try:
        for batch in batches:
            claimed = [key for key in batch if claims.claim(key)]
            if claimed:
                submit(claimed)
        while refs:
            done, _ = ray.wait(list(refs), num_returns=1)
            keys, start = refs.pop(done[0])
            try:
                pairs: list[tuple[str, Outcome]] = ray.get(done[0])
            except Exception as e:
                keys = yield from _stored_before_dying(tasks, keys, claims, start)
                if keys and retried.isdisjoint(keys):  # once more (it resumes from its checkpoints)
                    retried.update(keys)
                    submit(keys, start)  # its time counts both tries
                    continue
                # failed twice: record it, keep going
                cause = getattr(e, "cause", None) or e
                # Ray's text holds the worker's traceback (its colour codes taken out)
                cause.traceback_text = re.sub(r"\x1b\[[0-9;]*m", "", str(e))  # type: ignore[attr-defined]
                pairs = [(key, cause) for key in keys]
            for key, outcome in pairs:
                yield key, outcome, time.perf_counter() - start
    finally:
        for ref in refs:
            ray.cancel(ref, force=True)
        if started_here:
            ray.shutdown()


def _ray_shortfall(nodes: list[dict[str, float]], num_cpus: float, num_gpus: float) -> str | None:
    """Why no node among `nodes` (their Ray resources) can run a task of num_cpus CPUs and num_gpus GPUs (a
    task runs on one node); None when one can."""
    if any(r.get("CPU", 0) >= num_cpus and r.get("GPU", 0) >= num_gpus for r in nodes):
        return None
    have = ", ".join(f"{r.get('CPU', 0):g} CPU / {r.get('GPU', 0):g} GPU" for r in nodes) or "none"
    return f"no node with {num_cpus:g} CPU(s) and {num_gpus:g} GPU(s) for a run (its nodes: {have})"


def _with_traceback(error: BaseException) -> BaseException:
    error.traceback_text = "".join(traceback.format_exception(error))  # type: ignore[attr-defined]
    return error


__all__ = [
    "PARAMS_DIR",
    "SCALES",
    "scale_folder",
    "Experiment",
    "Task",
    "check_writers",
    "execute",
    "execute_group",
    "experiment_from_spec",
    "GridPlan",
    "plan_grid",
    "execute_grid",
    "grid_summary",
    "expand_params",
    "ParamsSpec",
    "select",
    "load_experiment",
    "mini_profile",
    "resolve_params",
    "run_grid",
    "smoke_profile",
    "undone",
]
