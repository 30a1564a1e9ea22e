"""The rollout engine's details (ngc.py, baselines.py): the compiled decode step, bad
arguments, bf16 on CUDA, sampling and top-p, and each baseline's per-key scores."""
import math
from collections import Counter

import pytest
import torch


from evaluation import baselines
import ngc

from gumbel import block_means, keep_count, ordered_topk
from lib.checkpoint import from_pretrained
from ngc import Eviction, Sampling, rollout
from replay import replay
from conftest import EOS, EV, hand_built_cache, keep, prompts_of, psi_by_hand, rounds, write_checkpoint


# ---------------------------------------------------------------------------------------
# The compiled decode step


COMPILED_PROMPTS = prompts_of([3, 14, 7, 22, 5], seed=1)  # one batch for the compiled tests
COMPILED_SAMPLING = Sampling(max_new_tokens=40, greedy=True)
COMPILED_EV = Eviction(delta=10, block=3, window=3, rate=0.5, greedy=True)


@pytest.fixture(scope="module")
def two_layers(tmp_path_factory):
    """The compiled tests' model: two layers (each evicts its own blocks) compile on a cold inductor
    cache in about 60% of the time of three (the two tests: 75 s against 125 s)."""
    return from_pretrained(write_checkpoint(tmp_path_factory.mktemp("two"), num_hidden_layers=2)).eval()


def test_compiled_decode_step_gives_the_eager_rollout(two_layers):
    """rollout(compile=True) captures the decode step with torch.compile whole (fullgraph: a host
    sync or a changing shape in it fails to compile) on the same static buffers: the same greedy
    tokens and decisions as eager, token log-probs to 1e-5, and replay reproduces it. The second
    call reuses the buffers and the compiled step. These caches are small, so the step takes SDPA's
    math form (SDPA_MATH_MAX_SLOTS); the full cache gives the eager rollout under it too."""
    model = two_layers
    args = (model, COMPILED_PROMPTS, COMPILED_SAMPLING, COMPILED_EV)
    eager = rollout(*args, eos_ids=[EOS])
    for _ in range(2):
        captured = rollout(*args, eos_ids=[EOS], compile=True)
        assert torch.equal(captured.tokens, eager.tokens) and torch.equal(captured.kept, eager.kept)
        assert torch.equal(captured.peak_kv, eager.peak_kv) and captured.kv_slots == eager.kv_slots
        assert (captured.logprobs - eager.logprobs).abs().max() < 1e-5
    assert int(captured.n_rounds.min()) >= 1 and int(captured.n_rounds.max()) >= 4  # every row evicted
    tok_lp, _ = replay(model, captured)
    completion = (tok_lp != 0) | (captured.logprobs != 0)
    assert (tok_lp - captured.logprobs)[completion].abs().max() < 1e-5
    # Negative control: the plain causal mask does not reproduce it (the compiled step did evict).
    causal, _ = replay(model, captured, causal=True)
    assert (causal - captured.logprobs)[completion].abs().max() > 1e-2
    full = compiled_and_eager(model, None)
    layers = model.config.num_hidden_layers
    assert full.kv_slots <= ngc.SDPA_MATH_MAX_SLOTS * layers  # the math form, as above


def compiled_and_eager(model, ev):
    """The compiled rollout of the shared batch, checked against the eager one."""
    eager = rollout(model, COMPILED_PROMPTS, COMPILED_SAMPLING, ev, eos_ids=[EOS])
    captured = rollout(model, COMPILED_PROMPTS, COMPILED_SAMPLING, ev, eos_ids=[EOS], compile=True)
    assert torch.equal(captured.tokens, eager.tokens) and torch.equal(captured.kept, eager.kept)
    assert (captured.logprobs - eager.logprobs).abs().max() < 1e-5
    return captured


def test_compiled_step_with_the_fused_attention_kernel_gives_the_eager_rollout(two_layers, monkeypatch):
    """On the CPU the compiled step takes SDPA's math form for caches up to SDPA_MATH_MAX_SLOTS
    (test_compiled_decode_step_...) and the fused kernel above (here: from 0 slots on): the fused
    form gives the eager rollout too, with eviction and with the full cache."""
    monkeypatch.setattr(ngc, "SDPA_MATH_MAX_SLOTS", 0)
    for ev in (COMPILED_EV, None):
        compiled_and_eager(two_layers, ev)


# ---------------------------------------------------------------------------------------
# Bad arguments


@pytest.mark.parametrize("kwargs, message", [
    (dict(rate=0.0), "must lie in"), (dict(rate=1.5), "must lie in"), (dict(block=0), "block size"),
    (dict(window=0), "window"), (dict(delta=4, window=4), "larger than the window"),
    (dict(delta=8, block=16, window=2), "at least the block size"),
])
def test_bad_eviction_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message) as err:
        Eviction(**{**dict(delta=16, block=4, window=3, rate=0.5), **kwargs})
    assert "\n" not in str(err.value)


def test_bad_rollout_arguments(model):
    with pytest.raises(ValueError, match="must lie in"):
        rollout(model, prompts_of([4]), Sampling(max_new_tokens=4), EV, rates=[1.2])
    with pytest.raises(ValueError, match="must not be negative"):
        rollout(model, prompts_of([4]), Sampling(max_new_tokens=4), EV, rates=[-0.1])
    with pytest.raises(ValueError, match="temperature"):
        Sampling(temperature=0)
    with pytest.raises(ValueError, match="at least one token"):
        rollout(model, [[]], Sampling(max_new_tokens=4))


# ---------------------------------------------------------------------------------------
# CUDA


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_bf16_replay_agrees_by_argmax(ckpt, monkeypatch):
    """In bf16 on CUDA, replay's argmax is the greedy rollout's token: at every completion position
    the token taken is replay's top token or within bf16 noise of it (0.2 nats below), and the top
    token at most positions; the taken tokens' log-probs agree to 0.2."""
    model = from_pretrained(ckpt, dtype=torch.bfloat16, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    ro = rollout(model, prompts_of([5, 17, 9, 3]), Sampling(max_new_tokens=40, greedy=True), EV,
                 eos_ids=[EOS], generator=g)
    seen = []  # replay's logits at the completion positions, in the order of its target mask
    monkeypatch.setattr(model, "logits", lambda h, logits=model.logits: seen.append(logits(h).float()) or seen[-1])
    tok_lp, ev_lp = replay(model, ro)
    t = torch.arange(1, ro.tokens.shape[1], device=ro.tokens.device)
    taken = ro.tokens[:, 1:][(t >= ro.prompt_lens[:, None]) & (t < ro.lengths[:, None]) & ~ro.forced[:, 1:]]
    assert len(seen) == 1 and seen[0].shape[0] == len(taken) > 0
    lp = seen[0].log_softmax(-1)
    gap = lp.max(-1).values - lp.gather(1, taken[:, None]).squeeze(1)  # 0 where the taken token is the top one
    assert gap.max() < 0.2 and (gap == 0).float().mean() > 0.5
    completion = ro.logprobs != 0
    assert torch.isfinite(tok_lp).all() and torch.isfinite(ev_lp).all()
    assert (tok_lp - ro.logprobs)[completion].abs().max() < 0.2


# ---------------------------------------------------------------------------------------
# Sampling, and top-p (nucleus) sampling, the paper's evaluation setting (top-p 0.95, T = 0.6)


CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}  # 0.999 quantiles by dof


def _nucleus_reference(logits, temperature, top_k, top_p):
    """Brute force, one distribution at a time in float64: softmax of logits / T, keep the top_k,
    renormalise, walk down the sorted probabilities until their sum reaches top_p."""
    probs = torch.softmax(logits.double() / temperature, -1).tolist()
    ranked = sorted(range(len(probs)), key=lambda i: -probs[i])[:top_k or None]
    total = sum(probs[i] for i in ranked)
    kept, mass = [], 0.0
    for i in ranked:
        kept.append(i)
        mass += probs[i] / total
        if mass >= top_p:
            break
    out = [0.0] * len(probs)
    for i in kept:
        out[i] = probs[i] / sum(probs[j] for j in kept)
    return torch.tensor(out, dtype=torch.float64)


def _ranked_mass(logits, temperature, top_k):
    """Cumulative probability of the 1, 2, ... most likely tokens among the top_k (float64)."""
    probs = torch.softmax(logits.double() / temperature, -1).sort(descending=True).values[:top_k or None]
    return (probs / probs.sum()).cumsum(0)


@pytest.mark.parametrize("temperature, top_k, n_kept", [(1.0, 0, 3), (0.6, 0, 2), (1.0, 0, 5), (1.3, 4, 3)])
def test_top_p_matches_a_brute_force_nucleus(temperature, top_k, n_kept):
    """120k draws from two interleaved distributions: no token outside the brute-force nucleus,
    and Pearson's χ² on the rest below its 0.999 quantile."""
    V, n = 8, 60_000
    gen = torch.Generator().manual_seed(n_kept)
    two = torch.randn(2, V, generator=gen) * 1.5  # two different distributions, rows interleaved
    mass = _ranked_mass(two[0], temperature, top_k)
    top_p = float(mass[n_kept - 2] + mass[n_kept - 1]) / 2  # halfway between two cuts
    s = Sampling(max_new_tokens=1, temperature=temperature, top_k=top_k, top_p=top_p)
    logits = two.repeat(n, 1)  # (2n, V)
    tok, logp = ngc.sample_tokens(logits, s, gen)
    assert torch.allclose(logp, torch.log_softmax(logits / temperature, -1).gather(1, tok[:, None]).squeeze(1))
    for row in range(2):
        # the cut is clear of float32 rounding (~1e-7) in both rows, so the reference is unambiguous
        assert (_ranked_mass(two[row], temperature, top_k) - top_p).abs().min() > 1e-4
        ref = _nucleus_reference(two[row], temperature, top_k, top_p)
        counts = torch.bincount(tok[row::2], minlength=V).double()
        assert (counts[ref == 0] == 0).all()  # nothing outside the nucleus, ever
        if row == 0:
            assert int((ref > 0).sum()) == n_kept

        def chi2(p):  # Pearson's goodness of fit over the cells p allows
            cells = p > 0
            expected = n * p[cells]
            return (((counts[cells] - expected) ** 2) / expected).sum().item(), int(cells.sum()) - 1

        stat, dof = chi2(ref)
        assert dof == 0 or stat < CHI2_999[dof], (row, stat)
        # Negative control: the same counts against the distribution without the cut fail
        # (row 0 always has a cut; row 1 only when its own nucleus is smaller than its top-k).
        full = _nucleus_reference(two[row], temperature, top_k, 1.0)
        if row == 0 or (full > 0).sum() > (ref > 0).sum():
            stat, dof = chi2(full)
            assert stat > CHI2_999[dof], (row, stat)


def test_top_p_keeps_the_smallest_set_that_reaches_p_exactly():
    """Four tied tokens hold exactly 1/4 each (exact in float32): p = 1/2 is reached by two of them,
    so exactly two are ever sampled, not three; p = 3/4 by three."""
    logits = torch.tensor([[0.0, float("-inf"), 0.0, 0.0, float("-inf"), 0.0]]).expand(4000, -1)
    gen = torch.Generator().manual_seed(0)
    for top_p, n_kept in [(0.25, 1), (0.5, 2), (0.75, 3), (0.7, 3), (1.0, 4)]:
        tok, _ = ngc.sample_tokens(logits, Sampling(max_new_tokens=1, temperature=1.0, top_k=0, top_p=top_p), gen)
        assert len(set(tok.tolist())) == n_kept and set(tok.tolist()) <= {0, 2, 3, 5}, top_p


def test_top_p_tiny_is_argmax_and_one_is_off():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2000, 50, generator=gen) * 2
    tok, _ = ngc.sample_tokens(logits, Sampling(max_new_tokens=1, temperature=1.0, top_k=0, top_p=1e-9), gen)
    assert torch.equal(tok, logits.argmax(-1))
    # Negative control: without the cut the same rows often sample something else.
    tok, _ = ngc.sample_tokens(logits, Sampling(max_new_tokens=1, temperature=1.0, top_k=0, top_p=1.0), gen)
    assert (tok != logits.argmax(-1)).float().mean() > 0.3
    for bad in (0.0, -0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"top_p=.* must lie in \(0, 1\]"):
            Sampling(top_p=bad)


def test_sampling_is_softmax_with_one_uniform_per_row(monkeypatch):
    """sample_tokens is inverse-CDF sampling: 2 x 60k draws match softmax(logits / T) over the
    top-k (Pearson's χ² below its 0.999 quantile; the same counts against T = 1 fail it), and
    with the uniform at either end of its range, 0 or 1, each row gets its first or last token
    with p > 0, never one the top-k cut."""
    V, n, T = 8, 60_000, 0.7
    gen = torch.Generator().manual_seed(0)
    two = torch.randn(2, V, generator=gen) * 1.5  # two distributions, rows interleaved
    for top_k in (0, 5):
        tok, _ = ngc.sample_tokens(two.repeat(n, 1), Sampling(max_new_tokens=1, temperature=T, top_k=top_k), gen)
        for row in range(2):
            counts = torch.bincount(tok[row::2], minlength=V).double()

            def chi2(p):
                cells = p > 0
                return (((counts[cells] - n * p[cells]) ** 2) / (n * p[cells])).sum().item(), int(cells.sum()) - 1

            ref = _nucleus_reference(two[row], T, top_k, 1.0)
            assert (counts[ref == 0] == 0).all()
            stat, dof = chi2(ref)
            assert stat < CHI2_999[dof], (top_k, row, stat)
            stat, dof = chi2(_nucleus_reference(two[row], 1.0, top_k, 1.0))  # negative control
            assert stat > CHI2_999[dof], (top_k, row, stat)
    logits = torch.randn(500, 50, generator=gen) * 3
    top7 = logits.topk(7, -1).indices
    for u, expected in ((0.0, top7.amin(-1)), (1.0, top7.amax(-1))):
        monkeypatch.setattr(torch, "rand", lambda shape, **kw: torch.full(shape, u))
        tok, _ = ngc.sample_tokens(logits, Sampling(max_new_tokens=1, temperature=1.0, top_k=7))
        assert torch.equal(tok, expected), u
    # Negative control: the cumulative sum itself is no strict upper bound: searched for, it is
    # past the last token.
    cdf = logits.masked_fill(logits < logits.topk(7, -1).values[:, -1:], float("-inf")).softmax(-1).cumsum(-1)
    assert (torch.searchsorted(cdf, cdf[:, -1:].contiguous(), right=True) == 50).all()


def test_rows_that_share_token_noise_differ_by_their_evictions_alone(model):
    """token_noise_rows (train.py's --eviction-draws): rows 0-2 take row 0's uniforms. Under the
    full cache they write one completion; evicting, they write others (their Gumbel draws differ);
    each row's own noise (the identity) draws what no sharing draws. Control: without sharing, the
    full cache's three rows differ."""
    prompts, sampling = [prompts_of([9])[0]] * 3, Sampling(max_new_tokens=40, temperature=1.5, top_k=0)
    shared = torch.tensor([0, 0, 0])
    run = lambda ev, rows: rollout(model, prompts, sampling, ev, generator=torch.Generator().manual_seed(0),
                                   token_noise_rows=rows).completions()
    full = run(None, shared)
    assert full[0] == full[1] == full[2]
    assert len({tuple(c) for c in run(None, None)}) == 3  # the control
    assert len({tuple(c) for c in run(EV, shared)}) > 1
    assert run(EV, torch.arange(3)) == run(EV, None)


def test_a_row_at_rate_zero_writes_and_replays_what_the_full_cache_does(model):
    """rates with zeros (train.py's --full-cache-groups): those rows keep every entry, so with the
    Gumbel noise apart they sample the full cache's tokens, and replay's masks give them the causal
    log-probs. Control: the rows at ε = 0.5 write and replay otherwise."""
    prompts, sampling = prompts_of([9, 9, 7, 7]), Sampling(max_new_tokens=40, temperature=1.5)
    run = lambda ev, rates: rollout(model, prompts, sampling, ev, rates=rates,
                                    generator=torch.Generator().manual_seed(0),
                                    eviction_generator=torch.Generator().manual_seed(1))
    mixed, full = run(EV, torch.tensor([0.0, 0.5, 0.0, 0.5])), run(None, None)
    same = [a == b for a, b in zip(mixed.completions(), full.completions())]
    assert same == [True, False, True, False] and (mixed.n_rounds > 0).all()
    masked, causal = replay(model, mixed)[0], replay(model, mixed, causal=True)[0]
    close = [torch.allclose(masked[i], causal[i], atol=1e-5) for i in range(4)]
    assert close == [True, False, True, False]


# ---------------------------------------------------------------------------------------
# Each baseline's scores equal its formula (§5.1, baselines.py)


def test_knorm_scores_and_keeps_the_low_norm_blocks():
    q, keys, kpos, alive, qpos = c = hand_built_cache(holes=())
    norms = torch.tensor([5.0, 1.0, 4.0, 0.5, 3.0, 2.0])  # per block of 2 keys
    keys = keys / keys.norm(dim=-1, keepdim=True) * norms.repeat_interleave(2)[None, None, :, None]
    keys[:, 1] *= 2  # head 1 twice as long: the mean over heads is 1.5 x norm
    c = (q, keys, kpos, alive, qpos)
    expected = -torch.tensor([[sum(keys[0, h, t].norm().item() for h in range(2)) / 2 for t in range(12)]])
    assert torch.allclose(baselines.knorm(None, keys, alive), expected, atol=1e-5)
    assert torch.allclose(expected[0, ::2], -1.5 * norms, atol=1e-5)
    assert keep("knorm", c, 2, 0.5) == [3, 1, 5]  # the three lowest norms, lowest first
    # Negative control: NGC's attention scores keep a different set.
    assert sorted(keep("ngc", c, 2, 0.5)) != [1, 3, 5]


def test_keydiff_scores_use_the_mean_of_normalised_alive_keys():
    q, keys, kpos, alive, qpos = c = hand_built_cache()
    expected = torch.zeros(12)
    for h in range(2):
        live = [t for t in range(12) if alive[0, t]]
        anchor = sum(keys[0, h, t] / keys[0, h, t].norm() for t in live) / len(live)
        for t in range(12):
            expected[t] -= torch.dot(keys[0, h, t], anchor) / (keys[0, h, t].norm() * anchor.norm()) / 2
    got = baselines.keydiff(None, keys, alive)[0]
    assert torch.allclose(got[alive[0]], expected[alive[0]], atol=1e-5)
    # Negative control: an anchor over every slot, dead keys included, scores differently.
    everything = baselines.keydiff(None, keys, torch.ones_like(alive))[0]
    assert (everything - got)[alive[0]].abs().max() > 1e-3
    # The most diverse block (lowest mean cosine to the anchor) is kept first.
    means, _ = block_means(expected[None], alive, 3)
    assert keep("keydiff", c, 3, 0.5)[0] == int(means.argmax())


def test_snapkv_is_psi_smoothed_by_a_5_pool_over_alive_keys():
    q, keys, kpos, alive, qpos = c = hand_built_cache(S=14, holes=(1, 6, 7))
    psi = psi_by_hand(c)
    live = alive[0].nonzero().flatten().tolist()  # neighbours are the alive keys in position order
    expected = torch.zeros(14)
    for r, t in enumerate(live):
        window = live[max(r - 2, 0): r + 3]  # cut short at the edges (count_include_pad=False)
        expected[t] = psi[window].mean()
    got = baselines.snapkv(psi[None], keys, alive)[0]
    assert torch.allclose(got, expected, atol=1e-6)
    assert got[~alive[0]].eq(0).all()
    # The round feeds SnapKV the engine's own ψ and keeps the top K blocks of the smoothed means.
    means, _ = block_means(expected[None], alive, 3)
    assert keep("snapkv", c, 3, 0.5) == ordered_topk(means, torch.tensor([2]))[0].tolist()
    # Negative control: pooling over slots (dead ones counted as zeros) is not the same.
    slots = torch.nn.functional.avg_pool1d(torch.where(alive, psi, 0.0)[None], 5, 1, 2)[0, 0]
    assert (slots - expected)[alive[0]].abs().max() > 1e-3


@pytest.mark.parametrize("block, rate, sinks", [(3, 0.5, [0, 1]), (3, 0.8, [0, 1]), (4, 0.5, [0]), (2, 0.5, [0, 1]),
                                               (2, 0.95, [0, 1]), (5, 0.9, [0])])
def test_streamingllm_keeps_the_sink_block_and_the_newest(block, rate, sinks):
    c = hand_built_cache(S=20, holes=(0, 5, 11))  # position 0 is dead: the sinks are the first 4 alive keys
    n = math.ceil(17 / block)
    k = int(keep_count(torch.tensor([n]), rate))
    kept = keep("streamingllm", c, block, rate)
    assert len(kept) == k
    assert kept == (sinks + [j for j in range(n - 1, -1, -1) if j not in sinks])[:k]
    # Negative control: recency alone (the rank, no sink bonus) drops the sink block when K < N.
    rank = (c[3].long().cumsum(1) - 1).float()
    means, _ = block_means(rank, c[3], block)
    if k < n:
        assert 0 not in ordered_topk(means, torch.tensor([k]))[0].tolist()


def kept_frequencies(policy, c, block, rate, n, prompt=None):
    """How often each block is kept over n rounds (n rows, one round)."""
    torch.manual_seed(0)  # the round draws its Gumbel noise from the global generator here
    sigma, _ = rounds(c, block, rate, policy, n, prompt)
    counts = Counter(sigma[sigma >= 0].tolist())
    return {j: counts[j] / n for j in sorted(counts)}


@pytest.mark.parametrize("name", ["random", "luck"])
def test_random_keeps_k_blocks_uniformly(name):
    """random, and the hindsight bound's luck control: K of the N blocks, each kept with probability K/N
    (within 4 SE over 1000 rounds)."""
    c = hand_built_cache(S=12, holes=())  # 6 blocks of 2, K = 3
    n = 1000
    freq = kept_frequencies(name, c, 2, 0.5, n)
    assert set(freq) == set(range(6)) and all(abs(f - 0.5) < 4 * (0.25 / n) ** 0.5 for f in freq.values()), freq
    assert all(len(keep(name, c, 2, 0.5)) == 3 for _ in range(5))
    # Negative control: NGC's own sampled policy on ψ is far from uniform here.
    ngc_freq = kept_frequencies("ngc-sample", c, 2, 0.5, n)
    assert max(abs(ngc_freq.get(j, 0.0) - 0.5) for j in range(6)) > 0.1, ngc_freq


def test_random_prompt_keeps_the_prompt_then_random_completion_blocks():
    """random-prompt: the blocks holding the prompt's 4 keys always, the rest of K uniformly from the
    completion's blocks; when K is below the prompt's blocks, prompt blocks only."""
    c = hand_built_cache(S=12, holes=())  # 6 blocks of 2; the prompt fills blocks 0 and 1
    prompt = (torch.zeros(1, 4, dtype=torch.long), torch.tensor([4]))
    n = 800
    freq = kept_frequencies("random-prompt", c, 2, 0.34, n, prompt)  # K = 4: 2 prompt + 2 of the 4 others
    assert freq[0] == freq[1] == 1.0
    assert all(abs(freq[j] - 0.5) < 4 * (0.25 / n) ** 0.5 for j in range(2, 6)), freq
    assert all(sorted(keep("random-prompt", c, 2, 0.9, prompt)) in ([0], [1]) for _ in range(20))  # K = 1
    # Negative control: plain random drops a prompt block.
    assert kept_frequencies("random", c, 2, 0.34, 200)[0] < 1.0


def test_task_rule_keeps_the_target_block_then_the_newest():
    """task-rule: the block holding the key after the marker token (the target), then the newest."""
    c = hand_built_cache(S=12, holes=())  # 6 blocks of 2
    marker = 7
    prompt = (torch.tensor([[3, 3, 3, 3, marker, 9]]), torch.tensor([6]))  # the target is key 5: block 2
    rule = dict(greedy=True, score=baselines.task_rule(marker))
    assert keep(rule, c, 2, 0.5, prompt) == [2, 5, 4]
    assert keep(rule, c, 2, 0.8, prompt) == [2]
    # Negative control: a prompt without the marker leaves recency alone.
    assert keep(rule, c, 2, 0.5, (torch.tensor([[3, 3, 3, 3, 8, 9]]), torch.tensor([6]))) == [5, 4, 3]


def test_number_rule_keeps_the_blocks_of_the_prompts_numbers_then_the_newest():
    """number-rule: the blocks holding a prompt key whose token is a number, then the newest; a number
    token in the completion is not pinned."""
    c = hand_built_cache(S=12, holes=())  # 6 blocks of 2
    is_number = torch.zeros(12, dtype=torch.bool)
    is_number[[9, 10]] = True
    prompt = (torch.tensor([[3, 9, 3, 3, 3, 10, 9]]), torch.tensor([6]))  # numbers at keys 1 and 5: blocks 0 and 2
    rule = dict(greedy=True, score=baselines.number_rule(is_number))
    assert keep(rule, c, 2, 0.5, prompt) == [2, 0, 5]  # (pinned blocks rank by their mean: block 2 holds the newer key)
    assert keep(rule, c, 2, 0.7, prompt) == [2, 0]
    # Negative control: without number tokens in the prompt, recency alone.
    assert keep(rule, c, 2, 0.5, (torch.tensor([[3, 3, 3, 3, 3, 3, 9]]), torch.tensor([6]))) == [5, 4, 3]


def test_oracle_scores_each_key_by_the_attention_of_the_next_delta_queries(model):
    """oracle: after token t, key s scores the attention that the reference's queries t+1..t+δ paid
    it (mean over heads), summed; computed here query by query from the model's own q and k."""
    ref = rollout(model, prompts_of([5, 9]), Sampling(max_new_tokens=16, greedy=True), None, eos_ids=[])
    T = ref.tokens.shape[1]
    att = []
    causal = torch.ones(T, T, dtype=torch.bool).tril().expand(2, T, T)
    model(ref.tokens, torch.arange(T).expand(2, T), qk_hook=lambda layer, q, k, mask: att.append(
        ngc.attention_scores(q, k, causal)))
    delta, t, layer = 4, 9, 1
    score = baselines.lookahead(baselines.future_attention(model, ref), delta)
    key_pos = torch.arange(T).expand(2, T)
    alive = key_pos <= t
    at = ngc.Round(torch.tensor([0, 1]), layer, key_pos, torch.full((2, 3), t), ref.tokens, ref.prompt_lens)
    got = score(None, None, alive, at)
    by_hand = sum(att[layer][:, q] for q in range(t + 1, t + 1 + delta))  # (2, T)
    assert (got - by_hand).abs().max() < 1e-5
    # Negative control: the δ queries up to t (shifted by one) score otherwise.
    shifted = sum(att[layer][:, q] for q in range(t, t + delta))
    assert (got - shifted).abs().max() > 1e-3


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_sampling_from_non_finite_logits_gives_a_token_id(value):
    """A diverged model's logits (NaN or ±inf) still give token ids of the vocabulary, in every
    sampling mode, so the rollout can finish and training can report the divergence."""
    V = 7
    logits = torch.full((3, V), value)
    for s in (Sampling(temperature=1.0, top_k=0), Sampling(temperature=1.0, top_k=3),
              Sampling(temperature=0.7, top_k=0, top_p=0.9), Sampling(greedy=True)):
        tok, _ = ngc.sample_tokens(logits, s, torch.Generator().manual_seed(0))
        assert ((0 <= tok) & (tok < V)).all(), (s, tok)
