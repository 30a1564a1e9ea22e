"""The paper's claims, in the paper's order: replay equals the rollout that made it, L_mem's
gradient reaches every q/k projection, the losses of eqs. 3-5 by hand, batch independence,
Gumbel-top-k is Plackett-Luce, the memory bound of App. A.2, one eviction round by hand and
every policy's K blocks, the curriculum of §4.6, targeted dropout's mask and the meta-token.

The rest lives in tests/: test_model.py (the Qwen2 model, checkpoints), test_engine.py
(rollout engine details, sampling, the baselines' scores), test_train.py (train.py),
test_distributed.py (torchrun), test_tasks.py (Countdown, math), test_eval.py (eval.py, show.py,
reproduce.py), test_shipped.py (make_tiny.py, tiny/, tiny-math/); shared fixtures in tests/conftest.py.
Run them all: pytest
"""
import itertools
import math
import types
from dataclasses import replace

import pytest
import torch

import model as model_module
import ngc
import train

from gumbel import block_means, gumbel_topk, keep_count, kept_keys, ordered_topk, plackett_luce_log_prob
from model import KVCache, LayerCache
from ngc import Eviction, Sampling, rollout
from replay import death_times, replay, visibility
from evaluation import baselines
from lib import settings
from lib.checkpoint import from_pretrained
from conftest import EOS, EV, TINY_MODEL, hand_built_cache, one_round, prompts_of, psi_by_hand


# ---------------------------------------------------------------------------------------
# 1. Replay = rollout (§4.5, App. A.3)


def test_rollout_covers_the_hard_cases(sampled):
    ro = sampled
    assert ro.eos.any() and (~ro.eos).any(), "want rows ending by EOS and by max length"
    assert len(set(ro.lengths.tolist())) >= 3
    assert int(ro.n_rounds.max()) >= 3
    first = ro.kept[:, 0]  # (B, L, Kmax): layers decide differently
    assert any(not torch.equal(first[i, 0], first[i, layer]) for i in range(len(first)) for layer in (1, 2))


def test_replay_reproduces_rollout_logprobs(model, sampled):
    tok_lp, ev_lp = replay(model, sampled)
    completion = torch.arange(sampled.tokens.shape[1]) >= sampled.prompt_lens[:, None]
    completion &= torch.arange(sampled.tokens.shape[1]) < sampled.lengths[:, None]
    tok_diff = (tok_lp - sampled.logprobs)[completion].abs().max().item()
    ev_diff = (ev_lp - sampled.evict_logprobs).abs().max().item()
    print(f"max |replay - rollout|: tokens {tok_diff:.2e}, evictions {ev_diff:.2e}")
    assert tok_diff < 1e-5
    assert ev_diff < 1e-4
    # Negative control: the plain causal mask sees evicted entries, so it must not match.
    causal_lp, _ = replay(model, sampled, causal=True)
    causal_diff = (causal_lp - sampled.logprobs)[completion].abs().max().item()
    print(f"max |causal - rollout|: {causal_diff:.2e}")
    assert causal_diff > 1e-2


def test_replay_reproduces_a_rollout_at_another_eviction_temperature(model):
    """With τ ≠ 1 (--eviction-temperature) replay scores σ over log s_j / τ, as the rollout drew it."""
    ro = rollout(model, prompts_of([5, 17, 9]), Sampling(max_new_tokens=60, temperature=1.0, top_k=0),
                 replace(EV, temperature=0.5), eos_ids=[EOS], generator=torch.Generator().manual_seed(3))
    _, ev_lp = replay(model, ro)
    assert int(ro.n_rounds.max()) >= 3 and (ev_lp - ro.evict_logprobs).abs().max() < 1e-4
    # Negative control: the same σ replayed as if drawn at τ = 1
    _, at_one = replay(model, replace(ro, eviction=replace(ro.eviction, temperature=1.0)))
    assert (at_one - ro.evict_logprobs).abs().max() > 1e-2


def test_replay_without_eviction_is_causal(model):
    ro = rollout(model, prompts_of([4, 9]), Sampling(max_new_tokens=20, temperature=1.0, top_k=5), None,
                 generator=torch.Generator().manual_seed(0))
    tok_lp, ev_lp = replay(model, ro)
    assert ev_lp is None and ro.kept.shape[1] == 0
    completion = tok_lp != 0
    assert completion.sum() == (ro.lengths - ro.prompt_lens).sum()
    assert (tok_lp - ro.logprobs).abs().max() < 1e-5


EV10 = Eviction(delta=10, block=2, window=3, rate=0.5)


@pytest.fixture(scope="module")
def made_with_delta_10(model):
    return rollout(model, prompts_of([4, 13, 8]), Sampling(max_new_tokens=30, temperature=0.8, top_k=20), EV10,
                   rates=[0.5, 0.25, 0.5], generator=torch.Generator().manual_seed(1))


def test_a_rollout_knows_how_it_was_made(model, made_with_delta_10):
    ro = made_with_delta_10
    assert ro.eviction == EV10 and (ro.sampling.temperature, ro.sampling.top_k) == (0.8, 20)
    assert ro.rates.tolist() == [0.5, 0.25, 0.5] and int(ro.n_rounds.min()) >= 2
    tok_lp, ev_lp = replay(model, ro)  # δ, b, w and the temperature from the rollout
    completion = (tok_lp != 0) | (ro.logprobs != 0)
    assert (tok_lp - ro.logprobs)[completion].abs().max() < 1e-5
    assert (ev_lp - ro.evict_logprobs).abs().max() < 1e-4
    row = ro.select(torch.tensor([1]))  # select keeps the settings
    assert row.eviction == EV10 and row.sampling == ro.sampling and row.rates.tolist() == [0.25]
    n = int(row.lengths[0])
    assert (replay(model, row)[0][0, :n] - tok_lp[1, :n]).abs().max() < 1e-5
    # Negative control: the same records relabelled with another δ or temperature replay to other log-probs.
    for wrong in (replace(ro, eviction=replace(EV10, delta=9)), replace(ro, eviction=replace(EV10, block=3)),
                  replace(ro, sampling=replace(ro.sampling, temperature=1.0))):
        assert (replay(model, wrong)[0] - ro.logprobs)[completion].abs().max() > 1e-2


# ---------------------------------------------------------------------------------------
# 2. Gradients reach θ through evictions (§4.4-4.5)


def test_eviction_loss_reaches_every_q_and_k_projection(ckpt, sampled):
    model = from_pretrained(ckpt)
    _, ev_lp = replay(model, sampled)
    ev_lp.sum().backward()
    norms = []
    for layer in model.layers:
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
            g = proj.weight.grad
            assert g is not None and torch.isfinite(g).all() and g.abs().max() > 0
            norms.append(g.norm().item())
    print("eviction-term grad norms (q, k per layer):", ", ".join(f"{n:.2e}" for n in norms))
    # Negative control: the rollout's own eviction log-probs are detached.
    assert not sampled.evict_logprobs.requires_grad


# ---------------------------------------------------------------------------------------
# 3. The objective (eqs. 3-5): Dr. GRPO over tokens and evictions (§4.4)


def test_group_advantages_are_centred_within_each_group():
    reward = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0])
    adv = train.group_advantages(reward, group=4)
    assert adv.view(2, 4).sum(1).abs().max() < 1e-7  # each group's advantages sum to zero
    assert torch.allclose(adv, torch.tensor([0.75, -0.25, -0.25, -0.25, 0.25, 0.25, 0.25, -0.75]))
    assert torch.equal(train.group_advantages(torch.ones(4), group=2), torch.zeros(4))  # no signal, no update


def test_losses_of_a_hand_built_batch_equal_the_equations(monkeypatch):
    """Two rollouts with chosen log-probs, the losses by hand:
    L_token = -Σ_i A_i Σ_t log π_it / (n · T_max)                       eq. (3), Dr. GRPO's constant
    L_mem   = -Σ_ℓ (1/n) Σ_i A_i · mean over i's rounds of log p(σ)     eq. (4)"""
    tok_lp = torch.tensor([[0.0, -1.0, -2.0, 0.0], [-0.5, -0.5, 0.0, 0.0]])
    ev_lp = torch.tensor([[[-1.0, -2.0], [-3.0, -4.0]],  # rollout 0: 2 rounds x 2 layers
                          [[-0.5, -1.5], [0.0, 0.0]]])  # rollout 1: 1 round, the second is padding
    ro = types.SimpleNamespace(n_rounds=torch.tensor([2, 1]))
    monkeypatch.setattr(train, "replay", lambda *args, **kwargs: (tok_lp, ev_lp))
    c = settings.Settings(mode="ngc", max_new_tokens=10)
    adv = torch.tensor([0.5, -0.5])
    terms = train.policy_losses(None, ro, adv, train.MODES[c.mode], c.max_new_tokens, n_total=4)
    l_token, l_mem = terms["L_token"], terms["L_mem"]
    # L_token = -(0.5·(-3) + (-0.5)·(-1)) / (4·10) = 1/40
    assert l_token.item() == pytest.approx(1 / 40, abs=1e-9)
    # rollout 0: layer means (-1-3)/2 = -2, (-2-4)/2 = -3; rollout 1: -0.5, -1.5 (one round)
    # L_mem = -(0.5·(-2-3) + (-0.5)·(-0.5-1.5)) / 4 = 1.5/4
    assert l_mem.item() == pytest.approx(1.5 / 4, abs=1e-9)
    c = replace(c, mode="token-only")
    assert list(train.policy_losses(None, ro, adv, train.MODES[c.mode], c.max_new_tokens, n_total=4)) == ["L_token"]


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_one_step_on_l_mem_moves_log_p_sigma_with_the_advantage(ckpt, sampled, sign):
    """Gradient descent on L_mem alone raises log p(σ) of a rollout with A > 0 and lowers it with
    A < 0, for each rollout on its own (so no other rollout's gradient interferes)."""
    c = settings.Settings(mode="ngc", max_new_tokens=30)
    for row in range(len(sampled.n_rounds)):
        if sampled.n_rounds[row] == 0:
            continue
        model = from_pretrained(ckpt)
        ro = sampled.select(torch.tensor([row]))
        before = replay(model, ro)[1].sum().item()
        terms = train.policy_losses(model, ro, torch.tensor([sign]), train.MODES[c.mode], c.max_new_tokens, n_total=1)
        l_mem = terms["L_mem"]
        l_mem.backward()
        torch.optim.SGD(model.parameters(), lr=1e-3).step()
        after = replay(model, ro)[1].sum().item()
        assert (after - before) * sign > 0, (row, before, after)


def test_a_micro_batch_without_rounds_adds_nothing_to_l_mem(ckpt):
    """A rollout that ends before its first round has no eviction term; its micro-batch adds 0 to
    L_mem, and the step's L_mem is that of the rollouts that had rounds."""
    model = from_pretrained(ckpt)
    ro = rollout(model, prompts_of([3, 14]), Sampling(max_new_tokens=5, temperature=1.0, top_k=0), EV,
                 eos_ids=[], generator=torch.Generator().manual_seed(0))
    assert ro.n_rounds.tolist() == [0, 1]  # 3 + 5 tokens never reach δ = 12
    c = settings.Settings(mode="ngc", max_new_tokens=5, micro_batch=1)
    adv = torch.tensor([1.0, -1.0])
    losses = train.backward(model, ro, adv, c)
    l_mem = train.policy_losses(model, ro.select(torch.tensor([1])), adv[1:], train.MODES[c.mode], c.max_new_tokens,
                                n_total=2)["L_mem"]
    assert losses["L_mem"] == pytest.approx(l_mem.item(), rel=1e-6) and l_mem.item() != 0


# ---------------------------------------------------------------------------------------
# 4. Batch independence (§4.1: rounds are per sequence)


def test_a_sequence_does_not_depend_on_its_batch(model):
    ev = Eviction(delta=10, block=2, window=3, rate=0.5, greedy=True)
    s = Sampling(max_new_tokens=40, greedy=True)
    prompts = prompts_of([3, 14, 7, 22, 5], seed=1)
    batch = rollout(model, prompts, s, ev, eos_ids=[EOS])
    for i in (2, 0, 3):  # a middle, the shortest and the longest prompt
        alone = rollout(model, [prompts[i]], s, ev, eos_ids=[EOS])
        assert alone.completions()[0] == batch.completions()[i]
        R = int(alone.n_rounds[0])
        assert R >= 2 and int(batch.n_rounds[i]) == R
        K = alone.kept.shape[3]
        assert torch.equal(alone.kept[0], batch.kept[i, :R, :, :K])
        assert (batch.kept[i, :R, :, K:] == -1).all()
        lp_alone, _ = replay(model, alone)
        lp_batch, _ = replay(model, batch)
        n = int(alone.lengths[0])
        assert (lp_alone[0, :n] - lp_batch[i, :n]).abs().max() < 1e-5
    # Negative control: the same prompt under a different eviction rate decides differently.
    other = rollout(model, [prompts[2]], s, Eviction(delta=10, block=2, window=3, rate=0.8, greedy=True),
                    eos_ids=[EOS])
    assert other.kept.shape[3] != batch.kept.shape[3] or not torch.equal(other.kept[0], batch.kept[2])


ROLLOUT_FIELDS = ("tokens", "lengths", "logprobs", "forced", "kept", "n_rounds", "evict_logprobs", "kv_before_round",
                  "peak_kv", "eos")


@pytest.mark.parametrize("ev", [EV, None, replace(EV, greedy=True, score=baselines.keydiff)],
                         ids=["evicting", "full cache", "a baseline"])
def test_rows_that_end_leave_the_decoded_batch_and_change_nothing(model, monkeypatch, ev):
    """Rows that hit EOS leave the batch the model decodes (ngc.drop_ended_rows); every other
    row's tokens, log-probs, evictions and KV counts are those of a rollout where none leaves."""
    prompts = prompts_of([5, 17, 9, 3, 11, 7] * 8)
    s = Sampling(max_new_tokens=60, temperature=1.0, top_k=0)

    drop = ngc.drop_ended_rows

    def run():  # the rollout, and the batch sizes it decoded at after rows left
        sizes = set()
        monkeypatch.setattr(ngc, "drop_ended_rows", lambda st, *a: (drop(st, *a), st.live is None or sizes.add(len(st.live))))
        return rollout(model, prompts, s, ev, eos_ids=[EOS], generator=torch.Generator().manual_seed(3)), sizes

    monkeypatch.setattr(ngc, "ROW_STEP", 10**9)  # no row ever leaves
    whole, sizes = run()
    assert sizes == set()
    monkeypatch.setattr(ngc, "ROW_STEP", 8)
    shrunk, sizes = run()
    assert len(sizes) >= 2 and all(n % 8 == 0 for n in sizes), sizes  # the batch did shrink, in steps of 8
    for name in ROLLOUT_FIELDS:
        a, b = getattr(whole, name), getattr(shrunk, name)
        assert a.shape == b.shape and torch.allclose(a.float(), b.float(), rtol=0, atol=1e-6), name
    # Negative control: a cache whose keys and values, once rows leave, sit in another row than the
    # rollout thinks: those rows decode from other rows' entries.
    keep_rows = model_module.LayerCache.keep_rows

    def keep_swapped(c, rows):
        keep_rows(c, rows)
        c.k, c.v = c.k.flip(0), c.v.flip(0)

    monkeypatch.setattr(model_module.LayerCache, "keep_rows", keep_swapped)
    swapped, _ = run()
    assert not torch.equal(swapped.tokens, whole.tokens)


# ---------------------------------------------------------------------------------------
# 5. Gumbel-top-k is the distribution it claims (§4.3, eq. 2)


def test_gumbel_topk_matches_plackett_luce():
    logits = torch.tensor([[1.2, 0.3, -0.5, 0.8, -1.5]])
    K, n_samples = 2, 200_000
    pairs = list(itertools.permutations(range(5), K))
    sigma = torch.tensor(pairs)
    exact = plackett_luce_log_prob(logits.expand(len(pairs), -1), sigma).exp()
    assert abs(exact.sum().item() - 1) < 1e-5  # a distribution over ordered pairs
    g = torch.Generator().manual_seed(0)
    draws = gumbel_topk(logits.expand(n_samples, -1), torch.full((n_samples,), K), g)
    counts = torch.zeros(5, 5).index_put_((draws[:, 0], draws[:, 1]), torch.ones(n_samples), accumulate=True)
    observed = torch.stack([counts[a, b] for a, b in pairs])

    def chi2(p):
        return (((observed - n_samples * p) ** 2) / (n_samples * p)).sum().item()

    # Pearson's chi-square goodness of fit, 20 cells -> 19 degrees of freedom; 43.82 is the
    # 0.999 quantile, so a correct sampler fails this with probability 0.001.
    print(f"chi2 = {chi2(exact):.1f} (critical 43.82)")
    assert chi2(exact) < 43.82
    # Negative control: the same counts against the unordered-uniform distribution fail.
    assert chi2(torch.full_like(exact, 1 / len(pairs))) > 43.82


def test_plackett_luce_sums_to_one_over_all_sequences():
    logits = torch.randn(1, 6, generator=torch.Generator().manual_seed(1)) * 3
    for K in (1, 3, 6):
        seqs = torch.tensor(list(itertools.permutations(range(6), K)))
        total = plackett_luce_log_prob(logits.expand(len(seqs), -1), seqs).exp().sum().item()
        assert abs(total - 1) < 1e-5


def test_peaked_logits_give_the_exact_log_prob():
    """On peaked logits (spread in the hundreds) the reverse-logcumsumexp form gives eq. (2)'s
    log-probability, for sampled and greedy orders, as a float64 evaluation does, with finite
    gradients; the subtractive form log(1 - cumsum p) of the same fp32 probabilities does not."""
    def reference_of(logits, sigma):  # eq. (2) term by term in float64, nothing subtracted
        x, out = logits.double(), []
        for row, order in zip(x, sigma.tolist()):
            left, total = torch.ones_like(row, dtype=torch.bool), row.new_zeros(())
            for j in (j for j in order if j >= 0):
                total = total + row[j] - row[left].logsumexp(0)  # over the blocks not yet kept
                left[j] = False
            out.append(total)
        return torch.stack(out)

    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(64, 40, generator=g) * 50).requires_grad_()
    k = torch.full((64,), 39)
    sigma = gumbel_topk(logits.detach(), k, g)
    lp = plackett_luce_log_prob(logits, sigma)
    lp.sum().backward()
    reference = reference_of(logits.detach(), sigma)
    assert torch.isfinite(reference).all() and torch.isfinite(logits.grad).all()
    assert torch.allclose(lp.double(), reference, rtol=1e-5, atol=1e-4)
    greedy_sigma = ordered_topk(logits.detach(), k)
    greedy = plackett_luce_log_prob(logits.detach(), greedy_sigma)
    assert torch.allclose(greedy.double(), reference_of(logits.detach(), greedy_sigma), rtol=1e-5, atol=1e-4)
    # Negative control: the subtractive form on the same input, in fp32 as the policy runs.
    p = logits.detach().softmax(1).gather(1, sigma)  # (64, 39): each kept block's probability
    removed = torch.cat([torch.zeros(64, 1), torch.cumsum(p, 1)[:, :-1]], 1)  # mass kept before it
    naive = (p.log() - torch.log(1 - removed)).sum(1)
    assert not torch.isclose(naive.double(), reference, rtol=1e-5, atol=1e-4).any()  # -inf in every row here


def test_block_pooling_and_keep_count():
    scores = torch.tensor([[1.0, 3.0, 5.0, 7.0, 9.0, 2.0, 4.0]])
    alive = torch.tensor([[True, True, False, True, True, True, True]])  # 6 alive keys, b=4
    means, exists = block_means(scores, alive, 4)
    assert exists.tolist() == [[True, True]]
    assert means.tolist() == [[(1 + 3 + 7 + 9) / 4, (2 + 4) / 2]]
    keep = kept_keys(alive, torch.tensor([[1, -1]]), 4)
    assert keep.tolist() == [[False, False, False, False, False, True, True]]
    n = torch.tensor([1, 2, 3, 4, 7, 10, 10])
    rate = torch.tensor([0.5, 0.5, 0.5, 0.5, 0.5, 0.7, 1.0])
    assert keep_count(n, rate).tolist() == [1, 1, 2, 2, 4, 3, 1]  # round half up, at least one


# ---------------------------------------------------------------------------------------
# 6. Memory bound (App. A.2)


def test_cache_size_converges_to_delta_over_eps(model):
    delta, eps, b = 16, 0.5, 4
    ev = Eviction(delta=delta, block=b, window=3, rate=eps)
    s = Sampling(max_new_tokens=300, temperature=1.0, top_k=0)
    ro = rollout(model, prompts_of([6]), s, ev, eos_ids=[], generator=torch.Generator().manual_seed(0))
    before = ro.kv_before_round[0]  # (R, L) alive entries per layer just before each round
    L, R = before.shape[1], int(ro.n_rounds[0])
    assert R == (6 + 300 - 1) // delta
    assert (before[0] == delta).all()
    tail = before[R // 2:].float()
    print("per-layer cache before rounds:", before[:, 0].tolist())
    assert (tail - delta / eps).abs().max() <= b  # paper Appendix A.2: c* = δ/ε
    # Physically allocated: at most the steady-state bound plus one growth chunk, per layer.
    assert ro.kv_slots <= L * (delta / eps + b + 64)
    assert ro.peak_kv[0] <= L * (delta / eps + b)
    full = rollout(model, prompts_of([6]), s, None, eos_ids=[], generator=torch.Generator().manual_seed(0))
    assert full.peak_kv[0] == L * (6 + 300 - 1)  # without eviction it grows linearly
    assert full.kv_slots >= full.peak_kv[0] > 3 * ro.kv_slots


def held_after_every_forward(monkeypatch, run):
    """run() under a spy on LayerCache.append: its result and the alive entries (forwards, L, B)
    of every layer and row right after each forward (prefill chunk or decode step)."""
    seen, append = [], LayerCache.append

    def spy(self, *args):
        append(self, *args)
        seen.append(self.fill.clone())

    monkeypatch.setattr(LayerCache, "append", spy)
    out = run()
    return out, torch.stack(seen).view(-1, TINY_MODEL["num_hidden_layers"], len(out.lengths))


# δ, b, ε, prompt lengths: b dividing δ or not, ε from 0.1 to 1, prompts shorter and longer than δ
BOUND_CASES = [(16, 4, 0.5, [6, 40]), (10, 3, 0.5, [3, 25]), (12, 5, 0.1, [7, 30]), (12, 5, 0.9, [12, 13]),
               (9, 2, 1.0, [4, 20]), (13, 4, 0.3, [50, 2]), (8, 3, 0.7, [5, 30])]


@pytest.mark.parametrize("delta, block, rate, lens", BOUND_CASES)
def test_alive_entries_never_exceed_the_bound_that_sized_the_cache(model, monkeypatch, delta, block, rate, lens):
    """200 sampled tokens (Gumbel-top-k rounds, no EOS): after every forward no layer of any row
    holds more than cache_bound entries, the buffers have exactly that many slots, and peak_kv
    (computed from the round records after the loop) is the most the rows held at once."""
    M, L = 200, TINY_MODEL["num_hidden_layers"]
    ev = Eviction(delta=delta, block=block, window=3, rate=rate)
    ro, held = held_after_every_forward(monkeypatch, lambda: rollout(
        model, prompts_of(lens), Sampling(max_new_tokens=M, temperature=1.0, top_k=0), ev, eos_ids=[],
        generator=torch.Generator().manual_seed(0)))
    bound = ngc.cache_bound(delta, block, float(ro.rates[0]), max(lens) + M - 1)  # the rollout's ε, float32
    print(f"δ={delta} b={block} ε={rate}: bound {bound} (δ/ε = {delta / rate:.1f}), most held {int(held.max())}")
    assert int(held.max()) <= bound
    assert ro.kv_slots == L * bound
    assert torch.equal(ro.peak_kv, held.sum(1).amax(0))
    assert int(ro.n_rounds.min()) >= 200 // delta


def test_cache_bound_by_hand():
    """The cache before each round of a policy that keeps K whole blocks, by hand: δ=10, b=3,
    ε=0.5 gives 10 (4 blocks, keep 2: 6) -> 16 (6, keep 3: 9) -> 19 (7, keep 4: 12) -> 22
    (8, keep 4: 12) -> 22; with b | δ it is δ/ε exactly (16, 4, 0.5: 32)."""
    assert ngc.cache_bound(16, 4, 0.5, 10_000) == 32
    assert ngc.cache_bound(10, 3, 0.5, 10_000) == 22
    assert ngc.cache_bound(10, 3, 0.5, 7) == 7  # no round: everything fed
    assert ngc.cache_bound(10, 3, 0.5, 10) == 10  # one round, after the 10th token
    assert ngc.cache_bound(10, 3, 0.5, 19) == 15  # one round leaves 6, then 9 more
    assert ngc.cache_bound(10, 3, 0.5, 25) == 16  # two rounds: 16 before the 2nd, 9 + 5 after it
    assert ngc.cache_bound(12, 5, 0.1, 25) == 25  # K = N while N <= 5: nothing is evicted yet
    assert ngc.cache_bound(9, 2, 1.0, 10_000) == 11  # ε = 1 keeps one block: δ + b
    for delta, block, rate in [(24, 4, 0.5), (256, 32, 0.5), (10, 3, 0.1), (350, 32, 0.25)]:
        u = ngc.cache_bound(delta, block, rate, 100_000)
        # K is (1-ε)N rounded half up, so u* lies within (δ ± 1.5 b)/ε of δ/ε (App. A.2's c*)
        assert (delta - block / 2) / rate <= u
        assert u <= max(delta + block, (delta + (1 - rate) * (block - 1) + block / 2) / rate)


@pytest.mark.parametrize("delta, block, rate, lens, M", [
    (*BOUND_CASES[0], 200), (*BOUND_CASES[1], 200), (*BOUND_CASES[5], 200),
    (12, 3, 0.5, [3], 5), (12, 3, 0.5, [3], 10), (12, 3, 0.5, [3], 17), (12, 3, 0.5, [3], 25)])
def test_rollouts_reach_the_bound(model, monkeypatch, delta, block, rate, lens, M):
    """The bound is not loose: where b | δ every count is a multiple of b, no block is short, and
    every policy reaches the bound; where b ∤ δ Gumbel-top-k comes within a block of it. The short
    ones, 3 + M - 1 tokens fed: 7 (no round), 12 (one round, at the end), 13 (one round leaves 6,
    then 7 more), 18 (the cache before the second round: 6 + 12)."""
    ev = Eviction(delta=delta, block=block, window=3, rate=rate)
    ro, held = held_after_every_forward(monkeypatch, lambda: rollout(
        model, prompts_of(lens), Sampling(max_new_tokens=M, temperature=1.0, top_k=0), ev, eos_ids=[],
        generator=torch.Generator().manual_seed(0)))
    bound = ngc.cache_bound(delta, block, float(ro.rates[0]), max(lens) + M - 1)
    if delta % block == 0:
        assert int(held.max()) == bound
    assert bound - block < int(held.max()) <= bound


def test_a_cache_too_small_is_an_error_not_a_silent_drop(model, monkeypatch):
    """More entries than slots is a one-line RuntimeError, never a silently dropped entry."""
    layer = LayerCache(1, 2, 4, 3, torch.float32, "cpu")
    k = torch.randn(1, 2, 4, 4)
    layer.append(k, k, torch.arange(4)[None], torch.ones(1, 4, dtype=torch.bool))
    with pytest.raises(RuntimeError, match="KV cache overflow: a row needs 4 slots of 3"):
        layer.check()
    # One slot short of the bound: the rollout stops with that error (at a round, or at the end).
    monkeypatch.setattr(ngc, "KVCache", lambda cfg, batch, capacity, *a, **kw: KVCache(cfg, batch, capacity - 1, *a, **kw))
    for ev in (Eviction(delta=16, block=4, window=3, rate=0.5), None):
        with pytest.raises(RuntimeError, match="KV cache overflow") as err:
            rollout(model, prompts_of([6, 9]), Sampling(max_new_tokens=60, greedy=True), ev)
        assert "\n" not in str(err.value)
    # Negative control: the bound itself is enough.
    monkeypatch.undo()
    rollout(model, prompts_of([6, 9]), Sampling(max_new_tokens=60, greedy=True),
            Eviction(delta=16, block=4, window=3, rate=0.5))


# ---------------------------------------------------------------------------------------
# 7. One eviction round by hand (§4.2, eq. 2); every policy keeps K blocks per layer and replay
# still reproduces the rollout (§5.1)


def test_ngc_round_by_hand():
    """NGC's round on a hand-built cache: ψ, the block means s_j, the top K blocks of log s_j, and
    log p(σ) of eq. (2) as a plain loop over the kept blocks."""
    c = hand_built_cache(S=14, holes=(1, 6, 7))  # 11 alive keys, blocks of 3: N = 4 (the last holds 2)
    psi = psi_by_hand(c)[c[3][0]]  # the alive keys, in position order
    x = [psi[j:j + 3].mean().log().item() for j in range(0, 11, 3)]
    sigma, logp = one_round(c, 3, 0.5, "ngc")
    assert sigma == sorted(range(4), key=lambda j: -x[j])[:2]  # K = round(0.5 · 4) = 2

    def log_p(x):
        return sum(x[s] - math.log(sum(math.exp(x[i]) for i in range(4) if i not in sigma[:j]))
                   for j, s in enumerate(sigma))

    assert abs(logp - log_p(x)) < 1e-5
    # Negative control: the block means themselves as logits (no log) give another log p(σ).
    assert abs(logp - log_p([math.exp(v) for v in x])) > 1e-2
    # τ (--eviction-temperature, a departure): the same top K; eq. (2) over x_j / τ, not over x_j
    sigma_tau, logp_tau = one_round(c, 3, 0.5, {"greedy": True, "temperature": 0.5})
    assert sigma_tau == sigma and abs(logp_tau - log_p([v / 0.5 for v in x])) < 1e-5
    assert abs(logp_tau - logp) > 1e-2


EVAL_POLICIES = list(baselines.POLICIES)


@pytest.fixture(scope="module")
def rollouts(model):
    runs = {}
    prompts, sampling = prompts_of([5, 17, 9]), Sampling(max_new_tokens=40, temperature=1.0, top_k=0)
    roll = lambda e: rollout(model, prompts, sampling, e, eos_ids=[EOS], generator=torch.Generator().manual_seed(6))
    own = {"task-rule": baselines.task_rule(prompts[0][1]),  # the target: the token after the first prompt's second
           "number-rule": baselines.number_rule(torch.isin(torch.arange(model.config.vocab_size),  # the "numbers":
                                                           torch.tensor(prompts[0])))}  # the first prompt's tokens
    for policy in EVAL_POLICIES:
        layout = Eviction(delta=12, block=3, window=4, rate=0.6)
        if policy in own:  # these bind a tokenizer's words; the random model's have no meaning
            e = replace(layout, greedy=True, score=own[policy])
        else:  # the oracle's reference: the full cache from the same noise
            e = baselines.build(policy, baselines.PolicyInputs(layout, model, None, "countdown", reference=lambda: roll(None)))
        runs[policy] = e, roll(e)
    return runs


@pytest.mark.parametrize("policy", EVAL_POLICIES)
def test_policy_keeps_k_blocks_and_replay_matches_rollout(model, rollouts, policy):
    e, ro = rollouts[policy]
    assert int(ro.n_rounds.min()) >= 2
    for i in range(len(ro.lengths)):
        R = int(ro.n_rounds[i])
        before = ro.kv_before_round[i, :R]  # (R, L)
        n_blocks = (before + e.block - 1) // e.block
        kept = ro.kept[i, :R]
        assert torch.equal((kept >= 0).sum(-1), keep_count(n_blocks.flatten(), e.rate).view_as(n_blocks))
        # the survivors are exactly the kept blocks: the next round starts from them plus δ new tokens
        alive = torch.arange(int(before.max()))[None] < before.flatten()[:, None]
        survivors = kept_keys(alive, kept.flatten(0, 1), e.block).sum(1).view_as(before)
        assert torch.equal(before[1:], survivors[:-1] + e.delta)
    tok_lp, ev_lp = replay(model, ro)
    completion = (tok_lp != 0) | (ro.logprobs != 0)
    assert (tok_lp - ro.logprobs)[completion].abs().max() < 1e-5
    # The round records log p(σ) under NGC's policy whichever policy chose σ: what replay recomputes.
    assert (ev_lp - ro.evict_logprobs).abs().max() < 1e-4
    # Negative control: the plain causal mask on the same tokens does not match.
    causal, _ = replay(model, ro, causal=True)
    assert (causal - ro.logprobs)[completion].abs().max() > 1e-2


def test_policies_decide_differently(rollouts):
    first = {p: ro.kept[:, 0] for p, (_, ro) in rollouts.items()}  # the first round (prompt only)
    names = [p for p in first if p not in ("ngc-sample", "random", "random-prompt")]  # the deterministic ones
    for a, b in itertools.combinations(names, 2):
        assert not torch.equal(first[a], first[b]), (a, b)


# ---------------------------------------------------------------------------------------
# 8. The curriculum (§4.6) and targeted dropout's causal mask


def test_curriculum_matches_the_paper_formula():
    stages, D, a = [0.9, 0.7, 0.5], 10, 0.6
    expected = {0: 0.9, 3: 0.9, 4: 0.9, 7: 0.9 + (0.7 - 0.4) / 0.6 * (0.7 - 0.9), 9: 0.9 + (0.9 - 0.4) / 0.6 * -0.2,
                10: 0.7, 13: 0.7, 17: 0.7 + 0.5 * -0.2, 20: 0.5, 35: 0.5, 1000: 0.5}
    for step, value in expected.items():
        assert abs(train.retention_at(step, stages, D, a) - value) < 1e-12, step
    # the blend is continuous at the stage edge: just before step 10 it approaches 0.7
    assert abs(train.retention_at(10, stages, D, a) - (0.9 + (1 - 0.4) / 0.6 * -0.2)) < 1e-12


def test_targeted_dropout_scores_tokens_under_the_causal_mask(train_ckpt, model, monkeypatch):
    c = train.resolve(train.parse_args(["--model", train_ckpt, "--mode", "targeted-dropout"]))
    ro = rollout(model, prompts_of([5, 9, 3]), Sampling(max_new_tokens=30, temperature=1.0, top_k=0), EV,
                 eos_ids=[EOS], generator=torch.Generator().manual_seed(0))
    adv = torch.tensor([1.0, -1.0, 0.5])
    replayed = []  # the token log-probs that policy_losses scored
    monkeypatch.setattr(train, "replay", lambda *args, **kwargs: replayed.append(replay(*args, **kwargs)) or replayed[-1])
    assert "L_mem" not in train.policy_losses(model, ro, adv, train.MODES[c.mode], c.max_new_tokens, n_total=3)
    tok_lp = replayed[0][0]
    causal, _ = replay(model, ro, causal=True)
    masked, _ = replay(model, ro)
    assert torch.equal(tok_lp, causal) and (tok_lp - masked).abs().max() > 1e-2


# ---------------------------------------------------------------------------------------
# 9. Compression via meta-tokens (Appendix): g forced before every round, the gist mask


META = 95  # any id of the tiny vocabulary serves as g for the engine


def expected_forced(ro, delta):
    """The spec: the completion tokens at indices kδ-1, the last before each round (prompts are given)."""
    t = torch.arange(ro.tokens.shape[1])
    return (t >= ro.prompt_lens[:, None]) & (t < ro.lengths[:, None]) & ((t + 1) % delta == 0)


def test_meta_token_is_forced_before_every_round_and_replays_exactly(model):
    """Prompts of 5..17 tokens (17 > δ: its first round falls in the prompt, which is never forced;
    11 = δ-1: the first sampled token is forced), EOS and max-length endings."""
    ro = rollout(model, prompts_of([5, 17, 9, 3, 11, 7]), Sampling(max_new_tokens=60, temperature=1.0, top_k=0,
                 meta_token=META), EV, eos_ids=[EOS], generator=torch.Generator().manual_seed(3))
    assert torch.equal(ro.forced, expected_forced(ro, EV.delta)) and int(ro.forced.sum()) >= 12
    assert (ro.tokens[ro.forced] == META).all() and (ro.logprobs[ro.forced] == 0).all()
    after_g = 0
    for i in range(len(ro.lengths)):  # every round that fired after decoding began follows a g
        ends = (torch.arange(int(ro.n_rounds[i])) + 1) * EV.delta - 1
        decoded = ends[ends >= ro.prompt_lens[i]]
        assert (ro.tokens[i, decoded] == META).all()
        after_g += len(decoded)
    assert after_g >= 8
    assert ro.tokens[1, EV.delta - 1] == prompts_of([5, 17])[1][EV.delta - 1] and not ro.forced[1, EV.delta - 1]
    assert ro.forced[4, 11] and ro.sampling.meta_token == META
    tok_lp, ev_lp = replay(model, ro)
    completion = expected_forced(ro, 1)  # every completion token
    assert (tok_lp[ro.forced] == 0).all()  # not sampled: no log-prob in L_token
    tok_diff = (tok_lp - ro.logprobs)[completion].abs().max().item()
    ev_diff = (ev_lp - ro.evict_logprobs).abs().max().item()
    print(f"meta-token rollout, max |replay - rollout|: tokens {tok_diff:.2e}, evictions {ev_diff:.2e}")
    assert tok_diff < 1e-5 and ev_diff < 1e-4
    row = ro.select(torch.tensor([4]))  # select keeps the forced positions
    assert torch.equal(row.forced[0], ro.forced[4, : int(ro.lengths[4])])
    assert (replay(model, row)[0][0] - tok_lp[4, : int(ro.lengths[4])]).abs().max() < 1e-5
    # Negative controls: scored as if sampled, g gets a log-prob; the causal mask sees evicted entries.
    as_sampled, _ = replay(model, replace(ro, forced=torch.zeros_like(ro.forced)))
    assert as_sampled[ro.forced].max() < -1e-2
    causal, _ = replay(model, ro, causal=True)
    assert (causal - ro.logprobs)[completion & ~ro.forced].abs().max() > 1e-2
    # Without eviction there is no round to precede, so nothing is forced.
    full = rollout(model, prompts_of([5, 17]), Sampling(max_new_tokens=30, meta_token=META), None,
                   generator=torch.Generator().manual_seed(3))
    assert not full.forced.any() and not (full.tokens[:, 11::12] == META).all()
    with pytest.raises(ValueError, match=r"meta_token=96 is not a token id of this model \(96\)"):
        rollout(model, prompts_of([5]), Sampling(max_new_tokens=4, meta_token=96), EV)


def newest_first(psi, keys, alive, context=None):
    """A per-key score that ranks the newest alive key highest (its rank among the alive keys)."""
    return alive.long().cumsum(1).float()


@pytest.mark.parametrize("rate, gist", [(1.0, True), (0.5, False)])
def test_when_everything_before_g_is_evicted_the_replay_mask_is_the_gist_mask(model, rate, gist):
    """b = 1, ε = 1: K = 1 block of one key, the newest, so every round keeps g alone. Then in the
    replay mask of every layer a token after g sees g and the tokens from g to itself, nothing
    before g: the gist mask of Mu et al. (the Appendix's figure). Control: ε = 0.5 keeps more."""
    e = Eviction(delta=6, block=1, window=2, rate=rate, greedy=True, score=newest_first)
    ro = rollout(model, prompts_of([3, 5, 4]), Sampling(max_new_tokens=40, temperature=1.0, top_k=0, meta_token=META),
                 e, generator=torch.Generator().manual_seed(0))
    T = ro.tokens.shape[1]
    assert int(ro.n_rounds.min()) >= 5
    tok_lp, _ = replay(model, ro)  # the masks below are the ones the rollout attended with
    assert (tok_lp - ro.logprobs)[expected_forced(ro, 1)].abs().max() < 1e-5
    death = death_times(ro.kept, ro.n_rounds, T, e.delta, e.block)
    s = torch.arange(T)
    compared, differ = 0, 0
    for layer in range(model.config.num_hidden_layers):
        mask = visibility(death[:, layer])  # (B, T, T)
        for i in range(len(ro.lengths)):
            for r in range(int(ro.n_rounds[i])):
                g = (r + 1) * e.delta - 1
                assert ro.tokens[i, g] == META
                for t in range(g + 1, min(g + e.delta, int(ro.lengths[i]) - 1) + 1):  # up to the next g
                    gist_row = (s >= g) & (s <= t)
                    compared += 1
                    differ += not torch.equal(mask[i, t], gist_row)
    assert compared >= 100
    assert differ == 0 if gist else differ == compared
