"""benchmarks/quickstart.py's pure parts: the FLOP count of a training step against a hand computation, the
round's FLOPs and its ratio to the floor, and the op counter (the timings themselves are not tested)."""

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import quickstart  # noqa: E402


def test_training_flops_of_a_tiny_conv_net_are_the_hand_count():
    # conv 1->2, 3x3, padding 1 on 4x4, then a linear 32 -> 3, batch B; 2 FLOPs per multiply-add.
    # conv forward: 2 * (1 * 3 * 3) * 2 channels * 16 positions = 576 per image; backward: the weight's
    # gradient only (the images need none), 576 more. Linear forward 2 * 32 * 3 = 192; backward: the input's
    # gradient (192) and the weight's (192). Biases, ReLU and the loss are not products: not counted.
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(32, 3))
    per_image = 576 + 576 + 192 + 192 + 192
    assert quickstart.training_flops(net, 5, image=(1, 4, 4)) == 5 * per_image
    assert all(p.grad is None for p in net.parameters())  # the count leaves no gradients behind


def test_the_digits_cnn_costs_what_its_layers_add_up_to():
    # DigitsCNN's products by hand (per image): conv 1->12 at 8x8 (forward, weight gradient), conv 12->24
    # at 4x4 (forward, input and weight gradients), fc 96->48 and 48->10 (forward, both gradients).
    conv1 = 2 * 9 * 12 * 64
    conv2 = 2 * 12 * 9 * 24 * 16
    fc = 2 * 96 * 48 + 2 * 48 * 10
    expected = 2 * conv1 + 3 * conv2 + 3 * fc
    assert quickstart.training_flops_per_image(quickstart.DigitsCNN(), batch=8) == expected == 307_008


def test_a_rounds_flops_and_its_ratio_to_the_floor():
    assert quickstart.round_flops(1000.0, [64, 64, 10]) == 138_000
    # 1.8 GFLOP at 18 GFLOP/s is a 0.1 s floor: a 0.32 s round is 3.2x it
    assert quickstart.floor_ratio(0.32, 1.8e9, 18e9) == pytest.approx(3.2)


def test_the_op_counter_counts_every_dispatched_aten_op():
    x = torch.ones(3, requires_grad=True)
    with quickstart.OpCounter() as counter:
        y = (x * 2).sum()
        y.backward()
    assert counter.ops["aten.mul"] >= 1 and counter.ops["aten.sum"] == 1
    assert sum(counter.ops.values()) >= 3 and x.grad.tolist() == [2.0, 2.0, 2.0]
