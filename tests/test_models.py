"""The paper's CNNs: exact parameter counts (hand-computed layer by layer), shapes and outputs."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from prodigy_core.models import (
    BATCHNORM_DATASETS,
    Cifar10CNN,
    DigitsCNN,
    FemnistCNN,
    count_parameters,
    make_model,
)
from prodigy_core.names import DATASETS


def conv(c_in: int, c_out: int, k: int) -> int:
    return c_in * c_out * k * k + c_out


def linear(n_in: int, n_out: int) -> int:
    return n_in * n_out + n_out


def bn(c: int) -> int:
    return 2 * c


def test_cifar10_cnn_has_the_papers_parameter_count():
    by_layer = (
        (conv(3, 64, 3) + bn(64) + conv(64, 64, 3) + bn(64) + conv(64, 128, 3) + bn(128) + conv(128, 128, 3))
        + bn(128)
        + linear(8192, 128)
        + linear(128, 10)
    )
    assert by_layer == 1_310_922
    assert count_parameters(Cifar10CNN()) == 1_310_922


def test_femnist_cnn_has_the_papers_parameter_count():
    by_layer = conv(1, 32, 5) + conv(32, 64, 5) + linear(3136, 512) + linear(512, 62)
    assert by_layer == 1_690_046
    assert count_parameters(FemnistCNN()) == 1_690_046


@pytest.mark.parametrize(
    ("name", "cls", "shape", "classes"),
    [
        ("cifar10", Cifar10CNN, (3, 32, 32), 10),
        ("femnist", FemnistCNN, (1, 28, 28), 62),
        ("digits", DigitsCNN, (1, 8, 8), 10),
    ],
)
def test_make_model_output_shape_and_training_step(name, cls, shape, classes):
    torch.manual_seed(0)
    model = make_model(name)
    assert isinstance(model, cls)
    x, y = torch.randn(4, *shape), torch.randint(0, classes, (4,))
    out = model(x)
    assert out.shape == (4, classes)
    loss = F.cross_entropy(out, y)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None for p in model.parameters())


def test_cifar10_cnn_returns_log_probabilities():
    torch.manual_seed(0)
    out = Cifar10CNN().eval()(torch.randn(3, 3, 32, 32))
    torch.testing.assert_close(out.exp().sum(-1), torch.ones(3))
    # cross-entropy on log-probabilities is the NLL of the same distribution
    y = torch.tensor([0, 5, 9])
    torch.testing.assert_close(F.cross_entropy(out, y), F.nll_loss(out, y))


def _conv_flops(c_in: int, c_out: int, side: int) -> int:
    return 2 * c_in * c_out * 9 * side * side  # 3x3, padding 1: one multiply-add per weight per output pixel


def test_digits_cnn_size_and_forward_flops_by_hand():
    """7,954 parameters and the forward FLOPs of each layer by hand, against torch's flop counter; the first
    digits model (conv 16 and conv 32 both at 8x8, fc 512 -> 64 -> 10) took 6.3x more per image."""
    from torch.utils.flop_counter import FlopCounterMode

    def conv(c_in, c_out):
        return c_out * c_in * 9 + c_out + 2 * c_out  # weights, bias, BN affine

    assert (
        count_parameters(DigitsCNN()) == conv(1, 12) + conv(12, 24) + (96 * 48 + 48) + (48 * 10 + 10) == 7_954
    )
    new = _conv_flops(1, 12, 8) + _conv_flops(12, 24, 4) + 2 * 96 * 48 + 2 * 48 * 10
    old = _conv_flops(1, 16, 8) + _conv_flops(16, 32, 8) + 2 * 512 * 64 + 2 * 64 * 10
    with FlopCounterMode(display=False) as counter:
        DigitsCNN().eval()(torch.zeros(5, 1, 8, 8))
    assert counter.get_total_flops() == 5 * new
    assert old / new > 4  # issue 27's goal: a training step at least 4x cheaper (backward ~ 2x forward)


def test_models_with_batchnorm_have_running_buffers():
    for model in (Cifar10CNN(), DigitsCNN()):
        assert any(name.endswith("running_mean") for name, _ in model.named_buffers())


def test_batchnorm_datasets_are_those_whose_model_has_batchnorm():
    """`BATCHNORM_DATASETS` (which keys carry `config.IDLE_REVISION`) read from the models themselves."""
    with_bn = {
        name for name in DATASETS if any(isinstance(m, nn.BatchNorm2d) for m in make_model(name).modules())
    }
    assert with_bn == BATCHNORM_DATASETS


def test_every_dataset_has_a_model_and_unknown_names_are_rejected():
    expected = {"cifar10": Cifar10CNN, "femnist": FemnistCNN, "digits": DigitsCNN}
    assert {name: type(make_model(name)) for name in DATASETS} == expected
    with pytest.raises(ValueError, match="valid: cifar10, femnist, digits"):
        make_model("mnist")


def test_cifar10_cnn_calls_its_layers_in_the_authors_order():
    # the authors' CIFAR10Net: conv -> ReLU -> BN (x2), pool, dropout, conv -> ReLU -> BN (x2), pool, dropout,
    # fc, ReLU, dropout, fc
    model = Cifar10CNN().train()
    kinds = (torch.nn.Conv2d, torch.nn.ReLU, torch.nn.BatchNorm2d, torch.nn.MaxPool2d, torch.nn.Dropout,
             torch.nn.Linear)  # fmt: skip
    calls, bn_input_minima = [], []
    for module in model.modules():
        if isinstance(module, kinds):
            module.register_forward_hook(lambda m, inputs, out: calls.append(type(m).__name__))
        if isinstance(module, torch.nn.BatchNorm2d):
            module.register_forward_pre_hook(lambda m, inputs: bn_input_minima.append(inputs[0].min().item()))
    model(torch.randn(4, 3, 32, 32))
    block = ["Conv2d", "ReLU", "BatchNorm2d"]
    assert calls == [*block, *block, "MaxPool2d", "Dropout", *block, *block, "MaxPool2d", "Dropout",
                     "Linear", "ReLU", "Dropout", "Linear"]  # fmt: skip
    assert all(m.p == 0.25 for m in model.modules() if isinstance(m, torch.nn.Dropout))
    assert len(bn_input_minima) == 4 and min(bn_input_minima) >= 0.0  # every BN input follows a ReLU
