"""Replay: one forward pass that reproduces a rollout (paper §4.5, Appendix A.3).

Every layer dropped its own blocks at every round, so a key is visible from its own position until
the round that evicted it: one death time per (layer, key), and the layer's (T, T) mask is

    visible[t, s] = s <= t < death[s]

built right before that layer's attention. The same pass recomputes each round's eviction
log-probability from its own queries and keys, so L_mem's gradient reaches every q_proj and k_proj.
"""
import torch

from gumbel import kept_keys, plackett_luce_log_prob
from ngc import Eviction, Rollout, round_logits

NEVER = torch.iinfo(torch.long).max


def death_times(kept, n_rounds, T: int, delta: int, block: int):
    """(B, L, T): the first token that no longer sees key s at layer l (NEVER if none), from kept
    (B, R, L, Kmax), -1 padded. A key round r evicts (after token (r+1)δ-1) dies at (r+1)δ."""
    B, R, L, _ = kept.shape
    s = torch.arange(T, device=kept.device)
    death = torch.full((B, L, T), NEVER, dtype=torch.long, device=kept.device)
    for r in range(R):  # rounds are sequential: round r cuts what survived round r-1
        end = (r + 1) * delta - 1
        alive = (s <= end) & (death == NEVER)  # (B, L, T)
        keep = kept_keys(alive.flatten(0, 1), kept[:, r].flatten(0, 1), block).view(B, L, T)
        fired = (r < n_rounds)[:, None, None]
        death = torch.where(fired & alive & ~keep, end + 1, death)
    return death


def evicted_by(death, delta: int):
    """The 0-based round that evicted each key, from its death time (-1 where none did)."""
    return torch.where(death == NEVER, -1, death // delta - 1)


def visibility(death):
    """(B, T, T) bool replay mask of one layer from its death times (B, T): s <= t < death[s]. A key
    dies after its own token (death[s] > s), so every token sees itself."""
    t = torch.arange(death.shape[1], device=death.device)
    return (t[None, None, :] <= t[None, :, None]) & (t[None, :, None] < death[:, None, :])


def round_log_probs(q, k, mask, kept, n_rounds, ev: Eviction):
    """log p(σ) (B, R) of one layer's rounds, from this pass's q (B, H, T, D), k (B, Hkv, T, D)
    and visibility mask (B, T, T); kept (B, R, Kmax). Scored as the rollout's round scored them."""
    B, R = kept.shape[:2]
    ends = torch.arange(1, R + 1, device=q.device) * ev.delta - 1  # round r fires after ends[r]
    rows = (ends[:, None] + torch.arange(1 - ev.window, 1, device=q.device)).flatten()  # (R·w,)
    seen = mask[:, rows]  # (B, R·w, T); each round's end, its last query, sees its alive keys
    _, logits, _ = round_logits(q[:, :, rows], k, seen, mask[:, ends], ev)
    logp = plackett_luce_log_prob(logits.flatten(0, 1), kept.flatten(0, 1)).view(B, R)
    return torch.where(torch.arange(R, device=q.device) < n_rounds[:, None], logp, 0.0)


def replay(model, ro: Rollout, causal: bool = False):
    """Token log-probs (B, T) and eviction log-probs (B, R, L) of rollouts ro, on the graph, under
    the δ, b, w and temperature recorded; prompt tokens and forced meta-tokens get 0. causal=True
    (or no eviction): the plain causal mask, no eviction log-probs ("targeted dropout" ablation)."""
    layout = ro.eviction  # δ, b, w as the rollout was made
    B, T = ro.tokens.shape
    pos = torch.arange(T, device=ro.tokens.device).expand(B, T)
    layer_mask, hook, per_layer = None, None, []  # per_layer: each layer's log p(σ) (B, R)
    if layout is not None and not causal and ro.kept.shape[1] > 0:
        death = death_times(ro.kept, ro.n_rounds, T, layout.delta, layout.block)

        def score_rounds(layer, q, k, mask):
            per_layer.append(round_log_probs(q, k, mask, ro.kept[:, :, layer], ro.n_rounds, layout))

        layer_mask, hook = lambda layer: visibility(death[:, layer]), score_rounds
    h = model(ro.tokens, pos, layer_mask=layer_mask, qk_hook=hook)
    evict_logps = torch.stack(per_layer, dim=2) if hook else None  # (B, R, L)
    t = torch.arange(1, T, device=pos.device)
    target = (t >= ro.prompt_lens[:, None]) & (t < ro.lengths[:, None])  # (B, T-1): completions
    target &= ~ro.forced[:, 1:]  # a forced meta-token was not sampled: no log-prob (still a key)
    logits = model.logits(h[:, :-1][target]).float() / ro.sampling.temperature  # (N, V)
    lp = logits.gather(1, ro.tokens[:, 1:][target][:, None]).squeeze(1) - logits.logsumexp(-1)
    token_logps = torch.zeros(B, T - 1, device=lp.device).masked_scatter(target, lp)
    return torch.nn.functional.pad(token_logps, (1, 0)), evict_logps
