"""The sharded-data benchmark: `make bench-shards`.

Images per second of the training input pipeline alone (read, decode, augment, collate, to
the device; no model) on the job of `make bench-peer` (the 8,000 MNIST digits of
../shared/data/mnist10k as PNGs, else the embedded digits; read as RGB, RandomResizedCrop(32)
+ flip, batch 64), at each ``data.num_workers``:
- the image folder (``data=imagefolder``), one PNG a sample;
- local shards (``data=shards``) of the same PNGs, and of decoded uint8 arrays (``--decoded``);
- the same two on an S3 store (SeaweedFS on 127.0.0.1, started here) read through the node
  cache (empty at the start: the downloads are in the time) and by range requests
  (``data.cache_bytes=0``).
Each number is the median of ``--repeats`` passes of ``--epochs`` epochs, the first batch of a
pass (worker start-up) left out. Writes bench/results/shards.json and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from bench_data import rate
from devices import bench_device
from peer import make_folder

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the SeaweedFS helper the tests start their store with

from ddp_utils.config import ImageFolderData, ShardsData  # noqa: E402
from ddp_utils.data import build_data  # noqa: E402
from ddp_utils.dist import Runtime  # noqa: E402

JOB = {"in_channels": 3, "image_size": 32, "num_classes": 10, "mean": [0.5] * 3,
       "std": [0.5] * 3, "batch_size": 64, "augment": True}  # fmt: skip


def write(folder: Path, out: str, decoded: bool, env: dict[str, str] | None = None) -> None:
    cmd = [sys.executable, "-m", "ddp_utils.shards", "write", f"--out={out}",
           "--samples-per-shard=1000", "--workers=2", *(["--decoded"] if decoded else []),
           "data=imagefolder", f"data.root={folder}", "data.in_channels=3",
           "data.image_size=32", "data.num_classes=10"]  # fmt: skip
    subprocess.run(
        cmd, cwd=ROOT, check=True, capture_output=True, env={**os.environ, **(env or {})}
    )


def measure(cfg, epochs: int, repeats: int, device: torch.device) -> float:
    rates = []
    for _ in range(repeats):
        if getattr(cfg, "cache_dir", None):
            shutil.rmtree(cfg.cache_dir, ignore_errors=True)  # each pass downloads anew
        data = build_data(cfg, Runtime(0, 0, 1, 1, device, "gloo"), seed=0)
        rates.append(rate(data.train, lambda x, p=data.preprocess_train: p(x.to(device)), epochs))
        data.close()
    return statistics.median(rates)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default=bench_device(), help="DEVICE")
    p.add_argument("--out", type=Path, default=RESULTS / "shards.json")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from seaweed import Seaweed, weed_binary

    device = torch.device(args.device)
    folder, what = make_folder(RESULTS / "peer_folder")
    rows = []
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        variants = {"image folder": ImageFolderData(root=str(folder), **JOB)}
        for kind, decoded in (("PNG", False), ("decoded", True)):
            write(folder, str(tmp / kind), decoded)
            variants[f"local shards, {kind}"] = ShardsData(root=str(tmp / kind), **JOB)
        server = None
        if weed_binary() is not None:
            server = Seaweed(tmp / "seaweed").start()
            os.environ.update(server.env())
            bucket = server.bucket("bench")
            for kind, decoded in (("PNG", False), ("decoded", True)):
                write(folder, f"{bucket}/{kind}", decoded, server.env())
                variants[f"S3 shards, {kind}, node cache"] = ShardsData(
                    root=f"{bucket}/{kind}", cache_dir=str(tmp / "cache"), **JOB)  # fmt: skip
                variants[f"S3 shards, {kind}, range requests"] = ShardsData(
                    root=f"{bucket}/{kind}", cache_bytes=0, **JOB)  # fmt: skip
        try:
            for w in args.workers:
                row = {"num_workers": w}
                for name, cfg in variants.items():
                    cfg.num_workers = w
                    row[name] = measure(cfg, args.epochs, args.repeats, device)
                    print(w, name, f"{row[name]:,.0f}", flush=True)
                rows.append(row)
        finally:
            if server is not None:
                server.stop()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"data": what, "device": str(device), "rows": rows}, indent=2))
    names = list(variants)
    print(f"\n{what}; RandomResizedCrop(32) + flip, batch 64, to {device}; images/s:\n")
    print("| data.num_workers | " + " | ".join(names) + " |")
    print("|" + " --- |" * (len(names) + 1))
    for r in rows:
        print(f"| {r['num_workers']} | " + " | ".join(f"{r[n]:,.0f}" for n in names) + " |")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
