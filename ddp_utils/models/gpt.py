"""model=gpt: a decoder-only transformer in GPT-2's shape.

Pre-norm blocks (LayerNorm, causal self-attention through ``scaled_dot_product_attention``,
LayerNorm, a 4x GELU MLP), learnt positions, the output layer tied to the token embedding, and
GPT-2's initialisation: N(0, 0.02) everywhere, the residual projections scaled by
1/sqrt(2 * n_layer) so the residual stream's variance does not grow with depth.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

INIT_STD = 0.02


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float) -> torch.Tensor:
    """Causal ``scaled_dot_product_attention``. On a CPU under bf16 autocast it runs in fp32:
    torch's CPU flash-attention backward is several times slower in bf16 than in fp32, casts
    included, enough to make a whole bf16 step slower than fp32's."""
    if q.device.type == "cpu" and q.dtype != torch.float32:
        with torch.autocast("cpu", enabled=False):
            y = F.scaled_dot_product_attention(
                q.float(), k.float(), v.float(), dropout_p=dropout, is_causal=True
            )
        return y.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.n_head, self.dropout = n_head, dropout
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, c = x.shape
        # (N, T, 3C) -> three (N, heads, T, C / heads)
        q, k, v = self.qkv(x).view(n, t, 3, self.n_head, c // self.n_head).permute(2, 0, 3, 1, 4)
        y = attention(q, k, v, self.dropout if self.training else 0.0)
        return self.resid_dropout(self.proj(y.transpose(1, 2).reshape(n, t, c)))


class MLP(nn.Module):
    def __init__(self, n_embd: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.proj = nn.Linear(4 * n_embd, n_embd, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = MLP(n_embd, dropout, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """(N, T) token ids, T <= block_size, to (N, T, vocab_size) next-token logits."""

    def __init__(self, vocab_size: int, block_size: int, n_layer: int = 4, n_head: int = 4,
                 n_embd: int = 128, dropout: float = 0.0, bias: bool = False) -> None:  # fmt: skip
        super().__init__()
        assert n_embd % n_head == 0, "checked by the model config"
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout, bias) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one matrix reads and writes tokens
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):  # the projections back into the residual stream
                nn.init.normal_(p, mean=0.0, std=INIT_STD / math.sqrt(2 * n_layer))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=INIT_STD)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def flops_per_sample(self) -> float:
        """Training FLOPs (forward and backward) of one window of ``block_size`` tokens, as
        nanoGPT and PaLM count them: 6 a parameter and token (the position table, a lookup,
        left out) and 12 x layers x width x block_size a token for attention's products."""
        n = sum(p.numel() for p in self.parameters()) - self.wpe.weight.numel()
        layers, width, t = len(self.blocks), self.wte.embedding_dim, self.block_size
        return float((6 * n + 12 * layers * width * t) * t)

    def fsdp_units(self) -> list[nn.Module]:
        """What trainer.strategy=fsdp2 shards one by one: the transformer blocks (the
        embeddings, tied to the head, stay with the root)."""
        return list(self.blocks)

    def hf_export(self) -> tuple[str, dict, dict[str, torch.Tensor]]:
        """This model in Hugging Face's GPT-2 layout (``python -m ddp_utils.checkpoint export
        --format hf``): the config class, its arguments, and the weights under GPT-2's names.
        GPT-2's Conv1D layers hold (in, out) matrices, the transpose of a Linear's; its
        LayerNorms and projections always have biases (zero where this model has none), and
        its exact GELU is ``gelu`` (``gelu_new`` is the tanh approximation)."""
        width, layers = self.wte.embedding_dim, len(self.blocks)
        kwargs = {"vocab_size": self.wte.num_embeddings, "n_positions": self.block_size,
                  "n_embd": width, "n_layer": layers, "n_head": self.blocks[0].attn.n_head,
                  "activation_function": "gelu", "layer_norm_epsilon": self.ln_f.eps,
                  "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
                  "bos_token_id": None, "eos_token_id": None,
                  "tie_word_embeddings": True}  # fmt: skip
        own = {k: v.detach() for k, v in self.state_dict().items()}

        def linear(ours: str, theirs: str, out: int) -> dict[str, torch.Tensor]:
            bias = own.get(f"{ours}.bias", torch.zeros(out))
            return {f"{theirs}.weight": own[f"{ours}.weight"].t().contiguous(),
                    f"{theirs}.bias": bias}  # fmt: skip

        def norm(ours: str, theirs: str) -> dict[str, torch.Tensor]:
            return {f"{theirs}.weight": own[f"{ours}.weight"],
                    f"{theirs}.bias": own.get(f"{ours}.bias", torch.zeros(width))}  # fmt: skip

        state = {"transformer.wte.weight": own["wte.weight"],
                 "transformer.wpe.weight": own["wpe.weight"],
                 "lm_head.weight": own["wte.weight"],
                 **norm("ln_f", "transformer.ln_f")}  # fmt: skip
        for i in range(layers):
            ours, theirs = f"blocks.{i}", f"transformer.h.{i}"
            state |= norm(f"{ours}.ln_1", f"{theirs}.ln_1") | norm(f"{ours}.ln_2", f"{theirs}.ln_2")
            state |= linear(f"{ours}.attn.qkv", f"{theirs}.attn.c_attn", 3 * width)
            state |= linear(f"{ours}.attn.proj", f"{theirs}.attn.c_proj", width)
            state |= linear(f"{ours}.mlp.fc", f"{theirs}.mlp.c_fc", 4 * width)
            state |= linear(f"{ours}.mlp.proj", f"{theirs}.mlp.c_proj", width)
        return "GPT2Config", kwargs, state

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.block_size:
            raise ValueError(
                f"a sequence of {t} tokens is longer than block_size={self.block_size}"
            )
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))
