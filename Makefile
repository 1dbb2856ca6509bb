# ddp-recipes: `make train` and `make test` do all the set-up on a fresh clone.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
NPROC  ?= 2
ARGS   ?=
# torch's wheel index for a cluster's CUDA, e.g. https://download.pytorch.org/whl/cu126
# (docs/install.md); empty: PyPI's default wheel
TORCH_INDEX ?=
# the device of both sides of bench-lm, -det, -comm, -memory, -peer, -nanogpt: cpu | cuda
DEVICE ?= cpu
export DEVICE

.DEFAULT_GOAL := help
.PHONY: help install train test test-fast docs lint format clean bench bench-gpu gpu-check bench-shards bench-data bench-seg bench-det bench-memory bench-comm bench-peer bench-profile bench-lm bench-nanogpt bench-poll bench-checkpoint bench-finetune recipes recipe-sft

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(if $(TORCH_INDEX),$(BIN)/python -m pip install -q torch torchvision --index-url $(TORCH_INDEX))
	$(BIN)/python -m pip install -q -e '.[dev,timm,slurm,lm,hf,optuna,mlflow,wandb,det,s3]'
	touch $(STAMP)

install: $(STAMP)  ## create .venv and install the project with its dev tools and every optional extra (timm, submitit, tokenizers, transformers, optuna, mlflow, wandb, faster-coco-eval, s3fs); TORCH_INDEX=URL: torch for your CUDA

train: $(STAMP)  ## train on the embedded digits with NPROC (default 2) processes; ARGS= for overrides
	$(BIN)/torchrun --standalone --nproc_per_node=$(NPROC) train.py $(ARGS)

test: $(STAMP)  ## run the whole test suite (one test file per CPU at a time)
	$(BIN)/python -m pytest -n auto --dist loadfile $(ARGS)

test-fast: $(STAMP)  ## the unit and config tests and the docs build (about a minute): the inner loop
	$(BIN)/python -m pytest -n auto $(wildcard tests/test_*units.py) tests/test_config.py tests/test_docs.py -k "not runs_as_written" $(ARGS)

docs: $(STAMP)  ## build the documentation site into site/ (mkdocs build --strict: a broken link fails)
	$(BIN)/mkdocs build --strict

bench: $(STAMP)  ## speed: tutorial loop vs train.py vs raw bound on the CPU (a few minutes)
	$(BIN)/python bench/bench.py --device cpu

bench-gpu: $(STAMP)  ## the same on a CUDA GPU, plus bf16 and torch.compile
	$(BIN)/python bench/bench.py --device cuda

gpu-check: $(STAMP)  ## on a CUDA machine: every GPU-only check and bench-gpu, one table, within 10 min (docs/gpus.md); fails where torch cannot use the GPUs
	$(BIN)/python bench/gpu_check.py

bench-data: $(STAMP)  ## input pipeline: image folder of JPEGs, train.py vs the references' loader
	$(BIN)/python -c "import skimage" 2>/dev/null || $(BIN)/python -m pip install -q -e '.[bench]'
	$(BIN)/python bench/bench_data.py

bench-seg: $(STAMP)  ## segmentation input pipeline: data=segfolder vs the segmentation references' (a few minutes)
	$(BIN)/python -c "import skimage" 2>/dev/null || $(BIN)/python -m pip install -q -e '.[bench]'
	$(BIN)/python bench/bench_seg.py $(ARGS)

bench-shards: $(STAMP)  ## sharded data: input-pipeline images/s of an image folder vs local and S3 tar shards, PNG and decoded (~5 min)
	$(BIN)/python bench/bench_shards.py $(ARGS)

bench-peer: $(STAMP)  ## whole runs: train.py vs torchvision's references/classification/train.py (REFERENCES=DIR, a checkout), 3 pairs (~8 min)
	@test -n "$(REFERENCES)" || { echo "make bench-peer REFERENCES=DIR: DIR is a checkout of github.com/pytorch/vision"; exit 2; }
	$(BIN)/python bench/peer.py --references $(REFERENCES) $(ARGS)

bench-profile: $(STAMP)  ## one run of each side under torch.profiler and py-spy (bench/results/profile)
	test -x $(BIN)/py-spy || $(BIN)/python -m pip install -q -e '.[bench]'
	@test -n "$(REFERENCES)" || { echo "make bench-profile REFERENCES=DIR: DIR is a checkout of github.com/pytorch/vision"; exit 2; }
	$(BIN)/python bench/peer.py --references $(REFERENCES) --profile=50 $(ARGS)

bench-det: $(STAMP)  ## detection: images/s of experiment=digits_detection vs a loop written as torchvision's detection reference writes it (~5 min)
	$(BIN)/python bench/bench_det.py $(ARGS)

bench-memory: $(STAMP)  ## memory a rank: ddp vs fsdp2 (and activation checkpointing) at world size 2, and ddp, fsdp2, HSDP 2x2 at 4, on the GPT recipes (~20 min)
	$(BIN)/python bench/bench_memory.py $(ARGS)

bench-comm: $(STAMP)  ## DDP's gradient compression hooks (trainer.ddp.comm_hook): bytes a step and tokens/s on lm_char (~4 min)
	$(BIN)/python bench/bench_comm.py $(ARGS)

bench-lm: $(STAMP)  ## language model: tokens/s of experiment=lm_char vs a plain DDP loop (~5 min)
	$(BIN)/python bench/bench_lm.py $(ARGS)

bench-nanogpt: $(STAMP)  ## language model: whole runs of nanoGPT's train.py (NANOGPT=DIR, a checkout) vs experiment=lm_char (~12 min)
	@test -n "$(NANOGPT)" || { echo "make bench-nanogpt NANOGPT=DIR: DIR is a checkout of github.com/karpathy/nanoGPT"; exit 2; }
	$(BIN)/python bench/nanogpt.py --nanogpt $(NANOGPT) $(ARGS)

bench-poll: $(STAMP)  ## the stop poll's cost a step at world sizes 2, 8, 16, 32 on gloo, every step vs trainer.stop_poll_s (~5 min)
	$(BIN)/python bench/bench_poll.py $(ARGS)

bench-checkpoint: $(STAMP)  ## checkpoint saves: the step blocked, sync vs async, local vs S3, GPT-2 124M fsdp2 and ResNet-50 ddp; upload vs boto3 (~10 min)
	$(BIN)/python -c "import boto3" 2>/dev/null || $(BIN)/python -m pip install -q -e '.[bench,s3]'
	$(BIN)/python bench/bench_checkpoint.py $(ARGS)

bench-finetune: $(STAMP)  ## fine-tuning a GPT-2-124M-sized HF model: full vs LoRA, ddp vs fsdp2, vs a plain transformers loop; tokens/s and memory a rank (~10 min)
	$(BIN)/python bench/bench_finetune.py $(ARGS)

recipes: $(STAMP)  ## the recipes' accuracy over 3 held-out slices x 3 seeds x 3 lrs (~30 min)
	$(BIN)/python bench/recipes.py

recipe-sft: $(STAMP)  ## the fine-tuning recipe's exact-match range: full and LoRA, 3 data splits x 3 seeds (~10 min)
	$(BIN)/python bench/recipe_sft.py $(ARGS)

lint: $(STAMP)  ## ruff check and format check
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)  ## apply ruff's fixes and formatting
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

clean:  ## remove the venv, caches and run outputs
	rm -rf $(VENV) outputs multirun .pytest_cache .ruff_cache *.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
