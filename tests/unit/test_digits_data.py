"""The examples read scikit-learn's digits without importing scikit-learn (a worker's start
would pay SciPy's import): the arrays must be exactly what `load_digits` gives."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

# Each test imports torch (the readers' modules do) and scikit-learn when it runs, not this
# module when it is collected, which every xdist worker does. Installed is checked without
# importing them.
for _needed in ("torch", "horovod", "sklearn"):
    if importlib.util.find_spec(_needed) is None:
        pytest.skip(f"{_needed} is not installed", allow_module_level=True)

REPO = Path(__file__).resolve().parents[2]


def train_digits_script() -> ModuleType:
    """`examples/train_digits.py` as a module (it is run as a script, not imported)."""
    spec = importlib.util.spec_from_file_location(
        "train_digits", REPO / "examples" / "train_digits.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_both_readers_give_what_load_digits_gives() -> None:
    from sklearn import datasets

    from examples.experiments import data

    reference = datasets.load_digits()
    images, labels = train_digits_script().load_digit_images()
    assert images.shape == (1797, 8, 8) and images.dtype == reference.images.dtype
    assert np.array_equal(images, reference.images)
    assert np.array_equal(labels, reference.target) and labels.dtype == reference.target.dtype
    pixels, targets = data.read_digits()
    assert np.array_equal(pixels, reference.data) and np.array_equal(targets, reference.target)


def test_without_the_bundled_file_the_readers_ask_scikit_learn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from sklearn import datasets

    from examples.experiments import data

    script = train_digits_script()
    # A scikit-learn whose files are elsewhere (a zip, another layout): no table file found.
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    reference = datasets.load_digits()
    images, labels = script.load_digit_images()
    assert np.array_equal(images, reference.images) and np.array_equal(labels, reference.target)
    pixels, targets = data.read_digits()
    assert np.array_equal(pixels, reference.data) and np.array_equal(targets, reference.target)


def test_the_readers_do_not_import_scikit_learn(monkeypatch: pytest.MonkeyPatch) -> None:
    from examples.experiments import data

    script = train_digits_script()
    # Forget scikit-learn and SciPy for this test (restored after): a reader that imported
    # them would put them back.
    for name in list(sys.modules):
        if name.split(".")[0] in ("sklearn", "scipy"):
            monkeypatch.delitem(sys.modules, name)
    images, labels = script.load_digit_images()
    assert images.shape == (1797, 8, 8) and labels.shape == (1797,)
    pixels, targets = data.read_digits()
    assert pixels.shape == (1797, 64) and targets.shape == (1797,)
    imported = sorted(name for name in sys.modules if name.split(".")[0] in ("sklearn", "scipy"))
    assert imported == []
