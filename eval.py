"""Held-out evaluation of a checkpoint on Countdown, with and without eviction.

    python eval.py --model DIR --eviction-rate 0.5

Accuracy is pass@1 with greedy tokens; eviction uses greedy top-K ("ngc-greedy", the
paper's evaluation). The peak-KV reduction is the paper's §5.1 metric: per problem, the
peak KV entries of the same model without eviction divided by the peak with eviction,
averaged over problems.
"""
import argparse
import json
import sys

import torch
from tqdm import tqdm

import countdown
from model import CheckpointError, from_pretrained, load_tokenizer
from ngc import Eviction, Sampling, rollout
from train import run_defaults


def solve_batch(model, tokenizer, style, problems, sampling, eviction, rates=None, generator=None,
                batch_size=64, desc=None):
    """Roll out one completion per problem; returns rewards, completion lengths, rounds and peak KV."""
    out = {"reward": [], "length": [], "rounds": [], "peak_kv": []}
    bar = tqdm(range(0, len(problems), batch_size), desc=desc, leave=False, disable=desc is None)
    for start in bar:
        chunk = problems[start:start + batch_size]
        chunk_rates = None if rates is None else rates[start:start + batch_size]
        prompts = [countdown.encode(tokenizer, p, style, None if chunk_rates is None else float(r))
                   for p, r in zip(chunk, chunk_rates if chunk_rates is not None else [None] * len(chunk))]
        ro = rollout(model, prompts, sampling, eviction, rates=chunk_rates, eos_ids=model.config.eos_ids,
                     generator=generator)
        texts = tokenizer.decode_batch(ro.completions(), skip_special_tokens=True)
        out["reward"] += [countdown.reward(t, p) for t, p in zip(texts, chunk)]
        out["length"] += (ro.lengths - ro.prompt_lens).tolist()
        out["rounds"] += ro.n_rounds.tolist()
        out["peak_kv"] += ro.peak_kv.tolist()
    return {k: torch.tensor(v, dtype=torch.float32) for k, v in out.items()}


def evaluate(model, tokenizer, style, problems, eviction: Eviction, max_new_tokens, batch_size=64,
             interoception=False, progress=False):
    """Greedy accuracy with the full cache and under `eviction`, and the peak-KV reduction."""
    s = Sampling(max_new_tokens=max_new_tokens, greedy=True)
    greedy = Eviction(eviction.delta, eviction.block, eviction.window, eviction.rate, "ngc-greedy")
    rates = torch.full((len(problems),), eviction.rate) if interoception else None
    full = solve_batch(model, tokenizer, style, problems, s, None, batch_size=batch_size,
                       desc="eval full cache" if progress else None)
    ev = solve_batch(model, tokenizer, style, problems, s, greedy, rates, batch_size=batch_size,
                     desc=f"eval ε={eviction.rate:g}" if progress else None)
    return {"acc_full": full["reward"].mean().item(), "acc": ev["reward"].mean().item(),
            "kv_reduction": (full["peak_kv"] / ev["peak_kv"]).mean().item(),
            "length": ev["length"].mean().item(), "rounds": ev["rounds"].mean().item()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="Qwen2 checkpoint directory")
    p.add_argument("--task", default="countdown", choices=["countdown"])
    p.add_argument("--eviction-rate", type=float, default=0.5, help="ε, the fraction of blocks evicted per round")
    p.add_argument("--problems", type=int, default=None, help="held-out problems to use (default: all)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch-size", type=int, default=64)
    args = p.parse_args(argv)
    try:
        d = run_defaults(args.model)
        model = from_pretrained(args.model, dtype=torch.float32, device=args.device).eval()
        tokenizer = load_tokenizer(args.model)
        ev = Eviction(d["delta"], d["block"], d["window"], args.eviction_rate, "ngc-greedy")
    except (CheckpointError, ValueError) as e:
        sys.exit(f"error: {e}")
    _, test = countdown.splits(d["seed"], n_train=0, n_test=d["eval_problems"],
                               difficulty=countdown.DIFFICULTIES[d["difficulty"]])
    problems = test[: args.problems]
    result = evaluate(model, tokenizer, d["prompt"], problems, ev, d["max_new_tokens"], args.batch_size,
                      interoception=d["interoception"], progress=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
