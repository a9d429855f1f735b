"""Run configuration: the one place where every field of a training run, its default and its checks live.

Field names follow the columns of the paper's results table (`paper_results.csv`). Fields left at ``None``
are resolved from the dataset and the number of rounds by :meth:`RunConfig.resolved`. The names a field is
checked against (datasets, splits, variants) live in `prodigy_core.names`, shared with the library's rules.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from prodigy_core.names import (
    DATASETS,
    DISTRIBUTIONS,
    ENGINES,
    NO_ATTACK,
    PRECISIONS,
    SOURCE_DIGEST_CHARS,
    TYPE_WORDS,
    VARIANTS,
    did_you_mean,
)

# The fields that make a run's federation, its clients' data (with `variant`, which draws an iid or Dirichlet
# split with numpy under ``authors``): runs equal in them share one loaded federation.
SPLIT_FIELDS = ("dataset", "distribution", "dirichlet_alpha", "n_clients", "data_seed",
                "femnist_min_writer_samples", "data_dir", "data_source")  # fmt: skip
# RunConfig.data_source per dataset (prodigy_core.data names and finds them); femnist's hashes its files.
# cifar10-jpeg-<digest>: a JPEG decode whose pixels are not the reference's; cifar10-jpeg-first-<train>-
# <test>-<digest>: one decoded in part (`data.decode_cifar10_jpeg`'s per_class). <digest>: SOURCE_DIGEST_CHARS
# hex digits.
DATA_SOURCES = {"digits": ("digits",),
                "cifar10": ("cifar10-binary", "cifar10-jpeg", "cifar10-jpeg-<digest>",
                            "cifar10-jpeg-first-<train>-<test>-<digest>"),
                "femnist": ("femnist-leaf-<digest>",)}  # fmt: skip
# Part of every ``authors`` result key: bumped whenever the authors variant's numbers change, so that a record
# made before is never read as current. 2: fidelity round 2 (test batches of 64 in an interleaved order,
# stop at a NaN test loss, numpy's split, the authors' ALIE z grid). 3: the authors' batch stream (epoch
# shuffles, drop_last, one iterator kept across rounds; `local_training.AuthorsBatchStream`). 4: FOE's choice
# from max_dist = 0 at eps (malicious.py:120-127) and the authors' test loss recorded beside ours.
AUTHORS_REVISION = 4
# Part of every result key: the random streams' revision (docs/semantics.md, "Random streams"). 1: every
# client's batches, augmentation and dropout masks from its own streams (`prodigy_core.streams`), the same
# on every device and in every engine; keys without it are the streams before, drawn on the run's device in
# an engine's order.
STREAMS_REVISION = 1
# Part of the key of the runs whose numbers it moved (`idle_moves_numbers`). 1: under an attack that never
# reads the Byzantine clients' honest updates, they take no local step and report the server's BatchNorm
# buffers (`training.RunState.idle`); before, they trained and reported their own.
IDLE_REVISION = 1
# Client SGD weight decay per dataset (paper: 1e-2 for CIFAR-10, none for FEMNIST).
DEFAULT_WEIGHT_DECAY = {"cifar10": 1e-2, "femnist": 0.0, "digits": 0.0}
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.manual_seed accepts
NUMPY_SEED_RANGE = (0, 2**32 - 1)  # what numpy's RandomState accepts (the ``authors`` split)
# The devices a run may name: torch's others (meta, mps, xla, ...) cannot train these models here.
DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:\d+)?")
# The fields that name a class (a rule, an attack) and, beside each, the field of that class's own settings.
NAMED_FIELDS = ("defense", "attack")
SETTINGS_FIELDS = tuple(f"{name}_params" for name in NAMED_FIELDS)


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the field, the value and the fix. A quoted value
    longer than `QUOTED_LIMIT` characters is shortened (`shorten_quoted`): the line stays readable."""

    def __init__(self, message: object = "") -> None:
        super().__init__(shorten_quoted(str(message)))


QUOTED_LIMIT = 200  # paths stay whole; a 10,000-character name does not


def shorten_quoted(text: str) -> str:
    """Every quoted string in `text` longer than QUOTED_LIMIT characters cut to its start, its length said:
    'xxxx...' (10000 characters)."""

    def cut(m: re.Match[str]) -> str:
        q, body = m[1], m[2]
        return f"{q}{body[:40]}...{q} ({len(body)} characters)"

    # a quote opens a value only after a non-word character (='x', ('x', a space), and closes one only before
    # another: else the text between two values ("'prodigy'?); valid: ..., defense='") is taken for one
    return re.sub(rf"(?<!\w)(['\"])([^'\"]{{{QUOTED_LIMIT + 1},}})\1(?!\w)", cut, text)


class SettingsUpdate(dict):
    """Settings given one by one (``--set defense_params.tau=5``): merged into the params file's own settings
    of that field (`experiments.ParamsSpec.parse`), where a whole mapping (``--set defense_params={tau:
    5}``) replaces them."""

    def merged_into(self, settings: Any) -> dict[str, Any]:
        return {**settings, **self} if isinstance(settings, dict) else dict(self)


@dataclass(frozen=True)
class RunConfig:
    """One run: every setting of the paper's experiments (dataset, split, N, f, E, beta, rounds, rule, attack,
    seed) and of how it is computed (engine, device, precision), each field's default given here once.
    `None` fields are filled by `resolved()` (the decay round, the weight decay, the data seed and source);
    `key()` names the record of the computation: the fields that change its numbers (docs/semantics.md)."""

    dataset: str = "digits"
    distribution: str = "dirichlet"
    dirichlet_alpha: float = 0.1
    n_clients: int = 10
    n_byzantine: int = 3
    local_momentum: float = 0.0
    local_steps: int = 1  # 1 = FedSGD, >1 = FedAVG
    rounds: int = 100
    defense: str = "prodigy"  # a name of aggregators.RULES (nnm+ in front), or a plug-in file.py:Class
    attack: str = "none"  # a name of attacks.ATTACKS, or a plug-in file.py:Class
    # the rule's and the attack's settings (their __init__ keywords: CClip's tau, FOE's eps); stored without
    # the defaults, so that a run written either way has one key
    defense_params: dict[str, Any] = dataclasses.field(default_factory=dict, hash=False)
    attack_params: dict[str, Any] = dataclasses.field(default_factory=dict, hash=False)
    lr: float = 0.05
    lr_decay_at: int | None = None  # first decayed round t (0-indexed); None: see decay_round
    lr_decay_factor: float = 0.1
    weight_decay: float | None = None  # None: DEFAULT_WEIGHT_DECAY[dataset]
    batch_size: int = 64
    eval_every: int = 10
    seed: int = 0
    data_seed: int | None = None  # seed of the data split; None: the same as seed (each seed its own split)
    # writers with fewer samples over train + test (LEAF's -k, the paper's 350) are not eligible as clients
    femnist_min_writer_samples: int = 0
    # where the samples come from (DATA_SOURCES); None: the first one found on this machine, fixed by
    # resolved() before the key is computed, so records from different sources never share a key
    data_source: str | None = None
    record_distances_at: tuple[int, ...] = ()  # rounds at which the (N, N) distance matrix is stored
    variant: str = "paper"  # one of VARIANTS
    checkpoint_every: int = 50
    device: str = "auto"
    engine: str = "auto"
    precision: str = "fp32"  # one of PRECISIONS; in the key only when not fp32
    data_dir: str | None = None
    download: bool = False

    # Fields that never change a run's numbers (device and engine: to rounding, `STREAMS_REVISION`): left out
    # of the result key.
    NON_RESULT_FIELDS: typing.ClassVar[frozenset[str]] = frozenset(
        {"checkpoint_every", "device", "engine", "data_dir", "download"}
    )

    def __post_init__(self) -> None:
        from prodigy_core.registry import plain_value

        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            # a NumPy scalar is the plain value it holds (its key and label are the plain value's); a path
            # object is its text; a list of rounds is a tuple
            plain = plain_value(value)
            if f.name == "data_dir" and isinstance(plain, os.PathLike):
                plain = os.fspath(plain)
            if f.name == "record_distances_at" and isinstance(plain, list):
                plain = tuple(plain)
            if plain is not value:
                object.__setattr__(self, f.name, plain)
                value = plain
            hint = _field_types()[f.name]
            _check_type(f.name, value, hint)
            if f.name == "record_distances_at":  # [2, 1] and [1, 1, 2] are the run of [1, 2]: one key
                object.__setattr__(self, f.name, _distance_rounds(value))
            if float in typing.get_args(hint) + (hint,) and isinstance(value, int):
                object.__setattr__(self, f.name, float(value))  # 1 and 1.0 must give the same result key
        self._canonical_names()
        self.validate()

    def _canonical_names(self) -> None:
        """Defense and attack with their settings in the one form a key stores (`Prodigy` and `prodigy`, or
        ``foe`` with eps=0.1 and ``foe_0.1``, are one run): `aggregators.canonical_defense`."""
        from prodigy_core.aggregators import canonical_defense
        from prodigy_core.attacks import canonical_attack

        for name, canonical in zip(NAMED_FIELDS, (canonical_defense, canonical_attack), strict=True):
            value, params = getattr(self, name), getattr(self, f"{name}_params")
            try:
                value, params = canonical(value, params)
            except ValueError as e:
                field = f"{name}_params" if params and "setting" in str(e) else name
                raise ConfigError(f"{field}={getattr(self, field)!r}: {e}") from None
            object.__setattr__(self, name, value)
            object.__setattr__(self, f"{name}_params", params)

    @classmethod
    def from_dict(cls, values: dict[str, Any], source: str = "config") -> RunConfig:
        """Build a config from a mapping; unknown keys are errors with a "did you mean" hint."""
        names = field_names()
        for key in values:
            if key not in names:
                raise ConfigError(f"{source}: unknown field {key!r}{did_you_mean(key, names)}")
        try:
            return cls(**values)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None

    def replace(self, **changes: Any) -> RunConfig:
        """This config with some fields changed; a new defense or attack drops the old one's settings
        unless they are given too."""
        from prodigy_core.aggregators import normalise_defense
        from prodigy_core.attacks import normalise_attack

        values = {**self.to_dict(), **changes}
        for name, normalise in zip(NAMED_FIELDS, (normalise_defense, normalise_attack), strict=True):
            new = changes.get(name)
            same = isinstance(new, str) and normalise(new) == getattr(self, name)  # "CClip" is "cclip"
            if name in changes and f"{name}_params" not in changes and not same:
                values[f"{name}_params"] = {}
        return RunConfig.from_dict(values)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["record_distances_at"] = list(self.record_distances_at)
        return d

    def resolved(self) -> RunConfig:
        """Fill the fields whose default depends on others (lr decay round, weight decay, data seed) or on
        this machine (data_source: `prodigy_core.data.resolve_data_source`; None when no data is found)."""
        from prodigy_core.data import resolve_data_source

        source = self.data_source or resolve_data_source(
            self.dataset, self.data_dir, self.n_clients, self.femnist_min_writer_samples
        )
        if source is None and self.dataset == "cifar10" and self.download:
            source = "cifar10-binary"  # what the run will download
        return dataclasses.replace(
            self,
            data_source=source,
            lr_decay_at=decay_round(self.rounds, self.variant)
            if self.lr_decay_at is None
            else self.lr_decay_at,
            data_seed=self.seed if self.data_seed is None else self.data_seed,
            weight_decay=DEFAULT_WEIGHT_DECAY[self.dataset]
            if self.weight_decay is None
            else self.weight_decay,
        )

    def key(self, code: Mapping[str, str] | None = None) -> str:
        """Hash of every resolved field that affects the result, and of nothing else (`key_fields`): settings
        only when given (keys made before settings existed hashed the same fields), a plug-in's code hash
        (`registry.plugin_hash`; ``code``: {spec: hash} to use instead, a record's ``plugins``, so that a
        record's key is checked without reading any plug-in file; a KeyError names a spec it lacks).
        Reads the disk: a plug-in's code is hashed (never imported), and when `data_source` is None
        `resolved` looks the source up on this machine (which CIFAR-10 copy, or a hash of the FEMNIST
        writers), so such a config's key can change with this machine's data; a config with `data_source` set
        (every task `run_grid` hands a worker, every stored record) hashes its fields alone."""
        blob = json.dumps(self.key_fields(code), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def key_fields(self, code: Mapping[str, str] | None = None) -> dict[str, Any]:
        """What `key` hashes: the resolved fields that affect the result (``precision`` only when not fp32),
        the plug-ins' code hashes (``code``, as in `key`) and the revisions (`STREAMS_REVISION`, and
        `AUTHORS_REVISION` under ``authors``)."""
        from prodigy_core.registry import plugin_hash

        d = self.resolved().to_dict()
        for name in self.NON_RESULT_FIELDS:
            d.pop(name)
        for name in SETTINGS_FIELDS:
            if not d[name]:
                d.pop(name)
        for name, spec in self.plugin_specs().items():
            d[f"{name}_code"] = plugin_hash(spec, name) if code is None else code[spec]
        if d["distribution"] != "dirichlet":
            d.pop("dirichlet_alpha")
        if d["dataset"] != "femnist":
            d.pop("femnist_min_writer_samples")
        if d["variant"] == "authors":
            d["authors_revision"] = AUTHORS_REVISION
        if d["precision"] == "fp32":  # the keys made before precision existed are fp32 runs'
            d.pop("precision")
        d["streams_revision"] = STREAMS_REVISION
        if idle_moves_numbers(d):
            d["idle_revision"] = IDLE_REVISION
        return d

    def plugin_specs(self) -> dict[str, str]:
        """{field: spec} of the plug-ins this run names (``{"defense": "my_rules.py:MyRule"}``, the rule
        without its ``nnm+``); {} without."""
        from prodigy_core.aggregators import split_defense
        from prodigy_core.registry import is_plugin

        specs = {"defense": split_defense(self.defense)[1], "attack": self.attack}
        return {name: spec for name, spec in specs.items() if is_plugin(spec)}

    def lr_at(self, t: int) -> float:
        """Server and client step size gamma_t of round t (0-indexed: round r = t + 1 of `RunResult`): lr for
        t < lr_decay_at, then lr * lr_decay_factor."""
        decay_at = self.resolved().lr_decay_at
        return self.lr * (self.lr_decay_factor if t >= decay_at else 1.0)

    def validate(self) -> None:
        if self.dataset not in DATASETS:
            raise ConfigError(f"dataset={self.dataset!r} is unknown; valid: {', '.join(DATASETS)}")
        valid = DISTRIBUTIONS[self.dataset]
        if self.distribution not in valid:
            raise ConfigError(
                f"distribution={self.distribution!r} is not available for dataset={self.dataset!r}; "
                f"valid: {', '.join(valid)}"
            )
        if self.variant not in VARIANTS:
            raise ConfigError(f"variant={self.variant!r} is unknown; valid: {', '.join(VARIANTS)}")
        if self.data_source is not None and not _valid_source(self.dataset, self.data_source):
            raise ConfigError(
                f"data_source={self.data_source!r} is not a source of dataset={self.dataset!r}; valid: "
                f"{', '.join(DATA_SOURCES[self.dataset])}, or null (the first one found on this machine)"
            )
        if self.femnist_min_writer_samples < 0:
            raise ConfigError(
                f"femnist_min_writer_samples={self.femnist_min_writer_samples} must be >= 0 (the paper: 350)"
            )
        if self.engine not in ENGINES:
            raise ConfigError(f"engine={self.engine!r} is unknown; valid: {', '.join(ENGINES)}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision={self.precision!r} is unknown; valid: {', '.join(PRECISIONS)}")
        if not DEVICE_PATTERN.fullmatch(self.device):
            raise ConfigError(
                f"device={self.device!r} cannot train these runs; valid: auto, cpu, cuda, cuda:N"
            )
        positive = {"n_clients": self.n_clients, "rounds": self.rounds, "local_steps": self.local_steps,
                    "batch_size": self.batch_size, "eval_every": self.eval_every,
                    "checkpoint_every": self.checkpoint_every, "lr": self.lr}  # fmt: skip
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                default = "null for the default" if f.default is None else f"default {f.default}"
                raise ConfigError(f"{f.name}={value} must be a finite number ({default})")
        for name in ("seed", "data_seed"):  # torch's seed range (2**64 - 1 seeds as -1 does)
            value = getattr(self, name)
            if value is not None and not SEED_RANGE[0] <= value <= SEED_RANGE[1]:
                raise ConfigError(f"{name}={value} is outside the seeds torch accepts, -2**63..2**64 - 1")
        for name, value in positive.items():
            if value <= 0:
                raise ConfigError(f"{name}={value} must be positive")
        import torch

        dtype = torch.get_default_dtype()  # the models' (float32; float64 in the tests that set it)
        steps = {"lr": self.lr, "weight_decay": self.weight_decay or 0.0,
                 "lr * lr_decay_factor": self.lr * self.lr_decay_factor}  # fmt: skip
        for name, value in steps.items():  # a step size beyond the dtype's range overflows in the local step
            if value > torch.finfo(dtype).max:
                raise ConfigError(
                    f"{name}={value:g} is beyond {str(dtype).removeprefix('torch.')}'s range "
                    f"({torch.finfo(dtype).max:.1e}), in which the model trains (the paper: lr 0.05, "
                    "weight_decay 0.01 on CIFAR-10)"
                )
        data_seed = self.seed if self.data_seed is None else self.data_seed
        if (
            self.variant == "authors"
            and self.distribution != "natural"
            and not NUMPY_SEED_RANGE[0] <= data_seed <= NUMPY_SEED_RANGE[1]
        ):
            name = "seed" if self.data_seed is None else "data_seed"
            raise ConfigError(
                f"{name}={data_seed} under variant='authors': its split seeds numpy's RandomState, which "
                f"takes 0..2**32 - 1; use a seed in that range (or set data_seed)"
            )
        if not self.dirichlet_alpha > 0:
            raise ConfigError(f"dirichlet_alpha={self.dirichlet_alpha} must be > 0 (0.1 is the paper's)")
        if not self.lr_decay_factor > 0:
            raise ConfigError(
                f"lr_decay_factor={self.lr_decay_factor} must be > 0 (the lr is multiplied by it; 0.1 is the "
                "paper's, 1 keeps the lr constant)"
            )
        if self.lr_decay_at is not None and self.lr_decay_at < 0:
            rule = "2 * rounds // 3" + (" + 1" if self.variant == "paper" else "")  # decay_round's
            raise ConfigError(
                f"lr_decay_at={self.lr_decay_at} must be a round >= 0, or null for the default {rule} "
                f"(round {decay_round(self.rounds, self.variant)} here; rounds counted from 0)"
            )
        outside = [r for r in self.record_distances_at if not 1 <= r <= self.rounds]
        if outside:
            raise ConfigError(
                f"record_distances_at={list(self.record_distances_at)}: {outside} not in "
                f"1..rounds={self.rounds} (rounds are numbered from 1)"
            )
        if not 0 <= self.local_momentum < 1:
            raise ConfigError(f"local_momentum={self.local_momentum} must be in [0, 1) (paper: 0 or 0.9)")
        if self.n_clients < 2:
            raise ConfigError(f"n_clients={self.n_clients}: federated learning needs at least 2 clients")
        if self.n_byzantine < 0 or 2 * self.n_byzantine >= self.n_clients:
            raise ConfigError(
                f"n_byzantine={self.n_byzantine} with n_clients={self.n_clients}: need 0 <= f < N/2 "
                f"(at most {(self.n_clients - 1) // 2} for N={self.n_clients})"
            )
        if self.weight_decay is not None and self.weight_decay < 0:
            raise ConfigError(f"weight_decay={self.weight_decay} must be >= 0")
        # The rule and the attack check their own constraints (one source of truth for each limit); a
        # plug-in only when plug-ins may be imported (not while records are read: `records_are_data`).
        from prodigy_core.aggregators import make_aggregator
        from prodigy_core.attacks import make_attack
        from prodigy_core.registry import imports_plugins

        data_only = set() if imports_plugins() else set(self.plugin_specs())
        n, f = self.n_clients, self.n_byzantine
        try:
            if "defense" not in data_only:
                make_aggregator(self.defense, f, n, self.variant, self.defense_params)
        except ValueError as e:
            raise ConfigError(f"defense={self.defense!r}: {e}") from None
        try:
            if "attack" not in data_only:
                make_attack(self.attack, variant=self.variant, params=self.attack_params)
        except ValueError as e:
            raise ConfigError(f"attack={self.attack!r}: {e}") from None
        if self.attack != NO_ATTACK and self.n_byzantine == 0:
            raise ConfigError(
                f"attack={self.attack!r} with n_byzantine=0: set n_byzantine > 0 or attack='none'"
            )


def as_row(values: dict[str, Any]) -> dict[str, Any]:
    """A config's fields as a results frame holds them: defense and attack with their settings as one label
    ("cclip(tau=5.0)" for {"tau": 5.0}, `registry.label`), so that a table keeps runs with other settings
    apart."""
    from prodigy_core.registry import label

    row = dict(values)
    for name in NAMED_FIELDS:
        params = row.pop(f"{name}_params", None) or {}
        if name in row:
            row[name] = label(row[name], params)
    return row


def decay_round(rounds: int, variant: str = "paper") -> int:
    """The first round t (0-indexed, t = 0..T-1) whose step size is decayed, for T = ``rounds``.

    ``paper``: the text's gamma_t = lr for t <= 2T/3, so the first decayed round is floor(2T/3) + 1 (667 for
    T = 1000, 1334 for T = 2000). ``authors``: the authors' code decays at round int(2T/3) (666, 1333)."""
    return 2 * rounds // 3 + (variant == "paper")


def idle_moves_numbers(fields: dict[str, Any]) -> bool:
    """Whether `IDLE_REVISION` belongs in the key of a run with these resolved fields: a ``paper`` run with
    Byzantine clients, a model with BatchNorm (`models.BATCHNORM_DATASETS`; without it, and under ``authors``,
    whose evaluation never reads the server's buffers, idle clients change no number) and an attack that
    never reads their honest updates (`Attack.needs_own`), or a plug-in attack (its class is not imported
    to find out: records are data)."""
    from prodigy_core.attacks import idle_byzantine
    from prodigy_core.models import BATCHNORM_DATASETS
    from prodigy_core.registry import is_plugin

    attack, f = fields["attack"], fields["n_byzantine"]
    if (
        fields["variant"] != "paper"
        or fields["dataset"] not in BATCHNORM_DATASETS
        or not f
        or attack == NO_ATTACK
    ):
        return False
    return is_plugin(attack) or idle_byzantine(attack, f, "paper", fields.get("attack_params")) > 0


_DIGEST = f"[0-9a-f]{{{SOURCE_DIGEST_CHARS}}}"


def _valid_source(dataset: str, source: str) -> bool:
    if dataset == "femnist":
        return re.fullmatch(f"femnist-leaf-{_DIGEST}", source) is not None
    if dataset == "cifar10" and re.fullmatch(rf"cifar10-jpeg-(first-[1-9]\d*-[1-9]\d*-)?{_DIGEST}", source):
        return True
    return source in DATA_SOURCES[dataset]


def _distance_rounds(rounds: tuple[int, ...]) -> tuple[int, ...]:
    """record_distances_at sorted, without repeats (a sorted, repeat-free tuple is kept as it is: its key
    does not change)."""
    return tuple(sorted(set(rounds)))


def field_names() -> list[str]:
    return [f.name for f in dataclasses.fields(RunConfig)]


def field_defaults() -> dict[str, Any]:
    """Every field's default: what a record that lacks a field was keyed with (`RunConfig.from_dict`)."""
    return {
        f.name: f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        for f in dataclasses.fields(RunConfig)
    }


def parse_value(name: str, text: str) -> Any:
    """Parse a command-line ``key=value`` string into the field's type (YAML scalars: 0.1, true, [1, 2]);
    text YAML cannot read (``[1``) is a ConfigError naming the field and the text."""
    if name not in field_names():
        raise ConfigError(f"unknown field {name!r}{did_you_mean(name, field_names())}")
    return _read_value(name, text)


def _read_value(name: str, text: str) -> Any:
    """``text`` read as YAML (`parse_value`), ``name`` (a field, or a setting) in the error message."""
    import yaml

    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or type(e).__name__
        raise ConfigError(
            f"{name}={text!r} cannot be read as a YAML value ({problem}): close its brackets and quotes, "
            'e.g. [1, 2] or "a, b"'
        ) from None
    if value is None and text.strip().lower() not in ("null", "none", "~", ""):
        value = text
    if isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
        value = float(value)  # YAML 1.1 reads 1e-3 (no dot) as text; on a command line it is a number
    return value


def parse_settings(name: str, text: str) -> dict[str, Any]:
    """A rule's or an attack's settings written as one line, ``"tau=5, L=2"`` -> {"tau": 5, "L": 2}, as
    `registry.settings_text` writes them (``rhos=[0.25, 0.5]``: a comma inside brackets or quotes is the
    value's); values read as `parse_value` reads them; "" -> {}. A ConfigError naming ``name`` and the text
    otherwise."""
    if name not in field_names():
        raise ConfigError(f"unknown field {name!r}{did_you_mean(name, field_names())}")
    settings: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in _top_level_split(text))):
        key, sep, value = part.partition("=")
        if not sep or not key.strip().isidentifier():
            raise ConfigError(f"{name}={text!r}: write setting=value pairs, commas between, e.g. tau=5, L=2")
        settings[key.strip()] = _read_value(f"{name}: {key.strip()}", value.strip())
    return settings


def _top_level_split(text: str) -> list[str]:
    """``text`` split at the commas outside brackets and quotes: "a=[1, 2], b='x, y'" -> ["a=[1, 2]",
    " b='x, y'"]. A quote opens a quoted value only where a value starts (after "=", "[", "{", "," or ":",
    as in YAML: the ' of it's is a letter); an unclosed one keeps the rest as one part (its value's YAML error
    says so)."""
    parts, start, depth, quote, escaped, last = [], 0, 0, "", False, "="
    for i, char in enumerate(text):
        if quote:  # inside '...' ('' is a quote in it: two toggles) or "..." (backslash escapes)
            if escaped:
                escaped = False
            elif char == "\\" and quote == '"':
                escaped = True
            elif char == quote:
                quote = ""
        elif char in "'\"" and last in "=[{,:":
            quote = char
        elif char in "[{":
            depth += 1
        elif char in "]}":
            depth = max(0, depth - 1)
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
        if not char.isspace():
            last = char
    return [*parts, text[start:]]


_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


@functools.cache  # every RunConfig needs the evaluated annotations; evaluate them once
def _field_types() -> dict[str, Any]:
    return typing.get_type_hints(RunConfig)


def _check_type(name: str, value: Any, hint: Any) -> None:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        errors = []
        for option in options:
            try:
                _check_type(name, value, option)
                return
            except ConfigError as e:
                errors.append(str(e))
        if len(errors) == 1:
            raise ConfigError(errors[-1])
        what = " or ".join(TYPE_WORDS.get(o, str(o)) for o in options)
        raise ConfigError(f"{name}={value!r} must be {what}{_number_hint(value)}")
    if hint is type(None):
        if value is not None:
            raise ConfigError(f"{name}={value!r} must be null")
        return
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ConfigError(f"{name}={value!r} must be a mapping of setting: value (e.g. {{tau: 5}})")
        return
    if origin is tuple:
        if not isinstance(value, tuple) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value
        ):
            raise ConfigError(f"{name}={value!r} must be a list of integers")
        return
    ok = {
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, int | float) and not isinstance(value, bool),
        bool: isinstance(value, bool),
        str: isinstance(value, str),
    }[hint]
    if not ok:
        hint_text = _number_hint(value)
        if hint is int and isinstance(value, float) and value.is_integer():
            hint_text = f" (write {int(value)})"
        raise ConfigError(
            f"{name}={value!r} must be {TYPE_WORDS[hint]}, not {type(value).__name__}{hint_text}"
        )


def _number_hint(value: Any) -> str:
    """For a string that reads as a number: YAML 1.1 takes 1e2 or 1e-3 (no dot) as text."""
    if isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
        number = float(value)
        plain = int(number) if number.is_integer() else number
        return f" (YAML reads {value} as text: write {plain})"
    return ""


__all__ = [
    "RunConfig",
    "SPLIT_FIELDS",
    "NAMED_FIELDS",
    "SETTINGS_FIELDS",
    "as_row",
    "ConfigError",
    "DATA_SOURCES",
    "PRECISIONS",
    "SettingsUpdate",
    "decay_round",
    "field_names",
    "idle_moves_numbers",
    "parse_settings",
    "parse_value",
]
