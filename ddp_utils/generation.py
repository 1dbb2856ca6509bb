"""generate.py's phases: the model and tokenizer of a checkpoint, then sampling.

Sampling is autoregressive over the last ``data.block_size`` tokens, with temperature and top-k
and one ``torch.Generator`` seeded by ``seed``: the same checkpoint, prompt and seed give the
same text on the same device.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddp_utils.checkpoint import inference_model, load_checkpoint
from ddp_utils.config import ConfigError, GenerateConfig, from_record, to_schema
from ddp_utils.data.text.tokenizer import Tokenizer, from_spec
from ddp_utils.files import atomic_write_text
from ddp_utils.lifecycle.disk import writing_into
from ddp_utils.models.probe import eval_mode


def load_generator(cfg: GenerateConfig, device: torch.device) -> tuple[nn.Module, Tokenizer, int]:
    """The checkpoint's model (on ``device``), its tokenizer and context length."""
    ckpt = load_checkpoint(cfg.checkpoint)
    spec = ckpt.get("tokenizer")
    train_cfg = to_schema(from_record(ckpt["config"]))
    if spec is None or not train_cfg.task.generates:
        raise ConfigError(
            f"checkpoint={cfg.checkpoint} holds no language model with a tokenizer (it was "
            f"trained with task={train_cfg.task.name} on data={train_cfg.data.name}): give a "
            "checkpoint of task=language_model on data prepared with a tokenizer "
            "(prepare_text, data=pystdlib)."
        )
    model = inference_model(ckpt, cfg.checkpoint, train_cfg, cfg.ema)
    return model.to(device), from_spec(spec), train_cfg.data.block_size


def encode_prompt(tokenizer: Tokenizer, prompt: str, chat: bool | None = None) -> list[int]:
    try:
        ids = tokenizer.prompt(prompt, chat).tolist()
    except ValueError as e:
        raise ConfigError(
            f"prompt={prompt!r}: {e} ({tokenizer.kind} tokenizer of the checkpoint); use "
            "characters of the training text, or chat=false."
        ) from None
    if not ids:
        # A shell and Hydra pass '\n' on as a backslash and an n: the default is the newline.
        raise ConfigError(
            "prompt is empty: leave prompt out to start from a new line (its "
            'default), or give some text: "prompt=def ".'
        )
    return ids


def sample(
    model: nn.Module,
    ids: list[int],
    cfg: GenerateConfig,
    block_size: int,
    vocab: int,
    device: torch.device,
    stop: set[int] | None = None,
) -> list[list[int]]:
    """``num_samples`` continuations of ``ids``, ``max_new_tokens`` each or up to an id of
    ``stop`` (in eval mode, without gradients)."""
    stop = stop or set()
    g = torch.Generator(device=device).manual_seed(cfg.seed)
    x = torch.tensor(ids, dtype=torch.long, device=device).repeat(cfg.num_samples, 1)
    ends = torch.tensor(sorted(stop), dtype=torch.long, device=device)
    ended = torch.zeros(cfg.num_samples, dtype=torch.bool, device=device)
    with eval_mode(model):
        for _ in range(cfg.max_new_tokens):
            logits = model(x[:, -block_size:])[:, -1, :].float()
            logits[:, vocab:] = -torch.inf  # ids of a padded vocabulary stand for no text
            if cfg.temperature == 0:
                nxt = logits.argmax(-1, keepdim=True)
            else:
                logits = logits / cfg.temperature
                if cfg.top_k is not None and cfg.top_k < logits.shape[-1]:
                    kth = torch.topk(logits, cfg.top_k).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, -torch.inf)
                nxt = torch.multinomial(logits.softmax(-1), 1, generator=g)
            x = torch.cat([x, nxt], dim=1)
            if stop:
                ended |= torch.isin(nxt[:, 0], ends)
                if bool(ended.all()):
                    break  # every sample has ended
    return [until(row, stop) for row in x[:, len(ids) :].tolist()]


def until(ids: list[int], stop: set[int]) -> list[int]:
    """``ids`` up to (without) the first end-of-sequence id."""
    ends = [k for k, i in enumerate(ids) if i in stop]
    return ids[: ends[0]] if ends else ids


def run_generate(cfg: GenerateConfig) -> list[str]:
    """Load, sample, print each sample (and write ``output``); returns the texts."""
    want_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda but no CUDA device is visible; use device=cpu.")
    device = torch.device("cuda" if want_cuda else "cpu")
    model, tokenizer, block_size = load_generator(cfg, device)
    ids = encode_prompt(tokenizer, cfg.prompt, cfg.chat)
    samples = sample(model, ids, cfg, block_size, tokenizer.vocab_size, device,
                     tokenizer.stop_ids())  # fmt: skip
    texts = [cfg.prompt + tokenizer.decode(s) for s in samples]
    for i, text in enumerate(texts):
        print(f"--- sample {i} (seed {cfg.seed}) ---\n{text}", flush=True)
    if cfg.output:
        record: dict[str, Any] = {
            "checkpoint": cfg.checkpoint,
            "prompt": cfg.prompt,
            "seed": cfg.seed,
            "samples": texts,
        }
        with writing_into(Path(cfg.output).parent, key="output"):
            atomic_write_text(Path(cfg.output), json.dumps(record, indent=2))
    return texts
