"""Supervised fine-tuning end to end with torchrun at world size 2: a pretrained folder made
here (a tiny Llama that learnt to copy a word) fine-tuned on a task it cannot do (shift each
letter: "abcd" -> "bcde"), fully under ddp on chat records and with LoRA under fsdp2 on
packed prompt/completion records. Each reaches an exact-match accuracy of greedy generation on
held-out words that the base does not; a SIGKILL mid-epoch and relaunch of the LoRA run ends
with adapters equal to the uninterrupted run's; eval.py gives the same numbers at world
sizes 1, 2 and 3, equal to a plain transformers loop's loss; the exports load in
transformers and peft with our logits."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from callbacks import fault
from helpers.launch import child_env, run_script
from helpers.paths import ROOT
from helpers.runs import assert_same_params, eval_at_world_sizes, params, whole_checkpoint
from sft_data import (
    base_accuracy,
    exact_match,
    pretrained_folder,
    shift_records,
    write_jsonl,
)

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

HELD_OUT = shift_records(40, seed=7)
ACCURACY = 0.9  # both runs reach 1.0 here; the base reaches 0.0
RUNS = {
    "ddp_full_chat": ("trainer.strategy=ddp", "optim.lr=3e-3"),
    "fsdp2_lora_packed": (
        "trainer.strategy=fsdp2",
        "model.lora.r=8",
        "optim.lr=1e-2",
        "data.packing=true",
        "data.max_length=64",
    ),
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft")
    base = pretrained_folder(root / "base")
    write_jsonl(root / "chat" / "train.jsonl", shift_records(1024, 0, chat=True))
    write_jsonl(root / "chat" / "val.jsonl", shift_records(64, 5, chat=True))
    write_jsonl(root / "plain" / "train.jsonl", shift_records(1024, 0))
    write_jsonl(root / "plain" / "val.jsonl", shift_records(64, 5))
    return root, base


def args(root, base, name: str, run) -> tuple[str, ...]:
    data = root / ("chat" if "chat" in name else "plain")
    return ("experiment=sft", f"data.root={data}", f"model.pretrained={base}",
            f"data.cache_dir={root / 'cache'}", "data.global_batch_size=32",
            "data.batch_size=16", "trainer.max_steps=120", "trainer.val_every_steps=60",
            "trainer.ckpt_every_steps=20", "trainer.precision=32", "logger=none",
            "trainer.progress=false", "sched.warmup_steps=10", f"run_dir={run}",
            *RUNS[name])  # fmt: skip


@pytest.fixture(scope="module")
def runs(setup):
    root, base = setup
    out = {}
    for name in RUNS:
        out[name] = root / name
        run_script("train.py", *args(root, base, name, out[name]), nproc=2)
    return out


def last(run):
    return run / "checkpoints" / ("last.pt" if (run / "checkpoints/last.pt").exists()
                                  else "last.dcp")  # fmt: skip


@pytest.mark.parametrize("name", RUNS)
def test_fine_tuning_learns_what_the_base_cannot(setup, runs, name):
    _, base = setup
    chat = "chat" in name
    held_out = shift_records(40, seed=7, chat=chat)
    assert base_accuracy(base, held_out, chat) < 0.1
    assert exact_match(last(runs[name]), held_out, chat) >= ACCURACY


# ddp's whole-file resume of a family's sampler is every family's; the sharded, adapters-only
# state with packed rows is this issue's own
@pytest.mark.parametrize("name, kill", [("fsdp2_lora_packed", 77)])
def test_sigkill_mid_epoch_and_relaunch_ends_equal_to_the_uninterrupted_run(
    setup, runs, tmp_path, name, kill
):
    root, base = setup
    run = tmp_path / "run"
    proc = run_script("train.py", *args(root, base, name, run), fault("kill", kill, 1),
                      nproc=2, launcher=("--max-restarts=1",))  # fmt: skip
    assert "failed (exitcode:" in proc.stderr
    assert "resumed from" in (run / "train.log").read_text()
    assert_same_params(params(run), params(runs[name]))


def test_a_lora_checkpoint_holds_the_adapters_and_exports_merged_or_as_peft_folder(
    setup, runs, tmp_path
):
    from peft import PeftModel

    _, base = setup
    src = last(runs["fsdp2_lora_packed"])
    ckpt = whole_checkpoint(src)
    adapters = sum(v.numel() for v in ckpt["model"].values())
    assert ckpt["model"] and all("lora_" in k for k in ckpt["model"])
    assert adapters < 0.2 * sum(v.numel() for v in params(runs["ddp_full_chat"]).values())
    moments = [v for s in ckpt["optimizer"]["state"].values() for k, v in s.items()
               if k in ("exp_avg", "exp_avg_sq")]  # fmt: skip
    assert sum(v.numel() for v in moments) == 2 * adapters  # AdamW's, of the adapters alone
    for fmt in ("hf", "adapter"):
        export(src, tmp_path / fmt, fmt)
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    adapted = PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(base), tmp_path / "adapter"
    ).eval()
    assert json.loads((tmp_path / "adapter/adapter_config.json").read_text())[
        "base_model_name_or_path"] == str(base)  # fmt: skip
    ids = torch.randint(0, 200, (2, 12))
    with torch.no_grad():
        a, b = merged(input_ids=ids).logits, adapted(input_ids=ids).logits
    assert torch.allclose(a, b, atol=1e-5)
    assert (tmp_path / "hf" / "tokenizer.json").is_file()


def test_eval_is_identical_at_any_world_size_and_equals_a_plain_transformers_loop(
    setup, runs, tmp_path
):
    root, _ = setup
    src = last(runs["ddp_full_chat"])
    results = eval_at_world_sizes(src, tmp_path)
    first = results[None]
    assert first["num_samples"] == 64
    for r in results.values():  # the same, to the last digit
        assert (r["loss"], r["perplexity"]) == (first["loss"], first["perplexity"]), results
    export(src, tmp_path / "hf", "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    total, count = 0.0, 0
    with torch.no_grad():
        for line in (root / "chat" / "val.jsonl").read_text().splitlines():
            messages = json.loads(line)["messages"]
            ids = tok.apply_chat_template(messages)["input_ids"]
            prompt = len(tok.apply_chat_template(messages[:1], add_generation_prompt=True)
                         ["input_ids"])  # fmt: skip
            labels = torch.tensor([[-100] * prompt + ids[prompt:]])
            loss = model(input_ids=torch.tensor([ids]), labels=labels).loss
            n = int((labels[:, 1:] != -100).sum())
            total, count = total + float(loss) * n, count + n
    assert first["loss"] == pytest.approx(total / count, rel=1e-5)


def test_a_bad_record_stops_every_rank_with_one_line_naming_it(setup, tmp_path):
    root, base = setup
    empty = {"prompt": "shift abcd =", "completion": ""}
    data = write_jsonl(tmp_path / "d" / "train.jsonl", shift_records(10, 0) + [empty])
    cmd = [sys.executable, "-m", "ddp_utils.launch", "--standalone", "--nproc_per_node=2",
           str(ROOT / "train.py"), "experiment=sft", f"data.root={data}",
           f"model.pretrained={base}", f"data.cache_dir={tmp_path / 'c'}",
           f"run_dir={tmp_path / 'run'}", "logger=none"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    printed = [x for x in proc.stderr.splitlines() if x.startswith("error: ")]
    assert len(printed) == 1 and "train.jsonl:11: the completion is empty" in printed[0]
    assert "Traceback" not in proc.stderr and not (tmp_path / "run").exists()


def export(src, out, fmt: str) -> None:
    done = subprocess.run([sys.executable, "-m", "ddp_utils.checkpoint", "export", str(src),
                           str(out), "--format", fmt], cwd=ROOT, env=child_env(),
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
