"""Write any image data option as WebDataset-layout tar shards (``data=shards`` reads them).

    python -m ddp_utils.shards write --out /data/digits_shards data=digits
    python -m ddp_utils.shards write --out s3://bucket/imagenet --samples-per-shard 2000 \\
        --decoded --resize 256 --workers 16 data=imagefolder data.root=/data/imagenet

Each split (``train/``, ``val/``) becomes ``shard-000000.tar``, ... of ``--samples-per-shard``
samples in the data set's order: ``KEY.png`` (lossless) or, with ``--decoded``, ``KEY.npy`` (the
uint8 CHW array: no decoding when read), either resized so its shorter side is ``--resize`` if
given, and ``KEY.cls`` (the class index as text). The last line printed is the train.py command
that reads them (the classes, channels, size and normalisation of the source). Beside the
shards, ``index.pt`` holds every sample's byte range (``data=shards`` builds one itself for
shards written by other tools), and ``data.root/classes.txt`` the class names where the source
has them. ``--out`` is a folder or any fsspec URL (S3 reads AWS_ENDPOINT_URL and the usual
credentials); the overrides after it choose the data option as they do for train.py.
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
from pathlib import Path

from ddp_utils.config import ConfigError, DataConfig, UserError
from ddp_utils.data import resolve_data
from ddp_utils.data.shards.writer import RUNTIME, SPLITS, training_command, write_split

CONF = Path(__file__).resolve().parents[1] / "conf"


def compose_data(overrides: list[str]) -> DataConfig:
    """The data option of ``overrides`` as train.py composes it, checked on its own (the
    writer trains nothing: no task or model has to match it)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from ddp_utils.config import TrainConfig
    from ddp_utils.config.schema import collect_target_kwargs
    from ddp_utils.entry import register

    register()
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose("train", overrides=overrides)
    collect_target_kwargs(cfg, TrainConfig)
    data = OmegaConf.to_object(cfg.data)
    data.check()
    return data


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ddp_utils.shards", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write", help="write a data option's splits as tar shards")
    w.add_argument("--out", required=True, help="a folder or fsspec URL (s3://bucket/prefix)")
    w.add_argument("--samples-per-shard", type=int, default=1000)
    w.add_argument("--decoded", action="store_true", help="store uint8 arrays (.npy), not PNG")
    w.add_argument("--resize", type=int, default=None, help="the images' shorter side, stored")
    w.add_argument("--workers", type=int, default=max(1, (multiprocessing.cpu_count() or 2) - 1))
    w.add_argument("overrides", nargs="*", help="the data option, as for train.py: data=digits")
    args = p.parse_args(argv)
    if args.samples_per_shard < 1 or args.workers < 1:
        p.error("--samples-per-shard and --workers must be at least 1")
    try:
        cfg = resolve_data(compose_data(args.overrides), RUNTIME)
        if args.resize is not None and type(cfg).holds != "labels":
            raise ConfigError(f"--resize resizes the images alone, but data={cfg.name} holds "
                              f"{type(cfg).holds}: store them at their size (leave out "
                              "--resize).")  # fmt: skip
        for split in SPLITS:
            n = write_split(cfg, split, args.out, args)
            print(f"{split}: {n} samples in {args.out.rstrip('/')}/{SPLITS[split]}/")
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"train with: {training_command(cfg, args.out, args.resize)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
