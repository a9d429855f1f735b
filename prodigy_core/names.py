"""Names shared by every floor of the package: the datasets, their client splits and the semantics variants
that exist, and the "did you mean" lookup that answers a misspelt name.

A ground-floor module (it imports no other `prodigy_core` module): the library's rules (`aggregators`,
`attacks`), the data (`data`, `models`) and the run configuration (`config`) all check names against these,
so that none of them needs another's module to do so.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

DATASETS = ("digits", "femnist", "cifar10")
DISTRIBUTIONS = {"digits": ("iid", "dirichlet"), "cifar10": ("iid", "dirichlet"), "femnist": ("natural",)}
# The attack name of a run without attack (`attacks.NoAttack`; the paper's "No attack" column).
NO_ATTACK = "none"
# paper: the paper's text; authors: the authors' public code (docs/semantics.md).
VARIANTS = ("paper", "authors")
# A run's arithmetic (`RunConfig.precision`; `seeding.precision_mode` sets it). fp32: full float32 (on CUDA
# TF32 off, deterministic kernels); tf32: TF32 convolutions and matmuls (CUDA only); bf16: bfloat16 autocast
# of the model's forward and backward.
PRECISIONS = ("fp32", "tf32", "bf16")
# The engine variants of the batched local step's kernels (`step_variants`): name -> what it changes.
ENGINE_VARIANTS = {
    "channels_last": "grouped convolutions over the clients in channels-last memory format",
    "bmm_conv": "every client's convolution as one batched matrix product (unfold + baddbmm)",
    "bmm_wgrad": "channels_last's grouped convolutions with the weight gradient as one batched product",
    "cuda_graphs": "the step in static buffers, captured once in a CUDA graph and replayed (CUDA only)",
    "channels_last_graphs": "channels_last's step captured in a CUDA graph, as cuda_graphs' (CUDA only)",
    "bmm_wgrad_graphs": "bmm_wgrad's step captured in a CUDA graph, as cuda_graphs' (CUDA only)",
}
# Every engine a run may name (`RunConfig.engine`, `local_training.pick_engine`): auto, the batched reference,
# the client-by-client one, batched under torch.compile, and the variants.
ENGINES = ("auto", "batched", "sequential", "compiled", *ENGINE_VARIANTS)
# How an error names a setting's type (`registry.check_settings`, `config` field checks).
TYPE_WORDS = {
    int: "an integer",
    float: "a number",
    bool: "true or false",
    str: "a string",
    type(None): "null",
}
# Hex digits of a digest in a data source's name (`femnist-leaf-<digest>`, `cifar10-jpeg-<digest>`; the
# digests are `data.femnist_source`'s and `data.decoded_digest`'s, the names checked by `config`).
SOURCE_DIGEST_CHARS = 12
# What a params file's `report.figures` list may name (`report.write_report` draws them; checked at load).
FIGURES = ("heatmap", "curves", "distances")


def did_you_mean(word: object, candidates: Iterable[str]) -> str:
    """The hint after an unknown name: the closest candidate, else them all. ``word`` may be any key a
    YAML file gives (``2000:``, ``on:`` read as a bool): it is compared as text."""
    candidates = list(candidates)
    close = difflib.get_close_matches(str(word), candidates, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else f"; valid: {', '.join(candidates)}"


__all__ = [
    "DATASETS",
    "DISTRIBUTIONS",
    "ENGINES",
    "ENGINE_VARIANTS",
    "FIGURES",
    "NO_ATTACK",
    "PRECISIONS",
    "SOURCE_DIGEST_CHARS",
    "TYPE_WORDS",
    "VARIANTS",
    "check_variant",
    "did_you_mean",
]


def check_variant(owner: str, variant: str) -> str:
    """`variant` if it is one of VARIANTS, else a ValueError naming `owner` and the valid ones."""
    if variant not in VARIANTS:
        raise ValueError(f"{owner}: variant={variant!r} is unknown; valid: {', '.join(VARIANTS)}")
    return variant
