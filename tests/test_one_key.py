"""One results key, one computation: what changed a run's numbers but not its key (an audit, helper-33),
now either kept out of the run or in the key."""

import os
import shutil

import pytest
import torch

from prodigy_core import data, groups, training
from prodigy_core.config import ConfigError, RunConfig
from prodigy_core.seeding import precision_flags, precision_mode

TINY = dict(dataset="digits", n_clients=7, n_byzantine=2, defense="prodigy", attack="alie", rounds=2,
            local_steps=1, batch_size=16, eval_every=2, device="cpu", engine="batched")  # fmt: skip


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_run_inside_a_callers_autocast_is_refused(precision):
    """An fp32 run in a notebook cell under torch.autocast computed in bfloat16, was stored under its fp32
    key, and every later grid read it as fp32's (the audit: 12.53% where fp32 gives 12.26%)."""
    config = RunConfig(**TINY, precision=precision)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    with autocast, pytest.raises(ConfigError, match="inside torch.autocast"):
        training.run(config)
    with autocast, pytest.raises(ConfigError, match="start it outside the autocast block"):
        groups.run_group([config, config.replace(defense="median")])
    result = training.run(config)  # outside it, the same run trains to the end
    assert result.rounds_completed == config.rounds and not result.diverged


def test_a_leaf_file_changed_with_its_size_and_mtime_kept_moves_the_key_in_the_same_process(
    tmp_path, femnist_dir
):
    """The LEAF digests were cached per (path, mtime, size): a pixel changed in place with the mtime set
    back (`cp -p`, `tar x`) kept the old source in a long-lived kernel, while the loader read the new
    pixels. A fresh process keyed it anew; the same process now does too."""
    folder = tmp_path / "leaf"
    shutil.copytree(femnist_dir, folder)
    for path in folder.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    config = RunConfig(dataset="femnist", distribution="natural", n_clients=4, n_byzantine=1, device="cpu",
                       defense="median",
                       data_dir=str(folder))  # fmt: skip
    before = config.key()
    target = max((folder / "train").glob("*.json"), key=lambda p: p.stat().st_size)  # holds writers
    text, st = target.read_text(), target.stat()
    start = text.index('"x": [[') + len('"x": [[')
    end = text.index(",", start)
    value = text[start:end]
    ones, twos = "0." + "1" * (len(value) - 2), "0." + "2" * (len(value) - 2)
    other = ones if value != ones else twos  # the same length: the file keeps its size
    target.write_text(text[:start] + other + text[end:])
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert target.stat().st_size == st.st_size and target.stat().st_mtime_ns == st.st_mtime_ns
    after = config.key()
    assert after != before
    for cache in (data._leaf_file_digest, data._leaf_file_counts, data._read_femnist_writers):
        cache.cache_clear()
    assert config.key() == after  # what a cold process computes


@pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN:UserWarning")  # no Intel GPU
def test_the_callers_kernel_settings_are_in_the_record():
    """oneDNN off moved a test sample and the distances by 5e-4 (the audit); "medium" matmul precision lets
    a CPU's matmuls run in bfloat16. Settable by any caller, so each record says how they were."""
    config = RunConfig(**{**TINY, "rounds": 1})
    default = training.run(config).environment
    assert (default["mkldnn"], default["mkldnn_matmul"]) == (True, "ieee")
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("medium")
        with torch.backends.mkldnn.flags(enabled=False):
            changed = training.run(config).environment
    finally:
        torch.set_float32_matmul_precision(previous)
    assert (changed["mkldnn"], changed["mkldnn_matmul"]) == (False, "bf16")


@pytest.mark.filterwarnings("ignore::UserWarning")  # no CUDA, no Intel GPU: torch says so, and goes on
@pytest.mark.parametrize("setting", ["high", "medium"])
@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
def test_the_flags_are_read_after_a_caller_set_the_matmul_precision(setting, precision):
    """torch.get_float32_matmul_precision() raises once `precision_mode` set the CUDA flags the legacy way
    after the caller set them the new way: reading it failed every CUDA run (settable without a GPU)."""
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision(setting)
        with precision_mode(precision, torch.device("cuda")):
            flags = precision_flags(torch.device("cuda"))
    finally:
        torch.set_float32_matmul_precision(previous)
    assert flags["mkldnn_matmul"] == {"high": "tf32", "medium": "bf16"}[setting]
    assert flags["tf32_matmul"] is (precision == "tf32")
