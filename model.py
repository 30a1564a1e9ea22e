"""Qwen2 in plain PyTorch, and its KV cache (checkpoint.py reads, writes Hugging Face directories).

The decoder is the Qwen2 of DeepSeek-R1-Distill-Qwen-1.5B. Attention is SDPA with a boolean mask
(True = attend), so one code path serves cached decoding (the mask from the cache's positions and
alive flags), replay (one (B, T, T) mask per layer, built right before that layer) and plain causal
training. The cache stores post-RoPE keys: an entry keeps its position, eviction only drops entries.
"""
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class Qwen2Config:
    vocab_size: int = 151936
    hidden_size: int = 1536
    intermediate_size: int = 8960
    num_hidden_layers: int = 28
    num_attention_heads: int = 12
    num_key_value_heads: int = 2
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 131072
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def eos_ids(self) -> list[int]:
        eos = self.eos_token_id
        return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()  # normalise in fp32, then cast back (as Qwen2 does)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_cos_sin(pos, head_dim: int, theta: float, dtype):
    """cos and sin of the rotary angles at absolute positions pos (B, T) -> (B, 1, T, D)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=pos.device).float() / head_dim)
    angles = pos.float()[..., None] * inv_freq  # (B, T, D/2)
    angles = torch.cat([angles, angles], dim=-1)  # rotate-half layout over the whole head
    return angles.cos().to(dtype)[:, None], angles.sin().to(dtype)[:, None]


def apply_rope(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: Qwen2Config):
        super().__init__()
        self.n_head, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_head * self.head_dim, bias=True)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=True)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=True)
        self.o_proj = nn.Linear(self.n_head * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin, pos, mask=None, cache=None, valid=None):
        (B, T, _), H, Hkv, D = x.shape, self.n_head, self.n_kv, self.head_dim
        q = self.q_proj(x).view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        k = self.k_proj(x).view(B, T, Hkv, D).transpose(1, 2)  # (B, Hkv, T, D)
        v = self.v_proj(x).view(B, T, Hkv, D).transpose(1, 2)  # (B, Hkv, T, D)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q_new, k_new = q, k
        if cache is not None:  # attend to everything alive in the cache, plus the new tokens
            cache.append(k, v, pos, valid)
            k, v, mask = cache.read(pos)  # (B, Hkv, S', D) twice, (B, T, S')
        if cache is not None and T == 1:  # decode: a KV group's query heads as one head's queries
            y = F.scaled_dot_product_attention(q.reshape(B, Hkv, -1, D), k, v,
                                               attn_mask=mask[:, None]).view(B, H, 1, D)
        else:  # (B, H, T, D)
            y = F.scaled_dot_product_attention(q, k, v, None if mask is None else mask[:, None],
                                               is_causal=mask is None, enable_gqa=True)
        y = self.o_proj(y.transpose(1, 2).reshape(B, T, -1))
        return y, q_new, k_new


class MLP(nn.Module):
    def __init__(self, cfg: Qwen2Config):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: Qwen2Config):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, pos, mask=None, cache=None, valid=None):
        a, q, k = self.self_attn(self.input_layernorm(x), cos, sin, pos, mask, cache, valid)
        x = x + a
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, q, k


class Qwen2(nn.Module):
    def __init__(self, cfg: Qwen2Config):
        super().__init__()
        self.config = cfg
        self.model = nn.ModuleDict(dict(  # Hugging Face's names: model.layers.0. ...
            embed_tokens=nn.Embedding(cfg.vocab_size, cfg.hidden_size),
            layers=nn.ModuleList(Block(cfg) for _ in range(cfg.num_hidden_layers)),
            norm=RMSNorm(cfg.hidden_size, cfg.rms_norm_eps),
        ))
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def layers(self):
        return self.model.layers

    def forward(self, idx, pos, cache=None, valid=None, layer_mask=None, qk_hook=None):
        """Final hidden states (B, T, C) of tokens idx (B, T) at absolute positions pos (B, T).

        cache: a KVCache the real tokens (valid (B, T)) join; they see its alive entries not later.
        layer_mask: layer -> (B, T, T) bool visibility, True = attend (replay); neither: causal.
        qk_hook(layer, q, k, mask) reads the new post-RoPE q (B, H, T, D) and k (B, Hkv, T, D)."""
        cfg = self.config
        x = self.model.embed_tokens(idx)  # (B, T, C)
        cos, sin = rope_cos_sin(pos, cfg.head_dim, cfg.rope_theta, x.dtype)
        for i, block in enumerate(self.layers):
            mask = layer_mask(i) if layer_mask is not None else None
            x, q, k = block(x, cos, sin, pos, mask, cache.layers[i] if cache else None, valid)
            if qk_hook is not None:
                qk_hook(i, q, k, mask)
        return self.model.norm(x)

    def logits(self, hidden):
        return self.lm_head(hidden)


class LayerCache:
    """One layer's KV entries for a batch, `capacity` slots per row in buffers allocated once. A
    row's alive entries are its first `fill` slots, in position order: a new entry goes to slot
    `fill`, an eviction moves the survivors to the front. No shape changes between tokens, so a
    decode step can be captured (torch.compile, CUDA graphs). The capacity is a bound the caller
    proves (ngc.cache_bound); needing more is an error at the next `check`, never a silent drop.
    Attention reads the first `span` slots: all S for a captured step (tight=False), else a
    host-side bound that grows with each append and shrinks at each eviction to the fullest row."""

    def __init__(self, batch, n_kv, head_dim, capacity, dtype, device, tight: bool = False):
        # (B, Hkv, S, D); zeros, not empty: attention weighs masked slots by 0, and 0 * NaN is NaN
        self.k = torch.zeros(batch, n_kv, capacity, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.pos = torch.zeros(batch, capacity, dtype=torch.long, device=device)  # (B, S)
        self.alive = torch.zeros(batch, capacity, dtype=torch.bool, device=device)  # (B, S)
        self.fill = self.pos.new_zeros(batch)  # (B,) slots in use; above S: an overflow
        self.size = capacity  # S; a round reads all S slots, masking the dead ones
        self.tight = tight
        self.span = 0 if tight else capacity  # S' <= S slots attention reads: every alive one
        self.span_floor = 0  # the most a row that left (keep_rows) held: S' never drops below it

    def read(self, qpos):
        """The keys and values (B, Hkv, S', D) of the first S' = span slots, and what each of the T
        newest tokens (positions qpos (B, T)) attends to among them (B, T, S'): alive, not later."""
        n = self.span
        seen = self.alive[:, None, :n] & (self.pos[:, None, :n] <= qpos[:, :, None])
        return self.k[:, :, :n], self.v[:, :, :n], seen

    def append(self, k, v, pos, valid):
        """Write k, v (B, Hkv, T, D) where valid (B, T) at each row's next free slots, in order;
        padding writes back what its slot holds. Slots wrap modulo S, distinct in a row past S."""
        n = valid.sum(1, keepdim=True)
        if valid.shape[1] == 1:  # decode: to slot fill (or it writes back what it holds)
            rank = torch.zeros_like(n)
        else:  # (B, T): each token's rank, the valid ones first
            rank = torch.where(valid, valid.cumsum(1) - 1, n + (~valid).cumsum(1) - 1)
        row, head = (torch.arange(m, device=k.device)[:, None] for m in k.shape[:2])
        slot = (self.fill[:, None] + rank) % self.size  # (B, T)
        index = row[:, None], head, slot[:, None]  # (B, Hkv, T) into the (B, Hkv, S, D) buffers
        new = valid[:, None, :, None]
        # index_put, not scatter_: torch.compile updates it in place instead of copying the buffer
        self.k[index] = torch.where(new, k.to(self.k.dtype), self.k[index])  # (B, Hkv, T, D)
        self.v[index] = torch.where(new, v.to(self.v.dtype), self.v[index])
        self.pos[row, slot] = torch.where(valid, pos, self.pos[row, slot])
        self.alive[row, slot] = self.alive[row, slot] | valid
        self.fill.add_(n[:, 0])
        if self.tight:
            self.span = min(self.size, self.span + k.shape[2])

    def evict(self, rows, keep):
        """Rows `rows` (N,) keep the entries where keep (N, S), moved in order to the front."""
        self.check()  # first: an overflow since the last round is an error
        order = torch.argsort(keep.to(torch.uint8), dim=1, descending=True, stable=True)  # (N, S)
        N, Hkv, S, D = len(rows), *self.k.shape[1:]
        heads = rows[:, None] * Hkv + torch.arange(Hkv, device=rows.device)  # (N, Hkv) of B·Hkv
        entries = (heads[:, :, None] * S + order[:, None]).flatten()  # (N·Hkv·S,) of B·Hkv·S
        for buf in (self.k, self.v):  # index_select of D-vectors: far faster than a gather on CPU
            buf.index_copy_(0, rows, buf.view(-1, D).index_select(0, entries).view(N, Hkv, S, D))
        self.pos[rows] = self.pos[rows].gather(1, order)
        self.fill[rows] = keep.sum(1)
        self.alive[rows] = torch.arange(self.size, device=keep.device) < self.fill[rows, None]
        if self.tight:
            self.span = max(int(self.fill.max()), self.span_floor)  # a host sync, once per round

    def keep_rows(self, rows):
        """Keep only rows `rows` (N,), in that order; eager only. Attention still reads as many
        slots as the rows that left held: the rest compute (and round) as they would beside them."""
        left = torch.ones_like(self.alive[:, 0]).index_fill_(0, rows, False)
        self.span_floor = max(self.span_floor, int(torch.where(left, self.fill, 0).max()))
        self.k, self.v, self.pos = self.k[rows], self.v[rows], self.pos[rows]
        self.alive, self.fill = self.alive[rows], self.fill[rows]

    def check(self):
        if (self.fill > self.size).any():
            raise RuntimeError(f"KV cache overflow: a row needs {int(self.fill.max())} slots of "
                               f"{self.size} allocated; the bound that sized the cache is wrong")


class KVCache:
    def __init__(self, cfg: Qwen2Config, batch, capacity, dtype, device, tight: bool = False):
        self.layers = [LayerCache(batch, cfg.num_key_value_heads, cfg.head_dim, capacity, dtype,
                                  device, tight) for _ in range(cfg.num_hidden_layers)]

    def keep_rows(self, rows):
        for kv in self.layers:
            kv.keep_rows(rows)

    def alive_counts(self):
        """(B, L) number of alive entries per row and layer."""
        return torch.stack([kv.fill for kv in self.layers], dim=1)

    def slots(self) -> int:
        """Entries physically allocated per row, summed over layers."""
        return sum(kv.size for kv in self.layers)

    def check(self):
        for kv in self.layers:
            kv.check()

    def buffers(self):
        return [t for kv in self.layers for t in (kv.k, kv.v, kv.pos, kv.alive, kv.fill)]


def init_weights(model: Qwen2, std: float = 0.02, seed: int = 0):
    """Random weights for tests and pretraining from scratch (normal(0, std), norms at 1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return model

