"""Per-round time of the training engines against an authors'-style loop, measured in one run.

Workloads (issue #6): digits N=10 E=10; FEMNIST CNN N=20 E=10; CIFAR-10 CNN N=10 E=10, b=64, FedAVG with a
plain average. FEMNIST and CIFAR-10 use synthetic data of the right shape (the speed does not depend on the
pixels; the CIFAR-10 path still augments on the device). Each workload runs with:
- batched: `prodigy_core.training.run(engine="batched")` (all clients in one vmapped step),
- sequential: the same `run` with the per-client reference loop,
- channels_last: the batched computation with the clients folded into grouped convolutions in channels-last
  format (`prodigy_core.step_variants`), the CPU's fastest for the digits model on an AVX-512 CPU,
- compiled (on a GPU, or with --compiled): the batched engine under torch.compile; its warm-up round, not
  timed, holds the compilation,
- authors: one nn.Module and torch.optim.SGD per client, a DataLoader over PIL images with torchvision
  transforms, updates flattened through numpy and averaged there (the structure of the authors' code).
A round is the clients' E local steps plus aggregation and the server step (evaluation excluded); the first
round of each engine is a warm-up and is not timed. On a CPU, `--cpu-steps` lowers E for the FEMNIST and
CIFAR-10 CNNs (a full E=10 round of either takes minutes there); the table says which E each row ran.

    python benchmarks/training.py                  # this machine's device
    python benchmarks/training.py --rounds 5       # more timed rounds
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F
import torchvision.transforms as T
from PIL import Image

from prodigy_core import local_training, training
from prodigy_core.cli import count_arg
from prodigy_core.config import RunConfig
from prodigy_core.data import CIFAR10_MEAN, CIFAR10_STD, FEMNIST_MEAN, FEMNIST_STD, Federation
from prodigy_core.models import make_model
from prodigy_core.seeding import resolve_device

LOAD_FEDERATION = training.run_federation
WORKLOADS = [  # dataset, N, E, samples per client
    ("digits", 10, 10, None),
    ("femnist", 20, 10, 200),
    ("cifar10", 10, 10, 640),
]


def synthetic_federation(dataset: str, n_clients: int, per_client: int, device: torch.device) -> Federation:
    """Random images of the dataset's shape and dtype, IID labels, `per_client` samples per client."""
    gen = torch.Generator().manual_seed(0)
    m = n_clients * per_client
    if dataset == "cifar10":
        images = torch.randint(0, 256, (m + 500, 3, 32, 32), dtype=torch.uint8, generator=gen)
        classes, mean, std, augment = 10, CIFAR10_MEAN, CIFAR10_STD, True
    else:
        images = torch.rand(m + 500, 1, 28, 28, generator=gen)
        classes, mean, std, augment = 62, FEMNIST_MEAN, FEMNIST_STD, False
    labels = torch.randint(0, classes, (m + 500,), generator=gen)
    parts = [torch.arange(k * per_client, (k + 1) * per_client, device=device) for k in range(n_clients)]
    return Federation(dataset, images[:m].to(device), labels[:m].to(device), parts, images[m:].to(device),
                      labels[m:].to(device), classes, mean, std, augment=augment)  # fmt: skip


def time_engine(cfg: RunConfig, rounds: int) -> list[float]:
    """Seconds per round of `training.run` (warm-up round dropped)."""
    result = training.run(
        cfg.replace(rounds=rounds + 1, eval_every=rounds + 1), progress=False, sync_timing=True
    )
    return result.round_times[1:]


# ------------------------------------------------------------------------------------ authors'-style loop
class PILDataset(torch.utils.data.Dataset):
    """One client's samples as PIL images through torchvision transforms, like the authors' data pipeline."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, transform: T.Compose) -> None:
        self.images, self.labels, self.transform = images, labels, transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.transform(Image.fromarray(self.images[i])), int(self.labels[i])


def authors_style_rounds(fed: Federation, dataset: str, steps: int, batch_size: int, rounds: int,
                         device: torch.device) -> list[float]:  # fmt: skip
    """FedAVG with one model, optimiser and DataLoader per client; seconds per round (warm-up dropped)."""
    if dataset == "cifar10":
        transform = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), T.ToTensor(),
                               T.Normalize(CIFAR10_MEAN, CIFAR10_STD)])  # fmt: skip
        pixels = fed.train_images.permute(0, 2, 3, 1).cpu().numpy()  # HWC uint8 for PIL
    else:
        transform = T.Compose([T.ToTensor(), T.Normalize(fed.mean, fed.std)])
        pixels = (fed.train_images[:, 0] * 255).to(torch.uint8).cpu().numpy()  # grayscale "L" images
    labels = fed.train_labels.cpu().numpy()
    loaders = [torch.utils.data.DataLoader(PILDataset(pixels[ix.cpu().numpy()], labels[ix.cpu().numpy()],
                                                      transform), batch_size=batch_size, shuffle=True)
               for ix in fed.client_indices]  # fmt: skip
    server = make_model(dataset).to(device)
    clients = [copy.deepcopy(server) for _ in loaders]
    optimisers = [torch.optim.SGD(c.parameters(), lr=0.05) for c in clients]
    times = []
    for _ in range(rounds + 1):
        tic = time.perf_counter()
        updates = []
        for client, optimiser, loader in zip(clients, optimisers, loaders, strict=True):
            client.load_state_dict(server.state_dict())
            client.train()
            batches = iter(loader)
            for _ in range(steps):
                try:
                    x, y = next(batches)
                except StopIteration:
                    batches = iter(loader)
                    x, y = next(batches)
                optimiser.zero_grad()
                F.cross_entropy(client(x.to(device)), y.to(device)).backward()
                optimiser.step()
            updates.append(np.concatenate([p.detach().cpu().numpy().ravel() for p in client.parameters()]))
        average = torch.from_numpy(np.mean(updates, axis=0)).to(device)
        torch.nn.utils.vector_to_parameters(average, server.parameters())
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - tic)
    return times[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--rounds", type=count_arg, help="timed rounds (default: 5 on GPU, 2 on CPU)")
    parser.add_argument("--cpu-steps", type=count_arg, default=2, help="E of the two paper CNNs on a CPU")
    parser.add_argument("--only", nargs="+", choices=[w[0] for w in WORKLOADS], help="datasets (default all)")
    parser.add_argument("--threads", type=count_arg, help="torch CPU threads (default: torch's)")
    parser.add_argument("--compiled", action=argparse.BooleanOptionalAction, default=None,
                        help="also time engine='compiled' (default: on a GPU only)")  # fmt: skip
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    rounds = args.rounds or (5 if device.type == "cuda" else 2)
    compiled = device.type == "cuda" if args.compiled is None else args.compiled
    cpu = f"CPU, {torch.get_num_threads()} threads"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu
    print(f"device: {name}; torch {torch.__version__}; median of {rounds} rounds after a warm-up; b=64\n")
    header = f"{'workload':<26} {'engine':<13} {'E':>3} {'s/round':>9} {'images/s':>10} {'vs authors':>11}"
    print(header + "\n" + "-" * len(header))
    for dataset, n, steps, per_client in WORKLOADS:
        if args.only and dataset not in args.only:
            continue
        if dataset != "digits" and device.type == "cpu":
            steps = args.cpu_steps
        distribution = "natural" if dataset == "femnist" else "iid"
        cfg = RunConfig(dataset=dataset, distribution=distribution, n_clients=n, n_byzantine=0,
                        defense="average", local_steps=steps, device=str(device))  # fmt: skip
        if per_client is None:
            fed = LOAD_FEDERATION(cfg.resolved(), device)
        else:
            fed = synthetic_federation(dataset, n, per_client, device)
        training.run_federation = lambda cfg, device, fed=fed: fed  # run() on this federation
        try:
            engines = ["batched", "sequential", "channels_last"] + (["compiled"] if compiled else [])
            times = {engine: time_engine(cfg.replace(engine=engine), rounds) for engine in engines}
            times["authors"] = authors_style_rounds(fed, dataset, steps, cfg.batch_size, rounds, device)
        finally:
            training.run_federation = LOAD_FEDERATION
        images = sum(min(cfg.batch_size, len(ix)) for ix in fed.client_indices) * steps
        authors = statistics.median(times["authors"])
        label = f"{dataset} N={n}" + (" (synthetic)" if per_client else "")
        for engine, ts in times.items():
            t = statistics.median(ts)
            print(f"{label:<26} {engine:<13} {steps:>3} {t:>9.3f} {images / t:>10.0f} {authors / t:>10.1f}x")
        ratio = statistics.median(times["sequential"]) / statistics.median(times["batched"])
        fastest = min((e for e in times if e != "authors"), key=lambda e: statistics.median(times[e]))
        auto = local_training.pick_engine("auto", device, dataset)
        print(f"{'':<26} batched vs sequential: {ratio:.2f}x; fastest: {fastest}; engine='auto' picks {auto}")


if __name__ == "__main__":
    main()
