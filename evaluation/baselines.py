"""The eviction baselines (§5.1: SnapKV, KeyDiff, KNorm, StreamingLLM), random ones, rules for
Countdown, an oracle that looks ahead, and the hindsight bound with its luck control.

Each is a per-key score in place of NGC's ψ, Eviction(score=...): (ψ (N, S), keys (N, Hkv, S, D),
alive (N, S), context: ngc.Round) -> (N, S), higher = keep; the round pools it to blocks by the
mean and keeps the top K (greedy) or Gumbel-top-k samples K. A new baseline is one function and
its line in POLICIES, which eval.py --policy builds by name (`build`).
"""
from dataclasses import replace
from functools import partial
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from ngc import Eviction, Rollout, attention_scores

SNAPKV_KERNEL = 5
BOUND_TEMPERATURE = 0.15  # the hindsight bound's draws: Gumbel-top-k over log(lookahead) / 0.15
DRAWS = 16  # the hindsight bound's eviction draws per problem and sample (eval.py --draws)
SINKS = 4
TARGET_MARKER = "reach"  # the tiny prompt's word before the target


def snapkv(psi, keys, alive, context=None):
    """SnapKV (Li et al. 2024): ψ averaged over a window of 5 alive keys in position order."""
    order = torch.argsort((~alive).to(torch.uint8), dim=1, stable=True)
    m = alive.gather(1, order).float()[:, None]  # (N, 1, S)
    x = psi.gather(1, order)[:, None] * m
    pool = partial(F.avg_pool1d, kernel_size=SNAPKV_KERNEL, stride=1, padding=SNAPKV_KERNEL // 2)
    smooth = (pool(x) / pool(m).clamp(min=1e-9))[:, 0]  # sum over alive neighbours / their count
    return torch.zeros_like(smooth).scatter(1, order, smooth).masked_fill(~alive, 0.0)


def keydiff(psi, keys, alive, context=None):
    """KeyDiff (Park et al. 2025): −cos(k_t, mean of the L2-normalised alive keys), averaged over
    KV heads."""
    k = keys.float()
    m = alive[:, None, :, None].float()  # (N, 1, S, 1)
    anchor = (F.normalize(k, dim=-1) * m).sum(2, keepdim=True) / m.sum(2, keepdim=True).clamp(min=1)
    return -F.cosine_similarity(k, anchor, dim=-1).mean(1)


def knorm(psi, keys, alive, context=None):
    """KNorm (Devoto et al. 2024): −‖k_t‖₂ averaged over KV heads."""
    return -keys.float().norm(dim=-1).mean(1)


def streamingllm(psi, keys, alive, context=None):
    """StreamingLLM (Xiao et al. 2024): the blocks of the first 4 alive keys (attention sinks), then
    the newest."""
    return pinned_then_newest(alive, (alive.long().cumsum(1) - 1) < SINKS)


def pinned_then_newest(alive, pinned):
    """S² for the pinned keys, else the rank among the alive keys (newer = higher): a block holding
    a pinned key has mean ≥ S²/b ≥ S, above any other (< S)."""
    S = alive.shape[1]
    return torch.where(pinned, float(S * S), (alive.long().cumsum(1) - 1).float())


def uniform(psi, keys, alive, context=None):
    """Random (with greedy=False): Gumbel-top-k keeps K blocks uniformly."""
    return torch.zeros_like(psi)


def random_prompt(psi, keys, alive, context):
    """Random Attention (2026; greedy=False): a block scores 10⁶ (above any Gumbel noise) × its
    share of prompt keys: prompt blocks first, then random."""
    return torch.where(context.key_pos < context.prompt_lens[:, None], 1e6, 0.0)


def task_rule(marker: int):
    """Countdown's rule: the block holding the target (after token `marker`), then the newest."""
    def score(psi, keys, alive, context):
        after = torch.cat([torch.zeros_like(context.prompts[:, :1], dtype=torch.bool),
                           context.prompts[:, :-1] == marker], 1)
        # (N,) the target's position, -1: none
        target_pos = torch.where(after.any(1), after.float().argmax(1), -1)
        return pinned_then_newest(alive, alive & (context.key_pos == target_pos[:, None]))
    return score


def number_rule(is_number):
    """The blocks holding the prompt's numbers (is_number (V,)), then the newest."""
    def score(psi, keys, alive, context):
        P = context.prompts.shape[1]
        in_prompt = context.key_pos < context.prompt_lens[:, None]  # (N, S)
        # (N, S): the key's token is a number
        number = is_number[context.prompts].gather(1, context.key_pos.clamp(max=P - 1))
        return pinned_then_newest(alive, alive & in_prompt & number)
    return score


@torch.no_grad()
def future_attention(model, reference: Rollout):
    """Per layer, (B, T + 1, T): row t sums the attention the reference's queries < t paid."""
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
    """The oracle: a round after token t scores each key by the attention the full-cache rollout's
    queries t+1..t+δ paid it (cumulative: its future_attention); ties go to the newer key."""
    def score(psi, keys, alive, context):
        c = cumulative[context.layer]  # (B, T + 1, T): the round's rows read in place, not copied
        T = c.shape[2]
        t = context.query_pos[:, -1].clamp(max=T - 1)  # (N,) the newest token
        ahead = (t + 1 + delta).clamp(max=T)
        paid = c[context.rows, ahead] - c[context.rows, t + 1]
        rank = (alive.long().cumsum(1) - 1).float() / alive.shape[1]  # in [0, 1): newer higher
        return paid.gather(1, context.key_pos.clamp(0, T - 1)) + 1e-6 * rank
    return score


class PolicyInputs(NamedTuple):  # what eval.py hands every policy it builds
    layout: Eviction  # the run's δ, b and w, and the ε evaluated
    model: object
    tokenizer: object
    task: str
    reference: Callable[[], Rollout] | None = None  # the batch's full-cache rollout; None: a check


class Policy(NamedTuple):
    greedy: bool  # keep the top K blocks; False: Gumbel-top-k with the block means as logits
    score: Callable | None  # the per-key score; None: NGC's ψ, or the one bind makes
    help: str  # its line in eval.py --help
    bind: Callable | None = None  # bind(inputs) -> the score (or a one-line ValueError)
    # ngc, agnostic, rule (Countdown only), oracle, bound (solved if any of --draws draws solves)
    kind: str = "agnostic"
    temperature: float | None = None  # Gumbel-top-k over log s_j / temperature, not the means


def build(name: str, inputs: PolicyInputs) -> Eviction:
    p = POLICIES[name]
    if p.kind == "rule" and inputs.task != "countdown":
        raise ValueError(f"--policy {name} keeps the block of a Countdown prompt's target; this "
                         f"evaluation's task is {inputs.task}: leave {name} out")
    logs = {} if p.temperature is None else dict(log_blocks=True, temperature=p.temperature)
    return replace(inputs.layout, greedy=p.greedy, score=p.bind(inputs) if p.bind else p.score,
                   **logs)


def target_marker(inputs: PolicyInputs) -> int:
    marker = inputs.tokenizer.token_to_id(TARGET_MARKER)
    if marker is None:
        raise ValueError(f"--policy task-rule keeps the token after '{TARGET_MARKER}' (the tiny "
                         f"prompt's target); this tokenizer has no such token")
    return marker


def number_tokens(inputs: PolicyInputs):
    vocab = inputs.tokenizer.get_vocab()
    is_number = torch.zeros(max(vocab.values()) + 1, dtype=torch.bool)
    is_number[[i for text, i in vocab.items() if text.isdigit()]] = True
    return is_number.to(inputs.model.lm_head.weight.device)


def oracle(inputs: PolicyInputs):
    """lookahead on the batch's full-cache rollout; without one, a score that refuses to run."""
    if inputs.reference is None:
        def unbound(*args):
            raise ValueError("the oracle reads the batch's full-cache rollout: build it with "
                             "PolicyInputs.reference")
        return unbound
    return lookahead(future_attention(inputs.model, inputs.reference()), inputs.layout.delta)


POLICIES = {  # --policy name -> Policy, in eval.py --help's order
    "ngc": Policy(True, None, "greedy top-K blocks on NGC's scores: the paper's evaluation",
                  kind="ngc"),
    "ngc-sample": Policy(False, None, "Gumbel-top-k blocks, as in training", kind="ngc"),
    "snapkv": Policy(True, snapkv, f"SnapKV: ψ smoothed over {SNAPKV_KERNEL} neighbouring keys "
                                   "(deterministic, as the next three)"),
    "keydiff": Policy(True, keydiff, "KeyDiff: the keys least like the mean key"),
    "knorm": Policy(True, knorm, "KNorm: the keys of lowest norm"),
    "streamingllm": Policy(True, streamingllm, f"StreamingLLM: the {SINKS} attention sinks' "
                                               "blocks, then the newest"),
    "random": Policy(False, uniform, "K blocks uniformly at random"),
    "random-prompt": Policy(False, random_prompt, "the prompt's blocks, then random completion "
                            "blocks (Random Attention, 2026)"),
    "task-rule": Policy(True, None, "Countdown's hand-written rule: the block holding the target, "
                        "then the newest", bind=lambda inputs: task_rule(target_marker(inputs)),
                        kind="rule"),
    "number-rule": Policy(True, None, "the same with the numbers: the blocks holding the prompt's "
                          "target and numbers, then the newest",
                          bind=lambda inputs: number_rule(number_tokens(inputs)), kind="rule"),
    "oracle": Policy(True, None, "the blocks the full-cache rollout's next δ tokens attend to "
                     "most (a heuristic that sees the future, not an optimum)", bind=oracle,
                     kind="oracle"),
    "bound": Policy(False, None, f"the hindsight bound: solved if any of --draws eviction draws "
                    f"around the oracle's scores (Gumbel-top-k over log attention / "
                    f"{BOUND_TEMPERATURE:g}, the token noise fixed) solves: an estimate "
                    "from above of what schedules exist, not a policy", bind=oracle, kind="bound",
                    temperature=BOUND_TEMPERATURE),
    "luck": Policy(False, uniform, "the bound's luck control: the same --draws, each K blocks "
                   "uniformly at random", kind="bound"),
}
