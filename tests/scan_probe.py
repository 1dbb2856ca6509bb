"""Launched under torchrun by test_one_scan_per_job: builds the data of an image folder on
every rank, twice, and writes, per rank and build, how often it listed the folder or read the
cached index."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ddp_utils.config import ImageFolderData, TrainerConfig  # noqa: E402
from ddp_utils.data import build_data, cache, imagefolder  # noqa: E402
from ddp_utils.dist import init_distributed, shutdown  # noqa: E402

counts = {"scans": 0, "cache_reads": 0}
real_scan, real_read = imagefolder.scan, cache.read_cache


def counting_scan(*args):
    counts["scans"] += 1
    return real_scan(*args)


def counting_read(*args):
    counts["cache_reads"] += 1
    return real_read(*args)


imagefolder.scan, cache.read_cache = counting_scan, counting_read

if __name__ == "__main__":
    root, out = sys.argv[1], Path(sys.argv[2])
    rt = init_distributed(TrainerConfig(device="cpu"))
    cfg = ImageFolderData(root=root, in_channels=1, image_size=8, num_workers=0, mean=[0.3],
                          std=[0.38])  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    for build in range(2):  # a first job, then one that finds the index cached
        counts.update(scans=0, cache_reads=0)
        data = build_data(cfg, rt, seed=0)
        counts.update(train=data.train_sampler.length, val=len(data.val.dataset))
        (out / f"rank{rt.rank}.{build}.json").write_text(json.dumps(counts))
    shutdown()
