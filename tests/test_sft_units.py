"""data=sft's encoding, one process: chat records are the tokenizer's own
``apply_chat_template``, only the completion / assistant tokens carry labels, the loss is a
plain transformers loop's, long records are cut or refused by data.overflow, and each bad
record is named by file and line."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from sft_data import model_folder, shift_records, tokenizer, write_jsonl  # noqa: E402

from ddp_utils.config import ConfigError, SFTData  # noqa: E402
from ddp_utils.data.samplers import IGNORE_LABEL  # noqa: E402
from ddp_utils.data.text import sft  # noqa: E402
from ddp_utils.dist import Runtime  # noqa: E402
from ddp_utils.tasks.language_model import LanguageModel  # noqa: E402

RT = Runtime(rank=0, local_rank=0, world_size=1, local_world_size=1,
             device=torch.device("cpu"), backend="gloo")  # fmt: skip


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return model_folder(tmp_path_factory.mktemp("model") / "llama")


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def families(request, tmp_path_factory):
    """A folder of each architecture family (GPT-2's learnt positions, Llama's rotary ones)."""
    return model_folder(tmp_path_factory.mktemp("model") / request.param, request.param)


def options(folder, root, tmp_path, **keys) -> SFTData:
    cfg = SFTData(root=str(root), tokenizer=str(folder), cache_dir=str(tmp_path / "cache"),
                  batch_size=4, **keys)  # fmt: skip
    cfg.check()
    return sft.resolve(cfg, RT)


def encode(folder, records, **keys):
    cfg = SFTData(root="x", tokenizer=str(folder), **keys)
    return sft.Encoder(sft.open_tokenizer(cfg), cfg).encode(
        [(f"f.jsonl:{i + 1}", r) for i, r in enumerate(records)]
    )


def test_chat_records_are_the_tokenizers_own_template_and_only_assistant_turns_are_labelled(
    folder,
):
    tok = tokenizer()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "abc"}, {"role": "user", "content": "more"},
                {"role": "assistant", "content": "de"}]  # fmt: skip
    (ids,), (labelled,) = encode(folder, [{"messages": messages}])
    assert ids.tolist() == tok.apply_chat_template(messages, tokenize=True)["input_ids"]
    text = tok.decode(ids[labelled])
    assert text == "abc<|end|>de<|end|>"  # the answers and the end of each turn, nothing else
    (_,), (every,) = encode(folder, [{"messages": messages}], train_on="all")
    assert every.all()


def test_a_template_that_rewrites_earlier_turns_is_refused_for_completions_only(folder):
    """A template that drops an earlier answer once a later turn follows (as some strip
    reasoning) has no prefix to find a turn by: refused with train_on=completion, and every
    token labelled with train_on=all, as the message says."""
    tok = sft.open_tokenizer(SFTData(root="x", tokenizer=str(folder)))
    template = tok.chat_template
    tok.chat_template = ("{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}"
                         "<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endif %}{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>{% endif %}")  # fmt: skip
    try:
        chat = [{"messages": [{"role": "user", "content": "a"},
                              {"role": "assistant", "content": "b"},
                              {"role": "user", "content": "c"},
                              {"role": "assistant", "content": "d"}]}]  # fmt: skip
        with pytest.raises(ConfigError, match="use data.train_on=all for this template"):
            encode(folder, chat)
        (_,), (every,) = encode(folder, chat, train_on="all")
        assert every.all()
    finally:
        tok.chat_template = template


def test_a_completion_is_labelled_with_its_end_of_sequence_and_the_prompt_is_not(folder):
    tok = tokenizer()
    (ids,), (labelled,) = encode(folder, [{"prompt": "shift abc =", "completion": " bcd"}])
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id
    assert tok.decode(ids[labelled]) == " bcd</s>"
    assert not labelled[: len(tok("shift abc =")["input_ids"])].any()


def test_the_loss_is_a_plain_transformers_loops_and_prompt_labels_do_not_count(families, tmp_path):
    folder = families
    records = shift_records(12, seed=0) + shift_records(5, seed=1, chat=True)
    cfg = options(folder, write_jsonl(tmp_path / "d" / "train.jsonl", records), tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    task = LanguageModel(cfg.vocab_size, cfg.max_length)
    data = sft.build(cfg, RT, 0, False)
    total, count = 0.0, 0
    with torch.no_grad():
        for x, y in data.val:
            total += float(task.loss_sum(model(input_ids=x).logits, y))
            count += int((y != IGNORE_LABEL).sum())
        # transformers' own: each record alone, labels -100 but on the completion
        records_ = sft.Records(sft.prepared(cfg) / "val.npz")
        theirs, n = 0.0, 0
        for i in range(len(records_)):
            ids, labelled = records_.row(i)
            ids = ids.astype(np.int64)
            labels = torch.from_numpy(np.where(labelled, ids, -100))[None]
            out = model(input_ids=torch.from_numpy(ids)[None], labels=labels)
            k = int((labels[0, 1:] != -100).sum())
            theirs, n = theirs + float(out.loss) * k, n + k
    assert count == n and total == pytest.approx(theirs, rel=1e-5)
    # A prompt token's label, changed, changes nothing: it carries the ignore label
    x, y = next(iter(data.val))
    prompt = (y[0] == IGNORE_LABEL).nonzero()[0]
    logits = model(input_ids=x).logits
    assert torch.equal(task.loss_sum(logits, y), task.loss_sum(logits, y))
    changed = y.clone()
    changed[0, prompt] = IGNORE_LABEL  # already so: the label a prompt token would have is gone
    assert torch.equal(changed, y)


def test_batches_pad_on_the_right_and_padding_markers_carry_no_label(folder, tmp_path):
    cfg = options(folder, write_jsonl(tmp_path / "d" / "train.jsonl", shift_records(20, 0)),
                  tmp_path)  # fmt: skip
    records = sft.Records(sft.prepared(cfg) / "train.npz")
    loader = sft.RecordLoader(records, [0, 1, ~2], 3, torch.device("cpu"), pad_id=0)
    x, y = loader.batch(np.array([0, 1, ~2]))
    assert x.shape[1] == max(len(records.row(i)[0]) for i in range(3)) - 1
    assert (y[2] == IGNORE_LABEL).all() and (y[:2] != IGNORE_LABEL).any()


def test_one_file_is_split_by_val_fraction_and_parquet_reads_as_jsonl(folder, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = shift_records(40, 0)
    one = options(folder, write_jsonl(tmp_path / "a.jsonl", records), tmp_path, val_fraction=0.25)
    train, val = (sft.Records(sft.prepared(one) / f"{s}.npz") for s in ("train", "val"))
    assert (len(train), len(val)) == (30, 10)
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "a.parquet")
    two = options(folder, tmp_path / "a.parquet", tmp_path, val_fraction=0.25)
    assert np.array_equal(sft.Records(sft.prepared(two) / "val.npz").ids, val.ids)


def test_long_records_are_cut_and_counted_or_refused_by_name(folder, tmp_path, capsys):
    root = write_jsonl(tmp_path / "d" / "train.jsonl", shift_records(8, 0))
    cut = options(folder, root, tmp_path, max_length=10)
    assert "8 records cut to data.max_length=10" in capsys.readouterr().out
    assert max(np.diff(sft.Records(sft.prepared(cut) / "train.npz").offsets)) == 10
    with pytest.raises(ConfigError, match=r"train.jsonl:\d+ has \d+ tokens, more than data.max"):
        options(folder, root, tmp_path, max_length=10, overflow="error")


@pytest.mark.parametrize("record, says", [
    ({"question": "a", "answer": "b"}, r"f.jsonl:1: a record is .* this one has \['answer'"),
    ({"prompt": "a", "completion": "  "}, r"f.jsonl:1: the completion is empty"),
    ({"messages": [{"role": "user", "content": "a"}]}, r"f.jsonl:1: the chat has no assistant"),
])  # fmt: skip
def test_a_bad_record_is_named_by_file_and_line(folder, record, says):
    with pytest.raises(ConfigError, match=says):
        encode(folder, [record])


def test_chat_records_without_a_chat_template_and_folders_without_a_tokenizer_are_named(
    tmp_path,
):
    plain = model_folder(tmp_path / "plain", chat=False)
    with pytest.raises(ConfigError, match="f.jsonl:1 is a chat record, but data.tokenizer=.* "
                                          "has no chat template"):  # fmt: skip
        encode(plain, shift_records(1, 0, chat=True))
    (plain / "tokenizer.json").unlink()
    (plain / "tokenizer_config.json").unlink()
    with pytest.raises(ConfigError, match="has no tokenizer"):
        encode(plain, shift_records(1, 0))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "completion": "b"}\nnot json\n')
    cfg = replace(SFTData(root=str(bad), tokenizer=str(tmp_path / "x")))
    with pytest.raises(ConfigError, match=r"bad.jsonl:2 is not a JSON object"):
        sft.read_records(sft.sources(cfg)[0])


def test_the_vocabulary_is_the_model_embeddings_rows_past_the_tokenizers_ids(folder, tmp_path):
    cfg = options(folder, write_jsonl(tmp_path / "t.jsonl", shift_records(20, 0)), tmp_path)
    rows = json.loads((folder / "config.json").read_text())["vocab_size"]
    assert cfg.vocab_size == cfg.num_classes == rows > len(tokenizer())


def test_packed_rows_keep_records_apart_and_give_the_unpacked_loss(families, tmp_path):
    folder = families
    from ddp_utils.models.zoo import hf_causal_lm

    cfg = options(folder, write_jsonl(tmp_path / "d" / "train.jsonl", shift_records(30, 0)),
                  tmp_path, packing=True, max_length=48)  # fmt: skip
    packed = sft.Records(sft.prepared(cfg) / "train.npz", cfg.max_length)
    plain = sft.Records(sft.prepared(cfg) / "train.npz")
    assert packed.rows[0] == 0 and packed.rows[-1] == len(plain) and len(packed) < len(plain)
    assert max(len(packed.sample(k)[0]) for k in range(len(packed))) <= cfg.max_length - 1
    model = hf_causal_lm("", cfg.vocab_size, cfg.max_length, pretrained=str(folder)).eval()
    assert model.packs_records
    task = LanguageModel(cfg.vocab_size, cfg.max_length)
    rows = np.arange(len(packed))
    x, y = sft.RecordLoader(packed, rows, 4, RT.device, 0).batch(rows)
    assert x.shape[1] == 2  # ids over positions
    a, b = sft.RecordLoader(plain, np.arange(len(plain)), 4, RT.device, 0).batch(
        np.arange(len(plain)))  # fmt: skip
    with torch.no_grad():
        together, apart = task.loss_sum(model(x), y), task.loss_sum(model(a), b)
    assert (y != IGNORE_LABEL).sum() == (b != IGNORE_LABEL).sum()
    assert together.item() == pytest.approx(apart.item(), rel=1e-5)


def test_packing_is_refused_for_a_model_that_cannot_keep_records_apart():
    task = LanguageModel(16, 8)
    with pytest.raises(ConfigError, match="data.packing=true: this model cannot keep packed"):
        task.forward(torch.nn.Identity(), torch.zeros(1, 2, 4, dtype=torch.long))
