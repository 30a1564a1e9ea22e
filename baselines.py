"""The heuristic eviction baselines of the paper's evaluation (§5.1): SnapKV, KeyDiff, KNorm, StreamingLLM.

Each is a per-key score for the engine's eviction round, Eviction(score=..., greedy=True): the
round pools it to blocks by the plain mean and keeps the top K blocks, with NGC's rounds, blocks
and K and the keys at their original positions; only the score differs. Every function maps
(ψ (N, S) NGC's attention score, keys (N, Hkv, S, D), alive (N, S)) to per-key scores (N, S),
higher = keep; dead slots are ignored. Used by eval.py only.
"""
from functools import partial

import torch
import torch.nn.functional as F

SNAPKV_KERNEL = 5
SINKS = 4


def snapkv(psi, keys, alive):
    """SnapKV (Li et al. 2024): ψ smoothed by a 1-D average pool of kernel 5 over the alive keys in
    position order (neighbours by alive rank, dead slots skipped). At the edges the window is cut
    short and the mean is over the alive keys it holds (count_include_pad=False)."""
    order = torch.argsort((~alive).to(torch.uint8), dim=1, stable=True)  # alive slots first, in position order
    m = alive.gather(1, order).float()[:, None]  # (N, 1, S)
    x = psi.gather(1, order)[:, None] * m
    pool = partial(F.avg_pool1d, kernel_size=SNAPKV_KERNEL, stride=1, padding=SNAPKV_KERNEL // 2)
    smooth = (pool(x) / pool(m).clamp(min=1e-9))[:, 0]  # sum over alive neighbours / their count
    return torch.zeros_like(smooth).scatter(1, order, smooth).masked_fill(~alive, 0.0)


def keydiff(psi, keys, alive):
    """KeyDiff (Park et al. 2025): −cos(k_t, mean of the L2-normalised alive keys), per KV head,
    averaged over KV heads."""
    k = keys.float()
    m = alive[:, None, :, None].float()  # (N, 1, S, 1)
    anchor = (F.normalize(k, dim=-1) * m).sum(2, keepdim=True) / m.sum(2, keepdim=True).clamp(min=1)
    return -F.cosine_similarity(k, anchor, dim=-1).mean(1)


def knorm(psi, keys, alive):
    """KNorm (Devoto et al. 2024): −‖k_t‖₂ averaged over KV heads: low-norm keys are kept."""
    return -keys.float().norm(dim=-1).mean(1)


def streamingllm(psi, keys, alive):
    """StreamingLLM (Xiao et al. 2024): attention sinks, then recency: S² for the first 4 alive keys,
    else the key's rank among the alive keys (newer = higher). A block holding a sink has mean
    ≥ S²/b ≥ S, above any other block (< S), and the older of two sink blocks wins the tie; so
    top-K keeps the sink block(s), then the newest blocks."""
    S = alive.shape[1]
    rank = (alive.long().cumsum(1) - 1).float()
    return torch.where(rank < SINKS, float(S * S), rank)
