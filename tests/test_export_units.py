"""python -m ddp_utils.checkpoint export: a checkpoint as a consolidated torch file, a
safetensors file, and (the GPT) a Hugging Face folder that transformers loads."""

from __future__ import annotations

import json

import pytest
import torch

from ddp_utils.checkpoint import load_checkpoint
from ddp_utils.checkpoint.export import main
from ddp_utils.config import (
    ConfigError,
    GPTModel,
    LanguageModelTask,
    TokenData,
    TrainConfig,
    as_plain_dict,
)
from ddp_utils.models import build_model


def gpt_checkpoint(tmp_path, bias: bool) -> tuple[torch.nn.Module, dict, object]:
    cfg = TrainConfig(model=GPTModel(n_layer=2, n_head=2, n_embd=32, bias=bias),
                      data=TokenData(root="corpus", num_classes=50, block_size=16),
                      task=LanguageModelTask())  # fmt: skip
    torch.manual_seed(0)
    model = build_model(cfg.model, cfg.data)
    with torch.no_grad():  # biases away from zero, so that a mix-up of them shows
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    record = as_plain_dict(cfg)
    path = tmp_path / "last.pt"
    torch.save({"model": model.state_dict(), "optimizer": {"state": {}}, "step": 7,
                "config": record}, path)  # fmt: skip
    return model.eval(), record, path


@pytest.mark.parametrize("bias", [False, True])
def test_the_gpts_hugging_face_folder_gives_the_same_logits_in_transformers(tmp_path, bias):
    import transformers

    model, record, path = gpt_checkpoint(tmp_path, bias)
    assert main(["export", str(path), str(tmp_path / "hf"), "--format", "hf"]) == 0
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokens = torch.randint(0, 50, (3, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens).logits, model(tokens), atol=1e-5, rtol=1e-5)
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    saved = json.loads((tmp_path / "hf" / "ddp_recipes.json").read_text())
    assert saved["config"] == record


def test_safetensors_holds_the_weights_and_the_runs_config(tmp_path):
    from safetensors import safe_open

    model, record, path = gpt_checkpoint(tmp_path, bias=False)
    out = tmp_path / "model.safetensors"
    assert main(["export", str(path), str(out), "--format", "safetensors"]) == 0
    with safe_open(out, "pt") as f:
        assert json.loads(f.metadata()["config"]) == record
        weights = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open's API
    own = model.state_dict()
    assert weights.keys() == own.keys()
    assert all(torch.equal(weights[k], own[k]) for k in own)


def test_torch_export_of_a_whole_file_leaves_the_optimizer_behind(tmp_path):
    model, _, path = gpt_checkpoint(tmp_path, bias=False)
    out = tmp_path / "whole.pt"
    assert main(["export", str(path), str(out)]) == 0
    ckpt = load_checkpoint(out)
    assert "optimizer" not in ckpt and ckpt["converted_from"] == str(path)
    assert all(torch.equal(ckpt["model"][k], v) for k, v in model.state_dict().items())


def test_a_model_without_a_hugging_face_layout_is_named_with_the_formats_it_has(tmp_path, capsys):
    torch.save({"model": build_model(TrainConfig().model, TrainConfig().data).state_dict(),
                "config": as_plain_dict(TrainConfig())}, tmp_path / "cnn.pt")  # fmt: skip
    assert main(["export", str(tmp_path / "cnn.pt"), str(tmp_path / "hf"), "--format", "hf"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: model=convnet declares no Hugging Face layout")
    assert "--format torch or --format safetensors" in err
    assert not (tmp_path / "hf").exists()
    with pytest.raises(ConfigError, match="--ema is for --format safetensors and hf"):
        from ddp_utils.checkpoint.export import export

        export(tmp_path / "cnn.pt", tmp_path / "x.pt", "torch", ema=True)
