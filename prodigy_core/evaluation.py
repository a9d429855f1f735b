"""Test accuracy and loss of the server's model (`evaluate`) or of several runs' models at once
(`evaluate_runs`), in eval mode (``paper``) or in training mode with the clients' batch size as the
authors' code evaluates (``authors``); when a run evaluates (`eval_due`) and what a diverged run scores
(`diverged_accuracy`).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import vmap

from prodigy_core.config import RunConfig
from prodigy_core.data import Federation
from prodigy_core.local_training import FunctionalNet
from prodigy_core.streams import ClientStreams

# Test batch size of the paper variant: eval mode gives every batch size the same numbers. (The authors' test
# loader takes the clients' batch size: `eval_settings`.)
EVAL_BATCH_SIZE = 1000
# Training-mode evaluation (``authors``): test images per stacked forward pass, over all the models evaluated
# together (`evaluate_runs`): 10,000 (one CIFAR-10 test set) is about 2.7 GB of CIFAR-10 activations.
EVAL_PASS_IMAGES = 10_000


@torch.no_grad()
def evaluate(
    model: nn.Module,
    fed: Federation,
    batch_size: int = EVAL_BATCH_SIZE,
    train_mode: bool = False,
    key: int = 0,
) -> tuple[float, float, float]:
    """`evaluate_runs` of [model]: (accuracy %, mean cross-entropy, the authors' test loss)."""
    return evaluate_runs([model], fed, train_mode, [key], batch_size=batch_size)[0]


def evaluate_runs(
    models: list[nn.Module],
    fed: Federation,
    train_mode: bool = False,
    keys: list[int] | None = None,
    batch_size: int = EVAL_BATCH_SIZE,
    net: FunctionalNet | None = None,
) -> list[tuple[float, float, float]]:
    """Test accuracy (percent), mean cross-entropy (sum over the test samples / M) and the authors' test loss
    (sum over the test batches of the batch's mean cross-entropy / M, what their server prints,
    server.py:63-67) over test batches of `batch_size` of R models of one architecture (M test samples), as
    one forward pass per test batch (vmapped over the models when R > 1); in train mode as stacked passes
    over up to `EVAL_PASS_IMAGES` images' batches (`_train_mode_pass`: the authors' 157 test batches of 64 in
    one pass instead of a loop of 157, with the loop's numbers).

    Eval mode (dropout off, each model's BatchNorm running statistics), or with ``train_mode`` as the authors'
    code evaluates: dropout on and BatchNorm normalising each test batch with that batch's own mean and
    (biased) variance; the models' buffers are left as they were. Model i's dropout masks for test batch j
    and layer l are the counter-based draws of key (keys[i], j, l) (`ClientStreams.eval_key`; None: 0 for
    every model), so its numbers do not depend on the other models or the device. ``net``:
    `FunctionalNet(models[0])`, built once by a caller that evaluates often."""
    net = net or FunctionalNet(models[0])
    runs = len(models)
    keys = [0] * runs if keys is None else keys
    params = [{k: v.detach() for k, v in m.named_parameters()} for m in models]
    buffers = [
        {k: v.detach().clone() for k, v in m.named_buffers()} for m in models
    ]  # train mode writes them
    if runs == 1:
        forward, params, buffers = net, params[0], buffers[0]
    else:
        forward = vmap(net, in_dims=(0, 0, 0, None), randomness="error")
        params, buffers = ({k: torch.stack([d[k] for d in ds]) for k in ds[0]} for ds in (params, buffers))
    correct = torch.zeros(runs, device=fed.test_labels.device)
    loss = torch.zeros(runs, device=fed.test_labels.device)
    batch_means = torch.zeros(runs, device=fed.test_labels.device)
    net.template.train(train_mode)
    total = len(fed.test_labels)
    if train_mode:  # every test batch its own BatchNorm statistics: the full batches in stacked passes
        batches = list(enumerate(fed.test_batches(batch_size)))  # (j, (x, y)): j keys batch j's masks
        full = [b for b in batches if len(b[1][1]) == batch_size]
        per_pass = max(1, EVAL_PASS_IMAGES // (runs * batch_size))
        passes = [full[i : i + per_pass] for i in range(0, len(full), per_pass)]
        passes += [[b] for b in batches if len(b[1][1]) != batch_size]  # the last, partial batch
        try:
            for part in passes:
                scores = _train_mode_pass(net, params, buffers, keys, part)
                correct, loss, batch_means = correct + scores[0], loss + scores[1], batch_means + scores[2]
        finally:
            net.template.train()
        rows = zip(*torch.stack([correct, loss, batch_means]).tolist(), strict=True)  # one wait
        return [(100.0 * c / total, v / total, m / total) for c, v, m in rows]
    try:
        with torch.no_grad():
            for x, y in fed.test_batches(batch_size):
                out = forward(params, buffers, {}, x).reshape(runs, len(y), -1)  # eval mode: no dropout masks
                summed = F.cross_entropy(out.transpose(1, 2), y.expand(runs, -1), reduction="none").sum(dim=1)
                loss += summed
                batch_means += summed / len(y)
                correct += (out.argmax(dim=2) == y).sum(dim=1)
    finally:
        net.template.train()
    rows = zip(*torch.stack([correct, loss, batch_means]).tolist(), strict=True)  # one wait for the three
    return [(100.0 * c / total, v / total, m / total) for c, v, m in rows]


@torch.no_grad()
def _train_mode_pass(
    net: FunctionalNet,
    params: dict[str, Tensor],
    buffers: dict[str, Tensor],
    keys: list[int],
    batches: list[tuple[int, tuple[Tensor, Tensor]]],
) -> tuple[Tensor, Tensor, Tensor]:
    """(correct, summed loss, summed batch means) per model over P test batches (j, (x, y)) of one size in
    training mode, as one forward pass vmapped over the batches (each normalised by its own BatchNorm
    statistics, as a loop over them would) and over the R models when R > 1 (`params`, `buffers` stacked
    then). Model i's masks for batch j are the draws of key (keys[i], j, layer), as in the loop."""
    runs, n_batches = len(keys), len(batches)
    xs = torch.stack([x for _, (x, _) in batches])  # (P, B, ...)
    ys = torch.stack([y for _, (_, y) in batches])
    masks: dict[str, Tensor] = {}
    if net.dropouts:
        per_batch = [net.masks(x[None], functools.partial(ClientStreams.keys, keys, j, device=x.device))
                     for j, (x, _) in batches]  # each (R, B, ...)  # fmt: skip
        masks = {k: torch.stack([m[k] for m in per_batch], dim=1) for k in per_batch[0]}  # (R, P, B, ...)
    lead = (runs, n_batches) if runs > 1 else (n_batches,)
    # train mode writes the running statistics: every batch gets its own copy, thrown away after
    stacked = {k: (v if runs > 1 else v[None])[:, None].expand(runs, n_batches, *v.shape[runs > 1 :])
               .clone().reshape(*lead, *v.shape[runs > 1 :]) for k, v in buffers.items()}  # fmt: skip
    forward = vmap(net, in_dims=(None, 0, 0, 0), randomness="error")  # over the batches
    if runs > 1:
        forward = vmap(forward, in_dims=(0, 0, 0, None), randomness="error")  # over the models
    else:
        masks = {k: v[0] for k, v in masks.items()}
    width = ys.shape[1]
    out = forward(params, stacked, masks, xs).reshape(runs, n_batches * width, -1)
    y = ys.reshape(-1).expand(runs, -1)
    per_sample = F.cross_entropy(out.transpose(1, 2), y, reduction="none")  # (R, P B)
    return (out.argmax(dim=2) == y).sum(dim=1), per_sample.sum(dim=1), per_sample.sum(dim=1) / width


def eval_settings(resolved: RunConfig) -> tuple[bool, int]:
    """(train_mode, batch size) of a run's test evaluation: eval mode in batches of `EVAL_BATCH_SIZE`
    (``paper``), or as the authors' server tests (``authors``): training mode over DataLoader(test_set,
    batch_size=<the clients' batch size>, shuffle=False) (server.py l.29, l.51-68), where each test batch's
    own BatchNorm statistics make the batch size and the test set's order matter."""
    return (True, resolved.batch_size) if resolved.variant == "authors" else (False, EVAL_BATCH_SIZE)


def eval_due(resolved: RunConfig, r: int) -> bool:
    """Whether round r ends with an evaluation: every `eval_every` rounds and after the last."""
    return r % resolved.eval_every == 0 or r == resolved.rounds


def diverged_accuracy(fed: Federation, variant: str) -> float:
    """The accuracy (percent) recorded for a diverged run: chance level 100 / num_classes (``paper``), or the
    share of class 0 in the test set (``authors``: NaN logits, whose argmax is class 0)."""
    if variant == "authors":
        return 100.0 * (fed.test_labels == 0).sum().item() / len(fed.test_labels)
    return 100.0 / fed.num_classes
