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
# paper: the paper's text; authors: the authors' public code (docs/semantics.md).
VARIANTS = ("paper", "authors")
# A run's arithmetic (`RunConfig.precision`; `seeding.precision_mode` sets it).
PRECISIONS = ("fp32", "tf32", "bf16")
# How an error names a setting's type (`registry.check_settings`, `config` field checks).
TYPE_WORDS = {
    int: "an integer",
    float: "a number",
    bool: "true or false",
    str: "a string",
    type(None): "null",
}
# What a params file's `report.figures` list may name (`report.write_report` draws them; checked at load).
FIGURES = ("heatmap", "curves", "distances")


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else f"; valid: {', '.join(candidates)}"


__all__ = [
    "DATASETS",
    "DISTRIBUTIONS",
    "FIGURES",
    "PRECISIONS",
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
