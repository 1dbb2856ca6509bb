"""Launched under torchrun by test_one_scan_per_job: builds the data of an image folder on
every rank, twice, and writes, per rank and build, how often it listed the folder or read the
cached index. Each listing is slowed by SCAN_DELAY_S, past the collectives' timeout
(COLLECTIVE_TIMEOUT_S): the other ranks must wait for it all the same."""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ddp_utils.config import ImageFolderData, TrainerConfig  # noqa: E402
from ddp_utils.data import build_data, cache  # noqa: E402
from ddp_utils.data.images import imagefolder  # noqa: E402
from ddp_utils.dist import init_distributed, shutdown  # noqa: E402

COLLECTIVE_TIMEOUT_S, SCAN_DELAY_S = 2.0, 4.0
counts = {"scans": 0, "cache_reads": 0}
real_scan, real_read = imagefolder.scan, cache.read_cache


def counting_scan(*args):
    counts["scans"] += 1
    time.sleep(SCAN_DELAY_S)  # a listing of a slow or very large folder
    return real_scan(*args)


def counting_read(*args):
    counts["cache_reads"] += 1
    return real_read(*args)


imagefolder.scan, cache.read_cache = counting_scan, counting_read

if __name__ == "__main__":
    root, out = sys.argv[1], Path(sys.argv[2])
    import torch.distributed as dist

    rt = init_distributed(TrainerConfig(device="cpu"))
    dist.barrier()  # all started: from here on a collective waits COLLECTIVE_TIMEOUT_S at most
    dist.distributed_c10d.set_timeout(timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    cfg = ImageFolderData(root=root, in_channels=1, image_size=8, num_workers=0, mean=[0.3],
                          std=[0.38])  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    for build in range(2):  # a first job, then one that finds the index cached
        counts.update(scans=0, cache_reads=0)
        data = build_data(cfg, rt, seed=0)
        counts.update(train=data.train_sampler.length, val=len(data.val.dataset))
        (out / f"rank{rt.rank}.{build}.json").write_text(json.dumps(counts))
    shutdown()
