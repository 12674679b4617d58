"""A parser for the IDX file format of MNIST and Fashion-MNIST, gzipped or raw.

An IDX file is a 4-byte magic number, one big-endian int32 size per dimension, then the data in row-major
(C) order, big-endian. The magic number is two zero bytes, one byte giving the element type, and one byte
giving the number of dimensions: MNIST image files start 0x00000803 (unsigned bytes, 3 dims: N, H, W),
label files 0x00000801 (unsigned bytes, 1 dim: N).

Gzip compression is recognized from the content (gzip streams start 0x1f 0x8b; IDX files start 0x00 0x00),
so a file works whatever its name ends with.
"""

from __future__ import annotations

import gzip
import math
import zlib
from pathlib import Path

import numpy as np

from softmoe.data.errors import DatasetError

IDX_DTYPES: dict[int, np.dtype] = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
"""IDX element-type codes (third byte of the magic number) and their big-endian NumPy dtypes."""

IDX_UBYTE = 0x08
GZIP_MAGIC = b"\x1f\x8b"


def idx_magic(dtype_code: int, ndim: int) -> int:
    """The magic number of an IDX file with the given element type and number of dimensions."""
    return (dtype_code << 8) | ndim


def _show_magic(magic: int) -> str:
    return f"0x{magic:08X}"


def read_file_bytes(path: Path) -> bytes:
    """The bytes of ``path``, decompressed if it is a gzip stream."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise DatasetError(f"{path}: file not found") from None
    except OSError as exc:
        raise DatasetError(f"{path}: cannot read file: {exc.strerror or exc}") from None
    if raw[:2] != GZIP_MAGIC:
        return raw
    try:
        return gzip.decompress(raw)
    except EOFError:
        raise DatasetError(f"{path}: truncated gzip stream (the compressed file ends early)") from None
    except (OSError, zlib.error) as exc:  # gzip.BadGzipFile is an OSError
        raise DatasetError(f"{path}: corrupt gzip stream: {exc}") from None


def read_idx(path: str | Path, *, expected_magic: int | None = None) -> np.ndarray:
    """Read one IDX file (gzipped or raw) into a read-only, native-endian array of its shape.

    Args:
        path: the file.
        expected_magic: if given, the exact magic number required, e.g. ``idx_magic(IDX_UBYTE, 3)`` (0x00000803)
            for MNIST images.

    Raises:
        DatasetError: naming the file, for a missing or unreadable file, a corrupt gzip stream, a bad magic
            number (expected vs got), a truncated header or data (expected vs actual byte counts), or
            trailing bytes after the data.
    """
    path = Path(path)
    raw = read_file_bytes(path)
    if len(raw) < 4:
        raise DatasetError(
            f"{path}: truncated IDX header: expected at least 4 bytes (the magic number), got {len(raw)}"
        )
    magic = int.from_bytes(raw[:4], "big")
    if expected_magic is not None and magic != expected_magic:
        raise DatasetError(
            f"{path}: bad magic number: expected {_show_magic(expected_magic)}, got {_show_magic(magic)} "
            f"(not an IDX file of the expected type)"
        )
    if raw[0] != 0 or raw[1] != 0:
        raise DatasetError(
            f"{path}: bad magic number {_show_magic(magic)}: an IDX magic number starts with two zero bytes"
        )
    code, ndim = raw[2], raw[3]
    if code not in IDX_DTYPES:
        known = ", ".join(f"0x{c:02X}" for c in IDX_DTYPES)
        raise DatasetError(
            f"{path}: bad magic number {_show_magic(magic)}: unknown IDX type code 0x{code:02X} (known: {known})"
        )
    if ndim == 0:
        raise DatasetError(f"{path}: bad magic number {_show_magic(magic)}: zero dimensions")
    header_len = 4 + 4 * ndim
    if len(raw) < header_len:
        raise DatasetError(
            f"{path}: truncated IDX header: expected {header_len} bytes for {ndim} dimensions, got {len(raw)}"
        )
    shape = tuple(int(s) for s in np.frombuffer(raw, dtype=">i4", count=ndim, offset=4))
    if any(s < 0 for s in shape):
        raise DatasetError(f"{path}: corrupt IDX header: negative size in shape {shape}")
    dtype = IDX_DTYPES[code]
    expected = math.prod(shape) * dtype.itemsize
    got = len(raw) - header_len
    if got < expected:
        raise DatasetError(
            f"{path}: truncated data: expected {expected} bytes after the {header_len}-byte header "
            f"for shape {shape}, got {got}"
        )
    if got > expected:
        raise DatasetError(
            f"{path}: {got - expected} unexpected trailing bytes: expected {expected} bytes after the "
            f"{header_len}-byte header for shape {shape}, got {got}"
        )
    data = np.frombuffer(raw, dtype=dtype, count=math.prod(shape), offset=header_len).reshape(shape)
    return data.astype(dtype.newbyteorder("="), copy=False)
