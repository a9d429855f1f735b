"""The cross-device reference (issue 34): 3 rounds of CIFAR-10 (the JPEG copy), ProDiGy under ALIE, Dirichlet
0.1, FedAVG E=10, beta 0.9, seed 0, N=10 f=3, run on the CPU and summarised in a few KB that
`benchmarks/gpu_run.py` reproduces on the GPU as its first check (`compare`).

    python scripts/cross_device_reference.py [--data-dir DIR] [--out benchmarks/cross_device_reference.json]

One key names one computation on any device (`config.STREAMS_REVISION`), so the GPU's run must agree with
this one to float32 rounding: the same clients zeroed and the same z chosen every round, the per-round test
loss and every client's update norm within `RTOL`, and the final parameters' 64 fixed random projections
(Gaussian, seeded) within `RTOL`. The summary is computed by `summarise`, the check by `compare`.
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

REFERENCE = ROOT / "benchmarks" / "cross_device_reference.json"
PROJECTIONS, PROJECTION_SEED = 64, 0
# float32 rounding across devices and kernels after 3 rounds of 10 local steps (relative); anything larger
# is a different computation (or a near-tie that rounding flipped: the check names the round either way)
RTOL = 1e-3
CONFIG = dict(dataset="cifar10", data_source="cifar10-jpeg", defense="prodigy", attack="alie",
              distribution="dirichlet", dirichlet_alpha=0.1, n_clients=10, n_byzantine=3, local_steps=10,
              local_momentum=0.9, seed=0, rounds=3, eval_every=1)  # fmt: skip


def projections(theta: Any, count: int = PROJECTIONS, seed: int = PROJECTION_SEED) -> list[float]:
    """`count` fixed random projections of a parameter vector: row i of a (count, d) standard Gaussian matrix
    drawn row by row from a CPU generator seeded `seed`, dotted with theta in float64, / sqrt(d)."""
    import torch

    theta = theta.detach().double().cpu()
    gen = torch.Generator().manual_seed(seed)
    rows = (torch.randn(theta.numel(), generator=gen, dtype=torch.float64) for _ in range(count))
    return [float(row @ theta) / math.sqrt(theta.numel()) for row in rows]


def summarise(fields: dict[str, Any] = CONFIG, device: str = "cpu", **overrides: Any) -> dict[str, Any]:
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
    """(agree, one line): whether `found` reproduces `reference` to rounding (the same key; every round's
    zeroed clients and z equal, update norms within rtol (relative, as a vector), accuracy within 0.1
    points; the final loss and the projections within rtol), else the first round where they part and how."""
    if found["key"] != reference["key"]:
        return False, f"another computation: key {found['key']} != the reference's {reference['key']}"
    rounds, gaps = len(reference["update_norms"]), [0.0]
    for r in range(rounds):
        if r >= len(found["update_norms"]):
            return False, f"parts at round {r + 1}: the run stopped after {len(found['update_norms'])} rounds"
        what = []
        mine, theirs = found["zeroed_clients"][r : r + 1], reference["zeroed_clients"][r : r + 1]
        if mine != theirs:
            what.append(f"zeroed {mine} != {theirs}")
        if found["z"][r] != reference["z"][r]:
            what.append(f"z {found['z'][r]} != {reference['z'][r]}")
        gaps.append(_gap(found["update_norms"][r], reference["update_norms"][r]))
        if gaps[-1] > rtol:
            what.append(f"update norms {gaps[-1]:.1e} relative")
        if abs(found["accuracy"][r] - reference["accuracy"][r]) > 0.1:
            what.append(f"accuracy {found['accuracy'][r]:.2f} != {reference['accuracy'][r]:.2f}")
        if what:
            return False, f"parts at round {r + 1} of {rounds}: {'; '.join(what)}"
    for name in ("final_loss", "projections"):
        mine, theirs = found[name], reference[name]
        gaps.append(
            _gap(mine if isinstance(mine, list) else [mine], theirs if isinstance(theirs, list) else [theirs])
        )
        if gaps[-1] > rtol:
            return False, f"parts after round {rounds}: {name} {gaps[-1]:.1e} relative"
    return True, f"agrees to rounding over {rounds} rounds (largest relative difference {max(gaps):.1e})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", help="where the decoded JPEG copy is or goes (default: the data root)")
    p.add_argument("--out", type=Path, default=REFERENCE)
    args = p.parse_args(argv)
    from prodigy_core.data import CIFAR10_JPEG_ARCHIVE, decode_cifar10_jpeg

    overrides = {"data_dir": args.data_dir} if args.data_dir else {}
    decode_cifar10_jpeg(CIFAR10_JPEG_ARCHIVE, args.data_dir, progress=False)  # once; kept when decoded
    summary = summarise(**overrides)
    args.out.write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.out} (key {summary['key']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
