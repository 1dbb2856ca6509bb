"""Language models in one process: tokenizers, prepare_text, token windows, the GPT, the task,
the optimiser's decay groups, the recipes' configs and the data mistakes."""

from __future__ import annotations

import json
import math
from collections import Counter

import numpy as np
import pytest
import torch
from helpers.launch import run_forked
from helpers.runs import compose_config
from lm_data import split_into_shards, write_token_folder

from ddp_utils.config import ConfigError, PyStdlibData, TokenData
from ddp_utils.data import resolve_data as resolve_tokens
from ddp_utils.data.samplers import IGNORE_LABEL, EvalShardSampler, ResumableDistributedSampler
from ddp_utils.data.text import pystdlib
from ddp_utils.data.text.tokenizer import ByteTokenizer, CharTokenizer, from_spec, train_bpe
from ddp_utils.data.text.tokens import WindowLoader, eval_windows, read_meta, train_windows
from ddp_utils.dist import Runtime
from ddp_utils.models import build_model
from ddp_utils.models.gpt import GPT
from ddp_utils.optim import param_groups
from ddp_utils.prepare_text import main as prepare_text
from ddp_utils.tasks import build_task, check_task
from ddp_utils.tasks.base import Batch
from ddp_utils.tasks.language_model import BitsPerByte, LanguageModel
from ddp_utils.train.state import split_global_batch

RT = Runtime(0, 0, 1, 1, torch.device("cpu"), "gloo")


def tokens_cfg(root, **kw) -> TokenData:
    return resolve_tokens(TokenData(root=str(root), **kw), RT)


def test_tokenizers_round_trip_and_a_char_vocabulary_names_what_it_lacks():
    char = CharTokenizer("hello world")
    assert char.decode(char.encode("low")) == "low" and char.vocab_size == 8
    with pytest.raises(ValueError, match="'z'"):
        char.encode("lazy")
    text = "naïve — ok"
    assert ByteTokenizer().decode(ByteTokenizer().encode(text)) == text
    bpe = train_bpe(["def f(x):\n    return x\n"] * 50, vocab_size=300)
    again = from_spec(bpe.spec())
    assert again.decode(again.encode("def f(x):")) == "def f(x):"
    assert sum(bpe.token_bytes()[i] for i in bpe.encode("return x")) == len("return x")


def test_prepare_text_splits_off_the_last_tenth_and_refuses_empty_or_binary_input(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    (src / "b.txt").write_text("b" * 49 + "\n")
    (src / "a.txt").write_text("a" * 49)  # no final newline: one is added
    assert prepare_text([str(tmp_path / "out"), str(src)]) == 0
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    train = np.fromfile(tmp_path / "out" / "train.bin", dtype=np.uint16)
    val = np.fromfile(tmp_path / "out" / "val.bin", dtype=np.uint16)
    assert (len(train), len(val)) == (90, 10) and meta["vocab_size"] == 3  # \n a b
    assert CharTokenizer(meta["tokenizer"]["chars"]).decode(val) == "b" * 9 + "\n"
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01\x02")
    for bad, said in (("empty.txt", "the sources are empty"), ("blob.bin", "is binary")):
        assert prepare_text([str(tmp_path / f"out_{bad}"), str(tmp_path / bad)]) == 2
        printed = capsys.readouterr().err.splitlines()
        assert len(printed) == 1 and printed[0].startswith("error: ") and said in printed[0]
    assert not (tmp_path / "out_blob.bin" / "meta.json").exists()


@pytest.mark.parametrize("n", [25, 1115394])  # int(n * 0.9) and n - round(n * 0.1) differ
def test_prepare_text_char_split_is_byte_identical_to_nanogpts(tmp_path, n):
    text = ("First Citizen:\nBefore we proceed any further, hear me speak." * (n // 50 + 1))[:n]
    (tmp_path / "input.txt").write_text(text)  # no final newline: none is added to one file
    assert prepare_text([str(tmp_path / "out"), str(tmp_path / "input.txt")]) == 0
    # nanoGPT's data/shakespeare_char/prepare.py, as its README describes the rule.
    chars = sorted(set(text))
    ids = np.array([chars.index(c) for c in text], dtype=np.uint16)
    cut = int(n * 0.9)
    assert (tmp_path / "out" / "train.bin").read_bytes() == ids[:cut].tobytes()
    assert (tmp_path / "out" / "val.bin").read_bytes() == ids[cut:].tobytes()


def test_prepare_text_refuses_to_overwrite_a_prepared_folder(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("abc\n" * 30)
    (tmp_path / "b.txt").write_text("xyz xyz\n" * 30)
    out = tmp_path / "out"
    assert prepare_text([str(out), str(tmp_path / "a.txt")]) == 0
    before = (out / "train.bin").read_bytes()
    capsys.readouterr()
    assert prepare_text([str(out), str(tmp_path / "b.txt")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and f"{out} already holds prepared files" in err[0]
    assert "--overwrite" in err[0] and (out / "train.bin").read_bytes() == before
    assert prepare_text([str(out), str(tmp_path / "b.txt"), "--overwrite"]) == 0
    assert (out / "train.bin").read_bytes() != before


def test_prepare_text_bpe_writes_its_tokenizer_beside_the_data(tmp_path):
    (tmp_path / "t.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    assert prepare_text([str(tmp_path / "o"), str(tmp_path / "t.txt"), "--tokenizer=bpe",
                         "--vocab_size=300"]) == 0  # fmt: skip
    cfg = tokens_cfg(tmp_path / "o")
    meta = read_meta(cfg)
    assert (tmp_path / "o" / "tokenizer.json").is_file() and meta.tokenizer["kind"] == "bpe"
    assert cfg.vocab_size == cfg.num_classes == from_spec(meta.tokenizer).vocab_size


def test_an_epoch_covers_the_tokens_once_and_every_offset_comes_in_block_size_epochs(tmp_path):
    cfg = tokens_cfg(write_token_folder(tmp_path, 1000, 200), block_size=8)
    windows = train_windows(cfg, seed=3)
    assert len(windows) == (1000 - 8) // 8
    offsets = [windows.offset(e) for e in range(8)]
    assert sorted(offsets) == list(range(8))
    sampler = ResumableDistributedSampler(len(windows), 2, 1, seed=3)
    loader = WindowLoader(windows, sampler, 5, torch.device("cpu"))
    sampler.set_epoch(2)
    tokens = np.fromfile(tmp_path / "train.bin", dtype=np.uint16).astype(np.int64)
    order = list(sampler)
    rows = [tokens[offsets[2] + 8 * (i if i >= 0 else ~i) :][:9] for i in order]
    batches = list(loader)
    assert len(batches) == len(loader) == math.ceil(len(order) / 5)
    x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    assert torch.equal(x, torch.from_numpy(np.stack(rows)[:, :8]))
    real = torch.tensor(order) >= 0
    assert torch.equal(y[real], torch.from_numpy(np.stack(rows)[:, 1:])[real])
    assert (y[~real] == IGNORE_LABEL).all()
    # Both ranks together: every window once, the padding ignored.
    seen = Counter()
    for rank in (0, 1):
        s = ResumableDistributedSampler(len(windows), 2, rank, seed=3)
        s.set_epoch(2)
        seen.update(i for i in s if i >= 0)
    assert seen == Counter(range(len(windows)))


def test_validation_windows_are_non_overlapping_and_split_exactly_over_ranks(tmp_path):
    cfg = tokens_cfg(write_token_folder(tmp_path, 500, 16 * 7 + 1), block_size=16)
    val = eval_windows(cfg, "val")
    assert len(val) == 7 and list(val.starts(np.arange(7), epoch=5)) == list(range(0, 112, 16))
    for ws in (1, 2, 3):
        shards = [list(EvalShardSampler(len(val), ws, r)) for r in range(ws)]
        assert sorted(sum(shards, [])) == list(range(7))


@pytest.mark.parametrize("case", ["no_meta", "dtype", "bad_id", "block", "too_small_vocab"])
def test_data_mistakes_name_the_file_and_the_fix(tmp_path, case):
    root = write_token_folder(tmp_path / "d", 400, 40, meta=case not in ("no_meta",))
    kw = {}
    if case == "no_meta":
        (root / "meta.pkl").write_bytes(b"never read")
        match = "meta.pkl is never unpickled"
    elif case == "dtype":
        (root / "meta.json").write_text(json.dumps({"vocab_size": 30, "dtype": "float32"}))
        match = "dtype 'float32'"
    elif case == "bad_id":
        ids = np.fromfile(root / "train.bin", dtype=np.uint16)
        ids[123] = 999
        ids.tofile(root / "train.bin")
        match = "token id 999 at position 123"
    elif case == "block":
        kw, match = {"block_size": 64}, "data.block_size=64 is larger than the val file"
    else:
        kw, match = {"vocab_size": 5}, "data.vocab_size=5 is smaller"
    with pytest.raises(ConfigError, match=match):
        cfg = resolve_tokens(TokenData(root=str(root), **kw), RT)
        train_windows(cfg, 0), eval_windows(cfg, "val")
    if case == "no_meta":  # with the vocabulary given, a nanoGPT folder works
        cfg = TokenData(root=str(root), vocab_size=30, block_size=16)
        assert resolve_tokens(cfg, RT).num_classes == 30


def test_an_id_past_the_sampled_part_is_named_when_its_window_is_read(tmp_path):
    root = write_token_folder(tmp_path, 4000, 100)
    ids = np.fromfile(root / "train.bin", dtype=np.uint16)
    ids[3001] = 77
    ids.tofile(root / "train.bin")
    cfg = resolve_tokens(TokenData(root=str(root), block_size=10, check_tokens=100), RT)
    windows = train_windows(cfg, 0)  # the sample missed it
    loader = WindowLoader(windows, range(len(windows)), 50, torch.device("cpu"))
    with pytest.raises(ConfigError, match="token id 77 at position 3001"):
        list(loader)


def test_bad_data_is_one_paragraph_and_exit_2_from_train_py(tmp_path):
    root = write_token_folder(tmp_path / "d", 400, 40)
    (root / "meta.json").write_text(json.dumps({"vocab_size": 30, "dtype": "int8"}))
    proc = run_forked("train.py", "experiment=lm_char", "data=tokens", f"data.root={root}",
                      f"run_dir={tmp_path}/run")  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.count("error: ") == 1 and "dtype 'int8'" in proc.stderr
    assert not (tmp_path / "run").exists()


def test_gpt_is_causal_tied_and_initialised_as_gpt2():
    torch.manual_seed(0)
    model = GPT(vocab_size=50, block_size=16, n_layer=3, n_head=2, n_embd=32).eval()
    x = torch.randint(50, (2, 16))
    y = x.clone()
    y[:, 10:] = (y[:, 10:] + 1) % 50
    assert model(x).shape == (2, 16, 50)
    assert torch.allclose(model(x)[:, :10], model(y)[:, :10], atol=1e-6)  # no peeking ahead
    assert model.lm_head.weight is model.wte.weight
    std = model.blocks[0].attn.proj.weight.std().item()
    assert abs(std - 0.02 / math.sqrt(6)) < 0.002 and abs(model.wte.weight.std() - 0.02) < 0.002
    with pytest.raises(ConfigError, match="model.n_embd=100 is not divisible by model.n_head=3"):
        compose_config("experiment=lm_char", "model.n_embd=100", "model.n_head=3")


def test_adamw_decays_2d_weights_only():
    cfg = compose_config("experiment=lm_char")
    model = GPT(vocab_size=20, block_size=8, n_layer=1, n_head=2, n_embd=8, bias=True)
    groups = {g["weight_decay"]: g["params"] for g in param_groups(cfg.optim, model)}
    assert set(groups) == {0.1, 0.0}
    assert all(p.ndim >= 2 for p in groups[0.1]) and all(p.ndim == 1 for p in groups[0.0])
    n = sum(p.numel() for ps in groups.values() for p in ps)
    assert n == sum(p.numel() for p in model.parameters())  # the tied matrix once


def test_the_task_sums_over_real_tokens_and_bits_per_byte_counts_bytes():
    task = LanguageModel(vocab_size=4, block_size=3, token_bytes=[1, 1, 2, 3])
    logits = torch.zeros(2, 3, 4)  # uniform: ln 4 nats per token
    target = torch.tensor([[0, 2, 3], [IGNORE_LABEL] * 3])

    def model(x):
        return logits

    loss, count = task.train_loss(model, Batch(torch.zeros(2, 3, dtype=torch.long), target))
    assert count == 3 and torch.isclose(loss, torch.tensor(3 * math.log(4)))
    bpb = BitsPerByte([1, 1, 2, 3], 4)
    bpb.update(logits, target)
    assert torch.isclose(bpb.compute(), torch.tensor(3 * 2 / 6, dtype=torch.float64))


def test_lm_char_recipe_and_gpt2_124m_compose_with_their_shapes():
    c = compose_config("experiment=lm_char")
    assert (c.model.n_layer, c.model.n_head, c.model.n_embd, c.model.dropout) == (4, 4, 128, 0.0)
    assert (c.data.name, c.data.block_size, c.data.global_batch_size) == ("pystdlib", 64, 24)
    assert c.data.eval_batch_size == 64  # measured fastest for one exact validation
    assert (c.trainer.max_steps, c.optim.lr, c.sched.min_lr, c.optim.betas[1]) == (
        2000, 1e-3, 1e-4, 0.99)  # fmt: skip
    assert (c.sched.warmup_steps, c.trainer.grad_clip, c.task.monitor) == (100, 1.0, "loss")
    g = compose_config("experiment=gpt2_124m")
    assert (g.model.n_layer, g.model.n_head, g.model.n_embd, g.data.block_size) == (
        12, 12, 768, 1024)  # fmt: skip
    assert g.data.global_batch_size * g.data.block_size == 491_520  # ~0.5M tokens a step
    assert split_global_batch(g.data.global_batch_size, 8, g.data.batch_size) == (12, 5)
    model = build_model(g.model, TokenData(block_size=1024, num_classes=50304))
    assert 123e6 < sum(p.numel() for p in model.parameters()) < 125e6


def test_custom_and_hf_models_take_ids_to_logits_and_pass_the_check(tmp_path):
    root = write_token_folder(tmp_path, 400, 40)
    overrides = {
        "custom": ("model=custom", "model._target_=custom_models.BigramLM"),
        "hf": ("model=hf", "+model.overrides={n_layer: 1, n_head: 2, n_embd: 16}"),
    }
    pytest.importorskip("transformers")
    for option, extra in overrides.items():
        cfg = compose_config("experiment=lm_char", "data=tokens", f"data.root={root}",
                             "data.block_size=8", *extra)  # fmt: skip
        import dataclasses

        cfg = dataclasses.replace(cfg, data=resolve_tokens(cfg.data, RT))
        task = build_task(cfg)
        model = build_model(cfg.model, cfg.data)
        from ddp_utils.evaluation import build_metrics

        check_task(task, model, build_metrics(cfg.task, task, RT.device), cfg, RT.device)
        assert model(torch.zeros(2, 8, dtype=torch.long)).shape == (2, 8, 30), option


def test_pystdlib_lists_sorted_sources_without_tests_and_prepares_once(tmp_path, monkeypatch):
    stdlib, files = pystdlib.stdlib_files()
    rel = [p.relative_to(stdlib).as_posix() for p in files]
    assert rel == sorted(rel) and "os.py" in rel and not any("/test/" in f"/{r}" for r in rel)
    monkeypatch.setattr(pystdlib, "stdlib_files", lambda: (stdlib, files[:5]))
    cfg = PyStdlibData(root=str(tmp_path / "c"))
    pystdlib.prepare_pystdlib(cfg)
    first = (tmp_path / "c" / "train.bin").stat().st_mtime_ns
    resolved = resolve_tokens(cfg, RT)  # prepared already: reused
    assert (tmp_path / "c" / "train.bin").stat().st_mtime_ns == first
    assert resolved.num_classes == json.loads((tmp_path / "c" / "meta.json").read_text())[
        "vocab_size"]  # fmt: skip
    # A cache cut by the former split rule (its key had no split version) is written again.
    meta = json.loads((tmp_path / "c" / "meta.json").read_text())
    meta["source"] = meta["source"].rsplit("-split", 1)[0]
    (tmp_path / "c" / "meta.json").write_text(json.dumps(meta))
    pystdlib.prepare_pystdlib(cfg)
    assert (tmp_path / "c" / "train.bin").stat().st_mtime_ns != first
    assert json.loads((tmp_path / "c" / "meta.json").read_text())["source"].endswith("-split2")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="nothing there was changed"):
        pystdlib.prepare_pystdlib(PyStdlibData(root=str(tmp_path / "mine")))
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_pairing_mistakes_name_the_recipe():
    with pytest.raises(ConfigError, match="holds token ids.*experiment=lm_char"):
        compose_config("data=pystdlib")
    with pytest.raises(ConfigError, match="task=language_model needs token data"):
        compose_config("task=language_model")


def test_token_shards_read_as_one_stream_give_the_single_files_batches(tmp_path):
    root = write_token_folder(tmp_path / "one", 2000, 16 * 9 + 1)
    # Uneven shards, windows across their edges, one with llm.c's header.
    shards = split_into_shards(root, tmp_path / "many", [7, 700, 701, 1500], llmc=2)
    one, many = tokens_cfg(root, block_size=16), tokens_cfg(shards, block_size=16)
    for epoch in (0, 3):
        want, got = (train_windows(c, seed=5) for c in (one, many))
        assert len(got) == len(want) == 124
        index = np.arange(len(want))
        rows = got.file.windows(got.starts(index, epoch), 17)
        assert np.array_equal(rows, want.file.windows(want.starts(index, epoch), 17))
    val = eval_windows(many, "val")
    assert np.array_equal(val.file.span(0, len(val.file)),
                          np.fromfile(root / "val.bin", dtype=np.uint16))  # fmt: skip


def test_a_bad_id_in_a_token_shard_names_the_shard_and_its_position(tmp_path):
    root = write_token_folder(tmp_path / "one", 2000, 200)
    shards = split_into_shards(root, tmp_path / "many", [1000])
    ids = np.fromfile(shards / "train" / "part-001.bin", dtype=np.uint16)
    ids[40] = 999
    ids.tofile(shards / "train" / "part-001.bin")
    with pytest.raises(ConfigError, match=r"part-001.bin holds token id 999 at position 40"):
        tokens_cfg(shards, block_size=16)
    (tmp_path / "empty" / "train").mkdir(parents=True)
    (tmp_path / "empty" / "meta.json").write_text((root / "meta.json").read_text())
    with pytest.raises(ConfigError, match=r"no .*/train/\*.bin shards"):
        tokens_cfg(tmp_path / "empty", block_size=16)


def test_gpt_attention_under_cpu_bf16_autocast_runs_in_fp32_and_returns_bf16():
    """The CPU's flash attention backward is slow in bf16: the GPT computes it in fp32 and
    hands bf16 back, so its output and gradients are fp32 attention's, rounded."""
    from ddp_utils.models.gpt import attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8, dtype=torch.bfloat16, requires_grad=True) for _ in "qkv")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = attention(q, k, v, 0.0)
    y.float().sum().backward()
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    want = torch.nn.functional.scaled_dot_product_attention(q32, k32, v32, is_causal=True)
    want.sum().backward()
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), want, atol=1e-2, rtol=1e-2)
    for got, ref in ((q.grad, q32.grad), (k.grad, k32.grad), (v.grad, v32.grad)):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=2e-2)


def test_an_empty_prompt_suggests_what_a_shell_passes_on():
    from ddp_utils.data.text.tokenizer import from_spec
    from ddp_utils.generation import encode_prompt

    tokenizer = from_spec({"kind": "char", "chars": sorted("def \n")})
    with pytest.raises(ConfigError) as e:
        encode_prompt(tokenizer, "")
    assert "leave prompt out" in str(e.value) and "\\n" not in str(e.value)
    assert encode_prompt(tokenizer, "def ") == tokenizer.encode("def ").tolist()
