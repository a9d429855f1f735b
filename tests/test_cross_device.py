"""The cross-device reference's check (scripts/cross_device_reference.py) on a tiny digits reference made
here: a rerun with the other engine agrees to rounding, and a changed round is named."""

import copy
import importlib.util
import math
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DIGITS = dict(dataset="digits", distribution="iid", defense="prodigy", attack="alie", n_clients=6,
              n_byzantine=2, local_steps=2, local_momentum=0.9, rounds=3, eval_every=1)  # fmt: skip


@pytest.fixture(scope="module")
def ref():
    spec = importlib.util.spec_from_file_location(
        "cross_device", ROOT / "scripts" / "cross_device_reference.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def pair(ref):
    return ref.summarise(DIGITS, engine="sequential"), ref.summarise(DIGITS, engine="batched")


def test_a_rerun_with_the_other_engine_agrees_to_rounding(ref, pair):
    reference, found = pair
    assert len(reference["update_norms"]) == 3 and len(reference["update_norms"][0]) == 6
    assert len(reference["projections"]) == ref.PROJECTIONS and reference["engine"] == "sequential"
    agree, line = ref.compare(found, reference)
    assert agree and line.startswith("agrees to rounding over 3 rounds"), line


@pytest.mark.parametrize(
    "change, expected",
    [
        (lambda s: s["zeroed_clients"][1].append(5), "parts at round 2 of 3: zeroed"),
        (lambda s: s["z"].__setitem__(2, 0.5), "parts at round 3 of 3: z"),
        (
            lambda s: s["update_norms"][0].__setitem__(3, s["update_norms"][0][3] * 1.01),
            "parts at round 1 of 3",
        ),
        (
            lambda s: s["projections"].__setitem__(0, s["projections"][0] + 1.0),
            "parts after round 3: projections",
        ),
        (lambda s: s.__setitem__("key", "0" * 16), "another computation"),
    ],
)
def test_a_changed_summary_is_named_at_the_round_where_it_parts(ref, pair, change, expected):
    reference, found = pair
    changed = copy.deepcopy(found)
    change(changed)
    agree, line = ref.compare(changed, reference)
    assert not agree and line.startswith(expected), line


def test_projections_are_a_seeded_gaussian_matrix_times_theta(ref):
    theta = torch.arange(5.0)
    gen = torch.Generator().manual_seed(0)
    matrix = torch.stack([torch.randn(5, generator=gen, dtype=torch.float64) for _ in range(3)])
    expected = (matrix @ theta.double() / math.sqrt(5)).tolist()
    assert ref.projections(theta, count=3) == pytest.approx(expected, rel=1e-12)
