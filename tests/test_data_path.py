"""The tensor-resident data path: DistributedSampler's indices, the same training, the cache."""

from __future__ import annotations

import gzip
import struct

import pytest
import torch
from helpers.launch import run_ranks
from helpers.runs import read_metrics
from torch.utils.data import DistributedSampler

from ddp_utils.config import TorchvisionData
from ddp_utils.data import IGNORE_LABEL, load_split
from ddp_utils.data.cache import cache_path
from ddp_utils.data.images import builtin as data_mod
from ddp_utils.data.images.builtin import ImageTensorDataset
from ddp_utils.data.loaders import TensorLoader
from ddp_utils.data.samplers import ResumableDistributedSampler


def indexed_dataset(n: int) -> ImageTensorDataset:
    """Sample i carries i in its first two pixels, so padding duplicates can be traced too."""
    images = torch.zeros(n, 1, 4, 4, dtype=torch.uint8)
    images[:, 0, 0, 0] = torch.arange(n) % 256
    images[:, 0, 0, 1] = torch.arange(n) // 256
    return ImageTensorDataset(images, torch.arange(n))


@pytest.mark.parametrize("n,world_size", [(1438, 1), (1438, 2), (1438, 3), (1001, 4), (7, 3)])
def test_tensor_path_hands_each_rank_distributed_samplers_indices(n, world_size):
    ds = indexed_dataset(n)
    for epoch in (0, 1, 5):
        pads = 0
        for rank in range(world_size):
            reference = DistributedSampler(range(n), world_size, rank, shuffle=True, seed=3)
            reference.set_epoch(epoch)
            sampler = ResumableDistributedSampler(n, world_size, rank, seed=3)
            sampler.set_epoch(epoch)
            images, labels = zip(*TensorLoader(ds, sampler, 10, torch.device("cpu")), strict=True)
            images, labels = torch.cat(images), torch.cat(labels)
            traced = images[:, 0, 0, 0].long() + 256 * images[:, 0, 0, 1].long()
            assert traced.tolist() == list(reference)
            # Real samples keep their labels; DistributedSampler's padding duplicates are ignored.
            pad = labels == IGNORE_LABEL
            assert torch.equal(labels[~pad], traced[~pad])
            pads += int(pad.sum())
        assert pads == len(reference) * world_size - n


def test_both_paths_train_the_same(tmp_path):
    args = ("trainer.epochs=3", "data.batch_size=64")
    run_ranks("train.py", *args, "data.loader=tensor", f"run_dir={tmp_path}/tensor", nproc=1)
    run_ranks("train.py", *args, "data.loader=torch", "data.num_workers=1",
              f"run_dir={tmp_path}/torch", nproc=1)  # fmt: skip
    a, b = read_metrics(tmp_path / "tensor"), read_metrics(tmp_path / "torch")
    for ra, rb in zip(a, b, strict=True):
        assert ra["train/loss"] == pytest.approx(rb["train/loss"], rel=1e-5)
        assert ra["val/loss"] == pytest.approx(rb["val/loss"], rel=1e-5)


def write_idx(path, array: torch.Tensor) -> None:
    """torchvision's raw MNIST layout: a magic number, the dimensions, the uint8 data."""
    magic = 2051 if array.ndim == 3 else 2049
    header = struct.pack(">I", magic) + b"".join(struct.pack(">I", d) for d in array.shape)
    path.write_bytes(header + array.numpy().tobytes())


def fake_mnist(root, labels: torch.Tensor) -> None:
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    n = len(labels)
    images = (torch.arange(n * 28 * 28) % 251).to(torch.uint8).view(n, 28, 28)
    for split in ("train", "t10k"):
        write_idx(raw / f"{split}-images-idx3-ubyte", images)
        write_idx(raw / f"{split}-labels-idx1-ubyte", labels.to(torch.uint8))
    with gzip.open(raw / "unused.gz", "wb") as f:
        f.write(b"")


def test_cache_is_built_reused_and_rebuilt_when_the_source_changes(tmp_path, monkeypatch):
    cfg = TorchvisionData(name="mnist", root=str(tmp_path), image_size=28)
    fake_mnist(tmp_path, torch.arange(12) % 10)
    first = load_split(cfg, "train")
    assert cache_path(cfg.root, "mnist-train.pt").is_file()

    decoded = []
    real_decode = data_mod._decode_torchvision
    monkeypatch.setattr(data_mod, "_decode_torchvision",
                        lambda *a: decoded.append(1) or real_decode(*a))  # fmt: skip
    again = load_split(cfg, "train")
    assert decoded == [] and torch.equal(again.labels, first.labels)  # served from the cache

    fake_mnist(tmp_path, (torch.arange(12) + 3) % 10)  # the source changes
    changed = load_split(cfg, "train")
    assert decoded == [1] and torch.equal(changed.labels, (torch.arange(12) + 3) % 10)
    assert torch.equal(load_split(cfg, "train").labels, changed.labels) and decoded == [1]


def test_read_only_data_root_caches_elsewhere(tmp_path):
    fake_mnist(tmp_path, torch.arange(12) % 10)
    tmp_path.chmod(0o555)
    try:
        cfg = TorchvisionData(name="mnist", root=str(tmp_path), image_size=28)
        assert not str(cache_path(cfg.root, "mnist-train.pt")).startswith(str(tmp_path))
    finally:
        tmp_path.chmod(0o755)


@pytest.mark.parametrize("n, world_size, batch", [(23, 2, 5), (1438, 3, 10), (7, 2, 4)])
def test_drop_last_ends_every_ranks_epoch_at_a_whole_batch_and_resumes_to_the_same(
    n, world_size, batch
):
    def shards(start: int = 0) -> list[list[int]]:
        out = []
        for rank in range(world_size):
            s = ResumableDistributedSampler(n, world_size, rank, seed=3, drop_last_of=batch)
            s.set_epoch(2, start)
            out.append(list(s))
        return out

    whole = shards()
    kept = n // (world_size * batch) * world_size * batch
    if kept == 0:  # less than one global batch: kept, padded, as without drop_last
        assert sum(len(s) for s in whole) >= n
        return
    assert all(len(s) == kept // world_size for s in whole)
    assert all(len(s) % batch == 0 for s in whole)  # full batches only: no batch of one
    seen = [i for s in whole for i in s]
    assert len(set(seen)) == len(seen) == kept and min(seen) >= 0  # no padding needed
    sampler = ResumableDistributedSampler(n, world_size, 0, seed=3, drop_last_of=batch)
    batches = len(sampler) // batch
    assert sampler.consumed(batches, batch) == n  # the epoch is over: dropped ones passed
    # A resume after one global batch continues with exactly the rest of the same epoch.
    middle = sampler.consumed(1, batch)
    rest = shards(middle)
    assert sorted(i for s in rest for i in s) == sorted(i for s in whole for i in s[batch:])
