"""model=hf model.pretrained=FOLDER: someone else's model folder, made here with
``save_pretrained`` (a tiny Llama and a tiny GPT-2), read without the network, locally or
from a URL through the node's cache; the logits are transformers' own; each missing file is
named."""

from __future__ import annotations

import itertools

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ddp_utils.config import ConfigError  # noqa: E402
from ddp_utils.models.zoo import hf_causal_lm  # noqa: E402

VOCAB = 64
_urls = itertools.count()


def tiny(kind: str):
    torch.manual_seed(0)
    if kind == "llama":
        config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                          num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2,
                                          max_position_embeddings=64)  # fmt: skip
    else:
        config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                                         n_positions=64)  # fmt: skip
    return transformers.AutoModelForCausalLM.from_config(config)


@pytest.fixture(params=["llama", "gpt2"])
def folder(request, tmp_path):
    model = tiny(request.param)
    model.save_pretrained(tmp_path / request.param)
    return tmp_path / request.param, model


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_a_model_folder_gives_transformers_own_logits(folder):
    path, original = folder
    ours = hf_causal_lm("ignored", VOCAB, 16, pretrained=str(path))
    ids = torch.randint(0, VOCAB, (2, 16))
    assert torch.equal(ours(ids), logits(original.eval(), ids))
    # What the export hands transformers is the folder's own model back
    name, kwargs, state = ours.hf_export()
    again = transformers.AutoModelForCausalLM.from_config(getattr(transformers, name)(**kwargs))
    again.load_state_dict(state)
    assert torch.equal(logits(again.eval(), ids), logits(original, ids))


def test_a_folder_at_a_url_is_downloaded_once_into_the_nodes_cache(folder, tmp_path, monkeypatch):
    import fsspec

    path, original = folder
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    url = f"memory://models-{next(_urls)}/{path.name}"
    fs = fsspec.filesystem("memory")
    for f in path.iterdir():
        fs.put_file(str(f), f"{url[len('memory://') :]}/{f.name}")
    ours = hf_causal_lm("ignored", VOCAB, 16, pretrained=url)
    ids = torch.randint(0, VOCAB, (1, 8))
    assert torch.equal(ours(ids), logits(original.eval(), ids))
    cached = list((tmp_path / "cache" / "ddp-recipes" / "models").glob(f"*-{path.name}"))
    assert len(cached) == 1 and (cached[0] / "config.json").is_file()


def test_each_missing_piece_of_a_model_folder_is_named(folder, tmp_path):
    path, _ = folder
    with pytest.raises(ConfigError, match="no such folder"):
        hf_causal_lm("gpt2", VOCAB, 16, pretrained=str(tmp_path / "nothing"))
    for weights in path.glob("*.safetensors"):
        weights.unlink()
    with pytest.raises(ConfigError, match="has config.json but no weights"):
        hf_causal_lm("gpt2", VOCAB, 16, pretrained=str(path))
    (path / "config.json").unlink()
    with pytest.raises(ConfigError, match="has no config.json"):
        hf_causal_lm("gpt2", VOCAB, 16, pretrained=str(path))


@pytest.mark.parametrize("vocab", [VOCAB - 1, VOCAB + 1])
def test_data_of_another_vocabulary_is_refused(folder, vocab):
    path, _ = folder
    with pytest.raises(ConfigError, match=f"data.vocab_size={vocab}, but .* has {VOCAB} tokens"):
        hf_causal_lm("gpt2", vocab, 16, pretrained=str(path))


def test_no_network_is_attempted(folder, monkeypatch):
    """transformers offline: a folder that loads needs nothing from the Hub."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path, _ = folder
    assert hf_causal_lm("gpt2", VOCAB, 16, pretrained=str(path)) is not None


def test_the_key_composes_and_is_part_of_the_runs_identity():
    from helpers.runs import compose_config

    from ddp_utils.checkpoint.resume import identity_keys

    cfg = compose_config("model=hf", "model.pretrained=/models/llama")
    assert cfg.model.pretrained == "/models/llama"
    assert any("model.pretrained".startswith(k) for k in identity_keys(cfg))
