"""scripts/alie_z_sensitivity.py at smoke scale: 1 round, 2 seeds, the table's cells against the records."""

import statistics
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def script(scripts):
    return scripts("scripts/alie_z_sensitivity.py")


def test_the_runs_are_the_quickstart_split_under_the_authors_typed_z(script):
    configs = script.experiment().configs
    assert len(configs) == 2 * 3 * 3 and {c.seed for c in configs} == {0, 1, 2}
    assert {(c.defense, c.attack_params["z"]) for c in configs} == {
        (d, z) for d in ("prodigy", "nnm+trimmed_mean") for z in (0.41, 0.52, 0.67)
    }
    quickstart = yaml.safe_load((ROOT / "params" / "quickstart_digits.yaml").read_text(encoding="utf-8"))
    quickstart_rounds = quickstart["base"]["rounds"]
    assert all(
        c.variant == "authors" and c.batch_size == 32 and c.rounds == quickstart_rounds for c in configs
    )
    setting = ("dataset", "distribution", "dirichlet_alpha", "n_clients", "n_byzantine", "local_steps",
               "local_momentum")  # fmt: skip
    expected = ("digits", "dirichlet", 0.1, 10, 3, 10, 0.9)
    assert all(tuple(getattr(c, f) for f in setting) == expected for c in configs)


def test_smoke_table_is_mean_and_std_of_the_records(script, tmp_path):
    out = tmp_path / "table.md"
    assert (
        script.main(["--rounds", "1", "--seeds", "2", "--results-dir", str(tmp_path), "--out", str(out)]) == 0
    )
    from prodigy_core.results import load

    df = load(script.experiment(rounds=1, seeds=2), tmp_path)
    assert len(df) == 12 and df["diverged"].eq(False).all()
    text = out.read_text()
    assert "| defense | z = 0.41 | z = 0.52 | z = 0.67 |" in text
    runs = df[(df["defense"] == "prodigy") & (df["attack"] == "alie(z=0.52)")]["final_accuracy"].tolist()
    cell = f"{statistics.fmean(runs):.2f} ± {statistics.pstdev(runs):.2f}"
    prodigy_row = next(line for line in text.splitlines() if line.startswith("| prodigy | "))
    assert prodigy_row.split(" | ")[2] == cell  # the z = 0.52 column
