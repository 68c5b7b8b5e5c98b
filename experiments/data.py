# SPDX-License-Identifier: Apache-2.0
"""Fashion-MNIST from Debian's ``dataset-fashion-mnist`` package (IDX files under
``/usr/share/datasets/fashion-mnist/``, or ``$GRADCOMP_FASHION_MNIST``). Nothing is downloaded."""
from __future__ import annotations

import gzip
import os
import struct
from typing import Optional, Tuple

import numpy as np

DEFAULT_DIR = "/usr/share/datasets/fashion-mnist"
_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


# ---- data ----------------------------------------------------------------------------------------
def _open(path: str):
    for p in (path, path + ".gz"):
        if os.path.exists(p):
            return gzip.open(p, "rb") if p.endswith(".gz") else open(p, "rb")
    raise FileNotFoundError(
        f"Fashion-MNIST file {path}[.gz] not found: install Debian's package "
        f"'dataset-fashion-mnist' (apt-get install dataset-fashion-mnist) or set "
        f"GRADCOMP_FASHION_MNIST to a folder holding the IDX files")


def load_idx(path: str) -> np.ndarray:
    """Reads an IDX file (uint8 data; magic 0x00000801 for labels, 0x00000803 for images).
    Raises ValueError on a wrong magic, a wrong type, or a size that does not match the header
    (truncated or padded file)."""
    with _open(path) as f:
        raw = f.read()
    if len(raw) < 4:
        raise ValueError(f"{path}: {len(raw)} bytes, too short for an IDX header")
    zero, dtype, ndim = struct.unpack(">HBB", raw[:4])
    if zero != 0 or dtype != 0x08:
        raise ValueError(f"{path}: not an unsigned-byte IDX file (magic {raw[:4].hex()})")
    if ndim < 1 or ndim > 4 or len(raw) < 4 + 4 * ndim:
        raise ValueError(f"{path}: IDX header announces {ndim} dimensions")
    dims = struct.unpack(">" + "I" * ndim, raw[4:4 + 4 * ndim])
    want = 4 + 4 * ndim + int(np.prod(dims, dtype=np.int64))
    if len(raw) != want:
        raise ValueError(f"{path}: {len(raw)} bytes, the header {dims} needs {want} "
                         f"(truncated or corrupt file)")
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def load_split(split: str, root: Optional[str] = None) -> Tuple[np.ndarray, np.ndarray]:
    """(images float32 [N, 1, 28, 28] normalised, labels int64 [N]) of 'train' or 'test'."""
    root = root or os.environ.get("GRADCOMP_FASHION_MNIST", DEFAULT_DIR)
    img_f, lab_f = _FILES[split]
    images = load_idx(os.path.join(root, img_f))
    labels = load_idx(os.path.join(root, lab_f))
    if images.ndim != 3 or images.shape[1:] != (28, 28):
        raise ValueError(f"{split} images have shape {images.shape}, expected [N, 28, 28]")
    if labels.ndim != 1 or labels.shape[0] != images.shape[0]:
        raise ValueError(f"{split}: {images.shape[0]} images but labels of shape {labels.shape}")
    if labels.size and labels.max() > 9:
        raise ValueError(f"{split}: label {int(labels.max())} outside 0..9")
    x = (images.astype(np.float32) / 255.0 - 0.2860) / 0.3530
    return x[:, None, :, :], labels.astype(np.int64)


# ---- model ---------------------------------------------------------------------------------------
