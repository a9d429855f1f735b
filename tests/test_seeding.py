"""seed_everything makes python, numpy and torch streams repeat; resolve_device explains bad devices."""

import random

import numpy as np
import pytest
import torch

from prodigy_core.seeding import resolve_device, seed_everything


def _draw():
    return random.random(), float(np.random.rand()), float(torch.rand(1))


def test_same_seed_same_streams_other_seed_other_streams():
    seed_everything(3)
    a = _draw()
    seed_everything(3)
    assert _draw() == a
    seed_everything(4)
    assert _draw() != a


def test_returned_generator_is_seeded():
    g1, g2 = seed_everything(7), seed_everything(7)
    assert torch.equal(torch.rand(4, generator=g1), torch.rand(4, generator=g2))
    assert torch.equal(
        torch.rand(4, generator=seed_everything(7)), torch.rand(4, generator=torch.Generator().manual_seed(7))
    )
    assert not torch.equal(
        torch.rand(4, generator=seed_everything(8)), torch.rand(4, generator=torch.Generator().manual_seed(7))
    )


def test_resolve_device():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="not a torch device .*; use 'auto', 'cpu' or 'cuda'"):
        resolve_device("gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda")
