"""``python -m ddp_utils.checkpoint DIR OUT.pt``: a sharded checkpoint folder as one whole
file, for eval.py, generate.py and sharing."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

from ddp_utils.checkpoint.format import SHARDED_DIR, load_sharded_meta
from ddp_utils.config import UserError
from ddp_utils.files import atomic_save


def to_single_file(src: Path, dst: Path) -> None:
    """A sharded checkpoint as one whole file that eval.py and generate.py read, and that can
    be shared: torch's ``dcp_to_torch_save`` gathers the shards; the optimizer's state stays
    behind (keyed by parameter name, it would not load into a single process's optimizer, and
    training resumes from the folder)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    meta = load_sharded_meta(src)
    with tempfile.TemporaryDirectory(dir=dst.parent) as tmp:
        dcp_to_torch_save(src, Path(tmp) / "whole.pt")
        whole = torch.load(Path(tmp) / "whole.pt", map_location="cpu", weights_only=True)
    plain = {k: v for k, v in meta.items() if k not in (SHARDED_DIR, "sharded")}
    states = {k: v for k, v in whole.items() if k != "optimizer"}
    atomic_save(plain | states | {"converted_from": str(src)}, dst)


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m ddp_utils.checkpoint",
        description="Turn a sharded checkpoint folder (trainer.strategy=fsdp2, *.dcp) into one "
        "whole .pt file for eval.py, generate.py and sharing.",
    )
    p.add_argument("src", type=Path, help="a .dcp folder, e.g. outputs/RUN/checkpoints/best.dcp")
    p.add_argument("dst", type=Path, help="the .pt file to write")
    args = p.parse_args(argv)
    try:
        to_single_file(args.src, args.dst)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.dst}")
    return 0
