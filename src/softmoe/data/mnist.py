"""MNIST and Fashion-MNIST from a directory of IDX files (the four standard files, gzipped or raw).

Splits: the official 10,000-example test set is the test split; the validation split is the **last
5,000** examples of the official 60,000-example training set (file order, no randomness), leaving 55,000
for training. See :func:`softmoe.data.splits.holdout_tail`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from softmoe.data.dataset import Splits, from_uint8
from softmoe.data.errors import DatasetError
from softmoe.data.idx import IDX_UBYTE, idx_magic, read_idx
from softmoe.data.splits import holdout_tail

MNIST_VAL_SIZE = 5000
"""Examples carved off the end of the training set as the validation split."""

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
"""Where Debian's ``dataset-fashion-mnist`` package installs Fashion-MNIST."""

IMAGES_MAGIC = idx_magic(IDX_UBYTE, 3)  # 0x00000803
LABELS_MAGIC = idx_magic(IDX_UBYTE, 1)  # 0x00000801


def idx_file_names(split: str, kind: str) -> tuple[str, ...]:
    """Accepted names, in order of preference, for ``split`` in ("train", "t10k") and ``kind`` in ("images", "labels").

    The standard ``train-images-idx3-ubyte`` and the dotted ``train-images.idx3-ubyte`` seen in some mirrors,
    each raw or with ``.gz``.
    """
    idx = {"images": "idx3", "labels": "idx1"}[kind]
    stems = (f"{split}-{kind}-{idx}-ubyte", f"{split}-{kind}.{idx}-ubyte")
    return tuple(name for stem in stems for name in (stem, stem + ".gz"))


def find_idx_file(directory: Path, split: str, kind: str) -> Path:
    """The first accepted file for (split, kind) in ``directory``; a :class:`DatasetError` listing the names if none."""
    names = idx_file_names(split, kind)
    for name in names:
        if (directory / name).is_file():
            return directory / name
    raise DatasetError(f"{directory}: missing {split} {kind} file: expected one of {', '.join(names)}")


def read_idx_pair(directory: Path, split: str, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """uint8 images (N, 1, H, W) and labels (N,) of one split, checked against each other."""
    images_path = find_idx_file(directory, split, "images")
    labels_path = find_idx_file(directory, split, "labels")
    images = read_idx(images_path, expected_magic=IMAGES_MAGIC)
    labels = read_idx(labels_path, expected_magic=LABELS_MAGIC)
    if labels.shape[0] != images.shape[0]:
        raise DatasetError(
            f"{labels_path}: label count does not match image count: {labels.shape[0]} labels "
            f"but {images_path} has {images.shape[0]} images"
        )
    bad = np.flatnonzero(labels >= num_classes)
    if bad.size:
        raise DatasetError(
            f"{labels_path}: label out of range: expected labels 0..{num_classes - 1}, "
            f"got {int(labels[bad[0]])} at index {int(bad[0])} ({bad.size} such labels)"
        )
    return images[:, None, :, :], labels


def load_mnist(
    root: str | Path, *, name: str = "mnist", num_classes: int = 10, val_size: int = MNIST_VAL_SIZE
) -> Splits:
    """Load an MNIST-format dataset from the directory ``root``.

    ``root`` holds ``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte`` and
    ``t10k-labels-idx1-ubyte``, each optionally gzipped (``.gz``). Images come back as (N, 1, H, W) float32 in
    [0, 1]. The validation split is the last ``val_size`` training examples (default 5,000): 55,000 / 5,000 /
    10,000 for MNIST and Fashion-MNIST.

    Raises:
        DatasetError: missing directory or file (with the expected names), bad magic number, truncated data,
            label/image count mismatch, labels >= ``num_classes``, or train and test image sizes that differ.
    """
    directory = Path(root)
    if not directory.is_dir():
        raise DatasetError(f"{directory}: dataset directory not found (expected the four {name} IDX files in it)")
    train_images, train_labels = read_idx_pair(directory, "train", num_classes)
    test_images, test_labels = read_idx_pair(directory, "t10k", num_classes)
    if train_images.shape[1:] != test_images.shape[1:]:
        raise DatasetError(
            f"{directory}: train and test images differ in size: {train_images.shape[2:]} vs {test_images.shape[2:]}"
        )
    train = from_uint8(train_images, train_labels, num_classes, name)
    test = from_uint8(test_images, test_labels, num_classes, name)
    return holdout_tail(train, test, val_size)


def load_fashion_mnist(root: str | Path | None = None, *, val_size: int = MNIST_VAL_SIZE) -> Splits:
    """Fashion-MNIST (10 classes of 28x28 grey clothing images) from ``root``, by default :data:`FASHION_MNIST_DIR`.

    On Debian/Ubuntu: ``apt-get install dataset-fashion-mnist``. Same file names and splits as :func:`load_mnist`.
    """
    directory = FASHION_MNIST_DIR if root is None else Path(root)
    if not directory.is_dir() and root is None:
        raise DatasetError(
            f"{directory}: Fashion-MNIST not found; install it with `apt-get install dataset-fashion-mnist` "
            f"or pass the directory holding its four IDX files"
        )
    return load_mnist(directory, name="fashion-mnist", val_size=val_size)
