"""scripts/no_attack_f0.py: the paper's NNM + trimmed mean / NNM + GeoMed pairs counted by brute force, the
authors' arithmetic harness on stand-in modules, and the digits table at smoke scale against its records."""

import statistics
import types

import numpy as np
import pandas as pd
import pytest


@pytest.fixture(scope="module")
def script(scripts):
    return scripts("scripts/no_attack_f0.py")


def brute_force_pairs(paper: pd.DataFrame) -> tuple[tuple[int, int], tuple[int, int]]:
    """(same, of) without an attack and under one: every (table, setting, attack) where both rules appear."""
    from prodigy_core.results import PAPER_SETTING

    cells: dict = {}
    for _, r in paper.iterrows():
        if r["defense"] in ("nnm+trimmed_mean", "nnm+geomed"):
            key = tuple(
                "" if v != v else v for v in (r["table"], *[r[c] for c in PAPER_SETTING], r["attack"])
            )
            cells.setdefault(key, {})[r["defense"]] = (r["accuracy_mean"], r["accuracy_std"])
    counts = {True: [0, 0], False: [0, 0]}
    for key, pair in cells.items():
        if len(pair) == 2:
            (m1, s1), (m2, s2) = pair.values()
            same = m1 == m2 and (s1 == s2 or (s1 != s1 and s2 != s2))
            counts[key[-1] == "none"][0] += same
            counts[key[-1] == "none"][1] += 1
    return tuple(counts[True]), tuple(counts[False])


def test_the_count_matches_a_loop_over_the_papers_cells(script):
    from prodigy_core.results import paper_results

    paper = paper_results()
    (quiet_same, quiet), (attacked_same, attacked) = brute_force_pairs(paper)
    _, count = script.paper_pairs(paper)
    assert count.startswith(f"the same mean and std in {quiet_same} of {quiet} no-attack cells; "
                            f"in {attacked_same} of {attacked} cells under an attack")  # fmt: skip


def test_a_hand_made_table_counts_std_too(script):
    from prodigy_core.results import PAPER_SETTING

    setting = dict.fromkeys(PAPER_SETTING, 1)
    rows = [  # block A: equal without attack; block B: equal means, different stds; under ALIE: equal
        ("A", "none", "nnm+trimmed_mean", 80.0, 0.5), ("A", "none", "nnm+geomed", 80.0, 0.5),
        ("B", "none", "nnm+trimmed_mean", 70.0, 0.4), ("B", "none", "nnm+geomed", 70.0, 0.3),
        ("A", "alie", "nnm+trimmed_mean", 10.0, None), ("A", "alie", "nnm+geomed", 10.0, None),
        ("A", "sf", "nnm+trimmed_mean", 50.0, None), ("A", "sf", "prodigy", 50.0, None),
    ]  # fmt: skip
    paper = pd.DataFrame([dict(setting, table=t, attack=a, defense=d, accuracy_mean=m, accuracy_std=s)
                          for t, a, d, m, s in rows])  # fmt: skip
    cells, count = script.paper_pairs(paper)
    assert (
        count
        == "the same mean and std in 1 of 2 no-attack cells; in 1 of 1 cells under an attack (accuracy 10.00)"
    )
    assert "| A: " in script.no_attack_rows(paper, cells) and "| yes |" in script.no_attack_rows(paper, cells)


def test_the_arithmetic_harness_counts_what_numpy_counts(script):
    """Stand-ins for their modules: every rule the float64 mean of the rows, but Median the first row."""
    predefenses = types.SimpleNamespace(predefend={"NoDefense": lambda G, n, f: G, "NNM": lambda G, n, f: G})
    mean = lambda G, n, f, w: G.astype(np.float64).mean(axis=0)  # noqa: E731
    rules = dict.fromkeys(["NoDefense", "TrimmedMean", "GeoMed", "Krum", "CClip"], mean)
    defenses = types.SimpleNamespace(defend={**rules, "Median": lambda G, n, f, w: G[0]})
    diffs = script.authors_arithmetic(predefenses, defenses, n=5, fs=(0, 2), d=1000, trials=2, seed=3)
    rng = np.random.default_rng(3)
    for f in (0, 2):
        expected = []
        for _ in range(2):  # the harness's own draws, in its order
            G = (rng.normal(size=1000) * 1e-2 + rng.normal(size=(5, 1000)) * 1e-2).astype(np.float32)
            w0 = rng.normal(size=1000).astype(np.float32)
            w_mean, w_first = w0.copy(), w0.copy()
            w_mean -= 0.05 * G.astype(np.float64).mean(axis=0)
            w_first -= 0.05 * G[0]
            expected.append(int((w_first != w_mean).sum()))
        assert diffs[(f, "nnm+median")] == expected and all(e > 0 for e in expected)
        assert all(diffs[(f, r)] == [0, 0] for r in ("none", "nnm+geomed", "nnm+krum", "nnm+cclip"))


def test_a_folder_without_their_code_is_one_clear_line(script, tmp_path, capsys):
    with pytest.raises(SystemExit):
        script.main(["--authors-code", str(tmp_path), "--out", str(tmp_path / "x.md")])
    assert (
        "no predefenses.py there; give a checkout of github.com/senaergisi/prodigy" in capsys.readouterr().err
    )


def test_smoke_table_is_mean_and_std_of_the_records(script, tmp_path):
    out = tmp_path / "table.md"
    args = ["--rounds", "1", "--seeds", "2", "--results-dir", str(tmp_path), "--out", str(out)]
    assert script.main(args) == 0
    from prodigy_core.results import load

    df = load(script.experiment(rounds=1, seeds=2), tmp_path)
    assert len(df) == 2 * (6 + 7) and set(df[df["n_byzantine"] == 0]["defense"]) == set(script.DEFENSES) - {
        "prodigy"
    }
    assert set(df["attack"]) == {"none"} and set(df["n_byzantine"]) == {0, 3}
    text = out.read_text()
    assert "Not run here (`--authors-code DIR`)." in text
    for f in (0, 3):
        runs = df[(df["defense"] == "nnm+geomed") & (df["n_byzantine"] == f)]["final_accuracy"].tolist()
        row = next(line for line in text.splitlines() if line.startswith("| nnm+geomed | "))
        assert (
            row.split(" | ")[1 + (f == 3)].rstrip(" |")
            == f"{statistics.fmean(runs):.2f} ± {statistics.pstdev(runs):.2f}"
        )
    prodigy = next(line for line in text.splitlines() if line.startswith("| prodigy | "))
    assert prodigy.split(" | ")[1] == "–"  # ProDiGy needs f >= 2: no f = 0 cell
