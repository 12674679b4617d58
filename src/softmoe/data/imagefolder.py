"""Image classification sets stored as one folder per class ("ImageFolder" layout), read with Pillow.

Two layouts are recognised under ``root``:

* **split folders**: ``root/train/<class>/*`` plus ``root/test/<class>/*`` and/or ``root/val/<class>/*``.
  With both ``val`` and ``test`` they are the validation and test splits. With only one of them it is the test
  split and the validation split is carved from ``train`` (stratified, seeded, ``val_fraction`` of each class).
* **one pool**: ``root/<class>/*``; split per class into train / validation / test with ``val_fraction`` and
  ``test_fraction`` (stratified, seeded; see :mod:`softmoe.data.splits`).

Classes are the sub-folder names in sorted order (labels 0..C-1); the train split's folders define them, and the other
splits may not hold a class the train split lacks. Image files are those with a known extension
(:data:`IMAGE_EXTENSIONS`, case-insensitive); hidden files and other files are ignored. Every image is converted to
``mode`` ("RGB": 3 channels, "L": 1 channel) and, with ``image_size``, resized (bilinear); without it all images must
already share one size. Images are held in memory as float32 in [0, 1], so this suits small and medium sets.

Pillow is optional: ``pip install pillow`` (imported only when a loader runs). A file Pillow cannot decode
(truncated, garbage, not an image) raises :class:`DatasetError` naming the file.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from softmoe.data.dataset import ImageDataset, Splits, from_uint8
from softmoe.data.errors import DatasetError
from softmoe.data.optional import import_optional
from softmoe.data.splits import SPLIT_SEED, stratified_split_indices, stratified_splits

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".ppm", ".pgm", ".tif", ".tiff", ".webp")
MODES = {"RGB": 3, "L": 1}
SPLIT_FOLDERS = ("train", "val", "test")


def _pil():
    return import_optional("PIL.Image", "pillow", "imagefolder")


def _size_pair(image_size: int | tuple[int, int] | None) -> tuple[int, int] | None:
    if image_size is None:
        return None
    height, width = (image_size, image_size) if isinstance(image_size, int) else image_size
    if int(height) < 1 or int(width) < 1:
        raise ValueError(f"image_size must be positive, got {image_size!r}")
    return int(height), int(width)


def class_folders(directory: Path) -> list[str]:
    """The class names of a folder: its non-hidden sub-folders, sorted."""
    if not directory.is_dir():
        raise DatasetError(f"{directory}: image folder not found")
    return sorted(p.name for p in directory.iterdir() if p.is_dir() and not p.name.startswith("."))


def image_files(directory: Path) -> list[Path]:
    """Image files directly inside ``directory``, by extension, sorted by name."""
    return sorted(
        p
        for p in directory.iterdir()
        if p.is_file() and not p.name.startswith(".") and p.suffix.lower() in IMAGE_EXTENSIONS
    )


def read_image(path: Path, mode: str = "RGB", size: tuple[int, int] | None = None) -> np.ndarray:
    """One image as uint8 (channels, height, width), converted to ``mode`` and resized to ``size`` (h, w) if given.

    Raises:
        DatasetError: Pillow cannot open or fully decode the file (the message names it).
    """
    image_module = _pil()
    try:
        with image_module.open(path) as image:
            image.load()  # decode now: a truncated file fails here, not later
            converted = image.convert(mode)
            if size is not None and converted.size != (size[1], size[0]):
                converted = converted.resize((size[1], size[0]), image_module.Resampling.BILINEAR)
            array = np.asarray(converted, dtype=np.uint8)
    except FileNotFoundError:
        raise DatasetError(f"{path}: file not found") from None
    except (OSError, ValueError, SyntaxError, image_module.DecompressionBombError) as exc:
        raise DatasetError(f"{path}: cannot read image ({type(exc).__name__}: {exc})") from None
    if array.ndim == 2:
        array = array[:, :, None]
    return np.ascontiguousarray(array.transpose(2, 0, 1))


def read_image_folder(
    directory: str | Path,
    classes: list[str] | None = None,
    *,
    image_size: int | tuple[int, int] | None = None,
    mode: str = "RGB",
    name: str | None = None,
) -> ImageDataset:
    """Every image under ``directory/<class>/`` as one :class:`ImageDataset` (labels = index in ``classes``).

    Args:
        directory: the folder holding one sub-folder per class.
        classes: the class names defining the labels (default: this folder's sub-folders, sorted); a sub-folder
            not in ``classes`` is an error, a class without a sub-folder simply has no examples here.
        image_size: resize every image to this size (an int or (height, width)); default: keep sizes, which must
            then all be equal.
        mode: "RGB" or "L".
        name: the dataset name (default: the folder's name).

    Raises:
        DatasetError: missing folder, no class folders, an unknown class folder, no images, an unreadable image,
            images of different sizes without ``image_size``.
        MissingDependencyError: Pillow is not installed.
    """
    directory = Path(directory)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {sorted(MODES)}, got {mode!r}")
    size = _size_pair(image_size)
    found = class_folders(directory)
    if not found:
        raise DatasetError(f"{directory}: no class sub-folders (expected {directory}/<class name>/<image files>)")
    classes = found if classes is None else list(classes)
    unknown = [c for c in found if c not in classes]
    if unknown:
        raise DatasetError(f"{directory}: class folder(s) {unknown} are not among the training classes {classes}")
    images: list[np.ndarray] = []
    labels: list[int] = []
    first: Path | None = None
    for label, cls in enumerate(classes):
        folder = directory / cls
        if not folder.is_dir():
            continue
        for path in image_files(folder):
            array = read_image(path, mode, size)
            if images and array.shape != images[0].shape:
                raise DatasetError(
                    f"{path}: image size {array.shape[1]}x{array.shape[2]} differs from {first} "
                    f"({images[0].shape[1]}x{images[0].shape[2]}); pass image_size to resize every image"
                )
            first = first or path
            images.append(array)
            labels.append(label)
    if not images:
        raise DatasetError(
            f"{directory}: no image files in the class folders (extensions: {', '.join(IMAGE_EXTENSIONS)})"
        )
    return from_uint8(np.stack(images), np.asarray(labels, dtype=np.int64), len(classes), name or directory.name)


def load_image_folder(
    root: str | Path,
    *,
    image_size: int | tuple[int, int] | None = None,
    mode: str = "RGB",
    val_fraction: float = 0.1,
    test_fraction: float = 0.2,
    seed: int = SPLIT_SEED,
) -> Splits:
    """Train / validation / test :class:`Splits` from an ImageFolder directory (see the module docstring).

    Raises:
        DatasetError: a missing or empty folder, a corrupt image (named), inconsistent classes or sizes.
        MissingDependencyError: Pillow is not installed.
    """
    root = Path(root)
    if not root.is_dir():
        raise DatasetError(f"{root}: image folder not found")
    name = root.name
    if (root / "train").is_dir():
        classes = class_folders(root / "train")
        train = read_image_folder(root / "train", classes, image_size=image_size, mode=mode, name=name)
        held = {
            split: read_image_folder(root / split, classes, image_size=image_size, mode=mode, name=name)
            for split in ("val", "test")
            if (root / split).is_dir()
        }
        if not held:
            raise DatasetError(f"{root}: found train/ but neither val/ nor test/ (expected {root}/test/<class>/...)")
        if len(held) == 2:
            splits = Splits(train, held["val"], held["test"])
        else:
            test = next(iter(held.values()))
            train_idx, val_idx, _ = stratified_split_indices(train.labels.numpy(), val_fraction, 0.0, seed)
            splits = Splits(train.subset(np.sort(train_idx)), train.subset(np.sort(val_idx)), test)
    else:
        pool = read_image_folder(root, image_size=image_size, mode=mode, name=name)
        splits = stratified_splits(pool, val_fraction, test_fraction, seed)
    shapes = {part.image_shape for part in splits if len(part)}
    if len(shapes) > 1:
        raise DatasetError(f"{root}: the splits hold images of different sizes {sorted(shapes)}; pass image_size")
    return splits
