"""Cost of one attack craft as a multiple of one server pipeline call (issue #4).

A search attack runs the pipeline once per candidate, so the goal is craft / pipeline <= candidates + 1.
Defaults: the paper's largest setting, N = 100 clients (f = 30) with FEMNIST-sized updates, d = 1,690,046.
The search scores its candidates from one Gram matrix of their points (a pipeline that gives weights, or
one led by NNM) or runs them as one batch (a coordinate-wise pipeline: median, trimmed mean, alone or after
NNM); ``1-by-1 s`` times the same craft with the pipeline run on each candidate instead (the route before
either), and ``speed-up`` is the ratio of the two, measured alternately in this run.

    python benchmarks/attacks.py                 # full size (about 2 GB of updates, minutes on a laptop CPU)
    python benchmarks/attacks.py --d 100000      # quick look
    python benchmarks/attacks.py --n 20 --f 4 --d 200000 --defenses nnm+trimmed_mean nnm+median median
    python benchmarks/attacks.py --n 20 --f 6 --attacks alie_spread --defenses prodigy nnm+trimmed_mean
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Iterator

import torch

from prodigy_core.aggregators import Pipeline, make_aggregator
from prodigy_core.attacks import LineSearchAttack, make_attack
from prodigy_core.cli import count_arg
from prodigy_core.seeding import resolve_device


def timed(fn, device: torch.device, repeats: int) -> tuple[float, object]:
    """Median wall time of ``fn()`` in seconds (synchronising a GPU) and its last result."""
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        result = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


@contextlib.contextmanager
def one_by_one() -> Iterator[None]:
    """The search as before batching: no Gram matrix of the candidates' points and no pipeline counted as
    coordinate-wise, so the pipeline runs on each candidate."""
    real, grams = Pipeline.coordinatewise, LineSearchAttack._candidate_grams
    Pipeline.coordinatewise = property(lambda self: False)  # type: ignore[method-assign, assignment]
    LineSearchAttack._candidate_grams = lambda *args: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        Pipeline.coordinatewise = real  # type: ignore[method-assign]
        LineSearchAttack._candidate_grams = grams  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=count_arg, default=100, help="clients N (Byzantine included)")
    parser.add_argument("--f", type=count_arg, default=30, help="Byzantine clients f")
    parser.add_argument("--d", type=count_arg, default=1_690_046, help="update size (FEMNIST CNN: 1,690,046)")
    parser.add_argument("--repeats", type=count_arg, default=3, help="timed repeats per measurement (median)")
    parser.add_argument("--device", default="auto")
    defenses = ["nnm+trimmed_mean", "nnm+krum", "nnm+cclip", "prodigy"]  # one per route of the search
    parser.add_argument("--defenses", nargs="+", default=defenses)
    parser.add_argument("--attacks", nargs="+", default=["alie", "foe_100"])
    args = parser.parse_args()
    if 2 * args.f >= args.n:
        parser.error(f"--f {args.f} with --n {args.n}: the Byzantine clients must be under half, f < N/2")
    for name in args.defenses:  # before the (N, d) updates are made, not after
        try:
            make_aggregator(name, args.f, n_clients=args.n)
        except ValueError as e:
            parser.error(f"--defenses {name}: {e}")
    for name in args.attacks:
        try:
            make_attack(name)
        except ValueError as e:
            parser.error(f"--attacks {name}: {e}")

    device = resolve_device(args.device)
    g = torch.Generator(device=device).manual_seed(0)
    honest = torch.randn(args.d, device=device, generator=g) + torch.randn(
        args.n - args.f, args.d, device=device, generator=g
    )
    own = honest[: args.f] + 0.1 * torch.randn(args.f, args.d, device=device, generator=g)
    X = torch.cat([own, honest])
    print(f"device={device} N={args.n} f={args.f} d={args.d:,} threads={torch.get_num_threads()}")
    header = ("defense", "attack", "cand.", "pipeline s", "attacked s", "craft s", "ratio", "goal",
              "1-by-1 s", "speed-up")  # fmt: skip
    print("{:<18} {:<11} {:>5} {:>10} {:>10} {:>9} {:>6} {:>5} {:>9} {:>8}".format(*header))
    for defense in args.defenses:
        server = make_aggregator(defense, args.f, n_clients=args.n)
        server.peek(X)  # warm-up (allocator, kernels)
        pipeline_s, _ = timed(lambda: server.peek(X), device, args.repeats)  # noqa: B023
        for name in args.attacks:
            attack = make_attack(name)
            candidates = len(attack.grid(args.n, args.f))
            craft = lambda: attack.craft(honest, own, server)  # noqa: B023, E731
            craft_s, byzantine = timed(craft, device, args.repeats)
            old = ""
            if isinstance(attack, LineSearchAttack):  # alternately, so that a drift in speed hits both
                batched, single = [], []
                for _ in range(args.repeats):
                    batched.append(timed(craft, device, 1)[0])
                    with one_by_one():
                        single.append(timed(craft, device, 1)[0])
                craft_s, single_s = statistics.median(batched), statistics.median(single)
                old = f"{single_s:>9.3f} {single_s / craft_s:>7.1f}x"
            # The pipeline's own cost can depend on its input (e.g. recentring around a far outlier).
            attacked = torch.cat([byzantine, honest])
            attacked_s, _ = timed(lambda: server.peek(attacked), device, args.repeats)  # noqa: B023
            print(
                f"{defense:<18} {name:<11} {candidates:>5} {pipeline_s:>10.3f} {attacked_s:>10.3f} "
                f"{craft_s:>9.3f} {craft_s / pipeline_s:>6.2f} {candidates + 1:>5} {old}"
            )
    print("ratio = craft s / pipeline s (one pipeline call on the round's honest-looking input);")
    print("attacked s = one pipeline call on the crafted input; goal = candidates + 1 pipeline calls;")
    print("1-by-1 s = the craft running the pipeline on each candidate; speed-up = 1-by-1 s / craft s")


if __name__ == "__main__":
    main()
