"""The eviction baselines: the paper's heuristics (§5.1: SnapKV, KeyDiff, KNorm, StreamingLLM) and the
bars any learned policy must clear: random blocks, random completion blocks behind the prompt, a
hand-written rule for the task, and an oracle that looks ahead.

Each is a per-key score for the engine's eviction round, Eviction(score=...): the round pools it
to blocks by the plain mean and keeps the top K blocks (greedy=True), or samples K by Gumbel-top-k
with the block means as logits (greedy=False: the random baselines), with NGC's rounds, blocks
and K and the keys at their original positions; only the score differs. Every score maps
(ψ (N, S) NGC's attention score, keys (N, Hkv, S, D), alive (N, S), at: ngc.Round) to per-key
scores (N, S), higher = keep; dead slots are ignored. Used by eval.py only.
"""
from functools import partial

import torch
import torch.nn.functional as F

from ngc import Rollout, attention_scores

SNAPKV_KERNEL = 5
SINKS = 4


def snapkv(psi, keys, alive, at=None):
    """SnapKV (Li et al. 2024): ψ smoothed by a 1-D average pool of kernel 5 over the alive keys in
    position order (neighbours by alive rank, dead slots skipped). At the edges the window is cut
    short and the mean is over the alive keys it holds (count_include_pad=False)."""
    order = torch.argsort((~alive).to(torch.uint8), dim=1, stable=True)  # alive slots first, in position order
    m = alive.gather(1, order).float()[:, None]  # (N, 1, S)
    x = psi.gather(1, order)[:, None] * m
    pool = partial(F.avg_pool1d, kernel_size=SNAPKV_KERNEL, stride=1, padding=SNAPKV_KERNEL // 2)
    smooth = (pool(x) / pool(m).clamp(min=1e-9))[:, 0]  # sum over alive neighbours / their count
    return torch.zeros_like(smooth).scatter(1, order, smooth).masked_fill(~alive, 0.0)


def keydiff(psi, keys, alive, at=None):
    """KeyDiff (Park et al. 2025): −cos(k_t, mean of the L2-normalised alive keys), per KV head,
    averaged over KV heads."""
    k = keys.float()
    m = alive[:, None, :, None].float()  # (N, 1, S, 1)
    anchor = (F.normalize(k, dim=-1) * m).sum(2, keepdim=True) / m.sum(2, keepdim=True).clamp(min=1)
    return -F.cosine_similarity(k, anchor, dim=-1).mean(1)


def knorm(psi, keys, alive, at=None):
    """KNorm (Devoto et al. 2024): −‖k_t‖₂ averaged over KV heads: low-norm keys are kept."""
    return -keys.float().norm(dim=-1).mean(1)


def streamingllm(psi, keys, alive, at=None):
    """StreamingLLM (Xiao et al. 2024): attention sinks, then recency: S² for the first 4 alive keys,
    else the key's rank among the alive keys (newer = higher). A block holding a sink has mean
    ≥ S²/b ≥ S, above any other block (< S), and the older of two sink blocks wins the tie; so
    top-K keeps the sink block(s), then the newest blocks."""
    return pinned_then_newest(alive, (alive.long().cumsum(1) - 1) < SINKS)


def pinned_then_newest(alive, pinned):
    """S² for the pinned keys (N, S), else the key's rank among the alive keys (newer = higher):
    top-K keeps the blocks holding a pinned key, then the newest."""
    S = alive.shape[1]
    return torch.where(pinned, float(S * S), (alive.long().cumsum(1) - 1).float())


# ---------------------------------------------------------------------------------------
# Baselines that could beat a learned policy


PROMPT = 1e6  # a prompt key's score in random-prompt: far above any Gumbel noise


def uniform(psi, keys, alive, at=None):
    """Random (with greedy=False): every block scores the same, so Gumbel-top-k keeps K blocks
    uniformly at random."""
    return torch.zeros_like(psi)


def random_prompt(psi, keys, alive, at):
    """Random Attention (2026; with greedy=False): the prompt's blocks kept, the rest of the K drawn
    uniformly from the completion's blocks. A block scores 10⁶ × its share of prompt keys, so whole
    prompt blocks come first, then a block the prompt shares with the completion; when the prompt
    blocks alone exceed K, K of the whole prompt blocks are kept at random and no completion block."""
    return torch.where(at.key_pos < at.prompt_lens[:, None], PROMPT, 0.0)


def task_rule(marker: int):
    """The hand-written rule for Countdown: keep the block holding the target (the token after
    `marker`, the token id of 'reach' in the tiny prompt), then the newest blocks (greedy=True)."""
    def score(psi, keys, alive, at):
        after = torch.cat([torch.zeros_like(at.prompts[:, :1], dtype=torch.bool), at.prompts[:, :-1] == marker], 1)
        target_pos = torch.where(after.any(1), after.float().argmax(1), -1)  # (N,) the target's position, -1: none
        return pinned_then_newest(alive, alive & (at.key_pos == target_pos[:, None]))
    return score


def number_rule(is_number):
    """Countdown's rule with the numbers: keep the blocks holding the prompt's numbers (its target and the
    numbers it gives: the tokens where is_number (V,) bool is True), then the newest blocks (greedy=True)."""
    def score(psi, keys, alive, at):
        P = at.prompts.shape[1]
        in_prompt = at.key_pos < at.prompt_lens[:, None]  # (N, S)
        number = is_number[at.prompts].gather(1, at.key_pos.clamp(max=P - 1))  # (N, S): the key's token is a number
        return pinned_then_newest(alive, alive & in_prompt & number)
    return score


@torch.no_grad()
def future_attention(model, reference: Rollout):
    """Per layer, (B, T + 1, T): row t is the attention that the queries at positions < t of the
    reference rollout paid to each key position (mean over heads), summed: a cumulative sum over queries."""
    B, T = reference.tokens.shape
    pos = torch.arange(T, device=reference.tokens.device).expand(B, T)
    real = pos < reference.lengths[:, None]  # (B, T): the reference's own tokens
    causal = torch.ones(T, T, dtype=torch.bool, device=pos.device).tril().expand(B, T, T)
    cumulative = []

    def hook(layer, q, k, mask):
        att = attention_scores(q, k, causal) * real[:, :, None]  # (B, T queries, T keys)
        cumulative.append(F.pad(att.cumsum(1), (0, 0, 1, 0)))

    model(reference.tokens, pos, qk_hook=hook)
    return cumulative


def lookahead(cumulative, delta: int):
    """The oracle (greedy=True): keep the blocks that the full-cache rollout's next δ tokens attend to
    most. A round after token t scores each key by the attention the reference's queries t+1..t+δ
    paid it (cumulative: future_attention of that rollout, made from the same noise), so while the
    evicting rollout follows the reference, the round keeps exactly what the next δ tokens will
    read; ties (past the reference's end) go to the newer key."""
    def score(psi, keys, alive, at):
        c = cumulative[at.layer][at.rows]  # (N, T + 1, T)
        T = c.shape[2]
        t = at.query_pos[:, -1:].clamp(max=T - 1)  # (N, 1) the newest token
        ahead = (t + 1 + delta).clamp(max=T)
        rows_of = lambda i: c.gather(1, i[:, :, None].expand(-1, 1, T))[:, 0]  # (N, T)
        paid = rows_of(ahead) - rows_of(t + 1)  # (N, T) attention of queries t+1..t+δ to each position
        rank = (alive.long().cumsum(1) - 1).float() / alive.shape[1]  # in [0, 1): newer higher
        return paid.gather(1, at.key_pos.clamp(0, T - 1)) + 1e-6 * rank
    return score
