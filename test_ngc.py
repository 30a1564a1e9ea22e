"""Tests for NGC. Run: pytest test_ngc.py

Every model here is a tiny random Qwen2 written to disk in the Hugging Face layout
(config.json, model.safetensors, tokenizer.json) and loaded back through from_pretrained,
the same path as the real checkpoint. Everything runs on the CPU in fp32.
"""
import builtins
import inspect
import itertools
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
import types
from dataclasses import replace
from fractions import Fraction
from html.parser import HTMLParser
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models, pre_tokenizers, processors

import baselines
import countdown as cd
import compiled
import distributed
import eval as evaluation
import rundir
import tasks
import make_tiny
import mathtask as mt
import ngc
import show
import train
from countdown import PAPER, SMALL, Problem, tiny_prompt

from gumbel import block_means, gumbel_topk, keep_count, kept_keys, ordered_topk, plackett_luce_log_prob
from checkpoint import (META_TOKEN, CheckpointError, add_meta_token, config_from_dict, from_pretrained, load_tokenizer,
                        save_pretrained)
from model import KVCache, LayerCache, Qwen2, Qwen2Config, init_weights
from make_tiny import build_tokenizer, check_trace, split_problems, trace
from ngc import Eviction, Sampling, rollout
from replay import death_times, replay, visibility

torch.set_num_threads(1)  # tiny models: one thread is fastest, and immune to a busy second core
EOS = 1
TINY_MODEL = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, eos_token_id=EOS)  # GQA: 2 query heads per KV head


def write_checkpoint(path, seed=0, std=0.1, **overrides):
    """A random Qwen2 saved as config.json + model.safetensors + tokenizer.json."""
    cfg = Qwen2Config(**{**TINY_MODEL, **overrides})
    model = init_weights(Qwen2(cfg), std=std, seed=seed)
    save_pretrained(model, str(path))
    vocab = {"<pad>": 0, "<eos>": EOS, **{f"w{i}": i for i in range(2, cfg.vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(path, "tokenizer.json"))
    return str(path)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def model(ckpt):
    torch.manual_seed(0)
    return from_pretrained(ckpt).eval()


def prompts_of(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, TINY_MODEL["vocab_size"], (n,), generator=g).tolist() for n in lengths]


# ---------------------------------------------------------------------------------------
# 1. Replay = rollout (§4.5, App. A.3)


EV = Eviction(delta=12, block=3, window=4, rate=0.5)


@pytest.fixture(scope="module")
def sampled(model):
    """Sampled tokens and Gumbel-top-k evictions: prompts of 5..17 tokens (one longer than δ,
    so prefill is chunked around a round), EOS for some rows and max length for others."""
    g = torch.Generator().manual_seed(3)
    ro = rollout(model, prompts_of([5, 17, 9, 3, 11, 7]), Sampling(max_new_tokens=60, temperature=1.0, top_k=0),
                 EV, eos_ids=[EOS], generator=g)
    return ro


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
    c = types.SimpleNamespace(mode="ngc", temperature=1.0, max_new_tokens=10)
    adv = torch.tensor([0.5, -0.5])
    l_token, l_mem, _ = train.policy_losses(None, ro, adv, train.MODES[c.mode], c.max_new_tokens, n_total=4)
    # L_token = -(0.5·(-3) + (-0.5)·(-1)) / (4·10) = 1/40
    assert l_token.item() == pytest.approx(1 / 40, abs=1e-9)
    # rollout 0: layer means (-1-3)/2 = -2, (-2-4)/2 = -3; rollout 1: -0.5, -1.5 (one round)
    # L_mem = -(0.5·(-2-3) + (-0.5)·(-0.5-1.5)) / 4 = 1.5/4
    assert l_mem.item() == pytest.approx(1.5 / 4, abs=1e-9)
    c.mode = "token-only"
    assert train.policy_losses(None, ro, adv, train.MODES[c.mode], c.max_new_tokens, n_total=4)[1] is None


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_one_step_on_l_mem_moves_log_p_sigma_with_the_advantage(ckpt, sampled, sign):
    """Gradient descent on L_mem alone raises log p(σ) of a rollout with A > 0 and lowers it with
    A < 0, for each rollout on its own (so no other rollout's gradient interferes)."""
    c = types.SimpleNamespace(mode="ngc", temperature=1.0, max_new_tokens=30)
    for row in range(len(sampled.n_rounds)):
        if sampled.n_rounds[row] == 0:
            continue
        model = from_pretrained(ckpt)
        ro = sampled.select(torch.tensor([row]))
        before = replay(model, ro)[1].sum().item()
        _, l_mem, _ = train.policy_losses(model, ro, torch.tensor([sign]), train.MODES[c.mode], c.max_new_tokens, n_total=1)
        l_mem.backward()
        torch.optim.SGD(model.parameters(), lr=1e-3).step()
        after = replay(model, ro)[1].sum().item()
        assert (after - before) * sign > 0, (row, before, after)


def test_per_term_gradient_norms_are_those_of_each_loss_alone(ckpt, sampled):
    """--term-grad-norms: one extra backward gives ‖∇L_token‖, and ‖∇L_mem‖ is the total minus it."""
    model = from_pretrained(ckpt)
    params = list(model.parameters())
    c = types.SimpleNamespace(mode="ngc", temperature=1.0, max_new_tokens=30)
    adv = torch.linspace(-1, 1, len(sampled.n_rounds))
    diag = train.TermGradNorms(params)
    for rows in torch.arange(len(adv)).split(2):  # micro-batches, as in train.backward
        l_token, l_mem, _ = train.policy_losses(model, sampled.select(rows), adv[rows], train.MODES[c.mode], c.max_new_tokens, n_total=len(adv))
        diag.add(l_token)
        (l_token + l_mem).backward()
    norms = diag.norms(has_mem=True)
    l_token, l_mem, _ = train.policy_losses(model, sampled, adv, train.MODES[c.mode], c.max_new_tokens, n_total=len(adv))
    for loss, key in ((l_token, "grad_norm_token"), (l_mem, "grad_norm_mem")):
        grads = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
        direct = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads if g is not None])).item()
        assert norms[key] == pytest.approx(direct, rel=1e-4), key
    assert abs(norms["grad_norm_token"] - norms["grad_norm_mem"]) > 1e-3 * norms["grad_norm_mem"]  # two different numbers


def test_a_micro_batch_without_rounds_adds_nothing_to_l_mem(ckpt):
    """A rollout that ends before its first round has no eviction term; its micro-batch adds 0 to
    L_mem, and the step's L_mem is that of the rollouts that had rounds."""
    model = from_pretrained(ckpt)
    ro = rollout(model, prompts_of([3, 14]), Sampling(max_new_tokens=5, temperature=1.0, top_k=0), EV,
                 eos_ids=[], generator=torch.Generator().manual_seed(0))
    assert ro.n_rounds.tolist() == [0, 1]  # 3 + 5 tokens never reach δ = 12
    c = types.SimpleNamespace(mode="ngc", temperature=1.0, max_new_tokens=5, micro_batch=1, term_grad_norms=False)
    adv = torch.tensor([1.0, -1.0])
    losses = train.backward(model, ro, adv, c)
    _, l_mem, _ = train.policy_losses(model, ro.select(torch.tensor([1])), adv[1:], train.MODES[c.mode], c.max_new_tokens, n_total=2)
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


def test_peaked_logits_stay_finite():
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(64, 40, generator=g) * 50).requires_grad_()
    k = torch.full((64,), 39)
    sigma = gumbel_topk(logits.detach(), k, g)
    lp = plackett_luce_log_prob(logits, sigma)
    lp.sum().backward()
    assert torch.isfinite(lp).all() and torch.isfinite(logits.grad).all()
    greedy = plackett_luce_log_prob(logits.detach(), ordered_topk(logits.detach(), k))
    assert torch.isfinite(greedy).all() and (greedy <= 0).all()
    # Negative control: the subtractive form log(1 - cumsum p) breaks on the same input.
    p = logits.detach().gather(1, sigma).softmax(1)  # any peaked distribution will do
    naive = torch.log(1 - torch.cumsum(logits.detach().softmax(1).gather(1, sigma), 1))
    assert not torch.isfinite(naive).all() and torch.isfinite(p).all()


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
# 6. The model is Qwen2


def test_cached_decode_equals_full_forward(model):
    x = torch.tensor(prompts_of([20])[0])[None]
    pos = torch.arange(20)[None]
    full = model.logits(model(x, pos))
    cache = KVCache(model.config, 1, 20, torch.float32, "cpu")
    steps = [model.logits(model(x[:, :7], pos[:, :7], cache=cache, valid=torch.ones(1, 7, dtype=torch.bool)))]
    for t in range(7, 20):
        steps.append(model.logits(model(x[:, t:t + 1], pos[:, t:t + 1], cache=cache,
                                        valid=torch.ones(1, 1, dtype=torch.bool))))
    diff = (torch.cat(steps, 1) - full).abs().max().item()
    assert diff < 1e-5
    # RoPE is relative: a uniform shift of positions changes nothing, a gap changes logits.
    assert (model.logits(model(x, pos + 3)) - full).abs().max() < 1e-4
    gap = torch.where(pos >= 10, pos + 3, pos)
    assert (model.logits(model(x, gap)) - full).abs().max() > 1e-3


def test_sharded_and_single_file_checkpoints_agree(ckpt, tmp_path, model):
    state = load_file(os.path.join(ckpt, "model.safetensors"))
    names = sorted(state)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in halves.items():
        save_file({n: state[n] for n in part}, tmp_path / file)
    index = {"weight_map": {n: f for f, part in halves.items() for n in part}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "config.json").write_text(open(os.path.join(ckpt, "config.json")).read())
    sharded = from_pretrained(str(tmp_path))
    x = torch.tensor(prompts_of([9])[0])[None]
    pos = torch.arange(9)[None]
    assert torch.equal(sharded.logits(sharded(x, pos)), model.logits(model(x, pos)))


def test_tied_and_untied_heads_load(tmp_path):
    for tied in (True, False):
        path = write_checkpoint(tmp_path / str(tied), tie_word_embeddings=tied)
        names = load_file(os.path.join(path, "model.safetensors")).keys()
        assert ("lm_head.weight" in names) != tied
        m = from_pretrained(path)
        assert (m.lm_head.weight is m.model.embed_tokens.weight) == tied
        assert load_tokenizer(path).token_to_id("<eos>") == EOS


def test_bad_checkpoints_name_the_tensor(ckpt, tmp_path):
    state = load_file(os.path.join(ckpt, "model.safetensors"))
    config = open(os.path.join(ckpt, "config.json")).read()
    (tmp_path / "config.json").write_text(config)
    wrong = dict(state)
    wrong["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(3, 3)
    save_file(wrong, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight.*shape"):
        from_pretrained(str(tmp_path))
    missing = {k: v for k, v in state.items() if k != "model.layers.2.mlp.up_proj.weight"}
    save_file(missing, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.mlp\.up_proj\.weight"):
        from_pretrained(str(tmp_path))
    with pytest.raises(CheckpointError, match="no config.json"):
        from_pretrained(str(tmp_path / "nowhere"))


def test_config_generations_and_refusals(ckpt, tmp_path):
    d = json.load(open(os.path.join(ckpt, "config.json")))
    new = {k: v for k, v in d.items() if k != "rope_theta"}
    new["rope_parameters"] = {"rope_type": "default", "rope_theta": 1234.0}
    assert config_from_dict(new).rope_theta == 1234.0
    assert config_from_dict({**d, "rope_theta": 99.0}).rope_theta == 99.0
    with pytest.raises(CheckpointError, match="rope_scaling"):
        config_from_dict({**d, "rope_scaling": {"type": "yarn", "factor": 4}})
    with pytest.raises(CheckpointError, match="sliding"):
        config_from_dict({**d, "use_sliding_window": True, "sliding_window": 64})
    assert config_from_dict({**d, "use_sliding_window": False, "sliding_window": 64}).hidden_size == 64


# ---------------------------------------------------------------------------------------
# 7. Memory bound (App. A.2)


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


def test_compiled_decode_step_gives_the_eager_rollout(model):
    """rollout(compile=True) captures the decode step with torch.compile whole (fullgraph: a host
    sync or a changing shape in it fails to compile) on the same static buffers: the same greedy
    tokens and decisions as eager, token log-probs to 1e-5, and replay reproduces it. The second
    call reuses the buffers and the compiled step."""
    ev = Eviction(delta=10, block=3, window=3, rate=0.5, greedy=True)
    s = Sampling(max_new_tokens=40, greedy=True)
    prompts = prompts_of([3, 14, 7, 22, 5], seed=1)
    eager = rollout(model, prompts, s, ev, eos_ids=[EOS])
    for _ in range(2):
        captured = rollout(model, prompts, s, ev, eos_ids=[EOS], compile=True)
        assert torch.equal(captured.tokens, eager.tokens) and torch.equal(captured.kept, eager.kept)
        assert torch.equal(captured.peak_kv, eager.peak_kv) and captured.kv_slots == eager.kv_slots
        assert (captured.logprobs - eager.logprobs).abs().max() < 1e-5
    assert int(captured.n_rounds.min()) >= 2
    tok_lp, _ = replay(model, captured)
    completion = (tok_lp != 0) | (captured.logprobs != 0)
    assert (tok_lp - captured.logprobs)[completion].abs().max() < 1e-5
    # Negative control: the plain causal mask does not reproduce it (the compiled step did evict).
    causal, _ = replay(model, captured, causal=True)
    assert (causal - captured.logprobs)[completion].abs().max() > 1e-2


@pytest.mark.parametrize("slots", [0, 10_000])
def test_compiled_step_with_either_attention_form_gives_the_eager_rollout(model, monkeypatch, slots):
    """On the CPU the compiled step takes SDPA's math form for caches up to SDPA_MATH_MAX_SLOTS
    and the fused kernel above: both give the eager rollout, with eviction and with the full cache."""
    monkeypatch.setattr(compiled, "SDPA_MATH_MAX_SLOTS", slots)
    s = Sampling(max_new_tokens=30, greedy=True)
    prompts = prompts_of([3, 14, 7], seed=2)
    for ev in (Eviction(delta=10, block=3, window=3, rate=0.5, greedy=True), None):
        eager = rollout(model, prompts, s, ev, eos_ids=[EOS])
        captured = rollout(model, prompts, s, ev, eos_ids=[EOS], compile=True)
        assert torch.equal(captured.tokens, eager.tokens) and torch.equal(captured.kept, eager.kept)
        assert (captured.logprobs - eager.logprobs).abs().max() < 1e-5


# ---------------------------------------------------------------------------------------
# 8. Bad arguments


@pytest.mark.parametrize("kwargs, message", [
    (dict(rate=0.0), "must lie in"), (dict(rate=1.5), "must lie in"), (dict(block=0), "block size"),
    (dict(window=0), "window"), (dict(delta=4, window=4), "larger than the window"),
    (dict(delta=8, block=16, window=2), "at least the block size"), (dict(score=baselines.knorm), "pass greedy=True"),
])
def test_bad_eviction_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message) as err:
        Eviction(**{**dict(delta=16, block=4, window=3, rate=0.5), **kwargs})
    assert "\n" not in str(err.value)


def test_bad_rollout_arguments(model):
    with pytest.raises(ValueError, match="must lie in"):
        rollout(model, prompts_of([4]), Sampling(max_new_tokens=4), EV, rates=[1.2])
    with pytest.raises(ValueError, match="temperature"):
        Sampling(temperature=0)
    with pytest.raises(ValueError, match="at least one token"):
        rollout(model, [[]], Sampling(max_new_tokens=4))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_bf16_replay_agrees_by_argmax(ckpt):
    model = from_pretrained(ckpt, dtype=torch.bfloat16, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    ro = rollout(model, prompts_of([5, 17, 9, 3]), Sampling(max_new_tokens=40, greedy=True), EV,
                 eos_ids=[EOS], generator=g)
    tok_lp, ev_lp = replay(model, ro)
    completion = ro.logprobs != 0
    assert torch.isfinite(tok_lp).all() and torch.isfinite(ev_lp).all()
    assert (tok_lp - ro.logprobs)[completion].abs().max() < 0.2


# ---------------------------------------------------------------------------------------
# 9. Training (train.py): curriculum (§4.6), modes, checkpoints, signals, logs, bad input


TRAIN_DEFAULTS = dict(difficulty="tiny", train_problems=64, eval_problems=4, prompts=2, group=4, max_new_tokens=24,
                      temperature=1.0, top_k=0, delta=8, block=2, window=3, retention="0.75,0.5", stage_steps=1,
                      micro_batch=3, eval_every=0, save_every=0, lr=1e-3)


@pytest.fixture(scope="module")
def train_ckpt(tmp_path_factory):
    path = write_checkpoint(tmp_path_factory.mktemp("train_model"), seed=1)
    with open(os.path.join(path, "ngc.json"), "w") as f:
        json.dump(TRAIN_DEFAULTS, f)
    return path


def parity_reward(text, problem):
    """A stand-in reward with variance inside a group (the random model never solves Countdown)."""
    return float(sum(map(ord, text)) % 2)


def run_train(ckpt, out, *flags):
    train.main(["--model", ckpt, "--out", str(out), "--threads", "1", *flags], reward_fn=parity_reward)
    return [json.loads(line) for line in open(os.path.join(out, "log.jsonl"))]


def test_curriculum_matches_the_paper_formula():
    stages, D, a = [0.9, 0.7, 0.5], 10, 0.6
    expected = {0: 0.9, 3: 0.9, 4: 0.9, 7: 0.9 + (0.7 - 0.4) / 0.6 * (0.7 - 0.9), 9: 0.9 + (0.9 - 0.4) / 0.6 * -0.2,
                10: 0.7, 13: 0.7, 17: 0.7 + 0.5 * -0.2, 20: 0.5, 35: 0.5, 1000: 0.5}
    for step, value in expected.items():
        assert abs(train.retention_at(step, stages, D, a) - value) < 1e-12, step
    # the blend is continuous at the stage edge: just before step 10 it approaches 0.7
    assert abs(train.retention_at(10, stages, D, a) - (0.9 + (1 - 0.4) / 0.6 * -0.2)) < 1e-12


@pytest.mark.parametrize("mode", list(train.MODES))
def test_one_training_step_in_each_mode(train_ckpt, tmp_path, mode):
    before = from_pretrained(train_ckpt).state_dict()
    flags = ["--mode", mode, "--steps", "1", "--term-grad-norms"] + (["--eval-every", "1"] if mode == "ngc" else [])
    log = run_train(train_ckpt, tmp_path, *flags)
    step = [r for r in log if "eval" not in r][0]
    assert list(step) == rundir.STEP_KEYS  # one schema for every step record
    assert math.isfinite(step["L_token"]) and math.isfinite(step["grad_norm"]) and step["grad_norm"] > 0
    assert step["grad_norm_token"] > 0
    if mode == "ngc":
        assert math.isfinite(step["L_mem"]) and step["L_mem"] != 0 and step["grad_norm_mem"] > 0
        assert step["rounds"] > 0 and len([r for r in log if "eval" in r]) == 2
    else:
        assert step["L_mem"] is None and step["grad_norm_mem"] is None
    assert (step["rounds"] > 0) == (mode != "no-evict")
    after = from_pretrained(os.path.join(tmp_path, "checkpoint")).state_dict()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert len(changed) == len(before)  # every tensor moved (Adam's first step is ±lr everywhere)


def test_targeted_dropout_scores_tokens_under_the_causal_mask(train_ckpt, model):
    c = train.resolve(train.parse_args(["--model", train_ckpt, "--mode", "targeted-dropout"]))
    ro = rollout(model, prompts_of([5, 9, 3]), Sampling(max_new_tokens=30, temperature=1.0, top_k=0), EV,
                 eos_ids=[EOS], generator=torch.Generator().manual_seed(0))
    adv = torch.tensor([1.0, -1.0, 0.5])
    _, l_mem, tok_lp = train.policy_losses(model, ro, adv, train.MODES[c.mode], c.max_new_tokens, n_total=3)
    assert l_mem is None
    causal, _ = replay(model, ro, causal=True)
    masked, _ = replay(model, ro)
    assert torch.equal(tok_lp, causal) and (tok_lp - masked).abs().max() > 1e-2


def test_resume_continues_exactly(train_ckpt, tmp_path):
    straight = run_train(train_ckpt, tmp_path / "a", "--steps", "2")
    run_train(train_ckpt, tmp_path / "b", "--steps", "1")
    resumed = run_train(train_ckpt, tmp_path / "b", "--steps", "2", "--resume", str(tmp_path / "b"))
    assert [r["step"] for r in resumed] == [0, 1]
    for key in ("reward", "L_token", "L_mem", "grad_norm", "response_len"):
        assert abs(straight[1][key] - resumed[1][key]) < 1e-6, key
    # Negative control: a different seed gives a different second step.
    other = run_train(train_ckpt, tmp_path / "c", "--steps", "2", "--seed", "5")
    assert abs(other[1]["L_token"] - straight[1]["L_token"]) > 1e-6


def save_small_checkpoint(train_ckpt, run_dir, step=3, scale=1.5):
    m = from_pretrained(train_ckpt)
    with torch.no_grad():
        m.lm_head.weight.mul_(scale)  # something a fresh load of train_ckpt would not have
    c = train.resolve(train.parse_args(["--model", train_ckpt, "--out", str(run_dir), "--overwrite"]))
    opt = train.make_optimizer(m, c)
    rundir.save_checkpoint(str(run_dir), m, opt, load_tokenizer(train_ckpt), train_ckpt, step, tasks.as_settings(c))
    return m


def test_checkpoint_loads_back_with_identical_logits(train_ckpt, tmp_path):
    m = save_small_checkpoint(train_ckpt, tmp_path)
    back = from_pretrained(os.path.join(tmp_path, "checkpoint"))
    x = torch.tensor(prompts_of([12])[0])[None]
    pos = torch.arange(12)[None]
    assert torch.equal(back.logits(back(x, pos)), m.logits(m(x, pos)))
    assert sorted(os.listdir(tmp_path / "checkpoint")) == [
        "config.json", "generation_config.json", "model.safetensors", "ngc.json", "tokenizer.json",
        "tokenizer_config.json", "trainer.pt"]
    assert tasks.run_defaults(str(tmp_path / "checkpoint"))["delta"] == TRAIN_DEFAULTS["delta"]
    assert tasks.run_defaults(str(tmp_path / "checkpoint"))["retention"] == TRAIN_DEFAULTS["retention"]
    tok_cfg = json.loads((tmp_path / "checkpoint" / "tokenizer_config.json").read_text())
    assert tok_cfg["eos_token"] == "<eos>" and tok_cfg["pad_token"] == "<pad>"
    assert json.loads((tmp_path / "checkpoint" / "generation_config.json").read_text())["eos_token_id"] == EOS
    # Control: another scale gives other logits, so the equality above is not vacuous.
    other = save_small_checkpoint(train_ckpt, tmp_path / "b", scale=2.0)
    assert not torch.equal(other.logits(other(x, pos)), m.logits(m(x, pos)))


def test_checkpoint_carries_the_chat_template_and_generation_config(train_ckpt, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(train_ckpt, src)
    (src / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}", "eos_token": "<eos>"}))
    (src / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS, "temperature": 0.6, "top_p": 0.95}))
    m, tok = from_pretrained(str(src)), load_tokenizer(str(src))
    c = train.resolve(train.parse_args(["--model", str(src), "--out", str(tmp_path / "run")]))
    rundir.save_checkpoint(str(tmp_path / "run"), m, train.make_optimizer(m, c), tok, str(src), 0, tasks.as_settings(c))
    out = tmp_path / "run" / "checkpoint"
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_cfg["chat_template"] == "{{ messages }}" and tok_cfg["pad_token"] == "<pad>"
    assert json.loads((out / "generation_config.json").read_text())["top_p"] == 0.95


def test_transformers_loads_the_checkpoint(train_ckpt, tmp_path):
    """The checkpoint is a complete Hugging Face directory: model and tokenizer load in transformers
    (when it is installed; it is never needed at run time) and give our logits."""
    transformers = pytest.importorskip("transformers")
    m = save_small_checkpoint(train_ckpt, tmp_path)
    path = str(tmp_path / "checkpoint")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(path)  # no token invented: pad and EOS are ours
    assert (tok.pad_token, tok.pad_token_id, tok.eos_token_id) == ("<pad>", 0, EOS) and len(tok) == 96
    # transformers 5 builds Qwen2's byte-level BPE class for model_type qwen2 whatever the file says;
    # this word-level test tokenizer (like tiny/'s) loads as it is with the generic class.
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(path)
    batch = tok(["w5 w6 w7", "w9"], padding=True, return_tensors="pt")
    assert batch["input_ids"].tolist() == [[5, 6, 7], [9, 0, 0]] and tok.pad_token_id == 0
    x = torch.tensor(prompts_of([12])[0])[None]
    with torch.no_grad():
        ours = m.logits(m(x, torch.arange(12)[None]))
        assert (hf(x).logits - ours).abs().max() < 1e-4


def run_dir_state(path):
    return {p.name: (p.read_bytes() if p.is_file() else sorted(q.name for q in p.iterdir())) for p in path.iterdir()}


def test_a_new_run_never_overwrites_another(train_ckpt, tmp_path):
    run_train(train_ckpt, tmp_path, "--steps", "1")
    before = run_dir_state(tmp_path)
    with pytest.raises(SystemExit) as err:
        run_train(train_ckpt, tmp_path, "--steps", "1")
    assert "already holds a run" in str(err.value) and "--resume" in str(err.value) and "\n" not in str(err.value)
    assert run_dir_state(tmp_path) == before  # nothing touched
    with pytest.raises(SystemExit) as err:  # --resume continues in place; another --out is refused
        train.main(["--resume", str(tmp_path), "--out", str(tmp_path / "elsewhere")])
    assert "drop --out" in str(err.value) and not (tmp_path / "elsewhere").exists()
    log = run_train(train_ckpt, tmp_path, "--steps", "1", "--seed", "3", "--overwrite")
    assert [r["step"] for r in log] == [0] and run_dir_state(tmp_path) != before


def test_a_kill_at_any_point_of_the_checkpoint_swap_leaves_a_checkpoint(train_ckpt, tmp_path, monkeypatch):
    """Kill the save before each rename (file or directory) it makes and before it deletes the old
    copy: resume then finds a complete checkpoint (the old step or the new one), and the next save
    works and leaves nothing behind."""
    class Killed(Exception):
        pass

    real_replace, calls = os.replace, []
    monkeypatch.setattr(os, "replace", lambda a, b: calls.append((a, b)) or real_replace(a, b))
    save_small_checkpoint(train_ckpt, tmp_path / "count", step=1)
    monkeypatch.undo()
    n_renames = len(calls)
    assert n_renames >= 5  # the files of the model directory, then the two directory renames
    for kill_at in range(n_renames + 2):  # the last two: killed after the last rename, before/while deleting
        run = tmp_path / f"kill{kill_at}"
        save_small_checkpoint(train_ckpt, run, step=1, scale=1.0)
        count = iter(range(10 ** 6))

        def dying_replace(a, b):
            if next(count) == kill_at:
                raise Killed
            real_replace(a, b)

        def dying_rmtree(path, ignore_errors=False):
            if os.path.exists(path):
                if kill_at == n_renames + 1:  # half deleted
                    next(p for p in Path(path).iterdir() if p.is_file()).unlink()
                raise Killed

        monkeypatch.setattr(os, "replace", dying_replace)
        monkeypatch.setattr(rundir.shutil, "rmtree", dying_rmtree)
        with pytest.raises(Killed):
            save_small_checkpoint(train_ckpt, run, step=2, scale=2.0)
        monkeypatch.undo()
        state = rundir.load_trainer_state(str(run))  # resume's first move: recover, then read
        back = from_pretrained(str(run / "checkpoint"))
        assert state["step"] in (1, 2)
        expected = 2.0 if state["step"] == 2 else 1.0
        assert torch.equal(back.lm_head.weight, from_pretrained(train_ckpt).lm_head.weight * expected)
        assert sorted(p.name for p in run.iterdir()) == ["checkpoint"]
        save_small_checkpoint(train_ckpt, run, step=3)
        assert rundir.load_trainer_state(str(run))["step"] == 3 and sorted(p.name for p in run.iterdir()) == ["checkpoint"]


def test_a_failed_save_keeps_the_previous_checkpoint(train_ckpt, tmp_path, monkeypatch):
    real, calls = rundir.save_pretrained, []

    def full_disk(model, path, state=None):
        calls.append(path)
        if len(calls) > 1:
            raise OSError(28, "No space left on device")
        real(model, path, state)

    monkeypatch.setattr(rundir, "save_pretrained", full_disk)
    with pytest.raises(SystemExit) as err:  # step 1 saves, the final save at step 2 fails
        run_train(train_ckpt, tmp_path, "--steps", "2", "--save-every", "1")
    assert "could not save" in str(err.value) and "No space left" in str(err.value) and "\n" not in str(err.value)
    assert rundir.load_trainer_state(str(tmp_path))["step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint", "log.jsonl"]


SIGNAL_RUN = "import sys, train; train.main(sys.argv[1:], reward_fn=lambda t, p: float(sum(map(ord, t)) % 2))"


def wait_for_log_lines(path, n, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline and (not path.exists() or len(path.read_text().splitlines()) < n):
        time.sleep(0.05)


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_saves_and_exits_nonzero_and_resume_continues_exactly(train_ckpt, tmp_path, sig, code):
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", SIGNAL_RUN, "--model", train_ckpt, "--out", str(run),
                             "--threads", "1", "--steps", "200"], cwd=os.path.dirname(train.__file__),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for_log_lines(run / "log.jsonl", 2)
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == code, out
    assert "Traceback" not in out and f"continue with --resume {run}" in out
    saved = rundir.load_trainer_state(str(run))["step"]
    logged = [r["step"] for r in rundir.read_log(str(run / "log.jsonl"))]
    assert 2 <= saved < 200 and logged == list(range(saved))  # the checkpoint and the log agree
    resumed = run_train(train_ckpt, run, "--resume", str(run), "--steps", str(saved + 2))
    straight = run_train(train_ckpt, tmp_path / "straight", "--steps", str(saved + 2))
    assert len(resumed) == len(straight) == saved + 2
    for a, b in zip(resumed, straight):
        for key in ("reward", "L_token", "L_mem", "response_len"):
            assert a[key] == pytest.approx(b[key], abs=1e-6), (a["step"], key)


def test_resume_drops_a_cut_last_log_line_and_refuses_a_bad_middle_one(train_ckpt, tmp_path, capsys):
    run_train(train_ckpt, tmp_path, "--steps", "1", "--save-every", "1")
    log = tmp_path / "log.jsonl"
    log.write_text(log.read_text() + '{"step": 1, "rew')  # a crash in the middle of a write
    resumed = run_train(train_ckpt, tmp_path, "--resume", str(tmp_path), "--steps", "2")
    assert [r["step"] for r in resumed] == [0, 1] and "unfinished last line" in capsys.readouterr().out
    log.write_text("garbage\n" + log.read_text())
    with pytest.raises(SystemExit) as err:
        run_train(train_ckpt, tmp_path, "--resume", str(tmp_path), "--steps", "3")
    assert "log.jsonl line 1 is not JSON" in str(err.value) and "\n" not in str(err.value)


def test_log_is_strict_json_and_plain_lines_without_a_terminal(train_ckpt, tmp_path, capsys):
    """Not a terminal (pytest captures): no progress bars, one plain line per step and per
    evaluation; every log record parses as strict JSON (no NaN) with the step schema."""
    run_train(train_ckpt, tmp_path, "--steps", "2", "--eval-every", "1", "--eval-problems", "2")
    out, err = capsys.readouterr()
    assert "\r" not in out + err and "\x1b" not in out + err and "it/s" not in err
    assert [line.split(" |")[0] for line in out.splitlines() if line.startswith("step ")] == ["step 1/2", "step 2/2"]
    assert sum(line.startswith("eval @ step") for line in out.splitlines()) == 3

    def no_constants(name):
        raise ValueError(f"{name} in log")

    records = [json.loads(line, parse_constant=no_constants) for line in open(tmp_path / "log.jsonl")]
    assert [list(r) for r in records if "eval" not in r] == [rundir.STEP_KEYS] * 2
    assert rundir.json_safe({"a": float("nan"), "b": {"c": float("inf")}, "d": 1.5}) == {"a": None, "b": {"c": None},
                                                                                         "d": 1.5}


def break_file(path, how):
    if how == "empty":
        path.write_bytes(b"")
    elif how == "truncated":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    else:
        path.write_text(how)


BAD_TRAIN_FLAGS = [
    (["--stage-steps", "0"], "--stage-steps 0 must be at least 1"), (["--train-problems", "0"], "at least 1"),
    (["--micro-batch", "0"], "--micro-batch 0 must be at least 1"), (["--max-new-tokens", "0"], "at least 1"),
    (["--temperature", "0"], "--temperature 0.0 must be positive"), (["--eval-rate", "1.5"], "must lie in (0, 1]"),
    (["--eval-batch", "0"], "at least 1"), (["--lr", "-1"], "--lr -1.0 must be positive"),
    (["--steps", "-3"], "--steps -3 must be at least 1"), (["--eval-problems", "0"], "at least 1"),
    (["--device", "foo"], "--device 'foo' is not a device"), (["--retention", "0.9,x"], "comma-separated numbers"),
    (["--eviction-rate", "1.5"], "must lie in"), (["--delta", "2"], "larger than the window"),
    (["--group", "1"], "--group"), (["--beta2", "1"], "must lie in [0, 1)"), (["--threads", "0"], "at least 1"),
    (["--steps", "x"], "invalid int value"),
] + ([] if torch.cuda.is_available() else [(["--device", "cuda"], "no CUDA GPU is visible")])
BAD_FILES = [("model.safetensors", "empty", "not a readable safetensors file"),
             ("model.safetensors", "truncated", "not a readable safetensors file"),
             ("tokenizer.json", "{not json", "not a readable tokenizer"),
             ("config.json", "{not json", "config.json is not valid JSON"),
             ("config.json", '{"model_type": "qwen2", "vocab_size": 96}', "config.json lacks hidden_size"),
             ("ngc.json", "[1, 2", "ngc.json is not valid JSON")]


@pytest.mark.parametrize("flags, message", BAD_TRAIN_FLAGS, ids=[" ".join(f) for f, _ in BAD_TRAIN_FLAGS])
def test_bad_training_flags_fail_with_one_line_and_create_nothing(train_ckpt, tmp_path, flags, message):
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as err:
        train.main(["--model", train_ckpt, "--out", str(out), *flags])
    assert str(err.value).startswith("error: ") and message in str(err.value) and "\n" not in str(err.value)
    assert not out.exists()


@pytest.mark.parametrize("file, how, message", BAD_FILES, ids=[f"{f} {h[:9]}" for f, h, _ in BAD_FILES])
def test_broken_checkpoint_files_fail_with_one_line_and_create_nothing(train_ckpt, tmp_path, file, how, message):
    model, out = tmp_path / "model", tmp_path / "run"
    shutil.copytree(train_ckpt, model)
    break_file(model / file, how)
    with pytest.raises(SystemExit) as err:
        train.main(["--model", str(model), "--out", str(out)])
    assert str(err.value).startswith("error: ") and message in str(err.value) and "\n" not in str(err.value)
    assert not out.exists()


def test_bad_resume_and_run_dirs_fail_with_one_line(train_ckpt, tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    run_train(train_ckpt, tmp_path / "run", "--steps", "1")
    break_file(tmp_path / "run" / "checkpoint" / "trainer.pt", "truncated")
    for argv, message in [(["--model", train_ckpt, "--out", str(a_file)], "is a file"),
                          (["--resume", str(tmp_path / "none")], "nothing to resume"),
                          (["--resume", str(tmp_path / "run")], "trainer.pt is unreadable"),
                          (["--model", str(tmp_path / "none")], "no config.json")]:
        with pytest.raises(SystemExit) as err:
            train.main(argv)
        assert str(err.value).startswith("error: ") and message in str(err.value) and "\n" not in str(err.value)


def test_help_shows_the_checkpoints_defaults(train_ckpt, capsys):
    with pytest.raises(SystemExit):
        train.parse_args(["--model", train_ckpt, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"(default {TRAIN_DEFAULTS['delta']})" in text and "(default 0.75,0.5)" in text  # ngc.json's, not the paper's
    with pytest.raises(SystemExit):
        train.parse_args(["--help"])
    assert f"(default {make_tiny.TINY_RUN['steps']})" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------
# 10. Several processes (torchrun, Gloo on the CPU)


def torchrun(tmp_path, *args, nproc=2, timeout=240):
    """Run `torchrun --standalone --nproc_per_node nproc args...` from the repository directory."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), *args]
    here = os.path.dirname(train.__file__)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": here}
    proc = subprocess.run(cmd, cwd=here, capture_output=True, text=True, timeout=timeout,
                          env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


DDP_STEP = """
import sys, torch, torch.distributed as dist, distributed, train
from checkpoint import from_pretrained
ckpt, rollouts, out, reduce = sys.argv[1:]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.set_num_threads(1)
ro, adv, ev, c = torch.load(rollouts, weights_only=False)
rows = torch.arange(len(adv)).chunk(world)[rank]  # this process's prompts: whole groups
if reduce == "sum":  # the negative control: gradients summed over the processes, not averaged
    distributed.average_gradients = lambda params, grads=None: [dist.all_reduce(p.grad) for p in params]
model = from_pretrained(ckpt)
if reduce == "fsdp":
    distributed.shard(model)
opt = train.make_optimizer(model, c)
train.backward(model, ro.select(rows), adv[rows], c)
grads = [p.grad.full_tensor() if reduce == "fsdp" else p.grad.clone() for p in model.parameters()]
torch.nn.utils.clip_grad_norm_(list(model.parameters()), c.clip)
opt.step()
params, _ = distributed.full_state(model, opt)
if rank == 0:
    torch.save({"grads": grads, "params": list(params.values())}, out)
"""


def test_two_processes_take_the_single_process_step(train_ckpt, sampled, tmp_path):
    """One step of 2 processes, each replaying its half of the rollouts with averaged gradients
    (whole copies, or FSDP shards), equals one step of 1 process on all of them (1e-6); summed
    gradients (the control) do not. (Adam's first step is nearly blind to a gradient's scale, so
    the control shows on the gradients.)"""
    c = train.resolve(train.parse_args(["--model", train_ckpt, "--out", str(tmp_path / "run"), "--lr", "1e-3"]))
    adv = torch.tensor([0.5, -0.5, 1.0, -1.0])  # two groups of two, one for each process
    ro = sampled.select(torch.arange(4))
    torch.save((ro, adv, EV, c), tmp_path / "rollouts.pt")
    (tmp_path / "step.py").write_text(DDP_STEP)
    model = from_pretrained(train_ckpt)
    opt = train.make_optimizer(model, c)
    train.backward(model, ro, adv, c)
    grads = [p.grad.clone() for p in model.parameters()]
    torch.nn.utils.clip_grad_norm_(list(model.parameters()), c.clip)
    opt.step()
    for reduce in ("mean", "fsdp", "sum"):
        torchrun(tmp_path, str(tmp_path / "step.py"), train_ckpt, str(tmp_path / "rollouts.pt"),
                 str(tmp_path / f"{reduce}.pt"), reduce)
        two = torch.load(tmp_path / f"{reduce}.pt")
        grad_err = max((a - b).abs().max().item() for a, b in zip(two["grads"], grads))
        param_err = max((a - b).abs().max().item() for a, b in zip(two["params"], model.parameters()))
        print(f"{reduce}: max |grad - single| {grad_err:.2e}, max |param - single| {param_err:.2e}")
        if reduce in ("mean", "fsdp"):
            assert grad_err < 1e-6 and param_err < 1e-6
        else:
            assert grad_err > 1e-3


def test_eval_over_two_processes_gives_the_rows_of_one(train_ckpt, tmp_path):
    flags = ["--model", train_ckpt, "--policy", "none", "ngc", "knorm", "--eviction-rate", "0.5", "--problems", "4",
             "--batch-size", "3"]
    evaluation.main(flags + ["--out", str(tmp_path / "one.jsonl")])
    torchrun(tmp_path, "eval.py", *flags, "--out", str(tmp_path / "two.jsonl"))
    one, two = ((tmp_path / f"{n}.jsonl").read_text().splitlines() for n in ("one", "two"))
    assert len(one) == 3 and one == two


def test_two_process_run_interrupted_and_resumed_logs_what_an_uninterrupted_one_does(train_ckpt, tmp_path):
    """SIGTERM to torchrun mid-run: rank 0 saves; --resume on 2 processes then writes the log an
    uninterrupted 2-process run writes (timings aside)."""
    (tmp_path / "run.py").write_text(SIGNAL_RUN)
    here = os.path.dirname(train.__file__)
    flags = ["--model", train_ckpt, "--threads", "1", "--eval-every", "3", "--eval-problems", "2"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(tmp_path / "run.py")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": here}
    proc = subprocess.Popen(cmd + flags + ["--out", str(tmp_path / "cut"), "--steps", "200"], cwd=here, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for_log_lines(tmp_path / "cut" / "log.jsonl", 3, timeout=120)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    saved = rundir.load_trainer_state(str(tmp_path / "cut"))["step"]
    assert 2 <= saved < 200 and "continue with --resume" in out, out
    torchrun(tmp_path, str(tmp_path / "run.py"), "--resume", str(tmp_path / "cut"), "--steps", str(saved + 1))
    torchrun(tmp_path, str(tmp_path / "run.py"), *flags, "--out", str(tmp_path / "straight"), "--steps", str(saved + 1))
    straight, resumed = (rundir.read_log(str(tmp_path / n / "log.jsonl")) for n in ("straight", "cut"))
    strip = lambda log: [{k: v for k, v in r.items() if k not in ("step_time", "tokens_per_s")} for r in log]
    assert [r["step"] for r in straight if "eval" not in r] == list(range(saved + 1))
    assert strip(resumed) == strip(straight)
    assert any(r.get("grad_norm") for r in straight)  # it learned, so the comparison means something


# ---------------------------------------------------------------------------------------
# 11. Countdown (§5.2, countdown.py): solver, generator, prompt and reward


def test_solve_finds_valid_expressions_and_none_when_unsolvable():
    expr = cd.find_solution((3, 5, 2), 16)
    assert expr is not None
    assert cd.evaluate_expression(expr) == 16
    assert sorted(cd.numbers_in(expr)) == [2, 3, 5]
    assert cd.reward(f"<answer>{expr}</answer>", Problem((3, 5, 2), 16)) == 1.0
    # negative controls: unreachable targets
    assert cd.find_solution((1, 1, 1), 100) is None
    assert cd.find_solution((2, 2, 2, 2), 1000) is None
    # every number must be used: 13 is among the numbers, but 17 and 19 can't be absorbed
    assert cd.find_solution((13, 17, 19), 13) is None
    assert cd.find_solution((50, 50, 50), 50) is not None        # 50 + 50 - 50
    assert cd.evaluate_expression(cd.find_solution((7, 1, 1), 7)) == 7


# ---------------------------------------------------------------------------------------
# generator and splits

def test_generate_is_seeded_and_reproducible():
    a, b = cd.generate(2000, seed=7), cd.generate(2000, seed=7)
    assert a == b
    assert cd.generate(2000, seed=8) != a
    assert cd.generate(2000, seed=7, difficulty=SMALL) == cd.generate(2000, seed=7, difficulty=SMALL)


@pytest.mark.parametrize("difficulty", [PAPER, SMALL])
def test_generated_problems_are_in_range_and_solvable(difficulty):
    probs = cd.generate(3000, seed=3, difficulty=difficulty)
    assert len(probs) == 3000
    assert {len(p.nums) for p in probs} == set(difficulty.n_nums)
    lo, hi = difficulty.num_range
    tlo, thi = difficulty.target_range
    for p in probs:
        assert isinstance(p.nums, tuple)
        assert all(lo <= n <= hi for n in p.nums)
        assert tlo <= p.target <= thi
        expr = cd.find_solution(p.nums, p.target)
        assert expr is not None, p
        assert cd.reward(f"<answer> {expr} </answer>", p) == 1.0
        assert cd.reward(f"<answer> {expr} </answer>", Problem(p.nums, p.target + 1)) == 0.0


def test_paper_preset_and_default_sizes():
    assert PAPER.n_nums == (3, 4)
    assert SMALL == cd.Difficulty(n_nums=(3,), num_range=(1, 15), target_range=(10, 100))
    defaults = {k: v.default for k, v in inspect.signature(cd.splits).parameters.items()}
    assert defaults["n_train"] == 327_680
    assert defaults["n_test"] == 1_024
    assert defaults["difficulty"] == PAPER


def test_splits_are_disjoint_distinct_and_reproducible():
    train, test = cd.splits(seed=0, n_train=20_000)
    assert len(train) == 20_000 and len(test) == 1_024
    key = lambda p: (tuple(sorted(p.nums)), p.target)
    train_keys, test_keys = {key(p) for p in train}, {key(p) for p in test}
    assert len(test_keys) == len(test) and len(train_keys) == len(train)
    assert not train_keys & test_keys
    assert cd.splits(seed=0, n_train=20_000) == (train, test)
    assert cd.splits(seed=1, n_train=20_000)[1] != test


def test_tiny_splits_disjoint_even_with_repeats():
    train, test = cd.splits(seed=0, n_train=20_000, n_test=512, difficulty=SMALL, unique=False)
    key = lambda p: (tuple(sorted(p.nums)), p.target)
    assert len(train) == 20_000
    assert len({key(p) for p in test}) == 512
    assert not {key(p) for p in train} & {key(p) for p in test}
    # SMALL has only a few thousand distinct problems: asking for more distinct ones fails loudly
    with pytest.raises(RuntimeError):
        cd.splits(seed=0, n_train=20_000, n_test=16, difficulty=SMALL, unique=True)

# ---------------------------------------------------------------------------------------
# prompt

def test_prompt_text_and_eviction_rate_tag():
    p = Problem((3, 5, 2), 16)
    text = cd.prompt_text(p)
    assert "[3, 5, 2]" in text and "equals 16" in text and "<answer>" in text
    assert "eviction_rate" not in text
    assert cd.prompt_text(p, 0.5) == text + "\n<eviction_rate>50%</eviction_rate>"
    assert cd.prompt_text(p, 0.25).endswith("<eviction_rate>25%</eviction_rate>")
    assert cd.prompt_text(p, 0.125).endswith("<eviction_rate>12.5%</eviction_rate>")
    assert cd.prompt_text(p, 0.0).endswith("<eviction_rate>0%</eviction_rate>")
    assert cd.prompt_text(p, 0.7).endswith("<eviction_rate>70%</eviction_rate>")  # 70.00000000000001
    assert cd.prompt_text(p, 0.7, blind=True) == text + "\n<eviction_rate>-%</eviction_rate>"  # the control


def _tiny_tokenizer(chat):
    words = "Using the numbers [3, 5, 2] equals 16 . <think> \n".split(" ")
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(dict.fromkeys(words))}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if chat:
        tok.add_special_tokens(list(cd.R1_CHAT))
        tok.add_tokens(["<think>"])
        bos = cd.R1_CHAT[0]
        # like the real R1 tokenizer, the post-processor would prepend BOS on its own
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))])
    return tok


def test_encode_prompt_uses_r1_chat_template_only_when_present():
    text = "Using the numbers 16"
    chat = _tiny_tokenizer(chat=True)
    ids = cd.encode_prompt(chat, text)
    bos, user, assistant = (chat.token_to_id(t) for t in cd.R1_CHAT)
    think = chat.token_to_id("<think>")
    assert ids[:2] == [bos, user]
    assert ids.count(bos) == 1  # not duplicated by the post-processor
    assert ids[-2:] == [assistant, think]
    assert ids[2:-2] == chat.encode(text, add_special_tokens=False).ids
    # sanity: the post-processor really would have added a BOS
    assert chat.encode(f"{cd.R1_CHAT[0]}x").ids[:2] == [bos, bos]

    plain = _tiny_tokenizer(chat=False)
    assert plain.token_to_id(cd.R1_CHAT[1]) is None
    assert cd.encode_prompt(plain, text) == plain.encode(text, add_special_tokens=False).ids
    assert len(cd.encode_prompt(plain, text)) == 4

# ---------------------------------------------------------------------------------------
# reward

P = Problem((3, 5, 2), 16)


def _boom(*args, **kwargs):
    raise AssertionError("eval/exec/compile must never be called")


@pytest.fixture
def no_eval(monkeypatch):
    """eval and exec raise for the whole test; compile raises while countdown or mathtask code
    runs (not throughout: pytest itself needs compile to report a failure)."""
    monkeypatch.setattr(builtins, "eval", _boom)
    monkeypatch.setattr(builtins, "exec", _boom)

    def trapped(fn):
        def wrapper(*args, **kwargs):
            prev, builtins.compile = builtins.compile, _boom
            try:
                return fn(*args, **kwargs)
            finally:
                builtins.compile = prev
        return wrapper

    for module, names in ((cd, ("reward", "evaluate_expression", "extract_answer", "numbers_in", "find_solution")),
                          (mt, ("reward", "last_boxed", "normalize", "equivalent"))):
        for name in names:
            monkeypatch.setattr(module, name, trapped(getattr(module, name)))


@pytest.mark.parametrize("completion", [
    "<answer> (3 + 5) * 2 </answer>",
    "<answer>(3+5)*2</answer>",
    "<answer>2*(5+3)</answer>",
    "<answer> (5 + 3) × 2 </answer>",
    "<answer> (3 + 5) * 2 = 16 </answer>",
    "<answer>\n(3 + 5) * 2\n</answer>",
    "<think>try 3*5+2 = 17, no</think> so <answer> (3 + 5) * 2 </answer>",
    "<answer> 3 + 5 </answer> wait, that's wrong. <answer> (3 + 5) * 2 </answer>",
    "<answer>(5+3)*2</answer>\n</answer>",  # a stray closing tag after the last complete pair
])
def test_reward_correct(completion, no_eval):
    assert cd.reward(completion, P) == 1.0


@pytest.mark.parametrize("completion", [
    "<answer> (3 + 5) + 2 </answer>",        # wrong value
    "<answer> 3 * 5 + 2 </answer>",          # wrong value (17)
    "<answer> (3 + 5) * 2 = 17 </answer>",   # wrong claimed value
    "<answer> (3 + 5) * 2 = 16 = 16 </answer>",
    "<answer> 16 </answer>",                 # numbers missing
    "<answer> 8 * 2 </answer>",              # 3 and 5 missing
    "<answer> (3 + 5) * 2 * 1 </answer>",    # extra number
    "<answer> (3 + 5) * 2 + 0 </answer>",    # extra number
    "<answer> (3 + 3 + 2) * 2 </answer>",    # 3 used twice, 5 missing (value 16)
    "<answer> (5 + 3) * 2 * (2 / 2) </answer>",  # 2 used three times (value 16)
    "<answer> 35 - 2 + 3 - 20 </answer>",    # digits glued / extra numbers
    "<answer> (3 + 5) * 2.0 </answer>",      # no decimals
    "<answer></answer>",
    "<answer> </answer>",
])
def test_reward_wrong(completion, no_eval):
    assert cd.reward(completion, P) == 0.0


@pytest.mark.parametrize("completion", [
    "(3 + 5) * 2",                                    # no tags at all
    "<answer> (3 + 5) * 2",                           # unclosed
    "(3 + 5) * 2 </answer>",                          # unopened
    "</answer> (3 + 5) * 2 <answer>",                 # reversed
    "<answer (3 + 5) * 2 </answer>",                  # broken open tag
    "<Answer> (3 + 5) * 2 </Answer>",                 # tags are case-sensitive
    "<answer><answer> (3 + 5) * 2 </answer></answer>",
    "<answer> (3 + 5) * 2 </answer> <answer> 3 + 5 + 2 </answer>",  # last one is wrong
    "<answer> 3 + 5 + 2 </answer> actually it is (3 + 5) * 2",      # right one outside tags
    "<answer> 3 + 5 + 2 </answer> <answer> (3 + 5) * 2",            # last tag unclosed
])
def test_reward_malformed_tags_and_answer_outside_last_tag(completion, no_eval):
    assert cd.reward(completion, P) == 0.0


def test_reward_rejects_unary_minus_and_powers_even_when_the_value_is_right(no_eval):
    p = Problem((3, 5, 2), 13)
    assert cd.reward("<answer> 3 * 5 - 2 </answer>", p) == 1.0   # positive control
    assert cd.reward("<answer> -2 + 3 * 5 </answer>", p) == 0.0
    assert cd.reward("<answer> 5 * 3 + (-2) </answer>", p) == 0.0
    q = Problem((2, 4, 1), 16)
    assert cd.reward("<answer> 2 * 4 * 1 </answer>", Problem((2, 4, 1), 8)) == 1.0
    assert cd.reward("<answer> 2 ** 4 * 1 </answer>", q) == 0.0
    assert cd.reward("<answer> 2 ^ 4 * 1 </answer>", q) == 0.0


def test_reward_rejects_injected_code_and_runs_nothing(tmp_path, monkeypatch, no_eval):
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "pwned"
    attacks = [
        "__import__('os').system('touch pwned')",
        "(3 + 5) * 2 if __import__('os').system('touch pwned') == 0 else 0",
        "open('pwned', 'w').write('x') and (3 + 5) * 2",
        "(lambda: __import__('os').system('touch pwned'))() or (3 + 5) * 2",
        "[c for c in ().__class__.__base__.__subclasses__()]",
        "(3 + 5) * 2; import os; os.system('touch pwned')",
        "exec('open(\"pwned\",\"w\")')",
        "eval('(3 + 5) * 2')",
    ]
    for attack in attacks:
        for completion in (f"<answer>{attack}</answer>", f"<answer> {attack} = 16 </answer>"):
            assert cd.reward(completion, P) == 0.0
        assert cd.evaluate_expression(attack) is None
    assert not marker.exists()
    assert list(tmp_path.iterdir()) == []
    # the traps are live: eval and exec are replaced, and an evaluator built on compile is caught
    assert builtins.eval is _boom and builtins.exec is _boom
    monkeypatch.setattr(cd, "_tokenize", lambda text: compile(text, "<answer>", "eval"))
    with pytest.raises(AssertionError):
        cd.evaluate_expression("1")


def test_reward_resists_huge_numbers_deep_nesting_and_division_by_zero(no_eval):
    t = time.perf_counter()
    assert cd.evaluate_expression("9**9**9") is None
    assert cd.reward("<answer> 9**9**9 </answer>", Problem((9, 9, 9), 729)) == 0.0
    assert cd.reward("<answer> 9 ** 9 ** 9 </answer>", Problem((9, 9, 9), 729)) == 0.0
    assert cd.evaluate_expression("1" * 7) is None                      # literal too long
    assert cd.reward("<answer>" + "9" * 100_000 + "</answer>", P) == 0.0  # int() digit limit
    big = "*".join(["999999"] * 28)                                     # 195 chars: allowed
    assert cd.evaluate_expression(big) == 999999 ** 28
    assert cd.evaluate_expression("1+" * 150 + "1") is None               # over 200 chars
    assert cd.evaluate_expression("(" * 30 + "16" + ")" * 30) == 16
    assert cd.evaluate_expression("(" * 40 + "16" + ")" * 40) is None     # too deep
    assert cd.reward("<answer>" + "(" * 5000 + "16" + ")" * 5000 + "</answer>", P) == 0.0
    assert cd.evaluate_expression("1 / 0") is None
    assert cd.evaluate_expression("5 / (3 - 3)") is None
    assert cd.reward("<answer> 5 / (3 - 3) </answer>", Problem((5, 3, 3), 0)) == 0.0
    assert cd.reward("<answer> (5 - 5) / 3 </answer>", Problem((5, 5, 3), 0)) == 1.0  # 0 / 3 is fine
    assert time.perf_counter() - t < 1.0


def test_evaluate_expression_grammar():
    ev = cd.evaluate_expression
    assert ev("3 + 5 * 2") == 13 and ev("(3 + 5) * 2") == 16
    assert ev("8 - 3 - 2") == 3 and ev("24 / 4 / 2") == 3      # left-associative
    assert ev("7 / 2") == Fraction(7, 2)
    assert ev("(8 / 3) * 3") == 8                               # exact, no float error
    assert ev("6 ÷ 3 × 4") == 8
    for bad in ["", "()", "3 +", "+ 3", "(3", "3)", "3 5", "3 (5)", "abc", "3 % 2", "0x10", "1e3", "½"]:
        assert ev(bad) is None, bad
    assert cd.numbers_in("(12 + 3) * 45") == [12, 3, 45]
    assert cd.extract_answer("a <answer> x </answer> b <answer> y </answer> c") == "y"
    assert cd.extract_answer("<answer> x </answer> </answer> <answer> y") == "x"  # the last complete pair
    assert cd.extract_answer("no tags") is None


def _random_tree(rng, nums):
    """A random fully parenthesised expression over nums and its exact value (None on /0)."""
    items = [(str(n), Fraction(n)) for n in nums]
    while len(items) > 1:
        (ea, a), (eb, b) = items.pop(rng.randrange(len(items))), items.pop(rng.randrange(len(items)))
        op = rng.choice("+-*/")
        if a is None or b is None or (op == "/" and b == 0):
            v = None
        else:
            v = {"+": a + b, "-": a - b, "*": a * b, "/": a / b if b else None}[op]
        sym = {"*": rng.choice(["*", "×"]), "/": rng.choice(["/", "÷"])}.get(op, op)
        items.append((f"({ea}{' ' * rng.randint(0, 2)}{sym} {eb})", v))
    return items[0]


def test_reward_10k_random_strings(no_eval, tmp_path, monkeypatch):
    """Random expressions with a known verdict, then pure noise: right verdicts, no exceptions."""
    monkeypatch.chdir(tmp_path)
    rng = random.Random(0)
    n_right = 0
    for _ in range(5_000):
        nums = [rng.randint(0, 20) for _ in range(rng.choice([3, 4]))]
        used = list(nums)
        mutation = rng.random()
        if mutation < 0.15:
            used[0] = used[1]                  # a number used twice, one missing
        elif mutation < 0.3:
            used.append(rng.randint(0, 20))    # an extra number
        elif mutation < 0.4:
            used.pop()                         # a missing number
        expr, value = _random_tree(rng, used)
        if value is not None and value.denominator == 1 and value >= 0 and rng.random() < 0.8:
            target = int(value)
        else:
            target = rng.randint(0, 100)
        expected = float(value == target and sorted(used) == sorted(nums))
        got = cd.reward(f"think... <answer> {expr} </answer>", Problem(tuple(nums), target))
        assert got == expected, (expr, nums, target)
        n_right += got == 1.0
    assert n_right > 1_000  # the oracle is not trivially all zeros

    alphabet = list("0123456789+-*/()=  ×÷.^%abcxyz_'\"\\\n\t[]{}<>!&|~") + [
        "<answer>", "</answer>", "**", "__import__('os')", "16", "3", "5", "2", "é", "\x00"]
    n_tagged = 0
    for _ in range(5_000):
        s = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))
        n_tagged += cd.extract_answer(s) is not None
        got = cd.reward(s, P)
        assert got in (0.0, 1.0)
        if got == 1.0:  # only possible if the last answer is genuinely right
            ans = cd.extract_answer(s).split("=")[0]
            assert cd.evaluate_expression(ans) == 16 and sorted(cd.numbers_in(ans)) == [2, 3, 5]
    assert n_tagged > 500  # a fair share of the noise reaches the parser
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------
# 12. Baselines (§5.1, baselines.py) and eval.py


def hand_built_cache(S=12, D=4, H=4, Hkv=2, w=3, seed=0, holes=(2, 7)):
    """A hand-built layer cache for one row: keys at positions 0..S-1, some slots dead."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(1, Hkv, S, D, generator=g)
    q = torch.randn(1, H, w, D, generator=g)
    kpos = torch.arange(S)[None]
    alive = torch.ones(1, S, dtype=torch.bool)
    alive[0, list(holes)] = False
    qpos = torch.arange(S - w, S)[None]
    return q, keys, kpos, alive, qpos


def one_round(c, block, rate, policy):
    """The engine's eviction round on the hand-built cache c under a --policy name: σ and log p(σ)."""
    q, keys, kpos, alive, qpos = c
    layer = LayerCache(1, keys.shape[1], keys.shape[3], keys.shape[2], torch.float32, "cpu")
    layer.append(keys, keys, kpos, alive)
    window = ngc.QueryWindow(1, 1, q.shape[2], q.shape[1], q.shape[3], torch.float32, "cpu")
    window.q[0], window.pos, window.valid = q, qpos, torch.ones(qpos.shape, dtype=torch.bool)
    record = ngc.Recorder(1, 1, "cpu")
    e = Eviction(delta=64, block=block, window=q.shape[2], rate=rate, **evaluation.CLI_POLICIES[policy])
    ngc.eviction_round(SimpleNamespace(layers=[layer]), window, torch.tensor([True]), e, torch.tensor([rate]), None,
                       record)
    kept, _, logps, _ = record.tensors()
    survivors = kept_keys(alive, kept[:, 0, 0], block)  # the rest are gone, the survivors moved to the front
    assert torch.equal(layer.pos[layer.alive], kpos[survivors]) and int(layer.fill) == survivors.sum()
    return kept[0, 0, 0][kept[0, 0, 0] >= 0].tolist(), logps[0, 0, 0].item()


def keep(policy, c, block, rate):
    return one_round(c, block, rate, policy)[0]


def psi_by_hand(c):
    """ψ (S,): softmax per query head and query over the alive keys it may see, averaged (paper §4.2)."""
    q, keys, kpos, alive, qpos = c
    H, w, D = q.shape[1:]
    psi = torch.zeros(alive.shape[1])
    for h, i in itertools.product(range(H), range(w)):
        seen = [t for t in range(alive.shape[1]) if alive[0, t] and t <= qpos[0, i]]
        logits = torch.stack([q[0, h, i] @ keys[0, h // (H // keys.shape[1]), t] / math.sqrt(D) for t in seen])
        psi[seen] += logits.softmax(0) / (H * w)
    return psi


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


# ---------------------------------------------------------------------------------------
# Each baseline's scores equal its formula


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


# ---------------------------------------------------------------------------------------
# Every policy keeps K blocks per layer and replay still reproduces the rollout

EVAL_POLICIES = [name for name in evaluation.CLI_POLICIES if name != "none"]


@pytest.fixture(scope="module")
def rollouts(model):
    runs = {}
    for policy in EVAL_POLICIES:
        e = Eviction(delta=12, block=3, window=4, rate=0.6, **evaluation.CLI_POLICIES[policy])
        runs[policy] = e, rollout(model, prompts_of([5, 17, 9]), Sampling(max_new_tokens=40, temperature=1.0, top_k=0),
                                  e, eos_ids=[EOS], generator=torch.Generator().manual_seed(6))
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
    names = [p for p in first if p != "ngc-sample"]
    for a, b in itertools.combinations(names, 2):
        assert not torch.equal(first[a], first[b]), (a, b)


# ---------------------------------------------------------------------------------------
# Peak-KV reduction (§5.1) and pass@k


def test_peak_kv_reduction_of_a_constructed_case(model):
    """3 layers, δ=8, b=2, ε=0.5, no EOS. Prompt 5 + 20 new tokens: 24 tokens fed (the last one
    sampled is never fed). Without eviction the peak is 3·24 = 72. With it, each layer holds 8,
    keeps 4; 4+8 = 12, keeps 6; 6+8 = 14, keeps 8: peak 3·14 = 42. With 12 new tokens: 16 fed,
    peak 3·16 = 48 against 3·12 = 36."""
    e = Eviction(delta=8, block=2, window=3, rate=0.5, greedy=True)
    peaks = []
    for m in (20, 12):
        s = Sampling(max_new_tokens=m, greedy=True)
        full, evicted = (rollout(model, prompts_of([5]), s, x) for x in (None, e))
        peaks.append((int(full.peak_kv), int(evicted.peak_kv)))
    assert peaks == [(72, 42), (48, 36)]
    ref, pol = torch.tensor([[72.0], [48.0]], dtype=torch.float64), torch.tensor([[42.0], [36.0]], dtype=torch.float64)
    assert abs(evaluation.kv_reduction(ref, pol) - (72 / 42 + 48 / 36) / 2) < 1e-12  # = 32/21
    # Negative control: the ratio of mean peaks (a different estimator) differs.
    assert abs(evaluation.kv_reduction(ref, pol) - 120 / 78) > 1e-3
    # With samples, a problem's peak is the mean over its samples.
    assert abs(evaluation.kv_reduction(torch.tensor([[10.0, 30.0]]), torch.tensor([[5.0, 10.0]])) - 20 / 7.5) < 1e-6


def test_pass_at_k_matches_its_closed_form():
    for n, k in [(1, 1), (5, 1), (5, 2), (8, 4), (10, 10)]:
        for c in range(n + 1):
            # closed form: the chance that k of n draws without replacement include a correct one
            subsets = list(itertools.combinations(range(n), k))
            brute = sum(any(i < c for i in s) for s in subsets) / len(subsets)
            stable = 1.0 if n - c < k else 1 - math.prod(1 - k / i for i in range(n - c + 1, n + 1))
            got = evaluation.pass_at_k(n, [c], k)
            assert abs(got - brute) < 1e-12 and abs(got - stable) < 1e-12
    assert evaluation.pass_at_k(4, [0, 4, 2], 1) == pytest.approx((0 + 1 + 0.5) / 3)
    # Negative control: the biased plug-in estimate 1 - (1 - c/n)^k is not the same.
    assert abs(evaluation.pass_at_k(8, [2], 4) - (1 - (1 - 2 / 8) ** 4)) > 1e-2


# ---------------------------------------------------------------------------------------
# The CLI


def test_cli_two_policies_two_rates_share_one_reference(train_ckpt, tmp_path, monkeypatch, capsys):
    calls = []

    def counting(model, prompts, sampling, eviction=None, **kw):
        calls.append((len(prompts), None if eviction is None else (eviction.score, eviction.greedy, eviction.rate)))
        return rollout(model, prompts, sampling, eviction, **kw)

    monkeypatch.setattr(evaluation, "rollout", counting)
    out = tmp_path / "results.jsonl"
    evaluation.main(["--model", train_ckpt, "--task", "countdown", "--policy", "ngc", "knorm", "--eviction-rate", "0.5",
             "0.75", "--problems", "3", "--out", str(out)])
    printed = capsys.readouterr().out
    print(printed)
    assert [c for c in calls if c[1] is None] == [(3, None)]  # one reference run, shared
    assert [c[1] for c in calls if c[1]] == [(None, True, 0.5), (None, True, 0.75), (baselines.knorm, True, 0.5),
                                             (baselines.knorm, True, 0.75)]  # ngc: greedy top-K on ψ
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["policy"], r["eviction_rate"]) for r in rows] == [("ngc", 0.5), ("ngc", 0.75), ("knorm", 0.5),
                                                                 ("knorm", 0.75)]
    for r in rows:
        assert r["problems"] == 3 and r["samples"] == 1 and 0 <= r["accuracy"] <= 1 and r["rounds"] > 0
        assert r["kv_reduction"] > 1 and "pass_at_k" not in r
    assert rows[1]["kv_reduction"] > rows[0]["kv_reduction"]  # evicting more shrinks the peak more
    assert not os.path.exists(str(out) + ".tmp")
    assert len(printed.strip().splitlines()) == 6 and "KV reduction" in printed

    calls.clear()  # sampled: k completions per problem, pass@k, `none` is the reference itself
    monkeypatch.setitem(tasks.TASK_REWARD, "countdown", lambda text, problem: float(len(text) % 2))  # some variance
    evaluation.main(["--model", train_ckpt, "--policy", "none", "ngc-sample", "--eviction-rate", "0.5", "--samples", "3",
             "--problems", "2", "--out", str(out)])
    assert [c[0] for c in calls] == [6, 6] and calls[1][1] == (None, False, 0.5)  # ngc-sample: Gumbel-top-k
    none, sampled = [json.loads(line) for line in out.read_text().splitlines()]
    assert none["kv_reduction"] == 1.0 and none["eviction_rate"] == 0.0 and none["rounds"] == 0
    assert sampled["samples"] == 3 and set(sampled["pass_at_k"]) == {"1", "2", "3"}
    p = sampled["pass_at_k"]
    assert p["1"] == pytest.approx(sampled["accuracy"]) and p["1"] <= p["2"] <= p["3"] and p["3"] in (0, 0.5, 1)


@pytest.mark.parametrize("flags, message", [
    (["--policy", "lru"], "unknown policy 'lru'"), (["--eviction-rate", "1.5"], "must lie in (0, 1]"),
    (["--samples", "0"], "--samples 0 must be at least 1"), (["--problems", "99"], "test split has 4"),
    (["--eviction-rate", "x"], "invalid float"), (["--out", "/no/such/dir/r.jsonl"], "does not exist"),
    (["--out", "/tmp"], "/tmp is a directory")])
def test_cli_bad_input_fails_with_one_line(train_ckpt, flags, message, monkeypatch):
    monkeypatch.setattr(evaluation, "rollout", None)  # nothing may run
    with pytest.raises(SystemExit) as err:
        evaluation.main(["--model", train_ckpt, *flags])
    assert str(err.value).startswith("error: ") and message in str(err.value) and "\n" not in str(err.value)


def test_cli_plot_without_matplotlib_fails_early(train_ckpt, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if matplotlib were not installed
    monkeypatch.setattr(evaluation, "from_pretrained", None)  # fails before loading anything
    with pytest.raises(SystemExit) as err:
        evaluation.main(["--model", train_ckpt, "--plot", str(tmp_path / "acc.png")])
    assert str(err.value) == "error: --plot needs matplotlib: pip install matplotlib"


# ---------------------------------------------------------------------------------------
# show.py: which keys each layer evicted, and at which round


def test_show_death_rounds_are_the_replay_masks(model, ckpt, sampled):
    """A key is alive at the end at layer l iff the replay mask lets the last token see it; an
    evicted key's round r is the one whose last query (token (r+1)δ-1) still sees it and whose next
    token does not."""
    tokenizer, delta = load_tokenizer(ckpt), EV.delta
    death = death_times(sampled.kept, sampled.n_rounds, sampled.tokens.shape[1], delta, EV.block)  # (B, L, T)
    for b in range(len(sampled.lengths)):
        T, R = int(sampled.lengths[b]), int(sampled.n_rounds[b])
        texts, rounds = show.fates(sampled, b, tokenizer)  # (L, T)
        assert texts == [tokenizer.decode([t], skip_special_tokens=False) for t in sampled.tokens[b, :T].tolist()]
        assert rounds.shape == (model.config.num_hidden_layers, T) and R >= 2
        for layer in range(rounds.shape[0]):
            vis = visibility(death[:, layer])[b, :T, :T]  # (T, T): row t, the keys token t saw
            r = rounds[layer]
            assert torch.equal(r == show.ALIVE, vis[T - 1])
            s = (r != show.ALIVE).nonzero().flatten()
            last = (r[s] + 1) * delta - 1  # the last token before round r
            assert (r[s] < R).all() and (last + 1 <= T - 1).all()
            assert vis[last, s].all() and not vis[last + 1, s].any()
            # at ε = 0.5 every round that fired evicted something at every layer
            assert set(r[s].tolist()) == set(range(R)), (b, layer)
    # Negative control: without eviction every key stays.
    full = rollout(model, prompts_of([5, 9]), Sampling(max_new_tokens=30, greedy=True))
    for b in range(2):
        _, rounds = show.fates(full, b, tokenizer)
        assert rounds.shape[1] == int(full.lengths[b]) and (rounds == show.ALIVE).all()


class PageParser(HTMLParser):
    """The page's text, and each table as its header texts and its rows (label, [cell classes])."""

    def __init__(self):
        super().__init__()
        self.text, self.tables, self.cell = [], [], None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "table":
            self.tables.append({"head": [], "rows": []})
        elif tag == "tr" and self.tables:
            self.tables[-1]["rows"].append([None, []])
        elif tag == "th" and self.tables:
            self.cell = ""
        elif tag == "td":
            self.tables[-1]["rows"][-1][1].append(attrs["class"].split()[0])

    def handle_endtag(self, tag):
        if tag == "th" and self.cell is not None:
            table = self.tables[-1]
            if len(table["rows"]) == 1:  # the header row
                table["head"].append(self.cell)
            else:
                table["rows"][-1][0] = self.cell
            self.cell = None

    def handle_data(self, data):
        self.text.append(data)
        if self.cell is not None:
            self.cell += data


def fate_class(r):
    return "alive" if r == show.ALIVE else f"r{r}"


def test_show_page_lists_every_token_of_every_rollout_and_every_layer(ckpt, train_ckpt, tmp_path, monkeypatch,
                                                                      capsys):
    made = []

    def recording(model, prompts, sampling, eviction=None, **kw):
        made.append((prompts, sampling, eviction, rollout(model, prompts, sampling, eviction, **kw)))
        return made[-1][-1]

    monkeypatch.setattr(show, "rollout", recording)
    out = tmp_path / "forgets.html"
    show.main(["--model", train_ckpt, "--before", ckpt, "--problems", "2", "--out", str(out)])
    printed = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in printed[:4]] == ["problem 1 untrained", "problem 1   trained",
                                                            "problem 2 untrained", "problem 2   trained"]
    assert not os.path.exists(str(out) + ".tmp")
    page = out.read_text(encoding="utf-8")
    for outside in ("<script", "<link", "src=", "href=", "url(", "http", "@import"):
        assert outside not in page  # self-contained
    parsed = PageParser()
    parsed.feed(page)
    text = "".join(parsed.text)
    assert "ε = 0.5, δ = 8, b = 2, w = 3" in text and train_ckpt in text and ckpt in text
    tokenizer = load_tokenizer(ckpt)
    _, test = tasks.load_problems(SimpleNamespace(**{**tasks.run_defaults(train_ckpt), "train_problems": 0,
                                                     "data": None}))
    assert [p[0] for p in made] == [[cd.encode(tokenizer, q) for q in test[:2]]] * 2  # eval.py's prompts
    assert all(s.greedy and s.max_new_tokens == 24 and e.greedy and e.score is None and e.rate == 0.5
               for _, s, e, _ in made)  # NGC's greedy top-K on greedy tokens
    rollouts = [made[0][-1], made[1][-1]]  # untrained, trained
    assert len(parsed.tables) == 4  # problem-major, the untrained model first
    n_rounds = 0
    for i, table in enumerate(parsed.tables):
        ro, b = rollouts[i % 2], i // 2
        T = int(ro.lengths[b])
        texts, rounds = show.fates(ro, b, tokenizer)
        assert str(test[b]) in text and f"problem {b + 1}" in text
        assert table["head"] == [""] + texts  # every token, in reading order
        layers = range(TINY_MODEL["num_hidden_layers"])
        assert [label for label, _ in table["rows"][1:]] == [f"layer {l}" for l in layers]
        for (_, cells), fate in zip(table["rows"][1:], rounds.tolist()):
            assert len(cells) == T and cells == [fate_class(r) for r in fate]
        n_rounds = max(n_rounds, int(ro.n_rounds[b]))
        assert int(rounds.max()) == int(ro.n_rounds[b]) - 1 >= 1  # evictions at every round, 2 at least
    assert all(f"round {k + 1}" in text for k in range(n_rounds)) and ("correct" in text or "wrong" in text)
    # Negative control: the two models' grids of one problem differ, so a table checked against the
    # other model's rollout would fail.
    assert parsed.tables[0]["head"] != parsed.tables[1]["head"] or parsed.tables[0]["rows"] != parsed.tables[1]["rows"]


def test_show_prompts_are_evals_with_the_interoception_tag(train_ckpt, tmp_path, monkeypatch):
    run = tmp_path / "run"
    shutil.copytree(train_ckpt, run)
    (run / "ngc.json").write_text(json.dumps({**TRAIN_DEFAULTS, "interoception": True}))
    seen = {}

    def recording(name):
        def record(model, prompts, sampling, eviction=None, **kw):
            seen.setdefault(name, []).append(prompts)
            return rollout(model, prompts, sampling, eviction, **kw)
        return record

    monkeypatch.setattr(show, "rollout", recording("show"))
    monkeypatch.setattr(evaluation, "rollout", recording("eval"))
    show.main(["--model", str(run), "--before", str(run), "--problems", "2", "--eviction-rate", "0.25",
               "--out", str(tmp_path / "f.html")])
    evaluation.main(["--model", str(run), "--policy", "ngc", "--eviction-rate", "0.25", "--problems", "2"])
    assert seen["show"] == [seen["eval"][1]] * 2  # eval's ngc run (its first is the full-cache reference)
    plain = seen["eval"][0]  # no eviction: no tag
    assert all(len(a) > len(b) for a, b in zip(seen["show"][0], plain))  # Negative control


def test_show_png(ckpt, train_ckpt, tmp_path):
    pytest.importorskip("matplotlib")
    out, png = tmp_path / "f.html", tmp_path / "f.png"
    show.main(["--model", train_ckpt, "--before", ckpt, "--problems", "1", "--out", str(out), "--png", str(png)])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert not os.path.exists(str(png) + ".tmp")


@pytest.mark.parametrize("flags, message", [
    (["--eviction-rate", "1.5"], "must lie in (0, 1]"), (["--problems", "0"], "--problems 0 must be at least 1"),
    (["--problems", "5"], "test split has 4"), (["--out", "/no/such/dir/f.html"], "does not exist"),
    (["--out", "/tmp"], "/tmp is a directory"), (["--model", "/no/such/run"], "no config.json in '/no/such/run'"),
    (["--before", "/no/such/model"], "no config.json in '/no/such/model'"),
    (["--png", "/no/such/dir/f.png"], "does not exist")])
def test_show_bad_input_fails_with_one_line(train_ckpt, tmp_path, flags, message, monkeypatch):
    monkeypatch.setattr(show, "from_pretrained", None)  # nothing may be loaded
    with pytest.raises(SystemExit) as err:
        show.main(["--model", train_ckpt, "--out", str(tmp_path / "f.html"), *flags])
    assert str(err.value).startswith("error: ") and message in str(err.value) and "\n" not in str(err.value)
    assert list(tmp_path.iterdir()) == []


def test_show_png_without_matplotlib_fails_early(train_ckpt, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if matplotlib were not installed
    monkeypatch.setattr(show, "from_pretrained", None)
    with pytest.raises(SystemExit) as err:
        show.main(["--model", train_ckpt, "--out", str(tmp_path / "f.html"), "--png", str(tmp_path / "f.png")])
    assert str(err.value) == "error: --png needs matplotlib: pip install matplotlib"


# ---------------------------------------------------------------------------------------
# make_tiny.py's search traces and the shipped tiny/ model

TINY_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny")


def test_trace_example():
    p = cd.Problem((3, 5, 2), 16)
    assert tiny_prompt(p) == "<bos> Countdown : reach 16 with 3 5 2 ."
    assert trace(p) == "[ 5 3 2 ] 5 + 3 = 8 [ 8 2 ] + 10 no * 16 yes <answer> ( 5 + 3 ) * 2 </answer>"


def test_traces_replay_to_correct_answers():
    problems = cd.generate(400, 123, cd.SMALL)
    for p in problems:
        t = trace(p)
        assert check_trace(p, t), (p, t)
        assert cd.reward(t, p) == 1.0
    lengths = [len(trace(p).split()) for p in problems]
    assert max(lengths) < 400


def test_search_depends_on_target_only_through_verdicts():
    """The trace never restates the target: two problems with the same numbers search
    identically until the first one's "yes" (where the other one says "no")."""
    by_nums = {}
    for p in cd.generate(400, 7, cd.SMALL):
        by_nums.setdefault(tuple(sorted(p.nums)), {})[p.target] = p
    pairs = 0
    for group in by_nums.values():
        ps = sorted(group.values(), key=lambda p: len(trace(p)))
        for short, long in zip(ps, ps[1:]):
            a, b = trace(short).split(), trace(long).split()
            k = a.index("yes")
            assert a[:k] == b[:k] and b[k] == "no"
            pairs += 1
    assert pairs > 20


@pytest.mark.parametrize("corrupt", [
    lambda t: t.replace("* 16 yes", "* 17 yes"),  # wrong arithmetic at a leaf
    lambda t: t.replace("+ 10 no", "+ 10 yes"),  # wrong verdict
    lambda t: t.replace("5 + 3 = 8", "5 + 3 = 9"),  # wrong move
    lambda t: t.replace("[ 8 2 ]", "[ 8 3 ]"),  # wrong numbers left
    lambda t: t.replace("( 5 + 3 ) * 2", "( 5 + 3 ) * 3"),  # answer misses a number
    lambda t: t.replace(" </answer>", ""),  # no closed answer
    lambda t: t[: t.index("<answer>")],  # truncated
])
def test_corrupted_trace_fails_replay(corrupt):
    p = cd.Problem((3, 5, 2), 16)
    t = trace(p)
    assert check_trace(p, t)
    bad = corrupt(t)
    assert bad != t and not check_trace(p, bad)


def test_corrupted_traces_fail_in_bulk():
    for p in cd.generate(100, 9, cd.SMALL):
        words = trace(p).split()
        for k, w in enumerate(words):
            if w.isdigit():  # change any one number of the search or the answer
                bad = " ".join(words[:k] + [str(int(w) + 1)] + words[k + 1:])
                assert not check_trace(p, bad), bad


def test_tokenizer_round_trips_a_trace():
    tok = build_tokenizer()
    unk = tok.token_to_id("<unk>")
    for p in cd.generate(100, 3, cd.SMALL):
        text = tiny_prompt(p) + " " + trace(p)
        ids = tok.encode(text).ids
        assert unk not in ids and ids[0] == tok.token_to_id("<bos>") and ids.count(ids[0]) == 1
        assert len(ids) == len(text.split())  # one token per word, numbers included
        assert tok.decode(ids, skip_special_tokens=False) == text
        tagged = tok.encode(tiny_prompt(p, eviction_rate=0.5)).ids  # the --interoception prompt
        assert unk not in tagged and tok.decode(tagged[-4:]) == "<eviction_rate> 50 % </eviction_rate>"
        completion = tok.decode(tok.encode(trace(p)).ids + [tok.token_to_id("<eos>")], skip_special_tokens=True)
        assert cd.reward(completion, p) == 1.0


def test_held_out_problems_are_disjoint():
    train, test = split_problems(0, 200, n_train=20_000)
    assert len({cd._key(p) for p in test}) == len(test) == 200
    assert not {cd._key(p) for p in train} & {cd._key(p) for p in test}


def test_shipped_tiny_model_loads_and_solves():
    model, tok = from_pretrained(TINY_DIR), load_tokenizer(TINY_DIR)
    cfg = model.config
    assert cfg.vocab_size == tok.get_vocab_size()
    assert cfg.bos_token_id == tok.token_to_id("<bos>") and cfg.eos_ids == [tok.token_to_id("<eos>")]
    assert sum(os.path.getsize(os.path.join(TINY_DIR, f)) for f in os.listdir(TINY_DIR)) < 8e6
    _, test = split_problems(0, 16, n_train=1)
    prompts = [tok.encode(tiny_prompt(p)).ids for p in test]
    torch.manual_seed(0)
    out = rollout(model, prompts, Sampling(max_new_tokens=400, greedy=True), None, eos_ids=cfg.eos_ids)
    texts = tok.decode_batch(out.completions(), skip_special_tokens=True)
    solved = sum(cd.reward(t, p) for t, p in zip(texts, test))
    assert solved >= 11, texts  # the shipped model solves about 95% of held-out problems


def _build_small(out, seed):
    make_tiny.main(["--out", str(out), "--seed", str(seed), "--steps", "3", "--warmup", "1", "--batch", "8",
                    "--micro", "4", "--d", "32", "--layers", "1", "--heads", "2", "--ffn", "64",
                    "--train-problems", "500", "--n-test", "2"])
    return {f.name: f.read_bytes() for f in sorted(out.iterdir())}


def test_make_tiny_rebuilds_bit_for_bit(tmp_path, capsys):
    """make_tiny.py in miniature: the same seed writes the same four files byte for byte (this
    is how tiny/ is reproducible); another seed writes other weights (the control)."""
    first, again, other = (_build_small(tmp_path / name, seed) for name, seed in [("a", 0), ("b", 0), ("c", 1)])
    assert sorted(first) == ["config.json", "model.safetensors", "ngc.json", "tokenizer.json"]
    assert first == again
    assert other["model.safetensors"] != first["model.safetensors"]
    assert not any(p.name.endswith((".tmp", ".old")) for p in tmp_path.iterdir())
    assert "final loss" in capsys.readouterr().out


def test_default_run_starts_from_the_shipped_model(tmp_path, capsys):
    """`python train.py --task countdown` with no --model: tiny/ and its ngc.json, shrunk to one
    small step and one evaluation."""
    from make_tiny import TINY_RUN
    with open(os.path.join(TINY_DIR, "ngc.json")) as f:
        assert json.load(f) == TINY_RUN  # the shipped run defaults are the ones make_tiny.py writes
    train.main(["--task", "countdown", "--out", str(tmp_path), "--threads", "1", "--steps", "1", "--prompts", "2",
                "--group", "2", "--max-new-tokens", "48", "--eval-problems", "4", "--eval-every", "1"])
    printed = capsys.readouterr().out
    assert "model " + TINY_DIR in printed and f"δ={TINY_RUN['delta']}" in printed
    assert "ε = 0.5 (greedy top-K)" in printed and "peak-KV reduction" in printed
    steps = [json.loads(line) for line in open(tmp_path / "log.jsonl")]
    assert [s["step"] for s in steps if "reward" in s] == [0] and sum("eval" in s for s in steps) == 2
    assert tasks.run_defaults(str(tmp_path / "checkpoint"))["prompt"] == "tiny"


def test_blind_tag_is_interoception_without_the_rate(tmp_path, monkeypatch):
    """--interoception --blind-tag, the control of §5.3's comparison: the groups draw the same ε
    as under --interoception, and the prompts have the same length and differ only where the
    tag states the rate ("-" instead of the rate's number)."""
    seen = {}

    def spy(model, prompts, sampling, eviction=None, rates=None, **kw):
        seen[run] = prompts, rates
        return rollout(model, prompts, replace(sampling, max_new_tokens=4), eviction, rates=rates, **kw)

    monkeypatch.setattr(train, "rollout", spy)
    for run, flags in (("rate", []), ("blind", ["--blind-tag"])):
        train.main(["--out", str(tmp_path / run), "--threads", "1", "--steps", "1", "--prompts", "4", "--group", "2",
                    "--eval-every", "0", "--save-every", "0", "--interoception", *flags])
    (tagged, rates), (blind, blind_rates) = seen["rate"], seen["blind"]
    assert rates is not None and torch.equal(rates, blind_rates) and len(set(rates.tolist())) > 1
    tok = load_tokenizer(TINY_DIR)
    for a, b, rate in zip(tagged, blind, rates.tolist()):
        changed = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
        assert len(a) == len(b) and changed == [len(a) - 3]  # <eviction_rate> RATE % </eviction_rate>
        assert tok.decode([a[-3]]) == str(round(100 * rate)) and tok.decode([b[-3]]) == "-"


# ---------------------------------------------------------------------------------------
# make_tiny.py --task math: word-problem traces and the shipped tiny-math/ model (the math
# pipeline of §5.4 in miniature)

TINY_MATH_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny-math")
SHELF = mt.Problem("A shelf has 8 rows of 12 books. Mia adds 37 more books. How many books are on the shelf?", "133")


def test_math_trace_example():
    assert make_tiny.math_trace(SHELF) == (
        "1 : 12 , 2 : 24 , 3 : 36 , 4 : 48 , 5 : 60 , 6 : 72 , 7 : 84 , 8 : 96 , so 96 books . "
        "96 + 37 : 6 + 7 = 13 , 90 + 30 + 10 = 130 , 130 + 3 = 133 . \\boxed { 133 }")
    apples = mt.Problem("Tom has 8 boxes of 12 apples and gives away 37 apples. How many apples are left?", "59")
    assert make_tiny.math_trace(apples).endswith(
        "so 96 apples . 96 - 37 : 16 - 7 = 9 , 90 - 10 - 30 = 50 , 50 + 9 = 59 . \\boxed { 59 }")
    with pytest.raises(ValueError, match="not one of mathtask.TEMPLATES"):
        make_tiny.math_trace(mt.Problem("What is 2 + 3?", "5"))


def _column_result(x, y, text):
    """Check a column sum step by step and return its result: each step `p op q [op r] = s` is
    right, the units line starts from x's units digit (+ 10 when it borrows) and takes y's, the
    last line adds the tens line's result and the units line's units digit."""
    steps = []
    for step in text.split(" , "):
        left, right = step.split(" = ")
        words = left.split()
        value = int(words[0])
        for op, n in zip(words[1::2], words[2::2]):
            value = value + int(n) if op == "+" else value - int(n)
        assert value == int(right) >= 0, step
        steps.append((words, value))
    (first, units), (_, tens), (last, result) = steps
    assert int(first[0]) in (x % 10, x % 10 + 10) and int(first[2]) == y % 10, text
    assert last == [str(tens), "+", str(units % 10)], text
    return result


@pytest.mark.parametrize("op", ["+", "-"])
def test_columns_add_and_subtract(op):
    for x in range(0, 300, 7):
        for y in range(0, x + 1, 3):
            assert _column_result(x, y, make_tiny.columns(x, op, y)) == (x + y if op == "+" else x - y), (x, op, y)
    with pytest.raises(AssertionError):  # the control: a dropped carry is caught
        _column_result(96, 37, make_tiny.columns(96, "+", 37).replace(" + 10 = 130", " = 130"))


def test_math_traces_decode_to_reward_one():
    """Every demo template, 400 problems: trace ids + EOS decode (joined with spaces, specials
    skipped) to a completion whose last \\boxed{...} is the answer; no word is <unk>."""
    tok = build_tokenizer(make_tiny.MATH_WORDS)
    unk, eos = tok.token_to_id("<unk>"), tok.token_to_id("<eos>")
    problems, _ = mt.demo_splits(5, 400, 1)
    assert {u for p in problems for u in make_tiny.MATH_LAST_STEP if f" {u}" in p.question} == set(make_tiny.MATH_LAST_STEP)
    for p in problems:
        ids = tok.encode(make_tiny.math_trace(p)).ids
        assert unk not in ids and len(ids) == len(make_tiny.math_trace(p).split())
        completion = tok.decode(ids + [eos], skip_special_tokens=True)
        assert completion == make_tiny.math_trace(p) and mt.reward(completion, p) == 1.0


@pytest.mark.parametrize("corrupt", [
    lambda t: t.replace("{ 133 }", "{ 134 }"),  # wrong answer
    lambda t: t.replace(" }", ""),  # the box never closes
    lambda t: t[: t.index("\\boxed")],  # truncated before the box
    lambda t: t.replace("\\boxed", "boxed"),  # no box
])
def test_corrupted_math_trace_scores_zero(corrupt):
    t = make_tiny.math_trace(SHELF)
    assert mt.reward(t, SHELF) == 1.0
    bad = corrupt(t)
    assert bad != t and mt.reward(bad, SHELF) == 0.0


def test_math_prompts_are_mathtask_encode_without_unk():
    """The prompts pretraining sees are mathtask.encode's (the plain fallback: this vocabulary has
    no R1 chat tokens), one token per word, none <unk>, for every demo problem; the targets start
    at the first trace token. Control: a word outside the demo questions is <unk>."""
    tok = build_tokenizer(make_tiny.MATH_WORDS)
    unk = tok.token_to_id("<unk>")
    train_set, test_set = mt.demo_splits(0, 2000, 200)
    for p in train_set + test_set:
        ids = mt.encode(tok, p)
        assert unk not in ids and ids == tok.encode(mt.prompt_text(p)).ids
        assert tok.decode(ids) == " ".join(mt.prompt_text(p).split())
    assert unk in mt.encode(tok, mt.Problem("A farmer has 3 cows.", "3"))
    by_prompt = {tuple(mt.encode(tok, p)): p for p in train_set[:40]}
    for x, y in make_tiny.batches(tok, train_set[:40], random.Random(0), 40, 8, make_tiny.math_example):
        for row, target in zip(x.tolist(), y.tolist()):
            start = next(i for i, v in enumerate(target) if v != -100) + 1  # the first completion token
            completion = tok.decode([v for v in target if v != -100], skip_special_tokens=True)
            assert mt.reward(completion, by_prompt[tuple(row[:start])]) == 1.0


def _build_small_math(out, seed):
    make_tiny.main(["--task", "math", "--out", str(out), "--seed", str(seed), "--steps", "3", "--warmup", "1",
                    "--batch", "8", "--micro", "4", "--d", "32", "--layers", "1", "--heads", "2", "--ffn", "64",
                    "--train-problems", "300", "--n-test", "2", "--max-new-tokens", "16"])
    return {f.name: f.read_bytes() for f in sorted(out.iterdir())}


def test_make_tiny_math_rebuilds_bit_for_bit(tmp_path, capsys):
    """make_tiny.py --task math in miniature: one seed writes the same four files byte for byte,
    another seed other weights (the control); ngc.json is the math run's."""
    first, again, other = (_build_small_math(tmp_path / name, seed) for name, seed in [("a", 0), ("b", 0), ("c", 1)])
    assert sorted(first) == ["config.json", "model.safetensors", "ngc.json", "tokenizer.json"]
    assert first == again
    assert other["model.safetensors"] != first["model.safetensors"]
    assert json.loads(first["ngc.json"]) == make_tiny.MATH_RUN
    assert not any(p.name.endswith((".tmp", ".old")) for p in tmp_path.iterdir())
    assert "final loss" in capsys.readouterr().out


def test_shipped_tiny_math_model_solves_and_eviction_hurts():
    """tiny-math/ loads through from_pretrained, is small, and solves most of 16 held-out demo
    problems greedily from mathtask.encode's prompts; evicting half the cache every δ tokens
    with its untrained scores (ngc.json's δ, b, w) solves fewer."""
    model, tok = from_pretrained(TINY_MATH_DIR), load_tokenizer(TINY_MATH_DIR)
    cfg = model.config
    assert cfg.vocab_size == tok.get_vocab_size() and cfg.eos_ids == [tok.token_to_id("<eos>")]
    assert sum(os.path.getsize(os.path.join(TINY_MATH_DIR, f)) for f in os.listdir(TINY_MATH_DIR)) < 8e6
    with open(os.path.join(TINY_MATH_DIR, "ngc.json")) as f:
        run = json.load(f)
    assert run == make_tiny.MATH_RUN
    defaults = tasks.run_defaults(TINY_MATH_DIR)  # every key is one of train.py's settings
    assert defaults["task"] == "math" and {k: defaults[k] for k in run} == run
    _, test = mt.demo_splits(0, 1, 200)
    test = test[:16]  # held out: the first problems of the seed's stream never reach pretraining
    sampling = Sampling(max_new_tokens=run["max_new_tokens"], greedy=True)
    full = evaluation.roll_out_and_score(model, tok, test, sampling, None, encode=mt.encode, reward_fn=mt.reward)
    assert full["reward"].sum() >= 13, full["texts"]
    evicted = evaluation.roll_out_and_score(model, tok, test, sampling, Eviction(run["delta"], run["block"], run["window"], 0.5, greedy=True),
                          encode=mt.encode, reward_fn=mt.reward)
    assert evicted["reward"].sum() <= full["reward"].sum() - 4, evicted["texts"]


# ---------------------------------------------------------------------------------------
# 13. Mathematical reasoning (§5.4, mathtask.py): DAPO-Math-17k → AMC/AIME, boxed answers, top-p


BIG = "1000000000000000000001"  # 22 digits: a float cannot tell it from 10^21

MATH_REWARD_CASES = [  # (completion, ground truth, reward)
    # the last \boxed{...} is read
    ("\\boxed{42}", "42", 1.0),
    ("so the answer is \\boxed {42}", "42", 1.0),
    ("<think>6 * 7 = 42</think> The answer is $\\boxed{42}$.", "42", 1.0),
    ("\\boxed{41}, no wait: \\boxed{42}", "42", 1.0),
    ("\\boxed{\\boxed{42}}", "42", 1.0),
    ("\\boxed{42}. (I was asked to use \\boxed as the format.)", "42", 1.0),  # a bare \boxed is no box
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}", 1.0),  # nested braces
    ("\\boxed{" + "9" * 999 + "}", "9" * 999, 1.0),  # long but under the cap
    # normalisation, one item at a time
    ("\\boxed{ 42 }", "42", 1.0),                                   # spaces
    ("\\boxed{\\left( 1, 2 \\right)}", "(1,2)", 1.0),               # \left, \right
    ("\\boxed{10\\!000}", "10000", 1.0),                            # \!
    ("\\boxed{10\\,000}", "10000", 1.0),                            # \,
    ("\\boxed{$42$}", "42", 1.0),                                   # $
    ("\\boxed{\\text{(C)}}", "(C)", 1.0),                           # \text{}
    ("\\boxed{30^\\circ}", "30", 1.0),                              # ^\circ
    ("\\boxed{30^{\\circ}}", "30", 1.0),
    ("\\boxed{12.0}", "12", 1.0),                                   # trailing .0
    ("\\boxed{27}", "27.0", 1.0),                                   # AMC's float answers
    ("\\boxed{42.}", "42", 1.0),
    ("\\boxed{x = 5}", "5", 1.0),                                   # a leading "x ="
    ("\\boxed{n=5}", "5", 1.0),
    ("\\boxed{1,000}", "1000", 1.0),                                # thousands separators
    ("\\boxed{+42}", "42", 1.0),
    ("\\boxed{007}", "7", 1.0),
    # exact numbers
    ("\\boxed{" + BIG + "}", BIG, 1.0),
    ("\\boxed{\\frac{1}{2}}", "1/2", 1.0),
    ("\\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\tfrac{3}{6}}", "1/2", 1.0),
    ("\\boxed{-\\frac{3}{4}}", "-3/4", 1.0),
    ("\\boxed{\\frac{-3}{4}}", "-0.75", 1.0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    # rejected
    ("42", "42", 0.0),                                              # no box
    ("\\boxed42", "42", 0.0),                                       # no braces
    ("\\Boxed{42}", "42", 0.0),
    ("\\fbox{42}", "42", 0.0),
    ("\\boxed{}", "42", 0.0),                                       # empty box
    ("\\boxed{ $ $ }", "42", 0.0),
    ("\\boxed{42} no wait, \\boxed{41}", "42", 0.0),                # conflicting boxes ending wrong
    ("\\boxed{42}, \\boxed{41}, \\boxed{40}", "42", 0.0),
    ("\\boxed{42", "42", 0.0),                                      # unbalanced braces
    ("\\boxed{42} and finally \\boxed{\\frac{1}{2}", "42", 0.0),    # the last box never closes
    ("\\boxed{\\frac{4}{2}", "2", 0.0),
    ("\\boxed{" + "4" * 100_000 + "}", "4" * 100_000, 0.0),         # a 100k-character answer
    ("\\boxed{" + "1" * 100_000 + "}", "42", 0.0),
    ("\\boxed{" + BIG + "}", "1000000000000000000000", 0.0),       # differ in the last digit
    ("\\boxed{1000000000000000000000}", BIG, 0.0),
    ("\\boxed{1e21}", "1000000000000000000000", 0.0),
    ("\\boxed{0.333}", "1/3", 0.0),
    ("\\boxed{12.5}", "12", 0.0),
    ("\\boxed{-42}", "42", 0.0),
    ("\\boxed{\\frac{1}{3}}", "1/2", 0.0),
    ("\\boxed{-\\frac{1}{2}}", "1/2", 0.0),
    ("\\boxed{1/0}", "0", 0.0),
    ("\\boxed{1,00}", "100", 0.0),                                  # not a thousands separator
    ("\\boxed{x = 6}", "5", 0.0),
    ("\\boxed{2^{10}}", "1024", 0.0),                               # nothing is evaluated
    ("\\boxed{6*7}", "42", 0.0),
    ("\\boxed{__import__('os').getpid() * 0 + 42}", "42", 0.0),
]


@pytest.mark.parametrize("completion, truth, expected", MATH_REWARD_CASES,
                         ids=[f"{i}-{'accept' if r else 'reject'}" for i, (_, _, r) in enumerate(MATH_REWARD_CASES)])
def test_math_reward_table(completion, truth, expected, no_eval):
    assert mt.reward(completion, mt.Problem("q", truth)) == expected


def test_math_reward_table_covers_both_verdicts():
    verdicts = [r for _, _, r in MATH_REWARD_CASES]
    assert len(verdicts) >= 40 and verdicts.count(1.0) >= 20 and verdicts.count(0.0) >= 20


def test_last_boxed_and_normalize(no_eval):
    lb = mt.last_boxed
    assert lb("\\boxed{a} \\boxed{b{c}d}") == "b{c}d"
    assert lb("\\boxed  {7}") == "7" and lb("\\boxed{}") == ""
    assert lb("\\boxed{7} \\boxed") == "7" and lb("\\boxed{7} \\boxed{") is None
    assert lb("no box") is None and lb("\\boxed{{}") is None
    cap = mt.MAX_ANSWER_CHARS
    assert lb("\\boxed{" + "1" * cap + "}") == "1" * cap and lb("\\boxed{" + "1" * (cap + 1) + "}") is None
    norm = mt.normalize
    assert norm(" \\left[ 1 ,\\; 2 \\right) ") == "[1,2)"
    assert norm("\\leftarrow") == "\\leftarrow"  # only \left itself is dropped
    assert norm("\\text{ m}") == "m" and norm("5\\!\\:\\,$") == "5"
    assert norm("90^\\circ") == "90" and norm("y=\\dfrac{1}{2}") == "\\frac{1}{2}"
    assert norm("12,345,678.5") == "12345678.5" and norm("1,23") == "1,23"
    assert mt.equivalent("3/6", "\\frac{1}{2}") and not mt.equivalent("0.3333333333", "1/3")
    assert mt.equivalent(BIG, BIG + ".000") and not mt.equivalent(BIG, "1e21")
    # Negative control: the float comparison these replace cannot tell the big integers apart.
    assert float(BIG) == float("1000000000000000000000")
    assert mt.equivalent("1" * 4999, "1" * 4999)  # over int()'s digit limit: compared as strings
    assert not mt.equivalent("", "") and not mt.equivalent("\\text{ }", "$")  # an empty answer never matches


def test_math_reward_runs_nothing_on_10k_noisy_strings(tmp_path, monkeypatch, no_eval):  # tmp_path before the traps
    """Random strings built from the reward's own syntax: always 0 or 1, never an exception,
    never a file written, and 1 only when the last box really holds the answer."""
    monkeypatch.chdir(tmp_path)
    rng = random.Random(0)
    alphabet = ["\\boxed{", "\\boxed", "{", "}", "42", "4", "2", " ", "$", "\\frac", "\\left", "x=", ".0", ",",
                "-", "/", "\\text{", "^\\circ", "\\!", "__import__('os').system('touch pwned')", "\\", "é", "\x00"]
    n_ones = 0
    for _ in range(10_000):
        s = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        got = mt.reward(s, mt.Problem("q", "42"))
        assert got in (0.0, 1.0)
        if got:
            n_ones += 1
            assert mt._number(mt.normalize(mt.last_boxed(s))) == 42
    assert n_ones > 10  # the noise does reach right answers
    assert list(tmp_path.iterdir()) == []
    # the traps are live: eval and exec are replaced, and a reader built on compile is caught
    assert builtins.eval is _boom and builtins.exec is _boom
    monkeypatch.setattr(mt, "_number", lambda text: compile(text, "<boxed>", "eval"))
    with pytest.raises(AssertionError):
        mt.reward("\\boxed{42}", mt.Problem("q", "42"))


DAPO_ROW = {  # a row of BytedTsinghua-SIA/DAPO-Math-17k, with its verbatim prompt wrapper
    "data_source": "math_dapo",
    "prompt": [{"content": "Solve the following math problem step by step. The last line of your response should be "
                           "of the form Answer: $Answer (without quotes) where $Answer is the answer to the problem."
                           "\n\nWhat is $6 \\times 7$?\n\nRemember to put your answer on its own line after \"Answer:\".",
                "role": "user"}],
    "ability": "MATH",
    "reward_model": {"ground_truth": "42", "style": "rule-lighteval/MATH_v2"},
    "extra_info": {"index": "9a9b6eb4-a1cb-49d1-8c1e-62eaf2f74079"},
}


def _write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_load_reads_the_dapo_and_aime_amc_layouts(tmp_path):
    dapo = _write_jsonl(tmp_path / "dapo.jsonl", [
        DAPO_ROW,
        {"prompt": "What is 2 + 2?", "reward_model": {"ground_truth": "4"}, "solution": "4"},  # open-r1's copy
        {"prompt": [{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "What is 3 + 3?\n" + mt.INSTRUCTION}], "reward_model": {"ground_truth": "6"}},
    ])
    assert mt.load(dapo) == [mt.Problem("What is $6 \\times 7$?", "42"), mt.Problem("What is 2 + 2?", "4"),
                             mt.Problem("What is 3 + 3?", "6")]
    both = _write_jsonl(tmp_path / "both.jsonl", [{"prompt": "Q?", "problem": "P?", "reward_model": {"ground_truth": "1"},
                                                   "answer": "2"}])
    assert mt.load(both) == [mt.Problem("Q?", "1")]  # DAPO's fields win when a row has both layouts
    aime = _write_jsonl(tmp_path / "aime.jsonl", [
        {"problem_idx": 1, "problem": "Find $n$.", "answer": 70},  # MathArena: integer answers
        "",                                                      # blank lines are skipped
        {"id": 0, "question": "Find $m$.", "answer": 27.0, "url": "x"},  # math-ai/amc23: float answers
    ])
    problems = mt.load(aime)
    assert problems == [mt.Problem("Find $n$.", "70"), mt.Problem("Find $m$.", "27.0")]
    assert mt.reward("\\boxed{27}", problems[1]) == 1.0 and mt.reward("\\boxed{70}", problems[0]) == 1.0


def test_load_field_overrides_take_dotted_paths(tmp_path):
    path = _write_jsonl(tmp_path / "custom.jsonl", [
        {"data": {"text": "What is 1 + 1?"}, "meta": {"solution": {"final": "2"}}, "answer": "wrong"}])
    assert mt.load(path, question_field="data.text", answer_field="meta.solution.final") == [
        mt.Problem("What is 1 + 1?", "2")]
    assert mt.load(path, question_field="data.text") == [mt.Problem("What is 1 + 1?", "wrong")]  # the default
    chat = _write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "Q?"}], "gt": 3}])
    assert mt.load(chat, question_field="messages", answer_field="gt") == [mt.Problem("Q?", "3")]


@pytest.mark.parametrize("rows, kwargs, message", [
    (None, {}, "missing.jsonl: no such file"),
    ([], {}, "empty.jsonl: no problems"),
    (["", "  "], {}, "empty.jsonl: no problems"),
    ([DAPO_ROW, "{not json"], {}, "bad.jsonl:2: not valid JSON"),
    ([DAPO_ROW, "[1, 2]"], {}, "bad.jsonl:2: expected a JSON object"),
    ([{"problem": "Q?"}], {}, "bad.jsonl:1: no answer in reward_model.ground_truth or answer"),
    ([{"answer": "1"}], {}, "bad.jsonl:1: no question text in prompt, problem or question"),
    ([{"problem": "Q?", "answer": ""}], {}, "bad.jsonl:1: no answer"),
    ([{"problem": "Q?", "answer": [1]}], {}, "bad.jsonl:1: no answer"),
    ([{"prompt": [{"role": "system", "content": "hi"}], "answer": "1"}], {}, "bad.jsonl:1: no question text"),
    ([DAPO_ROW], {"answer_field": "reward_model.truth"}, "bad.jsonl:1: no answer in reward_model.truth"),
    ([DAPO_ROW], {"question_field": "question"}, "bad.jsonl:1: no question text in question"),
])
def test_load_bad_input_fails_with_one_line(tmp_path, rows, kwargs, message):
    name = message.split(":")[0]
    path = str(tmp_path / name) if rows is None else _write_jsonl(tmp_path / name, rows)
    with pytest.raises(ValueError) as e:
        mt.load(path, **kwargs)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert str(tmp_path) in str(e.value)  # the message names the file


def test_load_wrong_extension_and_parquet_without_pyarrow(tmp_path, monkeypatch):
    (tmp_path / "x.csv").write_text("problem,answer\n")
    with pytest.raises(ValueError, match="expected a .jsonl or .parquet file"):
        mt.load(str(tmp_path / "x.csv"))
    (tmp_path / "x.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as if pyarrow were not installed
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ValueError) as e:
        mt.load(str(tmp_path / "x.parquet"))
    assert str(e.value) == "reading .parquet needs pyarrow: pip install pyarrow"


def test_load_parquet(tmp_path):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.Table.from_pylist([DAPO_ROW, {**DAPO_ROW, "reward_model": {"ground_truth": "7", "style": "rule"}}]),
                   tmp_path / "dapo.parquet")
    pq.write_table(pa.Table.from_pylist([{"problem": "Find $n$.", "answer": 70}]), tmp_path / "aime.parquet")
    assert mt.load(str(tmp_path / "dapo.parquet")) == [mt.Problem("What is $6 \\times 7$?", "42"),
                                                       mt.Problem("What is $6 \\times 7$?", "7")]
    assert mt.load(str(tmp_path / "aime.parquet")) == [mt.Problem("Find $n$.", "70")]
    with pytest.raises(ValueError, match=r"aime.parquet:1: no answer in solution"):
        mt.load(str(tmp_path / "aime.parquet"), answer_field="solution")


def test_math_prompt_has_the_r1_instruction_once_and_the_chat_template():
    q = mt.Problem("What is 6 * 7?", "42")
    assert mt.prompt_text(q) == "What is 6 * 7?\nPlease reason step by step, and put your final answer within \\boxed{}."
    already = mt.Problem("Please reason step by step, and put your final answer within \\boxed{}. What is 6 * 7?", "42")
    assert mt.prompt_text(already) == already.question  # not appended twice
    chat, plain = _tiny_tokenizer(chat=True), _tiny_tokenizer(chat=False)
    ids = mt.encode(chat, q)
    bos, user, assistant = (chat.token_to_id(t) for t in cd.R1_CHAT)
    assert ids[:2] == [bos, user] and ids[-2:] == [assistant, chat.token_to_id("<think>")] and ids.count(bos) == 1
    assert ids == cd.encode_prompt(chat, mt.prompt_text(q))
    assert mt.encode(plain, q) == plain.encode(mt.prompt_text(q), add_special_tokens=False).ids
    # a DAPO row's prompt asks for \boxed{}, not for DAPO's own "Answer:" line
    p = mt.Problem(mt._question(DAPO_ROW, None), mt._answer(DAPO_ROW, None))
    assert "Answer:" not in mt.prompt_text(p) and mt.prompt_text(p).count("\\boxed{}") == 1


DEMO_RECOMPUTE = {  # each demo template's answer from its three numbers, written independently
    "apples are left": lambda a, b, c: a * b - c,
    "books are on the shelf": lambda a, b, c: a * b + c,
    "cents of change": lambda a, b, c: c - a * b,
    "each friend get": lambda a, b, c: a * b // c if a * b % c == 0 else None,
}


def test_demo_set_is_reproducible_correct_and_in_dapo_layout(tmp_path):
    train, test = mt.make_demo(str(tmp_path / "a"), seed=3, n_train=300, n_test=40)
    files = {n: (tmp_path / "a" / n).read_bytes() for n in ("train.jsonl", "test.jsonl")}
    mt.make_demo(str(tmp_path / "b"), seed=3, n_train=300, n_test=40)
    mt.make_demo(str(tmp_path / "c"), seed=4, n_train=300, n_test=40)
    assert all((tmp_path / "b" / n).read_bytes() == f for n, f in files.items())  # same seed, same bytes
    assert (tmp_path / "c" / "train.jsonl").read_bytes() != files["train.jsonl"]    # control: other seed
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["test.jsonl", "train.jsonl"]  # no .tmp left
    assert (len(train), len(test)) == (300, 40)
    assert len({p.question for p in train + test}) == 340  # distinct, test disjoint from train
    row = json.loads(files["train.jsonl"].splitlines()[0])
    assert row["prompt"][0]["role"] == "user" and row["prompt"][0]["content"] == mt.prompt_text(train[0])
    assert row["reward_model"]["ground_truth"] == train[0].answer
    assert mt.load(str(tmp_path / "a" / "train.jsonl")) == train  # loads back as generated
    used = set()
    for p in train + test:
        (key,) = [k for k in DEMO_RECOMPUTE if k in p.question]
        used.add(key)
        a, b, c = map(int, re.findall(r"\d+", p.question))
        assert p.answer == str(DEMO_RECOMPUTE[key](a, b, c)) and int(p.answer) >= 0, p
        assert mt.reward(f"So \\boxed{{{p.answer}}}.", p) == 1.0
        assert mt.reward(f"So \\boxed{{{int(p.answer) + 1}}}.", p) == 0.0
    assert used == set(DEMO_RECOMPUTE)


def test_demo_cli_writes_the_files_and_refuses_bad_sizes(tmp_path):
    def cli(*flags):
        return subprocess.run([sys.executable, "mathtask.py", "--make-demo", str(tmp_path / "d"), *flags],
                              cwd=os.path.dirname(os.path.abspath(__file__)), capture_output=True, text=True)

    out = cli("--train", "20", "--test", "5")
    assert out.returncode == 0, out.stderr
    assert "wrote 20 train and 5 test problems" in out.stdout
    assert len(mt.load(str(tmp_path / "d" / "test.jsonl"))) == 5
    out = cli("--train", "0")
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.splitlines() == ["error: the demo set needs at least one train and one test problem, got 0 and 200"]


# top-p (nucleus) sampling, the paper's evaluation setting (top-p 0.95, T = 0.6)

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


def test_train_and_eval_run_the_math_task_end_to_end(train_ckpt, tmp_path, monkeypatch):
    """`train.py --task math` on the demo set in DAPO's layout: the paper's math recipe underneath
    (here shrunk), one step with the boxed-answer reward and the min-length penalty, an evaluation;
    `eval.py --task math` then gives pass@k for NGC and a baseline."""
    mt.make_demo(tmp_path / "data", n_train=8, n_test=3)
    data, held_out = str(tmp_path / "data" / "train.jsonl"), str(tmp_path / "data" / "test.jsonl")
    d = tasks.run_defaults(train_ckpt, "math")
    assert (d["delta"], d["max_new_tokens"], d["prompts"], d["group"], d["steps"]) == (8, 24, 2, 4, 469)  # ngc.json wins
    assert (tasks.MATH["delta"], tasks.MATH["min_length"], tasks.MATH["top_k"], tasks.MATH["beta2"]) == (350, 350, 0, 0.999)
    calls = []
    monkeypatch.setitem(tasks.TASK_REWARD, "math", lambda text, p: calls.append(p) or float(sum(map(ord, text)) % 2))
    log = run_train_task(train_ckpt, tmp_path / "run", "--task", "math", "--data", data, "--eval-data", held_out,
                         "--steps", "1", "--eval-every", "1", "--min-length", "20")
    step = [r for r in log if "eval" not in r][0]
    assert isinstance(calls[0], mt.Problem) and step["L_mem"] is not None
    assert json.loads((tmp_path / "run" / "checkpoint" / "ngc.json").read_text())["task"] == "math"
    monkeypatch.setattr(evaluation, "rollout", counting_rollout(seen := []))
    evaluation.main(["--model", str(tmp_path / "run" / "checkpoint"), "--policy", "none", "ngc", "knorm", "--samples", "2",
             "--out", str(tmp_path / "math.jsonl")])
    rows = [json.loads(line) for line in (tmp_path / "math.jsonl").read_text().splitlines()]
    assert [r["policy"] for r in rows] == ["none", "ngc", "knorm"] and all(set(r["pass_at_k"]) == {"1", "2"} for r in rows)
    s = seen[0]
    assert (s.temperature, s.top_p, s.max_new_tokens) == (0.6, 0.95, 3850)  # the paper's math evaluation


def run_train_task(ckpt, out, *flags):
    train.main(["--model", ckpt, "--out", str(out), "--threads", "1", *flags])
    return rundir.read_log(os.path.join(out, "log.jsonl"))


def counting_rollout(seen):
    def wrapped(model, prompts, sampling, eviction=None, **kw):
        seen.append(sampling)
        return rollout(model, prompts, replace(sampling, max_new_tokens=8), eviction, **kw)
    return wrapped


@pytest.mark.parametrize("flags, message", [
    (["--task", "math"], "--task math reads its problems from files"),
    (["--task", "math", "--data", "/no/such.jsonl", "--eval-every", "0"], "no such file: /no/such.jsonl"),
    (["--task", "math", "--data", "x.jsonl", "--eval-every", "0", "--interoception"], "has no such tag"),
    (["--top-p", "0"], "--top-p 0.0 must lie in (0, 1]"),
    (["--blind-tag"], "add --interoception")])
def test_bad_math_flags_fail_with_one_line(train_ckpt, tmp_path, flags, message):
    with pytest.raises(SystemExit) as err:
        train.main(["--model", train_ckpt, "--out", str(tmp_path / "run"), *flags])
    assert str(err.value).startswith("error: ") and message in str(err.value) and "\n" not in str(err.value)


# ---------------------------------------------------------------------------------------
# Compression via meta-tokens (Appendix): g forced before every round, the gist mask


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
    with pytest.raises(ValueError, match=r"meta_token=96 is not a token id of this model \(vocabulary 96\)"):
        rollout(model, prompts_of([5]), Sampling(max_new_tokens=4, meta_token=96), EV)


def newest_first(psi, keys, alive):
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


@pytest.mark.parametrize("tied", [False, True])
def test_add_meta_token_grows_the_vocabulary_with_the_mean_row(tmp_path, tied):
    """The tiny tokenizer covers all 96 rows, so g gets id 96 and one new row (tied or untied head),
    equal to the mean of the rows of the given text's tokens; every other row is unchanged."""
    path = write_checkpoint(tmp_path / "m", tie_word_embeddings=tied)
    model, tok = from_pretrained(path), load_tokenizer(path)
    emb, head = model.model.embed_tokens.weight.detach().clone(), model.lm_head.weight.detach().clone()
    g = add_meta_token(model, tok, text="w3 w7 w11")
    assert g == 96 and tok.token_to_id(META_TOKEN) == g and model.config.vocab_size == 97
    assert tok.encode(f"w3 {META_TOKEN} w5", add_special_tokens=False).ids == [3, g, 5]
    assert tok.decode([3, g, 5], skip_special_tokens=True) == "w3 w5"  # the reward never reads g
    new_emb, new_head = model.model.embed_tokens.weight, model.lm_head.weight
    assert new_emb.shape == new_head.shape == (97, 64) and (new_head is new_emb) == tied
    assert torch.equal(new_emb[:96], emb) and torch.equal(new_head[:96], head)
    mean = emb[[3, 7, 11]].mean(0)
    assert (new_emb[g] - mean).abs().max() < 1e-7
    assert (new_head[g] - (mean if tied else head[[3, 7, 11]].mean(0))).abs().max() < 1e-7
    assert (mean - emb[3]).abs().max() > 1e-2  # control: the mean is no single row
    assert new_emb.requires_grad and model.model.embed_tokens.num_embeddings == model.lm_head.out_features == 97
    out = model.logits(model(torch.tensor([[3, g, 5]]), torch.arange(3)[None]))
    assert out.shape == (1, 3, 97)


def test_add_meta_token_takes_a_spare_row_and_falls_back_when_the_text_is_unknown(ckpt, capsys):
    """R1 has more embedding rows than tokens: g takes the first spare one and nothing grows. The tiny
    word-level tokenizer does not know "tl;dr" (it maps it to <pad>, its unk): g is the mean of all rows."""
    model = init_weights(Qwen2(Qwen2Config(**{**TINY_MODEL, "vocab_size": 100})), std=0.1)
    tok = load_tokenizer(ckpt)  # 96 tokens for 100 rows
    assert tok.encode("tl;dr", add_special_tokens=False).ids == [0]
    emb, head = model.model.embed_tokens.weight.detach().clone(), model.lm_head.weight.detach().clone()
    g = add_meta_token(model, tok)
    assert g == 96 and model.config.vocab_size == 100 and model.lm_head.weight.shape == (100, 64)
    assert "has no tokens for 'tl;dr'" in capsys.readouterr().out
    assert (model.model.embed_tokens.weight[g] - emb.mean(0)).abs().max() < 1e-7
    assert (model.lm_head.weight[g] - head.mean(0)).abs().max() < 1e-7
    others = torch.arange(100) != g
    assert torch.equal(model.model.embed_tokens.weight[others], emb[others])
    assert torch.equal(model.lm_head.weight[others], head[others])
    assert (emb.mean(0) - emb[0]).abs().max() > 1e-2  # control: not <pad>'s own row


def test_train_meta_token_saves_g_and_eval_forces_it(train_ckpt, tmp_path, monkeypatch):
    """--meta-token: g is added at load, forced in the training and held-out rollouts, saved with the
    checkpoint (model, tokenizer, ngc.json), and eval.py forces it from the checkpoint's setting.
    A second load leaves the (possibly trained) row alone. Control: without the flag, no g anywhere."""
    seen = []

    def recording(model, prompts, sampling, eviction=None, **kw):
        ro = rollout(model, prompts, sampling, eviction, **kw)
        seen.append((sampling.meta_token, eviction is not None, bool(ro.forced.any())))
        return ro

    monkeypatch.setattr(train, "rollout", recording)
    monkeypatch.setattr(evaluation, "rollout", recording)
    run_train(train_ckpt, tmp_path / "run", "--meta-token", "--steps", "1", "--eval-every", "1")
    out = str(tmp_path / "run" / "checkpoint")
    back, tok = from_pretrained(out), load_tokenizer(out)
    g = tok.token_to_id(META_TOKEN)
    assert g == 96 and back.config.vocab_size == 97 and json.loads(Path(out, "ngc.json").read_text())["meta_token"]
    assert all(meta == g for meta, _, _ in seen) and len(seen) == 5  # eval (full, ε), step, eval (full, ε)
    assert all(forced == evicting for _, evicting, forced in seen)
    row = back.model.embed_tokens.weight[g].clone()
    assert add_meta_token(back, tok) == g and torch.equal(back.model.embed_tokens.weight[g], row)
    seen.clear()
    evaluation.main(["--model", out, "--policy", "none", "ngc", "--problems", "2"])
    assert [meta for meta, _, _ in seen] == [g, g] and seen[1][2]
    seen.clear()
    run_train(train_ckpt, tmp_path / "plain", "--steps", "1")
    assert seen and all(meta is None and not forced for meta, _, forced in seen)
    assert load_tokenizer(str(tmp_path / "plain" / "checkpoint")).token_to_id(META_TOKEN) is None


def test_reproduce_curves_take_steps_without_gradient_norms(tmp_path):
    """reproduce.py draws Figure 5 from logs whose steps may carry null grad norms (no learning
    signal, or --no-term-grad-norms): the figure is written, nothing raises."""
    pytest.importorskip("matplotlib")
    import reproduce
    for name, norms in (("ngc", [0.5, None, 0.7]), ("token-only", [None, None, None])):
        (tmp_path / "runs" / name).mkdir(parents=True)
        with open(tmp_path / "runs" / name / "log.jsonl", "w") as f:
            for step, g in enumerate(norms):
                f.write(json.dumps({**dict.fromkeys(rundir.STEP_KEYS), "step": step, "reward": 0.5,
                                    "grad_norm_token": g, "grad_norm_mem": g}) + "\n")
    for seed in (1,):  # a second seed of ngc, with other norms: the figure shows means over seeds
        (tmp_path / "runs" / f"ngc-seed{seed}").mkdir(parents=True)
        (tmp_path / "runs" / f"ngc-seed{seed}" / "log.jsonl").write_text("".join(
            json.dumps({**dict.fromkeys(rundir.STEP_KEYS), "step": step, "reward": 0.1, "grad_norm_token": 1.0,
                        "grad_norm_mem": None}) + "\n" for step in range(3)))
    reproduce.curves(str(tmp_path), ["ngc", "token-only"], 1, str(tmp_path / "ablations.png"))
    assert (tmp_path / "ablations.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(FileNotFoundError):  # token-only has no second seed
        reproduce.curves(str(tmp_path), ["ngc", "token-only"], 2, str(tmp_path / "ablations.png"))
    reproduce.curves(str(tmp_path), ["ngc"], 2, str(tmp_path / "ablations-2.png"))
    assert (tmp_path / "ablations-2.png").read_bytes()[:4] == b"\x89PNG"


def test_reproduce_tables_give_the_spread_across_seeds_and_the_binomial_error():
    """over_seeds: one row per (run, policy, ε) with the mean over seeds, the standard deviation
    across seeds, and the mean binomial standard error sqrt(p(1-p)/n), n = problems x samples."""
    import reproduce
    row = dict(policy="ngc", length=100.0, rounds=4.0, kv_reduction=2.0, problems=200)
    rows = [dict(row, run="ngc", eviction_rate=0.5, seed=0, accuracy=0.3, samples=2),
            dict(row, run="ngc", eviction_rate=0.5, seed=1, accuracy=0.5, samples=2, kv_reduction=3.0),
            dict(row, run="ngc", eviction_rate=0.7, seed=0, accuracy=0.1, samples=1)]
    two, one = reproduce.over_seeds(rows)
    assert (two["eviction_rate"], two["seeds"], one["seeds"]) == (0.5, 2, 1)
    assert abs(two["accuracy"] - 0.4) < 1e-12 and abs(two["kv_reduction"] - 2.5) < 1e-12
    assert abs(two["accuracy_sd"] - (0.02 ** 0.5)) < 1e-12  # sample sd of 0.3, 0.5
    assert abs(two["accuracy_se"] - ((0.21 / 400) ** 0.5 + (0.25 / 400) ** 0.5) / 2) < 1e-12
    assert one["accuracy_sd"] == 0.0 and abs(one["accuracy_se"] - (0.09 / 200) ** 0.5) < 1e-12
    table = reproduce.markdown([two, one])
    assert "| 40.0% ± 14.1 | 2.4 |" in table and "| 10.0% | 2.1 |" in table
    assert [reproduce.run_name("ngc", k) for k in range(3)] == ["ngc", "ngc-seed1", "ngc-seed2"]
    # the plots' error bars: the spread across seeds, else one evaluation's binomial standard error
    assert evaluation.error_bar(two) == two["accuracy_sd"] and evaluation.error_bar(one) == one["accuracy_se"]
    assert evaluation.error_bar(dict(accuracy=0.3, problems=200, samples=2)) == (0.21 / 400) ** 0.5


def test_reproduce_limit_study_tabulates_each_run_s_evaluations_during_training(tmp_path):
    """reproduce.py --limit: one row per run and logged evaluation, the default run first, each
    with its accuracy at ε, the full cache's, its binomial standard error and the reduction."""
    import reproduce
    runs = {"default": tmp_path / "runs" / "ngc", **{n: tmp_path / "limit" / n for n in reproduce.LIMIT}}
    for i, (name, run_dir) in enumerate(runs.items()):
        (run_dir / "checkpoint").mkdir(parents=True)
        (run_dir / "checkpoint" / "ngc.json").write_text(json.dumps({"eval_problems": 100 * (i + 1)}))
        evals = [{"step": s, "eval": {"acc": 0.1 * (i + 1), "acc_full": 0.9 - s / 1000, "kv_reduction": 2.0 + i}}
                 for s in (0, 20 * (i + 1))]
        steps = [dict.fromkeys(rundir.STEP_KEYS, 0.0) | {"step": s} for s in range(2)]
        (run_dir / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps + evals))
    rows = reproduce.limit_rows(str(tmp_path))
    assert [(r["recipe"], r["step"]) for r in rows] == [(n, s) for i, n in enumerate(runs) for s in (0, 20 * (i + 1))]
    p8 = rows[-1]
    assert p8["flags"] == "--prompts 8 --group 16 --eval-every 30" and p8["problems"] == 400
    assert (p8["accuracy"], p8["accuracy_full"], p8["kv_reduction"]) == (0.4, 0.9 - 0.08, 5.0)
    table = reproduce.limit_markdown(rows)
    assert "| p8g16 | `--prompts 8 --group 16 --eval-every 30` | 80 | 82.0% | 40.0% | 2.4 | 5.00x |" in table
    assert "| default | `` | 0 | 90.0% | 10.0% | 3.0 | 2.00x |" in table  # sqrt(0.1 * 0.9 / 100) = 3.0 points


def test_the_math_demo_trains_from_tiny_math(tmp_path, capsys):
    """README's CPU demonstration: `train.py --task math --model tiny-math` on the demo set, shrunk
    to one small step and one evaluation, runs with tiny-math/ngc.json's recipe."""
    mt.make_demo(tmp_path / "data", n_train=16, n_test=4)
    model = os.path.join(os.path.dirname(train.__file__), "tiny-math")
    train.main(["--model", model, "--out", str(tmp_path / "run"), "--threads", "1", "--steps", "1", "--prompts", "2",
                "--group", "2", "--data", str(tmp_path / "data" / "train.jsonl"),
                "--eval-data", str(tmp_path / "data" / "test.jsonl"), "--eval-every", "1"])
    out = capsys.readouterr().out
    assert "NGC on math" in out and "δ=32" in out and "ε = 0.5 (greedy top-K)" in out
    assert tasks.run_defaults(str(tmp_path / "run" / "checkpoint"))["task"] == "math"
