"""CIFAR-10 and CIFAR-100 in their "python version" pickle format, from a directory.

CIFAR-10 (``cifar-10-batches-py/``): ``data_batch_1`` .. ``data_batch_5`` (10,000 examples each) and
``test_batch``; CIFAR-100 (``cifar-100-python/``): ``train`` (50,000) and ``test`` (10,000). Each file is a
pickled dict whose ``b'data'`` is a uint8 array (N, 3072) -- the 1024 red, then 1024 green, then 1024 blue
values of a 32x32 image, row-major -- with labels in ``b'labels'`` (CIFAR-10) or ``b'fine_labels'`` /
``b'coarse_labels'`` (CIFAR-100). Pass either that directory or its parent.

Splits: the official test set is the test split; the validation split is the **last 5,000** training
examples (file order, no randomness: the second half of ``data_batch_5`` for CIFAR-10), leaving 45,000
for training. See :func:`softmoe.data.splits.holdout_tail`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from softmoe.data.dataset import Splits, from_uint8
from softmoe.data.errors import DatasetError
from softmoe.data.pickles import load_array_pickle
from softmoe.data.splits import holdout_tail

CIFAR_VAL_SIZE = 5000
"""Examples carved off the end of the training set as the validation split."""

CIFAR_PIXELS = 3 * 32 * 32


@dataclass(frozen=True)
class CifarLayout:
    """Where one CIFAR variant keeps its files and labels."""

    name: str
    folder: str
    archive: str
    train_files: tuple[str, ...]
    test_files: tuple[str, ...]

    @property
    def files(self) -> tuple[str, ...]:
        return self.train_files + self.test_files


CIFAR10 = CifarLayout(
    name="cifar10",
    folder="cifar-10-batches-py",
    archive="cifar-10-python.tar.gz",
    train_files=tuple(f"data_batch_{i}" for i in range(1, 6)),
    test_files=("test_batch",),
)
CIFAR100 = CifarLayout(
    name="cifar100",
    folder="cifar-100-python",
    archive="cifar-100-python.tar.gz",
    train_files=("train",),
    test_files=("test",),
)


def find_cifar_dir(root: str | Path, layout: CifarLayout) -> Path:
    """``root`` if it holds the layout's files, else ``root/<folder>``; :class:`DatasetError` if neither."""
    root = Path(root)
    if not root.is_dir():
        raise DatasetError(f"{root}: dataset directory not found (expected {layout.folder} or its parent)")
    if any((root / name).is_file() for name in layout.files):
        return root
    if (root / layout.folder).is_dir():
        return root / layout.folder
    message = (
        f"{root}: no {layout.name} files found: expected {', '.join(layout.files)} "
        f"in {root} or in {root / layout.folder}"
    )
    if (root / layout.archive).is_file():
        message += f" (found {layout.archive}: extract it first, e.g. `tar xzf {root / layout.archive} -C {root}`)"
    raise DatasetError(message)


def read_cifar_batch(path: Path, label_key: str, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """uint8 images (N, 3, 32, 32) and int64 labels (N,) of one CIFAR pickle file, checked."""
    if not path.is_file():
        raise DatasetError(f"{path}: missing file")
    batch = load_array_pickle(path)
    if "data" not in batch or label_key not in batch:
        found = ", ".join(repr(k.encode("latin-1")) for k in sorted(batch)) or "none"
        raise DatasetError(f"{path}: bad pickle keys: expected b'data' and b'{label_key}', found {found}")
    data = batch["data"]
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != CIFAR_PIXELS:
        got = f"{data.dtype} array of shape {data.shape}" if isinstance(data, np.ndarray) else type(data).__name__
        raise DatasetError(f"{path}: b'data' must be a uint8 array of shape (N, {CIFAR_PIXELS}), got {got}")
    try:
        labels = np.asarray(batch[label_key])
    except (ValueError, TypeError) as exc:
        raise DatasetError(f"{path}: b'{label_key}' is not a list of integers: {exc}") from None
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise DatasetError(
            f"{path}: b'{label_key}' must be a flat list of integers, got {labels.dtype} of shape {labels.shape}"
        )
    if labels.shape[0] != data.shape[0]:
        raise DatasetError(
            f"{path}: label count does not match image count: {labels.shape[0]} labels in b'{label_key}' "
            f"but {data.shape[0]} images in b'data'"
        )
    bad = np.flatnonzero((labels < 0) | (labels >= num_classes))
    if bad.size:
        raise DatasetError(
            f"{path}: label out of range: expected b'{label_key}' in 0..{num_classes - 1}, "
            f"got {int(labels[bad[0]])} at index {int(bad[0])} ({bad.size} such labels)"
        )
    return data.reshape(-1, 3, 32, 32), labels.astype(np.int64)


def _read_files(directory: Path, names: tuple[str, ...], layout: CifarLayout, label_key: str, num_classes: int):
    images, labels = [], []
    for name in names:
        path = directory / name
        if not path.is_file():
            expected = ", ".join(layout.files)
            raise DatasetError(f"{path}: missing {layout.name} file (expected {expected} in {directory})")
        x, y = read_cifar_batch(path, label_key, num_classes)
        images.append(x)
        labels.append(y)
    return np.concatenate(images), np.concatenate(labels)


def _load(root: str | Path, layout: CifarLayout, label_key: str, num_classes: int, val_size: int, name: str) -> Splits:
    directory = find_cifar_dir(root, layout)
    train_x, train_y = _read_files(directory, layout.train_files, layout, label_key, num_classes)
    test_x, test_y = _read_files(directory, layout.test_files, layout, label_key, num_classes)
    train = from_uint8(train_x, train_y, num_classes, name)
    test = from_uint8(test_x, test_y, num_classes, name)
    return holdout_tail(train, test, val_size)


def load_cifar10(root: str | Path, *, val_size: int = CIFAR_VAL_SIZE) -> Splits:
    """CIFAR-10 from ``cifar-10-batches-py`` (or its parent): (N, 3, 32, 32) in [0, 1], 45,000 / 5,000 / 10,000.

    Raises:
        DatasetError: missing directory or file (with the expected names), corrupt or unsafe pickle, bad
            pickle keys, wrong data shape or dtype, label/image count mismatch, labels outside 0..9.
    """
    return _load(root, CIFAR10, "labels", 10, val_size, "cifar10")


def load_cifar100(root: str | Path, *, coarse: bool = False, val_size: int = CIFAR_VAL_SIZE) -> Splits:
    """CIFAR-100 from ``cifar-100-python`` (or its parent), split as :func:`load_cifar10`.

    Labels are the 100 fine classes (``b'fine_labels'``), or the 20 superclasses (``b'coarse_labels'``)
    with ``coarse=True`` (the datasets are then named ``"cifar100-coarse"``).
    """
    if coarse:
        return _load(root, CIFAR100, "coarse_labels", 20, val_size, "cifar100-coarse")
    return _load(root, CIFAR100, "fine_labels", 100, val_size, "cifar100")
