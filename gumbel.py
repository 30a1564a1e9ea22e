"""Block-level eviction actions (paper §4.2–4.3).

A layer's alive keys, in position order, are cut into N = ceil(T/b) blocks; per-key scores are
pooled per block; K blocks are kept, by Gumbel-top-k or greedily, and the ordered kept sequence σ
has an exact Plackett-Luce log-probability. Batched over a leading dimension N, no loop over blocks.
"""
import torch

MISSING = -1e9  # logit of a block that does not exist: finite, so no NaN reaches a gradient
MIN_SCORE = 1e-30  # block scores are clamped here before the log


def keep_count(n_blocks, rate):
    """K = max(1, floor((1 - ε)·N + 1/2)) for n_blocks N (a long tensor) at rate ε (a float or a
    tensor of them); the small slack keeps (1 - 0.7)·10 from rounding down through fp error."""
    rate = torch.as_tensor(rate, dtype=torch.float64, device=n_blocks.device)
    k = torch.floor((1 - rate) * n_blocks + 0.5 + 1e-9).long()
    return torch.minimum(k.clamp(min=1), n_blocks.clamp(min=1))


def block_ids(alive, block_size: int):
    """(N, S) block index of each alive key (its rank among alive keys // b); -1 if dead."""
    rank = alive.long().cumsum(1) - 1
    return torch.where(alive, rank // block_size, -1)


def block_means(key_scores, alive, block_size: int):
    """Mean of key_scores (N, S) over the alive (N, S) keys of each block, §4.2's s_j: means
    (N, M), M = ceil(S / b), and exists (N, M), True for row i's first ceil(alive_i / b)."""
    N, S = alive.shape
    M = -(-S // block_size)
    slot = torch.where(alive, block_ids(alive, block_size), M)  # dead keys land in a spare column
    scores = torch.where(alive, key_scores.float(), 0.0)
    sums = scores.new_zeros(N, M + 1).scatter_add(1, slot, scores)[:, :M]
    counts = scores.new_zeros(N, M + 1).scatter_add(1, slot, alive.float())[:, :M]
    return sums / counts.clamp(min=1), counts > 0


def log_block_logits(key_scores, alive, block_size: int):
    """NGC's policy logits x_j = log s_j, fp32. The paper's s_j are attention probabilities
    (spread ≤ 1): as raw logits they give a nearly uniform policy; their log lets Gumbel-top-k
    keep blocks in proportion to the attention mass they receive, and become as sharp as needed."""
    means, exists = block_means(key_scores, alive, block_size)
    return torch.where(exists, means.clamp(min=MIN_SCORE).log(), MISSING), exists


def ordered_topk(scores, k):
    """Indices (N, max k) of the k_i largest scores, largest first, -1 padded; ties: lower index."""
    order = torch.argsort(scores, dim=1, descending=True, stable=True)
    kmax = int(k.max())
    return torch.where(torch.arange(kmax, device=k.device) < k[:, None], order[:, :kmax], -1)


def gumbel_topk(logits, k, generator=None):
    """Sample ordered K-subsets without replacement (Gumbel-top-k, Kool et al. 2019):
    perturb the logits with i.i.d. Gumbel(0, 1) noise and keep the k largest, in order."""
    u = torch.rand(logits.shape, generator=generator, device=logits.device, dtype=torch.float32)
    gumbel = -torch.log(-torch.log(u.clamp(min=1e-20, max=1 - 1e-7)))
    return ordered_topk(logits.float() + gumbel, k)


def plackett_luce_log_prob(logits, sigma):
    """log p(σ) = Σ_{j<K} [ x_{σ_j} - log Σ_{i ∉ {σ_1..σ_{j-1}}} exp x_i ]   # paper eq. (2)

    logits (N, M) with MISSING at absent blocks; sigma (N, Kmax), -1 padded. Laid out as [kept
    blocks in σ order | every other block], each denominator is a suffix log-sum-exp (a reverse
    logcumsumexp): nothing is subtracted, so it stays exact where the paper's log(1 - cumsum p)
    gives -inf or NaN in fp32 once the policy is peaked."""
    logits = logits.float()
    present = sigma >= 0
    chosen = logits.gather(1, sigma.clamp(min=0)).masked_fill(~present, MISSING)  # (N, Kmax)
    rest = logits.masked_fill(kept_blocks(sigma, logits.shape[1]), MISSING)  # (N, M)
    x = torch.cat([chosen, rest], dim=1)
    suffix_lse = torch.logcumsumexp(x.flip(1), dim=1).flip(1)[:, : sigma.shape[1]]
    return torch.where(present, chosen - suffix_lse, 0.0).sum(1)  # (N,)


def kept_blocks(sigma, n_blocks: int):
    """(N, n_blocks) bool: True at the blocks listed in sigma (N, Kmax), -1 padded."""
    flags = torch.zeros(sigma.shape[0], n_blocks + 1, dtype=torch.bool, device=sigma.device)
    return flags.scatter_(1, torch.where(sigma >= 0, sigma, n_blocks), True)[:, :n_blocks]


def kept_keys(alive, sigma, block_size: int):
    """(N, S) bool: the alive keys whose block is among the kept blocks sigma (N, Kmax)."""
    M = -(-alive.shape[1] // block_size)
    return alive & kept_blocks(sigma, M).gather(1, block_ids(alive, block_size).clamp(min=0))
