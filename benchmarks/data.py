"""Time to produce one FedAVG round of training batches (N clients x E local steps x b images).

On-device path (prodigy_core.data.Federation): the dataset is one uint8 tensor; per step one (N, b) index
draw, one gather, batched random crop + flip and normalisation. Baseline (the authors' approach): one torch
DataLoader per client over the same uint8 arrays with torchvision's per-sample PIL transforms
(RandomCrop(32, padding=4), RandomHorizontalFlip, ToTensor, Normalize), as torchvision's CIFAR10 serves them.
Synthetic CIFAR-shaped data (50,000 x 3 x 32 x 32 uint8), so no download is needed.

    .venv/bin/python benchmarks/data.py [--device auto] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset, Subset
from torchvision import transforms

from prodigy_core.cli import count_arg
from prodigy_core.data import CIFAR10_MEAN, CIFAR10_STD, Federation, iid_split
from prodigy_core.seeding import resolve_device


class PilCifar(Dataset):
    """What torchvision's CIFAR10 does per sample: HWC uint8 -> PIL image -> transform."""

    def __init__(self, images_hwc: np.ndarray, labels: list[int], transform) -> None:
        self.images, self.labels, self.transform = images_hwc, labels, transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        return self.transform(Image.fromarray(self.images[i])), self.labels[i]


def time_rounds(methods: dict, rounds: int, device: torch.device) -> dict[str, float]:
    """Median seconds per round of each method after a warm-up; methods alternate round by round so that a
    change in machine load (shared CPU) hits all of them alike."""
    times: dict[str, list[float]] = {name: [] for name in methods}
    for r in range(rounds + 1):
        for name, one_round in methods.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            one_round()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if r > 0:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--samples", type=count_arg, default=50_000)
    parser.add_argument("--clients", type=count_arg, default=10)
    parser.add_argument("--steps", type=count_arg, default=10)
    parser.add_argument("--batch", type=count_arg, default=64)
    parser.add_argument("--rounds", type=count_arg, default=5)
    parser.add_argument("--threads", type=count_arg, help="torch CPU threads (default: torch's)")
    args = parser.parse_args()
    if args.samples // args.clients < args.steps * args.batch:  # a round's batches without repeats
        parser.error(f"--samples {args.samples} over --clients {args.clients} gives each client "
                     f"{args.samples // args.clients} images, fewer than --steps x --batch = "
                     f"{args.steps * args.batch}: give more samples or fewer steps")  # fmt: skip
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    n, b, steps = args.clients, args.batch, args.steps

    gen = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (args.samples, 3, 32, 32), dtype=torch.uint8, generator=gen)
    labels = torch.randint(0, 10, (args.samples,), generator=gen)
    parts = iid_split(args.samples, n, gen)

    fed = Federation(
        "cifar10",
        images.to(device),
        labels.to(device),
        [p.to(device) for p in parts],
        images[:1000].to(device),
        labels[:1000].to(device),
        10,
        CIFAR10_MEAN,
        CIFAR10_STD,
        augment=True,
    )
    fed_gen = fed.generators(0)

    def on_device_round() -> None:
        for _ in range(steps):
            idx, _mask = fed.sample_batch(b, fed_gen)
            fed.train_batch(idx, fed_gen)

    transform = transforms.Compose(
        [
            transforms.RandomCrop(32, padding=4),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            transforms.Normalize(CIFAR10_MEAN, CIFAR10_STD),
        ]
    )
    dataset = PilCifar(images.permute(0, 2, 3, 1).numpy(), labels.tolist(), transform)
    loaders = [DataLoader(Subset(dataset, p.tolist()), batch_size=b, shuffle=True) for p in parts]

    def dataloader_round() -> None:
        for loader in loaders:
            batches = iter(loader)
            for _ in range(steps):
                x, _y = next(batches)
                x.to(device)

    baseline = "per-client DataLoader + PIL transforms"
    times = time_rounds(
        {baseline: dataloader_round, "on-device Federation (this package)": on_device_round},
        args.rounds,
        device,
    )
    per_round = n * steps * b
    print(f"One FedAVG round of batches: N={n}, E={steps}, b={b} ({per_round} images) from {args.samples}")
    print(f"CIFAR-shaped uint8 images; device={device}, torch threads={torch.get_num_threads()}, median of")
    print(f"{args.rounds} alternating rounds after a warm-up")
    print(f"{'method':<44} {'ms/round':>10} {'images/s':>12} {'speed-up':>9}")
    for name, t in times.items():
        print(f"{name:<44} {1e3 * t:>10.2f} {per_round / t:>12,.0f} {times[baseline] / t:>8.1f}x")


if __name__ == "__main__":
    main()
