"""What only a CUDA GPU can show, each check asserting what would break there: the device,
precision and TF32 a default run picks; fp16 with its scaler (ddp, fsdp2) learning; fsdp2 with
CPU offload; determinism; a resume with the CUDA RNG and the optimizer state on the device;
eval.py's numbers equal to training's; torch.compile; activation checkpointing; fsdp2 at world
size 1 against ddp; each task family over NCCL. With two GPUs or more: SyncBatchNorm, DDP's
all-reduce, fsdp2's resharding on resume, HSDP and exact evaluation at world sizes 1 and 2.

Each skips with a reason on a machine without what it needs; `python bench/gpu_check.py`
runs them with the GPU benchmark, in one table under 10 minutes (docs/gpus.md)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from helpers.launch import run_script
from helpers.runs import params, read_metrics, whole_checkpoint

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = pytest.mark.skipif(
    GPUS == 0, reason="needs a CUDA GPU (python bench/gpu_check.py runs these there)"
)
two_gpus = pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs: a group of one syncs nothing")

SHORT = ("trainer.max_steps=12", "trainer.val_every_steps=6", "logger=none",
         "trainer.progress=false")  # fmt: skip
# Bit-for-bit comparisons: fp32 without TF32, deterministic kernels.
EXACT = ("trainer.precision=32", "trainer.deterministic=true")
CHANCE = math.log(10)  # the digits' validation loss before any learning
BEST_PRECISION = "bf16" if GPUS and torch.cuda.get_device_capability(0)[0] >= 8 else "fp16"


def last_val(run_dir: Path, key: str = "val/loss") -> float:
    return [r[key] for r in read_metrics(run_dir) if key in r][-1]


def close(a: dict, b: dict, tol: float) -> None:
    assert a.keys() == b.keys()
    worst = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    assert worst <= tol, worst


def test_the_gpu_is_chosen_with_precision_auto_and_tf32_for_its_capability():
    from ddp_utils.hardware import auto_precision, backend_flags, choose_device, probe_cuda
    from ddp_utils.train.precision import set_numerics

    cuda = probe_cuda()
    assert cuda.usable and cuda.wheel_cuda and cuda.driver_cuda
    assert choose_device("auto", 0, 1, False, cuda) == torch.device("cuda", 0)
    assert auto_precision("cuda", cuda, amx=False, bf16_on_cpu=False) == BEST_PRECISION
    from ddp_utils.config import TrainerConfig

    assert set_numerics(TrainerConfig(), torch.device("cuda", 0)) == backend_flags("cuda", False)
    assert torch.backends.cuda.matmul.fp32_precision == "tf32"
    assert torch.backends.cudnn.conv.fp32_precision == "tf32"


def test_a_default_run_trains_on_the_gpu_and_learns(tmp_path):
    proc = run_script("train.py", *SHORT, f"run_dir={tmp_path}/run", nproc=1)
    assert "device cuda:0 | backend nccl" in proc.stdout
    assert f"precision {BEST_PRECISION}" in proc.stdout
    assert "the datasheet of" in proc.stdout or "measured on this machine" in proc.stdout
    mfu = [r["mfu"] for r in read_metrics(tmp_path / "run") if "mfu" in r]
    assert mfu and all(0 < m < 1 for m in mfu)
    assert last_val(tmp_path / "run") < CHANCE - 0.3


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_fp16_with_its_gradient_scaler_learns(tmp_path, strategy):
    run_script("train.py", *SHORT, "trainer.precision=fp16", "trainer.grad_clip=1.0",
               f"trainer.strategy={strategy}", f"run_dir={tmp_path}/run", nproc=1)  # fmt: skip
    ckpt = tmp_path / "run" / "checkpoints"
    saved = whole_checkpoint(ckpt / "last.pt" if strategy == "ddp" else ckpt / "last.dcp")
    scale = saved["scaler"]["scale"]
    assert math.isfinite(scale) and math.log2(scale) == int(math.log2(scale))  # a power of 2
    assert all(torch.isfinite(v).all() for v in params(tmp_path / "run").values())
    assert last_val(tmp_path / "run") < CHANCE - 0.3


def test_fsdp2_with_cpu_offload_on_a_model_with_batchnorm(tmp_path):
    proc = run_script("train.py", *SHORT, "trainer.strategy=fsdp2", "trainer.fsdp.cpu_offload=true",
                      "trainer.grad_clip=1.0", f"run_dir={tmp_path}/run", nproc=1)  # fmt: skip
    assert "backend cpu:gloo,cuda:nccl" in proc.stdout
    assert last_val(tmp_path / "run") < CHANCE - 0.3


def test_deterministic_runs_give_the_same_parameters(tmp_path):
    for name in ("a", "b"):
        run_script("train.py", *SHORT, *EXACT, f"run_dir={tmp_path}/{name}", nproc=1)
    a, b = params(tmp_path / "a"), params(tmp_path / "b")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_resume_with_cuda_rng_and_optimizer_state_ends_where_the_uninterrupted_run_does(
    tmp_path,
):
    # dropout draws from the CUDA generator: the GPT's recipe has it
    lm = ("experiment=lm_char", "trainer.max_steps=12", "trainer.ckpt_every_steps=6",
          "trainer.val_every_steps=12", "logger=none", "trainer.progress=false",
          "model.dropout=0.1", *EXACT)  # fmt: skip
    run_script("train.py", *lm, f"run_dir={tmp_path}/whole", nproc=1)
    (half,) = (tmp_path / "whole" / "checkpoints").glob("step_*6.pt")
    run_script("train.py", *lm, f"resume={half}", f"run_dir={tmp_path}/resumed", nproc=1)
    a, b = params(tmp_path / "whole"), params(tmp_path / "resumed")
    assert all(torch.equal(a[k], b[k]) for k in a)
    saved = whole_checkpoint(tmp_path / "resumed" / "checkpoints" / "last.pt")
    assert saved["rng"][0]["cuda"] is not None


def test_eval_scores_a_checkpoint_as_training_validated_it(tmp_path):
    run_script("train.py", *SHORT, *EXACT, f"run_dir={tmp_path}/run", nproc=1)
    out = tmp_path / "eval.json"
    ckpt = tmp_path / "run" / "checkpoints" / "last.pt"
    run_script("eval.py", f"checkpoint={ckpt}", f"output={out}", nproc=1)
    scored = json.loads(out.read_text())
    assert scored["accuracy"] == last_val(tmp_path / "run", "val/accuracy")
    assert abs(scored["loss"] - last_val(tmp_path / "run")) <= 1e-6


def test_compiled_training_learns(tmp_path):
    run_script("train.py", *SHORT, "trainer.compile=true", f"run_dir={tmp_path}/run", nproc=1,
               timeout=400)  # fmt: skip
    assert last_val(tmp_path / "run") < CHANCE - 0.3


def test_activation_checkpointing_and_fsdp2_at_one_gpu_match_plain_ddp(tmp_path):
    lm = ("experiment=lm_char", "trainer.max_steps=8", "trainer.val_every_steps=8",
          "logger=none", "trainer.progress=false", "model.dropout=0.0", *EXACT)  # fmt: skip
    run_script("train.py", *lm, f"run_dir={tmp_path}/ddp", nproc=1)
    run_script("train.py", *lm, "trainer.activation_checkpointing=true",
               f"run_dir={tmp_path}/ac", nproc=1)  # fmt: skip
    run_script("train.py", *lm, "trainer.strategy=fsdp2", f"run_dir={tmp_path}/fsdp2", nproc=1)
    base = params(tmp_path / "ddp")
    close(base, params(tmp_path / "ac"), 1e-5)
    close(base, params(tmp_path / "fsdp2"), 1e-5)


FAMILIES = {
    "classification": [],
    "segmentation": ["experiment=digits_segmentation"],
    "detection": ["experiment=digits_detection"],
    "language_model": ["experiment=lm_char"],
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_task_family_trains_over_nccl(tmp_path, family):
    nproc = min(2, GPUS)
    run_script("train.py", *FAMILIES[family], *SHORT, f"run_dir={tmp_path}/run", nproc=nproc,
               timeout=400)  # fmt: skip
    assert math.isfinite(last_val(tmp_path / "run"))


# Two GPUs or more: what a group of one cannot show.
MLP = ("model=mlp", "data.global_batch_size=64", *SHORT, *EXACT)


@two_gpus
def test_ddps_all_reduce_makes_two_gpus_train_as_one(tmp_path):
    run_script("train.py", *MLP, f"run_dir={tmp_path}/one", nproc=1)
    run_script("train.py", *MLP, f"run_dir={tmp_path}/two", nproc=2)
    close(params(tmp_path / "one"), params(tmp_path / "two"), 1e-5)


@two_gpus
def test_sync_batchnorm_over_two_gpus_trains_as_one_gpu_on_the_whole_batch(tmp_path):
    common = ("data.global_batch_size=64", "data.batch_size=64", *SHORT, *EXACT)
    run_script("train.py", *common, f"run_dir={tmp_path}/one", nproc=1)
    run_script("train.py", *common, "trainer.ddp.sync_bn=true", f"run_dir={tmp_path}/two", nproc=2)
    close(params(tmp_path / "one"), params(tmp_path / "two"), 1e-4)


@two_gpus
def test_fsdp2_shards_reshards_on_resume_and_hsdp_trains_alike(tmp_path):
    fsdp = (*MLP, "trainer.strategy=fsdp2", "trainer.ckpt_every_steps=6")
    run_script("train.py", *fsdp, f"run_dir={tmp_path}/two", nproc=2)
    (half,) = (tmp_path / "two" / "checkpoints").glob("step_*6.dcp")
    run_script("train.py", *fsdp, f"resume={half}", f"run_dir={tmp_path}/one", nproc=1)
    run_script("train.py", *fsdp, "trainer.fsdp.replicate=2", f"run_dir={tmp_path}/hsdp", nproc=2)
    base = params(tmp_path / "two")
    close(base, params(tmp_path / "one"), 1e-5)
    close(base, params(tmp_path / "hsdp"), 1e-5)


@two_gpus
def test_evaluation_is_exact_at_one_and_two_gpus(tmp_path):
    run_script("train.py", *SHORT, f"run_dir={tmp_path}/run", nproc=1)
    ckpt = tmp_path / "run" / "checkpoints" / "last.pt"
    scores = []
    for n in (1, 2):
        out = tmp_path / f"eval{n}.json"
        run_script("eval.py", f"checkpoint={ckpt}", f"output={out}", nproc=n)
        scores.append(json.loads(out.read_text()))
    for key in ("accuracy", "top5", "per_class_accuracy", "confusion_matrix", "num_samples"):
        assert scores[0][key] == scores[1][key], key
    assert abs(scores[0]["loss"] - scores[1]["loss"]) <= 1e-6
