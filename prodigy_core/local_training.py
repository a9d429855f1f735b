"""The clients' local steps: E SGD steps of every client from the server's model, as one batched computation
(`local_steps_stacked`, several runs at once for `prodigy_core.groups`) or client after client (the
reference, `local_steps_sequential`); the engine that computes them (`pick_engine`) and the authors'
batch stream (`AuthorsBatchStream`, ``variant="authors"``). Algorithm 1's client side (docs/semantics.md).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap
from torch.nn.utils import parameters_to_vector

from prodigy_core import step_variants
from prodigy_core.config import ConfigError, RunConfig
from prodigy_core.data import Federation
from prodigy_core.streams import ClientStreams, dropout_mask

# engine="auto" on a CPU, per dataset: the faster engine by benchmarks/training.py (its numbers:
# benchmarks/README.md, "training.py: the `auto` engine on a CPU"). Tests pin engine="batched" where they test
# that path.
AUTO_CPU_ENGINE = {"digits": "channels_last", "femnist": "sequential", "cifar10": "sequential"}


def pick_engine(engine: str, device: torch.device, dataset: str) -> str:
    """Resolve engine="auto": batched on CUDA, the measured faster one on CPU (`AUTO_CPU_ENGINE`).

    Engines (same semantics; the same batches, augmentation and dropout masks, from the clients' streams,
    `prodigy_core.streams`, on any device):
    - ``batched``: `torch.func.vmap` of `grad` of a `functional_call` over the clients' stacked parameters
      and BatchNorm buffers, elementwise SGD on the stacked tensors. Every client's dropout masks are made
      before the step (`FunctionalNet.masks`) and passed in (`ClientGrad`); `prodigy_core.groups` stacks
      several runs' clients in the same step this way. Clients smaller than batch_size (``paper`` only)
      are vmapped in groups of equal batch width, so every client's loss and BatchNorm batch statistics use
      exactly its own b_k samples.
    - ``sequential``: the reference, one model copy trained client after client on exactly its valid
      entries, its dropout layers multiplying by the same masks.
    - ``compiled``: the batched engine with its vmapped gradient step under `torch.compile`, built once per
      process and architecture (`cached_compiled_grad`: the first run pays the compilation,
      later runs of the same shapes reuse it; a new batch width, e.g. a small client's, may recompile).
      It takes the same dropout masks as `batched`, so the two agree to float32 rounding (tested with
      dropout). Opt-in: `auto` never picks it (see benchmarks/README.md's notes for where it pays).
    - ``channels_last``, ``bmm_conv``, ``bmm_wgrad``, ``cuda_graphs``, ``channels_last_graphs``,
      ``bmm_wgrad_graphs``: variants of batched's kernels, the same computation, for the GPU window's
      autotune (`prodigy_core.step_variants`; the captured ones, ``*_graphs``, are refused off CUDA).
    - ``auto``: batched on CUDA; on a CPU the faster one as measured by `benchmarks/training.py`
      (`AUTO_CPU_ENGINE`).
    """
    if engine != "auto":
        return engine
    return "batched" if device.type == "cuda" else AUTO_CPU_ENGINE[dataset]


class ClientTooSmallError(ConfigError):
    """An ``authors`` run with a client smaller than batch_size: the authors' code would never return."""


class AuthorsBatchStream:
    """The authors' client batch stream (``variant="authors"``), for all N clients at once.

    The authors' client (senaergisi/prodigy client.py:46-47) holds ``DataLoader(data_set, batch_size,
    shuffle=True, drop_last=True)`` and one ``iter(cycle(train_loader))`` made in ``__init__`` and kept
    across rounds; each of its local steps takes ``next`` of it (client.py:68-73; every client steps every
    round, server.py:38-40). ``cycle`` (client.py:11-14) re-enters the loader when an epoch is exhausted,
    which draws a new shuffle of the client's own samples; ``drop_last`` leaves out the last |D_k| mod b
    samples of each epoch. A client with fewer than b samples has an empty loader, on which ``cycle`` loops
    forever without yielding (the ``except StopIteration`` there never fires): `ClientTooSmallError` here.

    Here client k keeps its current epoch order (global row indices, the first |D_k| entries of row k of
    `perms`) and the position `pos[k]` of its next batch. `next(gens)` gives one local step's (idx (N, b),
    mask (N, b) all True): first, a client whose epoch cannot give a full batch (pos[k] + b > |D_k|) starts
    a new one, ``client_indices[k][torch.randperm(|D_k|, generator=gens[k])]`` (its own CPU generator,
    `streams.ClientStreams`), at position 0; then row k is the epoch's entries pos[k] .. pos[k] + b - 1 and
    pos[k] grows by b. Every client starts "exhausted" (pos[k] = |D_k|), so the first step draws every
    client's first epoch. Client k's augmentation draws from gens[k] after its shuffle. The random numbers
    cannot be the authors' own (their RandomSampler seeds a fresh generator from torch's global one, which
    their dropout and augmentation also draw from); the structure of the batch sequence is theirs.
    `state_dict` (tensors) goes into the checkpoint."""

    def __init__(self, fed: Federation, batch_size: int) -> None:
        sizes = [len(ix) for ix in fed.client_indices]
        small = [k for k, n in enumerate(sizes) if n < batch_size]
        if small:
            k, others = small[0], len(small) - 1
            more = f" (and {others} more client{'s' * (others > 1)})" if others else ""
            raise ClientTooSmallError(
                f"variant: authors: client {k} has {sizes[k]} samples, fewer than batch_size={batch_size}"
                f"{more}: its DataLoader(drop_last=True) yields no batch and the authors' code would never "
                "return here (client.py cycles an empty loader); use variant: paper (batches of "
                "min(batch_size, client size)), or fewer clients (n_clients) or a smaller batch_size"
            )
        self.fed, self.batch_size, self.sizes = fed, batch_size, sizes
        self.perms = torch.zeros(fed.n_clients, max(sizes), dtype=torch.int64, device=fed.device)
        self.pos = list(sizes)
        self._width = torch.arange(batch_size, device=fed.device)
        self._mask = torch.ones(fed.n_clients, batch_size, dtype=torch.bool, device=fed.device)

    def next(self, gens: list[torch.Generator]) -> tuple[Tensor, Tensor]:
        """One local step's (idx (N, b), mask (N, b) all True), drawing client k's new epochs from its CPU
        generator `gens[k]` (see above)."""
        b = self.batch_size
        for k, n in enumerate(self.sizes):
            if self.pos[k] + b > n:
                order = torch.randperm(n, generator=gens[k]).to(self.fed.device)
                self.perms[k, :n] = self.fed.client_indices[k][order]
                self.pos[k] = 0
        offsets = torch.tensor(self.pos, device=self.fed.device)
        idx = self.perms.gather(1, offsets[:, None] + self._width)
        self.pos = [p + b for p in self.pos]
        return idx, self._mask

    def state_dict(self) -> dict[str, Tensor]:
        return {"perms": self.perms.clone(), "pos": torch.tensor(self.pos, dtype=torch.int64)}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        perms, pos = state["perms"], [int(p) for p in state["pos"]]
        if tuple(perms.shape) != tuple(self.perms.shape) or len(pos) != len(self.sizes):
            raise ValueError(
                f"batch stream of shape {tuple(perms.shape)} does not fit {tuple(self.perms.shape)}"
            )
        if any(not 0 <= p <= n for p, n in zip(pos, self.sizes, strict=True)):
            raise ValueError(f"batch stream positions {pos} do not fit the client sizes {self.sizes}")
        self.perms, self.pos = perms.to(self.fed.device, torch.int64).clone(), pos


def make_batch_stream(resolved: RunConfig, fed: Federation) -> AuthorsBatchStream | None:
    """The run's batch stream: `AuthorsBatchStream` under ``authors`` (raises `ClientTooSmallError` for a
    client smaller than batch_size), None under ``paper`` (every step draws `Federation.sample_batch`)."""
    return AuthorsBatchStream(fed, resolved.batch_size) if resolved.variant == "authors" else None


def _draw_batch(
    fed: Federation, batch_size: int, rng: ClientStreams, stream: AuthorsBatchStream | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """One local step's data for all clients: images (N,B,C,H,W), labels (N,B), mask (N,B); the indices from
    `stream` when given (``authors``), else `Federation.sample_batch` (``paper``), client k's indices and
    augmentation from its own generator `rng.gens[k]`."""
    idx, mask = fed.sample_batch(batch_size, rng.gens) if stream is None else stream.next(rng.gens)
    return fed.train_batch(idx, rng.gens), fed.train_labels[idx], mask


def _train_masks(net: FunctionalNet, rng: ClientStreams, clients: list[int], x: Tensor, step: int) -> dict:
    """Dropout masks of `clients`' forward passes on x (len(clients), width, C, H, W) at local step `step`."""
    return net.masks(x, lambda layer: rng.keys([rng.client_keys[k] for k in clients], step, layer, x.device))


class _MaskedDropout(nn.Module):
    """nn.Dropout with its mask given from outside (`mask`, already scaled by 1 / (1 - p)): see
    `FunctionalNet`."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p, self.mask, self.shape = p, None, None

    def forward(self, x: Tensor) -> Tensor:
        self.shape = self.shape or tuple(x.shape[1:])  # recorded by FunctionalNet's shape probe
        return x if self.mask is None else x * self.mask


class FunctionalNet:
    """`model`'s architecture as a function (params, buffers, dropout masks, x) -> scores for torch.func.

    Dropout: its layers multiply by masks made beforehand by `masks`, the counter-based draws of
    `prodigy_core.streams` (keep with probability 1 - p, scaled by 1 / (1 - p)), one (rows, width, ...)
    tensor per dropout layer. Every client's masks then depend on its key alone, not on the device, the
    engine, or the other runs sharing a vmapped computation (`prodigy_core.groups`), and a compiled step uses
    the same masks as an eager one. `template` with its masks set is also the sequential engine's client.
    """

    def __init__(self, model: nn.Module) -> None:
        self.template = copy.deepcopy(model)  # its weights are never used: functional_call supplies them
        for name, m in list(self.template.named_modules()):
            if isinstance(m, nn.Dropout) and m.p > 0:
                self.template.set_submodule(name, _MaskedDropout(m.p))
        self.dropouts = {f"{name}.mask": m for name, m in self.template.named_modules()
                         if isinstance(m, _MaskedDropout)}  # fmt: skip

    def probe(self, x: Tensor) -> None:
        """Learn the dropout layers' input shapes from a forward pass of x[0, :1] (x: rows, width, ...)."""
        if any(m.shape is None for m in self.dropouts.values()):
            training = self.template.training
            with torch.no_grad():
                self.template.eval()(x[0, :1])
            self.template.train(training)

    def masks(self, x: Tensor, keys: Callable[[int], Tensor]) -> dict[str, Tensor]:
        """Dropout masks for a forward pass of x (rows, width, C, H, W) row by row: layer l's (rows,) int64
        keys are keys(l) (`streams.dropout_mask`)."""
        self.probe(x)
        width = x.shape[1]
        return {name: dropout_mask(keys(layer), (width, *m.shape), m.p, x.dtype)
                for layer, (name, m) in enumerate(self.dropouts.items())}  # fmt: skip

    def __call__(self, params: dict, buffers: dict, masks: dict, x: Tensor) -> Tensor:
        return functional_call(self.template, (params, buffers, masks), (x,))


def _client_loss(model: nn.Module, params: dict, buffers: dict, masks: dict, x: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(functional_call(model, (params, buffers, masks), (x,)), y)


# torch.compile keeps at most 8 compiled versions of one function's code, and every compiled ClientGrad
# wraps the same code (vmap's), so architectures, precisions and group sizes of one process share that limit;
# past it torch runs the step uncompiled with a log line, and a run or timing labelled `compiled` would not
# be. This limit, and an error past it.
COMPILE_LIMIT = 64


class ClientGrad:
    """(params, buffers, x, y, dropout masks), each stacked over clients -> every client's gradient of its
    loss; BatchNorm buffers are updated in place. ``compiled``: the vmapped step under torch.compile (at most
    `COMPILE_LIMIT` compiled versions a process, then an error). The masks come from `FunctionalNet.masks`
    of `net`."""

    def __init__(self, model: nn.Module, compiled: bool = False) -> None:
        self.net = FunctionalNet(model)
        fn = vmap(grad(functools.partial(_client_loss, self.net.template)), randomness="error")
        self.fn, self.compiled = (torch.compile(fn) if compiled else fn), compiled

    def __call__(self, params: dict, buffers: dict, x: Tensor, y: Tensor, masks: dict) -> dict:
        if not self.compiled:
            return self.fn(params, buffers, masks, x, y)
        try:
            with torch._dynamo.config.patch(recompile_limit=COMPILE_LIMIT, fail_on_recompile_limit_hit=True):
                return self.fn(params, buffers, masks, x, y)
        except torch._dynamo.exc.FailOnRecompileLimitHit as e:
            raise RuntimeError(
                f"engine='compiled': this process compiled the training step {COMPILE_LIMIT} times (models, "
                "precisions, group sizes), torch.compile's limit (local_training.COMPILE_LIMIT); past it the "
                "step would run uncompiled. Run the rest in a fresh process, or with engine='batched'"
            ) from e
        except torch._dynamo.exc.BackendCompilerFailed as e:
            raise RuntimeError(
                "engine='compiled': torch.compile could not build the training step (on a CPU it needs a "
                "working C++ compiler, on a GPU Triton). Run with engine='batched': the same computation, "
                f"uncompiled. The compiler said: {str(e.inner_exception).strip().splitlines()[0]}"
            ) from e


_COMPILED_STEPS: dict[tuple, Callable] = {}


def cached_compiled_grad(model: nn.Module) -> Callable:
    """The ``compiled`` engine's gradient function for `model`'s architecture, one per process: every run
    and every timing of the same architecture (the module tree, the parameters' and buffers' names, shapes,
    dtypes and device, the training mode) shares one torch.compile'd step, whose compiled graphs torch keeps
    per input shape, so compilation is paid once per process and shape. Its template's weights are never
    read: every call passes the run's own parameters and buffers."""
    named = [*model.named_parameters(), *model.named_buffers()]
    shapes = tuple((n, tuple(t.shape), t.dtype, str(t.device)) for n, t in named)
    key = (repr(model), model.training, shapes)
    if key not in _COMPILED_STEPS:
        _COMPILED_STEPS[key] = ClientGrad(model, compiled=True)
    return _COMPILED_STEPS[key]


def per_client_grad(model: nn.Module, compiled: bool = False, engine: str | None = None) -> ClientGrad:
    """The batched engine's gradient function for `model` (see `ClientGrad`); `engine` (a stacked engine):
    ``compiled`` (or `compiled`) the process's compiled one for this architecture (`cached_compiled_grad`),
    an engine variant its own (`step_variants.make_grad`)."""
    if compiled or engine == "compiled":
        return cached_compiled_grad(model)
    if engine in step_variants.ENGINE_VARIANTS:
        return step_variants.make_grad(engine, ClientGrad(model))
    return ClientGrad(model)


def draw_group(
    feds: list[Federation],
    batch_size: int,
    rngs: list[ClientStreams],
    streams: list[AuthorsBatchStream | None],
    net: FunctionalNet,
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """One local step's images (R N, B, C, H, W), labels (R N, B) and dropout masks of R runs, the values
    `_draw_batch` and `_train_masks` give run by run, drawn for all runs at once where
    they share their federation's tensors: the indices on the host (every client's own CPU generator, in
    its own order), one copy to the device and one gather; the augmentation in one call; each layer's
    masks in one call from the R N clients' keys. Runs with their own label table (label flipping), image
    store or batch stream (``authors``) are drawn run by run. Every run's step counter then advances."""
    first, device = feds[0], feds[0].device
    shared = all(f._index_table is first._index_table and f.train_images is first.train_images for f in feds)
    if shared and all(s is None for s in streams):
        pos = torch.cat([f.sample_positions(batch_size, r.gens)[0] for f, r in zip(feds, rngs, strict=True)])
        n, length = first.n_clients, first._index_table.shape[1]
        flat = pos + (torch.arange(len(pos)) % n * length)[:, None]
        idx = first._index_table.view(-1)[flat.to(device)]
        x = first.train_batch(idx, [g for r in rngs for g in r.gens])
        labels = {id(f.train_labels): f.train_labels for f in feds}
        if len(labels) == 1:
            y = first.train_labels[idx]
        else:  # label-flipped members: one gather per run
            y = torch.cat([f.train_labels[idx[i * n : (i + 1) * n]] for i, f in enumerate(feds)])
    else:
        parts = [_draw_batch(f, batch_size, r, s)[:2] for f, r, s in zip(feds, rngs, streams, strict=True)]
        x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    def keys(layer: int) -> Tensor:
        return torch.cat([ClientStreams.keys(r.client_keys, r.step, layer, device) for r in rngs])

    masks = net.masks(x, keys)
    for r in rngs:
        r.step += 1
    return x, y, masks


def _width_groups(fed: Federation, batch_size: int) -> list[tuple[int, Tensor | None]]:
    """Clients grouped by their batch width b_k = min(batch_size, |D_k|): [(b, client ids or None = all)]."""
    widths = torch.tensor([min(batch_size, len(ix)) for ix in fed.client_indices])
    if bool((widths == widths[0]).all()):
        return [(int(widths[0]), None)]
    return [(int(w), torch.nonzero(widths == w).flatten().to(fed.device)) for w in torch.unique(widths)]


def _trained_groups(
    fed: Federation, widths: list[tuple[int, Tensor | None]], idle: list[int]
) -> list[tuple[int, list[Tensor] | None, Tensor | None]]:
    """The clients that train in `local_steps_stacked`, by batch width (`widths`: `_width_groups`): [(width,
    each run's client ids in it, their rows in the run-major (R N) stack)]; (width, None, None) when every
    client of every run trains at that one width (no indexing). ``idle[i]``: run i's clients 0..idle[i]-1
    train in no group. A group where no client trains is left out."""
    n, device = fed.n_clients, fed.device
    if widths[0][1] is None and not any(idle):
        return [(widths[0][0], None, None)]
    out = []
    for w, ids in widths:
        ids = torch.arange(n, device=device) if ids is None else ids
        per_run = [ids[ids >= k] for k in idle]
        if any(len(c) for c in per_run):
            out.append((w, per_run, torch.cat([c + i * n for i, c in enumerate(per_run)])))
    return out


def local_steps_batched(
    model: nn.Module,
    fed: Federation,
    steps: int,
    lr: float,
    resolved: RunConfig,
    rng: ClientStreams,
    grad_fn: ClientGrad | None = None,
    stream: AuthorsBatchStream | None = None,
    idle: int = 0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """All N clients' E local SGD steps as one vmapped computation; returns the pseudo-gradients (N, d) and
    the clients' BatchNorm buffers {name: (N, ...)}. ``grad_fn``: `per_client_grad(model)` built once by the
    caller (compiled or not); None builds an eager one. ``stream``: the run's `AuthorsBatchStream`
    (``authors``), None: `Federation.sample_batch` (``paper``). ``idle``: clients 0..idle-1 do not train
    (`RunState.idle`)."""
    step = grad_fn or per_client_grad(model)
    ((pseudo_grads, buffers),) = local_steps_stacked(
        [model], [fed], steps, [lr], resolved, [rng], step, streams=[stream], idle=[idle]
    )
    return pseudo_grads, buffers


def local_steps_stacked(
    models: list[nn.Module],
    feds: list[Federation],
    steps: int,
    lrs: list[float],
    resolved: RunConfig,
    rngs: list[ClientStreams],
    grad_fn: ClientGrad,
    streams: list[AuthorsBatchStream | None] | None = None,
    idle: list[int] | None = None,
) -> list[tuple[Tensor, dict[str, Tensor]]]:
    """The E local SGD steps of R runs' N clients each (R = len(models), same architecture, same client
    data sizes, same E, batch size and weight decay: `resolved`'s) as one vmapped computation over R x N
    clients; returns every run's (pseudo-gradients (N, d), BatchNorm buffers {name: (N, ...)}).

    Run i draws its batches, augmentation and dropout masks from its clients' streams `rngs[i]` (batches
    through its `streams[i]` when it has one: ``authors``), so its numbers do not depend on the other runs,
    the engine or the device (`prodigy_core.streams`). Clients with fewer than batch_size samples
    form one vmapped group per batch width, so that every client trains on exactly its b_k valid samples
    (padding would enter BatchNorm's batch statistics); with IID data or large clients there is a single
    group and no indexing, and the R runs' batches and masks are drawn at once (`draw_group`:
    the same values, device kernels per step independent of R).

    ``idle[i]``: run i's clients 0..idle[i]-1 do not train (`RunState.idle`): they are left out of every
    step, so they end where they started (pseudo-gradient 0, the server's BatchNorm buffers). Their batches
    are still drawn and dropped, so every client's generator stays where it would be."""
    runs, n = len(models), feds[0].n_clients
    streams = streams or [None] * runs
    idle = idle or [0] * runs
    solo = _width_groups(feds[0], resolved.batch_size)
    groups = _trained_groups(feds[0], solo, idle)
    stacked = [rows for _, _, rows in groups]
    counts = [None if ids is None else [len(c) for c in ids] for _, ids, _ in groups]  # each run's rows

    def stack(tensors: list[Tensor]) -> Tensor:  # (R, ...) -> (R N, ...), run-major
        return torch.stack([t.detach() for t in tensors]).repeat_interleave(n, dim=0)

    named = [dict(m.named_parameters()) for m in models]
    params = {name: stack([p[name] for p in named]) for name in named[0]}
    named = [dict(m.named_buffers()) for m in models]
    buffers = {name: stack([b[name] for b in named]) for name in named[0]}
    # each group's rows of the weights and buffers, taken once a round (the clients train independently)
    rows_state = [(params, buffers) if ids is None else ({name: v[ids] for name, v in params.items()},
                   {name: v[ids] for name, v in buffers.items()}) for ids in stacked]  # fmt: skip

    def draw_one_width() -> tuple[Tensor, Tensor, dict[str, Tensor]]:  # every run's at once, same values
        x, y, masks = draw_group(feds, resolved.batch_size, rngs, streams, grad_fn.net)
        rows = stacked[0]  # the rows that train (None: all)
        return (x, y, masks) if rows is None else (x[rows], y[rows], {k: m[rows] for k, m in masks.items()})

    members = [None if ids is None else [c.tolist() for c in ids] for _, ids, _ in groups]  # for the masks
    if solo[0][1] is None and hasattr(grad_fn, "local_steps"):  # `step_variants.StaticSteps`' own loop
        grad_fn.local_steps(*rows_state[0], steps, lrs, resolved.weight_decay, counts[0], draw_one_width)
    else:
        for _ in range(steps):
            if solo[0][1] is None:
                batches = [draw_one_width()]
            else:
                batches = _draw_width_groups(
                    feds, resolved.batch_size, rngs, streams, groups, members, grad_fn.net
                )
            for g, (p, b) in enumerate(rows_state):
                xs, ys, ms = batches[g]
                grads = list(grad_fn(p, b, xs, ys, ms).values())
                step_variants.sgd_update(grads, list(p.values()), lrs, resolved.weight_decay, counts[g])
    for ids, (p, b) in zip(stacked, rows_state, strict=True):  # each group's weights and buffers written back
        if ids is not None:
            for name, v in p.items():
                params[name][ids] = v
            for name, v in b.items():
                buffers[name][ids] = v
    end = torch.cat([p.reshape(runs * n, -1) for p in params.values()], dim=1)
    out = []
    for i, model in enumerate(models):
        start = parameters_to_vector(model.parameters()).detach()
        rows = slice(i * n, (i + 1) * n)
        out.append(((start - end[rows]) / lrs[i], {name: v[rows] for name, v in buffers.items()}))
    return out


def _draw_width_groups(
    feds: list[Federation],
    batch_size: int,
    rngs: list[ClientStreams],
    streams: list[AuthorsBatchStream | None],
    groups: list[tuple[int, list[Tensor], Tensor]],
    members: list[list[list[int]]],
    net: FunctionalNet,
) -> list[tuple[Tensor, Tensor, dict[str, Tensor]]]:
    """One local step's (images, labels, dropout masks) of every width group of `_trained_groups` (clients
    of several batch widths), its runs joined: each run draws its own batch (`_draw_batch`), each group
    takes its clients' first `width` samples and their masks (`_train_masks`; `members`: each group's
    client ids per run, on the host)."""
    parts = []  # per run, per width group; None: the run has no client in it
    for i, (fed, rng, stream) in enumerate(zip(feds, rngs, streams, strict=True)):
        x, y, _ = _draw_batch(fed, batch_size, rng, stream)
        parts.append([(x[ids[i], :w], y[ids[i], :w], _train_masks(net, rng, clients[i], x[ids[i], :w],
                       rng.step)) if clients[i] else None
                      for (w, ids, _), clients in zip(groups, members, strict=True)])  # fmt: skip
        rng.step += 1
    return [_cat_runs([run[g] for run in parts if run[g] is not None]) for g in range(len(groups))]


def _cat_runs(parts: list[tuple[Tensor, Tensor, dict[str, Tensor]]]) -> tuple[Tensor, Tensor, dict]:
    """Runs' (images, labels, masks) joined along the client axis (no copy for a single run)."""
    if len(parts) == 1:
        return parts[0]
    xs, ys, ms = zip(*parts, strict=True)
    return torch.cat(xs), torch.cat(ys), {k: torch.cat([m[k] for m in ms]) for k in ms[0]}


def _round_masks(net: FunctionalNet, rng: ClientStreams, batches: list, n_clients: int) -> list[dict]:
    """Every client's dropout masks for the round's local steps, row e * N + k for client k at local step
    e (each cut to that client's batch width), in one counter-based draw per layer instead of one per step
    and client: entry i of a row depends on its key and i alone (`streams.uniforms`), so the widest row's
    draw cut to a client's width is, bit for bit, `_train_masks` of that client and step."""
    x = batches[0][0]
    net.probe(x[:1])
    widths = [mask.sum(dim=1).tolist() for _, _, mask in batches]
    widest = max(max(w) for w in widths)
    drawn = {}
    for layer, (name, m) in enumerate(net.dropouts.items()):
        keys = torch.cat([ClientStreams.keys(rng.client_keys, rng.step + e, layer, x.device)
                          for e in range(len(batches))])  # fmt: skip
        drawn[name] = dropout_mask(keys, (widest, *m.shape), m.p, x.dtype)
    return [{name: masks[e * n_clients + k, : widths[e][k]] for name, masks in drawn.items()}
            for e in range(len(batches)) for k in range(n_clients)]  # fmt: skip


def local_steps_sequential(
    model: nn.Module,
    fed: Federation,
    steps: int,
    lr: float,
    resolved: RunConfig,
    rng: ClientStreams,
    stream: AuthorsBatchStream | None = None,
    idle: int = 0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Reference: the same E local steps on the same batches and dropout masks, one client after another on
    one model copy. ``idle``: clients 0..idle-1 do not train (`RunState.idle`): they keep the server's model.

    The copy runs in channels-last memory format (faster convolutions on a CPU, benchmarks/README.md; native
    for cuDNN); flattening by reshape keeps the logical (N, C, H, W) order of every update vector."""
    batches = [_draw_batch(fed, resolved.batch_size, rng, stream) for _ in range(steps)]
    server_state = copy.deepcopy(model.state_dict())
    net = FunctionalNet(model)  # its template, masks set before every forward pass, is the client
    client = net.template.train().to(memory_format=torch.channels_last)
    weights = list(client.parameters())
    start = parameters_to_vector(model.parameters()).detach()
    masks = _round_masks(net, rng, batches, fed.n_clients)
    rows, reports = [], []
    for k in range(fed.n_clients):
        client.load_state_dict(server_state)
        for e, (x, y, mask) in enumerate(batches if k >= idle else []):
            xk = x[k][mask[k]].contiguous(memory_format=torch.channels_last)
            for name, m in masks[e * fed.n_clients + k].items():
                net.dropouts[name].mask = m
            loss = F.cross_entropy(client(xk), y[k][mask[k]])
            grads = list(torch.autograd.grad(loss, weights))
            with torch.no_grad():
                if resolved.weight_decay:
                    torch._foreach_add_(grads, weights, alpha=resolved.weight_decay)
                torch._foreach_add_(weights, grads, alpha=-lr)
        rows.append((start - torch.cat([w.detach().reshape(-1) for w in weights])) / lr)
        reports.append({name: b.detach().clone() for name, b in client.named_buffers()})
    buffers = {name: torch.stack([rep[name] for rep in reports]) for name in reports[0]} if reports[0] else {}
    rng.step += steps
    return torch.stack(rows), buffers
