"""The attack explorer: train a short run and look at its last round from the server's side (the distance
matrix between the updates, ProDiGy's scores and kept set, the attack's damage per candidate parameter), as
figures, a one-line summary, files, and a JupyterLab widget (`notebooks/explore_attacks.ipynb`).

The figures themselves (`distance_heatmap`, `score_bars`, `damage_plot`) and their files are `report`'s.
"""

from __future__ import annotations

import difflib
import math
import re
import urllib.error
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from matplotlib.figure import Figure

from prodigy_core import training
from prodigy_core.aggregators import AGGREGATOR_NAMES, RULES, ProDiGy, pairwise_sq_distances, split_defense
from prodigy_core.attacks import ATTACKS
from prodigy_core.config import SETTINGS_FIELDS, ConfigError, RunConfig, as_row, parse_settings
from prodigy_core.data import jpeg_copy_hint
from prodigy_core.names import DATASETS, DISTRIBUTIONS, NO_ATTACK
from prodigy_core.registry import settings_text
from prodigy_core.report import (
    byzantine_ids,
    damage_plot,
    display_value,
    distance_heatmap,
    flat_damage,
    format_parameter,
    output_dir,
    save_figure,
    score_bars,
    search_symbol,
    show,
)


@dataclass
class Exploration:
    """One round seen from the server: what `explore` measured at the last round of a short run."""

    config: RunConfig
    round: int
    byzantine: list[int]
    distances: torch.Tensor  # (N, N) squared distances between the updates the server received
    scores: Any  # ProDiGyScores of those updates (None when ProDiGy cannot run: f < 2)
    kept: list[int]  # clients with a non-zero ProDiGy weight
    search: list[tuple[Any, float]]  # the attack's (candidate, damage) pairs this round
    chosen: Any  # the attack's chosen parameter (None without a search)
    damage: float  # ||Agg(updates) - honest mean|| under the configured defense
    accuracy: float  # test accuracy (%) after the run
    scale: float | None = None  # ||honest mean||: what a damage is small against (report.flat_damage)


EXPLORE_DEFAULTS: dict[str, Any] = {"dataset": "digits", "rounds": 3, "eval_every": 3, "attack": "alie"}
# The explorer notebook's rounds per scale (`paths.notebook_scale`, experiments.SCALES) when it gives none.
NOTEBOOK_ROUNDS: dict[str, int] = {"smoke": 3, "interactive": 30, "mini": 20, "paper": 20}


def notebook_rounds(scale: str, rounds: int | None = None) -> int:
    """The rounds of notebooks/explore_attacks.ipynb's first setting: `rounds`, else NOTEBOOK_ROUNDS[scale];
    an unknown scale is a ValueError naming the valid ones (never a silent default)."""
    if scale not in NOTEBOOK_ROUNDS:
        raise ValueError(f"scale={scale!r} is unknown; valid: {', '.join(NOTEBOOK_ROUNDS)}")
    return NOTEBOOK_ROUNDS[scale] if rounds is None else rounds


def explore(
    config: RunConfig | None = None, on_progress: Callable[[int, int], None] | None = None, **fields: Any
) -> Exploration:
    """Train a short run (default: digits, 3 rounds, ALIE against ProDiGy) and look at its last round: the
    distance matrix, ProDiGy's scores and kept set, and the attack's damage per candidate parameter.

    ``fields`` override RunConfig fields of ``config`` (default: ``EXPLORE_DEFAULTS`` over RunConfig's).
    ``on_progress(k, T)`` is called as round k of T starts its aggregation (the explorer's "round k / T").
    """
    config = explore_config(config, **fields)
    f = config.n_byzantine
    seen: dict[str, Any] = {}

    def on_round(r: int, updates: torch.Tensor, momentum: torch.Tensor, pipeline: Any, attack: Any) -> None:
        if on_progress is not None:
            on_progress(r, config.rounds)
        if r != config.rounds:
            return
        honest_mean = momentum[f:].mean(dim=0)
        seen["distances"] = pairwise_sq_distances(updates).cpu()
        seen["scores"] = ProDiGy(f).scores(updates) if 2 <= f < config.n_clients / 2 else None
        seen["search"] = list(getattr(attack, "last_search", []) or [])
        seen["chosen"] = getattr(attack, "last_param", None)
        seen["damage"] = torch.linalg.vector_norm(pipeline.peek(updates) - honest_mean).item()
        seen["scale"] = torch.linalg.vector_norm(honest_mean).item()

    result = training.run(config, progress=False, on_round=on_round)
    if not seen:
        raise ValueError(
            f"the run diverged at round {result.diverged_at} of {config.rounds}, before the round to show: "
            "choose fewer rounds, another defense or a smaller learning rate"
        )
    scores = seen["scores"]
    kept = [] if scores is None else torch.nonzero(scores.weight > 0).flatten().tolist()
    return Exploration(config=config, round=config.rounds, byzantine=byzantine_ids(f), kept=kept,
                       accuracy=result.final_accuracy, **seen)  # fmt: skip


def explore_config(config: RunConfig | None = None, **fields: Any) -> RunConfig:
    """The run `explore` trains: ``config`` (default: ``EXPLORE_DEFAULTS`` over RunConfig's) with ``fields``
    over it. Anything but a RunConfig or None for ``config`` is a TypeError saying what to pass."""
    if config is not None and not isinstance(config, RunConfig):
        raise TypeError(
            f"explore: config must be a RunConfig or None, not {type(config).__name__}; give fields as "
            "keywords (explore(rounds=2), or explore(**fields) for a mapping)"
        )
    return (config if config is not None else RunConfig(**EXPLORE_DEFAULTS)).replace(**fields)


def names_with_settings(config: RunConfig) -> tuple[str, str]:
    """The defense's and the attack's names as tables print them, with their settings ("NNM+CClip
    (tau=5.0)" for {"tau": 5.0}), so that two settings of one rule never look alike."""
    row = as_row(config.to_dict())
    return display_value("defense", row["defense"]), display_value("attack", row["attack"])


def exploration_summary(ex: Exploration) -> str:
    """One line on what the explorer ran: the defense actually used (ProDiGy's kept set only as ProDiGy's
    view when another defense ran), the attack's chosen parameter, the damage and the accuracy."""
    c = ex.config
    defense, attack = names_with_settings(c)
    parts = [f"{defense} vs {attack}, round {ex.round}: Byzantine clients {ex.byzantine}"]
    if ex.scores is not None:
        who = "kept by ProDiGy" if c.defense == "prodigy" else "ProDiGy would keep"
        parts.append(f"{who} {ex.kept}")
    flat = flat_damage(ex.search, ex.scale)
    if flat is not None:  # a tie within rounding: no candidate is "chosen" for a reason
        parts.append(flat)
    elif ex.chosen is not None:
        symbol = search_symbol(c.attack)
        parts.append(f"chosen {symbol} = {format_parameter(ex.chosen)}")
    elif c.attack != NO_ATTACK and not ex.search:
        parts.append(f"{attack} has no parameter search")
    parts.append(f"damage under {defense} {ex.damage:.4g}, test accuracy {ex.accuracy:.1f}%")
    return ", ".join(parts)


def exploration_figures(ex: Exploration) -> dict[str, Figure]:
    """The explorer's views: distance heatmap, ProDiGy score bars (when ProDiGy can run: f >= 2), damage per
    attack candidate (when the attack searches a parameter; a sentence when the damages tie within
    rounding)."""
    c = ex.config
    defense, attack = names_with_settings(c)
    setting = f"{c.dataset}, N={c.n_clients}, f={c.n_byzantine}, {attack} vs {defense}, round {ex.round}"
    figures = {"distances": distance_heatmap(ex.distances, ex.byzantine, f"Squared distances ({setting})")}
    if ex.scores is not None:
        view = "" if c.defense == "prodigy" else ", ProDiGy's view"
        figures["scores"] = score_bars(ex.scores, ex.byzantine, f"ProDiGy scores ({setting}{view})")
    if ex.search:  # an attack without a parameter search (SF, LF, none) has nothing to draw
        title = f"Damage of {attack} per candidate against {defense} ({setting})"
        figures["damage"] = damage_plot(ex.search, c.attack, title=title, defense=c.defense, scale=ex.scale)
    return figures


EXPLORER_LABELS = {"dataset": "data set", "n_clients": "clients N", "n_byzantine": "Byzantine f",
                   "distribution": "split", "dirichlet_alpha": "Dirichlet α", "attack": "attack",
                   "defense": "defense", "defense_params": "defense settings",
                   "attack_params": "attack settings", "rounds": "rounds T", "seed": "seed",
                   "data_dir": "data folder", "download": "download CIFAR-10 if missing"}  # fmt: skip
SETTINGS_PLACEHOLDER = "e.g. tau=5, L=2"  # empty: the class's defaults (the tooltip says so)
DATASET_LABELS = {"digits": "digits (offline)", "femnist": "FEMNIST (LEAF folder)", "cifar10": "CIFAR-10"}
DATA_DIR_PLACEHOLDER = "empty: the default (see tooltip)"
# The controls' grid: two columns of COLUMN_EM, each control filling its column, labels DESCRIPTION_EM wide.
COLUMN_EM, DESCRIPTION_EM = 30, 9
# One name per rule: "average" is "none" (the plain mean, "No defense") under another name.
EXPLORER_DEFENSES = tuple(d for d in AGGREGATOR_NAMES if d.split("+")[-1] != "average")


def explorer_defaults(**setting: Any) -> dict[str, Any]:
    """The widget's first setting: ``EXPLORE_DEFAULTS`` and the explorer's own, then ``setting``."""
    return {**EXPLORE_DEFAULTS, "n_clients": 10, "n_byzantine": 3, "distribution": "dirichlet",
            "dirichlet_alpha": 0.1, "defense": "prodigy", "seed": 0, "data_dir": None, "download": False,
            "defense_params": {}, "attack_params": {}, **setting}  # fmt: skip


# The sliders' ranges: a setting outside them is refused, not clamped by the slider.
EXPLORER_RANGES: dict[str, tuple[float, float]] = {"n_clients": (4, 50), "rounds": (1, 100),
                                                   "dirichlet_alpha": (0.01, 100)}  # fmt: skip


def explorer_setting(**setting: Any) -> dict[str, Any]:
    """The widget's first setting (`explorer_defaults`), checked as RunConfig checks a run and normalised as
    the command line normalises it (``"ALIE"``: ``alie``); unknown names and values outside the controls'
    ranges are one ConfigError in the controls' words (`in_widget_words`)."""
    for name in setting:
        if name not in EXPLORER_LABELS:
            close = difflib.get_close_matches(name, list(EXPLORER_LABELS), n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            valid = ", ".join(f"{k} ({label})" for k, label in EXPLORER_LABELS.items())
            raise ConfigError(f"explorer: unknown setting {name!r}{hint}; valid: {valid}")
    s = explorer_defaults(**setting)
    splits = DISTRIBUTIONS.get(s["dataset"], ())
    if "distribution" not in setting and splits and s["distribution"] not in splits:
        s["distribution"] = splits[0]  # the default split of the data set
    for name, (low, high) in EXPLORER_RANGES.items():
        value = s[name]
        if isinstance(value, int | float) and not isinstance(value, bool) and not low <= value <= high:
            raise ConfigError(
                in_widget_words(
                    f"explorer: {name}={value:g} is outside its control's range {low:g}..{high:g}"
                )
            )
    try:
        config = RunConfig(**{k: s[k] for k in EXPLORER_LABELS})
    except ConfigError as e:
        raise ConfigError(f"explorer: {in_widget_words(str(e))}") from None
    s["attack"], s["defense"] = config.attack, config.defense
    s["attack_params"], s["defense_params"] = dict(config.attack_params), dict(config.defense_params)
    if s["defense"] not in EXPLORER_DEFENSES:  # "average" and its prefixed forms: "none" under another name
        s["defense"] = s["defense"].replace("average", "none")
    return s


def runnable_options(field: str, options: Sequence[str], setting: dict[str, Any]) -> list[str]:
    """The values of ``field`` (defense, attack) that can run with the rest of ``setting`` (N, f, the data
    set): those RunConfig accepts, so that the rules and attacks keep one source of truth for their limits."""
    base = {k: v for k, v in setting.items() if k in EXPLORER_LABELS and k not in SETTINGS_FIELDS}
    ok = []
    for option in options:
        try:
            RunConfig(**{**base, field: option})
        except (ConfigError, ValueError, TypeError):
            continue
        ok.append(option)
    return ok


def max_byzantine(n_clients: int) -> int:
    """The largest f below N/2 (every defense's and RunConfig's limit)."""
    return max(0, (int(n_clients) - 1) // 2)


def cannot_run(error: Exception, setting: dict[str, Any]) -> str:
    """Why ``setting`` (the explorer's fields) cannot run, one line: a failed download (a URLError, a refused
    or timed-out connection) says so and how to get CIFAR-10 offline (`prodigy-fl data cifar10 --from` the
    JPEG copy); another OSError its reason and file; any other error its message."""
    if isinstance(error, urllib.error.URLError | ConnectionError | TimeoutError):
        reason = getattr(error, "reason", None) or error.strerror or error
        folder = f" {setting['data_dir']}" if setting.get("data_dir") else ""
        return (
            f"downloading CIFAR-10 failed ({reason}; offline?): decode the JPEG copy instead, "
            f"`prodigy-fl data cifar10{folder} --from {jpeg_copy_hint()}`, and run this again"
        )
    if isinstance(error, OSError) and not isinstance(error, FileNotFoundError):
        return f"{error.strerror or error}" + (f": {error.filename}" if error.filename else "")
    return str(error)


def in_widget_words(message: str) -> str:
    """An error message as the explorer's user reads it: field names as the controls' labels
    ("n_byzantine=5" -> "Byzantine f=5"), ``download=True`` as the checkbox to tick."""
    tick = f'tick "{EXPLORER_LABELS["download"]}"'
    message = re.sub(r"(pass )?download=True", "\0", message)  # a placeholder, put back last
    for field, label in EXPLORER_LABELS.items():
        # a field name: an identifier with "_" anywhere, a plain word only as "field=value"
        message = re.sub(rf"\b{field}\b" if "_" in field else rf"\b{field}(?==)", label, message)
    return message.replace("\0", tick)


def explorer(**setting: Any) -> Any:
    """The attack explorer for JupyterLab (needs ipywidgets, the ``lab`` extra): labelled controls starting
    at ``setting`` (``EXPLORER_LABELS``' fields), a "Train and show" button, a "round k / T" bar while it
    trains, then the summary and the views in place of the previous ones (cleared as training starts).

    The controls offer only what can run: f stays below N/2 as N moves, the defenses and attacks are those
    RunConfig accepts at the current N, f and data set (one name per rule), the splits those of the data set;
    the Dirichlet α, the data folder and the download box are greyed out where they do not apply. Errors are
    in the controls' words (`in_widget_words`), a first setting the controls cannot show included
    (`explorer_setting`). Returns the widget box; its ``.train()`` runs the current setting (what the button
    does; the setting trained last is shown again, not retrained), ``.keep(ex)`` takes `ex` as the current
    setting's exploration (the notebook's first setting, trained once) and ``.controls`` maps fields to
    their controls. A chosen attack or defense that N, f or the data set rule out comes back when they
    allow it again."""
    import ipywidgets as widgets

    def choices(field: str, values: Sequence[str]) -> list[tuple[str, str]]:
        return [(display_value(field, v), v) for v in values]

    def settings_box(settings: dict[str, Any]) -> Any:
        tip = "the rule's or the attack's own settings, setting=value, commas between; empty: its defaults"
        return widgets.Text(value=settings_text(settings), placeholder=SETTINGS_PLACEHOLDER, tooltip=tip)

    s = explorer_setting(**setting)
    # a name the menus lack but the setting gives (``foe`` with its eps, a plug-in) is offered too
    menus = {"attack": list(ATTACKS.ready()), "defense": list(EXPLORER_DEFENSES)}
    given = {field: [s[field]] if s[field] not in menus[field] else [] for field in menus}
    (n_low, n_high), (t_low, t_high) = EXPLORER_RANGES["n_clients"], EXPLORER_RANGES["rounds"]
    alpha_low, alpha_high = (math.log10(a) for a in EXPLORER_RANGES["dirichlet_alpha"])
    fill = {"width": "100%"}
    controls = dict(
        dataset=widgets.Dropdown(options=[(DATASET_LABELS[d], d) for d in DATASETS], value=s["dataset"]),
        n_clients=widgets.IntSlider(value=s["n_clients"], min=n_low, max=n_high),
        n_byzantine=widgets.IntSlider(value=s["n_byzantine"], min=0, max=max_byzantine(s["n_clients"])),
        distribution=widgets.Dropdown(
            options=choices("distribution", DISTRIBUTIONS[s["dataset"]]), value=s["distribution"]
        ),  # fmt: skip
        dirichlet_alpha=widgets.FloatLogSlider(
            value=s["dirichlet_alpha"], base=10, min=alpha_low, max=alpha_high
        ),  # fmt: skip
        attack=widgets.Dropdown(
            options=choices("attack", menus["attack"] + given["attack"]), value=s["attack"]
        ),
        defense=widgets.Dropdown(
            options=choices("defense", menus["defense"] + given["defense"]), value=s["defense"]
        ),
        defense_params=settings_box(s["defense_params"]),
        attack_params=settings_box(s["attack_params"]),
        rounds=widgets.IntSlider(value=s["rounds"], min=t_low, max=t_high),
        seed=widgets.IntText(value=s["seed"]),
        data_dir=widgets.Text(value=s["data_dir"] or "", placeholder=DATA_DIR_PLACEHOLDER),
        download=widgets.Checkbox(value=bool(s["download"]), indent=False),
    )
    for field, control in controls.items():
        control.description = EXPLORER_LABELS[field]
        control.style = {"description_width": f"{DESCRIPTION_EM}em"}
        control.layout = dict(fill)
    controls["data_dir"].tooltip = (
        "CIFAR-10's folder (empty: data/ or env PRODIGY_DATA_DIR) or FEMNIST's LEAF folder (empty: env "
        "PRODIGY_FEMNIST_DIR, else shared/data/femnist-leaf-24 or femnist-leaf beside the clone)"
    )
    button = widgets.Button(description="Train and show", button_style="primary", icon="play")
    bar = widgets.IntProgress(value=0, min=0, max=1, description="", layout={"visibility": "hidden"})
    out = widgets.Output()

    def current() -> dict[str, Any]:
        return {k: c.value for k, c in controls.items()}

    chosen = {"attack": s["attack"], "defense": s["defense"]}  # the user's choice, kept while not offered
    offering = []  # non-empty while `offer` changes a menu: not the user's choice

    def offer(field: str, options: Sequence[str]) -> None:
        """Show only ``options`` for ``field``: the user's choice when it is there again (after f passed
        through 0, say), else the value it has when still there, else the first."""
        control = controls[field]
        value = chosen.get(field, control.value)
        value = value if value in options else control.value
        offering.append(field)
        try:
            if list(options) != [v for _, v in control.options]:
                control.options = choices(field, options)
            control.value = value if value in options else options[0]
        finally:
            offering.pop()

    def remember(field: str) -> Callable[[Any], None]:
        def on_change(change: Any) -> None:
            if not offering:  # the user picked it
                chosen[field] = change["new"]

        return on_change

    for field in chosen:
        controls[field].observe(remember(field), names="value")

    def update(_: Any = None) -> None:
        """Re-offer what can run after a change of the data set, N, f or the split."""
        n_clients, f = controls["n_clients"], controls["n_byzantine"]
        f.max = max_byzantine(n_clients.value)  # the slider clips its value to the new max
        dataset = controls["dataset"].value
        offer("distribution", DISTRIBUTIONS[dataset])
        controls["dirichlet_alpha"].disabled = controls["distribution"].value != "dirichlet"
        controls["data_dir"].disabled = dataset == "digits"
        controls["download"].disabled = dataset != "cifar10"
        values = current()
        attacks = runnable_options("attack", menus["attack"], {**values, "defense": "none"}) + given["attack"]
        offer("attack", attacks or ["none"])
        defenses = runnable_options("defense", menus["defense"], {**current(), "attack": "none"})
        offer("defense", defenses + given["defense"] or ["none"])

    for field in ("dataset", "n_clients", "n_byzantine", "distribution"):
        controls[field].observe(update, names="value")
    update()

    def progress(k: int, total: int) -> None:
        bar.max, bar.value, bar.description = total, k, f"round {k} / {total}"

    # the setting trained last, its run's code (`run_code`) and its exploration: shown again, not retrained
    last: dict[str, Any] = {}

    def train(_: Any = None) -> Exploration | None:
        values = current()
        settings = dict(values, data_dir=values["data_dir"].strip() or None)
        out.clear_output()  # the previous views go now, not when the new ones arrive
        try:
            for name in SETTINGS_FIELDS:
                settings[name] = parse_settings(name, settings[name])
            config = explore_config(eval_every=settings["rounds"], **settings)
            code = run_code(config)
        except (ConfigError, ValueError, OSError) as e:
            with out:
                print(f"cannot run this setting: {in_widget_words(cannot_run(e, settings))}")
            return None
        if last and last["values"] == values and last["code"] == code:
            with out:
                print(exploration_summary(last["ex"]))
                show(*exploration_figures(last["ex"]).values())
            return last["ex"]
        button.disabled = True
        bar.layout.visibility = "visible"
        progress(0, controls["rounds"].value)
        try:
            ex = explore(config=config, on_progress=progress)
        except (ConfigError, ValueError, OSError) as e:  # a failed CIFAR-10 download is an OSError
            with out:
                print(f"cannot run this setting: {in_widget_words(cannot_run(e, settings))}")
            return None
        finally:
            button.disabled = False
            bar.layout.visibility = "hidden"
        last.update(values=values, code=code, ex=ex)
        with out:
            print(exploration_summary(ex))
            show(*exploration_figures(ex).values())
        return ex

    button.on_click(train)
    grid = widgets.GridBox(list(controls.values()),
                           layout={"grid_template_columns": f"repeat(2, {COLUMN_EM}em)"})  # fmt: skip
    box = widgets.VBox([grid, widgets.HBox([button, bar]), out])
    box.train = train

    def keep(ex: Exploration) -> None:
        """Take ``ex`` as the exploration of what the controls show now (not trained again)."""
        last.update(values=current(), code=run_code(ex.config), ex=ex)

    box.keep = keep
    box.controls = controls
    return box


def run_code(config: RunConfig) -> tuple[Any, ...]:
    """What says a run's code changed: its result key (`RunConfig.key`: with a plug-in's code hash) and the
    classes a rule or an attack registered by name outside the package stands for now (whose code no key
    holds: a notebook's cell run again registers an edited class)."""
    rule, attack = RULES.unkeyed_class(split_defense(config.defense)[1]), ATTACKS.unkeyed_class(config.attack)
    return config.key(), rule, attack


EXPLORER_VIEWS = ("distances", "scores", "damage")  # `exploration_figures`' views, in its order
# What a run needs for the views it may lack.
VIEW_NEEDS = {"scores": "ProDiGy's scores need f >= 2", "damage": "the attack searches no parameter"}


def write_exploration(
    ex: Exploration,
    name: str,
    smoke: bool,
    out_dir: str | Path | None = None,
    views: Sequence[str] | None = None,
    mini: bool = False,
) -> list[Path]:
    """Save the explorer's views (all, or those named in ``views``, `EXPLORER_VIEWS`; one name as a string
    too) as ``<name>_<view>.pdf``/``.png`` in `report.output_dir` (its smoke/ or mini/ subfolder at those
    scales). An unknown view name is a ValueError naming the valid ones; a view this run lacks (scores with
    f < 2, damage for an attack without a parameter search) is a warning naming it, the others saved."""
    wanted = list(EXPLORER_VIEWS if views is None else [views] if isinstance(views, str) else views)
    unknown = [v for v in wanted if v not in EXPLORER_VIEWS]
    if unknown:
        raise ValueError(f"write_exploration: unknown view(s) {unknown}; valid: {', '.join(EXPLORER_VIEWS)}")
    figures = exploration_figures(ex)
    lacking = [v for v in EXPLORER_VIEWS if v in wanted and v not in figures]
    saved = [v for v in EXPLORER_VIEWS if v in wanted and v in figures]
    if lacking and views is not None:  # all views asked for: those the run has
        why = "; ".join(f"{v}: {VIEW_NEEDS[v]}" for v in lacking)
        warnings.warn(
            f"write_exploration: this run has no {', '.join(lacking)} view ({why}); saved "
            f"{', '.join(saved) or 'none'}",
            UserWarning,
            stacklevel=2,
        )
    folder = output_dir(smoke, out_dir, mini=mini)
    paths = []
    for view in saved:
        paths += save_figure(figures[view], folder / f"{name}_{view}")
    return paths


__all__ = [
    "DATASET_LABELS",
    "EXPLORER_DEFENSES",
    "EXPLORER_LABELS",
    "EXPLORER_RANGES",
    "EXPLORE_DEFAULTS",
    "EXPLORER_VIEWS",
    "Exploration",
    "cannot_run",
    "exploration_figures",
    "exploration_summary",
    "explore",
    "explore_config",
    "explorer",
    "explorer_defaults",
    "explorer_setting",
    "in_widget_words",
    "runnable_options",
    "write_exploration",
]
