"""The project's reference GPT: a small, plain decoder-only transformer.

It is what tests, the executor and the benchmarks train when no user model is
given. Plain `nn.Linear`/`nn.LayerNorm` modules with conventional names
(`attn.q_proj`, `mlp.up_proj`, ...) so that tracing and the executor's
appliers see the same shapes as in the HuggingFace families.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 512
    n_layers: int = 4
    hidden: int = 128
    heads: int = 4
    ffn_hidden: int | None = None
    max_seq_len: int = 128
    tie_embeddings: bool = False  # the LM head reuses the token embedding (GPT-2/GPT-3)

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or 4 * self.hidden


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.q_proj = nn.Linear(cfg.hidden, cfg.hidden)
        self.k_proj = nn.Linear(cfg.hidden, cfg.hidden)
        self.v_proj = nn.Linear(cfg.hidden, cfg.hidden)
        self.o_proj = nn.Linear(cfg.hidden, cfg.hidden)
        self.attend = None  # extension point: a replacement for the causal core (context parallelism sets it)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 rather than self.heads: under tensor parallelism the projections
        # hold heads/tp heads each, and the local head count follows.
        q, k, v = (p(x).view(b, s, -1, self.head_dim(x)).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        if self.attend is not None:
            out = self.attend(q, k, v)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))

    def head_dim(self, x: torch.Tensor) -> int:
        return self.q_proj.in_features // self.heads


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.up_proj = nn.Linear(cfg.hidden, cfg.ffn)
        self.down_proj = nn.Linear(cfg.ffn, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.up_proj(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.hidden)
        self.attn = Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.hidden)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class ReferenceGPT(nn.Module):
    """Token ids [batch, seq] -> logits [batch, seq, vocab]."""

    drops_to_none = True  # a pipeline stage sets the modules it does not own to None (see forward)

    def __init__(self, cfg: GPTConfig = GPTConfig()) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.hidden)
        # A ModuleDict keyed "0".."n-1" keeps layer names stable when a
        # pipeline stage deletes the layers it does not own.
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.ln_f = nn.LayerNorm(cfg.hidden)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.position_ids: torch.Tensor | None = None  # the tokens' positions when not 0..s-1 (context parallelism)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # A pipeline stage may hold only some of the modules (the others are
        # set to None); it then takes and returns hidden states.
        x = tokens
        if self.tok_emb is not None:
            positions = (self.position_ids.to(tokens.device) if self.position_ids is not None
                         else torch.arange(tokens.shape[1], device=tokens.device))
            x = self.tok_emb(tokens) + self.pos_emb(positions)
        for layer in self.layers.values():
            x = layer(x)
        if self.ln_f is not None:
            x = self.ln_f(x)
        if self.lm_head is not None:
            x = self.lm_head(x)
        return x
