"""How the fixed train / validation / test splits are made.

Two rules, both deterministic and independent of any global random state:

* :func:`holdout_tail` -- for datasets with an official train/test split (MNIST, Fashion-MNIST, CIFAR):
  the validation set is the **last** ``val_size`` examples of the official training set, in file order;
  the official test set is the test split. No randomness at all.
* :func:`stratified_split_indices` -- for datasets that come as one pool (mnist5k, digits): per class, a
  seeded permutation (``numpy.random.RandomState(seed)``, whose stream NumPy keeps frozen across versions)
  puts ``round(test_fraction * n_c)`` examples in test, ``round(val_fraction * n_c)`` in validation and the
  rest in train; each split is then shuffled with the same generator so it is not sorted by class.
"""

from __future__ import annotations

import math

import numpy as np

from softmoe.data.dataset import ImageDataset, Splits

SPLIT_SEED = 0
"""The seed of every seeded split in this package."""


def holdout_tail(train: ImageDataset, test: ImageDataset, val_size: int) -> Splits:
    """Splits whose validation set is the last ``val_size`` examples of ``train`` (views, no copies)."""
    if isinstance(val_size, bool) or not isinstance(val_size, int) or not 0 <= val_size < len(train):
        raise ValueError(f"val_size must be an int in [0, {len(train)}) for {train.name!r}, got {val_size!r}")
    cut = len(train) - val_size
    return Splits(train=train.subset(slice(0, cut)), val=train.subset(slice(cut, None)), test=test)


def stratified_split_indices(
    labels: np.ndarray, val_fraction: float, test_fraction: float, seed: int = SPLIT_SEED
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Disjoint (train, val, test) index arrays covering ``range(len(labels))``, stratified by class.

    For each class c (in increasing order) with n_c examples, ``floor(test_fraction * n_c + 0.5)`` go to test
    and ``floor(val_fraction * n_c + 0.5)`` to validation, chosen by one ``RandomState(seed)`` generator.
    """
    if not (val_fraction >= 0 and test_fraction >= 0 and val_fraction + test_fraction < 1):
        raise ValueError(
            f"need 0 <= val_fraction, test_fraction and a sum below 1, got {val_fraction}, {test_fraction}"
        )
    labels = np.asarray(labels)
    rng = np.random.RandomState(seed)
    parts: tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]] = ([], [], [])
    for c in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == c))
        n_test = math.floor(test_fraction * members.size + 0.5)
        n_val = math.floor(val_fraction * members.size + 0.5)
        parts[2].append(members[:n_test])
        parts[1].append(members[n_test : n_test + n_val])
        parts[0].append(members[n_test + n_val :])
    train, val, test = (rng.permutation(np.concatenate(p)) if p else np.empty(0, np.int64) for p in parts)
    return train.astype(np.int64), val.astype(np.int64), test.astype(np.int64)


def stratified_splits(pool: ImageDataset, val_fraction: float, test_fraction: float, seed: int = SPLIT_SEED) -> Splits:
    """Split one pool of examples with :func:`stratified_split_indices`."""
    train, val, test = stratified_split_indices(pool.labels.numpy(), val_fraction, test_fraction, seed)
    return Splits(train=pool.subset(train), val=pool.subset(val), test=pool.subset(test))
