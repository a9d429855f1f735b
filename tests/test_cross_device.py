"""The cross-device reference's check (scripts/cross_device_reference.py) on a tiny digits reference made
here: a rerun with the other engine agrees to rounding, a changed round is named, and a reference with a
twin judges each measure against the twin's distance from it (the noise floor). The committed reference is
of the current key."""

import copy
import json
import math

import pytest
import torch

DIGITS = dict(dataset="digits", distribution="iid", defense="prodigy", attack="alie", n_clients=6,
              n_byzantine=2, local_steps=2, local_momentum=0.9, rounds=3, eval_every=1)  # fmt: skip


@pytest.fixture(scope="module")
def ref(scripts):
    return scripts("scripts/cross_device_reference.py")


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


def _twin(summary: dict, scale: float) -> dict:
    """`summary` with every client's update norm at every round x (1 + scale): a twin that far from it."""
    twin = copy.deepcopy(summary)
    twin["update_norms"] = [[v * (1 + scale) for v in row] for row in twin["update_norms"]]
    return twin


def test_a_twin_sets_the_floor_each_measure_is_judged_against(ref, pair):
    """The committed CIFAR-10 reference's two CPU engines part by 4e-3 (update norms, round 1): a device as
    far from the reference as the twin, or up to FLOOR_FACTOR times, agrees and the line says it is within
    the engines' own spread; beyond that it parts, with the spread named."""
    reference, found = pair
    with_twin = ref.reference_with_twin(reference, _twin(reference, 4e-3))
    assert ref.compare(found, with_twin)[0]  # within rounding stays "to rounding"
    agree, line = ref.compare(_twin(found, 6e-3), with_twin)
    assert agree and line.startswith("agrees within the CPU engines' own spread over 3 rounds"), line
    agree, line = ref.compare(_twin(found, 1e-2), with_twin)
    assert not agree and line.startswith("parts at round 1 of 3: update norms 1.0e-02 relative"), line
    assert "the CPU engines' own: 4.0e-03" in line
    # without a twin the same 6e-3 parts: RTOL is float32 rounding alone
    assert not ref.compare(_twin(found, 6e-3), reference)[0]


def test_a_choice_the_twin_made_differently_is_accepted(ref, pair):
    """Where the two CPU engines chose different zeroed clients or z (a near-tie rounding flipped), either
    choice agrees; a third does not."""
    reference, found = pair
    twin = copy.deepcopy(reference)
    twin["z"][1] = reference["z"][1] + 0.125
    with_twin = ref.reference_with_twin(reference, twin)
    moved = copy.deepcopy(found)
    moved["z"][1] = twin["z"][1]
    assert ref.compare(moved, with_twin)[0]
    moved["z"][1] = reference["z"][1] + 0.25
    assert ref.compare(moved, with_twin)[1].startswith("parts at round 2 of 3: z")


@pytest.mark.parametrize("dataset", ["cifar10", "femnist"])
def test_the_committed_reference_is_of_the_current_key(ref, dataset, request):
    """A change to what a key holds (a revision, a new field) leaves a committed reference naming another
    computation, and the GPU window's check would only say so: regenerate it with
    `python scripts/cross_device_reference.py DATASET` (2-5 minutes on a 2-core CPU). Its twin agrees with
    it by construction, and says whether beyond rounding."""
    from prodigy_core.config import RunConfig

    committed = json.loads(ref.reference_path(dataset).read_text(encoding="utf-8"))
    # FEMNIST's key holds its writers' ids and counts: read from the 24-writer folder (skipped without it)
    where = {"data_dir": str(request.getfixturevalue("femnist24_dir"))} if dataset == "femnist" else {}
    current = RunConfig(**ref.CONFIGS[dataset], device="cpu", **where).key()
    assert committed["key"] == current, (
        f"benchmarks/cross_device/{dataset}.json is of key {committed['key']}, the config's now {current}: "
        f"regenerate it with `python scripts/cross_device_reference.py {dataset}`"
    )
    assert committed["engine"] == "sequential" and committed["twin"]["engine"] == "batched"
    assert set(ref.MEASURES) <= committed["twin"].keys()
    assert ref.compare({**committed["twin"], "key": committed["key"]}, committed)[0]
