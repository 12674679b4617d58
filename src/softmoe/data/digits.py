"""scikit-learn's 8x8 handwritten digits (``sklearn.datasets.load_digits``: shipped inside scikit-learn, no download).

1,797 greyscale 8x8 images with integer values 0..16, returned as (N, 1, 8, 8) float32 scaled to [0, 1] by
dividing by 16; 10 classes.

Split (fixed): stratified by class with ``RandomState(0)`` (see :mod:`softmoe.data.splits`), 70 / 10 / 20
percent of each class rounded per class, which gives **1,259 train / 179 validation / 359 test**.

scikit-learn is optional: it is imported only when this loader runs (``pip install scikit-learn``).
"""

from __future__ import annotations

import numpy as np
import torch

from softmoe.data.dataset import ImageDataset, Splits
from softmoe.data.errors import DatasetError
from softmoe.data.optional import import_optional
from softmoe.data.splits import SPLIT_SEED, stratified_splits

DIGITS_VAL_FRACTION = 0.1
DIGITS_TEST_FRACTION = 0.2
DIGITS_MAX_VALUE = 16


def load_digits(*, seed: int = SPLIT_SEED) -> Splits:
    """scikit-learn's digits, split 1,259 / 179 / 359 (stratified, seeded).

    Raises:
        MissingDependencyError: scikit-learn is not installed.
    """
    datasets = import_optional("sklearn.datasets", "scikit-learn", "digits")
    bunch = datasets.load_digits()
    images = np.asarray(bunch.images, dtype=np.float64)
    labels = np.asarray(bunch.target)
    if images.ndim != 3 or images.shape[1:] != (8, 8) or labels.shape != (images.shape[0],):
        raise DatasetError(f"sklearn.datasets.load_digits: unexpected shapes {images.shape} and {labels.shape}")
    if images.min() < 0 or images.max() > DIGITS_MAX_VALUE:
        raise DatasetError(
            f"sklearn.datasets.load_digits: pixel values outside 0..16: [{images.min()}, {images.max()}]"
        )
    pixels = torch.from_numpy((images / DIGITS_MAX_VALUE).astype(np.float32)[:, None, :, :])
    pool = ImageDataset(pixels, torch.from_numpy(labels.astype(np.int64)), 10, "digits")
    return stratified_splits(pool, DIGITS_VAL_FRACTION, DIGITS_TEST_FRACTION, seed)
