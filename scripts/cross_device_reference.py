"""The cross-device references (issue 34): 3 rounds of ProDiGy under ALIE at the paper's shape of each
dataset a GPU window trains, run on the CPU and summarised in a few KB that `benchmarks/gpu_run.py`
reproduces on the GPU as the first check of that dataset (`compare`): CIFAR-10 (the JPEG copy, Dirichlet
0.1, N=10 f=3) and FEMNIST (the 24-writer LEAF folder, N=20 f=6), FedAVG E=10, beta 0.9, seed 0.

    python scripts/cross_device_reference.py DATASET [--data-dir DIR] [--out FILE]

One key names one computation on any device (`config.STREAMS_REVISION`), so the GPU's run must agree with
this one to float32 rounding: the same clients zeroed and the same z chosen every round, the per-round test
accuracy, every client's update norm and the final parameters' 64 fixed random projections (Gaussian,
seeded) within max(`RTOL`, `autotune.FLOOR_FACTOR` x the same measure between the two CPU engines). The
reference is the sequential engine's run; its `twin`, the batched engine's run of the same key on the same
CPU, is the noise floor: on this CNN (BatchNorm, dropout, crops and flips, 10 local steps) the two CPU
engines already part by 4e-3 in the update norms after one round, so a device is judged against that
spread, not against a tolerance rounding alone exceeds. `summarise` makes a summary, `compare` checks one.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # runs from a source tree, no install needed

from benchmarks.autotune import FLOOR_FACTOR  # noqa: E402 - a measure's bound over its floor, as the gate's

REFERENCES = ROOT / "benchmarks" / "cross_device"  # <dataset>.json
PROJECTIONS, PROJECTION_SEED = 64, 0
# float32 rounding across devices and kernels (relative): the bound where the reference has no twin (the
# digits check of `gpu_run.py --simulate`, whose engines agree to 1e-8); with a twin, the larger of this and
# FLOOR_FACTOR x the twin's distance from the reference
RTOL = 1e-3
ACCURACY_POINTS = 0.1  # the same for the test accuracy, in points
MEASURES = ("update_norms", "zeroed_clients", "z", "accuracy", "final_loss", "projections")  # a twin's
COMMON = dict(defense="prodigy", attack="alie", local_steps=10, local_momentum=0.9, seed=0, rounds=3,
              eval_every=1)  # fmt: skip
# fmt: off
CONFIGS = {
    "cifar10": dict(dataset="cifar10", data_source="cifar10-jpeg", distribution="dirichlet",
                    dirichlet_alpha=0.1, n_clients=10, n_byzantine=3, **COMMON),
    # Table II's writers: the first 20 with >= 350 samples (the key holds their ids and counts, not the path)
    "femnist": dict(dataset="femnist", distribution="natural", n_clients=20, n_byzantine=6,
                    femnist_min_writer_samples=350, **COMMON),
}
# fmt: on


def reference_path(dataset: str) -> Path:
    return REFERENCES / f"{dataset}.json"


def projections(theta: Any, count: int = PROJECTIONS, seed: int = PROJECTION_SEED) -> list[float]:
    """`count` fixed random projections of a parameter vector: row i of a (count, d) standard Gaussian matrix
    drawn row by row from a CPU generator seeded `seed`, dotted with theta in float64, / sqrt(d)."""
    import torch

    theta = theta.detach().double().cpu()
    gen = torch.Generator().manual_seed(seed)
    rows = (torch.randn(theta.numel(), generator=gen, dtype=torch.float64) for _ in range(count))
    return [float(row @ theta) / math.sqrt(theta.numel()) for row in rows]


def summarise(fields: dict[str, Any], device: str = "cpu", **overrides: Any) -> dict[str, Any]:
    """Run the reference config (`fields` with `overrides`) on `device`; its summary: per round the test
    loss, every client's update norm (the server input's rows), the zeroed clients and the chosen z; the
    final parameters' projections; the config's key."""
    import torch
    from torch.nn.utils import parameters_to_vector

    from prodigy_core import training
    from prodigy_core.config import RunConfig

    config = RunConfig(**{**fields, **overrides, "device": device})
    norms: list[list[float]] = []
    kept: dict[str, Any] = {}

    def on_round(r: int, updates: Any, *_: Any) -> None:
        norms.append(torch.linalg.vector_norm(updates.double(), dim=1).tolist())

    finish = training.finish_run

    def keep(st: Any, keep_checkpoint: bool = False) -> Any:
        kept["theta"] = parameters_to_vector(st.model.parameters()).detach()
        return finish(st, keep_checkpoint)

    training.finish_run = keep  # the final model, which the record does not hold
    try:
        result = training.run(config, progress=False, on_round=on_round)
    finally:
        training.finish_run = finish
    return {"key": config.key(), "config": {k: v for k, v in config.to_dict().items() if k in fields},
            "device": result.environment.get("device"), "engine": result.environment.get("engine"),
            "update_norms": norms, "zeroed_clients": result.zeroed_clients, "z": result.attack_params,
            "accuracy": [a for _, a in result.accuracy_curve], "final_loss": result.final_loss,
            "projections": projections(kept["theta"])}  # fmt: skip


def _gap(a: list[float], b: list[float]) -> float:
    """norm(a - b) / norm(b) (inf when the lengths differ)."""
    if len(a) != len(b):
        return math.inf
    return math.dist(a, b) / max(math.hypot(*b), 1e-30)


def compare(found: dict[str, Any], reference: dict[str, Any], rtol: float = RTOL) -> tuple[bool, str]:
    """(agree, one line): whether `found` reproduces `reference` (the same key; every round's zeroed clients
    and z equal to the reference's or its twin's; the update norms (relative, as a vector) within max(rtol,
    FLOOR_FACTOR x the twin's distance from the reference at that round), the accuracy within
    max(ACCURACY_POINTS, FLOOR_FACTOR x the twin's largest distance in any round); the final loss and the
    projections as the norms), else the first round where they part and how."""
    if found["key"] != reference["key"]:
        return False, f"another computation: key {found['key']} != the reference's {reference['key']}"
    twin = reference.get("twin") or reference  # no twin: a floor of 0

    def bound(tolerance: float, spread: float) -> float:
        return max(tolerance, FLOOR_FACTOR * spread)

    rounds, worst = len(reference["update_norms"]), []  # worst: (measured, its spread), every measure
    # a test accuracy moves by whole images (one of FEMNIST's 772 is 0.13 points): its floor is the largest
    # difference the twin showed in any round
    accuracy_spread = max(abs(a - b) for a, b in zip(twin["accuracy"], reference["accuracy"], strict=True))
    most_points = 0.0
    for r in range(rounds):
        if r >= len(found["update_norms"]):
            return False, f"parts at round {r + 1}: the run stopped after {len(found['update_norms'])} rounds"
        what = []
        mine = found["zeroed_clients"][r : r + 1]
        if mine not in (reference["zeroed_clients"][r : r + 1], twin["zeroed_clients"][r : r + 1]):
            what.append(f"zeroed {mine} != {reference['zeroed_clients'][r : r + 1]}")
        if found["z"][r] not in (reference["z"][r], twin["z"][r]):
            what.append(f"z {found['z'][r]} != {reference['z'][r]}")
        gap = _gap(found["update_norms"][r], reference["update_norms"][r])
        spread = _gap(twin["update_norms"][r], reference["update_norms"][r])
        worst.append((gap, spread))
        if gap > bound(rtol, spread):
            what.append(f"update norms {gap:.1e} relative{_spread(spread)}")
        points = abs(found["accuracy"][r] - reference["accuracy"][r])
        most_points = max(most_points, points)
        if points > bound(ACCURACY_POINTS, accuracy_spread):
            what.append(f"accuracy {found['accuracy'][r]:.2f} != {reference['accuracy'][r]:.2f}")
        if what:
            return False, f"parts at round {r + 1} of {rounds}: {'; '.join(what)}"
    for name in ("final_loss", "projections"):
        mine, theirs, other = (_listed(s[name]) for s in (found, reference, twin))
        gap, spread = _gap(mine, theirs), _gap(other, theirs)
        worst.append((gap, spread))
        if gap > bound(rtol, spread):
            return False, f"parts after round {rounds}: {name} {gap:.1e} relative{_spread(spread)}"
    gap, spread = max(worst)
    if gap <= rtol and most_points <= ACCURACY_POINTS:
        return True, f"agrees to rounding over {rounds} rounds (largest relative difference {gap:.1e})"
    return True, (
        f"agrees within the CPU engines' own spread over {rounds} rounds (largest relative difference "
        f"{gap:.1e}, theirs {spread:.1e}; accuracy {most_points:.2f} points apart at most, theirs "
        f"{accuracy_spread:.2f})"
    )


def _listed(value: Any) -> list[float]:
    return value if isinstance(value, list) else [value]


def _spread(spread: float) -> str:
    return f" (the CPU engines' own: {spread:.1e})" if spread else ""


def reference_with_twin(reference: dict[str, Any], twin: dict[str, Any]) -> dict[str, Any]:
    """The committed file: the sequential engine's summary with the batched engine's measures as its twin."""
    if twin["key"] != reference["key"]:
        raise ValueError(f"the twin's key {twin['key']} is not the reference's {reference['key']}")
    return {**reference, "twin": {"engine": twin["engine"], **{k: twin[k] for k in MEASURES}}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dataset", choices=sorted(CONFIGS))
    p.add_argument("--data-dir", help="cifar10: where the decoded JPEG copy is or goes (default: the data "
                   "root); femnist: the LEAF folder (default: `prodigy-fl data femnist`'s)")  # fmt: skip
    p.add_argument("--out", type=Path, help="default: benchmarks/cross_device/<dataset>.json")
    args = p.parse_args(argv)
    from prodigy_core.cli import check_out
    from prodigy_core.data import CIFAR10_JPEG_ARCHIVE, decode_cifar10_jpeg

    out = args.out or reference_path(args.dataset)
    check_out(p, out, f"benchmarks/cross_device/{args.dataset}.json")  # before the training, not after
    overrides = {"data_dir": args.data_dir} if args.data_dir else {}
    fields = CONFIGS[args.dataset]
    try:  # a data folder that is missing, malformed or not a folder: one line (DataError is a ValueError)
        if args.dataset == "cifar10":
            decode_cifar10_jpeg(CIFAR10_JPEG_ARCHIVE, args.data_dir, progress=False)  # kept once decoded
        summary = reference_with_twin(summarise(fields, **overrides, engine="sequential"),
                                      summarise(fields, **overrides, engine="batched"))  # fmt: skip
    except (ValueError, OSError) as e:
        raise SystemExit(f"cross_device_reference: {args.dataset}: {e}") from None
    out.write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {out} (key {summary['key']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
