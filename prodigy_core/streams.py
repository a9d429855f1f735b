"""A run's random streams, the same on every device and in every engine (`config.STREAMS_REVISION`).

Client k's batches (indices, or the ``authors`` epoch shuffles) and augmentation (crop offsets, flips) come
from its own CPU generator, seeded with `mix(seed, k)`, in the order it takes its local steps; they are small
and move to the device as tensors. Dropout masks are large (CIFAR-10: about 10 M entries per layer per local
step of 10 clients), so drawing them on a CPU and copying them would cost a GPU its throughput; they are
instead a counter-based draw: entry i of the mask of layer l at client k's local step c keeps its unit when
the uniform of `hash(seed, k, c, l, i)` is >= p. The hash is splitmix64's finaliser on int64 tensors, whose
additions, multiplications, xors and shifts wrap identically on a CPU and a GPU, so every device computes the
same bits, whatever engine groups the clients (`tests/test_streams.py` checks it against pure Python).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

MASK64 = 2**64 - 1
GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment
MIX1, MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
# the dropout streams (clients' local steps, the ``authors`` train-mode evaluation) and the attack's generator
TRAIN, EVAL, ATTACK = 1, 2, 3


def mix(*words: int) -> int:
    """splitmix64 of the words folded in order, as an unsigned 64-bit Python int: the key of one stream."""
    z = 0
    for w in words:
        z = _finalise((z ^ (w & MASK64)) + GOLDEN & MASK64)
    return z


def _finalise(z: int) -> int:
    z = (z ^ (z >> 30)) * MIX1 & MASK64
    z = (z ^ (z >> 27)) * MIX2 & MASK64
    return z ^ (z >> 31)


def _signed(c: int) -> int:
    return c - 2**64 if c >= 2**63 else c


def _shr(z: Tensor, s: int) -> Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def uniforms(keys: Tensor, count: int) -> Tensor:
    """(len(keys), count) float32 uniforms in [0, 1): entry i of row j is the top 24 bits of the splitmix64
    output finalise(keys[j] + (i + 1) * GOLDEN), every operation in wrapping int64."""
    z = keys[:, None] + torch.arange(1, count + 1, device=keys.device, dtype=torch.int64) * _signed(GOLDEN)
    z = (z ^ _shr(z, 30)) * _signed(MIX1)
    z = (z ^ _shr(z, 27)) * _signed(MIX2)
    z = z ^ _shr(z, 31)
    return _shr(z, 40).to(torch.float32) * 2.0**-24


def dropout_mask(keys: Tensor, shape: tuple[int, ...], p: float, dtype: torch.dtype) -> Tensor:
    """(len(keys), *shape) dropout masks, 1 / (1 - p) where the row's uniform is >= p, else 0."""
    n = 1
    for s in shape:
        n *= s
    keep = uniforms(keys, n) >= p
    return keep.to(dtype).mul_(1.0 / (1.0 - p)).view(len(keys), *shape)


class ClientStreams:
    """One run's streams: client k's CPU generator `gens[k]` (batches, augmentation), the dropout keys and
    `attack`, the CPU generator of an attack's own draws (gaussian's noise, moved to the device).

    Client k's training masks at local step c, layer l have the key mix(client_keys[k], c, l), with
    client_keys[k] = mix(seed, TRAIN, k); an evaluation after round r (``authors``: train mode) uses
    mix(eval_key(r), j, l) for test batch j. `step` counts the local steps taken so far (every client takes
    each one); the checkpoint keeps it with the generators' states (`state_dict`)."""

    def __init__(self, seed: int, n_clients: int) -> None:
        self.seed, self.step = seed, 0
        self.gens = [torch.Generator().manual_seed(mix(seed, k) >> 1) for k in range(n_clients)]
        self.client_keys = [mix(seed, TRAIN, k) for k in range(n_clients)]
        self.attack = torch.Generator().manual_seed(mix(seed, ATTACK) >> 1)

    def eval_key(self, r: int) -> int:
        """The key of the evaluation after round r."""
        return mix(self.seed, EVAL, r)

    @staticmethod
    def keys(prefixes: Sequence[int], counter: int, layer: int, device: torch.device) -> Tensor:
        """(len(prefixes),) int64 keys mix(prefix, counter, layer): the rows of one layer's masks."""
        words = [_signed(mix(p, counter, layer)) for p in prefixes]
        return torch.tensor(words, dtype=torch.int64).to(device)

    def state_dict(self) -> dict[str, Tensor]:
        return {"gens": torch.stack([g.get_state() for g in self.gens]), "step": torch.tensor(self.step),
                "attack": self.attack.get_state()}  # fmt: skip

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        gens = state["gens"]
        if gens.shape[0] != len(self.gens):
            raise ValueError(f"streams of {gens.shape[0]} clients do not fit {len(self.gens)}")
        for g, s in zip(self.gens, gens, strict=True):
            g.set_state(s.cpu().clone())
        self.step = int(state["step"])
        self.attack.set_state(state["attack"].cpu().clone())


__all__ = ["ClientStreams", "dropout_mask", "uniforms", "mix", "TRAIN", "EVAL"]
