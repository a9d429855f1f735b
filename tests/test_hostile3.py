"""Hostile inputs, round 3 (issue 35): records that run code, plug-in edits that reuse old numbers, settings
that merge wrong. One regression test per finding, each against an independent expectation (a file a
plug-in's top level would write, a hand-computed value, the file system after the fault)."""

import importlib
import io
import json
import os
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from prodigy_core import results, training
from prodigy_core.aggregators import make_aggregator
from prodigy_core.cli import main, parse_fields
from prodigy_core.config import ConfigError, RunConfig, as_row, parse_settings
from prodigy_core.experiments import load_experiment
from prodigy_core.registry import plugin_hash

ROOT = Path(__file__).resolve().parents[1]

# A digits run of a second or less.
TINY = dict(dataset="digits", n_clients=6, n_byzantine=1, defense="average", attack="none", rounds=2,
            local_steps=1, batch_size=32, eval_every=1, checkpoint_every=1, device="cpu")  # fmt: skip
TINY_SET = [f"--set={k}={v}" for k, v in TINY.items()]

# A rule whose module's top level leaves a mark: whoever imports it runs it.
PAYLOAD = """
from pathlib import Path
import torch
from prodigy_core.aggregators import Rule

Path({mark!r}).write_text("ran")


class X(Rule):
    def __init__(self, f: int, scale: float = 1.0, tag=None):
        self.f, self.scale = f, scale

    def aggregate(self, G):
        return self.scale * G.mean(dim=0)
"""


def payload(folder: Path, name: str = "payload.py") -> Path:
    """``folder/name`` defining the rule X; returns the file its import would write."""
    mark = folder / f"{name}.ran"
    (folder / name).write_text(PAYLOAD.format(mark=str(mark)))
    return mark


@pytest.fixture
def work(tmp_path, monkeypatch):
    folder = tmp_path / "work"
    folder.mkdir()
    monkeypatch.chdir(folder)
    return folder


def record_of(config: dict, key: str, plugins: dict) -> dict:
    return {"key": key, "experiment": "x", "status": "done", "config": config, "final_accuracy": 50.0,
            "accuracy_curve": [[1, 50.0]], "plugins": plugins}  # fmt: skip


# -------------------------------------------------- 7: reading a record never imports code


def test_7_judging_a_record_that_names_a_plugin_imports_nothing(work):
    mark = payload(work)
    config = {**TINY, "defense": "payload.py:X"}
    folder = work / "results" / "exp"
    folder.mkdir(parents=True)
    for key in ("0123456789abcdef", "fedcba9876543210"):
        (folder / f"{key}.json").write_text(json.dumps(record_of(config, key, {"payload.py:X": "0" * 16})))
        record, why = results.judge_record(folder, key)
        assert record is None and "key" in why  # a key its stored code hash does not give
    assert not mark.exists()


def test_7_a_plugin_record_is_checked_against_its_stored_code_hash(work):
    from prodigy_core.registry import records_are_data

    mark = payload(work)
    config = {**TINY, "defense": "payload.py:X", "data_source": "digits"}
    with records_are_data():
        key = RunConfig.from_dict(config).key(code={"payload.py:X": "ab" * 8})
    folder = work / "results" / "exp"
    folder.mkdir(parents=True)
    (folder / f"{key}.json").write_text(json.dumps(record_of(config, key, {"payload.py:X": "ab" * 8})))
    record, why = results.judge_record(folder, key)
    assert why is None and record["key"] == key and not mark.exists()
    (folder / f"{key}.json").write_text(json.dumps(record_of(config, key, {})))  # no stored hash
    assert "without its code hash" in results.judge_record(folder, key)[1] and not mark.exists()


def test_7_gpu_import_of_a_tarball_that_plants_a_plugin_runs_nothing(work, gpu_run):
    config = {**TINY, "defense": "figures/gpu/payload.py:X", "data_source": "digits"}
    mark = work / "ran"
    write_tar(work / "r.tar.gz", [("payload.py", PAYLOAD.format(mark=str(mark))),
                                  ("results/gpu_x-mini/0123456789abcdef.json",
                                   json.dumps(record_of(config, "0123456789abcdef", {})))])  # fmt: skip
    gpu_run.import_results(work / "r.tar.gz", work / "results", work / "figures")
    assert not mark.exists()
    assert not (work / "figures" / "gpu" / "payload.py").exists()  # 13: only the kinds a tarball holds


@pytest.fixture(scope="module")
def gpu_run():
    """benchmarks/gpu_run.py as a module (its folder appended to sys.path: none of its files shadows one)."""
    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.append(str(ROOT / "benchmarks"))
    return importlib.import_module("gpu_run")


def write_tar(path: Path, members: list[tuple[str, str | bytes]]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, text in members:
            data = text.encode() if isinstance(text, str) else text
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


# ------------------------------------------- 11, 13, 17: gpu_run.py import reads only what the driver writes


def test_11_import_refuses_a_member_over_the_size_cap_unread(work, gpu_run, monkeypatch, capsys):
    monkeypatch.setattr(gpu_run, "MAX_MEMBER_BYTES", 1000)
    tarball = write_tar(work / "r.tar.gz", [("log.txt", "x" * 2000), ("env.txt", "small")])
    gpu_run.import_results(tarball, work / "results", work / "figures")
    assert (
        not (work / "figures" / "gpu" / "log.txt").exists()
        and (work / "figures" / "gpu" / "env.txt").exists()
    )
    assert "'log.txt'" in capsys.readouterr().err


def test_a_tarball_without_a_record_leaves_provenance_as_it_is(work, gpu_run, capsys):
    """Importing the wrong tarball (a helper found it): its zero rows replaced figures/gpu/PROVENANCE.md's."""
    provenance = work / "figures" / "gpu" / "PROVENANCE.md"
    provenance.parent.mkdir(parents=True)
    provenance.write_text("| the committed rows |\n")
    tarball = write_tar(work / "r.tar.gz", [("hi.txt", "hello")])
    gpu_run.import_results(tarball, work / "results", work / "figures")
    assert provenance.read_text() == "| the committed rows |\n"
    assert "holds no run record (results/<folder>/<key>.json)" in capsys.readouterr().err


def test_13_a_member_named_results_never_turns_results_gpu_into_a_file(work, gpu_run, capsys):
    tarball = write_tar(work / "r.tar.gz", [("results", "not a folder"), ("results/x/y/z.json", "{}")])
    gpu_run.import_results(tarball, work / "results", work / "figures")
    assert not (work / "results" / "gpu").is_file() and not (work / "results" / "gpu" / "x").exists()
    err = capsys.readouterr().err
    assert "skipped 'results'" in err and "skipped 'results/x/y/z.json'" in err


@pytest.mark.parametrize(
    "content, what",
    [(b"\xff not json", "not JSON"), (b"[1, 2]", "not a JSON object"), (b'{"key": "k"}', "no config"),
     (json.dumps({"key": "k", "config": {"rounds": -1}}).encode(), "invalid")],
)  # fmt: skip
def test_17_import_skips_a_bad_record_with_a_warning_naming_it(work, gpu_run, capsys, content, what):
    name = "results/gpu_x-mini/0123456789abcdef.json"
    gpu_run.import_results(
        write_tar(work / "r.tar.gz", [(name, content)]), work / "results", work / "figures"
    )
    err = capsys.readouterr().err
    assert f"skipped {name!r}" in err and what in err, err
    assert not list((work / "results").rglob("*.json"))


# -------------------------------------------------- 8: a dry run imports nothing


def test_8_a_dry_run_of_a_params_file_naming_a_plugin_imports_nothing(work, capsys):
    mark = payload(work)
    (work / "p.yaml").write_text(
        "experiment: p\ntitle: t\nbase: {dataset: digits, n_clients: 6, n_byzantine: 1, rounds: 2}\n"
        'grid: {defense: [average, "payload.py:X"], attack: [none]}\nseeds: [0]\n'
    )
    assert main(["grid", "p.yaml", "--dry-run", "--results-dir", str(work / "results")]) == 0
    out = capsys.readouterr().out
    assert "defense=payload.py:X" in out and "2 runs (0 stored, 2 to run)" in out
    assert not mark.exists()


def test_8_the_docs_say_a_params_file_naming_a_plugin_runs_its_file():
    for doc in (ROOT / "README.md", ROOT / "docs" / "usage.md"):
        text = " ".join(doc.read_text().split())
        assert "runs that file like a script" in text, doc


# -------------------------------------------------- 1: a plug-in edited while its run trains


RULE = """
from prodigy_core.aggregators import Rule


class Scaled(Rule):
    def __init__(self, f: int):
        self.f = f

    def aggregate(self, G):
        return {scale} * G.mean(dim=0)
"""


def test_1_a_plugin_edited_while_it_trains_keeps_its_record_under_the_old_code(work, monkeypatch, capsys):
    (work / "rule.py").write_text(RULE.format(scale=1.0))
    config = RunConfig(**{**TINY, "defense": "rule.py:Scaled"})
    old_key, old_hash = config.key(), plugin_hash("rule.py:Scaled")
    real = training.end_round

    def edit_then_end(*args, **kwargs):
        (work / "rule.py").write_text(RULE.format(scale=0.0))  # the user edits the file meanwhile
        return real(*args, **kwargs)

    monkeypatch.setattr(training, "end_round", edit_then_end)
    argv = ["run", *TINY_SET, "--set=defense=rule.py:Scaled", "--results-dir", str(work / "results")]
    assert main(argv) == 0
    monkeypatch.setattr(training, "end_round", real)
    folder = work / "results" / "runs"
    stored = json.loads((folder / f"{old_key}.json").read_text())
    assert stored["plugins"] == {"rule.py:Scaled": old_hash}  # the code that ran
    assert results.judge_record(folder, old_key)[1] is None  # valid: old code, old key
    new_key = RunConfig(**{**TINY, "defense": "rule.py:Scaled"}).key()
    assert new_key != old_key and not (folder / f"{new_key}.json").exists()
    capsys.readouterr()
    assert main(argv) == 0  # the edited rule trains: no stored result of the old code
    assert "stored result" not in capsys.readouterr().err
    assert (folder / f"{new_key}.json").exists()


# -------------------------------------------------- 2: a plug-in's helper module is in its key


def test_2_editing_a_helper_beside_a_plugin_changes_its_key_and_its_code(work, monkeypatch):
    monkeypatch.syspath_prepend(str(work))
    (work / "helpers_35.py").write_text("SCALE = 1.0\n")
    (work / "rule.py").write_text(
        "import helpers_35\nfrom prodigy_core.aggregators import Rule\n\n\nclass Scaled(Rule):\n"
        "    def __init__(self, f: int):\n        self.f = f\n\n"
        "    def aggregate(self, G):\n        return helpers_35.SCALE * G.mean(dim=0)\n"
    )
    config = RunConfig(**{**TINY, "defense": "rule.py:Scaled"})
    before = config.key()
    G = torch.ones(6, 3)
    assert torch.equal(make_aggregator("rule.py:Scaled", 1)(G), torch.ones(3))
    (work / "helpers_35.py").write_text("SCALE = 2.0\n")
    assert config.key() != before  # the helper is part of the plug-in's code
    assert torch.equal(make_aggregator("rule.py:Scaled", 1)(G), 2 * torch.ones(3))  # and runs edited
    sys.modules.pop("helpers_35", None)


def test_config_error_is_still_raised_for_a_bad_plugin_setting_outside_records(work):
    payload(work)
    with pytest.raises(ConfigError, match="no setting 'nope'"):
        RunConfig(**{**TINY, "defense": "payload.py:X", "defense_params": {"nope": 1}})


# -------------------------------------------------- 3, 5: labels and the explorer's box are exact


@pytest.mark.parametrize(
    "a, b", [(5.00001, 5.00002), (1, 1.0), (True, 1), ("5", 5), (None, "None"), (1e-5, 1.0000001e-5)]
)
def test_3_two_settings_that_give_two_keys_give_two_labels(work, a, b):
    payload(work)  # a plug-in setting keeps its type: 1 and 1.0 are two keys there
    runs = [RunConfig(**{**TINY, "defense": "payload.py:X", "defense_params": {"tag": v}}) for v in (a, b)]
    assert runs[0].key() != runs[1].key()
    rows = [as_row(r.to_dict())["defense"] for r in runs]
    assert rows[0] != rows[1], rows


def test_3_foe_eps_written_close_stays_two_columns():
    runs = [RunConfig(**{**TINY, "attack": "foe", "attack_params": {"eps": e}}) for e in (5.00001, 5.00002)]
    assert as_row(runs[0].to_dict())["attack"] == "foe(eps=5.00001)" != as_row(runs[1].to_dict())["attack"]


@pytest.mark.parametrize("settings", [{"tau": 1.23456}, {"tau": 123.456789, "L": 2}, {"tau": 5.0}])
def test_5_the_explorer_settings_box_runs_the_values_it_was_given(settings, optional_import):
    optional_import("ipywidgets", "dev")
    from prodigy_core.explorer import explorer

    box = explorer(defense="cclip", defense_params=settings).controls["defense_params"]
    assert parse_settings("defense_params", box.value) == settings, box.value


# -------------------------------------------------- 4: --set name.setting merges into the file's settings


def test_4_a_dotted_set_keeps_the_params_files_other_settings(work):
    (work / "p.yaml").write_text(
        "experiment: p\ntitle: t\nbase: {dataset: digits, n_clients: 6, n_byzantine: 1, rounds: 2, "
        "defense: cclip, defense_params: {L: 1}}\ngrid: {attack: [none]}\nseeds: [0]\n"
    )
    fields = parse_fields(["defense_params.tau=5"])
    (config,) = load_experiment(work / "p.yaml", fields=fields).configs
    assert dict(config.defense_params) == {"L": 1, "tau": 5.0}
    (config,) = load_experiment(work / "p.yaml", fields=parse_fields(["defense_params={tau: 5}"])).configs
    assert dict(config.defense_params) == {"tau": 5.0}  # a whole mapping replaces


def test_4_a_dotted_set_merges_into_each_settings_of_a_grid_axis(work):
    (work / "p.yaml").write_text(
        "experiment: p\ntitle: t\nbase: {dataset: digits, n_clients: 6, n_byzantine: 1, rounds: 2, "
        "defense: cclip}\ngrid: {defense_params: [{L: 1}, {L: 2}]}\nseeds: [0]\n"
    )
    configs = load_experiment(work / "p.yaml", fields=parse_fields(["defense_params.tau=5"])).configs
    assert [dict(c.defense_params) for c in configs] == [{"L": 1, "tau": 5.0}, {"L": 2, "tau": 5.0}]


# -------------------------------------------------- 6, 10, 20: data files


def leaf(root: Path, pixel: float = 0.5) -> Path:
    """A LEAF folder of three writers (4 train and 2 test samples each), one pixel of w_b set to ``pixel``."""
    for split, n in (("train", 4), ("test", 2)):
        (root / split).mkdir(parents=True)
        data = {w: {"x": [[0.5] * 784 for _ in range(n)], "y": list(range(n))} for w in ("w_a", "w_b", "w_c")}
        data["w_b"]["x"][1][7] = pixel
        content = {"users": sorted(data), "num_samples": [n] * 3, "user_data": data}
        (root / split / "part.json").write_text(json.dumps(content))
    return root


@pytest.mark.parametrize("pixel", [1e30, -0.5, 1.5])
def test_6_a_femnist_pixel_outside_0_1_is_refused(tmp_path, pixel):
    from prodigy_core.data import DataError, load_federation

    with pytest.raises(
        DataError, match=r"part.json: writer w_b: x row 1 is not 784 finite numbers in \[0, 1\]"
    ):
        load_federation("femnist", 3, "natural", data_dir=leaf(tmp_path / "leaf", pixel))
    assert load_federation("femnist", 3, "natural", data_dir=leaf(tmp_path / "ok", 1.0)).n_clients == 3


def test_10_a_fifo_named_json_in_a_femnist_folder_is_refused_unread(tmp_path):
    from prodigy_core.data import DataError, load_federation

    folder = leaf(tmp_path / "leaf")
    os.mkfifo(folder / "train" / "zz.json")  # reading it would block forever
    with pytest.raises(DataError, match="zz.json: not a regular file"):
        load_federation("femnist", 3, "natural", data_dir=folder)


def test_10_a_fifo_named_jpg_in_an_unpacked_cifar10_copy_is_refused_unread(tmp_path, jpeg_folder):
    from prodigy_core.data import DataError, decode_cifar10_jpeg

    root = jpeg_folder(tmp_path / "jpeg", per_class=1)
    fifo = next(root.glob("train/*/*.jp*g"))
    fifo.unlink()
    os.mkfifo(fifo)
    with pytest.raises(DataError, match=f"{fifo.name}: not a regular file"):
        decode_cifar10_jpeg(root, tmp_path / "out", progress=False)


def test_20_a_non_utf8_json_in_a_femnist_folder_is_named(tmp_path):
    from prodigy_core.data import DataError, load_federation

    folder = leaf(tmp_path / "leaf")
    (folder / "train" / "bad.json").write_bytes(b'{"users": ["\xff"]}')
    with pytest.raises(DataError, match="bad.json: not a UTF-8 LEAF JSON file"):
        load_federation("femnist", 3, "natural", data_dir=folder)


# -------------------------------------------------- 14, 9: integer settings and iteration bounds


@pytest.mark.parametrize(
    "defense, setting, message",
    [
        ("cclip", "L=2.0", r"L=2.0 must be an integer \(write 2\)"),
        ("cclip", "L=2.5", "L=2.5 must be an integer"),
        ("geomed", "R=2.5", "R=2.5 must be an integer"),
        ("multikrum", "m=2.5", "m=2.5 must be an integer or null"),
        ("multikrum", "m=None", "m='None' must be an integer or null"),
        ("cclip", "tau=true", "tau=True must be a number"),
    ],
)
def test_14_a_float_or_bool_where_an_integer_or_number_is_meant_is_refused_at_config_time(
    defense, setting, message
):
    fields = parse_fields([f"defense={defense}", f"defense_params.{setting}", "n_byzantine=1"])
    with pytest.raises(ConfigError, match=message):
        RunConfig.from_dict(fields)


def test_14_integer_settings_written_as_integers_still_run():
    assert dict(RunConfig(defense="cclip", defense_params={"L": 2, "tau": 5}).defense_params) == {
        "L": 2,
        "tau": 5.0,
    }
    assert dict(RunConfig(defense="multikrum", n_byzantine=1, defense_params={"m": 4}).defense_params) == {
        "m": 4
    }


@pytest.mark.parametrize("defense, setting", [("cclip", "L"), ("geomed", "R")])
def test_9_an_iteration_count_beyond_the_bound_is_refused_not_run(defense, setting, capsys):
    from prodigy_core.aggregators import MAX_ITERATIONS

    with pytest.raises(ConfigError, match=f"1 <= {setting} <= {MAX_ITERATIONS}, got .*{setting}=1000000000"):
        RunConfig(defense=defense, defense_params={setting: 10**9})
    assert RunConfig(defense=defense, defense_params={setting: MAX_ITERATIONS}).defense_params[setting] == 100
    assert (
        main(["run", *TINY_SET, f"--set=defense={defense}", f"--set=defense_params.{setting}=1000000000"])
        == 2
    )
    assert "prodigy-fl: error:" in capsys.readouterr().err


# -------------------------------------------------- 18: --resume checked before $OUT is written


@pytest.mark.parametrize("kind", ["missing", "not a tar"])
def test_18_resume_with_a_missing_or_non_tar_file_is_one_line_before_out_is_written(
    tmp_path, gpu_run, capsys, kind
):
    data = tmp_path / "data"
    (data / "cifar10-jpeg").mkdir(parents=True)
    (data / "cifar10-jpeg" / "cifar10-jpeg.tar.gz").write_bytes(b"")
    (data / "femnist-leaf-24").mkdir()
    resume = tmp_path / "earlier.tar.gz"
    if kind == "not a tar":
        resume.write_text("hello")
    out = tmp_path / "out"
    argv = [
        "--simulate",
        "--data",
        str(data),
        "--out",
        str(out),
        "--work",
        str(tmp_path / "w"),
        "--resume",
        str(resume),
    ]
    assert gpu_run.main(argv) == gpu_run.EXIT_PREFLIGHT
    err = capsys.readouterr().err.strip()
    assert (
        err.count("\n") == 0
        and f"--resume {resume}: " in err
        and kind.replace("missing", "no such file") in err
    )
    assert not out.exists()


# -------------------------------------------------- 12, 16: the JupyterLab hook and git-setup


def _git(folder: Path, *args: str) -> str:
    import subprocess

    return subprocess.run(
        ["git", "-C", str(folder), *args], capture_output=True, text=True, check=True
    ).stdout


def test_12_the_save_hook_never_stages_an_untracked_file_whose_name_is_a_glob(tmp_path, git_installed):

    from prodigy_core import lab

    repo = tmp_path / "clone"
    repo.mkdir()
    for args in (["init", "-q"], ["config", "user.email", "t@example.org"], ["config", "user.name", "t"]):
        _git(repo, *args)
    (repo / "analysis1.ipynb").write_text('{"cells": []}\n')
    _git(repo, "add", "analysis1.ipynb")
    _git(repo, "commit", "-q", "-m", "a")
    (repo / "analysis[1].ipynb").write_text('{"cells": [1]}\n')  # untracked: the glob matches analysis1
    assert not lab.refresh_git_index(str(repo / "analysis[1].ipynb"))
    assert _git(repo, "diff", "--cached", "--name-only") == ""
    assert "?? analysis[1].ipynb" in _git(repo, "status", "--porcelain")


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"ContentsManager": "x"}', "ContentsManager='x' is not an object of settings"),
        ("[1, 2]", "is not a JSON object of settings"),
        (
            '{"FileContentsManager": {"post_save_hook": "my.hook"}}',
            "sets FileContentsManager.post_save_hook='my.hook'",
        ),
    ],
)
def test_16_git_setup_on_a_config_it_cannot_use_says_why(tmp_path, content, message):
    from prodigy_core import lab

    config = lab.config_file(str(tmp_path))
    config.parent.mkdir(parents=True)
    config.write_text(content)
    with pytest.raises(ValueError, match=message):
        lab.install_hook(str(tmp_path))
    assert config.read_text() == content  # left as it was


def test_16_git_setup_fills_a_null_contents_manager(tmp_path):
    from prodigy_core import lab

    config = lab.config_file(str(tmp_path))
    config.parent.mkdir(parents=True)
    config.write_text('{"ContentsManager": null, "ServerApp": {"port_retries": 3}}')
    lab.install_hook(str(tmp_path))
    assert json.loads(config.read_text()) == {
        "ContentsManager": {"post_save_hook": lab.HOOK},
        "ServerApp": {"port_retries": 3},
    }


# -------------------------------------------------- 22: Ray that cannot start


def ray_that_fails(ray, work: Path, monkeypatch, message: str) -> tuple[list[str], list[dict]]:
    """A one-run grid in `work` with Ray (the module) whose start raises `message`: (the grid's command line,
    the keyword arguments of every `ray.init` call)."""
    calls: list[dict] = []

    def init(*args, **kwargs):
        calls.append(kwargs)
        raise Exception(message)

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    (work / "p.yaml").write_text(
        "experiment: p\ntitle: t\nbase: {dataset: digits, n_clients: 6, n_byzantine: 1, rounds: 1, "
        "defense: average}\ngrid: {attack: [none]}\nseeds: [0]\n"
    )
    return ["grid", "p.yaml", "--executor", "ray", "--results-dir", str(work / "results")], calls


def test_22_grid_with_ray_that_cannot_start_is_one_line_naming_the_way_without_it(
    work, monkeypatch, capsys, optional_import
):
    message = "The current node timed out during startup.\nThis could happen because ..."
    grid, _ = ray_that_fails(optional_import("ray", "ray"), work, monkeypatch, message)
    assert main(grid) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "prodigy-fl: error:" in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "Ray could not start on this machine (The current node timed out" in lines[0]
    assert "--executor local" in lines[0]


def test_22_ray_joins_the_cluster_of_ray_address_and_names_a_running_one(
    work, monkeypatch, capsys, optional_import
):
    """`ray job submit` sets RAY_ADDRESS: the grid joins that cluster (Ray refuses num_cpus there); without
    it, a cluster started by `ray start` on this machine makes Ray refuse the local start, and the line says
    how to join it."""
    message = "When connecting to an existing cluster, num_cpus and num_gpus must not be provided."
    grid, calls = ray_that_fails(optional_import("ray", "ray"), work, monkeypatch, message)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert main(grid) == 2
    assert calls[-1] == {"address": "10.0.0.1:6379", "log_to_driver": False}
    assert "Ray could not start at 10.0.0.1:6379" in capsys.readouterr().err
    monkeypatch.delenv("RAY_ADDRESS")
    assert main(grid) == 2
    assert "num_cpus" in calls[-1] and "address" not in calls[-1]
    err = capsys.readouterr().err
    assert "a Ray cluster runs here: join it with --address auto" in err and "Traceback" not in err


def test_ray_on_this_machine_without_the_gpus_a_run_asks_for_is_one_line_not_a_wait(
    work, monkeypatch, capsys, optional_import
):
    """--num-gpus 1 where Ray's local node has no GPU: Ray would queue every task forever (a local cluster
    never grows); the grid stops at once in one line naming the nodes, and trains nothing."""
    ray = optional_import("ray", "ray")
    grid, calls = ray_that_fails(ray, work, monkeypatch, "")
    stopped = []
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True, "Resources": {"CPU": 2.0, "memory": 1e9}}])
    monkeypatch.setattr(ray, "shutdown", lambda: stopped.append(True))
    assert main([*grid, "--num-gpus", "1"]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "prodigy-fl: error:" in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "no node with 1 CPU(s) and 1 GPU(s) for a run (its nodes: 2 CPU / 0 GPU)" in lines[0]
    assert "--num-gpus" in lines[0] and stopped
    assert not list((work / "results").rglob("*.json"))


def test_a_run_fits_a_ray_node_only_whole():
    """A task runs on one node: its CPUs and GPUs must fit one node's; a GPU fraction fits any GPU node."""
    from prodigy_core.experiments import _ray_shortfall

    gpu_node, cpu_node = {"CPU": 8.0, "GPU": 1.0}, {"CPU": 64.0}
    assert _ray_shortfall([cpu_node, gpu_node], 1, 0.25) is None
    assert _ray_shortfall([cpu_node, gpu_node], 16, 0) is None  # the CPU node
    assert _ray_shortfall([gpu_node, gpu_node], 1, 2) == (
        "no node with 1 CPU(s) and 2 GPU(s) for a run (its nodes: 8 CPU / 1 GPU, 8 CPU / 1 GPU)"
    )
    assert _ray_shortfall([cpu_node, gpu_node], 16, 1) == (  # enough of each, never on one node
        "no node with 16 CPU(s) and 1 GPU(s) for a run (its nodes: 64 CPU / 0 GPU, 8 CPU / 1 GPU)"
    )
    assert _ray_shortfall([], 1, 0) == "no node with 1 CPU(s) and 0 GPU(s) for a run (its nodes: none)"


def test_22_a_ray_worker_runs_from_the_drivers_folder_where_its_node_has_it(work, monkeypatch, tmp_path):
    """A `ray start` worker starts in the folder `ray start` ran from: a plug-in named by a relative path
    (part of the run's key as written) is found only from the driver's folder, which the work item enters
    when the node has it, and leaves the worker's own folder alone when it has not."""
    from prodigy_core import experiments

    seen = []
    monkeypatch.setattr(experiments, "_work", lambda tasks: seen.append(os.getcwd()) or [])
    elsewhere = tmp_path / "raylet"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    experiments._ray_work(str(work), [])
    experiments._ray_work(str(tmp_path / "not-on-this-node"), [])
    assert seen == [str(work), str(work)]


KILLER = """import multiprocessing, os, signal
from pathlib import Path

from prodigy_core.aggregators import Rule


class Killer(Rule):
    def __init__(self, f: int):
        self.f = f

    def aggregate(self, G):
        marker = Path(os.environ["KILLER_MARKER"])
        first = not marker.exists()
        if multiprocessing.parent_process() is not None and (os.environ["KILLER_ALWAYS"] or first):
            marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)  # a pool worker killed (the OOM killer, a user)
        return G.mean(dim=0)
"""


@pytest.mark.parametrize("always", [False, True])
def test_23_a_pool_worker_that_dies_costs_the_grid_nothing_but_its_own_run(work, monkeypatch, capsys, always):
    """A killed worker breaks a process pool and every run in flight with it: those go to a fresh pool once,
    each alone (they finish, as a rerun would), and only a run whose worker dies again is recorded as failed,
    in one line; the grid goes on, and ends with its summary, never a BrokenProcessPool traceback. Before,
    the run beside the dead one was recorded as failed and the grid stopped with that traceback."""
    (work / "killer.py").write_text(KILLER)
    monkeypatch.setenv("KILLER_MARKER", str(work / "killed"))
    monkeypatch.setenv("KILLER_ALWAYS", "1" if always else "")
    (work / "p.yaml").write_text(
        "experiment: p\ntitle: t\nbase: {dataset: digits, n_clients: 6, n_byzantine: 1, rounds: 1, "
        "eval_every: 1}\ngrid: {defense: [average, killer.py:Killer], attack: [none]}\nseeds: [0]\n"
    )
    results = work / "results"
    code = main(["grid", "p.yaml", "--jobs", "2", "--batch-runs", "1", "--results-dir", str(results)])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out and (work / "killed").exists()
    done = sorted(p.name for p in (results / "p").glob("*.json") if not p.name.endswith(".failed.json"))
    failed = sorted((results / "p").glob("*.failed.json"))
    if always:  # the average's run, in flight beside the dying one, is done; the plug-in's failed
        assert code == 1 and len(done) == 1 and len(failed) == 1
        assert "its worker process died twice" in failed[0].read_text()
    else:
        assert code == 0 and len(done) == 2 and not failed


# -------------------------------------------------- 21: a plug-in named like a built-in


def test_21_a_plugin_whose_display_is_a_builtins_gets_a_row_of_its_own(work):
    from prodigy_core.registry import records_are_data
    from prodigy_core.report import display_value

    (work / "fake.py").write_text(
        'from prodigy_core.aggregators import Rule\n\n\nclass Fake(Rule):\n    display = "ProDiGy"\n\n'
        "    def __init__(self, f: int):\n        self.f = f\n\n    def aggregate(self, G):\n"
        "        return G.mean(dim=0)\n"
    )
    shown = [display_value("defense", d) for d in ("prodigy", "fake.py:Fake", "nnm+fake.py:Fake")]
    assert shown == ["ProDiGy", "ProDiGy [fake.py:Fake]", "NNM+ProDiGy [fake.py:Fake]"]
    with records_are_data():  # reading records: its file read as text, never imported, the same row
        assert display_value("defense", "fake.py:Fake") == "ProDiGy [fake.py:Fake]"


# -------------------------------------------------- 15: the explorer takes every setting RunConfig takes


@pytest.mark.parametrize(
    "setting, field, shown",
    [
        (dict(attack="foe", attack_params={"eps": 1}), "attack", "foe"),  # the notebook's own example
        (dict(attack="foe_0.1", attack_params={"eps": 1}), "attack", "foe"),
        (dict(defense="payload.py:X", attack="none"), "defense", "payload.py:X"),
    ],
)
def test_15_the_explorer_opens_on_a_setting_outside_its_menus(work, setting, field, shown, optional_import):
    optional_import("ipywidgets", "dev")
    from prodigy_core.explorer import explorer

    payload(work)
    widget = explorer(**setting)
    assert widget.controls[field].value == shown
    if "attack_params" in setting:
        assert parse_settings("attack_params", widget.controls["attack_params"].value) == {"eps": 1}
