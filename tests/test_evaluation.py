"""The ``authors`` evaluation (training mode, test batches of b): stacked passes over the test batches equal
a brute-force loop over them, one nn.Module forward per batch."""

import functools

import pytest
import torch

from prodigy_core import evaluation, local_training
from prodigy_core.data import load_federation
from prodigy_core.models import make_model
from prodigy_core.streams import ClientStreams


@pytest.mark.parametrize("pass_images", [10_000, 100])  # one pass; passes of 3 batches, then the partial one
def test_train_mode_evaluation_in_stacked_passes_equals_the_loop_over_batches(monkeypatch, pass_images):
    monkeypatch.setattr(evaluation, "EVAL_PASS_IMAGES", pass_images)
    fed = load_federation("digits", 4, seed=0)
    batch_size = 32
    assert len(fed.test_labels) % batch_size  # a partial last batch, evaluated on its own statistics
    torch.manual_seed(0)
    model = make_model("digits")
    batched = evaluation.evaluate(model, fed, batch_size, train_mode=True, key=5)
    net = local_training.FunctionalNet(model.train())
    params = {k: v.detach() for k, v in model.named_parameters()}
    correct, loss, batch_means = 0, 0.0, 0.0
    with torch.no_grad():
        for j, (x, y) in enumerate(fed.test_batches(batch_size)):  # brute force: the authors' loop
            keys = functools.partial(ClientStreams.keys, [5], j, device=x.device)  # batch j's masks, key 5
            masks = {k: v[0] for k, v in net.masks(x[None], keys).items()}
            buffers = {k: v.clone() for k, v in model.named_buffers()}  # train mode writes them
            out = net(params, buffers, masks, x)  # the template is in train mode: batch statistics
            correct += int((out.argmax(dim=1) == y).sum())
            loss += float(torch.nn.functional.cross_entropy(out, y, reduction="sum"))
            batch_means += float(torch.nn.functional.cross_entropy(out, y))
    total = len(fed.test_labels)
    assert batched[0] == pytest.approx(100.0 * correct / total, abs=1e-12)
    assert batched[1] == pytest.approx(loss / total, rel=1e-5)
    assert batched[2] == pytest.approx(batch_means / total, rel=1e-5)  # the authors' test loss
