"""The quickstart's cost: FLOPs per training image of the digits model (before/after), a round's time
against its compute floor, aten ops per local step, and the wall time of `prodigy-fl quickstart` (training
and report) on this machine. Run it on an idle machine; the floor and the timed rounds run at one thread
(what `--jobs auto` gives each run), whatever the process's thread count.

    python benchmarks/quickstart.py [--seeds N] [--flops-only] [--floor-only] [--rounds R]

The floor: a round's local training FLOPs (every client's E local steps, each on its own batch width: the
quickstart's first round drawn from its real split) over the best GFLOP/s the same CNN reaches on one
thread, a training step (forward + backward) on a large batch, measured in the same process. The round's
time / that floor is the ratio (1.0: a round costs only its FLOPs at the best rate this CPU gives the CNN).
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import tempfile
import time

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from prodigy_core import cli, local_training
from prodigy_core.models import DigitsCNN, _conv_bn_relu

FLOOR_BATCHES = (64, 256, 1024, 4096)  # the floor's rate: the best of these batch sizes' training steps
FLOOR_CASES = (("none", "none"), ("prodigy", "alie"))  # the round times measured: (defense, attack)


def first_digits_model() -> nn.Module:
    """The digits model before the quickstart was made cheaper: both convolutions at the full 8x8."""
    return nn.Sequential(_conv_bn_relu(1, 16), _conv_bn_relu(16, 32), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Dropout(0.25), nn.Linear(512, 64), nn.ReLU(), nn.Linear(64, 10))  # fmt: skip


def training_flops(model: nn.Module, batch: int, image: tuple[int, ...] = (1, 8, 8)) -> int:
    """Forward + backward FLOPs of one training step (cross-entropy) on a batch (torch.utils.flop_counter:
    convolutions and matrix products, 2 per multiply-add; the input's gradient is not computed)."""
    x = torch.randn(batch, *image)
    with FlopCounterMode(display=False) as counter:
        scores = model.train()(x)
        nn.functional.cross_entropy(scores, torch.randint(0, scores.shape[1], (batch,))).backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def training_flops_per_image(model: nn.Module, batch: int = 64) -> float:
    """`training_flops` per image."""
    return training_flops(model, batch) / batch


def round_flops(flops_per_image: float, widths: list[int]) -> float:
    """A round's local training FLOPs: every local step of every client, each on its batch width."""
    return flops_per_image * sum(widths)


def floor_ratio(round_seconds: float, flops: float, best_flops_per_second: float) -> float:
    """A round's time over its compute floor, flops / best_flops_per_second."""
    return round_seconds / (flops / best_flops_per_second)


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched inside it (forward, backward and optimizer ops alike)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def best_rate(
    model: nn.Module, batches: tuple[int, ...] = FLOOR_BATCHES, repeats: int = 5
) -> tuple[float, int]:
    """(best FLOP/s, its batch size) of a training step of `model` on random digits-shaped batches, the
    best of `repeats` timings per batch size after a warm-up step, in this process's thread count."""
    best = (0.0, batches[0])
    for b in batches:
        x, y = (
            torch.randn(b, 1, 8, 8).contiguous(memory_format=torch.channels_last),
            torch.randint(0, 10, (b,)),
        )
        flops, params = training_flops(model, b), list(model.parameters())
        seconds = []
        for _ in range(repeats + 1):
            tic = time.perf_counter()
            torch.autograd.grad(nn.functional.cross_entropy(model(x), y), params)
            seconds.append(time.perf_counter() - tic)
        best = max(best, (flops / min(seconds[1:]), b))
    return best


def quickstart_configs() -> dict[tuple[str, str], object]:
    """The quickstart's seed-0 configs of `FLOOR_CASES`."""
    from prodigy_core.experiments import load_experiment

    configs = load_experiment("quickstart_digits").configs
    return {(c.defense, c.attack): c for c in configs if (c.defense, c.attack) in FLOOR_CASES}


def first_round_widths(config) -> list[int]:  # noqa: ANN001
    """The batch width of every local step of every client that trains in the config's first round (its real
    split; idle Byzantine clients take no step: `training.RunState.idle`)."""
    from prodigy_core import training

    resolved = config.resolved()
    st = training.start_run(config, torch.device("cpu"), "sequential")
    widths = []
    for _ in range(resolved.local_steps):
        _, _, mask = local_training._draw_batch(st.fed, resolved.batch_size, st.streams, st.stream)
        widths += mask[st.idle :].sum(dim=1).tolist()
    return widths


def ops_per_step(config) -> float:  # noqa: ANN001
    """aten ops dispatched by one round's local training (the engine the quickstart uses on a CPU) per
    local step of one client: forward, backward, update, dropout masks and the round's bookkeeping."""
    from prodigy_core import training

    resolved = config.resolved()
    st = training.start_run(config, torch.device("cpu"), "sequential")
    with OpCounter() as counter:
        local_training.local_steps_sequential(st.model, st.fed, resolved.local_steps, 0.05, resolved,
                                              st.streams, stream=st.stream)  # fmt: skip
    return sum(counter.ops.values()) / (resolved.n_clients * resolved.local_steps)


def minor_faults() -> int:
    """The process's minor page faults so far (0 where `resource` does not exist: Windows)."""
    try:
        import resource
    except ImportError:
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def round_seconds(config, rounds: int) -> tuple[float, float]:  # noqa: ANN001
    """The median round time (record's round_times, the first left out) of a `rounds`-round run, and its
    minor page faults a round after the first (`training.keep_freed_memory`: a few dozen; glibc's defaults:
    thousands)."""
    from prodigy_core import training

    faults: list[int] = []
    result = training.run(config.replace(rounds=rounds, eval_every=rounds), progress=False,
                          on_round=lambda *args: faults.append(minor_faults()))  # fmt: skip
    per_round = (faults[-1] - faults[0]) / max(len(faults) - 1, 1)
    return statistics.median(result.round_times[1:]), per_round


def floor_report(rounds: int) -> list[str]:
    """Lines: the floor's rate, each case's round time against the floor, and ops per local step."""
    model = DigitsCNN().train()
    rate, batch = best_rate(model)
    per_image = training_flops_per_image(model)
    configs = quickstart_configs()
    lines = [f"compute floor: the best {rate / 1e9:.1f} GFLOP/s (DigitsCNN training step, batch {batch}, "
             f"{torch.get_num_threads()} thread(s))"]  # fmt: skip
    for (defense, attack), config in configs.items():
        flops = round_flops(per_image, first_round_widths(config))
        seconds, faults = round_seconds(config, rounds)
        ratio = floor_ratio(seconds, flops, rate)
        lines.append(f"round time {defense}/{attack}: {seconds:.3f} s = {ratio:.2f}x the floor "
                     f"({flops / 1e9:.2f} GFLOP of local training: {flops / rate:.3f} s; median of rounds "
                     f"2-{rounds}); "
                     f"{faults:,.0f} minor page faults a round")  # fmt: skip
    lines.append(f"aten ops per local step (one client): {ops_per_step(configs[FLOOR_CASES[0]]):.0f}")
    return lines


def machine() -> str:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"{os.cpu_count()} cores, torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}), "
            f"load average {load:.2f}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=cli.seeds_arg, default=1)
    parser.add_argument("--flops-only", action="store_true")
    parser.add_argument("--floor-only", action="store_true", help="the floor, ratios and ops; no quickstart")
    parser.add_argument("--rounds", type=cli.rounds_arg, default=6, help="rounds of each timed run")
    args = parser.parse_args(argv)
    if args.rounds < 2:  # the ratio is the median of rounds 2..R (the first is a cold start)
        parser.error(f"--rounds {args.rounds}: at least 2 (the median of rounds 2..R is timed), e.g. 6")
    before, after = training_flops_per_image(first_digits_model()), training_flops_per_image(DigitsCNN())
    print(
        f"FLOPs per training image: first model {before:,.0f}, DigitsCNN {after:,.0f} ({before / after:.1f}x)"
    )
    if args.flops_only:
        return 0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the floor and the rounds at one thread, as `--jobs auto` runs each run
    try:
        print("\n".join(floor_report(args.rounds)), f"\n{machine()}", flush=True)
    finally:
        torch.set_num_threads(threads)
    if args.floor_only:
        return 0
    with tempfile.TemporaryDirectory(prefix="quickstart-bench-") as tmp:
        argv = ["quickstart", "--seeds", str(args.seeds), "--results-dir", f"{tmp}/results",
                "--out-dir", f"{tmp}/figures"]  # fmt: skip
        tic = time.monotonic()
        code = cli.main(argv)
        seconds = time.monotonic() - tic
    print(f"prodigy-fl quickstart --seeds {args.seeds}: {seconds:.0f} s (training and report), {machine()}")
    return code


if __name__ == "__main__":
    sys.exit(main())
