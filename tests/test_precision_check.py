"""scripts/precision_check.py at smoke scale: its table against the records' numbers worked out by hand."""

import csv
import json
import math
import statistics


def test_precision_check_table_at_smoke_scale(tmp_path, scripts):
    module = scripts("scripts/precision_check.py")
    results, out = tmp_path / "results", tmp_path / "out"
    args = ["--smoke", "--seeds", "2", "--rounds", "1", "--jobs", "1", "--results-dir", str(results)]
    assert module.main([*args, "--out", str(out)]) == 0
    by_cell: dict[tuple, dict] = {}  # (defense, attack) -> {precision: {seed: accuracy}}
    for path in results.rglob("*.json"):
        record = json.loads(path.read_text())
        c = record["config"]
        precision = c.get("precision", "fp32")
        by_cell.setdefault((c["defense"], c["attack"]), {}).setdefault(precision, {})[c["seed"]] = record[
            "final_accuracy"
        ]
    assert len(by_cell) == 6 and all(len(p["fp32"]) == len(p["bf16"]) == 2 for p in by_cell.values())
    rows = list(csv.DictReader((out / "precision_check.csv").open()))
    assert len(rows) == 6
    for row in rows:
        cell = by_cell[row["defense"], row["attack"]]
        diffs = [cell["bf16"][s] - cell["fp32"][s] for s in (0, 1)]
        assert float(row["diff"]) == statistics.mean(diffs)
        two_se = 2 * statistics.stdev(diffs) / math.sqrt(2)
        assert math.isclose(float(row["two_se"]), two_se, abs_tol=1e-9)
        assert (row["within"] == "True") == (abs(statistics.mean(diffs)) <= two_se)
        for precision in ("fp32", "bf16"):  # the worst case: lowest mean accuracy over the row's attacks
            means = {a: statistics.mean(v[precision].values()) for (d, a), v in by_cell.items()
                     if d == row["defense"] and a != "none"}  # fmt: skip
            assert means[row[f"worst_{precision}"]] == min(means.values())
    text = (out / "precision_check.md").read_text()
    assert "| defense | attack | fp32 | bf16 | diff | 2 SE | within |" in text
    # With 2 seeds the paired t statistic has 1 degree of freedom (a Cauchy variable): P(|t| <= 2) is
    # 2/pi atan(2) = 70%, the share of cells within 2 SE expected of one distribution (not 95%).
    assert f"{2 / math.pi * math.atan(2):.0%} would if both precisions drew from one distribution" in text
    seconds = {"fp32": 0.0, "bf16": 0.0}
    for path in results.rglob("*.json"):
        record = json.loads(path.read_text())
        seconds[record["config"].get("precision", "fp32")] += sum(record["round_times"])
    assert f"bf16 / fp32 = {seconds['bf16'] / seconds['fp32']:.2f}x" in text
    assert "<!-- provenance: fp32 runs " in text and "; bf16 runs " in text
