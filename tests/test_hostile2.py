"""Hostile inputs and faults, round 2 (issue 29): one regression test per row, each against an independent
expectation (the file system's state after the fault, an invariant, a rerun)."""

import errno

import pytest

from prodigy_core import cli, results, training
from prodigy_core.config import RunConfig
from prodigy_core.experiments import experiment_from_spec, run_grid

# A digits run of a second or less.
TINY = dict(dataset="digits", n_clients=6, n_byzantine=0, defense="average", attack="none", rounds=2,
            local_steps=1, batch_size=32, eval_every=2, checkpoint_every=1, device="cpu")  # fmt: skip
TINY_SET = [f"--set={k}={v}" for k, v in TINY.items()]


def tiny(**changes) -> RunConfig:
    return RunConfig(**{**TINY, **changes})


def one_error_line(err: str, *parts: str) -> None:
    """One `prodigy-fl: error: ...` line (after a progress bar, if one ran), no traceback."""
    lines = [
        line.partition("prodigy-fl: error: ")[2] for line in err.splitlines() if "prodigy-fl: error: " in line
    ]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert all(p in lines[0] for p in parts), err


# ------------------------------------------------------- 3: the record is written before the checkpoint goes


@pytest.fixture
def full_disk_for_records(monkeypatch):
    """Writing a finished run's record fails as on a full disk (failure records, checkpoints: not)."""
    real = results.write_json_atomic

    def write(path, obj):
        if path.name.endswith(".json") and not path.name.endswith(".failed.json"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, obj)

    monkeypatch.setattr(results, "write_json_atomic", write)
    return monkeypatch


def _resumed_from(monkeypatch) -> list[int]:
    """The round each later run starts from (0: from scratch, r: resumed from a checkpoint of round r)."""
    starts: list[int] = []
    real = training.start_run

    def spy(*args, **kwargs):
        st = real(*args, **kwargs)
        starts.append(st.start)
        return st

    monkeypatch.setattr(training, "start_run", spy)
    return starts


def test_run_keeps_its_checkpoint_when_the_record_cannot_be_written(tmp_path, full_disk_for_records, capsys):
    where = ["--results-dir", str(tmp_path)]
    ckpt = results.checkpoint_dir(tmp_path / "runs") / f"{tiny().key()}.pt"
    assert cli.main(["run", *TINY_SET, *where]) == 2
    one_error_line(capsys.readouterr().err, "No space left on device")
    assert ckpt.exists()  # the work is not lost
    full_disk_for_records.undo()
    starts = _resumed_from(full_disk_for_records)
    assert cli.main(["run", *TINY_SET, *where]) == 0
    assert starts == [1] and not ckpt.exists()  # resumed at round 1 of 2, then the checkpoint went
    assert results.stored_record(tmp_path / "runs", tiny().key()) is not None


@pytest.mark.parametrize("batch_runs", [1, 2])
def test_grid_keeps_checkpoints_when_the_records_cannot_be_written(
    tmp_path, full_disk_for_records, batch_runs
):
    spec = {"experiment": "seeds", "base": {**TINY, "engine": "batched"}, "seeds": [0, 1]}
    experiment = experiment_from_spec(spec)
    folder = tmp_path / "seeds"
    run_grid(experiment, results_dir=tmp_path, progress=False, batch_runs=batch_runs)
    ckpts = [results.checkpoint_dir(folder) / f"{c.key()}.pt" for c in experiment.configs]
    assert all(p.exists() for p in ckpts)
    assert all(results.failure_path(folder, c.key()).exists() for c in experiment.configs)
    full_disk_for_records.undo()
    starts = _resumed_from(full_disk_for_records)
    df = run_grid(experiment, results_dir=tmp_path, progress=False, batch_runs=batch_runs)
    assert starts == [1, 1] and len(df) == 2 and not any(p.exists() for p in ckpts)

