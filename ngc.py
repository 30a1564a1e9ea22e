"""The NGC rollout engine: batched sampling from a Qwen2 whose KV cache is pruned every δ tokens.

One sequence's life (paper §4.1): each time its cache has just taken token kδ-1 (prompt included),
an eviction round fires (`eviction_round`). At each layer the w newest queries score the alive keys
(ψ, §4.2), the keys are cut into blocks of b, and K = keep_count(N, ε) blocks are kept: sampled
with Gumbel-top-k (§4.3, training) or the top K (the paper's evaluation); the rest are gone from
that layer for good. Token kδ is sampled from the logits computed before the round and attends to
the survivors. A baseline (baselines.py) swaps ψ for its own per-key score in the same rounds.

With a meta-token g (Sampling.meta_token; App. "Compression via Meta-Tokens") the completion's
token kδ-1, the last before a round, is forced to g. A Rollout holds all that replay needs.
"""
import functools
import math
import weakref
from collections import namedtuple
from dataclasses import dataclass, replace
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from tqdm import tqdm

from gumbel import (MISSING, block_means, gumbel_topk, keep_count, kept_keys, log_block_logits,
                    ordered_topk, plackett_luce_log_prob)
from model import KVCache, LayerCache, Qwen2


@dataclass
class Eviction:
    """When and how much to evict (paper §4.1–4.3), and how the kept blocks are chosen."""
    delta: int = 256  # eviction cadence δ: a round after every δ tokens of a sequence
    block: int = 32  # block size b
    window: int = 5  # scoring window w: the w newest queries score the keys
    rate: float = 0.5  # eviction rate ε: the fraction of blocks evicted per round
    temperature: float = 1.0  # τ: sample over the block logits log s_j / τ (1: the paper's)
    greedy: bool = False  # the top K blocks (the paper's evaluation), else Gumbel-top-k (training)
    score: Callable | None = None  # a baseline's (ψ, keys, alive, Round) -> (N, S); None: ψ
    log_blocks: bool = False  # a baseline's blocks ranked as ψ's, log s_j / τ; else plain means

    def __post_init__(self):
        check_eviction(self.delta, self.block, self.window, self.rate, self.temperature)


# What a baseline's score reads besides ψ, keys and alive: the round's rows (N,), the layer, each
# slot's position (N, S), the w newest tokens' (N, w), the prompts (N, T, 0-padded), their lengths.
Round = namedtuple("Round", "rows layer key_pos query_pos prompts prompt_lens")


def is_round_end(t, delta: int):
    """Whether token t (0-based, prompt included) is kδ-1, the last before a round (§4.1)."""
    return (t + 1) % delta == 0


@dataclass
class Sampling:
    max_new_tokens: int = 1024
    temperature: float = 0.9
    top_k: int = 50  # 0 = no top-k truncation
    top_p: float = 1.0  # nucleus: the fewest top tokens whose mass reaches top_p; 1 = off
    greedy: bool = False
    meta_token: int | None = None  # g: forced as the last token before each round; None: never

    def __post_init__(self):
        if self.temperature <= 0:
            raise ValueError(f"temperature={self.temperature} must be positive (or greedy=True)")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be at least 1")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must lie in (0, 1]: the probability mass kept")


@dataclass
class Rollout:
    tokens: torch.Tensor  # (B, T) prompt + completion, right-padded with 0
    prompt_lens: torch.Tensor  # (B,)
    lengths: torch.Tensor  # (B,) prompt + completion
    logprobs: torch.Tensor  # (B, T) log softmax(logits / temperature) of each sampled token, else 0
    forced: torch.Tensor  # (B, T) bool: tokens forced to the meta-token g (log-prob 0: not sampled)
    kept: torch.Tensor  # (B, R, L, Kmax) ordered kept blocks σ per round and layer, -1 padded
    n_rounds: torch.Tensor  # (B,) rounds that fired
    evict_logprobs: torch.Tensor  # (B, R, L) log p(σ) of each decision, 0 where none
    kv_before_round: torch.Tensor  # (B, R, L) alive entries just before each round
    peak_kv: torch.Tensor  # (B,) most KV entries held at once, summed over layers
    kv_slots: int  # most KV slots allocated per batch row, summed over layers
    eos: torch.Tensor  # (B,) bool, finished by EOS (else by max_new_tokens)
    sampling: Sampling  # how the tokens were drawn: temperature, top-k, greedy
    eviction: Eviction | None  # δ, b, w and how blocks were chosen; None: the full cache
    rates: torch.Tensor | None  # (B,) each row's ε (eviction.rate unless rollout's `rates` set it)

    def select(self, rows) -> "Rollout":
        """The rollouts of rows `rows`, trimmed to their own longest length and round count."""
        T, R = int(self.lengths[rows].max()), int(self.n_rounds[rows].max())
        trim = dict(tokens=T, logprobs=T, forced=T, kept=R, evict_logprobs=R, kv_before_round=R)
        return replace(self, **{k: v[rows, : trim[k]] if k in trim else v[rows]
                                for k, v in vars(self).items() if torch.is_tensor(v)})

    def completions(self) -> list[list[int]]:
        return [t[p:n].tolist() for t, p, n in zip(self.tokens, self.prompt_lens, self.lengths)]


@torch.no_grad()
def rollout(model: Qwen2, prompts: list[list[int]], sampling: Sampling,
            eviction: Eviction | None = None, rates=None, eos_ids=(), generator=None,
            progress=False, compile=False, eviction_generator=None,
            token_noise_rows=None) -> Rollout:
    """Sample a completion for each prompt, evicting every δ tokens (eviction=None: full cache).
    rates: per-row ε (B,) in place of eviction.rate (interoception; 0: the row keeps its full
    cache); generator: the token noise's, and the Gumbel noise's unless eviction_generator is
    given; token_noise_rows (B,): the row whose token noise each row takes (rows that share it
    differ by their evictions alone); compile: the decode step through torch.compile, same
    results."""
    state = RolloutState(model, prompts, sampling, eviction, rates, generator, compile,
                         eviction_generator, token_noise_rows)
    logits = prefill(state)
    return finish(state, *decode_n_tokens(state, logits, eos_ids, progress))


class RolloutState:
    """A rollout under way: what prefill, decode_n_tokens and finish share."""

    def __init__(self, model: Qwen2, prompts, sampling: Sampling, eviction: Eviction | None, rates,
                 generator, compile, eviction_generator=None, token_noise_rows=None):
        self.model, self.sampling, self.eviction = model, sampling, eviction
        self.generator, self.eviction_generator = generator, eviction_generator or generator
        self.token_noise_rows = token_noise_rows
        self.meta = sampling.meta_token if eviction else None  # g; without eviction, no round
        check_rollout(prompts, self.meta, model.config.vocab_size, eviction, rates)
        B, L, device = len(prompts), model.config.num_hidden_layers, model.lm_head.weight.device
        self.rates = None if eviction is None else torch.as_tensor(  # (B,) each row's ε
            [eviction.rate] * B if rates is None else rates, device=device)
        self.lens = [len(p) for p in prompts]  # on the host
        self.prompt_lens = torch.tensor(self.lens, device=device)  # (B,)
        T = max(self.lens) + sampling.max_new_tokens  # tokens (B, T); the last is never fed
        self.tokens = torch.tensor([[*p] + [0] * (T - len(p)) for p in prompts], device=device)
        self.dtype = model.lm_head.weight.dtype  # the cache's and the logits'
        if torch.is_autocast_enabled(device.type):  # fp32 weights, bf16 compute: a bf16 cache
            self.dtype = torch.get_autocast_dtype(device.type)
        capacity = T - 1 if eviction is None else max(  # App. A.2's bound at each row's ε
            cache_bound(eviction.delta, eviction.block, r, T - 1) for r in set(self.rates.tolist()))
        spec = (B, capacity, eviction.window if eviction else 0, self.dtype, device)
        if compile:  # captured_decode, below: buffers kept for the next rollout
            self.cache, self.window, self.step = captured_decode(model, spec)
        else:  # eager: attention reads only the slots some row has filled (a tight cache)
            self.cache, self.window = decode_state(model, *spec, tight=True)
            self.step = decode_one_token
        self.fed = torch.zeros(B, dtype=torch.long, device=device)  # (B,) tokens each cache took
        self.rounds = []  # (rows, their round index, σ per layer, log p(σ), alive before) each
        self.n_rounds = torch.zeros(B, dtype=torch.long, device=device)  # (B,) rounds fired
        self.can_drop = not compile  # ended rows leave the batch (a captured step: fixed shapes)
        self.live = None  # (B',) the batch row of each cache row; None: every row, in order
        self.cache_row = torch.arange(B, device=device)  # (B,) each batch row's cache row
        self.final_alive = torch.zeros(B, L, dtype=torch.long, device=device)  # of rows that left


def prefill(state: RolloutState):
    """Feed the prompts and return the logits (B, V) after each one's last token: in chunks that
    end on eviction boundaries, with a round between chunks (§4.1); without eviction, in one."""
    ev, P, fed, model = state.eviction, state.prompt_lens, state.fed, state.model
    chunk = ev.delta if ev else max(state.lens)  # δ; without eviction the whole prompt is one chunk
    logits = torch.zeros(len(P), model.config.vocab_size, device=P.device, dtype=state.dtype)
    while (fed < P).any():
        n = torch.minimum(P, (fed // chunk + 1) * chunk) - fed  # (B,) tokens in this chunk
        offs = torch.arange(int(n.max()), device=P.device)
        pos, valid = fed[:, None] + offs, offs < n[:, None]  # (B, T)
        tokens = state.tokens.gather(1, pos.clamp(max=state.tokens.shape[1] - 1))
        idx = tokens.masked_fill(~valid, 0)
        if state.window:
            state.window.advance(pos, valid)
        h = model(idx, pos, cache=state.cache, valid=valid, qk_hook=state.window)
        fed.add_(n)
        last = h[torch.arange(len(n), device=P.device), (n - 1).clamp(min=0)]  # (B, C)
        logits[n > 0] = model.logits(last)[n > 0]
        if ev:
            fire_round(state, (n > 0) & is_round_end(fed - 1, ev.delta))
    return logits


def decode_n_tokens(state: RolloutState, logits, eos_ids=(), progress=False):
    """The one loop over time: up to M tokens per row from the logits (B, V) after each prompt, a
    row stopping at EOS. Returns them and their log-probs (B, M), each row's count and EOS (B,)."""
    ev, M, fed = state.eviction, state.sampling.max_new_tokens, state.fed
    B, device, phases = len(fed), fed.device, set()
    if ev:  # a row still going after step t has taken token lens[i] + t: a round if due[t % δ]
        due = is_round_end(torch.tensor(state.lens) + torch.arange(ev.delta)[:, None], ev.delta)
        phases, due = set(due.any(1).nonzero().flatten().tolist()), due.to(device)  # no sync
    new = torch.zeros(B, M, dtype=torch.long, device=device)  # token t of each completion
    new_logprobs = torch.zeros(B, M, dtype=torch.float32, device=device)
    n_new = torch.zeros(B, dtype=torch.long, device=device)
    active = torch.ones(B, dtype=torch.bool, device=device)
    hit_eos = torch.zeros_like(active)
    eos = torch.tensor(list(eos_ids), dtype=torch.long, device=device)
    for t in tqdm(range(M), desc="decode", leave=False, disable=not progress, delay=2):
        tok, lp = sample_tokens(logits, state.sampling, state.generator, state.token_noise_rows)
        if state.meta is not None:  # token kδ-1, the last before a round, is g
            force = is_round_end(state.prompt_lens + n_new, ev.delta)
            tok, lp = tok.masked_fill(force, state.meta), lp.masked_fill(force, 0.0)
        new[:, t], new_logprobs[:, t] = tok, lp
        n_new += active
        hit_eos |= active & torch.isin(tok, eos)
        active &= ~hit_eos & (n_new < M)
        going = int(active.sum()) if eos.numel() else None  # a host sync, needless without EOS ids
        if t == M - 1 or going == 0:
            break
        if going and state.can_drop:
            drop_ended_rows(state, active, going)
        live = slice(None) if state.live is None else state.live  # the rows the cache holds
        out = state.step(state.model, state.cache, state.window,
                         *(x[live, None] for x in (tok, state.fed, active)))
        logits = out if state.live is None else logits.index_copy(0, live, out)  # ended: unused
        state.fed += active
        if ev and t % ev.delta in phases:
            fire_round(state, due[t % ev.delta] & active)
    return new, new_logprobs, n_new, hit_eos


def decode_one_token(model: Qwen2, cache: KVCache, window, tok, pos, valid):
    """Feed one token per row (tok, pos, valid (B, 1)) and return the logits (B, V) after it. Fixed
    shapes and no host reads, so torch.compile captures it whole; rows not valid write nothing."""
    if window is not None:
        window.advance(pos, valid)
    h = model(tok, pos, cache=cache, valid=valid, qk_hook=window)
    return model.logits(h[:, -1])


def sample_tokens(logits, sampling: Sampling, generator=None, noise_rows=None):
    """Next tokens (B,) and their log-probs under softmax(logits / temperature); noise_rows (B,):
    the row whose uniform each row takes (None: its own)."""
    logits = logits.float() / sampling.temperature
    logp = F.log_softmax(logits, dim=-1)
    if sampling.greedy:
        tok = logits.argmax(-1)
    else:
        if sampling.top_k:
            kth = logits.topk(min(sampling.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if sampling.top_p < 1:  # nucleus: drop a token once the tokens ranked above it hold top_p
            sorted_logits, order = logits.sort(dim=-1, descending=True)  # (B, V)
            probs = sorted_logits.softmax(-1)
            mass_above = probs.cumsum(-1) - probs  # 0 for the top token, which is always kept
            cut = sorted_logits.masked_fill(mass_above >= sampling.top_p, float("-inf"))
            logits = logits.scatter(-1, order, cut)
        tok = inverse_cdf_sample(logits, generator, noise_rows)
    return tok, logp.gather(1, tok[:, None]).squeeze(1)


def finish(state: RolloutState, new, new_logprobs, n_new, hit_eos) -> Rollout:
    """The Rollout: each prompt, then its first n_new (B,) tokens of new (B, M); the record."""
    cache, live = state.cache, state.live
    cache.check()  # an overflow after the last round is an error too
    P, M, device = state.prompt_lens, new.shape[1], new.device
    lengths = P + n_new
    done = torch.arange(M, device=device) < n_new[:, None]  # (B, M)
    slots = P[:, None] + torch.arange(M, device=device)  # (B, M): where the new tokens go
    tokens = state.tokens.scatter_(1, slots, torch.where(done, new, 0))
    logprobs = torch.zeros_like(tokens, dtype=torch.float32)
    logprobs.scatter_(1, slots, torch.where(done, new_logprobs, 0.0))
    kept, evict_logprobs, before = stack_rounds(state.rounds, state.n_rounds, len(cache.layers))
    alive = cache.alive_counts()  # (B', L)
    final = alive if live is None else state.final_alive.index_copy(0, live, alive)  # (B, L)
    # Alive entries only grow between rounds: a row holds the most before a round or at the end.
    held = torch.cat([before.sum(2), final.sum(1, keepdim=True)], 1)  # (B, R + 1)
    T = int(lengths.max())
    t = torch.arange(T, device=device)
    completion = (t >= P[:, None]) & (t < lengths[:, None])  # (B, T)
    forced = completion & (state.meta is not None and is_round_end(t, state.eviction.delta))
    return Rollout(tokens[:, :T], P, lengths, logprobs[:, :T], forced, kept, state.n_rounds,
                   evict_logprobs, before, peak_kv=held.amax(1), kv_slots=cache.slots(),
                   eos=hit_eos, sampling=state.sampling, eviction=state.eviction, rates=state.rates)


def stack_rounds(rounds, n_rounds, L: int):
    """The rounds' record as Rollout's kept (B, R, L, Kmax), evict_logprobs and kv_before_round."""
    B, R = len(n_rounds), int(n_rounds.max())
    Kmax = max([sigma.shape[1] for *_, sigmas, _, _ in rounds for sigma in sigmas], default=1)
    kept = n_rounds.new_full((B, R, L, Kmax), -1)
    logps, before = torch.zeros(B, R, L, device=n_rounds.device), n_rounds.new_zeros(B, R, L)
    for rows, r, sigmas, lp, bf in rounds:
        for layer, sigma in enumerate(sigmas):
            kept[rows, r, layer, : sigma.shape[1]] = sigma
        logps[rows, r], before[rows, r] = lp, bf
    return kept, logps, before


def fire_round(state: RolloutState, fired):
    """An eviction round for the batch rows where fired (B,) is True, recorded for replay."""
    rows = fired.nonzero().flatten()
    if len(rows):
        ev = state.eviction  # the rows' tokens are gathered only for a baseline that reads them
        context = ev.score and Round(rows, None, None, None, state.tokens[rows],
                                     state.prompt_lens[rows])
        decided = eviction_round(state.cache.layers, state.window, state.cache_row[rows],
                                 state.rates[rows], ev, state.eviction_generator, context)
        state.rounds.append((rows, state.n_rounds[rows].clone(), *decided))
        state.n_rounds[rows] += 1


def eviction_round(layers: list[LayerCache], window: "QueryWindow", in_cache, rates, ev: Eviction,
                   generator=None, context: Round | None = None):
    """One eviction round at every layer for cache rows in_cache (N,) at rates ε (N,) (§4.1-4.3);
    context: their Round for a baseline's score (each layer fills in its layer and positions).
    Returns σ of each layer [(N, Kmax)], log p(σ) and the alive entries before the round (N, L)."""
    qpos, sigmas, logps, before = window.pos[in_cache], [], [], []  # qpos (N, w): all scored
    for layer, kv in enumerate(layers):
        alive, kpos, keys = kv.alive[in_cache], kv.pos[in_cache], kv.k.index_select(0, in_cache)
        q = window.q[layer][in_cache]  # (N, H, w, D); keys (N, Hkv, S, D), alive (N, S)
        seen = alive[:, None, :] & (kpos[:, None, :] <= qpos[:, :, None])  # (N, w, S): causal
        # one round: ψ (N, S), logits and exists (N, nb)
        psi, logits, exists = (x[:, 0] for x in round_logits(q, keys, seen, alive[:, None], ev))
        ranking = logits
        if ev.score is not None:  # a baseline: its own key score's block mean (may be < 0)
            at_layer = context._replace(layer=layer, key_pos=kpos, query_pos=qpos)
            key_scores = ev.score(psi, keys, alive, at_layer)
            ranking = (log_block_logits(key_scores, alive, ev.block)[0] / ev.temperature
                       if ev.log_blocks else
                       torch.where(exists, block_means(key_scores, alive, ev.block)[0], MISSING))
        K = keep_count(exists.sum(1), rates)  # K = max(1, ⌊(1-ε)N + ½⌋), N: blocks (§4.1)
        # σ (N, Kmax): the top K blocks, or a Gumbel-top-k sample (§4.3)
        sigma = ordered_topk(ranking, K) if ev.greedy else gumbel_topk(ranking, K, generator)
        logps.append(plackett_luce_log_prob(logits, sigma))  # log p(σ) under NGC's policy, eq. (2)
        kv.evict(in_cache, kept_keys(alive, sigma, ev.block))  # the survivors move to the front
        sigmas.append(sigma), before.append(alive.sum(1))
    return sigmas, torch.stack(logps, 1), torch.stack(before, 1)


def round_logits(q, k, seen, alive, ev: Eviction):
    """What R rounds per row decide from (rollout: one; replay: all): q (N, H, R·w, D) each round's
    w queries, k (N, Hkv, S, D), seen (N, R·w, S) the keys each query sees, alive (N, R, S).
    Returns ψ (N, R, S), the attention to each key averaged over heads and w queries (§4.2), and
    per block (N, R, nb) its logit x_j = log s_j / τ (s_j: mean ψ) and whether it exists."""
    N, R, S = alive.shape
    psi = attention_scores(q, k, seen).view(N, R, -1, S).mean(2)  # (N, R, S)
    logits, exists = log_block_logits(psi.flatten(0, 1), alive.flatten(0, 1), ev.block)
    return psi, (logits / ev.temperature).view(N, R, -1), exists.view(N, R, -1)


def attention_scores(q, k, mask):
    """Mean over query heads of softmax(q·kᵀ/√d) per query row in fp32 (§4.2's A): q (N, H, M,
    D) post-RoPE queries, k (N, Hkv, S, D) keys, mask (N, M, S) which keys each query row sees.
    Query head h reads KV group h // (H / Hkv). Returns (N, M, S)."""
    (N, H, M, D), Hkv = q.shape, k.shape[1]
    q = q.float().view(N, Hkv, H // Hkv, M, D)
    att = q @ k.float()[:, :, None].transpose(-1, -2) / math.sqrt(D)  # (N, Hkv, G, M, S)
    att = att.masked_fill(~mask[:, None, None], float("-inf")).softmax(-1)
    return att.mean(dim=(1, 2))  # (N, M, S)


class QueryWindow:
    """Each row's post-RoPE queries of its w newest tokens per layer: ψ's Q (§4.2), in place."""

    def __init__(self, n_layers, batch, w: int, n_head, head_dim, dtype, device):
        self.w = w
        self.q = [torch.zeros(batch, n_head, w, head_dim, dtype=dtype, device=device)
                  for _ in range(n_layers)]  # (B, H, w, D) per layer
        self.pos = torch.zeros(batch, w, dtype=torch.long, device=device)
        self.valid = torch.zeros(batch, w, dtype=torch.bool, device=device)
        self.idx = torch.zeros(batch, w, dtype=torch.long, device=device)

    def advance(self, pos, valid):
        """Before a forward: which w of (window + new tokens) are the newest real tokens."""
        cat_valid, cat_pos = torch.cat([self.valid, valid], 1), torch.cat([self.pos, pos], 1)
        if valid.shape[1] == 1:  # decode: a valid token pushes the oldest out
            self.idx.copy_(torch.arange(self.w, device=pos.device) + valid.long())  # (B, w)
        else:
            order = torch.arange(cat_valid.shape[1], device=pos.device).expand_as(cat_valid)
            newest = torch.where(cat_valid, order, -1).topk(self.w, dim=1).indices
            self.idx.copy_(newest.sort(1).values)  # (B, w)
        self.valid.copy_(cat_valid.gather(1, self.idx))
        self.pos.copy_(cat_pos.gather(1, self.idx))

    def __call__(self, layer, q, k, mask):  # the model's qk_hook
        B, H, _, D = q.shape
        both = torch.cat([self.q[layer], q.to(self.q[layer].dtype)], dim=2)
        self.q[layer].copy_(both.gather(2, self.idx[:, None, :, None].expand(-1, H, -1, D)))

    def keep_rows(self, rows):
        """Keep only batch rows `rows` (N,), in that order (rows that ended leave)."""
        self.q = [q[rows] for q in self.q]
        self.pos, self.valid, self.idx = self.pos[rows], self.valid[rows], self.idx[rows]

    def buffers(self):
        return [*self.q, self.pos, self.valid, self.idx]


# ---- What only makes a rollout fast, then the checks of its arguments ------------------------


def decode_state(model: Qwen2, batch: int, capacity: int, w: int, dtype, device, tight: bool):
    """A KVCache of `capacity` slots per row and a QueryWindow of w queries (None if w = 0)."""
    cfg = model.config
    window = QueryWindow(cfg.num_hidden_layers, batch, w, cfg.num_attention_heads, cfg.head_dim,
                         dtype, device) if w else None
    return KVCache(cfg, batch, capacity, dtype, device, tight), window


def cache_bound(delta: int, block: int, rate: float, tokens: int) -> int:
    """The most KV entries a layer holds at once for a sequence fed `tokens` tokens with a round
    after every δ: its buffers' size. App. A.2's c_{k+1} = (1-ε)c_k + δ (which rises to δ/ε)
    in whole blocks: a round leaves at most g(c) = K·b of c (c if K = N; N = ⌈c/b⌉, K =
    keep_count(N, ε)), g never decreases, so before round k the cache holds at most u_k: u_1 = δ,
    u_{k+1} = g(u_k) + δ; after the last round R = tokens // δ, at most g(u_R) + tokens - Rδ."""
    def survivors(c):  # g(c)
        n = -(-c // block)
        k = int(keep_count(torch.tensor([n]), rate))
        return c if k == n else k * block

    rounds = tokens // delta
    if rounds == 0:
        return tokens
    c = delta  # u_1
    for _ in range(rounds - 1):
        if survivors(c) + delta == c:  # u* reached
            break
        c = survivors(c) + delta
    return max(c, survivors(c) + tokens - rounds * delta)


ROW_STEP = 16  # the decoded batch shrinks in steps of this many rows


def drop_ended_rows(state: RolloutState, active, going: int):
    """Once ROW_STEP rows have ended, the cache and query window keep the rows still going, padded
    with ended ones to a multiple of ROW_STEP (each shrink pays for its copy). A row's results do
    not depend on its batch: bit for bit on one thread (a test), else up to float rounding."""
    live = torch.arange(len(active), device=active.device) if state.live is None else state.live
    size = min(len(live), -(-going // ROW_STEP) * ROW_STEP)
    if size == len(live):
        return
    still = active[live]  # (B',)
    stay = still | ((~still).cumsum(0) <= size - going)  # the rows going, then ended ones to pad
    state.cache.check()  # an overflow is an error before a row leaves, too
    state.final_alive[live[~stay]] = state.cache.alive_counts()[~stay]
    rows = stay.nonzero().flatten()
    state.cache.keep_rows(rows)
    if state.window is not None:
        state.window.keep_rows(rows)
    state.live = live[rows]
    state.cache_row[state.live] = torch.arange(size, device=active.device)


def inverse_cdf_sample(logits, generator=None, noise_rows=None):
    """A token per row (B,) from softmax(logits (B, V)): the first whose cumulative probability
    passes one uniform (torch.multinomial's way on CUDA; on the CPU it draws B·V exponentials).
    Rows that share a uniform (noise_rows) take the same token wherever their softmaxes agree."""
    cdf = logits.softmax(-1).cumsum(-1)  # (B, V)
    total = cdf[:, -1:].contiguous()  # (B, 1)
    u = torch.rand(total.shape, generator=generator, device=total.device)
    u = (u if noise_rows is None else u[noise_rows]) * total
    u = torch.minimum(u, total.nextafter(torch.zeros_like(total)))
    tok = torch.searchsorted(cdf, u, right=True)[:, 0]
    return tok.clamp(max=logits.shape[-1] - 1)  # NaN logits (a diverged model) still give a token


def check_eviction(delta, block, window, rate, temperature=1.0):
    """A one-line ValueError for δ, b, w, ε (a float, or (B,)) or τ the method cannot use."""
    if not all(0 < r <= 1 for r in (rate.tolist() if torch.is_tensor(rate) else [rate])):
        raise ValueError(f"eviction rate ε={rate} must lie in (0, 1]: the fraction evicted")
    if min(block, window) < 1:
        raise ValueError(f"block size b={block} and scoring window w={window} must be at least 1")
    if delta <= window:
        raise ValueError(f"eviction cadence δ={delta} must be larger than the window w={window}")
    if delta < block:
        raise ValueError(f"eviction cadence δ={delta} must be at least the block size b={block}")
    if not temperature > 0:
        raise ValueError(f"eviction temperature τ={temperature} must be positive")


def check_rollout(prompts, meta, vocab_size: int, ev: Eviction | None, rates):
    """A one-line ValueError for prompts, a meta-token g or rates (B,) the method cannot use."""
    if not prompts or min(map(len, prompts)) == 0:
        raise ValueError("rollout needs one or more prompts, each of at least one token")
    if meta is not None and not 0 <= meta < vocab_size:
        raise ValueError(f"meta_token={meta} is not a token id of this model ({vocab_size})")
    if ev is not None and rates is not None:
        rates = torch.as_tensor(rates)
        if (rates < 0).any():
            raise ValueError(f"per-row eviction rates {rates.tolist()} must not be negative (0: "
                             f"the row keeps its full cache)")
        check_eviction(ev.delta, ev.block, ev.window, rates[rates > 0])


# ---- The decode step, captured whole by torch.compile (rollout(..., compile=True)) ----------
# decode_one_token has fixed shapes and no host syncs, so torch.compile takes it as one graph: one
# CUDA graph per shape on CUDA ("reduce-overhead"), inductor's kernels launched from C++ on the CPU.
# It reads and writes the KV cache and query window at fixed addresses, so a model's buffers are
# handed back, zeroed, to its next rollout of the same shape. Results match eager up to rounding.

# CPU: the most cache slots for which the step uses SDPA's math backend. At decode sizes the fused
# CPU kernel costs 0.3-0.5 ms a call however few slots it reads; the math form, fused into the step,
# grows with the slots and is the cheaper one up to about this many (tiny/, batch 64, 2 cores).
SDPA_MATH_MAX_SLOTS = 128


@functools.cache
def compiled_step(step, cuda: bool, sdpa_math: bool):
    """`step` through torch.compile, whole (fullgraph: a host sync would be an error)."""
    if cuda:
        return torch.compile(step, mode="reduce-overhead", fullgraph=True)
    if sdpa_math:
        eager = step

        def step(*args):
            with sdpa_kernel(SDPBackend.MATH):
                return eager(*args)
    return torch.compile(step, fullgraph=True, options={"cpp_wrapper": True})  # launched from C++


# model -> (state_args, (cache, window)) its compiled step last ran on
CAPTURED = weakref.WeakKeyDictionary()


def captured_decode(model, state_args: tuple):
    """(cache, window, compiled decode_one_token) for a rollout whose state_args = (batch, capacity,
    w, dtype, device): decode_state makes them, or the model's last ones are handed back, zeroed,
    so that CUDA graphs captured on their addresses replay instead of being captured again."""
    batch, capacity, w, dtype, device = state_args
    key = (batch, capacity, w, dtype, str(device))
    reused = model in CAPTURED and CAPTURED[model][0] == key
    if not reused:
        CAPTURED[model] = key, decode_state(model, *state_args, tight=False)  # reads all slots
    cache, window = CAPTURED[model][1]
    for t in cache.buffers() + (window.buffers() if window is not None else []):
        if reused:
            t.zero_()  # handed back: the last rollout's entries go
        else:
            torch._dynamo.mark_static_address(t)  # CUDA graphs read and write them in place
    cuda = torch.device(device).type == "cuda"
    sdpa_math = not cuda and capacity <= SDPA_MATH_MAX_SLOTS
    return cache, window, compiled_step(decode_one_token, cuda, sdpa_math)
