"""Tables and figures from a results frame (`results.load`, `experiments.run_grid`): the paper's layout as
Markdown and LaTeX, heatmaps, curves, worst-case bars, and the views of one round (distances, ProDiGy's
scores, an attack's damage). A params file's ``report`` layout names the rows, columns and blocks; cells are
mean ± std over seeds, each row's worst case over the attacks bold as in the paper, a diverged run marked †.
Figures are built without pyplot under one fixed style and saved without dates: the same results give
byte-identical files. Entry points: `write_report`, `heatmap`, `worst_case_bars`, `accuracy_table`.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import re
import textwrap
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import matplotlib
import numpy as np
import pandas as pd
import torch
from matplotlib.figure import Figure

from prodigy_core.aggregators import PRE_AGGREGATORS, RULES, split_defense
from prodigy_core.attacks import ATTACKS
from prodigy_core.config import as_row
from prodigy_core.names import FIGURES, NO_ATTACK  # FIGURES: what a layout may draw (checked at load too)
from prodigy_core.registry import split_label

SMOKE_SUBDIR = "smoke"
MINI_SUBDIR = "mini"
SMOKE_LABEL = "SMOKE / stand-in"
MINI_LABEL = "MINI scale"
DIVERGED_MARK = "†"
# What a diverged run scores, per variant (`evaluation`): chance under `paper`; under `authors` what their
# code reports, the class-0 share of a NaN network's argmax, or the evaluation whose test loss was NaN.
DIVERGED_SCORE = {
    "paper": "chance accuracy",
    "authors": "the accuracy the authors' code reports (a NaN network's argmax: the class-0 share)",
}
LAYOUT_FIX = (
    "name it in the report layout's blocks (params file: report.blocks), or report one value at a time "
    "(select its rows); write_report splits by precision itself"
)

# Names as the paper prints them, for fields without a registry (defense and attack names come from the
# classes: `aggregators.RULES`, `attacks.ATTACKS`); values not listed are shown as field=value.
DISPLAY_NAMES: dict[str, dict[Any, str]] = {
    "distribution": {"iid": "IID", "dirichlet": "Dirichlet", "natural": "Natural"},
}
FIELD_SYMBOLS = {"local_momentum": "β", "n_clients": "N", "n_byzantine": "f", "dirichlet_alpha": "α"}

# One fixed style for every saved figure (fonts shipped with matplotlib, so the same on every machine).
STYLE = {
    "font.family": "DejaVu Sans",
    "font.size": 8,
    "axes.titlesize": 9,
    "figure.dpi": 100,
    "savefig.dpi": 150,
    "pdf.fonttype": 3,
    "svg.hashsalt": "prodigy-fl",
    "image.cmap": "viridis",
}
FIXED_METADATA = {
    "pdf": {"CreationDate": None, "ModDate": None, "Creator": None, "Producer": None},
    "png": {"Software": None},
}
SUBTITLE_SIZE = 7  # points: the smoke/stand-in tag under a figure's title
BYZANTINE_COLOUR = "#d62728"
HONEST_COLOUR = "#1f77b4"


# ---------------------------------------------------------------------------------------------- labels


def display_value(field: str, value: Any) -> str:
    """How one value of a config field is printed in tables and figures ("sf" -> "SF", beta -> "β=0.9")."""
    if field == "defense" and isinstance(value, str):
        prefix, base = split_defense(value)
        if prefix:
            return f"{PRE_AGGREGATORS[prefix].display}+{display_value(field, base)}"
    registry = {"defense": RULES, "attack": ATTACKS}.get(field)
    shown = registry.display_label(value) if registry is not None and isinstance(value, str) else None
    if shown is not None:
        return shown
    if value in DISPLAY_NAMES.get(field, {}):
        return DISPLAY_NAMES[field][value]
    if field == "local_steps":
        return "FedSGD" if int(value) == 1 else f"FedAVG (E={int(value)})"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return f"{FIELD_SYMBOLS.get(field, field)}={value}"


def field_title(field: str) -> str:
    """Column header for a field name: "n_byzantine" -> "N byzantine"."""
    return field.replace("_", " ").capitalize()


def block_label(blocks: Sequence[str], key: Any) -> str:
    """Label of one column block, e.g. "Dirichlet, β=0.9, FedAVG (E=10)"."""
    values = key if isinstance(key, tuple) else (key,)
    return ", ".join(display_value(b, v) for b, v in zip(blocks, values, strict=True))


def split_title(title: str) -> tuple[str, str | None]:
    """A title's headline and its trailing "[...]" tag (smoke scale, stand-in data), which tables and
    figures show as a subtitle: "Table I [SMOKE: 3 rounds]" -> ("Table I", "SMOKE: 3 rounds")."""
    m = re.fullmatch(r"(.*?)\s*\[([^\[\]]*)\]", title.strip(), flags=re.S)
    return (m[1], m[2]) if m and m[1] else (title, None)


def join_title(headline: str, tag: str | None) -> str:
    """Inverse of :func:`split_title`."""
    return f"{headline} [{tag}]" if tag else headline


def scale_label(tag: str | None) -> str | None:
    """The short label of a title's tag that goes into the headline itself, so that smoke, stand-in and mini
    outputs are never read as the paper's: "SMOKE: 3 rounds; digits (offline stand-in for cifar10)" ->
    "SMOKE / stand-in", "MINI: 100 of 800 rounds, seed 0" -> "MINI"."""
    if not tag:
        return None
    label = tag.split(":")[0].strip()
    if "stand-in" in tag and "stand-in" not in label:
        label += " / stand-in"
    return label


def labelled_headline(title: str) -> tuple[str, str | None]:
    """A title's headline with its scale label in front ("SMOKE / stand-in — Table I: CIFAR-10"), and its
    tag (the details, shown under it)."""
    headline, tag = split_title(title)
    label = scale_label(tag)
    return (f"{label} — {headline}" if label else headline), tag


def rounds_phrase(df: pd.DataFrame) -> str | None:
    """How many rounds the runs trained: "70 rounds", "40-80 rounds" (None without a rounds column)."""
    if "rounds" not in df.columns:
        return None
    rounds = sorted({int(r) for r in df["rounds"].dropna().tolist()})
    if not rounds:
        return None
    return f"{rounds[0]} rounds" if len(rounds) == 1 else f"{rounds[0]}-{rounds[-1]} rounds"


def diverged_score(df: pd.DataFrame) -> str:
    """What a diverged run of these runs counts at (`DIVERGED_SCORE` of their variants, ``paper``'s first)."""
    variants = set(df["variant"]) if "variant" in df else {"paper"}
    return " or ".join(DIVERGED_SCORE[v] for v in DIVERGED_SCORE if v in variants) or DIVERGED_SCORE["paper"]


def diverged_note(seeds: str, df: pd.DataFrame) -> str:
    """The footnote of a diverged cell; "in at least one seed" only where a cell has several."""
    where = "" if seeds == "one seed" else " in at least one seed"
    return f"the model diverged (became non-finite){where}; such a run counts at {diverged_score(df)}"


def diverged_legend(seeds: str, df: pd.DataFrame) -> str:
    """A figure's legend line for a diverged cell (heatmap, worst-case bars); tables: `diverged_note`."""
    where = "" if seeds == "one seed" else " in at least one seed"
    return f"{DIVERGED_MARK} diverged{where} (counted at {diverged_score(df)})"


def table_caption(
    df: pd.DataFrame,
    layout: Mapping[str, Any],
    order: Mapping[str, Sequence[Any]] | None = None,
    coverage: str | None = None,
    curves: bool = False,
) -> str:
    """What a table figure shows, under its title: the accuracy after how many rounds, over how many seeds,
    how many of the grid's cells were run (``coverage``, e.g. "9 of 84 cells run") and, for the heatmap,
    what bold means ("Final test accuracy (%) after 70 rounds, one seed; bold: the worst case over the
    attacks per defense")."""
    rows, columns, _ = _layout(layout)
    *_, seeds = _tables(df, layout, order)
    seeds = seeds.replace("mean ± std", "mean")  # a figure shows the mean only
    rounds = rounds_phrase(df)
    if curves:
        head = f"Test accuracy (%) over {rounds}" if rounds else "Test accuracy (%) over the rounds"
    else:
        head = f"Final test accuracy (%) after {rounds}" if rounds else "Final test accuracy (%)"
    parts = [f"{head}, {seeds}"]
    if coverage:
        parts.append(coverage)
    if not curves:
        parts.append(f"bold: the worst case over the {columns}s per {rows}")
    return "; ".join(parts)


# ---------------------------------------------------------------------------------------------- tables


def _layout(layout: Mapping[str, Any]) -> tuple[str, str, list[str]]:
    rows, columns = layout.get("rows", "defense"), layout.get("columns", "attack")
    blocks = layout.get("blocks") or []
    blocks = [blocks] if isinstance(blocks, str) else list(blocks)
    return rows, columns, blocks


def _ordered(values: pd.Series, order: Sequence[Any] | None) -> list[Any]:
    """Unique values in the given order (values not in it follow, in order of first appearance)."""
    seen = list(dict.fromkeys(values.tolist()))
    if order is None:
        return seen
    return [v for v in dict.fromkeys(order) if v in seen] + [v for v in seen if v not in order]


def summarize(
    df: pd.DataFrame, layout: Mapping[str, Any], order: Mapping[str, Sequence[Any]] | None = None
) -> pd.DataFrame:
    """Mean, std and number of seeds of ``final_accuracy`` per table cell, in table order.

    std is the population std over seeds (numpy's default, ddof=0); it is NaN where a cell has one seed.
    ``n_diverged`` counts the cell's runs recorded as diverged (column ``diverged``; 0 without it).
    ``worst_case`` marks, within each row and block, the attacks whose mean equals the row's minimum over
    the attacks other than "no attack" (the paper's bold cells). A cell averages over seeds only: runs of
    one cell that differ in another field (precision, lr, ...) are a ValueError naming it
    (`results.check_one_setting_per_cell`; `write_report` writes one report per precision).
    """
    rows, columns, blocks = _layout(layout)
    keys = blocks + [rows, columns]
    missing = [k for k in keys + ["final_accuracy"] if k not in df.columns]
    if missing:
        raise ValueError(
            f"results frame lacks columns {missing} needed by the layout {dict(layout)}; "
            f"available: {', '.join(map(str, df.columns))}"
        )
    if df.empty:
        raise ValueError("results frame is empty: run the grid first (prodigy-fl grid ...)")
    from prodigy_core.results import check_one_setting_per_cell, data_source_of

    data_source_of(df)  # one table, one data source
    check_one_setting_per_cell(df, keys, LAYOUT_FIX)  # a cell is a mean over seeds only
    diverged = df["diverged"].fillna(False).astype(bool) if "diverged" in df.columns else False
    grouped = df.assign(_diverged=diverged).groupby(keys, sort=False, dropna=False)
    accuracy = grouped["final_accuracy"]
    out = pd.DataFrame({"mean": accuracy.mean(), "std": accuracy.std(ddof=0), "n_seeds": accuracy.count(),
                        "n_diverged": grouped["_diverged"].sum()})  # fmt: skip
    out.loc[out["n_seeds"] < 2, "std"] = np.nan
    out = out.reset_index()
    order = dict(order or {})
    for key in keys:
        values = _ordered(df[key], order.get(key))
        out[key] = pd.Categorical(out[key], categories=values, ordered=True)
    out = out.sort_values(keys, kind="stable").reset_index(drop=True)
    for key in keys:
        out[key] = out[key].astype(object)
    attacked = out[out[columns] != NO_ATTACK]
    row_min = attacked.groupby(blocks + [rows], sort=False, dropna=False)["mean"].transform("min")
    out["worst_case"] = False
    out.loc[attacked.index, "worst_case"] = np.isclose(attacked["mean"], row_min, rtol=0, atol=1e-9)
    return out


def cell_table(
    df: pd.DataFrame, rows: str, columns: str, row_order: Sequence[Any] | None = None
) -> pd.DataFrame:
    """Final accuracy per (row, column) value as a report prints its cells (`summarize`, `cell_text`: mean ±
    std over seeds), wide: the row field first, then one column per value (sorted); no runs: "–"."""
    long = summarize(df, {"rows": rows, "columns": columns}, {rows: list(row_order or [])})
    long["cell"] = [cell_text(m, s) for m, s in zip(long["mean"], long["std"], strict=True)]
    wide = long.pivot(index=rows, columns=columns, values="cell").fillna("–")
    return wide.reindex(index=list(dict.fromkeys(long[rows]))).reset_index()


def accuracy_table(
    df: pd.DataFrame,
    layout: Mapping[str, Any],
    stat: str = "mean",
    order: Mapping[str, Sequence[Any]] | None = None,
) -> pd.DataFrame:
    """Wide table of one statistic (``mean``, ``std``, ``n_seeds``, ``n_diverged`` or ``worst_case``): index =
    row values,
    columns = (block values..., column value) as a MultiIndex when the layout has blocks, else column
    values."""
    rows, columns, blocks = _layout(layout)
    long = summarize(df, layout, order)
    table = long.pivot_table(index=rows, columns=blocks + [columns], values=stat, sort=False, dropna=False)
    if stat == "worst_case":
        table = table.eq(True)  # a missing cell (NaN) is not a worst case
    row_order = list(dict.fromkeys(long[rows]))
    col_order = list(dict.fromkeys(zip(*[long[k] for k in blocks + [columns]], strict=True)))
    if not blocks:
        col_order = [c[0] for c in col_order]
    return table.reindex(index=row_order, columns=col_order)


def worst_case(
    df: pd.DataFrame, layout: Mapping[str, Any], order: Mapping[str, Sequence[Any]] | None = None
) -> pd.DataFrame:
    """Wide boolean table of the paper's bold cells: per row and column block, the attacks with the lowest
    mean accuracy ("no attack" excluded, ties all marked); see :func:`summarize`."""
    return accuracy_table(df, layout, "worst_case", order)


def _block_groups(columns: pd.Index) -> dict[Any, list[Any]]:
    """Columns grouped by block key (all block levels but the last), in order; one group without blocks."""
    groups: dict[Any, list[Any]] = {}
    for c in columns:
        key = c[:-1] if isinstance(c, tuple) and len(c) > 1 else ()
        groups.setdefault(key, []).append(c)
    return groups


def cell_text(mean: float, std: float, digits: int = 2) -> str:
    """A table cell as the reports print it: "mean ± std", "mean" without a std (one seed), "–" without a
    mean (`parse_cell` reads it back)."""
    if pd.isna(mean):
        return "–"
    return f"{mean:.{digits}f}" if pd.isna(std) else f"{mean:.{digits}f} ± {std:.{digits}f}"


def _tables(df: pd.DataFrame, layout: Mapping[str, Any], order: Mapping[str, Sequence[Any]] | None):
    """Wide mean, std, worst-case and diverged (bool) tables, and the caption's seeds phrase."""
    mean, std, worst, n_seeds, n_diverged = (
        accuracy_table(df, layout, stat, order)
        for stat in ("mean", "std", "worst_case", "n_seeds", "n_diverged")
    )
    counts = n_seeds.to_numpy(dtype=float).ravel()
    return mean, std, worst, n_diverged.fillna(0) > 0, seeds_phrase(counts[~np.isnan(counts)].tolist())


def seeds_phrase(n_seeds: Sequence[float]) -> str:
    """What a cell holds, from the cells' numbers of seeds: "mean ± std over 3 seeds" ("over 2-3 seeds" where
    cells differ), or "one seed" when no cell has more (then there is no std)."""
    counts = [int(n) for n in n_seeds if n > 0] or [1]
    lo, hi = min(counts), max(counts)
    if hi == 1:
        return "one seed"
    return f"mean ± std over {hi if lo == hi else f'{lo}-{hi}'} seeds"


def to_markdown(
    df: pd.DataFrame,
    layout: Mapping[str, Any],
    title: str,
    order: Mapping[str, Sequence[Any]] | None = None,
    note: str | None = None,
) -> str:
    """The table as Markdown: one pipe table per column block, worst case per row in bold, diverged cells
    marked with a dagger and a footnote. A trailing "[...]" tag of the title (smoke, stand-in) becomes an
    italic subtitle line."""
    rows, columns, blocks = _layout(layout)
    mean, std, worst, diverged, seeds = _tables(df, layout, order)
    headline, tag = labelled_headline(title)
    lines = [f"# {headline}", ""]
    if tag:
        lines += [f"*{tag}*", ""]
    if note:
        lines += [note, ""]
    after = f" after {rounds_phrase(df)}" if rounds_phrase(df) else ""
    lines += [f"Final test accuracy (%){after}, {seeds}; **bold**: worst case per {rows}.", ""]
    for key, cols in _block_groups(mean.columns).items():
        if blocks:
            lines += [f"## {block_label(blocks, key)}", ""]
        header = [field_title(rows)] + [display_value(columns, c[-1] if blocks else c) for c in cols]
        lines.append("| " + " | ".join(header) + " |")
        lines.append("|" + "|".join([":---"] + ["---:"] * len(cols)) + "|")
        for r in mean.index:
            cells = []
            for c in cols:
                text = cell_text(mean.at[r, c], std.at[r, c]) + (DIVERGED_MARK if diverged.at[r, c] else "")
                cells.append(f"**{text}**" if worst.at[r, c] else text)
            lines.append("| " + " | ".join([display_value(rows, r)] + cells) + " |")
        lines.append("")
    if diverged.to_numpy().any():
        note = diverged_note(seeds, df)
        lines += [f"{DIVERGED_MARK} {note[0].upper()}{note[1:]}.", ""]
    return "\n".join(lines)


_LATEX_ESCAPES = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
                  "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}",
                  "ε": r"$\varepsilon$", "β": r"$\beta$", "α": r"$\alpha$", "–": "--", "±": r"$\pm$",
                  "†": r"$^\dagger$"}  # fmt: skip


def latex_escape(text: str) -> str:
    return "".join(_LATEX_ESCAPES.get(ch, ch) for ch in str(text))


def to_latex(
    df: pd.DataFrame,
    layout: Mapping[str, Any],
    title: str,
    order: Mapping[str, Sequence[Any]] | None = None,
    label: str | None = None,
) -> str:
    """The table as a LaTeX ``table`` (booktabs): one header row per block level with merged cells,
    worst case per row in bold (``\\boldmath``, so that ± and the dagger are bold too), diverged cells
    with a dagger explained in the caption. Needs ``\\usepackage{booktabs}``."""
    rows, columns, blocks = _layout(layout)
    mean, std, worst, diverged, seeds = _tables(df, layout, order)
    cols = list(mean.columns)
    keys = [c if isinstance(c, tuple) else (c,) for c in cols]
    headline, tag = split_title(title)
    caption = latex_escape(headline) + (f" ({latex_escape(tag)})" if tag else "")
    after = f" after {rounds_phrase(df)}" if rounds_phrase(df) else ""
    note = latex_escape(diverged_note(seeds, df))
    footnote = rf" $^\dagger$: {note}." if diverged.to_numpy().any() else ""
    lines = [
        r"\begin{table}[t]",
        r"\centering",
        rf"\caption{{{caption}: final test accuracy (\%){after}, {latex_escape(seeds)}; "
        rf"bold: worst case over attacks per {latex_escape(rows)}.{footnote}}}",
    ]
    if label:
        lines.append(rf"\label{{{label}}}")
    lines += [r"\resizebox{\linewidth}{!}{%", rf"\begin{{tabular}}{{l{'c' * len(cols)}}}", r"\toprule"]
    for level, field in enumerate(blocks):
        # (block prefix, first column, last column); LaTeX columns are 1-based, column 1 is the row label
        spans: list[tuple[Any, int, int]] = []
        for i, k in enumerate(keys, start=2):
            if spans and spans[-1][0] == k[: level + 1]:
                spans[-1] = (spans[-1][0], spans[-1][1], i)
            else:
                spans.append((k[: level + 1], i, i))
        names = [latex_escape(display_value(field, prefix[-1])) for prefix, _, _ in spans]
        cells = [
            rf"\multicolumn{{{b - a + 1}}}{{c}}{{{name}}}"
            for name, (_, a, b) in zip(names, spans, strict=True)
        ]
        lines.append(" & ".join([""] + cells) + r" \\")
        lines.append(" ".join(rf"\cmidrule(lr){{{a}-{b}}}" for _, a, b in spans))
    header = [latex_escape(field_title(rows))] + [latex_escape(display_value(columns, k[-1])) for k in keys]
    lines += [" & ".join(header) + r" \\", r"\midrule"]
    for r in mean.index:
        cells = []
        for c in cols:
            m, s = mean.at[r, c], std.at[r, c]
            text = "--" if pd.isna(m) else (f"{m:.2f}" if pd.isna(s) else rf"{m:.2f} $\pm$ {s:.2f}")
            text += r"$^\dagger$" if diverged.at[r, c] else ""
            cells.append(rf"\textbf{{\boldmath {text}}}" if worst.at[r, c] else text)
        lines.append(" & ".join([latex_escape(display_value(rows, r))] + cells) + r" \\")
    lines += [r"\bottomrule", r"\end{tabular}}", r"\end{table}", ""]
    return "\n".join(lines)


def frame_to_markdown(frame: pd.DataFrame, title: str | None = None, floatfmt: str = ".2f") -> str:
    """A plain DataFrame as a Markdown pipe table (no tabulate dependency); index left out."""

    def fmt(v: Any) -> str:
        if isinstance(v, float | np.floating):
            return "–" if math.isnan(v) else format(v, floatfmt)
        return str(v)

    lines = [f"# {title}", ""] if title else []
    lines.append("| " + " | ".join(map(str, frame.columns)) + " |")
    lines.append("|" + "|".join("---" for _ in frame.columns) + "|")
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in frame.itertuples(index=False)]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------- figures


@contextlib.contextmanager
def figure_style() -> Iterator[None]:
    """The fixed style every figure is drawn and saved under (so files do not depend on the user's rc)."""
    with matplotlib.rc_context(STYLE):
        yield


def save_figure(fig: Figure, base: str | Path) -> list[Path]:
    """Write ``<base>.pdf`` and ``<base>.png`` without dates or version strings (byte-reproducible)."""
    base = Path(base)
    base.parent.mkdir(parents=True, exist_ok=True)
    paths = []
    with figure_style():
        for fmt, metadata in FIXED_METADATA.items():
            path = base.with_name(f"{base.name}.{fmt}")
            fig.savefig(path, format=fmt, metadata=metadata)
            paths.append(path)
    return paths


def wrap(title: str, fig: Figure, size: float = 9) -> str:
    """A title broken into lines that fit the figure's width (about 10 characters per inch at 9 pt)."""
    width = max(24, int(fig.get_figwidth() * 10 * 9 / size))
    return "\n".join(textwrap.fill(line, width) for line in title.split("\n"))


def set_title(fig: Figure, title: str, caption: str | None = None) -> None:
    """The figure's title: the headline with its scale label in front (:func:`labelled_headline`: "SMOKE /
    stand-in — Table I"), and under it, smaller, the tag's details in italics and the ``caption`` (rounds,
    seeds, cells, what bold means)."""
    headline, tag = labelled_headline(title)
    head = wrap(headline, fig)
    subs = [(wrap(text, fig, SUBTITLE_SIZE), style) for text, style in ((tag, "italic"), (caption, "normal"))
            if text]  # fmt: skip
    if not subs:
        fig.suptitle(head)
        return
    # the suptitle (which constrained layout makes room for) holds blank lines where the subtitles go
    blank = sum(text.count("\n") + 1 for text, _ in subs)
    suptitle = fig.suptitle(head + "\n" * blank)
    size = suptitle.get_fontsize()
    top = suptitle.get_position()[1] - (head.count("\n") + 1) * 1.2 * size / 72 / fig.get_figheight()
    for text, style in subs:
        fig.text(0.5, top, text, ha="center", va="top", fontsize=SUBTITLE_SIZE, fontstyle=style)
        top -= (text.count("\n") + 1) * 1.2 * size / 72 / fig.get_figheight()


def _grid(n: int, max_cols: int = 4) -> tuple[int, int]:
    ncols = max(1, min(n, max_cols))
    return math.ceil(n / ncols), ncols


def heatmap(
    df: pd.DataFrame,
    layout: Mapping[str, Any],
    title: str = "",
    order: Mapping[str, Sequence[Any]] | None = None,
    limits: tuple[float, float] | None = (0.0, 100.0),
    coverage: str | None = None,
) -> Figure:
    """Annotated heatmap of the mean accuracy table, one panel per column block; worst cases in bold,
    diverged cells hatched with a dagger; under the title, the rounds, the seeds, ``coverage`` ("9 of 84
    cells run") and what bold means (:func:`table_caption`). ``limits``: the colour scale, 0-100 by default
    (None: the data's range, flagged as a local scale on the colour bar, since a few points of noise would
    look like contrast)."""
    rows, columns, blocks = _layout(layout)
    mean, _, worst, diverged, seeds = _tables(df, layout, order)
    local = limits is None
    groups = _block_groups(mean.columns)
    nr, nc = _grid(len(groups))
    width = max(len(cols) for cols in groups.values())
    if limits is None:
        values = mean.to_numpy(dtype=float)
        lo, hi = (np.nanmin(values), np.nanmax(values)) if np.isfinite(values).any() else (0.0, 100.0)
        limits = (lo, hi) if hi > lo else (lo - 0.5, hi + 0.5)
    norm = matplotlib.colors.Normalize(*limits)
    with figure_style():
        size = (nc * (0.75 * width + 0.8) + 1.6, nr * (0.32 * len(mean) + 1.4) + 0.4)
        fig = Figure(figsize=size, layout="constrained")
        axes = fig.subplots(nr, nc, squeeze=False)
        image = None
        for i, (key, cols) in enumerate(groups.items()):
            ax = axes.flat[i]
            values = mean[cols].to_numpy(dtype=float)
            image = ax.imshow(values, norm=norm, aspect="auto")
            for (r, c), v in np.ndenumerate(values):
                if np.isnan(v):
                    continue
                mark = DIVERGED_MARK if diverged[cols].iat[r, c] else ""
                if mark:
                    cell = matplotlib.patches.Rectangle((c - 0.5, r - 0.5), 1, 1, fill=False, hatch="xxx",
                                                        edgecolor="0.5", lw=0)  # fmt: skip
                    ax.add_patch(cell)
                weight = "bold" if worst[cols].iat[r, c] else "normal"
                colour = "black" if norm(v) > 0.6 else "white"
                ax.text(c, r, f"{v:.1f}{mark}", ha="center", va="center", fontsize=7, color=colour,
                        fontweight=weight)  # fmt: skip
            ax.set_xticks(range(len(cols)), [display_value(columns, c[-1] if blocks else c) for c in cols],
                          rotation=45, ha="right")  # fmt: skip
            row_labels = [display_value(rows, r) for r in mean.index] if i % nc == 0 else []
            ax.set_yticks(range(len(mean)), row_labels)
            if blocks:
                ax.set_title(block_label(blocks, key))
        for ax in axes.flat[len(groups) :]:
            ax.set_visible(False)
        label = "final test accuracy (%)"
        if local:
            label += f"\nLOCAL scale {limits[0]:.1f}-{limits[1]:.1f}, not 0-100"
        fig.colorbar(image, ax=axes, label=label, shrink=0.8)
        if diverged.to_numpy().any():
            label = diverged_legend(seeds, df)
            hatch = matplotlib.patches.Patch(facecolor="white", edgecolor="0.5", hatch="xxx", label=label)
            fig.legend(handles=[hatch], loc="outside lower center", frameon=False, fontsize=7)
        if title:
            set_title(fig, title, table_caption(df, layout, order, coverage))
    return fig


def worst_case_bars(
    df: pd.DataFrame,
    layout: Mapping[str, Any],
    title: str = "",
    order: Mapping[str, Sequence[Any]] | None = None,
    limits: tuple[float, float] = (0.0, 100.0),
    coverage: str | None = None,
) -> Figure:
    """One horizontal bar per row (defense): its worst case, the lowest mean accuracy over the columns
    (attacks; "no attack" excluded), i.e. the value of its bold cell in the table (:func:`worst_case`), one
    panel per column block. Each bar is labelled with its value and the attack that reaches it (a dagger
    where that cell diverged); under the title, the rounds, the seeds and ``coverage`` as on the heatmap.
    ``limits``: the accuracy axis, 0-100 by default."""
    rows, columns, blocks = _layout(layout)
    mean, _, worst, diverged, seeds = _tables(df, layout, order)
    groups = _block_groups(mean.columns)
    nr, nc = _grid(len(groups), max_cols=2)
    with figure_style():
        fig = Figure(figsize=(nc * 3.6 + 1.4, nr * (0.3 * len(mean) + 1.2) + 0.4), layout="constrained")
        axes = fig.subplots(nr, nc, squeeze=False, sharey=True)
        marked = False  # a bar whose worst cell diverged
        for i, (key, cols) in enumerate(groups.items()):
            ax = axes.flat[i]
            cells = worst[cols].to_numpy(dtype=bool) & ~np.isnan(mean[cols].to_numpy(dtype=float))
            heights = np.where(cells, mean[cols].to_numpy(dtype=float), np.inf).min(axis=1)
            heights = np.where(np.isfinite(heights), heights, np.nan)  # a row with no attacked cell run
            ax.barh(range(len(mean)), heights, color=HONEST_COLOUR, height=0.6)
            for r, v in enumerate(heights):
                if np.isnan(v):
                    continue
                c = int(np.argmax(cells[r]))  # the first of tied worst cells
                mark = DIVERGED_MARK if diverged[cols].iat[r, c] else ""
                marked = marked or bool(mark)
                attack = display_value(columns, cols[c][-1] if blocks else cols[c])
                inside = v > limits[0] + 0.7 * (limits[1] - limits[0])  # a long bar holds its own label
                pad = 0.01 * (limits[1] - limits[0]) * (-1 if inside else 1)
                ax.text(v + pad, r, f"{v:.1f}{mark} ({attack})", va="center", fontsize=7,
                        ha="right" if inside else "left", color="white" if inside else "black")  # fmt: skip
            ax.set_yticks(range(len(mean)), [display_value(rows, r) for r in mean.index])
            ax.set_ylim(len(mean) - 0.5, -0.5)  # the table's order, top to bottom
            ax.set_xlim(*limits)
            ax.set_xlabel(f"worst-case final test accuracy (%) over the {columns}s")
            if blocks:
                ax.set_title(block_label(blocks, key))
        for ax in axes.flat[len(groups) :]:
            ax.set_visible(False)
        if marked:
            legend = diverged_legend(seeds, df)
            note = matplotlib.patches.Patch(facecolor="none", edgecolor="none", label=legend)
            fig.legend(handles=[note], loc="outside lower center", frameon=False, fontsize=7)
        if title:
            rounds = rounds_phrase(df)
            head = f"Worst case per {rows}: its lowest final test accuracy (%) over the {columns}s"
            head += f" after {rounds}" if rounds else ""
            caption = f"{head}, {seeds.replace('mean ± std', 'mean')}"  # a bar shows the mean only
            set_title(fig, title, f"{caption}; {coverage}" if coverage else caption)
    return fig


def curves_frame(df: pd.DataFrame) -> pd.DataFrame:
    """Long frame (run index, round, accuracy) from the ``accuracy_curve`` column ([[round, acc%], ...])."""
    records = [
        (i, int(point[0]), float(point[1]))
        for i, curve in df["accuracy_curve"].items()
        if isinstance(curve, list | tuple)
        for point in curve
    ]
    return pd.DataFrame(records, columns=["run", "round", "accuracy"])


PAPER_WIDTH = 7.0  # inches: the text width of a paper page (a two-column paper's figure*)
CURVE_COLUMNS = 3  # panels per row of the accuracy curves


def accuracy_curves(
    df: pd.DataFrame,
    layout: Mapping[str, Any],
    title: str = "",
    order: Mapping[str, Sequence[Any]] | None = None,
    coverage: str | None = None,
) -> Figure:
    """Test accuracy over rounds, mean over seeds: a panel per (block, column value), a line per row value,
    panels in rows of ``CURVE_COLUMNS`` within ``PAPER_WIDTH``. A curve of one point is drawn as a point. A
    run that diverged ends with an ✕ at the round it diverged, at the chance accuracy it is scored with."""
    rows, columns, blocks = _layout(layout)
    cells = summarize(df, layout, order)
    panels = list(dict.fromkeys(zip(*[cells[k] for k in blocks + [columns]], strict=True)))
    row_values = list(dict.fromkeys(cells[rows]))
    points = curves_frame(df)
    if not points.empty:
        points = points.join(df[blocks + [rows, columns]], on="run")
    ends = _diverged_ends(df)
    last_round = max(([] if points.empty else points["round"].tolist()) + ends["round"].dropna().tolist(),
                     default=1)  # fmt: skip
    nr, nc = _grid(len(panels), CURVE_COLUMNS)
    colours = matplotlib.colormaps["tab10"]
    with figure_style():
        fig = Figure(figsize=(PAPER_WIDTH, 1.5 * nr + 1.0), layout="constrained")
        axes = fig.subplots(nr, nc, squeeze=False, sharex=True, sharey=True)
        for ax, panel in zip(axes.flat, panels, strict=False):
            *block_key, column = panel
            name = display_value(columns, column)
            ax.set_title(f"{block_label(blocks, tuple(block_key))}\n{name}" if blocks else name, fontsize=7)
            for j, r in enumerate(row_values):
                style = dict(color=colours(j % 10))
                where = dict(zip(blocks + [columns, rows], [*panel, r], strict=True))
                line = _select(points, where).groupby("round")["accuracy"].mean() if not points.empty else []
                if len(line) == 1:
                    ax.plot(line.index, line.to_numpy(), ls="none", marker="o", ms=4, **style)
                elif len(line):
                    ax.plot(line.index, line.to_numpy(), lw=1.2, marker="o", ms=2.5, **style)
                end = _select(ends, where)
                if len(end):
                    ax.plot(end["round"], end["accuracy"], ls="none", marker="X", ms=6, mec="black", mew=0.5,
                            **style)  # fmt: skip
            ax.set_ylim(0, 100)
            ax.set_xlim(0, last_round * 1.05 + 0.5)
            ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(nbins=4, integer=True))
            ax.grid(alpha=0.3)
        for ax in axes.flat[len(panels) :]:
            ax.set_visible(False)
        for ax in axes[-1]:
            ax.set_xlabel("round")
        for ax in axes[:, 0]:
            ax.set_ylabel("test accuracy (%)")
        drawn = set(points[rows]) if not points.empty else set()
        handles = [matplotlib.lines.Line2D([], [], color=colours(j % 10), marker="o", ms=3,
                                           label=display_value(rows, r))
                   for j, r in enumerate(row_values) if r in drawn or r in set(ends[rows])]  # fmt: skip
        if len(ends):
            handles.append(matplotlib.lines.Line2D([], [], ls="none", marker="X", color="0.5", mec="black",
                                                   mew=0.5, label="diverged (chance accuracy)"))  # fmt: skip
        if handles:
            fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 4),
                       title=field_title(rows), frameon=False)  # fmt: skip
        if title:
            set_title(fig, title, table_caption(df, layout, order, coverage, curves=True))
    return fig


def _select(frame: pd.DataFrame, where: Mapping[str, Any]) -> pd.DataFrame:
    """Rows of ``frame`` whose columns equal ``where``'s values."""
    mask = np.ones(len(frame), dtype=bool)
    for column, value in where.items():
        mask &= (frame[column] == value).to_numpy()
    return frame[mask]


def _diverged_ends(df: pd.DataFrame) -> pd.DataFrame:
    """The diverged runs: their config columns, the round they diverged at (``diverged_at``, else the rounds
    they completed) and the accuracy they are scored with (chance)."""
    if "diverged" not in df.columns:
        return df.iloc[0:0].assign(round=[], accuracy=[])
    runs = df[df["diverged"].fillna(False).astype(bool)]
    at = runs["diverged_at"] if "diverged_at" in runs.columns else pd.Series(np.nan, index=runs.index)
    if "rounds_completed" in runs.columns:
        at = at.fillna(runs["rounds_completed"])
    return runs.assign(round=at.astype(float), accuracy=runs["final_accuracy"].astype(float))


def byzantine_ids(n_byzantine: int) -> list[int]:
    """The Byzantine clients' ids: 0..f-1, the training loop's convention (as in the paper)."""
    return list(range(int(n_byzantine)))


def _as_array(x: Any) -> np.ndarray:
    """Tensor, list or array -> float numpy array (matplotlib's input type)."""
    if hasattr(x, "detach"):
        x = x.detach().to("cpu", torch.float64).numpy()
    return np.asarray(x, dtype=float)


def distance_heatmap(
    D: Any, byzantine_ids: Sequence[int], title: str = "Pairwise squared distances", log: bool = True
) -> Figure:
    """N x N heatmap of squared distances between client updates; Byzantine clients' labels red, "(B)".

    ``log``: a logarithmic colour scale (default), so that honest pairs stay distinguishable when a
    Byzantine update lies orders of magnitude away (FOE ε=100); zeros (the diagonal) take the floor colour.
    """
    D = _as_array(D)
    n = D.shape[0]
    byz = set(int(i) for i in byzantine_ids)
    with figure_style():
        fig = Figure(figsize=(0.32 * n + 2.2, 0.3 * n + 1.4), layout="constrained")
        ax = fig.subplots()
        norm = None
        if log:
            positive = D[np.isfinite(D) & (D > 0)]
            floor = positive.min() if positive.size else 1.0
            norm = matplotlib.colors.LogNorm(vmin=floor, vmax=max(positive.max(initial=floor), floor * 10))
            D = np.where(D > 0, D, floor)
        image = ax.imshow(D, norm=norm, cmap="magma_r")
        labels = [f"{i}{' (B)' if i in byz else ''}" for i in range(n)]
        ax.set_xticks(range(n), labels, rotation=90)
        ax.set_yticks(range(n), labels)
        for tick_labels in (ax.get_xticklabels(), ax.get_yticklabels()):
            for i, label in enumerate(tick_labels):
                if i in byz:
                    label.set_color(BYZANTINE_COLOUR)
                    label.set_fontweight("bold")
        ax.set_xlabel("client")
        ax.set_ylabel("client")
        fig.colorbar(image, ax=ax, label="squared distance" + (" (log scale)" if log else ""))
        set_title(fig, title)
    return fig


SCORE_PANELS = ("proximity", "dissimilarity", "composite")


def score_bars(scores: Any, byzantine_ids: Sequence[int], title: str = "ProDiGy scores per client") -> Figure:
    """Bars of ProDiGy's proximity, dissimilarity and composite scores per client (``ProDiGy(f).scores(G)``
    or a mapping with those keys). Byzantine clients in red; clients given weight 0 (not kept) hatched; a
    score of exactly 0 (no bar to see) is marked by a triangle on the axis in the client's colour."""
    fields = dict(scores) if isinstance(scores, Mapping) else scores._asdict()
    weight = fields.get("weight")
    kept = _as_array(weight) > 0 if weight is not None else None
    byz = set(int(i) for i in byzantine_ids)
    with figure_style():
        fig = Figure(figsize=(9.0, 2.6), layout="constrained")
        axes = fig.subplots(1, len(SCORE_PANELS))
        for ax, name in zip(axes, SCORE_PANELS, strict=True):
            values = _as_array(fields[name])
            n = len(values)
            colours = [BYZANTINE_COLOUR if i in byz else HONEST_COLOUR for i in range(n)]
            bars = ax.bar(range(n), values, color=colours)
            zeros = [i for i in range(n) if values[i] == 0]
            if zeros:
                ax.scatter(zeros, [0.0] * len(zeros), marker="^", s=30, c=[colours[i] for i in zeros],
                           edgecolors="black", linewidths=0.5, zorder=3, clip_on=False)  # fmt: skip
            if kept is not None:
                for bar, keep in zip(bars, kept, strict=True):
                    if not keep:
                        bar.set_hatch("///")
                        bar.set_edgecolor("black")
            ax.set_title(name)
            ax.set_xticks(range(n), [str(i) for i in range(n)])
            ax.set_xlabel("client")
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
        handles = [matplotlib.patches.Patch(color=HONEST_COLOUR, label="honest"),
                   matplotlib.patches.Patch(color=BYZANTINE_COLOUR, label="Byzantine")]  # fmt: skip
        if kept is not None:
            zeroed = matplotlib.patches.Patch(
                facecolor="white", edgecolor="black", hatch="///", label="weight 0"
            )
            handles.append(zeroed)
        fig.legend(handles=handles, loc="outside right center")
        set_title(fig, title)
    return fig


def search_symbol(attack: str) -> str:
    """The symbol of an attack's searched parameter (``Attack.symbol``: ALIE's z), "parameter" if unknown."""
    try:
        return ATTACKS.lookup(split_label(attack)[0]).cls.symbol
    except (ValueError, AttributeError):
        return "parameter"


def format_parameter(value: Any) -> str:
    """An attack parameter for labels: 3 significant digits, element-wise for ALIE-spread's (z, ρ) pairs."""
    if isinstance(value, list | tuple):
        return "(" + ", ".join(format_parameter(v) for v in value) + ")"
    return f"{value:.3g}" if isinstance(value, int | float) else str(value)


# A damage below ABOUT_ZERO x the scale (the honest mean's norm) is float noise: the aggregate is the honest
# mean; damages within TIED x the largest of one another differ by rounding only. Either way no candidate is
# more damaging than another, and a plot of them would draw noise.
ABOUT_ZERO, TIED = 1e-5, 1e-6


def flat_damage(search: Sequence[tuple[Any, float]], scale: float | None = None) -> str | None:
    """A sentence for a search whose damages are all about 0 against ``scale`` (the explorer passes the honest
    mean's norm) or tie within rounding; None when they differ or there is no search."""
    damage = [d for _, d in search]
    if not damage or not all(math.isfinite(d) for d in damage):
        return None
    top = max(abs(d) for d in damage)
    if scale is not None and math.isfinite(scale) and top <= ABOUT_ZERO * scale:
        return "damage about 0 for every candidate (the defense removes the attack; no candidate chosen)"
    if max(damage) - min(damage) <= TIED * top:
        return f"damage {top:.3g} for every candidate (equal within rounding; no candidate chosen)"
    return None


def damage_plot(
    search: Sequence[tuple[Any, float]],
    attack: str,
    title: str | None = None,
    defense: str | None = None,
    scale: float | None = None,
) -> Figure:
    """Damage (distance of the aggregate to the honest mean) against the attack's candidate parameter,
    from ``attack.last_search``, under ``defense``; the chosen (most damaging) candidate is marked. The axes
    print plain numbers (no offset: a flat curve must not look steep). Damages that tie within rounding
    (`flat_damage`, against ``scale``) and an attack without a search are a sentence, not empty or noisy
    axes."""
    symbol = search_symbol(attack)
    against = f" against {display_value('defense', defense)}" if defense else ""
    title = title or f"Damage of {display_value('attack', attack)} per candidate{against}"
    flat = flat_damage(search, scale)
    with figure_style():
        if not search or flat is not None:
            fig = Figure(figsize=(4.2, 1.0), layout="constrained")
            ax = fig.subplots()
            ax.set_axis_off()
            what = flat if search else f"{display_value('attack', attack)} has no parameter search"
            ax.text(0.5, 0.5, wrap(what[0].upper() + what[1:], fig), ha="center", va="center",
                    transform=ax.transAxes)  # fmt: skip
            fig.suptitle(wrap(title, fig))
            return fig
        fig = Figure(figsize=(4.2, 2.8), layout="constrained")
        ax = fig.subplots()
        params, damage = zip(*search, strict=True)
        numeric = all(isinstance(p, int | float) for p in params)  # alie_spread's are (z, rho) pairs
        x = list(params) if numeric else list(range(len(params)))
        y = [d if math.isfinite(d) else np.nan for d in damage]  # an infinite damage is not drawable
        best = max(range(len(damage)), key=damage.__getitem__)  # the first maximum, as the attack picks
        ax.plot(x, y, marker="o", color=HONEST_COLOUR)
        label = f"chosen: {symbol} = {format_parameter(params[best])}"
        ax.plot([x[best]], [y[best]], marker="*", ms=14, color=BYZANTINE_COLOUR, ls="none", label=label)
        if not numeric:
            ax.set_xticks(x, [format_parameter(p) for p in params], rotation=90)
        ax.legend()
        for axis in (ax.xaxis, ax.yaxis):
            if isinstance(axis.get_major_formatter(), matplotlib.ticker.ScalarFormatter):
                axis.set_major_formatter(matplotlib.ticker.ScalarFormatter(useOffset=False))
        ax.set_xlabel(f"candidate {symbol}")
        ax.set_ylabel("‖aggregate − honest mean‖")
        ax.set_title(wrap(title, fig))
        ax.grid(alpha=0.3)
    return fig


# ---------------------------------------------------------------------------------------------- files


def stand_in_of(experiment: Any, df: pd.DataFrame | None = None) -> str | None:
    """The stand-in data set description of an experiment or of its runs (None: the real data)."""
    if getattr(experiment, "stand_in", None):
        return str(experiment.stand_in)
    if df is not None and "stand_in" in df.columns:
        values = [v for v in df["stand_in"].tolist() if isinstance(v, str) and v]
        if values:
            return values[0]
    return None


def is_smoke(experiment: Any, df: pd.DataFrame | None = None) -> bool:
    """Smoke scale or stand-in data: such outputs are never mistaken for paper-scale results."""
    return bool(getattr(experiment, "smoke", False)) or stand_in_of(experiment, df) is not None


def output_dir(smoke: bool, out_dir: str | Path | None = None, mini: bool = False) -> Path:
    """Folder for an experiment's figures: ``out_dir`` (default ``paths.figures_dir()``: env
    PRODIGY_FIGURES_DIR, else <project folder>/outputs), or its smoke/ or mini/ subfolder."""
    from prodigy_core import paths

    base = Path(out_dir) if out_dir is not None else paths.figures_dir()
    return base / SMOKE_SUBDIR if smoke else base / MINI_SUBDIR if mini else base


def variants_of(experiment: Any, df: pd.DataFrame | None = None) -> list[str]:
    """The variants (``paper``, ``authors``) of an experiment's grid, else of its runs; ["paper"] if neither
    says."""
    from prodigy_core.results import variants_in

    configs = getattr(experiment, "configs", None) or []
    found = list(dict.fromkeys(c.variant for c in configs if hasattr(c, "variant")))
    return found or (variants_in(df) if df is not None else []) or ["paper"]


def report_title(experiment: Any, df: pd.DataFrame | None = None) -> str:
    """The experiment's title, the variant(s) it ran under, its precision when not fp32 ("precision: bf16"),
    its data when it is real CIFAR-10 or FEMNIST ("data: CIFAR-10 (JPEG copy)"), and the smoke/stand-in
    label where it applies."""
    from prodigy_core.data import DIGITS_SOURCE, FEMNIST_SOURCE_PREFIX, source_label
    from prodigy_core.results import data_source_of, precisions_in

    title = getattr(experiment, "title", None) or experiment.name
    about = [f"variant: {', '.join(variants_of(experiment, df))}"]
    precisions = precisions_in(df) if df is not None else []
    if precisions and precisions != ["fp32"]:  # fp32, the default, is not named (the committed titles)
        about.append(f"precision: {', '.join(precisions)}")
    source = data_source_of(df)
    if source is not None and source.startswith(FEMNIST_SOURCE_PREFIX):
        about.append(f"data: {femnist_label(source, df)}")
    elif source is not None and source != DIGITS_SOURCE:
        about.append(f"data: {source_label(source)}")
    headline, tag = split_title(title)  # the scale tag stays last, where split_title finds it
    title = join_title(f"{headline} ({'; '.join(about)})", tag)
    if not is_smoke(experiment, df) or "SMOKE" in title:  # smoke_profile already labels its titles
        return title
    stand_in = stand_in_of(experiment, df)
    return f"{title} [{SMOKE_LABEL}{': ' + stand_in if stand_in else ''}]"


def femnist_label(source: str, df: pd.DataFrame | None = None) -> str:
    """A FEMNIST data source in words: "FEMNIST, 20 LEAF writers (writer set cb412b880d2f)"."""
    from prodigy_core.data import FEMNIST_SOURCE_PREFIX

    counts = (
        sorted({int(n) for n in df["n_clients"].tolist()}) if df is not None and "n_clients" in df else []
    )
    writers = "-".join(map(str, counts[:: max(1, len(counts) - 1)])) if counts else "the"
    return f"FEMNIST, {writers} LEAF writers (writer set {source.removeprefix(FEMNIST_SOURCE_PREFIX)})"


def _row(config: Any) -> dict[str, Any]:
    """A run's fields as its results-frame row holds them (`config.as_row`)."""
    if hasattr(config, "to_dict"):
        return as_row(config.to_dict())
    return as_row(dict(config) if isinstance(config, Mapping) else vars(config))


def grid_coverage(experiment: Any, df: pd.DataFrame, layout: Mapping[str, Any]) -> str | None:
    """ "9 of 84 cells run" when the runs cover only part of the experiment's grid (table cells: the layout's
    blocks x rows x columns); None when they cover it all or the grid is unknown."""
    rows, columns, blocks = _layout(layout)
    keys = blocks + [rows, columns]
    configs = getattr(experiment, "configs", None) or []
    if not configs or any(k not in df.columns for k in keys):
        return None
    grid = {tuple(_row(c).get(k) for k in keys) for c in configs}
    ran = {tuple(row) for row in df[keys].itertuples(index=False)} & grid
    return None if len(ran) >= len(grid) else f"{len(ran)} of {len(grid)} cells run"


def grid_order(experiment: Any) -> dict[str, list[Any]]:
    """Order of each field's values as the params file lists them (rows and columns follow the grid)."""
    configs = getattr(experiment, "configs", None) or []
    if not configs:
        return {}
    dicts = [_row(c) for c in configs]
    return {k: list(dict.fromkeys(d[k] for d in dicts if not isinstance(d[k], list))) for k in dicts[0]}


def _ran_without_attack(comparisons: Mapping[str, pd.DataFrame]) -> bool:
    """Whether a no-attack cell of ours sits beside the paper's: then at the table's f (a cell matches the
    paper's setting, f included), and NO_ATTACK_NOTE says what that means."""
    return any(((c["attack"] == NO_ATTACK) & c["ours"].notna()).any() for c in comparisons.values())


def diverged_cells_note(cells: list[str]) -> str:
    """The line naming the `cells` whose every run diverged, which `results.paper_agreement` never counts
    within its points of the paper."""
    from prodigy_core.results import WITHIN_POINTS

    return (f"Never counted within {WITHIN_POINTS:g} points, however near: the {len(cells)} cell(s) whose "
            f"every run diverged (a diverged run scores by a convention): {'; '.join(cells)}.")  # fmt: skip


def paper_comparison_markdown(comparison: pd.DataFrame | Mapping[str, pd.DataFrame], title: str) -> str:
    """``results.compare_with_paper`` as Markdown, one frame or one per variant ({variant: frame}).

    One variant: the setting columns that vary, then ours, paper, delta and the worst-case flags, headed by
    the variant, the cells run, the mean absolute delta, the cells within 3 points and the worst-case
    agreement over defense rows. Several: paper | ours (paper) | ours (authors) side by side, headed by a
    table of those numbers per variant."""
    from prodigy_core.results import WITHIN_POINTS, paper_agreement

    comparisons = {comparison["variant"].iloc[0] if "variant" in comparison and len(comparison) else "paper":
                   comparison} if isinstance(comparison, pd.DataFrame) else dict(comparison)  # fmt: skip
    first = next(iter(comparisons.values()))
    setting = list(first.columns[: first.columns.get_loc("attack")])  # ... defense: one table row
    varying = [c for c in setting if first[c].nunique(dropna=False) > 1]
    stats = {v: paper_agreement(c) for v, c in comparisons.items()}
    if len(comparisons) == 1:
        ((variant, only),) = comparisons.items()
        a = stats[variant]
        frame = only.drop(columns=[c for c in setting if c not in varying] + ["variant"], errors="ignore")
        summary = [f"Variant: {variant}.", f"Cells run: {a['cells_run']} of {a['cells']}."]
        if a["cells_run"]:
            summary.append(f"Mean |ours - paper|: {a['mean_abs_delta']:.2f} points.")
            summary.append(
                f"Within {WITHIN_POINTS:g} points of the paper: {a['within']} of {a['cells_run']} cells."
            )
        if a["diverged"]:
            summary.append(diverged_cells_note(a["diverged"]))
        if a["worst_case_rows"]:
            agree, rows = a["worst_case_agree"], a["worst_case_rows"]
            summary.append(f"Worst-case attack agrees with the paper's on {agree} of {rows} rows.")
        else:
            summary.append(f"Worst-case attack: {NOT_ENOUGH_CELLS}.")
        if _ran_without_attack(comparisons):
            summary.append(NO_ATTACK_NOTE)
        return "\n".join([f"# {title}", "", *summary, "", frame_to_markdown(frame)])
    per_variant = pd.DataFrame(
        {"variant": list(stats),
         "cells run": [f"{a['cells_run']} of {a['cells']}" for a in stats.values()],
         "mean abs(ours - paper)": [a["mean_abs_delta"] for a in stats.values()],
         f"within {WITHIN_POINTS:g} points": [f"{a['within']} of {a['cells_run']}" if a["cells_run"]
                                              else "no cells run" for a in stats.values()],
         "diverged cells": [len(a["diverged"]) for a in stats.values()],
         "worst case agrees (rows)": [f"{a['worst_case_agree']} of {a['worst_case_rows']}"
                                      if a["worst_case_rows"] else NOT_ENOUGH_CELLS for a in stats.values()]}
    )  # fmt: skip
    side = first[list(dict.fromkeys([*varying, "defense", "attack", "paper"]))].copy()
    for variant, c in comparisons.items():
        side[f"ours ({variant})"] = c["ours"].to_numpy()
    for variant, c in comparisons.items():
        side[f"delta ({variant})"] = c["delta"].to_numpy()
    body = ["Which variant matches the paper (paper: the text; authors: the authors' code):", "",
            frame_to_markdown(per_variant), "", frame_to_markdown(side)]  # fmt: skip
    if _ran_without_attack(comparisons):
        body[0:0] = [NO_ATTACK_NOTE, ""]
    return "\n".join([f"# {title}", "", *body])


DETECTION_HEADING = "ProDiGy detection"  # a report's detection section: "## ProDiGy detection[ (variant)]"
# Detection's columns say "detection" ("precision" alone is a run's numeric precision: fp32, tf32, bf16).
DETECTION_COLUMNS = {"detection_precision": "detection precision", "detection_recall": "detection recall"}
NO_ATTACK_RATE = "no-attack rate"
DETECTION_VALUES = (*DETECTION_COLUMNS.values(), NO_ATTACK_RATE)


def detection_frame(df: pd.DataFrame) -> pd.DataFrame:
    """ProDiGy's detection per attacked run, beside the no-attack rate of the same split and seed: one row
    per run with a detection precision and an attack, its setting columns that vary, ``detection
    precision``, ``detection recall`` and ``no-attack rate``, the detection precision of the run with the
    same config and attack none (the share of its zeroed clients that are ids 0..f-1 although nobody
    attacks: what the split alone gives; NaN, shown "n/a", when that run is not in ``df`` or zeroed
    nobody). Empty when no run has a detection precision."""
    from prodigy_core.config import RunConfig, field_names

    if "detection_precision" not in df.columns:
        return pd.DataFrame()
    setting = [c for c in field_names() if c in df.columns and c not in RunConfig.NON_RESULT_FIELDS
               and c not in ("attack", "attack_params")]  # fmt: skip

    def same_split(row: pd.Series) -> tuple[str, ...]:
        return tuple(str(row[c]) for c in setting)

    measured = df[df["detection_precision"].notna()]
    attacked = measured[measured["attack"] != NO_ATTACK]
    baseline = {same_split(row): row["detection_precision"] for _, row in
                measured[measured["attack"] == NO_ATTACK].iterrows()}  # fmt: skip
    if attacked.empty:
        return pd.DataFrame()
    varying = [c for c in setting if c not in ("defense", "seed") and df[c].astype(str).nunique() > 1]
    # a column no record has (an older record with a precision and no recall): NaN, shown as such
    frame = attacked.reindex(columns=[*varying, "defense", "attack", "seed", *DETECTION_COLUMNS])
    frame = frame.rename(columns=DETECTION_COLUMNS)
    frame[NO_ATTACK_RATE] = [baseline.get(same_split(row), math.nan) for _, row in attacked.iterrows()]
    return frame.reset_index(drop=True)


def detection_markdown(df: pd.DataFrame, heading: str = DETECTION_HEADING) -> str:
    """`detection_frame` as a Markdown section headed by what the columns mean ("" when no run has one)."""
    frame = detection_frame(df)
    if frame.empty:
        return ""
    rates = frame[NO_ATTACK_RATE]
    frame[NO_ATTACK_RATE] = ["n/a" if math.isnan(v) else format(v, ".2f") for v in rates]
    legend = (
        "Detection precision: share of the zeroed clients that are Byzantine (ids 0..f-1), over all rounds; "
        "detection recall: share of the Byzantine clients zeroed, over all rounds; no-attack rate: the "
        "detection precision of the run with the same split and seed and no attack (the split's own "
        "outliers; n/a: that run is not stored or zeroed nobody)."
    )
    return "\n".join([f"## {heading}", "", legend, "", frame_to_markdown(frame)])


# Where no defense row has every attack of the paper's row run, there is no worst case to compare.
NOT_ENOUGH_CELLS = "not enough cells (no defense row has all its attacks run)"
# Under every comparison with a no-attack column (scripts/no_attack_f0.py gives the evidence).
NO_ATTACK_NOTE = (
    "No attack: the paper's cells look like runs with f = 0 (every NNM rule then the average, ProDiGy "
    "zeroing nobody); ours keep the table's f, whose honest 'Byzantine' clients the robust rules still "
    'discount (docs/results.md, "The paper\'s no-attack column").'
)
PROVENANCE = re.compile(r"<!-- provenance: (.*?) -->")


def code_hash() -> str:
    """sha256 (12 hex digits) of the package's files (prodigy_core/**, line endings normalised): which code
    wrote a table."""
    root = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes().replace(b"\r\n", b"\n") + b"\0")
    return digest.hexdigest()[:12]


def provenance(experiment: Any) -> str:
    """What produced an experiment's report: its runs (a hash of their result keys, which hash every
    resolved config field) and the code (:func:`code_hash`). Written into the Markdown and LaTeX tables, and
    checked for the committed quickstart table by tests/test_report.py."""
    keys = sorted(c.key() for c in getattr(experiment, "configs", None) or [])
    runs = hashlib.sha256("\n".join(keys).encode()).hexdigest()[:12]
    return f"runs {runs} ({len(keys)} in the grid), code {code_hash()}"


def pipe_tables(markdown: str) -> Iterator[tuple[list[str], list[list[str]]]]:
    """Every pipe table of a Markdown text, in order: (its header's cells, its rows' cells), the separator
    row left out; a table ends at the first line that is not a table row."""
    header: list[str] = []
    rows: list[list[str]] = []
    for line in [*markdown.splitlines(), ""]:
        if not line.startswith("|"):
            if header:
                yield header, rows
            header, rows = [], []
            continue
        parts = [p.strip() for p in line.strip("|").split("|")]
        if not header:
            header = parts
        elif not re.fullmatch(r":?-+:?", parts[0]):
            rows.append(parts)


def markdown_cells(markdown: str) -> dict[tuple[str, str], str]:
    """{(row, column): cell text} of every pipe table in a Markdown report written by :func:`to_markdown`
    (a later table's cell replaces an earlier one of the same labels)."""
    table: dict[tuple[str, str], str] = {}
    for header, rows in pipe_tables(markdown):
        for parts in rows:
            table.update({(parts[0], col): text for col, text in zip(header[1:], parts[1:], strict=False)})
    return table


CELL_NUMBERS = re.compile(r"(-?\d+(?:\.\d+)?)(?:\s*±\s*(\d+(?:\.\d+)?))?")
WITHIN_STD = 2  # a cell "agrees" with a reference mean ± std when |x - mean| <= WITHIN_STD * std
SEED_NOTE = (
    "A single seed moves: each seed draws its own Dirichlet split and initial model (the ± is how far seeds "
    "0-2 spread), and a last-bit difference (another CPU kernel, thread count or torch version) can move a "
    "cell by as much, since the attacks' line search picks among candidates by their damage. Digit for "
    "digit, seed 0 reproduces the committed one-seed table only on the same CPU type (the records' "
    "`cpu_capability`), torch and one thread per run."
)


def parse_cell(text: str) -> tuple[float, float | None] | None:
    """A table cell's numbers: "**59.24 ± 7.85**" -> (59.24, 7.85), "10.00†" -> (10.0, None); None when
    it has none ("–")."""
    m = CELL_NUMBERS.search(text)
    if m is None:
        return None
    return float(m[1]), None if m[2] is None else float(m[2])


def split_detection(markdown: str) -> tuple[str, str]:
    """A report's accuracy part and its detection section (`DETECTION_HEADING` on, "" when it has none)."""
    m = re.search(rf"^## {DETECTION_HEADING}", markdown, flags=re.MULTILINE)
    return (markdown, "") if m is None else (markdown[: m.start()], markdown[m.start() :])


def _within(x: float, mean: float, std: float, digits: int) -> bool:
    """|x - mean| <= WITHIN_STD std, the last printed digit counting as rounding (+ 10**-digits)."""
    return abs(x - mean) <= WITHIN_STD * std + 10**-digits


def compare_with_reference(markdown: str, reference: str, digits: int = 2) -> tuple[str, int, int]:
    """Each accuracy cell of the Markdown table `markdown` (one seed) against the same cell of `reference`
    (mean ± std over seeds, as `to_markdown` writes both): a Markdown table of "x (mean ± std)", the cells
    further than WITHIN_STD std from their mean in bold, then a line counting the cells within and
    `SEED_NOTE`. Only the accuracy table is compared: a detection section (`split_detection`) is
    `compare_detection_with_reference`'s. Returns (that text, cells within, cells compared); (a sentence,
    0, 0) when no cell is in both. The last digit counts as rounding: |x - mean| <= 2 std + 10**-digits.
    One table each: the blocks of a blocked report repeat their labels (compare one block at a time)."""
    for text in (markdown, reference):
        blocks = len(list(pipe_tables(split_detection(text)[0])))
        if blocks > 1:
            raise ValueError(f"a report of {blocks} blocks: compare one block's table at a time")
    ours = markdown_cells(split_detection(markdown)[0])
    theirs = markdown_cells(split_detection(reference)[0])
    rows, columns = list(dict.fromkeys(r for r, _ in theirs)), list(dict.fromkeys(c for _, c in theirs))
    lines, within, compared = [], 0, 0
    for row in rows:
        cells = []
        for column in columns:
            x, ref = parse_cell(ours.get((row, column), "")), parse_cell(theirs.get((row, column), ""))
            if x is None or ref is None:
                cells.append("–")
                continue
            mean, std = ref[0], ref[1] or 0.0
            ok = _within(x[0], mean, std, digits)
            within, compared = within + ok, compared + 1
            text = f"{x[0]:.{digits}f} ({mean:.{digits}f} ± {std:.{digits}f})"
            cells.append(text if ok else f"**{text}**")
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    if not compared:
        return "no cell of this table is in the reference table: nothing to compare", 0, 0
    header = ["| | " + " | ".join(columns) + " |", "|:---|" + "---:|" * len(columns)]
    summary = (
        f"{within} of {compared} accuracy cells lie within {WITHIN_STD} std of the reference mean (bold: "
        "outside). " + SEED_NOTE
    )
    return "\n".join(header + lines + ["", summary]), within, compared


# Tables written before the detection columns said "detection" (read as today's names).
_OLD_DETECTION_COLUMNS = {"precision": "detection precision", "recall": "detection recall"}


def detection_rows(markdown: str) -> list[dict[str, str]]:
    """The rows of a report's detection table ({column: cell text}; [] when it has no detection section)."""
    for header, rows in pipe_tables(split_detection(markdown)[1]):
        header = [_OLD_DETECTION_COLUMNS.get(p, p) for p in header]
        return [dict(zip(header, parts, strict=False)) for parts in rows]
    return []


def compare_detection_with_reference(markdown: str, reference: str, digits: int = 2) -> tuple[str, int, int]:
    """ProDiGy's detection of `markdown` (one seed) against `reference`'s (`detection_rows`, several
    seeds): for each of our rows, its detection precision, detection recall and no-attack rate beside the
    mean ± std (population) over the reference's seeds of the same run but for the seed, bold when further
    than WITHIN_STD std (+ 10**-digits). Returns (a Markdown table and a line counting the values within,
    values within, values compared); (a sentence, 0, 0) when no run is in both."""
    theirs: dict[tuple[str, ...], dict[str, list[float]]] = {}
    for row in detection_rows(reference):
        key = tuple(v for c, v in row.items() if c != "seed" and c not in DETECTION_VALUES)
        for column in DETECTION_VALUES:
            cell = parse_cell(row.get(column, ""))
            if cell is not None:
                theirs.setdefault(key, {}).setdefault(column, []).append(cell[0])
    lines, within, compared = [], 0, 0
    header: list[str] = []
    for row in detection_rows(markdown):
        labels = {c: v for c, v in row.items() if c not in DETECTION_VALUES}
        key = tuple(v for c, v in labels.items() if c != "seed")
        if key not in theirs:
            continue
        header = header or [*labels, *DETECTION_VALUES]
        cells = []
        for column in DETECTION_VALUES:
            x, values = parse_cell(row.get(column, "")), theirs[key].get(column)
            if x is None or not values:
                cells.append("–")
                continue
            mean, std = float(np.mean(values)), float(np.std(values))
            ok = _within(x[0], mean, std, digits)
            within, compared = within + ok, compared + 1
            text = f"{x[0]:.{digits}f} ({mean:.{digits}f} ± {std:.{digits}f})"
            cells.append(text if ok else f"**{text}**")
        lines.append("| " + " | ".join([*labels.values(), *cells]) + " |")
    if not compared:
        return "no detection row of this table is in the reference table: nothing to compare", 0, 0
    table = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *lines]
    summary = (
        f"{within} of {compared} detection values lie within {WITHIN_STD} std of the reference mean over "
        "its seeds (bold: outside)."
    )
    return "\n".join([*table, "", summary]), within, compared


def read_provenance(text: str) -> str | None:
    """The provenance written into a Markdown table by :func:`write_report` (None when it has none)."""
    m = PROVENANCE.search(text)
    return m[1] if m else None


# What a table's last digits depend on besides its runs and code: the records' `environment` fields that
# pick the kernels and their order (training._environment). A table names them under its provenance, and a
# digit-for-digit check is meaningful only where they match (scripts/check_committed_quickstart.py).
# The engine and the group size (runs stacked in one step, `groups`) are out of the key, as they change
# rounding only, and in this line.
MACHINE_FIELDS = ("device", "cpu_capability", "torch", "threads", "engine", "group_size")
MACHINE_DEFAULTS = {"group_size": 1}  # a run trained alone records none
MACHINE = re.compile(r"<!-- trained on: (.*?) -->")


def machine(df: pd.DataFrame) -> dict[str, str]:
    """{field: value} of MACHINE_FIELDS over a results frame's runs (its ``env_*`` columns); several values of
    one field are joined by "/", a field no record has is "unknown" (`MACHINE_DEFAULTS` where it has one)."""
    found = {}
    for name in MACHINE_FIELDS:
        column = df.get(f"env_{name}", pd.Series([None] * len(df), dtype=object))
        if name in MACHINE_DEFAULTS:
            column = column.astype(object).where(column.notna(), MACHINE_DEFAULTS[name])
        values = sorted({str(int(v)) if isinstance(v, float) and v.is_integer() else str(v)
                         for v in column.dropna()})  # fmt: skip
        found[name] = "/".join(values) if values else "unknown"
    return found


def machine_line(found: Mapping[str, str]) -> str:
    """``device=cpu, cpu_capability=AVX2, torch=2.14.1, threads=1``: :func:`machine` as one line."""
    return ", ".join(f"{k}={v}" for k, v in found.items())


def read_machine(text: str) -> dict[str, str] | None:
    """The machine a Markdown table names under its provenance (:func:`machine`), None when it names none."""
    m = MACHINE.search(text)
    if m is None:
        return None
    return dict(part.split("=", 1) for part in m[1].split(", ") if "=" in part)


# What a layout's `figures` list may name (`names.FIGURES`, checked at load); heatmap and curves by default.
# "distances": one distance heatmap per run and recorded round (`record_distances_at`), named <name> when
# there is just one.
DEFAULT_FIGURES = ("heatmap", "curves")


def write_report(
    experiment: Any,
    df: pd.DataFrame,
    out_dir: str | Path | None = None,
    results_dir: str | os.PathLike | None = None,
) -> list[Path]:
    """Write an experiment's table (``<name>.md``, ``.tex``), heatmap (``.pdf``, ``.png``), accuracy curves
    (``<name>_curves.pdf``/``.png``) and, for a paper table at mini or paper scale, ``<name>_vs_paper.md``.

    ``<name>_vs_paper.md`` compares each variant of ``df`` and, when ``experiment`` can (an `Experiment`),
    the stored runs of the same grid under the other variant (from ``results_dir``): with both, paper |
    ours (paper) | ours (authors) side by side.

    Smoke-scale or stand-in results go to ``<out_dir>/smoke/``, mini-scale ones to ``<out_dir>/mini/`` (their
    side-by-side with the paper matches cells without the rounds), and say so in every title.

    One report per precision of ``df`` (`results.precisions_in`): a cell never averages over precisions,
    and a report other than fp32's says its precision in every title and file name (``<name>_bf16.md``,
    ``<name>_bf16_vs_paper.md``, ...), so it never overwrites fp32's.

    The parts: `write_tables` (under `table_note`), `write_figures`, `write_paper_comparison`.
    """
    from prodigy_core.results import precisions_in

    precisions = precisions_in(df)
    if len(precisions) > 1:
        column = df["precision"].fillna("fp32")
        parts = [df[column == precision] for precision in precisions]
        return [path for part in parts for path in write_report(experiment, part, out_dir, results_dir)]
    precision = precisions[0] if precisions else "fp32"
    smoke = is_smoke(experiment, df)
    mini = bool(getattr(experiment, "mini", False)) and not smoke
    folder = output_dir(smoke, out_dir, mini=mini)
    folder.mkdir(parents=True, exist_ok=True)
    layout = getattr(experiment, "report", None) or {}
    coverage = grid_coverage(experiment, df, layout)
    name = report_name(experiment.name, precision)
    page = Page(name, df, folder, layout, report_title(experiment, df), grid_order(experiment))
    note = table_note(df, coverage, smoke=smoke, mini=mini)
    paths = write_tables(page, note, provenance(experiment), machine_line(machine(df)))
    paths += write_figures(page, coverage)
    if getattr(experiment, "paper_table", None) and not smoke:
        comparison = write_paper_comparison(experiment, df, folder, results_dir, mini, precision)
        paths.append(comparison)
    return paths


def report_name(name: str, precision: str = "fp32") -> str:
    """The file name (without suffix) of an experiment's report at a precision: fp32's is the experiment's
    name, another's carries it ("quickstart_digits_bf16")."""
    return name if precision == "fp32" else f"{name}_{precision}"


def table_note(df: pd.DataFrame, coverage: str | None, smoke: bool = False, mini: bool = False) -> str:
    """The line under the table: the runs and seeds, the grid's coverage when partial, the scale's label."""
    seeds = sorted(set(df["seed"].tolist())) if "seed" in df.columns else []
    runs = f"{len(df)} run{'s' * (len(df) != 1)}"
    note = f"{runs}, seed{'s' * (len(seeds) != 1)} {', '.join(map(str, seeds))}." if seeds else f"{runs}."
    if coverage:
        note += f" {coverage[0].upper()}{coverage[1:]} (the grid's other cells have no stored run)."
    if smoke:
        note = f"**{SMOKE_LABEL}**: tiny scale, not comparable with the paper. " + note
    elif mini:
        note = f"**{MINI_LABEL}**: the paper's settings with fewer rounds and one seed. " + note
    return note


class Page(NamedTuple):
    """What a report's tables and figures share: the experiment's name, its results, the folder they go
    to, the layout (rows, columns, blocks, figures), the title and the grid's order of values."""

    name: str
    df: pd.DataFrame
    folder: Path
    layout: Mapping[str, Any]
    title: str
    order: Mapping[str, Sequence[Any]]


def write_tables(page: Page, note: str, made_by: str, trained_on: str) -> list[Path]:
    """The table as ``<folder>/<name>.md`` (with `note`) and ``.tex``, each with the provenance `made_by`
    and the machine `trained_on` (:func:`machine_line`) under it."""
    df, layout, title, order = page.df, page.layout, page.title, page.order
    paths = [page.folder / f"{page.name}.md", page.folder / f"{page.name}.tex"]
    markdown = to_markdown(df, layout, title, order, note=note)
    detection = detection_markdown(df)
    markdown += f"\n{detection}" if detection else ""
    comments = f"<!-- provenance: {made_by} -->\n<!-- trained on: {trained_on} -->\n"
    paths[0].write_text(f"{markdown}\n{comments}", encoding="utf-8")
    latex = to_latex(df, layout, title, order, label=f"tab:{page.name}")
    paths[1].write_text(f"% provenance: {made_by}\n% trained on: {trained_on}\n{latex}", encoding="utf-8")
    return paths


def write_figures(page: Page, coverage: str | None = None) -> list[Path]:
    """The layout's figures (DEFAULT_FIGURES when it names none) as ``.pdf`` and ``.png`` in `folder`: the
    heatmap ``<name>``, the accuracy curves ``<name>_curves`` and, for `distances`, each recorded distance
    matrix (``<name>``, or ``<name>_<key>_round<r>`` when there are several)."""
    name, df, folder, layout, title, order = page
    figures = layout.get("figures") or DEFAULT_FIGURES
    unknown = sorted(set(figures) - set(FIGURES))
    if unknown:
        raise ValueError(f"report.figures: unknown {unknown}; valid: {', '.join(FIGURES)}")
    paths: list[Path] = []
    if "heatmap" in figures:  # 0-100 at every scale: smoke's few points of noise must not look like contrast
        paths += save_figure(heatmap(df, layout, title, order, coverage=coverage), folder / name)
    if "curves" in figures and "accuracy_curve" in df.columns:
        curves = accuracy_curves(df, layout, title, order, coverage=coverage)
        paths += save_figure(curves, folder / f"{name}_curves")
    if "distances" in figures and "distance_matrices" in df.columns:
        recorded = [
            (i, int(r), D)
            for i, matrices in df["distance_matrices"].items()
            if isinstance(matrices, dict)
            for r, D in sorted(matrices.items(), key=lambda item: int(item[0]))
        ]
        for i, r, D in recorded:
            run = df.loc[i]
            base = name if len(recorded) == 1 else f"{name}_{run.get('key', i)}_round{r}"
            headline, tag = split_title(title)
            subtitle = join_title(f"{headline}\n{display_value('defense', run['defense'])}, round {r}", tag)
            paths += save_figure(
                distance_heatmap(D, byzantine_ids(run["n_byzantine"]), subtitle), folder / base
            )
    return paths


def write_paper_comparison(
    experiment: Any,
    df: pd.DataFrame,
    folder: Path,
    results_dir: str | os.PathLike | None = None,
    mini: bool = False,
    precision: str = "fp32",
) -> Path:
    """``<folder>/<name>_vs_paper.md``: each variant of ``df`` beside the paper's table
    (`results.compare_with_paper`; mini scale: cells matched without the rounds), and, when ``experiment``
    is an `Experiment`, the stored runs of the same grid under the other variant (from ``results_dir``), at
    the same ``precision`` (not fp32: named in the title and the file, ``<name>_<precision>_vs_paper.md``)."""
    from prodigy_core import results
    from prodigy_core.names import VARIANTS

    frames = {v: df for v in results.variants_in(df)} or {variants_of(experiment)[0]: df}
    if hasattr(experiment, "with_variant"):
        for v in (v for v in VARIANTS if v not in frames):
            stored = results.load(experiment.with_variant(v), results_dir)
            if "precision" in stored.columns:
                stored = stored[stored["precision"].fillna("fp32") == precision]
            if not stored.empty:
                frames[v] = stored
    comparisons = {
        v: results.compare_with_paper(frame, experiment.paper_table, variant=v, match_rounds=not mini)
        for v, frame in frames.items()
    }
    comparisons = {v: comparisons[v] for v in [*VARIANTS, *comparisons] if v in comparisons}
    base_title = getattr(experiment, "title", None) or experiment.name
    path = folder / f"{report_name(experiment.name, precision)}_vs_paper.md"
    about = f"variant: {', '.join(comparisons)}"
    about += f"; precision: {precision}" if precision != "fp32" else ""
    text = paper_comparison_markdown(comparisons, f"{base_title}: ours vs the paper ({about})")
    for v, frame in frames.items():  # every detection precision beside the split's no-attack rate
        mine = frame[frame["variant"].fillna("paper") == v] if "variant" in frame else frame
        detection = detection_markdown(mine, f"ProDiGy detection ({v})")
        text += f"\n{detection}" if detection else ""
    path.write_text(text, encoding="utf-8")
    return path


# ---------------------------------------------------------------------------------------------- notebooks


def show(*items: Figure | str | Path | Sequence[Path]) -> None:
    """Display figures and written files in a notebook: a Figure as PNG, ``.md`` as Markdown, ``.png`` as an
    image (``.pdf``/``.tex`` are listed only). Works headless (papermill, nbval) and without pyplot."""
    import io

    from IPython.display import Image, Markdown, display

    for item in items:
        if isinstance(item, Figure):
            buffer = io.BytesIO()
            with figure_style():
                item.savefig(buffer, format="png", metadata=FIXED_METADATA["png"])
            display(Image(data=buffer.getvalue()))
        elif isinstance(item, str | Path):
            path = Path(item)
            if path.suffix == ".md":
                display(Markdown(path.read_text(encoding="utf-8")))
            elif path.suffix == ".png":
                display(Image(filename=str(path)))
            else:
                print(f"wrote {path}")
        else:
            show(*item)
