"""Held-out scoring: rollouts of a problem set and their rewards, the numbers train.py logs and ends
with, scripts/eval.py's per-policy rows (paper §5.1)."""
from dataclasses import replace

import torch
from tqdm import tqdm

import countdown
from ngc import Eviction, Sampling, rollout
from lib import distributed

# the hindsight bound's eviction draws: a generator per (batch, draw) seeded from here
DRAW_SEED = 1_000_003


@torch.no_grad()
def roll_out_and_score(model, tokenizer, problems, sampling, eviction=None, encode=None,
                       reward_fn=countdown.reward, generator=None, samples=1, batch_size=64,
                       desc=None, compile=False, policy=None, draws=None):
    """`samples` completions per problem: rewards, lengths, rounds and peak KV, each (problems,
    samples), and the texts. policy(reference) -> each batch's Eviction, reference() its full-cache
    rollout from the same noise. draws (the hindsight bound): a reward is 1 if any draw solved it
    (`draw_reward`: the mean over draws), the rest are means, the texts draw 0's."""
    encode = encode or countdown.encode
    rank, world = distributed.rank_and_world()
    jobs = [p for p in problems for _ in range(samples)]
    mine = jobs[rank::world]
    results = []  # (reward, draw reward, length, rounds, peak KV, text) per job of this process
    for start in tqdm(range(0, len(mine), batch_size), desc=desc, leave=False,
                      disable=desc is None):
        chunk = mine[start:start + batch_size]
        prompts = [encode(tokenizer, p) for p in chunk]

        # called by policy, before the batch's rollout draws any noise: a copy of it
        def reference():
            noise = (None if generator is None
                     else torch.Generator(generator.device).set_state(generator.get_state()))
            return rollout(model, prompts, sampling, None, eos_ids=model.config.eos_ids,
                           generator=noise)

        ev = eviction if policy is None else policy(reference)
        outs = draw_rollouts(model, prompts, sampling, ev, generator, draws,
                             rank * len(mine) + start, desc, compile)
        texts = tokenizer.decode_batch(outs[0].completions(), skip_special_tokens=True)
        rewards = torch.tensor([[reward_fn(t, p) for t, p in zip(tokenizer.decode_batch(
            ro.completions(), skip_special_tokens=True), chunk)] for ro in outs])  # (draws, batch)
        mean = lambda f: torch.stack([f(ro).double() for ro in outs]).mean(0).tolist()
        results += zip(rewards.amax(0).tolist(), rewards.mean(0).tolist(),
                       mean(lambda ro: ro.lengths - ro.prompt_lens), mean(lambda ro: ro.n_rounds),
                       mean(lambda ro: ro.peak_kv), texts)
    results = distributed.gather_in_order(results, len(jobs))
    columns = list(zip(*results)) or [()] * 6
    out = {k: torch.tensor(v, dtype=torch.float64).view(len(problems), samples)
           for k, v in zip(("reward", "draw_reward", "length", "rounds", "peak_kv"), columns)}
    out["texts"] = [list(columns[5][i * samples:(i + 1) * samples]) for i in range(len(problems))]
    return out


def draw_rollouts(model, prompts, sampling, eviction, generator, draws, first_job: int, desc,
                  compile):
    """`draws` rollouts of a batch from the same token noise, each draw's evictions seeded by (the
    batch's first job, the draw); generator is left where draw 0 left it, so that the next batch's
    token noise does not depend on the draws. draws None: one rollout, its evictions from
    `generator` too."""
    device = model.lm_head.weight.device
    start = None if generator is None or draws is None else generator.get_state()
    outs, after_first = [], None
    for d in [None] if draws is None else range(draws):
        if start is not None:
            generator.set_state(start)
        evictions = (None if d is None
                     else torch.Generator(device).manual_seed(DRAW_SEED + first_job * draws + d))
        outs.append(rollout(model, prompts, sampling, eviction, eos_ids=model.config.eos_ids,
                            generator=generator, progress=desc is not None, compile=compile,
                            eviction_generator=evictions))
        if d == 0 and start is not None:
            after_first = generator.get_state()
    if after_first is not None:
        generator.set_state(after_first)
    return outs


def kv_reduction(ref_peak, peak) -> float:
    """§5.1: the mean over problems of peak(full cache) / peak(policy), each over its samples."""
    return (ref_peak.mean(1) / peak.mean(1)).mean().item()


def standard_error(reward) -> float:
    """1 SE of pass@1 over problems (the paper's error bars); reward: (problems, samples)."""
    per_problem = reward.mean(1)
    return ((per_problem.std(correction=1) / len(per_problem) ** 0.5).item()
            if len(per_problem) > 1 else 0.0)


def evaluate(model, tokenizer, problems, eviction: Eviction, sampling: Sampling, encode=None,
             reward_fn=countdown.reward, batch_size=64, progress=False, meta_token=None,
             compile=False, samples=0, seed=0):
    """train.py's held-out numbers: greedy accuracy and peak-KV reduction with the full cache and
    under `eviction` (greedy top-K); with `samples`, pass@1 ± 1 SE at `sampling` and the peak-KV
    reduction of those completions (§5.1 measures both on the same ones)."""
    greedy = replace(eviction, greedy=True)

    def score(s, ev, k, what):
        gen = None if s.greedy else torch.Generator(model.lm_head.weight.device).manual_seed(seed)
        return roll_out_and_score(model, tokenizer, problems, replace(s, meta_token=meta_token), ev,
                                  encode, reward_fn, gen, k, batch_size,
                                  desc=f"eval {what}" if progress else None, compile=compile)

    plain = replace(sampling, greedy=True)
    full, pruned = (score(plain, None, 1, "full cache"),
                    score(plain, greedy, 1, f"ε={eviction.rate:g}"))
    r = {"acc_full": full["reward"].mean().item(), "acc": pruned["reward"].mean().item(),
         "kv_reduction": kv_reduction(full["peak_kv"], pruned["peak_kv"]),
         "length": pruned["length"].mean().item(), "rounds": pruned["rounds"].mean().item()}
    if samples:
        s = replace(sampling, greedy=False)
        full, pruned = (score(s, None, samples, "full cache, sampled"),
                        score(s, greedy, samples, "ε, sampled"))
        r |= {"samples": samples, "pass1_full": full["reward"].mean().item(),
              "pass1_full_se": standard_error(full["reward"]),
              "pass1": pruned["reward"].mean().item(), "pass1_se": standard_error(pruned["reward"]),
              "pass1_kv_reduction": kv_reduction(full["peak_kv"], pruned["peak_kv"])}
    return r


def eval_line(step, r, rate) -> str:
    sampled = (f"; pass@1 {r['pass1_full']:.1%} and {r['pass1']:.1%} at "
               f"{r['pass1_kv_reduction']:.2f}x" if "pass1" in r else "")  # evaluate's r
    return (f"eval @ step {step}: accuracy full cache {r['acc_full']:.1%}, at ε={rate:g} "
            f"{r['acc']:.1%} (greedy tokens){sampled}, peak-KV reduction {r['kv_reduction']:.2f}x")


def before_after(evals, rate, seconds, problems=None, split="held-out") -> str:
    """The table train.py ends with: its first and last evaluation, on `problems` of the `split`."""
    first, last = evals[0], evals[-1]
    pm = lambda r, k: f"{r[k]:6.1%} ± {100 * r[k + '_se']:.1f}" if k in r else f"{'':>12s}"
    lines = [f"{f'{split} ({problems} problems)' if problems else split:32s} "
             f"{'before':>12s} {'after':>12s}"]
    if "pass1" in last:
        sampled = f"full cache, pass@1 ({last['samples']} samples)"
        lines += [f"{sampled:32s} {pm(first, 'pass1_full')} {pm(last, 'pass1_full')}",
                  f"{f'ε = {rate:g}, pass@1 (greedy top-K)':32s} {pm(first, 'pass1')} "
                  f"{pm(last, 'pass1')}"]
        if "pass1_kv_reduction" in first:  # of the completions pass@1 scores (a log before: none)
            lines += [f"{'peak-KV reduction, sampled':32s} {first['pass1_kv_reduction']:11.2f}x "
                      f"{last['pass1_kv_reduction']:11.2f}x"]
    lines += [f"{'full cache, greedy tokens':32s} {first['acc_full']:12.1%} "
              f"{last['acc_full']:12.1%}",
              f"{f'ε = {rate:g}, greedy tokens':32s} {first['acc']:12.1%} {last['acc']:12.1%}",
              f"{'peak-KV reduction, greedy tokens':32s} {first['kv_reduction']:11.2f}x "
              f"{last['kv_reduction']:11.2f}x",
              f"{'wall time':32s} {'':>12s} {seconds / 60:9.1f} min"]
    return "\n".join(lines)
