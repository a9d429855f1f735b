"""prodigy_core: robust aggregators, Byzantine attacks and a batched GPU training loop for federated learning.

Reproduces "ProDiGy" (proximity x dissimilarity scoring for Byzantine-robust aggregation).
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("prodigy-fl")
except PackageNotFoundError:  # running from a source tree without installing
    __version__ = "0.0.0+source"

from prodigy_core.progress import quiet_tqdm_auto

quiet_tqdm_auto()  # before any module imports tqdm.auto: no "IProgress not found" without the `lab` extra
del quiet_tqdm_auto
