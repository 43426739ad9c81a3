"""Offline data sets for the accuracy study: nothing is downloaded.

- `digits`: scikit-learn's bundled 8x8 handwritten digits (1,797 images, 10 classes). Real
  images, but easy: almost any setting reaches ~97%, so it shows little batch effect.
- `blobs`: scikit-learn's `make_classification`, generated from a fixed seed: 16 classes
  of two Gaussian clusters each in 40 dimensions, only 10 of them informative (10 more
  are linear mixtures of those, the rest noise), and 10% of the labels drawn at random.
  The label noise caps the attainable accuracy and small batches fit noise differently
  from big ones: a task where the global batch and the learning rate show in the result.

Both are standardized with the training split's mean and deviation; the split is fixed
(it does not depend on the training seed, so seeds vary the model only).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

DATASETS = ("digits", "blobs")
_SPLIT_SEED = 1234


@dataclass(frozen=True)
class Split:
    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    classes: int

    @property
    def features(self) -> int:
        return int(self.x_train.shape[1])


def _split(name: str, x: np.ndarray, y: np.ndarray, test_fraction: float) -> Split:
    order = np.random.default_rng(_SPLIT_SEED).permutation(len(x))
    cut = int(len(x) * (1 - test_fraction))
    train, test = order[:cut], order[cut:]
    mean, std = x[train].mean(axis=0), x[train].std(axis=0) + 1e-6
    x = (x - mean) / std
    return Split(
        name,
        torch.tensor(x[train], dtype=torch.float32),
        torch.tensor(y[train], dtype=torch.long),
        torch.tensor(x[test], dtype=torch.float32),
        torch.tensor(y[test], dtype=torch.long),
        int(y.max()) + 1,
    )


def read_digits() -> tuple[np.ndarray, np.ndarray]:
    """The digits as scikit-learn's `load_digits` gives them (64 pixels per row, labels),
    read from the CSV it ships without importing it: the import (SciPy with it) took as
    long as torch's on 2 loaded cores, and every worker of a study run or a resize pays it.
    `find_spec` finds the package without running it."""
    spec = importlib.util.find_spec("sklearn")
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    table_file = Path(folders[0], "datasets", "data", "digits.csv.gz") if folders else None
    if table_file is not None and table_file.is_file():
        table = np.loadtxt(table_file, delimiter=",")  # 64 pixels, then the label
        return table[:, :-1], table[:, -1].astype(int)
    from sklearn.datasets import load_digits  # another layout: let scikit-learn read it

    digits = load_digits()
    return digits.data, digits.target


def load(name: str, samples: int = 12_000) -> Split:
    """The named data set; `samples` sizes the generated one."""
    if name == "digits":
        pixels, labels = read_digits()
        return _split(name, pixels.astype(np.float64), labels, 0.25)
    if name == "blobs":
        from sklearn.datasets import make_classification  # only here: see read_digits

        x, y = make_classification(
            n_samples=samples,
            n_features=40,
            n_informative=10,
            n_redundant=10,
            n_classes=16,
            n_clusters_per_class=2,
            class_sep=1.5,
            flip_y=0.1,
            random_state=_SPLIT_SEED,
        )
        return _split(name, x, y, 0.2)
    raise ValueError(f"unknown data set {name!r}: one of {', '.join(DATASETS)}")
