"""The hindsight bound and its luck control (evaluation/baselines.py, evaluation/scoring.py), and the claims' intervals
(scripts/claims.py): what the instruments measure, each with a control that shows it can fail."""
import numpy as np
import pytest
import torch

from evaluation import baselines, scoring
from lib.checkpoint import load_tokenizer
import claims
import ngc
from gumbel import ordered_topk
from ngc import Eviction, Sampling
from conftest import hand_built_cache, prompts_of, rounds

LAYOUT = Eviction(delta=6, block=2, window=3, rate=0.6)
SAMPLING = Sampling(max_new_tokens=16, temperature=1.0, top_k=0)


def policy(name, model):
    """eval.py's construction of --policy `name` for each batch, from that batch's reference rollout."""
    return lambda reference: baselines.build(name, baselines.PolicyInputs(LAYOUT, model, None, "countdown", reference))


def score(model, ckpt, name, reward_fn, draws=None, seed=0):
    """roll_out_and_score over four prompts, two samples each, as eval.py calls it."""
    problems = prompts_of([4, 7, 5, 9])
    return scoring.roll_out_and_score(
        model, load_tokenizer(ckpt), problems, SAMPLING, encode=lambda tokenizer, p: p, reward_fn=reward_fn,
        generator=torch.Generator().manual_seed(seed), samples=2, batch_size=8, policy=policy(name, model),
        draws=draws)


def no_noise(logits, k, generator=None):
    return ordered_topk(logits, k)


def test_one_draw_without_noise_is_the_oracle(model, ckpt, monkeypatch):
    """The bound's draws are Gumbel-top-k over log(the oracle's block means) / τ: without the noise, one draw
    keeps the oracle's blocks in the oracle's order, from the oracle's token noise, so every completion is the
    oracle's. The control: with the noise, the draw keeps other blocks and writes other completions."""
    texts = lambda out: [t for problem in out["texts"] for t in problem]
    reward = lambda text, p: float(len(text) % 3 == 0)
    oracle = score(model, ckpt, "oracle", reward)
    noisy = score(model, ckpt, "bound", reward, draws=1)
    monkeypatch.setattr(ngc, "gumbel_topk", no_noise)
    bound = score(model, ckpt, "bound", reward, draws=1)
    assert texts(bound) == texts(oracle) and torch.equal(bound["reward"], oracle["reward"])
    assert torch.equal(bound["peak_kv"], oracle["peak_kv"]) and torch.equal(bound["draw_reward"], bound["reward"])
    assert texts(noisy) != texts(oracle)


def test_draws_share_their_token_noise_and_differ_in_their_evictions(model):
    """Each draw starts from the batch's token noise and draws its evictions apart: before the first round the
    draws' tokens agree, after it they differ; the generator ends where the first draw left it, so the next
    batch's tokens do not depend on the draws. The control: one generator for both (draws=None, twice in a row)
    gives other tokens from the first one on."""
    prompts = prompts_of([3, 3, 3, 3])  # the first round after 3 new tokens
    luck = baselines.build("luck", baselines.PolicyInputs(LAYOUT, model, None, "countdown"))
    gen = torch.Generator().manual_seed(0)
    outs = scoring.draw_rollouts(model, prompts, SAMPLING, luck, gen, 3, 0, None, False)
    after = gen.get_state()
    first = [ro.tokens[:, 3:6] for ro in outs]  # the tokens before the first round
    assert all(torch.equal(first[0], f) for f in first[1:])
    assert not all(torch.equal(outs[0].kept, ro.kept) for ro in outs[1:])
    again = torch.Generator().manual_seed(0)
    scoring.draw_rollouts(model, prompts, SAMPLING, luck, again, 1, 0, None, False)
    assert torch.equal(after, again.get_state())
    shared = torch.Generator().manual_seed(0)
    one, two = (scoring.draw_rollouts(model, prompts, SAMPLING, luck, shared, None, 0, None, False)[0]
                for _ in range(2))
    assert not torch.equal(one.tokens[:, 3:6], two.tokens[:, 3:6])


def test_a_problem_counts_as_solved_if_any_draw_solves_it(model, ckpt):
    """Of six luck draws, the one completion of draw 3 for the first problem's first sample is made the only
    solution: that problem-sample is solved and every other one is not; its draw_reward is the share of draws
    that wrote it. The control: a rule that counts the last draw (or the first) misses it."""
    tokenizer = load_tokenizer(ckpt)
    luck = baselines.build("luck", baselines.PolicyInputs(LAYOUT, model, None, "countdown"))
    problems = prompts_of([4, 7, 5, 9])
    jobs = [p for p in problems for _ in range(2)]
    outs = scoring.draw_rollouts(model, jobs, SAMPLING, luck, torch.Generator().manual_seed(0), 6, 0, None, False)
    written = [tokenizer.decode_batch(ro.completions(), skip_special_tokens=True) for ro in outs]
    solution = written[3][0]
    assert written[-1][0] != solution and written[0][0] != solution
    out = scoring.roll_out_and_score(model, tokenizer, problems, SAMPLING, luck, lambda tokenizer, p: p,
                                     lambda text, p: float(text == solution and p == problems[0]),
                                     torch.Generator().manual_seed(0), samples=2, batch_size=8, draws=6)
    assert out["reward"].tolist() == [[1.0, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]]
    assert out["draw_reward"][0, 0] == pytest.approx(sum(w[0] == solution for w in written) / 6)


def test_the_bound_samples_in_proportion_to_the_oracles_block_means_to_the_power_one_over_tau():
    """One kept block (K = 1) of a Gumbel-top-k over log s_j / τ is block j with probability s_j^(1/τ) / Σ s^(1/τ)
    (within 4 SE over 3000 rounds), s_j the mean of the score over the block's keys. The control: plain means as
    logits (a baseline's usual pooling) keep the blocks nearly uniformly."""
    c = hand_built_cache(S=8, holes=())  # 4 blocks of 2
    key_score = torch.tensor([[0.9, 0.7, 0.5, 0.3, 0.6, 0.6, 0.1, 0.2]])
    means = key_score.view(4, 2).mean(1)
    tau = 0.5
    expected = means ** (1 / tau) / (means ** (1 / tau)).sum()
    torch.manual_seed(0)  # the round draws its Gumbel noise from the global generator here
    bound = dict(greedy=False, score=lambda *a: key_score, log_blocks=True, temperature=tau)
    n = 3000
    counts = torch.bincount(rounds(c, 2, 0.75, bound, n)[0][:, 0], minlength=4)
    se = (expected * (1 - expected) / n).sqrt()
    assert ((counts / n - expected).abs() < 4 * se).all(), (counts / n, expected)
    plain = torch.bincount(rounds(c, 2, 0.75, dict(bound, log_blocks=False), 400)[0][:, 0], minlength=4) / 400
    assert (plain - expected).abs().max() > 0.1


def rows(*per_problem, seeds=1):
    """claims' rows of pass@1 per problem (one sample each), the same at every seed."""
    return [dict(run="r", policy=f"p{i}", accuracy=float(np.mean(v)), rewards=[[[x] for x in v]] * seeds)
            for i, v in enumerate(per_problem)]


def unpaired(stat, *rows, draws=2000):
    """The control: claims.interval with each row's problems resampled apart."""
    arrays = [claims.per_problem(r, 3) for r in rows]
    rng = np.random.default_rng(0)
    s, P = rng.integers(3, size=(draws, 3, 1)), arrays[0].shape[1]
    values = stat(*(a[s, rng.integers(P, size=(draws, 1, P))].mean((1, 2)) for a in arrays))
    return tuple(np.percentile(values, [2.5, 97.5]))


def test_the_interval_is_paired_over_problems_and_seeds():
    """A share of a row over itself is exactly 1 and a difference exactly 0 in every bootstrap draw: the draws
    pair the rows problem by problem and seed by seed. A row that solves the same problems plus one more is
    never below it. The control: resampling each row's problems apart (unpaired) spreads both."""
    rng = np.random.default_rng(1)
    hard = (rng.random(60) < 0.4).astype(float)
    easier = hard.copy()
    easier[np.flatnonzero(hard == 0)[0]] = 1.0
    a, b = rows(hard, easier, seeds=3)
    assert claims.interval(lambda x, y: x / y, a, a) == (1.0, 1.0)
    assert claims.interval(lambda x, y: x - y, a, a) == (0.0, 0.0)
    lo, hi = claims.interval(lambda x, y: x - y, b, a)
    assert 0 <= lo and 0 < hi <= 5 / 60
    assert claims.share(a, a) == "100% [100%, 100%]" and claims.points(b, a).startswith("+1.7 points [+")
    assert unpaired(lambda x, y: x - y, a, a)[0] < -0.05 and unpaired(lambda x, y: x / y, a, a)[1] > 1.1
    assert unpaired(lambda x, y: x - y, b, a)[0] < -0.05


def test_an_untrained_row_of_one_seed_stands_for_every_seed_and_other_problems_are_refused():
    """The untrained model is scored once: its row of one seed is paired with each seed of a trained one. Rows on
    other problems (another count) cannot be paired."""
    one, three = rows([1, 0, 1, 0])[0], rows([1, 1, 1, 0], seeds=3)[0]
    assert claims.interval(lambda x, y: x - y, three, one)[0] >= 0
    with pytest.raises(ValueError, match="different problems"):
        claims.interval(lambda x, y: x - y, three, rows([1, 0, 1])[0])
