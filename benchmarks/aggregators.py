"""Time every server pipeline on paper-sized updates and compare with two references measured in the same run.

For each (N, d) it prints: the time of one aggregation; its ratio to one Gram matrix product G @ G.T (the
floor: the distance-based rules need at least that), the floor being timed alternately with each pipeline;
the speed-up over a pairwise loop of vector norms in the style of the authors' public code (timed on a subset
of the pairs and extrapolated when there are many); the peak extra memory (CUDA allocator peak on a GPU;
sampled resident set size on a CPU); and the fixed cost of a call, the same pipeline at d = 1000, which is
what small N on a fast device is made of (the N x N algebra on the host, kernel launches, waits).

    .venv/bin/python benchmarks/aggregators.py [--device auto|cpu|cuda] [--sizes 10x1310922,100x1690046]
                                               [--pipelines prodigy nnm+krum]
"""

from __future__ import annotations

import argparse
import itertools
import threading
import time

import torch

from prodigy_core.aggregators import make_aggregator
from prodigy_core.seeding import resolve_device

SIZES = [(10, 1_310_922), (20, 1_690_046), (100, 1_690_046)]  # CIFAR-10 CNN and FEMNIST CNN sizes
F_FOR_N = {10: 3, 20: 4, 100: 30}  # the paper's f for each N
PIPELINES = [
    "average", "median", "trimmed_mean", "geomed", "krum", "multikrum", "bulyan", "cclip", "prodigy",
    "nnm+median", "nnm+trimmed_mean", "nnm+geomed", "nnm+krum", "nnm+cclip", "bucketing+krum",
]  # fmt: skip
LOOP_PAIRS = 200  # pairs timed for the pairwise-loop reference
FIXED_COST_D = 1000  # "fixed ms": the pipeline at this d, its per-call cost of small ops, launches and syncs


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class PeakMemory:
    """Peak extra memory (bytes) of the block: CUDA allocator peak, or RSS sampled each ms on CPU."""

    def __init__(self, device: torch.device):
        self.device, self.peak = device, 0

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._rss() - self.base)
            time.sleep(0.001)

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        else:
            self.base, self._stop = self._rss(), threading.Event()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            self.peak = torch.cuda.max_memory_allocated(self.device) - self.base
        else:
            self._stop.set()
            self._thread.join()


def timed(fn, device: torch.device, floor=None) -> tuple[float, float | None, int]:
    """Best wall time of ``fn`` over a few runs (after a warm-up); with ``floor``, the best time of that
    reference too, run alternately with ``fn`` so that both see the same machine (a noisy CPU drifts by 20%
    within minutes); and the peak extra memory of one more run of ``fn``. The CPU's memory sampler is a
    Python thread that competes for the GIL and a core, so it never runs while timing."""

    def once(f) -> float:
        sync(device)
        start = time.perf_counter()
        f()
        sync(device)
        return time.perf_counter() - start

    best = once(fn)
    best_floor = None if floor is None else once(floor)
    for _ in range(3 if best < 1.0 else 1):
        best = min(best, once(fn))
        if floor is not None:
            best_floor = min(best_floor, once(floor))
    with PeakMemory(device) as memory:
        fn()
        sync(device)
    return best, best_floor, memory.peak


def pairwise_loop(G: torch.Tensor, pairs: list[tuple[int, int]]) -> torch.Tensor:
    """The authors' style: one vector norm per pair of clients, in a Python double loop."""
    D = torch.zeros(G.shape[0], G.shape[0])
    for i, j in pairs:
        D[i, j] = D[j, i] = torch.norm(G[i] - G[j]).item() ** 2
    return D


def sizes_arg(text: str) -> list[tuple[int, int]]:
    """--sizes: comma-separated NxD, N >= 2 clients and D >= 1 coordinates each."""
    try:
        sizes = [tuple(int(v) for v in s.split("x")) for s in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or any(len(s) != 2 or s[0] < 2 or s[1] < 1 for s in sizes):
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated NxD, N >= 2 and D >= 1, e.g. 20x1690046")
    return sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--sizes", type=sizes_arg, default=",".join(f"{n}x{d}" for n, d in SIZES))
    parser.add_argument("--pipelines", nargs="*", default=PIPELINES, help="default: all")
    args = parser.parse_args()
    device = resolve_device(args.device)
    sizes = args.sizes
    name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"CPU, {torch.get_num_threads()} threads"
    )
    print(f"device: {device} ({name}), torch {torch.__version__}, float32")
    for N, d in sizes:
        f = F_FOR_N.get(N, (N - 1) // 3)
        G = torch.randn(N, d, generator=torch.Generator().manual_seed(0)).to(device) + 0.5
        floor = lambda G=G: G @ G.T  # noqa: E731
        pairs = list(itertools.combinations(range(N), 2))
        subset = pairs[:: max(1, len(pairs) // LOOP_PAIRS)][:LOOP_PAIRS]
        loop, gram, _ = timed(lambda G=G, subset=subset: pairwise_loop(G, subset), device, floor)
        loop *= len(pairs) / len(subset)
        note = "" if len(subset) == len(pairs) else f", extrapolated from {len(subset)} of {len(pairs)} pairs"
        print(f"\nN={N}, d={d:,}, f={f}: Gram floor {gram * 1e3:.1f} ms, pairwise loop {loop:.2f} s{note}")
        print(f"{'pipeline':<18} {'time ms':>9} {'x Gram':>7} {'loop/time':>9} {'peak extra MB':>14} "
              f"{'fixed ms':>9}")  # fmt: skip
        tiny = G[:, :FIXED_COST_D].clone()  # the same N at a negligible d: the cost that does not scale
        for pipeline_name in args.pipelines:
            try:
                pipeline = make_aggregator(pipeline_name, f, n_clients=N)
            except ValueError as e:
                print(f"{pipeline_name:<18} {'n/a':>9}  ({str(e).split(': ', 1)[1]})")
                continue
            seconds, local_floor, peak = timed(lambda G=G, p=pipeline: p.peek(G), device, floor)
            fixed = timed(lambda p=pipeline, tiny=tiny: p.peek(tiny), device)[0]
            print(
                f"{pipeline_name:<18} {seconds * 1e3:>9.1f} {seconds / local_floor:>7.2f} "
                f"{loop / seconds:>9.1f} {peak / 2**20:>14.0f} {fixed * 1e3:>9.2f}"
            )
        del G


if __name__ == "__main__":
    main()
