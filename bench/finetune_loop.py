"""The baseline of `make bench-finetune` (under torchrun): a plain transformers fine-tuning
loop, as a user writes it from transformers' docs.

    torchrun --nproc_per_node=2 bench/finetune_loop.py FOLDER RECORDS.jsonl OUT.json STEPS BATCH

Each rank loads the model folder with ``from_pretrained``, wraps it in torch's DDP, tokenizes
the prompt/completion records (``labels`` -100 on the prompt, the end-of-sequence token
after the completion), and steps a non-fused AdamW on batches of ``BATCH`` records a rank,
padded on the right to their longest with an attention mask, in full precision. Writes the
median step time, the bytes of parameters, gradients and AdamW state, and each rank's peak
resident memory to OUT.json (rank 0).
"""

from __future__ import annotations

import json
import resource
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent))
from devices import clock, join_group  # noqa: E402 - bench/devices.py


def batches(tok, path: Path, batch: int, rank: int, world: int):
    rows = []
    for line in path.read_text().splitlines():
        r = json.loads(line)
        prompt = tok(r["prompt"])["input_ids"]
        ids = tok(r["prompt"] + r["completion"])["input_ids"] + [tok.eos_token_id]
        rows.append((ids, [-100] * len(prompt) + ids[len(prompt) :]))
    g = torch.Generator().manual_seed(0)
    while True:
        order = torch.randperm(len(rows), generator=g).tolist()
        for k in range(rank * batch, len(order) - world * batch + 1, world * batch):
            part = [rows[i] for i in order[k : k + batch]]
            width = max(len(ids) for ids, _ in part)
            ids = torch.full((batch, width), tok.pad_token_id, dtype=torch.long)
            labels = torch.full((batch, width), -100, dtype=torch.long)
            mask = torch.zeros((batch, width), dtype=torch.long)
            for j, (a, b) in enumerate(part):
                ids[j, : len(a)], labels[j, : len(b)], mask[j, : len(a)] = (
                    torch.tensor(a), torch.tensor(b), 1)  # fmt: skip
            yield ids, labels, mask


def main() -> None:
    import transformers

    folder, records, out, steps, batch = sys.argv[1:6]
    device = join_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).to(device)
    ddp = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-5, weight_decay=0.0)
    times, last = [], clock(device)
    data = batches(tok, Path(records), int(batch), rank, world)
    for _ in range(int(steps)):
        ids, labels, mask = (t.to(device) for t in next(data))
        loss = ddp(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        now = clock(device)
        times.append(now - last)
        last = now
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    moments = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                  if v.ndim > 0)  # fmt: skip
    peak = [None] * world
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    dist.all_gather_object(peak, rss)
    if rank == 0:
        Path(out).write_text(json.dumps({
            "state_MiB": (2 * params + moments) / 2**20, "optimizer_MiB": moments / 2**20,
            "peak_rank_MiB": [p / 2**20 for p in peak], "step_s": statistics.median(times[1:]),
        }))  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
