"""Tests for NGC. Run: pytest test_ngc.py

Every model here is a tiny random Qwen2 written to disk in the Hugging Face layout
(config.json, model.safetensors, tokenizer.json) and loaded back through from_pretrained,
the same path as the real checkpoint. Everything runs on the CPU in fp32.
"""
import itertools
import json
import math
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models, pre_tokenizers

from gumbel import block_means, gumbel_topk, keep_count, kept_keys, ordered_topk, plackett_luce_log_prob
from model import CheckpointError, KVCache, Qwen2, Qwen2Config, from_pretrained, init_weights, load_tokenizer, save_pretrained
from ngc import Eviction, Sampling, rollout
from replay import replay

EOS = 1
TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, eos_token_id=EOS)  # GQA: 2 query heads per KV head


def write_checkpoint(path, seed=0, std=0.1, **overrides):
    """A random Qwen2 saved as config.json + model.safetensors + tokenizer.json."""
    cfg = Qwen2Config(**{**TINY, **overrides})
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
    return [torch.randint(2, TINY["vocab_size"], (n,), generator=g).tolist() for n in lengths]


# ---------------------------------------------------------------------------------------
# 1. Replay = rollout


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
    tok_lp, ev_lp = replay(model, sampled, EV, temperature=1.0)
    completion = torch.arange(sampled.tokens.shape[1]) >= sampled.prompt_lens[:, None]
    completion &= torch.arange(sampled.tokens.shape[1]) < sampled.lengths[:, None]
    tok_diff = (tok_lp - sampled.logprobs)[completion].abs().max().item()
    ev_diff = (ev_lp - sampled.evict_logprobs).abs().max().item()
    print(f"max |replay - rollout|: tokens {tok_diff:.2e}, evictions {ev_diff:.2e}")
    assert tok_diff < 1e-5
    assert ev_diff < 1e-4
    # Negative control: the plain causal mask sees evicted entries, so it must not match.
    causal_lp, _ = replay(model, sampled, EV, temperature=1.0, causal=True)
    causal_diff = (causal_lp - sampled.logprobs)[completion].abs().max().item()
    print(f"max |causal - rollout|: {causal_diff:.2e}")
    assert causal_diff > 1e-2


def test_replay_without_eviction_is_causal(model):
    ro = rollout(model, prompts_of([4, 9]), Sampling(max_new_tokens=20, temperature=1.0, top_k=5), None,
                 generator=torch.Generator().manual_seed(0))
    tok_lp, ev_lp = replay(model, ro, None, temperature=1.0)
    assert ev_lp is None and ro.kept.shape[1] == 0
    completion = tok_lp != 0
    assert completion.sum() == (ro.lengths - ro.prompt_lens).sum()
    assert (tok_lp - ro.logprobs).abs().max() < 1e-5


# ---------------------------------------------------------------------------------------
# 2. Gradients reach θ through evictions


def test_eviction_loss_reaches_every_q_and_k_projection(ckpt, sampled):
    model = from_pretrained(ckpt)
    _, ev_lp = replay(model, sampled, EV, temperature=1.0)
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
# 3. Batch independence


def test_a_sequence_does_not_depend_on_its_batch(model):
    ev = Eviction(delta=10, block=2, window=3, rate=0.5, policy="ngc-greedy")
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
        lp_alone, _ = replay(model, alone, ev, temperature=1.0)
        lp_batch, _ = replay(model, batch, ev, temperature=1.0)
        n = int(alone.lengths[0])
        assert (lp_alone[0, :n] - lp_batch[i, :n]).abs().max() < 1e-5
    # Negative control: the same prompt under a different eviction rate decides differently.
    other = rollout(model, [prompts[2]], s, Eviction(delta=10, block=2, window=3, rate=0.8, policy="ngc-greedy"),
                    eos_ids=[EOS])
    assert other.kept.shape[3] != batch.kept.shape[3] or not torch.equal(other.kept[0], batch.kept[2])


# ---------------------------------------------------------------------------------------
# 4. Gumbel-top-k is the distribution it claims


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
# 5. The model is Qwen2


def test_cached_decode_equals_full_forward(model):
    x = torch.tensor(prompts_of([20])[0])[None]
    pos = torch.arange(20)[None]
    full = model.logits(model(x, pos))
    cache = KVCache(model.config, 1, torch.float32, "cpu", chunk=4)
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
    assert Qwen2Config.from_dict(new).rope_theta == 1234.0
    assert Qwen2Config.from_dict({**d, "rope_theta": 99.0}).rope_theta == 99.0
    with pytest.raises(CheckpointError, match="rope_scaling"):
        Qwen2Config.from_dict({**d, "rope_scaling": {"type": "yarn", "factor": 4}})
    with pytest.raises(CheckpointError, match="sliding"):
        Qwen2Config.from_dict({**d, "use_sliding_window": True, "sliding_window": 64})
    assert Qwen2Config.from_dict({**d, "use_sliding_window": False, "sliding_window": 64}).hidden_size == 64


# ---------------------------------------------------------------------------------------
# 6. Memory bound


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


# ---------------------------------------------------------------------------------------
# 7. Bad arguments


@pytest.mark.parametrize("kwargs, message", [
    (dict(rate=0.0), "must lie in"), (dict(rate=1.5), "must lie in"), (dict(block=0), "block size"),
    (dict(window=0), "window"), (dict(delta=4, window=4), "larger than the window"),
    (dict(delta=8, block=16, window=2), "at least the block size"), (dict(policy="lru"), "unknown eviction policy"),
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
    tok_lp, ev_lp = replay(model, ro, EV, temperature=1.0)
    completion = ro.logprobs != 0
    assert torch.isfinite(tok_lp).all() and torch.isfinite(ev_lp).all()
    assert (tok_lp - ro.logprobs)[completion].abs().max() < 0.2
