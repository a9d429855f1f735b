"""Were the paper's no-attack cells run with f = 0? Three pieces of evidence (docs/results.md, "The paper's
no-attack column").

    python scripts/no_attack_f0.py [--authors-code DIR] [--dims D] [--seeds 3] [--rounds R] [--out FILE]

1. The paper's tables (`results.paper_results`): the cells where NNM + trimmed mean and NNM + GeoMed report
   the same mean and std, without an attack and under one.
2. With ``--authors-code DIR`` (a checkout of github.com/senaergisi/prodigy; this imports its
   ``predefenses.py`` and ``defenses.py``, which runs their code): their server's arithmetic (float32 client
   updates, a float64 rule, the update written into float32 weights, server.py ``defend``) on random updates
   at Table II's shape, N = 20, at f = 0 and at f = 6: for each rule, the coordinates whose new float32 weight
   differs from NNM + trimmed mean's.
3. The quickstart's setting (params/quickstart_digits.yaml's base, variant ``paper``) without an attack at
   f = 0 and at its f = 3, seeds 0-2: each rule's final accuracy, mean ± std. ProDiGy needs f >= 2, so it has
   no f = 0 cell. Runs are stored in results/no_attack_f0/ and loaded when already there.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # runs from a source tree, no install needed

OUT = ROOT / "figures" / "no_attack_f0.md"
NNM_RULES = ("nnm+median", "nnm+trimmed_mean", "nnm+geomed", "nnm+krum", "nnm+cclip")
DEFENSES = ("none", *NNM_RULES, "prodigy")
PAIR = ("nnm+trimmed_mean", "nnm+geomed")
# their (predefense, defense) names for our rules (main.py's -p and -d choices)
AUTHORS_RULES = {"none": ("NoDefense", "NoDefense"), "nnm+trimmed_mean": ("NNM", "TrimmedMean"),
                 "nnm+geomed": ("NNM", "GeoMed"), "nnm+median": ("NNM", "Median"),
                 "nnm+krum": ("NNM", "Krum"), "nnm+cclip": ("NNM", "CClip")}  # fmt: skip


def blank(frame: Any) -> Any:
    """The frame with a missing value (a std or alpha the paper does not give) as "": NaN never equals."""
    return frame.astype(object).where(frame.notna(), "")


def paper_pairs(paper: Any) -> tuple[Any, str]:
    """Every paper cell where both rules of PAIR are reported, one row each (the table, the setting, the
    attack, and `same`: both rules print the same mean and std), and a one-line count, no attack against
    attacks."""
    import pandas as pd

    from prodigy_core.results import PAPER_SETTING

    key = ["table", *PAPER_SETTING, "attack"]
    cells = []
    for values, group in blank(paper[paper["defense"].isin(PAIR)]).groupby(key, sort=False):
        printed = {r["defense"]: (r["accuracy_mean"], r["accuracy_std"]) for _, r in group.iterrows()}
        if len(printed) == 2:
            cells.append({**dict(zip(key, values, strict=True)), "mean": printed[PAIR[0]][0],
                          "same": printed[PAIR[0]] == printed[PAIR[1]]})  # fmt: skip
    cells = pd.DataFrame(cells)
    no_attack = cells["attack"] == "none"
    attacked_same = cells[~no_attack & cells["same"]]
    at = ", ".join(sorted(f"{m:.2f}" for m in attacked_same["mean"]))
    quiet_same, quiet = int(cells[no_attack]["same"].sum()), int(no_attack.sum())
    count = (
        f"the same mean and std in {quiet_same} of {quiet} no-attack cells; "
        f"in {len(attacked_same)} of {int((~no_attack).sum())} cells under an attack"
        + (f" (accuracy {at})" if len(attacked_same) else "")
    )
    return cells, count


def authors_rules(code: Path) -> tuple[Any, Any]:
    """Their ``predefenses`` and ``defenses`` modules, imported from a checkout (this runs their code)."""
    modules = []
    for name in ("predefenses", "defenses"):
        path = code / f"{name}.py"
        if not path.is_file():
            raise FileNotFoundError(f"--authors-code {code}: no {name}.py there; give a checkout of "
                                    "github.com/senaergisi/prodigy")  # fmt: skip
        spec = importlib.util.spec_from_file_location(f"authors_{name}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        modules.append(module)
    return modules[0], modules[1]


def authors_arithmetic(
    predefenses: Any,
    defenses: Any,
    n: int = 20,
    fs: tuple[int, ...] = (0, 6),
    d: int = 400_000,
    trials: int = 3,
    lr: float = 0.05,
    seed: int = 0,
) -> dict:
    """{(f, rule): [coordinates whose float32 weight differs from NNM + trimmed mean's, per trial]}: their
    server.py ``defend`` on float32 updates (a shared direction plus a client's own, as non-IID updates are),
    ``current_weights -= lr * rule(predefense(G))`` with float32 weights."""
    import numpy as np

    rng = np.random.default_rng(seed)
    diffs: dict = {}
    for f in fs:
        for _ in range(trials):
            G = (rng.normal(size=d) * 1e-2 + rng.normal(size=(n, d)) * 1e-2).astype(np.float32)
            w0 = rng.normal(size=d).astype(np.float32)
            new = {}
            for rule, (pre, defense) in AUTHORS_RULES.items():
                w = w0.copy()
                mixed = predefenses.predefend[pre](G, n, f)
                w -= lr * defenses.defend[defense](mixed, len(mixed), f, w0.copy())
                new[rule] = w
            for rule, w in new.items():
                diffs.setdefault((f, rule), []).append(int((w != new[PAIR[0]]).sum()))
    return diffs


def experiment(rounds: int | None = None, seeds: int = 3) -> Any:
    """The quickstart's base without an attack: every rule at f = 3, every rule but ProDiGy at f = 0."""
    import yaml

    from prodigy_core.experiments import experiment_from_spec

    quickstart = yaml.safe_load((ROOT / "params" / "quickstart_digits.yaml").read_text(encoding="utf-8"))
    base = {**quickstart["base"], "attack": "none"}
    if rounds is not None:
        base.update(rounds=rounds, eval_every=rounds)
    f = base["n_byzantine"]
    spec = {"experiment": "no_attack_f0", "title": "No attack at f = 0 and f = 3: digits quickstart split",
            "paper_table": None, "base": base, "seeds": list(range(seeds)),
            "grid": [{"n_byzantine": [0], "defense": [d for d in DEFENSES if d != "prodigy"]},
                     {"n_byzantine": [f], "defense": list(DEFENSES)}]}  # fmt: skip
    return experiment_from_spec(spec, source="scripts/no_attack_f0.py")


def digits_table(df: Any) -> str:
    """Markdown: final accuracy mean ± population std over seeds, rows defense, columns f."""
    from prodigy_core.report import cell_table, frame_to_markdown

    df = df.assign(f=[f"f = {f}" for f in df["n_byzantine"]])
    return frame_to_markdown(cell_table(df, "defense", "f", DEFENSES))


def no_attack_rows(paper: Any, cells: Any) -> str:
    """Markdown: each paper block's no-attack cell of every rule (mean ± std where the paper gives one), and
    whether NNM + trimmed mean and NNM + GeoMed agree there."""
    import pandas as pd

    from prodigy_core.report import frame_to_markdown
    from prodigy_core.results import PAPER_SETTING

    block = ["table", *PAPER_SETTING]
    same = {tuple(r[c] for c in block): r["same"] for _, r in cells[cells["attack"] == "none"].iterrows()}
    rows: dict[tuple, dict[str, str]] = {}
    quiet = paper[(paper["attack"] == "none") & paper["defense"].isin(DEFENSES)]
    for _, r in blank(quiet).iterrows():
        key = tuple(r[c] for c in block)
        std = "" if r["accuracy_std"] == "" else f" ± {r['accuracy_std']:.2f}"
        row = rows.setdefault(key, {"setting": f"{r['table']}: {r['distribution']}, {r['algorithm']}, "
                                               f"beta {r['local_momentum']:g}"})  # fmt: skip
        row[r["defense"]] = f"{r['accuracy_mean']:.2f}{std}"
        row["TM = GeoMed"] = {True: "yes", False: "no"}.get(same.get(key), "–")
    frame = pd.DataFrame(list(rows.values()))
    return frame_to_markdown(frame[["setting", *[d for d in DEFENSES if d in frame], "TM = GeoMed"]])


def report(paper: Any, diffs: dict | None, digits: str, note: str, d: int) -> str:
    """The three parts as one Markdown page."""
    cells, count = paper_pairs(paper)
    lines = ["# The paper's no-attack column: run with f = 0?", "",
             "## 1. The paper's tables", "",
             f"NNM + trimmed mean and NNM + GeoMed report {count}. Every rule's no-attack cell:", "",
             no_attack_rows(paper, cells), "",
             "## 2. Their server's arithmetic at f = 0 and f = 6", ""]  # fmt: skip
    if diffs is None:
        lines += ["Not run here (`--authors-code DIR`).", ""]
    else:
        lines += [f"Coordinates (of {d:,}) whose new float32 weight differs from NNM + trimmed mean's, per "
                  "trial (their predefenses.py and defenses.py, N = 20):", "",
                  "| rule | f = 0 | f = 6 |", "|---|---|---|"]  # fmt: skip
        for rule in AUTHORS_RULES:
            lines.append(f"| {rule} | {diffs[(0, rule)]} | {diffs[(6, rule)]} |")
        lines.append("")
    lines += ["## 3. The quickstart's setting without an attack, f = 0 and f = 3", "", digits, "", note]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from prodigy_core.cli import count_arg, parse_study_args
    from prodigy_core.results import paper_results

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--authors-code", type=Path, help="a checkout of senaergisi/prodigy (runs its code)")
    p.add_argument("--dims", type=count_arg, default=400_000, help="coordinates per update in part 2")
    args = parse_study_args(p, argv, OUT)
    diffs = None
    if args.authors_code is not None:
        try:
            diffs = authors_arithmetic(*authors_rules(args.authors_code), d=args.dims)
        except FileNotFoundError as e:
            p.error(str(e))
    from prodigy_core.experiments import run_grid

    runs = experiment(args.rounds, args.seeds)  # jobs="auto": as the quickstart's tables are made
    df = run_grid(runs, jobs="auto", results_dir=args.results_dir, progress=False)
    seeds = ", ".join(map(str, sorted(set(df["seed"]))))
    note = (f"Final accuracy (%), mean ± std over seeds {seeds}; variant paper, "
            f"{int(df['rounds'].iloc[0])} rounds, no attack.")  # fmt: skip
    text = report(paper_results(), diffs, digits_table(df), note, args.dims)
    args.out.write_text(text + "\n", encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
