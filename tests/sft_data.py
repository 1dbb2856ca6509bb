"""Model folders and instruction records for the fine-tuning tests, all made here: a tokenizer
trained on local text with ``tokenizers`` and given a chat template, a tiny Llama (or GPT-2)
saved with ``save_pretrained``, and a synthetic task with a learnable answer (each letter of
a word moved one place on in the alphabet: "abc" -> "bcd")."""

from __future__ import annotations

import json
import random
from pathlib import Path

LETTERS = "abcdefghij"
SPECIAL = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")  # fmt: skip


def tokenizer(chat: bool = True):
    """A byte-level BPE of a few dozen ids, with Llama's special tokens (a bos token added in
    front, eos at the end of a completion) and, with ``chat``, a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    impl = Tokenizer(models.BPE())
    impl.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    impl.decoder = decoders.ByteLevel()
    text = [f"shift {w} = {shifted(w)}." for w in words(200, 1)] + ["Hello, world: 1+2=3"]
    trainer = trainers.BpeTrainer(vocab_size=80, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    impl.train_from_iterator(text, trainer=trainer)
    impl.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", impl.token_to_id("<s>"))]
    )
    tok = PreTrainedTokenizerFast(tokenizer_object=impl, bos_token="<s>", eos_token="</s>",
                                  pad_token="<pad>")  # fmt: skip
    if chat:
        tok.chat_template = TEMPLATE
    return tok


def model_folder(where: Path, arch: str = "llama", chat: bool = True, seed: int = 0) -> Path:
    """A tiny pretrained-model folder: config.json, model.safetensors, the tokenizer files.
    The embedding has a few rows past the tokenizer's ids (padded to a multiple of 8)."""
    import torch
    import transformers

    tok = tokenizer(chat)
    vocab = -(-len(tok) // 8) * 8
    torch.manual_seed(seed)
    if arch == "llama":
        config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                                          num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, max_position_embeddings=128,
                                          bos_token_id=tok.bos_token_id,
                                          eos_token_id=tok.eos_token_id,
                                          pad_token_id=tok.pad_token_id)  # fmt: skip
    else:
        config = transformers.GPT2Config(vocab_size=vocab, n_embd=64, n_layer=2, n_head=4,
                                         n_positions=128, bos_token_id=tok.bos_token_id,
                                         eos_token_id=tok.eos_token_id)  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config)
    # As a chat model's folder does: a turn's end also ends generation
    model.generation_config.eos_token_id = [tok.eos_token_id, tok.convert_tokens_to_ids("<|end|>")]
    model.save_pretrained(where)
    tok.save_pretrained(where)
    return where


def shifted(word: str) -> str:
    return "".join(LETTERS[(LETTERS.index(c) + 1) % len(LETTERS)] for c in word)


def words(n: int, seed: int, length: int = 4) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(LETTERS) for _ in range(length)) for _ in range(n)]


def shift_records(n: int, seed: int, chat: bool = False) -> list[dict]:
    """The synthetic task's records: a word, and the word shifted."""
    out = []
    for w in words(n, seed):
        if chat:
            out.append({"messages": [{"role": "user", "content": f"shift {w}"},
                                     {"role": "assistant", "content": shifted(w)}]})  # fmt: skip
        else:
            out.append({"prompt": f"shift {w} =", "completion": f" {shifted(w)}"})
    return out


def write_jsonl(path: Path, records: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def exact_match(checkpoint: Path, records: list[dict], chat: bool = False) -> float:
    """Greedy generation's exact-match accuracy on ``records``' prompts (their held-out words),
    from a train.py checkpoint, through generate.py's own functions."""
    import torch

    from ddp_utils.config import GenerateConfig
    from ddp_utils.generation import load_generator

    cfg = GenerateConfig(checkpoint=str(checkpoint), temperature=0.0, num_samples=1,
                         max_new_tokens=8)  # fmt: skip
    model, tok, block = load_generator(cfg, torch.device("cpu"))
    return greedy_accuracy(model, tok, block, records, chat)


def greedy_accuracy(model, tok, block: int, records: list[dict], chat: bool = False) -> float:
    import torch

    from ddp_utils.config import GenerateConfig
    from ddp_utils.generation import encode_prompt, sample

    cfg = GenerateConfig(checkpoint="-", temperature=0.0, num_samples=1, max_new_tokens=8)
    right = 0
    for record in records:
        if chat:
            prompt, answer = record["messages"][0]["content"], record["messages"][1]["content"]
        else:
            prompt, answer = record["prompt"], record["completion"]
        ids = encode_prompt(tok, prompt, chat)
        out = sample(model, ids, cfg, block, tok.vocab_size, torch.device("cpu"), tok.stop_ids())
        right += tok.decode(out[0]).strip() == answer.strip()
    return right / len(records)


def base_accuracy(folder: Path, records: list[dict], chat: bool = False) -> float:
    """The untrained base's accuracy, through the same generation."""
    from ddp_utils.data.text.tokenizer import HFTokenizer
    from ddp_utils.models.zoo import hf_causal_lm

    tok = HFTokenizer(str(folder), chat)
    vocab = -(-len(tok.impl) // 8) * 8
    return greedy_accuracy(hf_causal_lm("", vocab, 64, pretrained=str(folder)), tok, 64,
                           records, chat)  # fmt: skip


def copy_records(n: int, seed: int) -> list[dict]:
    """A neighbouring task a base model is pretrained on: the word, copied."""
    return [{"prompt": f"shift {w} =", "completion": f" {w}"} for w in words(n, seed)]


def pretrained_folder(where: Path, steps: int = 150, arch: str = "llama") -> Path:
    """``model_folder`` trained (a plain loop, every token) on ``copy_records``: a base that
    knows the format, as a published model does, for LoRA to adapt to the shift."""
    import torch
    import transformers

    model_folder(where, arch)
    tok = transformers.AutoTokenizer.from_pretrained(where)
    model = transformers.AutoModelForCausalLM.from_pretrained(where)
    texts = [r["prompt"] + r["completion"] for r in copy_records(512, 3)]
    ids = torch.tensor([tok(t)["input_ids"] + [tok.eos_token_id] for t in texts])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        batch = ids[torch.randint(len(ids), (32,), generator=g)]
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(where)  # its generation_config.json too, as model_folder wrote it
    return where
