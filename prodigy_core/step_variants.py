"""Engine variants of the batched local step: other kernels for the E local SGD steps of R x N clients of
`local_training.local_steps_stacked`, the same computation as `batched` (tests/test_step_variants.py: float64,
dropout on), for the GPU window's autotune to time and gate (`benchmarks/autotune.py`).

Entry points: `make_grad` (a variant's gradient function; `names.ENGINE_VARIANTS` lists them), `sgd_update`
(the SGD step every stacked engine takes), `StaticSteps` (a step in static buffers, captured in a CUDA graph).
The client-folded variants (`FOLDED`, `FoldedGrad`) replace each layer by its client-folded form; the
captured ones (`GRAPHED`) run on CUDA only. Semantics: docs/semantics.md ("Engines"); timings:
benchmarks/README.md. This module never imports `local_training`: the run's pieces come in as arguments.
"""

from __future__ import annotations

import copy
import functools
import itertools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from prodigy_core.config import ConfigError
from prodigy_core.names import ENGINE_VARIANTS

# the engines that stack the clients (and runs) in one step: `groups.group_key` groups runs of these
STACKED_ENGINES = ("batched", "compiled", *ENGINE_VARIANTS)
# the client-folded variants (`FoldedGrad`): engine -> (its convolutions, channels-last memory)
FOLDED = {"channels_last": ("grouped", True), "bmm_conv": ("bmm", False), "bmm_wgrad": ("bmm_wgrad", True)}
# the captured variants (`StaticSteps`): engine -> the engine whose step it captures
GRAPHED = {"cuda_graphs": "batched", "channels_last_graphs": "channels_last", "bmm_wgrad_graphs": "bmm_wgrad"}
CUDA_ONLY = tuple(GRAPHED)


def make_grad(engine: str, base: Callable, capture: bool = True) -> Callable:
    """The gradient function of engine variant `engine`, from `base`, the batched engine's uncompiled one
    for the run's model (`local_training.ClientGrad`: `.net`, `(params, buffers, x, y, masks) -> grads`),
    with the same interface; a captured one's (`GRAPHED`) also has `.local_steps`, which
    `local_training.local_steps_stacked` hands the whole E steps to. ``capture=False`` gives a captured
    engine's static-buffer path uncaptured (the tests, on a CPU). A CUDA-only engine on another device raises
    a one-line `ConfigError`."""
    device = next(base.net.template.parameters()).device
    if engine in CUDA_ONLY and capture and device.type != "cuda":
        uncaptured = GRAPHED[engine]
        raise ConfigError(
            f"engine={engine!r} captures the local steps in CUDA graphs and needs a CUDA device (this run's "
            f"is {device}); use engine={uncaptured!r}: the same computation, uncaptured"
        )
    if engine in FOLDED:
        conv, channels_last = FOLDED[engine]
        return FoldedGrad(base.net, conv=conv, channels_last=channels_last)
    if engine in GRAPHED:
        inner = GRAPHED[engine]
        return StaticSteps(base if inner == "batched" else make_grad(inner, base), capture=capture)
    raise ValueError(f"engine={engine!r} is not an engine variant; valid: {', '.join(ENGINE_VARIANTS)}")


# ----------------------------------------------------------------------------------- client-folded layers
def _per_channel(fn: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """fn (a per-image, per-channel 4-D op: pooling) on x (clients, B, C, H, W), folded without a copy where
    x's strides allow: clients into the channels (the grouped convolution's layout) or into the batch."""
    n, b, c = x.shape[:3]
    t = x.transpose(0, 1)
    if t.stride(1) == c * t.stride(2):  # (B, n C, H, W) is a view
        out = fn(t.reshape(b, n * c, *x.shape[3:]))
        return out.reshape(b, n, c, *out.shape[2:]).transpose(0, 1)
    out = fn(x.reshape(n * b, c, *x.shape[3:]))
    return out.reshape(n, b, c, *out.shape[2:])


class _FoldedConv(nn.Module):
    """nn.Conv2d of every client at once, weight (clients, O, C, k, k), x (clients, B, C, H, W)."""

    def __init__(self, conv: nn.Conv2d, impl: str, channels_last: bool) -> None:
        super().__init__()
        if conv.groups != 1 or conv.padding_mode != "zeros" or isinstance(conv.padding, str):
            raise ValueError(f"{conv}: only zero-padded, ungrouped convolutions have a client-folded form")
        self.weight, self.bias = conv.weight, conv.bias
        self.stride, self.padding, self.dilation = conv.stride, conv.padding, conv.dilation
        self.impl, self.channels_last = impl, channels_last

    def forward(self, x: Tensor) -> Tensor:
        if self.impl == "bmm":
            return self._bmm(x)
        if self.impl == "bmm_wgrad":
            return _BmmWeightGradConv.apply(x, self.weight, self.bias, self)
        return self._grouped(x)

    def _grouped(self, x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None) -> Tensor:
        n, b = x.shape[:2]
        weight, bias = (self.weight, self.bias) if weight is None else (weight, bias)
        bias = None if bias is None else bias.reshape(-1)
        out = F.conv2d(self._into_channels(x), self._grouped_weight(weight), bias, self.stride, self.padding,
                       self.dilation, groups=n)  # fmt: skip
        return out.reshape(b, n, -1, *out.shape[2:]).transpose(0, 1)

    def _input_grad(self, x: Tensor, weight: Tensor, g: Tensor) -> Tensor:
        """d loss / d x of `_grouped`, from the output's gradient `g`: the grouped convolution's own
        (transposed) kernel."""
        n, b, c = x.shape[:3]
        shape = (b, n * c, *x.shape[3:])
        gx = torch.nn.grad.conv2d_input(shape, self._grouped_weight(weight), self._into_channels(g),
                                        self.stride, self.padding, self.dilation, groups=n)  # fmt: skip
        return gx.reshape(b, n, c, *x.shape[3:]).transpose(0, 1)

    def _into_channels(self, t: Tensor) -> Tensor:
        """(clients, B, C, H, W) -> (B, clients C, H, W), the grouped convolution's layout (channels-last
        memory when asked)."""
        t = t.transpose(0, 1).reshape(t.shape[1], -1, *t.shape[3:])
        return t.contiguous(memory_format=torch.channels_last) if self.channels_last else t

    def _grouped_weight(self, weight: Tensor) -> Tensor:
        """(clients, O, C, k, k) -> (clients O, C, k, k), the grouped convolution's weight."""
        w = weight.reshape(-1, *weight.shape[2:])
        return w.contiguous(memory_format=torch.channels_last) if self.channels_last else w

    def _weight_grad(self, x: Tensor, weight: Tensor, g: Tensor) -> Tensor:
        """d loss / d weight (clients, O, C, k, k) of `_grouped` as one batched product: per client and image
        g (O, L) x unfold(x)^T (L, C kk), summed over the images. The unfolded input is read as it is laid
        out (its transpose is a view), never copied: CIFAR-10's largest is about 1.5 GB in float32 per 10
        clients."""
        n, b, c = x.shape[:3]
        cols = F.unfold(x.reshape(n * b, c, *x.shape[3:]), weight.shape[3:], self.dilation, self.padding,
                        self.stride)  # fmt: skip
        per_image = torch.bmm(g.reshape(n * b, g.shape[2], -1), cols.transpose(1, 2))  # (n b, O, C kk)
        return per_image.view(n, b, *per_image.shape[1:]).sum(dim=1).reshape(weight.shape)

    def _bmm(self, x: Tensor) -> Tensor:
        n, b, c, h, w = x.shape
        o, k = self.weight.shape[1], self.weight.shape[3:]
        geometry = zip((h, w), self.padding, self.dilation, k, self.stride, strict=True)
        size = [(s + 2 * p - d * (kk - 1) - 1) // st + 1 for s, p, d, kk, st in geometry]
        # (n b, C kk, L) -> (n, b L, C kk)
        cols = F.unfold(x.reshape(n * b, c, h, w), k, self.dilation, self.padding, self.stride)
        cols = cols.view(n, b, cols.shape[1], -1).transpose(2, 3).reshape(n, -1, cols.shape[1])
        weight = self.weight.reshape(n, o, -1).transpose(1, 2)  # (n, C kk, O)
        if self.bias is None:
            out = torch.bmm(cols, weight)
        else:
            out = torch.baddbmm(self.bias[:, None, :], cols, weight)
        return out.view(n, b, *size, o).permute(0, 1, 4, 2, 3)  # (n, b, O, H', W'), channels last per image


class _BmmWeightGradConv(torch.autograd.Function):
    """`_FoldedConv._grouped` whose backward computes the weight gradient as one batched product
    (`_weight_grad`) and the input gradient with the grouped convolution's kernel (`_input_grad`). Under
    autocast the convolution runs in the autocast dtype, as F.conv2d's would, and the gradients come back in
    the inputs' dtypes."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, conv: _FoldedConv) -> Tensor:
        kind = x.device.type
        dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype
        xc, wc = x.to(dtype), weight.to(dtype)
        bc = None if bias is None else bias.to(dtype)
        ctx.save_for_backward(xc, wc)
        ctx.conv, ctx.dtypes = conv, (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        with torch.autocast(kind, enabled=False):
            return conv._grouped(xc, wc, bc)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        conv, (x_dtype, w_dtype, b_dtype) = ctx.conv, ctx.dtypes
        g = g.to(x.dtype)
        gx = conv._input_grad(x, weight, g).to(x_dtype) if ctx.needs_input_grad[0] else None
        gw = conv._weight_grad(x, weight, g).to(w_dtype) if ctx.needs_input_grad[1] else None
        gb = g.sum(dim=(1, 3, 4)).to(b_dtype) if ctx.needs_input_grad[2] else None
        return gx, gw, gb, None


class _FoldedBatchNorm(nn.Module):
    """models.BatchNorm2d in training mode with every client's own batch statistics and running buffers
    (clients, C): one F.batch_norm over the clients' channels side by side."""

    def __init__(self, bn: nn.BatchNorm2d) -> None:
        super().__init__()
        if bn.momentum is None or not bn.track_running_stats or not bn.affine:
            raise ValueError(f"{bn}: only affine BatchNorm with a momentum and running buffers is folded")
        self.weight, self.bias, self.momentum, self.eps = bn.weight, bn.bias, bn.momentum, bn.eps
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            self.register_buffer(name, getattr(bn, name))

    def forward(self, x: Tensor) -> Tensor:
        n, b, c = x.shape[:3]
        xi = x.transpose(0, 1).reshape(b, n * c, *x.shape[3:])
        xi = xi.float() if xi.dtype in (torch.bfloat16, torch.float16) else xi  # as models.BatchNorm2d
        self.num_batches_tracked.add_(1)
        out = F.batch_norm(xi, self.running_mean.view(-1), self.running_var.view(-1), self.weight.reshape(-1),
                           self.bias.reshape(-1), True, self.momentum, self.eps)  # fmt: skip
        return out.reshape(b, n, c, *out.shape[2:]).transpose(0, 1)


class _FoldedMaxPool(nn.Module):
    def __init__(self, pool: nn.MaxPool2d) -> None:
        super().__init__()
        self.pool = pool

    def forward(self, x: Tensor) -> Tensor:
        return _per_channel(self.pool, x)


class _FoldedFlatten(nn.Module):
    def __init__(self, flatten: nn.Flatten) -> None:
        super().__init__()
        if (flatten.start_dim, flatten.end_dim) != (1, -1):
            raise ValueError(f"{flatten}: only Flatten() of the whole sample has a client-folded form")

    def forward(self, x: Tensor) -> Tensor:
        return x.reshape(*x.shape[:2], -1)


class _FoldedLinear(nn.Module):
    """nn.Linear of every client at once, weight (clients, O, I), x (clients, B, I)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, x: Tensor) -> Tensor:
        if self.bias is None:
            return torch.bmm(x, self.weight.transpose(1, 2))
        return torch.baddbmm(self.bias[:, None, :], x, self.weight.transpose(1, 2))


class FoldedGrad:
    """`local_training.ClientGrad`'s function, (params, buffers, x, y, masks) stacked over clients -> every
    client's gradient of its mean cross-entropy (BatchNorm buffers updated in place), computed by the
    client-folded layers above instead of vmap: `conv` "grouped" (optionally `channels_last`) or "bmm".
    The activations keep a leading client axis, (R N, B, C, H, W) then (R N, B, F); a client's gradient is
    that of the sum of the clients' losses, the clients being independent. `net`: the run's
    `local_training.FunctionalNet`; the masks are its `masks`, as the batched engine's. Layers other than
    Conv2d, BatchNorm2d, MaxPool2d, Flatten, Linear, ReLU and dropout are refused in one line."""

    def __init__(self, net: Any, conv: str = "grouped", channels_last: bool = False) -> None:
        self.net = net  # local_training.FunctionalNet: the template and its dropout layers, "<name>.mask"
        self.folded = copy.deepcopy(self.net.template).train()
        dropouts = {key.removesuffix(".mask") for key in net.dropouts}
        keep = (nn.ReLU, nn.Sequential)
        for name, m in list(self.folded.named_modules()):
            if name in dropouts:
                continue
            if isinstance(m, nn.Conv2d):
                self.folded.set_submodule(name, _FoldedConv(m, conv, channels_last))
            elif isinstance(m, nn.BatchNorm2d):
                self.folded.set_submodule(name, _FoldedBatchNorm(m))
            elif isinstance(m, nn.MaxPool2d):
                self.folded.set_submodule(name, _FoldedMaxPool(m))
            elif isinstance(m, nn.Flatten):
                self.folded.set_submodule(name, _FoldedFlatten(m))
            elif isinstance(m, nn.Linear):
                self.folded.set_submodule(name, _FoldedLinear(m))
            elif name and not isinstance(m, keep) and next(m.children(), None) is None:
                raise ValueError(f"the model's {type(m).__name__} layers have no client-folded form; use "
                                 "engine='batched'")  # fmt: skip
        self.compiled = False

    def __call__(self, params: dict, buffers: dict, x: Tensor, y: Tensor, masks: dict) -> dict:
        leaves = {name: v.detach().requires_grad_() for name, v in params.items()}
        out = functional_call(self.folded, (leaves, buffers, masks), (x,))  # (clients, B, classes)
        n, b = y.shape
        per_sample = F.cross_entropy(out.reshape(n * b, -1), y.reshape(-1), reduction="none")
        # the clients are independent: the gradient of the sum is each one's of its own loss
        loss = per_sample.view(n, b).mean(dim=1).sum()
        return dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values())), strict=True))


# ----------------------------------------------------------------------------------------- static buffers
def sgd_update(
    grads: list[Tensor],
    weights: list[Tensor],
    lrs: list[float],
    weight_decay: float,
    counts: list[int] | None = None,
) -> None:
    """The local SGD step in place on R runs' stacked client rows (each tensor (sum counts, ...), run-major:
    run i's counts[i] rows after the runs before it; counts None: R equal blocks): g <- g + wd w;
    w <- w - gamma_i g (`training.run`, step 1): the weight decay in one call for all rows, the update in
    one call for each block of consecutive runs that share their lr (views; one for the whole group when
    all do, as when its runs are at the same round), so the launches do not grow with R where a few runs'
    lr decayed. `local_training.local_steps_stacked` and `StaticSteps` take this step."""
    if weight_decay:
        torch._foreach_add_(grads, weights, alpha=weight_decay)
    counts = counts or [len(weights[0]) // len(lrs)] * len(lrs)
    blocks = [
        (lr, sum(c for _, c in same))
        for lr, same in itertools.groupby(zip(lrs, counts, strict=True), lambda p: p[0])
    ]
    start = 0
    for lr, rows in blocks:
        sl = slice(start, start + rows) if len(blocks) > 1 else slice(None)
        start += rows
        torch._foreach_add_([t[sl] for t in weights], [t[sl] for t in grads], alpha=-lr)


def _alike(a: Tensor, b: Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype


class StaticSteps:
    """The E local steps of R runs with every per-step input in static buffers: the clients' weights and
    BatchNorm buffers (R N, ...) written once a round from the server models, each step's images, labels
    and dropout masks (`draw_group`) copied into the same tensors, and the step (gradient, weight decay,
    SGD update in place) reading and writing only those; for a step whose host, launching its kernels, is
    slower than its GPU. ``capture`` (CUDA): the step is run eagerly once (on a side stream, its warm-up),
    captured in a CUDA graph at its next use and replayed from then on, one graph per input shape, captured
    again when the step sizes change (a decayed lr). Without capture (a CPU: the tests) the same step runs
    eagerly: the static-buffer path, the `batched` engine's numbers bit for bit.
    Clients of several batch widths (small clients, ``paper``) take `local_training.local_steps_stacked`'s
    loop, which calls this object as the plain gradient function."""

    def __init__(self, grad_fn: Callable, capture: bool = False) -> None:
        self.grad_fn, self.net, self.capture, self.compiled = grad_fn, grad_fn.net, capture, False
        self.static: dict[str, object] = {}
        self.graphs: dict[tuple, object] = {}

    def __call__(self, params: dict, buffers: dict, x: Tensor, y: Tensor, masks: dict) -> dict:
        return self.grad_fn(params, buffers, x, y, masks)

    def local_steps(
        self,
        params: dict[str, Tensor],
        buffers: dict[str, Tensor],
        steps: int,
        lrs: list[float],
        weight_decay: float,
        counts: list[int] | None,
        draw: Callable[[], tuple[Tensor, Tensor, dict[str, Tensor]]],
    ) -> None:
        """The E steps of R runs whose clients share one batch width (the others take
        `local_training.local_steps_stacked`'s loop), in place on the rows that train: their weights and
        buffers `params`, `buffers` (R runs' rows, run-major; ``counts`` each run's number of them, None: R
        equal blocks) are loaded into the static ones and the result written back. `draw()`: one step's
        images, labels and masks of those rows (`local_training.draw_group`'s)."""
        st = self._load({"params": params, "buffers": buffers})
        for _ in range(steps):
            x, y, masks = draw()
            st = self._inputs(st, x, y, masks)
            step = functools.partial(self._step, st, lrs, weight_decay, counts)
            self._run((tuple(x.shape), tuple(counts or ())), tuple(lrs), step)
        for kind, given in (("params", params), ("buffers", buffers)):
            for k, v in given.items():
                v.copy_(st[kind][k])

    def _load(self, fresh: dict[str, dict[str, Tensor]]) -> dict:
        """The static weights and buffers set to `fresh`'s {"params": ..., "buffers": ...} (allocated at
        first use)."""
        st = self.static
        for kind in ("params", "buffers"):
            old = st.get(kind)
            fits = old is not None and all(_alike(old[k], v) for k, v in fresh[kind].items())
            if not fits:  # new shapes: new buffers, new graphs
                st[kind], self.graphs = {k: v.clone() for k, v in fresh[kind].items()}, {}
            else:
                for k, v in fresh[kind].items():
                    old[k].copy_(v)
        return st

    def _inputs(self, st: dict, x: Tensor, y: Tensor, masks: dict) -> dict:
        """This step's images, labels and masks copied into the static ones (allocated at first use)."""
        if "x" not in st or not _alike(st["x"], x):
            st["x"], st["y"], self.graphs = x.clone(), y.clone(), {}
            st["masks"] = {k: m.clone() for k, m in masks.items()}
            return st
        st["x"].copy_(x)
        st["y"].copy_(y)
        for k, m in masks.items():
            st["masks"][k].copy_(m)
        return st

    def _step(self, st: dict, lrs: list[float], weight_decay: float, counts: list[int] | None) -> None:
        """One SGD step on the static buffers, as `local_training.local_steps_stacked` takes it."""
        p, b = st["params"], st["buffers"]
        grads = list(self.grad_fn(p, b, st["x"], st["y"], st["masks"]).values())
        sgd_update(grads, list(p.values()), lrs, weight_decay, counts)

    def _run(self, key: tuple, lrs: tuple, step: Callable[[], None]) -> None:
        """step() eagerly, or (capture) the CUDA graph of the input shapes `key` at the step sizes `lrs`:
        warm-up, capture, then replays. One graph per shape: a graph whose lrs are not this step's (the lr
        decayed, a member of the group reached another round) is dropped before the new one's warm-up, so
        its memory pool does not stay held beside the new one's."""
        if not self.capture:
            step()
            return
        held = self.graphs.get(key)
        if held is not None and held[0] != lrs:
            del self.graphs[key]
            held = None
        if held is None:  # warm-up on a side stream: a real step, eager
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                step()
            torch.cuda.current_stream().wait_stream(side)
            self.graphs[key] = (lrs, "warm")
        elif held[1] == "warm":  # capture (records, runs nothing), then the replay takes this step
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            self.graphs[key] = (lrs, graph)
            graph.replay()
        else:
            held[1].replay()


__all__ = ["STACKED_ENGINES", "FOLDED", "GRAPHED", "FoldedGrad", "StaticSteps", "make_grad"]
