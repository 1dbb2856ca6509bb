"""data=shards in one process: the window-shuffled order, the tar index and its refusals, the
node cache (one download, atomic, least recently used out) on fsspec's in-memory store, and
a store that never answers."""

from __future__ import annotations

import io
import json
import tarfile
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from seaweed import free_ports

from ddp_utils.config import ConfigError, ShardsData
from ddp_utils.data.samplers import ResumableDistributedSampler
from ddp_utils.data.shards.formats import ClassFormat
from ddp_utils.data.shards.reader import window_order
from ddp_utils.data.shards.store import NodeCache, Store, StoreUnavailable
from ddp_utils.data.shards.tarindex import index_shard, split_name

COUNTS = torch.tensor([7, 3, 10, 1, 9, 6, 4])  # uneven shards, as real ones are
STARTS = torch.cumsum(COUNTS, 0) - COUNTS


def labels(num_classes: int) -> ClassFormat:
    return ClassFormat(ShardsData(num_classes=num_classes))


def shard_of(i: int) -> int:
    return int(torch.searchsorted(STARTS, i, right=True)) - 1


@pytest.mark.parametrize("window", [1, 2, 3, 7, 50])
def test_the_order_is_a_permutation_read_a_window_of_shards_at_a_time(window):
    order = window_order(COUNTS, seed=3, epoch=1, window=window)
    assert sorted(order) == list(range(int(COUNTS.sum())))
    assert order == window_order(COUNTS, seed=3, epoch=1, window=window)  # (seed, epoch) alone
    assert order != window_order(COUNTS, seed=3, epoch=2, window=window)
    # Consecutive samples come from at most `window` shards at a time: each window's shards
    # are read together, and never again later in the epoch.
    windows, seen = [], set()
    for i in order:
        s = shard_of(i)
        if not windows or (s not in windows[-1] and len(windows[-1]) == min(window, 7)):
            windows.append(set())
        assert s not in seen or s in windows[-1]
        windows[-1].add(s)
        seen.add(s)
    assert all(len(w) <= window for w in windows)


@pytest.mark.parametrize(("before", "after"), [(2, 3), (3, 1), (1, 2)])
def test_a_resume_at_another_world_size_takes_each_remaining_sample_once(before, after):
    n = int(COUNTS.sum())
    order = lambda seed, epoch: window_order(COUNTS, seed, epoch, 2)  # noqa: E731
    samplers = [ResumableDistributedSampler(n, before, r, seed=5, order=order)
                for r in range(before)]  # fmt: skip
    for s in samplers:
        s.set_epoch(1)
    done = [i for s in samplers for i in list(s)[:4]]  # every rank took 4 samples
    start = samplers[0].consumed(4, 1)
    rest = []
    for r in range(after):
        s = ResumableDistributedSampler(n, after, r, seed=5, order=order)
        s.set_epoch(1, start)
        rest += [i for i in s if i >= 0]  # padding duplicates are marked (negative)
    assert start == 4 * before
    assert Counter(done + rest) == Counter(range(n))


def tar_bytes(members: list[tuple[str, bytes]]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def test_the_index_gives_each_samples_byte_range_and_label():
    data = tar_bytes([("a/0001.png", b"PNG1"), ("a/0001.cls", b"3\n"), ("a/0002.seg.png", b"x"),
                      ("a/0002.jpg", b"JPEG22"), ("a/0002.cls", b"0")])  # fmt: skip
    index = index_shard(io.BytesIO(data), "s.tar", labels(5))
    assert index["label"].tolist() == [3, 0] and index["size"].tolist() == [4, 6]
    first, second = (int(o) for o in index["offset"])
    assert data[first : first + 4] == b"PNG1" and data[second : second + 6] == b"JPEG22"
    assert split_name("a/b/0002.seg.png") == ("a/b/0002", "seg.png")


@pytest.mark.parametrize(
    ("members", "says"),
    [
        ([("k.png", b"x")], "has no .cls member"),
        ([("k.cls", b"1")], "has no image"),
        ([("k.png", b"x"), ("k.cls", b"cat")], "not a class index"),
        ([("k.png", b"x"), ("k.cls", b"12")], "outside data.num_classes=10"),
    ],
)
def test_a_sample_the_index_cannot_use_is_named(members, says):
    with pytest.raises(ConfigError, match=says) as e:
        index_shard(io.BytesIO(tar_bytes(members)), "s3://b/train/shard-7.tar", labels(10))
    assert "shard-7.tar" in str(e.value)


def png(h: int, w: int) -> bytes:
    from torchvision.io import encode_png

    return encode_png(torch.zeros(3, h, w, dtype=torch.uint8)).numpy().tobytes()


def test_masks_and_boxes_keep_the_images_sizes_and_their_members_byte_ranges():
    from ddp_utils.config import DetShardsData, SegShardsData
    from ddp_utils.data.shards.formats import BoxFormat, MaskFormat

    boxes = json.dumps({"boxes": [[1, 2, 6, 4]], "labels": [2]}).encode()
    data = tar_bytes([("0.png", png(5, 7)), ("0.mask.png", b"M" * 9), ("0.json", boxes),
                      ("1.png", png(3, 4)), ("1.seg.png", b"S"), ("1.json", b"{}")])  # fmt: skip
    masks = index_shard(io.BytesIO(data), "s.tar", MaskFormat(SegShardsData(num_classes=4)))
    assert masks["height"].tolist() == [5, 3] and masks["width"].tolist() == [7, 4]
    start, size = int(masks["target_offset"][0]), int(masks["target_size"][0])
    assert data[start : start + size] == b"M" * 9 and "label" not in masks
    fmt = BoxFormat(DetShardsData(num_classes=3))
    index = index_shard(io.BytesIO(data), "s.tar", fmt)
    start, size = int(index["target_offset"][0]), int(index["target_size"][0])
    target = fmt.target(index, 0, data[start : start + size], "sample 0")
    assert target["boxes"].tolist() == [[1, 2, 6, 4]] and target["boxes"].canvas_size == (5, 7)
    assert target["labels"].tolist() == [2] and target["iscrowd"].tolist() == [0]


@pytest.mark.parametrize(
    ("record", "says"),
    [
        (b"[1, 2", "is not a boxes record"),
        (b'{"boxes": [[0, 0, 2, 2]], "labels": []}', "has 1 boxes, 0 labels"),
        (b'{"boxes": [[0, 0, 9, 2]], "labels": [1]}', "outside its 7x5 image"),
        (b'{"boxes": [[0, 0, 2, 2]], "labels": [3]}', "label 3, outside 1..2"),
    ],
)
def test_a_boxes_record_the_index_cannot_use_is_named(record, says):
    from ddp_utils.config import DetShardsData
    from ddp_utils.data.shards.formats import BoxFormat

    data = tar_bytes([("a/k.png", png(5, 7)), ("a/k.json", record)])
    with pytest.raises(ConfigError, match=says) as e:
        index_shard(io.BytesIO(data), "shard-4.tar", BoxFormat(DetShardsData(num_classes=3)))
    assert "a/k.json in the shard shard-4.tar" in str(e.value)


def test_a_truncated_shard_is_named():
    data = tar_bytes([(f"{i:04d}.png", b"x" * 3000) for i in range(3)])
    with pytest.raises(ConfigError, match="shard-3.tar is not a readable tar file"):
        index_shard(io.BytesIO(data[:2500]), "shard-3.tar", labels(10))


@pytest.fixture
def memory_store():
    """fsspec's in-memory file system: a store that is not a local folder."""
    import fsspec

    fs = fsspec.filesystem("memory")
    root = f"memory://shards-{time.monotonic_ns()}"
    for i in range(4):
        fs.pipe_file(f"{root}/train/shard-{i}.tar", bytes([i]) * 1000)
    yield Store(root, {}, retries=2)
    fs.rm(root, recursive=True)


def test_each_shard_is_downloaded_once_and_the_least_recently_used_go_first(memory_store, tmp_path):
    cache = NodeCache(tmp_path, limit=2500)
    calls = Counter()
    download = memory_store.download

    def counted(name, dest, size):
        calls[name] += 1
        time.sleep(0.05)  # long enough for the other threads to wait on the lock
        download(name, dest, size)

    memory_store.download = counted
    threads = [threading.Thread(target=cache.get, args=(memory_store, "train/shard-0.tar", 1000))
               for _ in range(6)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == {"train/shard-0.tar": 1}
    first = cache.get(memory_store, "train/shard-0.tar", 1000)
    assert first.read_bytes() == bytes([0]) * 1000
    time.sleep(0.01)
    cache.get(memory_store, "train/shard-1.tar", 1000)
    time.sleep(0.01)
    cache.get(memory_store, "train/shard-0.tar", 1000)  # used again: now the newest
    time.sleep(0.01)
    cache.get(memory_store, "train/shard-2.tar", 1000)  # 3000 > 2500: shard 1 goes
    kept = sorted(p.name.split("-", 1)[1] for p in tmp_path.iterdir() if p.is_file())
    assert kept == ["shard-0.tar", "shard-2.tar"]


def test_a_killed_download_leaves_nothing_that_is_read(memory_store, tmp_path):
    cache = NodeCache(tmp_path, limit=10**6)

    def dies(name, dest, size):
        dest.write_bytes(b"half")
        raise KeyboardInterrupt  # the process is stopped mid-download

    real, memory_store.download = memory_store.download, dies
    with pytest.raises(KeyboardInterrupt):
        cache.get(memory_store, "train/shard-3.tar", 1000)
    assert [p for p in tmp_path.iterdir() if p.is_file()] == []
    memory_store.download = real
    assert cache.get(memory_store, "train/shard-3.tar", 1000).read_bytes() == bytes([3]) * 1000


def test_a_store_that_never_answers_is_given_up_after_the_retries():
    port = free_ports(1)[0]  # nothing listens there
    store = Store("s3://bucket/data", {"endpoint_url": f"http://127.0.0.1:{port}", "key": "k",
                                       "secret": "s"}, retries=2)  # fmt: skip
    start = time.monotonic()
    with pytest.raises(StoreUnavailable, match="after 2 attempts") as e:
        store.read("train/shard-0.tar", 0, 10)
    assert time.monotonic() - start < 60
    assert e.value.exit_code == 75 and "relaunch the same command" in str(e.value)


def test_a_local_folder_is_read_in_place(tmp_path):
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "b.tar").write_bytes(b"1" * 10)
    (tmp_path / "train" / "a.tar").write_bytes(b"1" * 20)
    store = Store(str(tmp_path), {}, retries=1)
    assert store.local and store.listing("train") == [("train/a.tar", 20), ("train/b.tar", 10)]
    assert store.local_path("train/a.tar") == Path(tmp_path) / "train" / "a.tar"
    with pytest.raises(ConfigError, match="holds no \\*.tar shards"):
        store.listing("val")
    with pytest.raises(ConfigError, match="does not exist"):
        Store(str(tmp_path / "nowhere"), {}, retries=1).listing("train")


def test_brace_patterns_name_the_shards_in_their_order(tmp_path):
    from ddp_utils.data.shards.store import expand_braces

    assert expand_braces("train/s-{008..011}.tar") == [f"train/s-{i:03d}.tar" for i in range(8, 12)]
    assert expand_braces("{b,a}/p-{0..1}.tar") == [
        "b/p-0.tar",
        "b/p-1.tar",
        "a/p-0.tar",
        "a/p-1.tar",
    ]
    with pytest.raises(ConfigError, match="not a range"):
        expand_braces("train/{9..1}.tar")
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        for i in range(3):
            (tmp_path / folder / f"p-{i}.tar").write_bytes(b"x" * (i + 1))
    store = Store(str(tmp_path), {}, retries=1)
    want = [("b/p-1.tar", 2), ("b/p-2.tar", 3), ("a/p-1.tar", 2), ("a/p-2.tar", 3)]
    assert store.listing("{b,a}/p-{1..2}.tar") == want
    assert store.listing("a/p-0.tar") == [("a/p-0.tar", 1)]
    with pytest.raises(ConfigError, match="1 shard\\(s\\) of the pattern a/p-\\{0..3\\}.tar"):
        store.listing("a/p-{0..3}.tar")


def test_a_decoded_arrays_header_is_read_once_and_its_bytes_as_they_lie():
    import numpy as np

    from ddp_utils.data.shards.reader import decode_member
    from ddp_utils.data.shards.tarindex import RAW

    members = []
    for key, array in (("a", np.arange(3 * 4 * 5, dtype=np.uint8).reshape(3, 4, 5)),
                       ("b", np.arange(6, dtype=np.uint8).reshape(2, 3)),
                       ("c", np.zeros((2, 2), dtype=np.int16))):  # fmt: skip
        buffer = io.BytesIO()
        np.save(buffer, array)
        members += [(f"{key}.npy", buffer.getvalue()), (f"{key}.cls", b"1")]
    data = tar_bytes(members)
    index = index_shard(io.BytesIO(data), "s.tar", labels(3))
    assert index["kind"].tolist()[:2] == [RAW, RAW] and index["kind"][2] != RAW  # not uint8
    for i, shape in ((0, (3, 4, 5)), (1, (1, 2, 3))):
        start, size = int(index["offset"][i]), int(index["size"][i])
        image = decode_member(data[start : start + size], RAW, int(index["shape"][i]), shape[0],
                              "x")  # fmt: skip
        assert image.shape == shape and image.flatten().tolist() == list(range(size))


def test_the_writers_printed_command_trains(tmp_path):
    import shlex
    import subprocess
    import sys

    from helpers.paths import ROOT

    out = tmp_path / "shards"
    writer = subprocess.run([sys.executable, "-m", "ddp_utils.shards", "write", f"--out={out}",
                             "--samples-per-shard=300", "--workers=1", "data=digits"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert writer.returncode == 0, writer.stderr[-2000:]
    printed = writer.stdout.strip().splitlines()[-1]
    assert printed.startswith("train with: train.py data=shards")
    args = shlex.split(printed.removeprefix("train with: train.py "))
    run = subprocess.run([sys.executable, "train.py", *args, "trainer.max_steps=2", "logger=none",
                          f"run_dir={tmp_path}/run"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]


def test_resize_applies_to_png_shards_too():
    from ddp_utils.data.shards.writer import encode

    image = torch.zeros(1, 8, 16, dtype=torch.uint8)
    kind, data = encode(image, decoded=False, resize=4)
    from torchvision.io import decode_png

    assert kind == "png" and decode_png(
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
    ).shape == (1, 4, 8)
