"""The ImageFolder loader on small PNG/JPEG files written with Pillow: layouts, labels, splits, sizes, and clear errors
naming the file for truncated or garbage images."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from softmoe.data.errors import DatasetError, MissingDependencyError
from softmoe.data.imagefolder import load_image_folder, read_image, read_image_folder

Image = pytest.importorskip("PIL.Image")


def write_image(path, value, size=(6, 5), mode="RGB", fmt=None):
    """A solid image of ``value`` (0..255), width x height = size."""
    path.parent.mkdir(parents=True, exist_ok=True)
    channels = 3 if mode == "RGB" else 1
    array = np.full((size[1], size[0], channels), value, dtype=np.uint8).squeeze(-1 if channels == 1 else ())
    Image.fromarray(array, mode=None).save(path, format=fmt)
    return path


def make_pool(root, per_class=10, classes=("cat", "dog", "eel")):
    for c, name in enumerate(classes):
        for i in range(per_class):
            ext = ".png" if i % 2 else ".jpg"
            write_image(root / name / f"{i:02d}{ext}", 40 * c + i)
    return root


def test_pool_layout_labels_and_stratified_splits(tmp_path):
    root = make_pool(tmp_path / "animals")
    (root / "cat" / "notes.txt").write_text("not an image")
    (root / "cat" / ".hidden.png").write_bytes(b"garbage")
    splits = load_image_folder(root, val_fraction=0.2, test_fraction=0.2)
    train, val, test = splits
    assert (len(train), len(val), len(test)) == (18, 6, 6)
    for part in splits:
        assert part.image_shape == (3, 5, 6) and part.num_classes == 3 and part.name == "animals"
        assert torch.bincount(part.labels, minlength=3).tolist() == [len(part) // 3] * 3
    everything = read_image_folder(root)
    assert len(everything) == 30 and everything.labels[:10].tolist() == [0] * 10  # "cat" is label 0
    png = read_image(root / "dog" / "01.png")
    assert png.dtype == np.uint8 and png.shape == (3, 5, 6) and int(png[0, 0, 0]) == 41
    assert float(everything.images[11, 0, 0, 0]) == pytest.approx(41 / 255)  # dog/01.png, exact (lossless PNG)


def test_split_folders(tmp_path):
    root = tmp_path / "data"
    make_pool(root / "train", per_class=10, classes=("a", "b"))
    make_pool(root / "test", per_class=2, classes=("a", "b"))
    train, val, test = load_image_folder(root, val_fraction=0.1)
    assert (len(train), len(val), len(test)) == (18, 2, 4)
    assert sorted(val.labels.tolist()) == [0, 1]
    make_pool(root / "val", per_class=3, classes=("b",))
    train, val, test = load_image_folder(root)
    assert (len(train), len(val), len(test)) == (20, 3, 4)
    assert val.labels.tolist() == [1, 1, 1] and val.num_classes == 2  # labels follow the train classes
    make_pool(root / "test", per_class=1, classes=("zebra",))
    with pytest.raises(DatasetError, match=r"zebra.*not among the training classes"):
        load_image_folder(root)


def test_grayscale_and_resizing(tmp_path):
    root = tmp_path / "mixed"
    write_image(root / "x" / "big.png", 10, size=(8, 8))
    write_image(root / "x" / "small.png", 20, size=(4, 4), mode="L")
    write_image(root / "y" / "other.png", 30, size=(4, 4))
    with pytest.raises(DatasetError, match=r"small\.png: image size 4x4 differs .*big\.png.*image_size"):
        read_image_folder(root)
    data = read_image_folder(root, image_size=4, mode="L")
    assert data.images.shape == (3, 1, 4, 4) and data.labels.tolist() == [0, 0, 1]
    assert read_image_folder(root, image_size=(2, 3)).images.shape == (3, 3, 2, 3)


def test_truncated_and_garbage_images_name_the_file(tmp_path):
    root = make_pool(tmp_path / "bad", per_class=2, classes=("a", "b"))
    good = write_image(root / "a" / "big.png", 7, size=(6, 5))
    data = good.read_bytes()
    good.write_bytes(data[: len(data) // 2])
    with pytest.raises(DatasetError, match=r"big\.png: cannot read image"):
        load_image_folder(root)
    good.write_bytes(data)
    (root / "b" / "zz.jpg").write_bytes(b"\x00not a jpeg at all\xff" * 10)
    with pytest.raises(DatasetError, match=r"zz\.jpg: cannot read image"):
        load_image_folder(root)
    jpeg = write_image(root / "b" / "zz.jpg", 9, fmt="JPEG")
    blob = jpeg.read_bytes()
    jpeg.write_bytes(blob[: len(blob) - 40])
    with pytest.raises(DatasetError, match=r"zz\.jpg"):
        load_image_folder(root)


def test_missing_and_empty_folders(tmp_path):
    with pytest.raises(DatasetError, match="image folder not found"):
        load_image_folder(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match="no class sub-folders"):
        load_image_folder(tmp_path / "empty")
    (tmp_path / "empty" / "a").mkdir()
    (tmp_path / "empty" / "a" / "readme.md").write_text("x")
    with pytest.raises(DatasetError, match="no image files"):
        load_image_folder(tmp_path / "empty")
    make_pool(tmp_path / "only_train" / "train", per_class=2, classes=("a",))
    with pytest.raises(DatasetError, match="neither val/ nor test/"):
        load_image_folder(tmp_path / "only_train")
    with pytest.raises(ValueError, match="mode"):
        read_image_folder(tmp_path / "only_train" / "train", mode="CMYK")


def test_missing_pillow_says_what_to_install(tmp_path, monkeypatch):
    root = make_pool(tmp_path / "p", per_class=1, classes=("a",))
    monkeypatch.setitem(sys.modules, "PIL.Image", None)
    with pytest.raises(MissingDependencyError, match="pip install pillow"):
        read_image_folder(root)
