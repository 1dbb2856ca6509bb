"""A pretrained model folder trained by train.py at world size 2, under ddp and under fsdp2
(whose other ranks build on the meta device and take the main rank's weights): the run
starts from the folder's own weights, and the export gives transformers the folder's
architecture with the run's weights and the base's tokenizer files."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from callbacks import dump_state
from helpers.launch import child_env, run_ranks
from helpers.paths import ROOT
from helpers.runs import params
from lm_data import write_token_folder

transformers = pytest.importorskip("transformers")


def test_a_model_folder_trains_under_ddp_and_fsdp2_from_its_own_weights(tmp_path):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=30, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2,
                                      max_position_embeddings=64)  # fmt: skip
    base = transformers.AutoModelForCausalLM.from_config(config)
    base.save_pretrained(tmp_path / "llama")
    (tmp_path / "llama" / "tokenizer_config.json").write_text('{"chat_template": "x"}')
    tokens = write_token_folder(tmp_path / "tokens", 4000, 400)
    expected = {f"model.{k}": v for k, v in base.state_dict().items()}
    for strategy in ("ddp", "fsdp2"):
        run = tmp_path / strategy
        run_ranks("train.py", "experiment=lm_char", "data=tokens", f"data.root={tokens}",
                  "data.block_size=16", "data.global_batch_size=4", "data.batch_size=2",
                  "data.eval_batch_size=8", "model=hf", f"model.pretrained={tmp_path / 'llama'}",
                  "trainer.max_steps=2", "trainer.val_every_steps=2", "trainer.precision=32",
                  "logger=none", "trainer.progress=false", f"trainer.strategy={strategy}",
                  f"run_dir={run}", dump_state(tmp_path / f"{strategy}.pt", optimizer=False),
                  nproc=2)  # fmt: skip
        start = torch.load(tmp_path / f"{strategy}.pt", weights_only=True)["model"]
        assert start.keys() == expected.keys(), strategy
        for key in expected:
            assert torch.equal(start[key], expected[key]), (strategy, key)
        assert not torch.equal(params(run)["model.model.norm.weight"],
                               expected["model.model.norm.weight"])  # it trained  # fmt: skip
    # The export is the folder's own architecture, with the run's weights
    out = tmp_path / "export"
    done = subprocess.run([sys.executable, "-m", "ddp_utils.checkpoint", "export",
                           str(tmp_path / "ddp" / "checkpoints" / "last.pt"), str(out),
                           "--format", "hf"], cwd=ROOT, env=child_env(), capture_output=True,
                          text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    again = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert type(again).__name__ == "LlamaForCausalLM"
    assert (out / "tokenizer_config.json").read_text() == '{"chat_template": "x"}'
    trained = params(tmp_path / "ddp")
    for key, value in again.state_dict().items():
        assert torch.equal(value, trained[f"model.{key}"]), key
