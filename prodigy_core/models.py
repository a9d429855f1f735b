"""The paper's CNNs (CIFAR-10, FEMNIST) and a small CNN for the embedded digits data.

Every model maps (B, C, H, W) normalised images to (B, classes) scores: log-probabilities for Cifar10CNN (the
paper's log-softmax + NLL), logits for the others. Train all of them with `F.cross_entropy`: log_softmax is
idempotent, so cross-entropy on log-probabilities is the same NLL as on logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from prodigy_core.names import DATASETS


class BatchNorm2d(nn.BatchNorm2d):
    """nn.BatchNorm2d on a float32 copy of its input: under bfloat16 autocast (`precision: bf16`) the batch
    statistics, the running buffers and the output stay float32 (and CPU autocast under vmap, which fails on
    a bfloat16 input with float32 weights, works); a float32 or float64 input is used as it is."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.float() if x.dtype in (torch.bfloat16, torch.float16) else x)


def _conv_bn_relu(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1), BatchNorm2d(c_out), nn.ReLU())


def _conv_relu_bn(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1), nn.ReLU(), BatchNorm2d(c_out))


class Cifar10CNN(nn.Module):
    """The paper's CIFAR-10 CNN, layer for layer the authors' `CIFAR10Net`: 1,310,922 trainable parameters.

    [conv3x3 64, ReLU, BN], [conv3x3 64, ReLU, BN], max-pool 2, dropout 0.25, [conv3x3 128, ReLU, BN],
    [conv3x3 128, ReLU, BN], max-pool 2, dropout 0.25, fc 8192 -> 128, ReLU, dropout 0.25, fc 128 -> 10,
    log-softmax. BatchNorm follows the ReLU, as in the authors' code, so it normalises non-negative
    activations.
    """

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            _conv_relu_bn(3, 64),
            _conv_relu_bn(64, 64),
            nn.MaxPool2d(2),
            nn.Dropout(0.25),
            _conv_relu_bn(64, 128),
            _conv_relu_bn(128, 128),
            nn.MaxPool2d(2),
            nn.Dropout(0.25),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(128 * 8 * 8, 128),
            nn.ReLU(),
            nn.Dropout(0.25),
            nn.Linear(128, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(self.classifier(self.features(x)), dim=-1)


class FemnistCNN(nn.Module):
    """The paper's FEMNIST CNN (LEAF's reference model): 1,690,046 trainable parameters.

    conv5x5 32 (pad 2), ReLU, max-pool 2, conv5x5 64 (pad 2), ReLU, max-pool 2, fc 3136 -> 512, ReLU,
    fc 512 -> 62; returns logits.
    """

    def __init__(self, num_classes: int = 62) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, 32, 5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(64 * 7 * 7, 512),
            nn.ReLU(),
            nn.Linear(512, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class DigitsCNN(nn.Module):
    """A small CNN for scikit-learn's 8x8 digits (not from the paper; 7,954 parameters).

    [conv3x3 12, BN, ReLU] at 8x8, max-pool 2, [conv3x3 24, BN, ReLU] at 4x4, max-pool 2, dropout 0.25,
    fc 96 -> 48, ReLU, fc 48 -> 10; returns logits. It keeps BatchNorm and dropout so that the CI-sized runs
    exercise the same BN-buffer and dropout-RNG handling as the paper's CIFAR-10 model, and the conventional
    conv -> BN -> ReLU order (the order does not change which code paths a run exercises). Pooling before the
    wide convolution keeps a step cheap (`benchmarks/quickstart.py`), and it still learns the task
    (docs/results.md "The quickstart's rounds").
    """

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.net = nn.Sequential(
            _conv_bn_relu(1, 12),
            nn.MaxPool2d(2),
            _conv_bn_relu(12, 24),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Dropout(0.25),
            nn.Linear(24 * 2 * 2, 48),
            nn.ReLU(),
            nn.Linear(48, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


MODELS: dict[str, type[nn.Module]] = {"cifar10": Cifar10CNN, "femnist": FemnistCNN, "digits": DigitsCNN}
assert set(MODELS) == set(DATASETS), "every dataset in names.DATASETS needs a model"


# the datasets whose model has BatchNorm layers (`config.idle_moves_numbers`; tested against the models)
BATCHNORM_DATASETS = frozenset({"cifar10", "digits"})


def make_model(dataset_name: str) -> nn.Module:
    """The model for `dataset_name` (one of names.DATASETS), freshly initialised from torch's global RNG."""
    if dataset_name not in MODELS:
        raise ValueError(f"no model for dataset={dataset_name!r}; valid: {', '.join(MODELS)}")
    return MODELS[dataset_name]()


def count_parameters(model: nn.Module) -> int:
    """Number of trainable parameters (BatchNorm running buffers are not parameters)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


__all__ = [
    "BATCHNORM_DATASETS",
    "BatchNorm2d",
    "Cifar10CNN",
    "FemnistCNN",
    "DigitsCNN",
    "MODELS",
    "make_model",
    "count_parameters",
]
