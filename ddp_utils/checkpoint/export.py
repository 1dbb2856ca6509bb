"""Checkpoints as files that other tools load:

    python -m ddp_utils.checkpoint export CHECKPOINT OUT --format torch|safetensors|hf|adapter
    python -m ddp_utils.checkpoint DIR.dcp OUT.pt        # the same as --format torch

``CHECKPOINT`` is a file, a sharded folder, or either's URL on a store (a ``last.pt`` or
``best.pt`` URL names the step its marker names); S3 reads AWS_ENDPOINT_URL and the usual
credentials.

``torch``: one consolidated ``torch.save`` file that eval.py and generate.py read (a sharded
folder's shards gathered; the optimizer's state left behind). ``safetensors``: the model's
weights alone, with the run's config in the file's metadata. ``hf``: a Hugging Face folder
(``config.json``, ``model.safetensors``) for a model that declares its Hugging Face layout
(``hf_export()``: the GPT's is GPT-2's), which ``transformers``' ``from_pretrained`` loads;
a LoRA run's adapters are merged into the base weights. ``adapter``: a LoRA run's adapters
alone as peft's folder (``adapter_config.json`` naming the base folder,
``adapter_model.safetensors``). ``--ema`` exports the EMA weights (not with ``torch``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from torch import nn

from ddp_utils.checkpoint.format import (
    SHARDED_DIR,
    SHARDED_OPTIONS,
    load_checkpoint,
    read_all_shards,
)
from ddp_utils.checkpoint.inference import inference_model
from ddp_utils.config import ConfigError, UserError, from_record, to_schema
from ddp_utils.data.text.tokenizer import HF_TOKENIZER_FILES
from ddp_utils.files import atomic_save, atomic_write_text

FORMATS = ("torch", "safetensors", "hf", "adapter")


def to_single_file(src: str, dst: Path) -> None:
    """A checkpoint as one whole file that eval.py and generate.py read, and that can be
    shared: a sharded folder's shards gathered. The optimizer's state stays behind (a sharded
    one is keyed by parameter name and would not load into a single process's optimizer;
    training resumes from the original)."""
    ckpt = load_checkpoint(src)
    if SHARDED_DIR in ckpt:
        states = read_all_shards(ckpt)
        plain = {
            k: v for k, v in ckpt.items() if k not in (SHARDED_DIR, SHARDED_OPTIONS, "sharded")
        }
        ckpt = plain | states
    whole = {k: v for k, v in ckpt.items() if k != "optimizer"}
    atomic_save(whole | {"converted_from": str(src)}, dst)


def checkpoint_model(src: str, ema: bool) -> tuple[nn.Module, dict[str, Any]]:
    """The model a checkpoint (a file or a sharded folder) holds, on the CPU, and the run's
    config record."""
    ckpt = load_checkpoint(src)
    train_cfg = to_schema(from_record(ckpt["config"]))
    fix = "Give a train.py checkpoint."
    return inference_model(ckpt, src, train_cfg, ema, fix=fix), ckpt["config"]


def to_safetensors(src: str, dst: Path, ema: bool = False) -> None:
    """The model's weights as one safetensors file (each tensor its own: a tied embedding is
    written twice), the run's config as JSON in its metadata."""
    from safetensors.torch import save_file

    model, record = checkpoint_model(src, ema)
    weights = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    dst.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dst.parent) as tmp:
        save_file(weights, Path(tmp) / "w.safetensors", metadata={"config": json.dumps(record)})
        Path(tmp, "w.safetensors").replace(dst)


def to_hf_folder(src: str, dst: Path, ema: bool = False) -> None:
    """A Hugging Face folder of a model that declares its layout (``hf_export()`` returns the
    ``transformers`` config class name, its arguments, and the state dict in its names)."""
    model, record = checkpoint_model(src, ema)
    if not hasattr(model, "hf_export"):
        raise ConfigError(
            f"model={record.get('model', {}).get('name')} declares no Hugging Face layout "
            f"(an hf_export() method): export it with --format torch or --format safetensors."
        )
    import transformers

    config_class, kwargs, state = model.hf_export()
    hf = transformers.AutoModelForCausalLM.from_config(
        getattr(transformers, config_class)(**kwargs)
    )
    missing, unexpected = hf.load_state_dict(state, strict=False)
    tied = set(getattr(hf, "_tied_weights_keys", None) or [])
    if unexpected or set(missing) - tied:
        raise AssertionError(f"hf_export() does not fit {config_class}: {missing}, {unexpected}")
    hf.save_pretrained(dst, safe_serialization=True)
    copy_tokenizer(getattr(model, "hf_source", None), dst)
    atomic_write_text(dst / "ddp_recipes.json", json.dumps({"config": record}, indent=1) + "\n")


def to_adapter_folder(src: str, dst: Path, ema: bool = False) -> None:
    """A LoRA run's adapters as peft's folder, with the base's tokenizer files."""
    model, record = checkpoint_model(src, ema)
    if not hasattr(model, "save_adapter"):
        raise ConfigError("--format adapter is for a model=hf model.lora run's checkpoint: "
                          "export this one with --format hf or safetensors.")  # fmt: skip
    model.save_adapter(dst)
    copy_tokenizer(getattr(model, "hf_source", None), dst)
    atomic_write_text(dst / "ddp_recipes.json", json.dumps({"config": record}, indent=1) + "\n")


def copy_tokenizer(source: Path | None, dst: Path) -> None:
    """The base model folder's tokenizer files and chat template, beside the exported weights
    (a model fine-tuned from ``model.pretrained``)."""
    if source is None:
        return
    for name in HF_TOKENIZER_FILES:
        if (Path(source) / name).is_file():
            shutil.copy2(Path(source) / name, dst / name)


def export(src: str, dst: Path, fmt: str, ema: bool = False) -> None:
    if fmt == "torch":
        if ema:
            raise ConfigError("--ema is for --format safetensors and hf: --format torch keeps "
                              "both the weights and the EMA weights.")  # fmt: skip
        to_single_file(src, dst)
    else:
        writer = {"safetensors": to_safetensors, "hf": to_hf_folder, "adapter": to_adapter_folder}
        writer[fmt](src, dst, ema)


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ddp_utils.checkpoint", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    if not argv or argv[0] != "export":  # the two-argument form of earlier releases
        p.add_argument("src", help="a .dcp folder, e.g. outputs/RUN/checkpoints/best.dcp")
        p.add_argument("dst", type=Path, help="the .pt file to write")
        return argparse.Namespace(**vars(p.parse_args(argv)), format="torch", ema=False)
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser("export", help="export a checkpoint for other tools")
    e.add_argument(
        "src",
        help="a checkpoint file or sharded folder (best.pt, last.dcp), or its "
        "URL (s3://bucket/run/checkpoints/best.pt)",
    )
    e.add_argument("dst", type=Path, help="the file (torch, safetensors) or folder (hf) to write")
    e.add_argument("--format", choices=FORMATS, default="torch")
    e.add_argument("--ema", action="store_true", help="the EMA weights (safetensors, hf)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    try:
        export(args.src, args.dst, args.format, args.ema)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.dst}")
    return 0
