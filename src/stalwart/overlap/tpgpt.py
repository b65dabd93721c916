"""The reference GPT (stalwart.train.model) in Megatron tensor-parallel form.

Attention heads and MLP hidden units are split over the TP group: qkv and fc are column-parallel,
both proj layers row-parallel, so each block costs two all-reduces in forward and two in backward
(no sequence parallelism). Embeddings, LayerNorms and the tied head are replicated: their inputs
are identical on every TP rank after each all-reduce, so their gradients are too and need no
communication.

Guarantee: ``TPGPT.from_full(gpt, comm)`` computes the same logits, loss and (after
``full_grads``) the same gradients as ``gpt`` itself, to float summation order (1e-5 in tests).
Parameter names equal GPT's, so a full state dict shards (``load_full_state_dict``) and a
sharded one gathers (``full_state_dict``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from stalwart.overlap.comm import TPComm
from stalwart.overlap.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    column_slice,
    row_slice,
)
from stalwart.train.model import GPT, GPTConfig


class TPAttention(nn.Module):
    def __init__(self, cfg: GPTConfig, comm: TPComm) -> None:
        super().__init__()
        if cfg.n_head % comm.world:
            raise ValueError(f"n_head {cfg.n_head} not divisible by TP size {comm.world}")
        self.n_head = cfg.n_head // comm.world
        self.head_dim = cfg.n_embd // cfg.n_head
        self.qkv = ColumnParallelLinear(cfg.n_embd, 3 * cfg.n_embd, comm)
        self.proj = RowParallelLinear(cfg.n_embd, cfg.n_embd, comm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        local = self.n_head * self.head_dim
        q, k, v = self.qkv(x).split(local, dim=2)
        q, k, v = (t.view(B, T, self.n_head, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, local))


class TPMLP(nn.Module):
    def __init__(self, cfg: GPTConfig, comm: TPComm) -> None:
        super().__init__()
        self.fc = ColumnParallelLinear(cfg.n_embd, 4 * cfg.n_embd, comm)
        self.proj = RowParallelLinear(4 * cfg.n_embd, cfg.n_embd, comm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class TPBlock(nn.Module):
    def __init__(self, cfg: GPTConfig, comm: TPComm) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = TPAttention(cfg, comm)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = TPMLP(cfg, comm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TPGPT(nn.Module):
    """GPT with TP-sharded blocks; ``forward(idx, targets) -> (logits, loss)`` like GPT."""

    def __init__(self, cfg: GPTConfig, comm: TPComm) -> None:
        super().__init__()
        if cfg.dropout:
            raise ValueError("TPGPT supports dropout=0 only (the reference presets use 0)")
        self.cfg = cfg
        self.comm = comm
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(TPBlock(cfg, comm) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.head.weight = self.wte.weight
        self.drop = nn.Identity()  # TP training requires dropout 0; keeps GPT.forward usable

    @classmethod
    def from_full(cls, gpt: GPT, comm: TPComm) -> TPGPT:
        model = cls(gpt.cfg, comm)
        model.load_full_state_dict(gpt.state_dict())
        return model

    # the same embeddings -> blocks -> tied head -> loss as the full model; only the blocks differ
    forward = GPT.forward

    # ---- sharding ---------------------------------------------------------------------------
    def _slice(self, name: str, full: torch.Tensor) -> torch.Tensor:
        r, w = self.comm.rank, self.comm.world
        if name.endswith("attn.qkv.weight") or name.endswith("attn.qkv.bias"):
            return column_slice(full, r, w, parts=3)
        if name.endswith("mlp.fc.weight") or name.endswith("mlp.fc.bias"):
            return column_slice(full, r, w)
        if name.endswith("proj.weight"):
            return row_slice(full, r, w)
        return full.clone()

    def load_full_state_dict(self, full: dict[str, torch.Tensor]) -> None:
        """Take this rank's shards of an unsharded GPT state dict."""
        own = self.state_dict()
        missing = set(own) - set(full)
        if missing:
            raise KeyError(f"full state dict lacks {sorted(missing)}")
        self.load_state_dict({k: self._slice(k, full[k]) for k in own})

    def _gather(self, name: str, local: torch.Tensor) -> torch.Tensor:
        w = self.comm.world
        sharded = (name.endswith(("attn.qkv.weight", "attn.qkv.bias", "mlp.fc.weight",
                                  "mlp.fc.bias", "proj.weight")))
        if not sharded or w == 1:
            return local.detach().clone()
        parts = [torch.empty_like(local) for _ in range(w)]
        dist.all_gather(parts, local.detach().contiguous(), group=self.comm.group)
        if name.endswith("proj.weight"):
            return torch.cat(parts, dim=1)
        if "attn.qkv" in name:  # per rank [q_r; k_r; v_r] -> [q; k; v]
            chunks = [p.chunk(3, dim=0) for p in parts]
            return torch.cat([torch.cat([c[i] for c in chunks], dim=0) for i in range(3)])
        return torch.cat(parts, dim=0)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unsharded state dict (collective: every TP rank must call it)."""
        return {k: self._gather(k, v) for k, v in self.state_dict().items()}

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Unsharded gradients by parameter name (collective: every TP rank must call it)."""
        out = {}
        for name, p in self.named_parameters():
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            out[name] = self._gather(name, g)
        return out
