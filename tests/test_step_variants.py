"""Engine variants of the batched local step (issue 44, `prodigy_core.step_variants`): each is the `batched`
engine's computation (float64, dropout on, the same streams), its launches per step do not grow with the
group, the CUDA-only one is refused on a CPU in one line, and a run's record names the variant it ran."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from prodigy_core import local_training, step_variants, training
from prodigy_core.attacks import idle_byzantine
from prodigy_core.config import ConfigError, RunConfig
from prodigy_core.data import load_federation
from prodigy_core.models import make_model
from prodigy_core.step_variants import FoldedGrad, StaticSteps, _FoldedBatchNorm, _FoldedConv
from prodigy_core.streams import ClientStreams

TINY = dict(dataset="digits", n_clients=4, n_byzantine=0, defense="average", attack="none", rounds=2,
            local_steps=2, batch_size=32, eval_every=2, device="cpu")  # fmt: skip


def _float64_federation(distribution: str, n: int = 4):
    """digits in float64: the images jittered by 1e-3 (digits' constant backgrounds make exact max-pooling
    ties, which any rounding difference routes to another pixel: tests/test_training.py) and every training
    batch cast to float64, so the dropout masks are float64 too."""
    fed = load_federation("digits", n, distribution=distribution, seed=0)
    jitter = torch.rand(fed.train_images.shape, generator=torch.Generator().manual_seed(2))
    fed.train_images = fed.train_images + 1e-3 * jitter
    plain = fed.train_batch
    fed.train_batch = lambda idx, gens: plain(idx, gens).double()
    return fed


def _steps(fed, grad_fn, model, steps=3, batch_size=32, authors=False, idle=0):
    cfg = RunConfig(**{**TINY, "n_clients": fed.n_clients, "batch_size": batch_size, "weight_decay": 1e-2})
    rng = ClientStreams(1, fed.n_clients)
    stream = local_training.AuthorsBatchStream(fed, batch_size) if authors else None
    if grad_fn == "sequential":
        return local_training.local_steps_sequential(
            model, fed, steps, 0.05, cfg.resolved(), rng, stream, idle=idle
        )
    return local_training.local_steps_batched(
        model, fed, steps, 0.05, cfg.resolved(), rng, grad_fn=grad_fn, stream=stream, idle=idle
    )


def _model():
    torch.manual_seed(0)
    model = make_model("digits").double().train()
    assert any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules())  # dropout on
    return model


@pytest.mark.parametrize("distribution", ["iid", "dirichlet"])
@pytest.mark.parametrize(("conv", "channels_last"), [("grouped", True), ("bmm", False), ("bmm_wgrad", True)])
def test_client_folded_variants_equal_batched_in_float64(distribution, conv, channels_last):
    """channels_last and bmm_conv: the client-folded layers give the batched engine's pseudo-gradients and
    BatchNorm buffers to float64 rounding, with one batch width (iid) and several (Dirichlet's small
    clients)."""
    fed = _float64_federation(distribution)
    model = _model()
    g_ref, buf_ref = _steps(fed, None, model)
    g, buf = _steps(
        fed, FoldedGrad(local_training.FunctionalNet(model), conv=conv, channels_last=channels_last), model
    )
    assert g.dtype == torch.float64
    torch.testing.assert_close(g, g_ref, rtol=1e-10, atol=1e-10)
    assert buf.keys() == buf_ref.keys() and buf
    for name in buf_ref:
        torch.testing.assert_close(buf[name], buf_ref[name], rtol=1e-10, atol=1e-10)


class _CountedRows:
    """A gradient function that notes how many client rows each call trains."""

    def __init__(self, fn, seen: list[int]) -> None:
        self.fn, self.net, self.seen = fn, fn.net, seen

    def __call__(self, params, buffers, x, y, masks):
        self.seen.append(len(y))
        return self.fn(params, buffers, x, y, masks)


@pytest.mark.parametrize("distribution", ["iid", "dirichlet"])
@pytest.mark.parametrize("engine", ["sequential", "batched", "channels_last", "static"])
def test_idle_clients_keep_the_server_model_and_the_others_train_as_if_all_did(
    engine, distribution, monkeypatch
):
    """`RunState.idle` (the attack never reads the Byzantine clients' honest updates): clients 0 and 1 of 4
    take no step, so their pseudo-gradients are exactly 0 and their BatchNorm buffers exactly the server's,
    while clients 2 and 3 get what they get when all four train (float64 rounding: the same batches and
    masks). The work is skipped, not thrown away: the gradient function sees 2 client rows a step, not 4."""
    fed = _float64_federation(distribution)
    model = _model()
    seen: list[int] = []

    if engine == "sequential":
        plain = F.cross_entropy  # one call per client and step
        counted = lambda *a, **k: seen.append(1) or plain(*a, **k)  # noqa: E731
        monkeypatch.setattr(local_training.F, "cross_entropy", counted)

    def engine_fn():
        if engine == "sequential":
            return "sequential"
        base = local_training.per_client_grad(model)
        if engine == "channels_last":
            base = FoldedGrad(local_training.FunctionalNet(model), conv="grouped", channels_last=True)
        counted = _CountedRows(base, seen)
        return StaticSteps(counted) if engine == "static" else counted

    g_all, buf_all = _steps(fed, engine_fn(), model)
    assert sum(seen) == 4 * 3  # every client, 3 steps
    seen.clear()
    g, buf = _steps(fed, engine_fn(), model, idle=2)
    assert sum(seen) == 2 * 3
    assert torch.equal(g[:2], torch.zeros_like(g[:2])) and g[2:].abs().sum() > 0
    torch.testing.assert_close(g[2:], g_all[2:], rtol=1e-10, atol=1e-10)
    server = dict(model.named_buffers())
    assert buf.keys() == server.keys() and server
    for name in server:
        assert torch.equal(buf[name][:2], server[name].expand_as(buf[name][:2])), name
        torch.testing.assert_close(buf[name][2:], buf_all[name][2:], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    ("attack", "variant", "idle"),
    [("alie", "paper", 3), ("foe_100", "paper", 3), ("foe_0.1", "authors", 3), ("gaussian", "paper", 3),
     ("alie", "authors", 0), ("none", "paper", 0), ("sf", "paper", 0), ("lf", "paper", 0)],
)  # fmt: skip
def test_a_runs_idle_clients_are_its_byzantine_ones_when_its_attack_ignores_them(attack, variant, idle):
    """`attacks.idle_byzantine` (what `start_run` sets and the GPU driver's estimates read): f = 3 under an
    attack whose rows come from the honest updates alone, none where the Byzantine clients' own training is
    sent (none, SF, LF; the authors' ALIE, which sends it at z = 0)."""
    config = RunConfig(**{**TINY, "n_clients": 10, "n_byzantine": 3, "attack": attack, "variant": variant})
    assert idle_byzantine(attack, 3, variant) == idle
    assert training.start_run(config, torch.device("cpu"), "sequential").idle == idle


@pytest.mark.parametrize("authors", [False, True])  # the authors' batch stream: drawn run by run
@pytest.mark.parametrize("engine", list(step_variants.GRAPHED))
def test_static_buffer_steps_are_their_uncaptured_engines_bit_for_bit(engine, authors):
    """A captured engine's static-buffer path (the capture itself is CUDA's): the same kernels on the same
    values, so the same bits as the engine it captures (cuda_graphs: batched; channels_last_graphs and
    bmm_wgrad_graphs: their folded step), float64 and float32; in float64 batched's to rounding, with
    dropout on."""
    for dtype in (torch.float64, torch.float32):
        fed = (
            _float64_federation("iid")
            if dtype == torch.float64
            else load_federation("digits", 4, distribution="iid", seed=0)
        )
        model = _model().to(dtype)
        uncaptured = step_variants.GRAPHED[engine]
        plain = (
            None
            if uncaptured == "batched"
            else step_variants.make_grad(uncaptured, local_training.ClientGrad(model))
        )
        g_ref, buf_ref = _steps(fed, plain, model, authors=authors)
        static = step_variants.make_grad(engine, local_training.ClientGrad(model), capture=False)
        assert isinstance(static, StaticSteps)
        g, buf = _steps(fed, static, model, authors=authors)
        assert static.static["x"].dtype == dtype  # the static path, not the loop of several batch widths
        assert torch.equal(g, g_ref)
        assert all(torch.equal(buf[k], buf_ref[k]) for k in buf_ref)
        if dtype == torch.float64 and plain is not None:
            g_batched, buf_batched = _steps(fed, None, model, authors=authors)
            torch.testing.assert_close(g, g_batched, rtol=1e-10, atol=1e-10)
            for k in buf_batched:
                torch.testing.assert_close(buf[k], buf_batched[k], rtol=1e-10, atol=1e-10)


def test_static_buffer_steps_of_a_group_are_each_runs_own():
    """Three runs drawn together (`local_training.draw_group`: one gather, one mask draw per layer) give each
    run what it gets alone in the static path, and the steps after the first round reuse the buffers."""
    fed = load_federation("digits", 4, distribution="iid", seed=0)
    cfg = RunConfig(**TINY).resolved()
    torch.manual_seed(0)
    models = [make_model("digits").train() for _ in range(3)]
    static = StaticSteps(local_training.ClientGrad(models[0]))
    for _ in range(2):  # two rounds: the second writes into the first's buffers
        rngs = [ClientStreams(i, 4) for i in range(3)]
        together = local_training.local_steps_stacked(models, [fed] * 3, 2, [0.05] * 3, cfg, rngs, static)
    assert len(static.static["x"]) == 3 * 4  # the static path
    for i, model in enumerate(models):
        ((alone, buf),) = local_training.local_steps_stacked(
            [model], [fed], 2, [0.05], cfg, [ClientStreams(i, 4)], local_training.ClientGrad(model)
        )
        assert torch.equal(together[i][0], alone)
        assert all(torch.equal(together[i][1][k], buf[k]) for k in buf)


@pytest.mark.parametrize(("kernel", "padding"), [(5, 2), (3, 1)])  # the FEMNIST and CIFAR-10 convolutions
@pytest.mark.parametrize(("impl", "channels_last"), [("grouped", True), ("bmm", False), ("bmm_wgrad", True)])
def test_folded_convolution_and_batchnorm_are_each_clients_own(kernel, padding, impl, channels_last):
    """Against each client's own nn.functional call (float64), forward and gradients."""
    gen = torch.Generator().manual_seed(0)
    n, b, c, o = 3, 4, 2, 5
    x = torch.randn(n, b, c, 9, 9, generator=gen, dtype=torch.float64)
    conv = nn.Conv2d(c, o, kernel, padding=padding).double()
    w = torch.randn(n, o, c, kernel, kernel, generator=gen, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(n, o, generator=gen, dtype=torch.float64, requires_grad=True)
    folded = _FoldedConv(conv, impl, channels_last)
    out = torch.func.functional_call(folded, {"weight": w, "bias": bias}, (x,))
    ref = torch.stack([F.conv2d(x[k], w[k], bias[k], padding=padding) for k in range(n)])
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    grads = torch.autograd.grad(out.square().sum(), (w, bias))
    refs = torch.autograd.grad(ref.square().sum(), (w, bias))
    for g, r in zip(grads, refs, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)
    bn = nn.BatchNorm2d(o).double()
    state = {k: torch.stack([v] * n) for k, v in bn.state_dict().items()}
    params = {k: state.pop(k) for k in ("weight", "bias")}
    y = torch.func.functional_call(_FoldedBatchNorm(bn), (params, state), (out,))
    for k in range(n):
        mean, var = torch.zeros(o, dtype=torch.float64), torch.ones(o, dtype=torch.float64)
        expect = F.batch_norm(out[k], mean, var, params["weight"][k], params["bias"][k], True, 0.1, 1e-5)
        torch.testing.assert_close(y[k], expect, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(state["running_mean"][k], mean, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(state["running_var"][k], var, rtol=1e-12, atol=1e-12)
    assert state["num_batches_tracked"].tolist() == [1] * n


def test_the_batched_weight_gradient_passes_autograds_gradcheck_and_keeps_dtypes_under_autocast():
    """bmm_wgrad's hand-written backward against finite differences (float64, torch.autograd.gradcheck), for
    the input, the weights and the bias; under bf16 autocast the convolution runs in bf16 (as F.conv2d's
    would) and each gradient comes back in its input's dtype, close to the float32 gradients."""
    from prodigy_core.step_variants import _BmmWeightGradConv

    gen = torch.Generator().manual_seed(1)
    conv = _FoldedConv(nn.Conv2d(2, 3, 3, padding=1), "bmm_wgrad", True)
    x = torch.randn(2, 3, 2, 5, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, 3, 2, 3, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(2, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *t: _BmmWeightGradConv.apply(*t, conv), (x, w, bias))
    x32, w32, b32 = (t.detach().float().requires_grad_() for t in (x, w, bias))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = _BmmWeightGradConv.apply(x32, w32, b32, conv)
    assert out.dtype == torch.bfloat16
    grads = torch.autograd.grad(out.float().square().sum(), (x32, w32, b32))
    ref = conv._grouped(x32, w32, b32)
    refs = torch.autograd.grad(ref.square().sum(), (x32, w32, b32))
    for g, r in zip(grads, refs, strict=True):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, r, rtol=0.05, atol=0.05 * float(r.abs().max()))


@pytest.mark.parametrize("engine", list(step_variants.GRAPHED))
def test_a_captured_engine_is_refused_on_a_cpu_in_one_line_naming_its_uncaptured_one(engine):
    uncaptured = step_variants.GRAPHED[engine]
    refusal = rf"^engine='{engine}' .*needs a CUDA device.*engine='{uncaptured}'"
    with pytest.raises(ConfigError, match=refusal):
        training.run(RunConfig(**TINY, engine=engine), progress=False)


# ------------------------------------------------------------------------------------ launches per step
def _digits_on_device():
    """digits for 4 clients and its tensors to place on the emulated accelerator (all but the host's copy of
    the client sizes, test_host_waits.py)."""
    fed = load_federation("digits", 4, distribution="iid", seed=0)
    fed._cpu_sizes = fed._cpu_sizes.clone()
    return fed, [t for k, t in vars(fed).items() if isinstance(t, torch.Tensor) and k != "_cpu_sizes"]


def _kernels_per_step(
    on_accelerator, monkeypatch, runs: int, engine: str, idle: bool = False, decayed: bool = False
) -> int:
    """Device kernels of one local step of a group of `runs` digits runs (4 clients each) under `engine`
    (a captured one on its static-buffer path), on the emulated accelerator: a round of 2 steps minus a round
    of 1 (the per-round stacking and outputs cancel). `idle`: every other run (the first included) has 2 idle
    clients (`training.RunState.idle`). `decayed`: the later half of the runs at a decayed lr."""
    fed, data = _digits_on_device()
    cfg = RunConfig(**{**TINY, "batch_size": 16}).resolved()
    torch.manual_seed(0)
    models = [make_model("digits").train() for _ in range(runs)]
    base = local_training.ClientGrad(models[0])
    grad_fn = base if engine == "batched" else step_variants.make_grad(engine, base, capture=False)
    tensors = [t for m in models for t in (*m.parameters(), *m.buffers())]
    counts = []
    with on_accelerator(*tensors, *data) as accelerator:
        to = torch.Tensor.to

        def to_device(t, *args, **kwargs):  # a host tensor copied to the device lives there
            out = to(t, *args, **kwargs)
            if any(isinstance(a, torch.device) for a in (*args, *kwargs.values())):
                accelerator.place(out)
            return out

        monkeypatch.setattr(torch.Tensor, "to", to_device)
        for steps in (1, 2):
            rngs = [ClientStreams(i, 4) for i in range(runs)]
            before = accelerator.kernels
            idles = [2 * (idle and i % 2 == 0) for i in range(runs)]
            lrs = [0.005 if decayed and i >= runs // 2 else 0.05 for i in range(runs)]
            local_training.local_steps_stacked(models, [fed] * runs, steps, lrs, cfg, rngs, grad_fn,
                                         idle=idles)  # fmt: skip
            counts.append(accelerator.kernels - before)
        monkeypatch.setattr(torch.Tensor, "to", to)
    return counts[1] - counts[0]


@pytest.mark.parametrize("idle", [False, True])
@pytest.mark.parametrize("engine", ["batched", *step_variants.ENGINE_VARIANTS])
def test_device_kernels_of_a_local_step_do_not_grow_with_the_group(on_accelerator, monkeypatch, engine, idle):
    """Every stacked engine's step (the captured ones on their static-buffer path) draws all R runs' batches
    and masks at once (`local_training.draw_group`) and computes the R N clients in one pass: its device
    kernels per local step are the same at R = 1, 4 and 16. Before, every run drew its own: 111 kernels a step
    at R = 1, 189 at R = 4. With idle clients in some runs, the rows that train are taken from that one draw
    in one gather per tensor, whatever R."""
    kernels = {r: _kernels_per_step(on_accelerator, monkeypatch, r, engine, idle) for r in (1, 4, 16)}
    assert kernels[1] == kernels[4] == kernels[16] > 0


@pytest.mark.parametrize("engine", ["batched", "cuda_graphs"])
def test_a_group_whose_later_runs_lr_decayed_launches_as_many_kernels_whatever_its_size(
    on_accelerator, monkeypatch, engine
):
    """Helper 51: where the runs' lrs differed, the SGD update took two launches per run (R = 1/4/16: 113,
    119, 143 kernels a step). Now one per block of consecutive runs sharing their lr: two blocks (the later
    half decayed) cost the same at R = 4 and 16, one more update launch than a group at one lr."""
    kernels = {r: _kernels_per_step(on_accelerator, monkeypatch, r, engine, decayed=True) for r in (4, 16)}
    same = _kernels_per_step(on_accelerator, monkeypatch, 4, engine)
    assert kernels[4] == kernels[16] > same


@pytest.mark.parametrize("engine", list(step_variants.GRAPHED))
def test_a_captured_step_never_reads_the_device(on_accelerator, monkeypatch, engine):
    """What a captured engine records in its CUDA graph (`StaticSteps._step`: the gradient, weight decay and
    SGD update on the static buffers) runs on the device only: on the emulated accelerator it reads nothing
    back to the host (a read, `.item()`, `.tolist()`, a boolean mask, would break the capture), in each of
    the steps of a round, and it launches kernels."""
    fed, data = _digits_on_device()
    cfg = RunConfig(**{**TINY, "batch_size": 16, "weight_decay": 1e-2}).resolved()
    torch.manual_seed(0)
    model = make_model("digits").train()
    grad_fn = step_variants.make_grad(engine, local_training.ClientGrad(model), capture=False)
    step, recorded = StaticSteps._step, []

    def watched(self, *args):
        waits, kernels = accelerator.waits, accelerator.kernels
        step(self, *args)
        recorded.append((accelerator.waits - waits, accelerator.kernels - kernels))

    monkeypatch.setattr(StaticSteps, "_step", watched)
    with on_accelerator(*model.parameters(), *model.buffers(), *data) as accelerator:
        local_training.local_steps_stacked([model], [fed], 3, [0.05], cfg, [ClientStreams(0, 4)], grad_fn)
    assert len(recorded) == 3 and all(waits == 0 and kernels > 0 for waits, kernels in recorded)


# ------------------------------------------------------------------------------------ the autotune's choice
def test_the_autotune_chooses_a_faster_variant_the_gate_accepts(monkeypatch):
    """On the CPU of `gpu_run.py --simulate`, given the variants (`engine_candidates("cpu")`) and a timer
    that makes bmm_conv the fastest (whatever this CPU measures): the gate trains it (fp32, the batched
    computation to rounding) against the reference, accepts it, and the autotune chooses it."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import autotune
    from prodigy_core.experiments import load_experiment

    # the variants most likely to pay first (autotune.VARIANT_ORDER: the 2026-11-27 profile)
    assert autotune.engine_candidates("cpu") == (
        "batched",
        "channels_last",
        "bmm_wgrad",
        "bmm_conv",
        "compiled",
    )
    cuda_engines = autotune.CANDIDATES["cuda"]["engine"]
    assert set(step_variants.ENGINE_VARIANTS) <= set(cuda_engines) and cuda_engines[-1] == "compiled"
    assert cuda_engines[1:3] == ("bmm_wgrad_graphs", "channels_last_graphs")  # captured first
    space = {"precision": ("fp32",), "size": (1,), "engine": autotune.engine_candidates("cpu")}
    monkeypatch.setitem(autotune.CANDIDATES, "cpu", space)
    speed = {"bmm_conv": 4.0, "channels_last": 2.0, "bmm_wgrad": 1.5, "batched": 1.0, "compiled": 0.5}
    timed = []

    def timer(resolved, fed, precision, engine, size):
        timed.append(engine)
        return 1.0 / speed[engine]

    config = load_experiment("quickstart_digits", scale="smoke").configs[0]
    config = config.replace(device="cpu", distribution="iid", engine="batched")
    fed = training.run_federation(config.resolved(), torch.device("cpu"))
    # a budget with room for compiled's compilation (the default 45 s leaves it out: autotune.COMPILE_S)
    report = autotune.autotune({"digits": config}, {"digits": fed}, timer=timer, log=lambda line: None,
                               budget_s=1000.0)  # fmt: skip
    tune = report["datasets"]["digits"]
    assert timed == list(autotune.engine_candidates("cpu"))
    verdicts = {(g["engine"], g["accepted"]) for g in tune["gate"]}
    assert verdicts == {("bmm_conv", True), ("channels_last", True)}
    assert all(0 < g["measures"]["param_rel"] < 1e-3 for g in tune["gate"])  # rounding, not bits
    assert tune["chosen"] == {"precision": "fp32", "engine": "bmm_conv"}
    assert report["peak"]["tflops"] > 0 and tune["gflop_per_image"] > 0  # autotune.json's rates
    for row in tune["timings"]:
        assert row["wall_s"] >= 0  # the timing's wall clock, warm-up (compilation) included
        assert row["tflops"] == pytest.approx(row["images_per_s"] * tune["gflop_per_image"] / 1e3)
        assert row["peak_share"] == pytest.approx(row["tflops"] / report["peak"]["tflops"])


def test_a_step_is_timed_in_steady_state_after_a_captured_engines_warm_up_and_capture(monkeypatch):
    """`autotune.time_step` times steady state: a captured engine's first step is eager (its warm-up), its
    second records the CUDA graph, and only the replays after them are what the window's runs take. With
    steps costing 9 s, 5 s, then 1 s each (a fake clock), 3 timed steps give 1 s a step; timing from the
    second step, as before, gave (5 + 1 + 1) / 3."""
    import sys
    import types
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import autotune
    from prodigy_core.experiments import load_experiment

    clock, costs = [0.0], iter([9.0, 5.0, 1.0, 1.0, 1.0])

    def step(*args, **kwargs):
        clock[0] += next(costs)

    monkeypatch.setattr(autotune.local_training, "local_steps_stacked", step)
    monkeypatch.setattr(autotune, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    config = load_experiment("quickstart_digits", scale="smoke").configs[0].replace(device="cpu")
    fed = training.run_federation(config.resolved(), torch.device("cpu"))
    assert autotune.time_step(config, fed, "fp32", "batched", 1, steps=3) == 1.0
    assert next(costs, None) is None  # every step taken: 2 warm-up, 3 timed


def test_throughput_smoke_prints_every_variants_rate_and_share_of_the_peak(capsys):
    """benchmarks/throughput.py --smoke on the CPU: the measured peak, then per engine its images/s, TFLOP/s,
    share of the peak and warm-up seconds; cuda_graphs refused in its row with the reason."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import throughput

    assert throughput.main(["--smoke"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("device: CPU") and "TFLOP/s (float32 128^3 matrix product)" in out[0]
    rows = {line.split(" | ")[2]: line.split(" | ") for line in out if line.startswith("digits | fp32")}
    assert set(rows) == {"batched", *step_variants.ENGINE_VARIANTS}
    peak = float(out[0].split("peak ")[1].split(" TFLOP/s")[0])
    for engine in ("batched", "channels_last", "bmm_conv"):
        images, tflops, share, first = rows[engine][4:]
        assert float(images.replace(",", "")) > 0 and float(tflops) > 0
        # the share is the row's TFLOP/s over the peak of the first line, to the printed digits
        assert float(share.removesuffix("%")) == pytest.approx(100 * float(tflops) / peak, rel=0.06)
        assert float(first) >= -0.5  # wall clock less the timed steps: noise can make it a little negative
    for engine in step_variants.CUDA_ONLY:
        assert rows[engine][4].startswith(f"refused: ConfigError: engine='{engine}'")


def test_throughput_writes_the_table_and_each_engines_profile_within_its_budget(
    tmp_path, capsys, monkeypatch
):
    """Issue 44's GPU command on the CPU: --out gets throughput.md (the printed rows as a markdown table) and,
    with --profile, variants-profile.txt with one profile per engine that ran, at its fastest (precision,
    size); --budget 0 times nothing and says so in each row; --data reads a folder without the data sets
    and skips them with the reason, the others running."""
    import os
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import throughput

    out = tmp_path / "out"
    assert throughput.main(["--smoke", "--profile", "--out", str(out), "--budget", "600"]) == 0
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("digits | fp32")]
    table = (out / "throughput.md").read_text().splitlines()
    assert table[0].startswith("device: CPU") and table[2] == f"| {' | '.join(throughput.HEADER)} |"

    def cells(line: str) -> list[str]:
        return [c.strip() for c in line.strip().strip("|").split(" | ") if c.strip()]

    assert [cells(line) for line in table[4:]] == [cells(line) for line in printed]
    profiles = (out / "variants-profile.txt").read_text()
    ran = [line.split(" | ")[2] for line in printed if not line.split(" | ")[4].startswith("refused")]
    assert [line.split(", ")[1] for line in profiles.splitlines() if line.startswith("# digits")] == ran
    ran_expected = 1 + len(step_variants.ENGINE_VARIANTS) - len(step_variants.CUDA_ONLY)  # batched + CPU ones
    assert profiles.count("## top 15 CPU ops by self_cpu_time_total") == len(ran) == ran_expected

    capsys.readouterr()
    none = tmp_path / "none"
    assert throughput.main(["--smoke", "--budget", "0", "--out", str(none)]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("digits | fp32")]
    assert len(rows) == 1 + len(step_variants.ENGINE_VARIANTS)
    assert all("not timed: the --budget was spent" in row for row in rows)

    # one compiled row after the first dataset's other engines (the first precision and size: its compilation
    # measured while most of the budget is left), the others after every other engine of every dataset, cut
    # first by the budget
    calls = []
    monkeypatch.setattr(throughput, "time_step", lambda c, f, p, engine, *a: calls.append(engine) or 0.01)
    assert throughput.main(["--smoke", "--engines", "compiled", "batched", "--sizes", "1", "2"]) == 0
    assert calls == ["batched", "batched", "compiled", "compiled"]
    monkeypatch.setattr(throughput, "COMPILE_S", 10**6)
    calls.clear()
    assert throughput.main(["--smoke", "--engines", "compiled", "batched", "--budget", "600"]) == 0
    assert calls == ["batched"] and "compiled | 1 | not timed" in capsys.readouterr().out

    def out_of_memory_when_profiled(c, f, p, engine, size, steps):
        if steps == throughput.PROFILE_STEPS:
            raise RuntimeError("CUDA out of memory")
        return 0.01

    monkeypatch.setattr(throughput, "time_step", out_of_memory_when_profiled)
    failing = tmp_path / "failing"
    assert throughput.main(["--smoke", "--engines", "batched", "--profile", "--out", str(failing)]) == 0
    assert (
        "profile failed (RuntimeError: CUDA out of memory)" in (failing / "variants-profile.txt").read_text()
    )
    assert "| digits | fp32 | batched | 1 |" in (failing / "throughput.md").read_text()

    for name in ("PRODIGY_FEMNIST_DIR", "PRODIGY_DATA_DIR"):  # restored after the test: --data sets them
        monkeypatch.setenv(name, "")
    capsys.readouterr()
    femnist = ["--datasets", "femnist", "--peak-size", "128", "--data", str(tmp_path / "empty")]
    assert throughput.main(femnist) == 0
    assert "femnist: skipped" in capsys.readouterr().out
    # the loaders read that folder only (as gpu_run's), CIFAR-10 from a scratch folder of its own
    assert Path(os.environ["PRODIGY_FEMNIST_DIR"]).parent == tmp_path / "empty"
    assert Path(os.environ["PRODIGY_DATA_DIR"]).name.startswith("prodigy-throughput-")


def test_throughput_starts_the_profiler_before_its_timings_capture_any_graph(monkeypatch):
    """benchmarks/throughput.py --profile starts the profiler (`gpu_run.init_profiler_for_cuda_graphs`)
    before its first timing, whose captured engines make CUDA graphs; without --profile it never does."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import throughput

    calls = []
    monkeypatch.setattr(throughput, "init_profiler_for_cuda_graphs", lambda: calls.append("profiler"))
    monkeypatch.setattr(throughput, "time_step", lambda *a, **k: calls.append("timing") or 0.01)
    monkeypatch.setattr(throughput, "profile_engines", lambda *a, **k: "")
    assert throughput.main(["--smoke", "--engines", "batched", "--profile"]) == 0
    assert calls == ["profiler", "timing"]
    calls.clear()
    assert throughput.main(["--smoke", "--engines", "batched"]) == 0
    assert calls == ["timing"]


# ------------------------------------------------------------------------------------------------ groups
@pytest.mark.parametrize(
    ("engine", "distribution"),
    [
        ("channels_last", "dirichlet"),
        ("bmm_conv", "dirichlet"),
        ("bmm_wgrad", "dirichlet"),
        ("cuda_graphs", "iid"),
        ("channels_last_graphs", "iid"),
        ("bmm_wgrad_graphs", "iid"),
    ],
)
def test_a_group_of_variant_runs_equals_each_run_alone_batched(tmp_path, monkeypatch, engine, distribution):
    """tests/test_groups.py's four runs (CClip + ALIE, ProDiGy + LF: its own labels, NNM + TM + SF at another
    lr, average) in float64, grouped under a variant, against each alone under `batched`: the same models,
    momentum, attack parameters and zeroed clients after 2 rounds. The captured engines run their
    static-buffer path uncaptured (the capture is CUDA's), on iid data (one batch width: Dirichlet's fall
    back to the loop)."""
    import test_groups as tg

    from prodigy_core.data import Federation

    normalise = Federation.normalise
    monkeypatch.setattr(Federation, "normalise", lambda self, x: normalise(self, x).double())
    static_rows = []
    if engine in step_variants.GRAPHED:
        make_grad = step_variants.make_grad
        monkeypatch.setattr(step_variants, "make_grad", lambda e, base: make_grad(e, base, capture=False))
        step = StaticSteps._step

        def counted(self, st, *args):
            static_rows.append(len(st["x"]))  # 4 runs x 6 clients, less the ALIE run's 2 idle Byzantine
            step(self, st, *args)

        monkeypatch.setattr(StaticSteps, "_step", counted)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        configs = [c.replace(distribution=distribution) for c in tg.CONFIGS]
        solo = tg._solo_states(configs, tmp_path / "solo")
        grouped = tg._group_states([c.replace(engine=engine) for c in configs], tmp_path / "group")
    finally:
        torch.set_default_dtype(previous)
    for config in configs:
        tg._assert_same_run(grouped[config.key()], solo[config.key()])
        assert grouped[config.key()]["result"]["environment"]["engine"] == engine
    static_steps = [4 * 6 - 2] * 2 * tg.STOP if engine in step_variants.GRAPHED else []
    assert static_rows == static_steps


# ------------------------------------------------------------------------- on a GPU (skipped without one)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none here)")


@cuda
@pytest.mark.parametrize("engine", list(step_variants.GRAPHED))
def test_cuda_graph_replays_take_the_batched_engines_steps(engine):
    """Captured once, replayed: two rounds of 3 steps (the first: a warm-up step, the capture, replays; the
    second: replays only) give the batched engine's pseudo-gradients and buffers, in float64 (the folded
    variants' kernels differ from batched's: in float32, TF32 convolutions would set the tolerance)."""
    fed = load_federation("digits", 4, distribution="iid", seed=0, device=torch.device("cuda"))
    plain = fed.train_batch
    fed.train_batch = lambda idx, gens: plain(idx, gens).double()
    torch.manual_seed(0)
    model = make_model("digits").double().cuda().train()
    cfg = RunConfig(**{**TINY, "device": "cuda"}).resolved()
    static = step_variants.make_grad(engine, local_training.ClientGrad(model))
    for _ in range(2):
        (ref,), (got,) = (
            local_training.local_steps_stacked([model], [fed], 3, [0.05], cfg, [ClientStreams(0, 4)], grad_fn)
            for grad_fn in (local_training.ClientGrad(model), static)
        )
        torch.testing.assert_close(got[0], ref[0], rtol=1e-10, atol=1e-10)
        for k in ref[1]:
            torch.testing.assert_close(got[1][k], ref[1][k], rtol=1e-10, atol=1e-10)
    assert any(isinstance(held[1], torch.cuda.CUDAGraph) for held in static.graphs.values())


@cuda
@pytest.mark.parametrize("engine", ["channels_last", "bmm_conv", "bmm_wgrad"])
def test_folded_variants_equal_batched_on_cuda_in_float64(engine):
    fed = load_federation("digits", 4, distribution="iid", seed=0, device=torch.device("cuda"))
    plain = fed.train_batch
    fed.train_batch = lambda idx, gens: plain(idx, gens).double()
    torch.manual_seed(0)
    model = make_model("digits").double().cuda().train()
    g_ref, buf_ref = _steps(fed, None, model)
    g, buf = _steps(fed, step_variants.make_grad(engine, local_training.ClientGrad(model)), model)
    torch.testing.assert_close(g, g_ref, rtol=1e-10, atol=1e-10)
    for k in buf_ref:
        torch.testing.assert_close(buf[k], buf_ref[k], rtol=1e-10, atol=1e-10)


@cuda
@pytest.mark.parametrize("engine", list(step_variants.GRAPHED))
def test_a_captured_run_trains_and_records_its_engine(engine):
    result = training.run(RunConfig(**{**TINY, "device": "cuda", "engine": engine}), progress=False)
    assert result.environment["engine"] == engine and not result.diverged
    # the same computation as the batched engine's run (float32 rounding apart): its loss and accuracy
    batched = training.run(RunConfig(**{**TINY, "device": "cuda", "engine": "batched"}), progress=False)
    assert result.final_loss == pytest.approx(batched.final_loss, rel=1e-2)
    assert abs(result.final_accuracy - batched.final_accuracy) <= 2.0


@pytest.mark.parametrize(("dataset", "image"), [("femnist", (1, 28, 28)), ("cifar10", (3, 32, 32))])
@pytest.mark.parametrize(("conv", "channels_last"), [("grouped", True), ("bmm", False), ("bmm_wgrad", True)])
def test_client_folded_variants_equal_batched_on_the_papers_models(dataset, image, conv, channels_last):
    """The window's autotune times the variants on the paper's CNNs (5x5 convolutions without BatchNorm for
    FEMNIST; 3x3, ReLU before BatchNorm and dropout for CIFAR-10), not on the digits model the tests above
    use: every client's gradient and BatchNorm buffers equal the vmapped engine's in float64 (2 clients, 4
    images, dropout masks drawn)."""
    from torch.func import stack_module_state

    torch.manual_seed(0)
    models = [make_model(dataset).double().train() for _ in range(2)]
    params, buffers = stack_module_state(models)
    x = torch.randn(2, 4, *image, dtype=torch.float64)
    y = torch.randint(0, 10, (2, 4))
    batched = local_training.ClientGrad(models[0])
    masks = batched.net.masks(x, lambda layer: torch.arange(2) + 100 * layer)
    assert all(0 < float((m == 0).double().mean()) < 1 for m in masks.values())  # dropout drops some
    ref_buffers = {k: v.clone() for k, v in buffers.items()}
    expected = batched(params, ref_buffers, x, y, masks)
    folded = FoldedGrad(batched.net, conv=conv, channels_last=channels_last)
    got = folded(params, buffers, x, y, masks)
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-10, atol=1e-10)
    for name in ref_buffers:
        torch.testing.assert_close(buffers[name], ref_buffers[name], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("engine", ["cuda_graphs", "channels_last_graphs"])
def test_captured_engines_under_an_emulated_capture_equal_each_run_alone_batched(monkeypatch, engine):
    """The capture branch of `StaticSteps._run` on a CPU, with a fake CUDA graph that behaves as a real one:
    its capture runs nothing and binds the tensors the step reads and writes, with the step sizes of that
    moment; a replay runs the step again on those very tensors at those sizes. A buffer reallocated under a
    live graph, or a graph replayed after its lr changed, would train on stale values. Four runs of 4-6
    rounds (the lr decays at a different round in each, and the group shrinks as they end), float64: each
    one's accuracy curve and final loss those of it alone under `batched` (to float64's rounding). And a
    graph whose lrs changed is dropped before the next one is warmed up and captured: never two live graphs
    of one shape (each holds a memory pool)."""
    import contextlib
    import gc
    import weakref

    real_step, live, capturing, captures = StaticSteps._step, weakref.WeakSet(), [], []

    class FakeGraph:
        def __init__(self) -> None:
            self.bound = None
            live.add(self)

        def replay(self) -> None:
            real_step(*self.bound)

    @contextlib.contextmanager
    def graph(g):
        gc.collect()
        captures.append(len(live))  # the graphs alive as this one is captured, itself included
        capturing.append(g)
        yield
        capturing.pop()

    def step(self, st, *args):
        if capturing:  # bind the tensor objects of this moment, as a graph binds their addresses
            capturing[-1].bound = (
                self,
                {k: dict(v) if isinstance(v, dict) else v for k, v in st.items()},
                *args,
            )
            return
        real_step(self, st, *args)

    class FakeStream:
        def wait_stream(self, other) -> None:
            pass

    monkeypatch.setattr(StaticSteps, "_step", step)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    make_grad = step_variants.make_grad

    def captured(e, base):
        fn = make_grad(e, base, capture=False)
        fn.capture = True  # the CPU refuses capture=True: the fakes above stand in for CUDA's
        return fn

    monkeypatch.setattr(step_variants, "make_grad", captured)
    _a_group_of_decaying_lrs_equals_each_run_alone(monkeypatch, engine, "cpu")
    assert len(captures) >= 4 and max(captures) == 1  # captured again after each change, one graph alive


def _a_group_of_decaying_lrs_equals_each_run_alone(monkeypatch, engine: str, device: str) -> None:
    """tests/test_groups.py's four runs at 6, 5, 6 and 4 rounds (the lr decays at another round in each,
    the group shrinks as they end), float64, iid (one batch width: the captured path), grouped under
    `engine` on `device`: each one's accuracy curve and final loss those of it alone under `batched`."""
    import test_groups as tg

    from prodigy_core import groups
    from prodigy_core.data import Federation

    normalise = Federation.normalise
    monkeypatch.setattr(Federation, "normalise", lambda self, x: normalise(self, x).double())
    base = {"distribution": "iid", "checkpoint_every": 100, "eval_every": 1, "device": device}
    configs = [c.replace(**base, rounds=rounds) for c, rounds in zip(tg.CONFIGS, (6, 5, 6, 4), strict=True)]
    assert len({tuple(c.lr_at(t) for t in range(6)) for c in configs}) >= 3  # the lrs decay at other rounds
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        solo = [training.run(c, progress=False) for c in configs]
        grouped = groups.run_group([c.replace(engine=engine) for c in configs])
    finally:
        torch.set_default_dtype(previous)
    for alone, in_group in zip(solo, grouped, strict=True):
        # float64: a grouped convolution sums in another order than one run's (tests/test_groups.py's 1e-10)
        assert in_group.accuracy_curve == alone.accuracy_curve
        assert in_group.final_loss == pytest.approx(alone.final_loss, rel=0, abs=1e-10)
        assert in_group.environment["engine"] == engine


@cuda
@pytest.mark.parametrize("engine", list(step_variants.GRAPHED))
def test_a_captured_group_with_decaying_lrs_equals_each_run_alone_on_cuda(monkeypatch, engine):
    """The emulated capture's test above on a real CUDA graph: captures, replays, a re-capture at each lr
    change and a shrinking group, each run equal to it alone under `batched` in float64."""
    _a_group_of_decaying_lrs_equals_each_run_alone(monkeypatch, engine, "cuda")


def test_the_compiled_engine_never_runs_uncompiled_past_torch_compiles_limit(monkeypatch):
    """Every compiled `ClientGrad` wraps the same code, so one process's models, precisions and group sizes
    share torch.compile's limit of compiled versions, past which torch ran the step uncompiled, still
    labelled `compiled` (a throughput table's CIFAR-10 rows after digits and FEMNIST). Past
    `COMPILE_LIMIT` (set to 1 here, torch's eager backend standing in for the compiler) it is an error
    naming the limit; within it, the compiled step gives the batched one's gradients (float64, dropout on)."""
    from functools import partial

    monkeypatch.setattr(torch, "compile", partial(torch.compile, backend="eager"))
    monkeypatch.setattr(local_training, "COMPILE_LIMIT", 1)
    torch._dynamo.reset()
    try:
        fed, model = _float64_federation("iid"), _model()
        compiled = local_training.ClientGrad(model, compiled=True)
        g_ref, _ = _steps(fed, None, model)
        g, _ = _steps(fed, compiled, model)
        torch.testing.assert_close(g, g_ref, rtol=1e-10, atol=1e-10)
        with pytest.raises(RuntimeError, match=r"compiled the training step 1 times .*COMPILE_LIMIT"):
            _steps(fed, compiled, model, batch_size=16)  # another shape: a second compiled version
    finally:
        torch._dynamo.reset()
