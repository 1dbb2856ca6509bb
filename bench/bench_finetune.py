"""The fine-tuning benchmark: `make bench-finetune`.

A GPT-2-124M-sized transformers model (12 x 768, GPT-2's 50,257-row vocabulary padded to
50,304) built from its config, saved with ``save_pretrained`` and loaded back as
``model.pretrained``, fine-tuned at world size 2 on the same instruction records (about 150
tokens each, loss on the completion) for a few steps: full fine-tuning and LoRA (r 16, every
linear layer), each under ddp and fsdp2, against a plain transformers loop (torch DDP,
``labels`` of -100 on the prompt, the same batches padded the same way). Per variant: tokens
a second (the records' tokens, pads left out, over the median step), the bytes of parameters,
gradients and AdamW state a rank holds, and each rank's peak memory. Full precision, no
compile. Writes bench/results/finetune.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from bench_lm import torchrun

from bench import save_rows

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
VARIANTS = {
    "full, ddp": ["trainer.strategy=ddp"],
    "full, fsdp2": ["trainer.strategy=fsdp2"],
    "LoRA, ddp": ["trainer.strategy=ddp", "model.lora.r=16", "model.lora.alpha=32"],
    "LoRA, fsdp2": ["trainer.strategy=fsdp2", "model.lora.r=16", "model.lora.alpha=32"],
    "plain transformers loop (DDP)": None,
}
BATCH = 4  # records a rank takes a step


def setup(tmp: Path) -> tuple[Path, Path, int]:
    """The model folder, the records, and their tokens (pads left out) a global step."""
    import transformers
    from sft_data import shifted, tokenizer, words, write_jsonl

    tok = tokenizer()
    folder = tmp / "gpt2-124m"
    config = transformers.GPT2Config(vocab_size=50304, n_positions=1024,
                                     bos_token_id=tok.bos_token_id,
                                     eos_token_id=tok.eos_token_id)  # fmt: skip
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    records = []
    for k in range(256):
        ws = words(15, k)
        records.append({"prompt": "shift " + " ".join(ws) + " =",
                        "completion": " " + " ".join(shifted(w) for w in ws)})  # fmt: skip
    write_jsonl(tmp / "records" / "train.jsonl", records)
    write_jsonl(tmp / "records" / "val.jsonl", records[:8])
    per_record = statistics.mean(len(tok(r["prompt"] + r["completion"])["input_ids"]) + 1
                                 for r in records)  # fmt: skip
    return folder, tmp / "records", round(per_record * BATCH * 2)


def ours(variant: str, folder: Path, records: Path, tmp: Path, steps: int) -> dict:
    run, probe = tmp / f"run{abs(hash(variant))}", tmp / f"probe{abs(hash(variant))}"
    torchrun(2, "train.py", "experiment=sft", f"model.pretrained={folder}",
             f"data.root={records}", f"data.cache_dir={tmp / 'cache'}",
             f"data.batch_size={BATCH}", "data.global_batch_size=null", "data.max_length=256",
             f"trainer.max_steps={steps}", "trainer.val_every_steps=1000000",
             "trainer.precision=32", "trainer.compile=false", "logger=none",
             "trainer.progress=false", f"run_dir={run}", *VARIANTS[variant],
             f"callbacks=[{{_target_:memory_probe.MemoryProbe,folder:{probe}}}]")  # fmt: skip
    ranks = [json.loads((probe / f"rank{r}.json").read_text()) for r in range(2)]
    return {"state_MiB": max(sum(r["state_bytes"].values()) for r in ranks) / 2**20,
            "optimizer_MiB": max(r["state_bytes"].get("optimizer", 0) for r in ranks) / 2**20,
            "peak_rank_MiB": [r["peak_bytes"] / 2**20 for r in ranks],
            "step_s": statistics.median(r["step_s"] for r in ranks)}  # fmt: skip


def plain(folder: Path, records: Path, tmp: Path, steps: int) -> dict:
    out = tmp / "plain.json"
    torchrun(2, "bench/finetune_loop.py", str(folder), str(records / "train.jsonl"), str(out),
             str(steps), str(BATCH))  # fmt: skip
    return json.loads(out.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--variants", nargs="*", default=list(VARIANTS))
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "finetune.json")
    args = p.parse_args()
    os.environ["PYTHONPATH"] = f"{ROOT / 'bench'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    rows = []
    with tempfile.TemporaryDirectory() as t:
        folder, records, tokens = setup(Path(t))
        for variant in args.variants:
            if VARIANTS[variant] is None:
                row = plain(folder, records, Path(t), args.steps)
            else:
                row = ours(variant, folder, records, Path(t), args.steps)
            rows.append({"variant": variant, "world_size": 2, "tokens_per_step": tokens,
                         "tokens_per_s": tokens / row["step_s"], **row})  # fmt: skip
            print(rows[-1], flush=True)
    header = ("| variant (world size 2) | tokens/s | params + grads + AdamW a rank (MiB) | "
              "AdamW state a rank (MiB) | peak resident memory of each rank (MiB) |\n"
              "| --- | --- | --- | --- | --- |")  # fmt: skip
    save_rows(args.out, rows, header)
    for r in rows:
        print(f"| {r['variant']} | {r['tokens_per_s']:,.0f} | {r['state_MiB']:,.0f} | "
              f"{r['optimizer_MiB']:,.1f} | "
              f"{' / '.join(f'{m:,.0f}' for m in r['peak_rank_MiB'])} |")  # fmt: skip
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
