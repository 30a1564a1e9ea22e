"""Train NGC: Dr. GRPO over tokens and evictions (paper §4.4–4.6, Appendix A.1), on Countdown or math.

    python train.py --task countdown                           # the shipped tiny model, on the CPU
    python train.py --task countdown --model DIR --out runs/r1 # a Hugging Face Qwen2 directory
    python train.py --task math --model DIR --data dapo.jsonl --eval-data aime25.jsonl
    python train.py --resume runs/r1                           # continue a run where it stopped
    torchrun --nproc_per_node 8 train.py ...                   # data parallel over 8 GPUs

One step: P prompts x G rollouts through the NGC engine (a round every δ tokens at the
curriculum's ε), binary reward, advantage A = r - mean(group), then the replay pass in
micro-batches, L = L_token + L_mem (eqs. 3-5), one backward, grad-norm clipping, AdamW at a
constant LR. Defaults are the paper's recipe for the task; a checkpoint directory may carry an
ngc.json whose values replace them (the tiny model's does), and any flag replaces both.

A run directory holds log.jsonl and checkpoint/ (a Hugging Face model directory plus
trainer.pt). SIGINT (Ctrl-C) and SIGTERM save a checkpoint and exit with 130 / 143;
--resume continues with exactly the steps an uninterrupted run would have taken.
"""
import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from tqdm import tqdm

import countdown
import mathtask
from model import (META_TOKEN, CheckpointError, add_meta_token, from_pretrained, load_tokenizer, save_pretrained,
                   save_tokenizer)
from ngc import Eviction, Sampling, rollout
from replay import replay

HERE = os.path.dirname(os.path.abspath(__file__))


@dataclass(frozen=True)
class Mode:
    evict: bool  # evict during rollouts
    replay_masks: bool  # token log-probs under the per-layer replay masks (else the plain causal mask)
    eviction_loss: bool  # add L_mem


MODES = {
    "ngc": Mode(evict=True, replay_masks=True, eviction_loss=True),
    "token-only": Mode(evict=True, replay_masks=True, eviction_loss=False),  # ablation: no L_mem
    "targeted-dropout": Mode(evict=True, replay_masks=False, eviction_loss=False),  # ablation: causal log-probs
    "no-evict": Mode(evict=False, replay_masks=False, eviction_loss=False),  # the full-cache upper bound
}
COUNTDOWN = dict(  # the paper's Countdown settings (§5.2, Table 1), for large models
    task="countdown", prompt="plain", difficulty="paper", train_problems=327_680, eval_problems=1024,
    data=None, eval_data=None, question_field=None, answer_field=None, seed=0,
    steps=250, prompts=32, group=16, max_new_tokens=1024, temperature=0.9, top_k=50, top_p=1.0,
    mode="ngc", delta=256, block=32, window=5,
    retention="0.9,0.8,0.7,0.6,0.5", stage_steps=25, alpha=0.6, eviction_rate=None,
    interoception=False, interoception_rates="0.25,0.5,0.75", blind_tag=False, min_length=0, meta_token=False,
    lr=5e-6, beta1=0.9, beta2=0.95, adam_eps=1e-15, weight_decay=0.0, clip=1.0,
    micro_batch=4, term_grad_norms=False, eval_every=50, eval_rate=None, eval_batch=64, save_every=50,
    eval_samples=None, eval_temperature=None, eval_top_p=None, eval_max_new_tokens=None,
)
MATH = dict(  # DAPO-17k (§5.4, Appendix A.1 "DAPO-17k training hyperparameters")
    COUNTDOWN, task="math", prompt=None, difficulty=None, train_problems=None, eval_problems=None,
    steps=469, prompts=256, group=8, max_new_tokens=1050, temperature=1.0, top_k=0, delta=350,
    min_length=350,  # Appendix A.1: reward 0 for a rollout that ends before the first round (δ)
    beta2=0.999, adam_eps=1e-8, eval_samples=32, eval_temperature=0.6, eval_top_p=0.95, eval_max_new_tokens=3850,
)  # The paper does not give the math run's curriculum; it is Countdown's, in stages of 50 steps.
MATH["stage_steps"] = 50
RECIPES = {"countdown": COUNTDOWN, "math": MATH}
TASK_REWARD = {"countdown": countdown.reward, "math": mathtask.reward}


def run_defaults(model_dir: str, task: str | None = None) -> dict:
    """The paper's recipe for the task, replaced by the checkpoint's ngc.json where it has one.
    The task is `task`, else the one ngc.json names, else Countdown."""
    path = os.path.join(model_dir, "ngc.json")
    extra = {}
    if os.path.exists(path):
        try:
            with open(path) as f:
                extra = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path} is not valid JSON ({e}); fix or delete it")
        unknown = set(extra) - set(COUNTDOWN) if isinstance(extra, dict) else {"<not an object>"}
        if unknown:
            raise CheckpointError(f"{path} has unknown keys {sorted(unknown)}; the known ones are train.py's flags")
    task = task or extra.get("task") or "countdown"
    return {**RECIPES[task], **extra, "task": task}


def load_problems(c):
    """(training, held-out) problems of the run's task: Countdown's are generated from the seed,
    math problems are read from --data and --eval-data."""
    if c.task == "countdown":
        difficulty = countdown.DIFFICULTIES[c.difficulty]
        return countdown.splits(c.seed, c.train_problems, c.eval_problems, difficulty, unique=False)
    train = mathtask.load(c.data, c.question_field, c.answer_field)[: c.train_problems] if c.data else []
    test = mathtask.load(c.eval_data, c.question_field, c.answer_field) if c.eval_data else []
    return train, test[: c.eval_problems]


def prompt_encoder(c, eviction_rate=None):
    """encode(tokenizer, problem) -> prompt ids for the run's task (Countdown: with the budget tag
    when eviction_rate is given, the rate hidden under --blind-tag)."""
    if c.task == "math":
        return mathtask.encode
    return lambda tokenizer, problem: countdown.encode(tokenizer, problem, c.prompt, eviction_rate, c.blind_tag)


# ---------------------------------------------------------------------------------------
# Eviction-rate curriculum (paper §4.6)


def retention_at(step: int, stages: list[float], stage_steps: int, alpha: float) -> float:
    """Staircase over retention p0 = 1 - ε (eq. 6): hold ρ_ℓ for the first (1 - α) of stage ℓ,
    then blend linearly to ρ_{ℓ+1}; the last stage holds ρ_K."""
    last = len(stages) - 1
    stage = min(step // stage_steps, last)
    if stage == last:
        return stages[last]
    s = (step % stage_steps) / stage_steps
    if s < 1 - alpha:
        return stages[stage]
    return stages[stage] + (s - (1 - alpha)) / alpha * (stages[stage + 1] - stages[stage])


def eviction_rate_at(step: int, c) -> float:
    """ε at a step: the fixed --eviction-rate, or 1 - the curriculum's retention."""
    if c.eviction_rate is not None:
        return c.eviction_rate
    return 1 - retention_at(step, c.retention, c.stage_steps, c.alpha)


# ---------------------------------------------------------------------------------------
# The objective (paper eqs. 3-5, Dr. GRPO)


def group_advantages(reward, group: int):
    """A_i = r_i - mean of its group's rewards (Dr. GRPO: no division by the std). reward (P·G,)."""
    r = reward.view(-1, group)
    return (r - r.mean(1, keepdim=True)).flatten()


def policy_losses(model, ro, adv, c, n_total):
    """L_token and L_mem (None when the mode has none) of rollouts ro with advantages adv (B,).

    Both are normalised by the whole step's rollout count n_total (and L_token by the max
    completion length: Dr. GRPO's constant), so micro-batch losses add up to the step's loss."""
    mode = MODES[c.mode]
    tok_lp, ev_lp = replay(model, ro, causal=not mode.replay_masks)
    l_token = -(tok_lp.sum(1) * adv).sum() / (n_total * c.max_new_tokens)  # eq. (3)
    l_mem = None
    if mode.eviction_loss and ev_lp is not None:
        per_layer = ev_lp.sum(1) / ro.n_rounds.clamp(min=1)[:, None]  # (B, L): mean over each rollout's rounds
        l_mem = -(adv[:, None] * per_layer).sum() / n_total  # eq. (4), summed over layers
    return l_token, l_mem, tok_lp


class TokenGradient:
    """Optional diagnostic (the paper's Figure 5): ‖∇L_token‖ and ‖∇L_mem‖ apart. One extra
    backward per micro-batch accumulates ∇L_token into a buffer; ∇L_mem is the total minus it."""

    def __init__(self, params):
        self.params, self.acc = params, [torch.zeros_like(p) for p in params]

    def add(self, l_token):
        grads = torch.autograd.grad(l_token, self.params, retain_graph=True, allow_unused=True)
        for a, g in zip(self.acc, grads):
            if g is not None:
                a += g

    def norms(self, has_mem: bool) -> dict:
        norm = lambda gs: torch.linalg.vector_norm(torch.stack([g.norm() for g in gs])).item()
        total = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        return {"grad_norm_token": norm(self.acc),
                "grad_norm_mem": norm([t - a for t, a in zip(total, self.acc)]) if has_mem else None}


def step_generator(seed: int, rank: int, step: int, device) -> torch.Generator:
    """The noise of one step on one rank (tokens, Gumbel draws, interoception rates), derived from
    (seed, rank, step) alone: a resumed run draws exactly what an uninterrupted one would have."""
    return torch.Generator(device=device).manual_seed(int(np.random.SeedSequence([seed, rank, step]).generate_state(1)[0]))


def train_step(model, tokenizer, problems, step, c, amp, reward_fn, progress=False):
    """rollout → reward → advantage → replay → L_token + L_mem → backward → clip. Returns the
    step's log record; the caller takes the optimizer step (so that an update and its record
    land together, see main). With several processes each rolls out its share of the P prompts,
    whole groups each, and the gradients are averaged across them."""
    t0 = time.perf_counter()
    device = model.lm_head.weight.device
    rank, world = rank_and_world()
    P, G, mode = c.prompts // world, c.group, MODES[c.mode]  # this process's prompts
    gen = step_generator(c.seed, rank, step, device)
    eps = eviction_rate_at(step, c)
    ev = Eviction(c.delta, c.block, c.window, eps) if mode.evict else None
    group_eps = None
    if c.interoception:  # one ε per group, written into its prompts (paper §5.3, Figure 6)
        final = c.eviction_rate if c.eviction_rate is not None else 1 - c.retention[-1]
        choices = torch.tensor(c.interoception_rates) * eps / final
        group_eps = choices[torch.randint(len(choices), (P,), generator=gen, device=gen.device).cpu()].clamp(0.01, 1)
    rates = None if group_eps is None else group_eps.repeat_interleave(G)
    batch = [problems[(step * c.prompts + rank * P + i) % len(problems)] for i in range(P)]
    prompts = [prompt_encoder(c, None if group_eps is None else float(group_eps[i]))(tokenizer, p)
               for i, p in enumerate(batch) for _ in range(G)]
    meta = tokenizer.token_to_id(META_TOKEN) if c.meta_token else None
    sampling = Sampling(c.max_new_tokens, c.temperature, c.top_k, top_p=c.top_p, meta_token=meta)
    with amp, whole_model(model):
        ro = rollout(model, prompts, sampling, ev, rates=rates, eos_ids=model.config.eos_ids, generator=gen,
                     progress=progress, compile=c.compile)
    t_rollout = time.perf_counter() - t0
    texts = tokenizer.decode_batch(ro.completions(), skip_special_tokens=True)
    correct = torch.tensor([reward_fn(t, batch[i // G]) for i, t in enumerate(texts)])
    reward = torch.where(ro.lengths.cpu() < c.min_length, 0.0, correct)  # Appendix A.1 penalty
    adv = group_advantages(reward, G).to(device)
    losses = backward(model, ro, adv, c, amp)
    params = [p for p in model.parameters() if p.requires_grad]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, c.clip).item()

    n_new = (ro.lengths - ro.prompt_lens).float()
    means = mean_over_processes(dict(reward=reward.mean(), accuracy=correct.mean(), response_len=n_new.mean(),
                                     rounds=ro.n_rounds.float().mean(), peak_kv=ro.peak_kv.float().mean(),
                                     tokens_per_s=n_new.sum() / t_rollout))
    means["tokens_per_s"] *= world  # all processes together
    return {"step": step, **means, "eps": eps, **losses, "grad_norm": grad_norm,
            "step_time": time.perf_counter() - t0}


def backward(model, ro, adv, c, amp=contextlib.nullcontext()):
    """Replay the rollouts that carry signal (A = 0 contributes nothing) in micro-batches,
    accumulate ∇(L_token + L_mem), and average it over the processes. The losses are normalised
    by this process's rollout count, so the average is the single-process gradient of all of them."""
    params = [p for p in model.parameters() if p.requires_grad]
    diag = TokenGradient(params) if c.term_grad_norms else None
    mem = MODES[c.mode].eviction_loss
    l_token_sum, l_mem_sum = 0.0, 0.0 if mem else None
    learn = torch.nonzero(adv).flatten()
    chunks = [(rows, adv[rows]) for rows in learn.split(c.micro_batch)] if len(learn) else []
    if isinstance(model, FSDPModule):  # each backward is a collective: every process runs as many,
        padding = (learn[:1] if len(learn) else torch.zeros(1, dtype=torch.long, device=adv.device))
        chunks += [(padding, torch.zeros(1, device=adv.device))] * (max_over_processes(len(chunks)) - len(chunks))
    for rows, a in chunks:  # (padding has advantage 0: a zero gradient)
        with amp:
            l_token, l_mem, _ = policy_losses(model, ro.select(rows), a, c, n_total=len(adv))
        if diag:
            diag.add(l_token)
        (l_token if l_mem is None else l_token + l_mem).backward()
        l_token_sum += l_token.item()
        if l_mem is not None:  # None: no rollout of this micro-batch had a round, so L_mem adds 0
            l_mem_sum += l_mem.item()
    average_gradients(params)
    if diag:
        average_gradients(params, diag.acc)
    losses = mean_over_processes({"L_token": l_token_sum, **({"L_mem": l_mem_sum} if mem else {})})
    norms = diag.norms(mem) if diag else {"grad_norm_token": None, "grad_norm_mem": None}
    return {"L_token": losses["L_token"], "L_mem": losses.get("L_mem"), **norms}


# ---------------------------------------------------------------------------------------
# Several processes (torchrun): data parallel, every process holds the whole model


def rank_and_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def average_gradients(params, grads=None):
    """Average the gradients (p.grad, or the given tensors) over the processes, in place. When no
    process has any (no learning signal anywhere), they stay None, as in a single process."""
    world = rank_and_world()[1]
    grads = grads or [p.grad for p in params]
    if world == 1 or isinstance(params[0], DTensor):  # one process, or FSDP averaged them already
        return
    if mean_over_processes({"any": any(g is not None for g in grads)})["any"] == 0:
        return
    for p, g in zip(params, grads):
        if g is None:  # this process had no learning signal: it adds zeros
            g = p.grad = torch.zeros_like(p)
        dist.all_reduce(g)
        g.div_(world)


def comm_device():
    """Where collectives run: NCCL needs the tensors on the GPU."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def max_over_processes(n: int) -> int:
    if rank_and_world()[1] == 1:
        return n
    t = torch.tensor([n], device=comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t)


def mean_over_processes(values: dict) -> dict:
    """Each value averaged over the processes (every process holds the same number of rollouts)."""
    world = rank_and_world()[1]
    t = torch.tensor([float(v) for v in values.values()], dtype=torch.float64)
    if world > 1:
        t = t.to(comm_device())
        dist.all_reduce(t)
    return dict(zip(values, (t / world).tolist()))


def shard(model):
    """--fsdp: every decoder layer, and the rest of the model, sharded across the processes (FSDP2).
    Gradients are then averaged by FSDP's reduce-scatter, and each process keeps its shard of the
    optimizer state."""
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)


@contextlib.contextmanager
def whole_model(model):
    """Rollouts under FSDP: gather every layer once and keep it through the decode loop (whose
    number of forwards differs from process to process), then shard again."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for u in units:
        u.unshard()
        u.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for u in units:  # back to FSDP's defaults: the root stays gathered after its forward
            u.reshard()
            u.set_reshard_after_forward(u is not model, recurse=False)


def full_state(model, opt):
    """The whole model's and optimizer's state dicts (under FSDP every process must call this)."""
    if not isinstance(model, FSDPModule):
        return model.state_dict(), opt.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options), get_optimizer_state_dict(model, opt, options=options)


def load_optimizer_state(model, opt, state):
    if not isinstance(model, FSDPModule):
        return opt.load_state_dict(state)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
    set_optimizer_state_dict(model, opt, state, options=StateDictOptions(full_state_dict=True))


# ---------------------------------------------------------------------------------------
# Held-out evaluation (paper §5.1): eval.py, make_tiny.py and reproduce.py call these too


@torch.no_grad()
def solve(model, tokenizer, problems, sampling, eviction=None, encode=None, reward_fn=countdown.reward,
          generator=None, samples=1, batch_size=64, desc=None, compile=False):
    """Roll out `samples` completions per problem. Returns rewards, completion lengths, rounds and
    peak KV entries, each (problems, samples), and the completions' texts (problems x samples).
    encode(tokenizer, problem) gives a prompt's ids (default: countdown's plain prompt). With
    several processes each rolls out every world-th job and all of them get all the results."""
    encode = encode or countdown.encode
    rank, world = rank_and_world()
    jobs = [p for p in problems for _ in range(samples)]
    mine = jobs[rank::world]
    results = []  # (reward, length, rounds, peak KV, text) per job of this process
    for start in tqdm(range(0, len(mine), batch_size), desc=desc, leave=False, disable=desc is None):
        chunk = mine[start:start + batch_size]
        ro = rollout(model, [encode(tokenizer, p) for p in chunk], sampling, eviction, eos_ids=model.config.eos_ids,
                     generator=generator, progress=desc is not None, compile=compile)
        texts = tokenizer.decode_batch(ro.completions(), skip_special_tokens=True)
        results += zip([reward_fn(t, p) for t, p in zip(texts, chunk)], (ro.lengths - ro.prompt_lens).tolist(),
                       ro.n_rounds.tolist(), ro.peak_kv.tolist(), texts)
    if world > 1:
        parts = [None] * world
        dist.all_gather_object(parts, results)
        results = [parts[i % world][i // world] for i in range(len(jobs))]  # back in job order
    columns = list(zip(*results)) or [()] * 5
    out = {k: torch.tensor(v, dtype=torch.float64).view(len(problems), samples)
           for k, v in zip(("reward", "length", "rounds", "peak_kv"), columns)}
    out["texts"] = [list(columns[4][i * samples:(i + 1) * samples]) for i in range(len(problems))]
    return out


def kv_reduction(ref_peak, peak) -> float:
    """§5.1: mean over problems of peak(no eviction) / peak(policy); rows are problems, columns
    samples (a problem's peak is the mean over its samples)."""
    return (ref_peak.mean(1) / peak.mean(1)).mean().item()


def evaluate(model, tokenizer, problems, eviction: Eviction, max_new_tokens, encode=None, reward_fn=countdown.reward,
             batch_size=64, progress=False, meta_token=None, compile=False):
    """Greedy accuracy with the full cache and under `eviction` (NGC with greedy top-K), and the
    peak-KV reduction: the held-out numbers train.py logs every --eval-every steps. meta_token:
    g's id, forced before each round under `eviction` (the full cache has no rounds)."""
    s = Sampling(max_new_tokens=max_new_tokens, greedy=True, meta_token=meta_token)
    greedy = replace(eviction, greedy=True)
    full = solve(model, tokenizer, problems, s, None, encode, reward_fn, batch_size=batch_size,
                 desc="eval full cache" if progress else None, compile=compile)
    ev = solve(model, tokenizer, problems, s, greedy, encode, reward_fn, batch_size=batch_size,
               desc=f"eval ε={eviction.rate:g}" if progress else None, compile=compile)
    return {"acc_full": full["reward"].mean().item(), "acc": ev["reward"].mean().item(),
            "kv_reduction": kv_reduction(full["peak_kv"], ev["peak_kv"]),
            "length": ev["length"].mean().item(), "rounds": ev["rounds"].mean().item()}


# ---------------------------------------------------------------------------------------
# Checkpoints: a Hugging Face model directory plus trainer.pt, swapped in so that a complete
# copy exists at every instant:  write checkpoint.tmp/ → rename checkpoint/ to checkpoint.old/
# → rename checkpoint.tmp/ to checkpoint/ → delete checkpoint.old/.


def recover_checkpoint(run_dir):
    """Finish or undo a swap that a crash interrupted, leaving checkpoint/ and nothing else."""
    final, tmp, old = (os.path.join(run_dir, name) for name in ("checkpoint", "checkpoint.tmp", "checkpoint.old"))
    if not os.path.exists(final) and os.path.exists(old):  # killed between the two renames:
        os.replace(tmp if os.path.exists(tmp) else old, final)  # checkpoint.tmp/ is complete and newer
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(old, ignore_errors=True)


def save_checkpoint(run_dir, model, tokenizer, source_dir, opt, step, c):
    """Every process calls this (FSDP gathers the shards); the first one writes."""
    model_state, opt_state = full_state(model, opt)
    if rank_and_world()[0] != 0:
        return
    final, tmp, old = (os.path.join(run_dir, name) for name in ("checkpoint", "checkpoint.tmp", "checkpoint.old"))
    recover_checkpoint(run_dir)
    save_pretrained(model, tmp, model_state)
    save_tokenizer(tokenizer, tmp, model.config, source_dir)
    ngc = {k: settings_value(k, getattr(c, k)) for k in COUNTDOWN}
    with open(os.path.join(tmp, "ngc.json"), "w") as f:
        json.dump(ngc, f, indent=1)
    torch.save({"step": step, "optimizer": opt_state, "config": ngc},
               os.path.join(tmp, "trainer.pt"))
    if os.path.exists(final):
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def settings_value(key, value):
    """A setting as ngc.json writes it: comma lists back to text."""
    return ",".join(f"{x:g}" for x in value) if key in LISTS else value


def load_trainer_state(run_dir) -> dict:
    recover_checkpoint(run_dir)
    path = os.path.join(run_dir, "checkpoint", "trainer.pt")
    if not os.path.exists(path):
        raise CheckpointError(f"nothing to resume in {run_dir!r}: it has no checkpoint/trainer.pt")
    try:
        state = torch.load(path, weights_only=False)
        return {k: state[k] for k in ("step", "optimizer", "config")}
    except Exception as e:  # a truncated or foreign file
        raise CheckpointError(f"{path} is unreadable ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                              f"it is not a trainer state this code wrote")


def make_optimizer(model, c):
    return torch.optim.AdamW(model.parameters(), lr=c.lr, betas=(c.beta1, c.beta2), eps=c.adam_eps,
                             weight_decay=c.weight_decay)


# ---------------------------------------------------------------------------------------
# The log: one JSON object per line, every step record with the same keys


STEP_KEYS = ["step", "reward", "accuracy", "eps", "response_len", "rounds", "L_token", "L_mem", "grad_norm",
             "grad_norm_token", "grad_norm_mem", "peak_kv", "step_time", "tokens_per_s"]


def json_safe(value):
    """NaN and ±inf are not JSON: they are written as null."""
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    return None if isinstance(value, float) and not math.isfinite(value) else value


def write_log(path, record):
    with open(path, "a") as f:
        f.write(json.dumps(json_safe(record), allow_nan=False) + "\n")


def read_log(path) -> list[dict]:
    """The records of log.jsonl; a last line cut short by a crash is dropped, any other bad line is an error."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        lines = f.read().splitlines()
    records = []
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                print(f"note: dropping the unfinished last line of {path}")
                break
            raise CheckpointError(f"{path} line {i + 1} is not JSON; repair or remove that line")
    return records


def keep_log_before(path, step):
    """On resume, keep the log records of the steps before `step` (later ones will run again)."""
    records = [r for r in read_log(path) if r["step"] < step]
    with open(path + ".tmp", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    os.replace(path + ".tmp", path)


def step_line(m, steps) -> str:
    mem = "" if m["L_mem"] is None else f" | L_mem {m['L_mem']:+.4f}"
    return (f"step {m['step'] + 1}/{steps} | reward {m['reward']:.3f} | ε {m['eps']:.2f} | "
            f"len {m['response_len']:.0f} | L_token {m['L_token']:+.5f}{mem} | {m['step_time']:.1f} s")


# ---------------------------------------------------------------------------------------
# SIGINT and SIGTERM: stop at once and save, but never between an update and its record


class Interrupted(Exception):
    def __init__(self, signum):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def raise_interrupted(signum, frame):
    raise Interrupted(signum)


@contextlib.contextmanager
def signals_held():
    """SIGINT/SIGTERM that arrive inside the block are delivered when it ends."""
    if not hasattr(signal, "pthread_sigmask"):  # not on Windows
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


@contextlib.contextmanager
def stop_on_signals():
    previous = {s: signal.signal(s, raise_interrupted) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


# ---------------------------------------------------------------------------------------
# The command


def parse_args(argv=None):
    """Flags; --help shows the defaults a run would use: the paper's, or --model's ngc.json over them."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--model", default=os.path.join(HERE, "tiny"))
    pre.add_argument("--task", choices=list(RECIPES))
    known = pre.parse_known_args(argv)[0]
    try:
        defaults = run_defaults(known.model, known.task)
    except CheckpointError:
        defaults = RECIPES[known.task or "countdown"]  # resolve() reports the broken ngc.json
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.error = lambda message: sys.exit(f"error: {message}")  # one line, no usage dump
    p.add_argument("--task", choices=list(RECIPES), help="countdown (generated problems) or math (DAPO-17k from "
                   "--data, AIME/AMC from --eval-data); default: the checkpoint's ngc.json, else countdown")
    p.add_argument("--model", default=os.path.join(HERE, "tiny"),
                   help="Qwen2 checkpoint directory: config.json, *.safetensors, tokenizer.json (default: tiny/)")
    p.add_argument("--out", default=None, help="run directory for log.jsonl and checkpoint/ (default: runs/<mode>)")
    p.add_argument("--overwrite", action="store_true", help="start afresh in an --out that already holds a run")
    p.add_argument("--resume", default=None, metavar="RUN_DIR", help="continue the run saved in RUN_DIR")
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when present)")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default=None,
                   help="compute dtype; weights and optimizer stay fp32 (default: bf16 on cuda, fp32 on cpu)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    p.add_argument("--compile", action="store_true",
                   help="capture the decode step with torch.compile (CUDA graphs on CUDA): the eager rollouts up to "
                        "float rounding, faster on GPUs and, with eviction, on the CPU")
    p.add_argument("--fsdp", action="store_true",
                   help="under torchrun: shard the model, gradients and optimizer state across the processes (FSDP2) "
                        "instead of a whole copy each")
    g = p.add_argument_group("task and run")
    g.add_argument("--seed", type=int, help="seed of the problems, the rollouts and the evictions")
    g.add_argument("--steps", type=int, help="optimizer steps")
    g.add_argument("--prompt", choices=sorted(countdown.PROMPTS), help="prompt style")
    g.add_argument("--difficulty", choices=sorted(countdown.DIFFICULTIES), help="problem generator preset")
    g.add_argument("--train-problems", type=int, help="training problems (drawn for countdown, the first N of --data)")
    g.add_argument("--data", help="math: training problems, .jsonl or .parquet (DAPO-Math-17k layout)")
    g.add_argument("--eval-data", help="math: held-out problems, .jsonl or .parquet (AIME/AMC layout)")
    g.add_argument("--question-field", help="math: the question's field in --data/--eval-data rows (a.b for nested)")
    g.add_argument("--answer-field", help="math: the answer's field (a.b for nested)")
    g = p.add_argument_group("rollouts")
    g.add_argument("--prompts", type=int, help="P: distinct prompts per step")
    g.add_argument("--group", type=int, help="G: rollouts per prompt")
    g.add_argument("--max-new-tokens", type=int, help="completion length cap")
    g.add_argument("--temperature", type=float, help="sampling temperature (log-probs use it too)")
    g.add_argument("--top-k", type=int, help="0 disables top-k")
    g.add_argument("--top-p", type=float, help="nucleus sampling, 1 disables it")
    g = p.add_argument_group("eviction (paper §4.1-4.3, §4.6)")
    g.add_argument("--mode", choices=list(MODES),
                   help="ngc | token-only (no L_mem) | targeted-dropout (causal log-probs) | no-evict (full cache)")
    g.add_argument("--delta", type=int, help="δ: a round every δ tokens of a sequence")
    g.add_argument("--block", type=int, help="b: block size")
    g.add_argument("--window", type=int, help="w: scoring queries")
    g.add_argument("--retention", help="curriculum stages ρ_0,...,ρ_K (retention = 1 - ε)")
    g.add_argument("--stage-steps", type=int, help="Δ: steps per curriculum stage")
    g.add_argument("--alpha", type=float, help="fraction of a stage spent blending to the next")
    g.add_argument("--eviction-rate", type=float, help="a fixed ε instead of the curriculum")
    g.add_argument("--interoception", action=argparse.BooleanOptionalAction,
                   help="one ε per group, written into its prompts as <eviction_rate>ε%%</eviction_rate>")
    g.add_argument("--interoception-rates", help="the rates groups draw from (scaled by curriculum progress)")
    g.add_argument("--blind-tag", action=argparse.BooleanOptionalAction,
                   help="with --interoception, the control: the same per-group ε, but the tag reads "
                        "<eviction_rate>-%%</eviction_rate> (same length: the prompts and blocks match)")
    g.add_argument("--min-length", type=int, help="reward 0 when prompt+completion is shorter (Appendix A.1)")
    g.add_argument("--meta-token", action=argparse.BooleanOptionalAction,
                   help=f"force the meta-token {META_TOKEN} as the last token before each round (Appendix, "
                        "compression via meta-tokens); a checkpoint that lacks it gets it, embedded as the mean of "
                        "the embeddings of 'tl;dr'")
    g = p.add_argument_group("optimisation")
    g.add_argument("--lr", type=float, help="AdamW learning rate, constant")
    g.add_argument("--beta1", type=float, help="AdamW β1")
    g.add_argument("--beta2", type=float, help="AdamW β2")
    g.add_argument("--adam-eps", type=float, help="AdamW ε")
    g.add_argument("--weight-decay", type=float, help="AdamW weight decay")
    g.add_argument("--clip", type=float, help="grad-norm clipping")
    g.add_argument("--micro-batch", type=int, help="rollouts per replay forward/backward")
    g.add_argument("--term-grad-norms", action=argparse.BooleanOptionalAction,
                   help="log the grad norms of L_token and L_mem apart (one extra backward per micro-batch "
                        "and one extra copy of the gradients)")
    g = p.add_argument_group("evaluation and checkpoints")
    g.add_argument("--eval-every", type=int, help="held-out evaluation every N steps (0: never)")
    g.add_argument("--eval-problems", type=int, help="held-out problems")
    g.add_argument("--eval-rate", type=float, help="ε for evaluation (default: the final training ε)")
    g.add_argument("--eval-batch", type=int, help="rollouts per evaluation batch")
    g.add_argument("--save-every", type=int, help="checkpoint every N steps (0: only at the end)")
    for action in p._actions:
        if defaults.get(action.dest) is not None:
            action.help += f" (default {defaults[action.dest]})".replace("%", "%%")
    return p.parse_args(argv)


LISTS = ("retention", "interoception_rates")  # comma lists, parsed once into lists of floats
AT_LEAST_ONE = ("steps", "prompts", "train_problems", "eval_problems", "max_new_tokens", "stage_steps",
                "micro_batch", "eval_batch")
AT_LEAST_ZERO = ("top_k", "min_length", "eval_every", "save_every", "weight_decay")
POSITIVE = ("temperature", "lr", "adam_eps", "clip")


def resolve(args, state=None):
    """Fill every unset flag from the resumed run's state, the checkpoint's ngc.json or the paper,
    then check them all. Raises CheckpointError or ValueError with a one-line message."""
    if args.resume:
        if args.out and os.path.abspath(args.out) != os.path.abspath(args.resume):
            raise ValueError(f"--resume continues in {args.resume} itself; drop --out {args.out} "
                             f"(or copy the run directory there and resume that)")
        base = (state or load_trainer_state(args.resume))["config"]
        args.model, args.out = os.path.join(args.resume, "checkpoint"), args.resume
    else:
        base = run_defaults(args.model, args.task)
    for k, v in base.items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    for k in LISTS:
        try:
            args.__dict__[k] = [float(x) for x in str(getattr(args, k)).split(",")]
        except ValueError:
            raise ValueError(f"--{k.replace('_', '-')} {getattr(args, k)!r} must be comma-separated numbers")
    for k in AT_LEAST_ONE + AT_LEAST_ZERO + POSITIVE:
        v, least = getattr(args, k), 1 if k in AT_LEAST_ONE else 0
        if v is not None and ((v <= 0) if k in POSITIVE else (v < least)):
            raise ValueError(f"--{k.replace('_', '-')} {v} must be " + ("positive" if k in POSITIVE else f"at least {least}"))
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads {args.threads} must be at least 1")
    if not (0 <= args.beta1 < 1 and 0 <= args.beta2 < 1):
        raise ValueError(f"--beta1 {args.beta1} and --beta2 {args.beta2} must lie in [0, 1)")
    if args.task == "math":
        if not args.data or (args.eval_every and not args.eval_data):
            raise ValueError("--task math reads its problems from files: --data FILE (training) and --eval-data FILE "
                             "(held-out; or --eval-every 0), JSONL or Parquet; see mathtask.py for the datasets")
        if args.interoception or args.blind_tag:
            raise ValueError("--interoception writes the budget into Countdown's prompts; --task math has no such tag")
        for path in (args.data, args.eval_data):
            if path and not os.path.isfile(path):
                raise ValueError(f"no such file: {path}")
    if not 0 < args.top_p <= 1:
        raise ValueError(f"--top-p {args.top_p} must lie in (0, 1]")
    if not 0 < args.alpha <= 1:
        raise ValueError(f"--alpha {args.alpha} must lie in (0, 1]")
    if args.blind_tag and not args.interoception:
        raise ValueError("--blind-tag is the control for --interoception (the same per-group ε, the rate hidden); "
                         "add --interoception")
    if args.prompts < 1 or args.group < 2:
        raise ValueError("--prompts must be at least 1 and --group at least 2 (advantages are within a group)")
    for eps in [eviction_rate_at(s, args) for s in (0, args.steps)] + args.interoception_rates + [args.eval_rate or 0.5]:
        Eviction(args.delta, args.block, args.window, eps)  # one-line errors for bad δ, b, w, ε
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise ValueError(f"--device {args.device!r} is not a device; use cpu, cuda or cuda:N")
    if device.type not in ("cpu", "cuda") or (device.type == "cuda" and not torch.cuda.is_available()):
        raise ValueError(f"--device {args.device}: " + ("no CUDA GPU is visible here; use --device cpu"
                                                        if device.type == "cuda" else "use cpu, cuda or cuda:N"))
    if device.type == "cuda" and device.index is None and "LOCAL_RANK" in os.environ:  # torchrun: one GPU each
        args.device = f"cuda:{os.environ['LOCAL_RANK']}"
    world = int(os.environ.get("WORLD_SIZE", 1))
    if args.fsdp and "RANK" not in os.environ:
        raise ValueError("--fsdp runs under torchrun: torchrun --nproc_per_node N train.py ... --fsdp")
    args.term_grad_norms = args.term_grad_norms and not args.fsdp  # their extra backward is not sharded
    if args.prompts % world:
        raise ValueError(f"--prompts {args.prompts} must be a multiple of the {world} processes (each takes whole groups)")
    args.dtype = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    args.out = args.out or os.path.join("runs", args.mode)
    check_run_dir(args)
    return args


RUN_FILES = ("log.jsonl", "checkpoint", "checkpoint.tmp", "checkpoint.old")


def check_run_dir(args):
    """A new run never writes into a directory that holds another run, unless --overwrite."""
    out = args.out
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"--out {out} is a file; the run directory must be a directory")
    if args.resume or not os.path.isdir(out) or not os.listdir(out):
        return
    if not args.overwrite:
        raise ValueError(f"{out} already holds a run; continue it with --resume {out}, choose another --out, "
                         f"or pass --overwrite to start afresh there")


def load(c):
    """Model, tokenizer and (when resuming) trainer state, every failure a one-line error."""
    model = from_pretrained(c.model, dtype=torch.float32, device=torch.device(c.device))
    tokenizer = load_tokenizer(c.model)
    if not model.config.eos_ids:
        raise CheckpointError(f"{c.model}/config.json has no eos_token_id; rollouts could never end early")
    if c.meta_token:  # before the optimizer is made: g may add a row to the embedding and the LM head
        add_meta_token(model, tokenizer)
    return model, tokenizer


def main(argv=None, reward_fn=None):
    args = parse_args(argv)
    try:
        state = load_trainer_state(args.resume) if args.resume else None
        c = resolve(args, state)
        if c.threads:
            torch.set_num_threads(c.threads)
        model, tokenizer = load(c)
    except (CheckpointError, ValueError) as e:
        sys.exit(f"error: {e}")
    device = torch.device(c.device)
    ddp = "RANK" in os.environ  # launched by torchrun: one process per device, data parallel
    if ddp:  # every process has checked its arguments before this rendezvous; none has written
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    master = rank_and_world()[0] == 0  # the one process that prints, logs and saves
    if c.fsdp:
        shard(model)
    amp = torch.autocast(device.type, dtype=torch.bfloat16) if c.dtype == "bf16" else contextlib.nullcontext()
    opt = make_optimizer(model, c)
    step = 0
    if state:
        load_optimizer_state(model, opt, state["optimizer"])
        step = state["step"]
    log_path = os.path.join(c.out, "log.jsonl")
    if master:
        if c.overwrite:
            for name in RUN_FILES:
                path = os.path.join(c.out, name)
                shutil.rmtree(path) if os.path.isdir(path) else os.path.exists(path) and os.remove(path)
        os.makedirs(c.out, exist_ok=True)
        try:
            keep_log_before(log_path, step)
        except CheckpointError as e:
            sys.exit(f"error: {e}")
    say = tqdm.write if master else lambda text: None
    interactive = master and sys.stderr.isatty()  # bars on a terminal; plain lines in a log file
    final_eps = c.eviction_rate if c.eviction_rate is not None else 1 - c.retention[-1]
    say(f"NGC on {c.task}: model {c.model} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f} M params), "
        f"{c.device} {c.dtype}" + (f" x {rank_and_world()[1]} processes" if ddp else "") + f", mode {c.mode}, "
        f"P={c.prompts} x G={c.group}, δ={c.delta} b={c.block} w={c.window}, ε -> {final_eps:g}, "
        f"steps {step}..{c.steps}, run dir {c.out}")
    train, test = load_problems(c)
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(c.seed)).tolist()
    train = [train[i] for i in order]
    eval_ev = Eviction(c.delta, c.block, c.window, c.eval_rate or final_eps, greedy=True)
    encode = prompt_encoder(c, eval_ev.rate if c.interoception else None)
    reward_fn = reward_fn or TASK_REWARD[c.task]
    evals = []

    def run_eval():
        with amp, whole_model(model):
            r = evaluate(model, tokenizer, test, eval_ev, c.max_new_tokens, encode, reward_fn, c.eval_batch,
                         progress=interactive, meta_token=tokenizer.token_to_id(META_TOKEN) if c.meta_token else None,
                         compile=c.compile)
        evals.append(r)
        if master:
            write_log(log_path, {"step": step, "eval": r})
        say(f"eval @ step {step}: accuracy full cache {r['acc_full']:.1%}, at ε={eval_ev.rate:g} "
            f"{r['acc']:.1%}, peak-KV reduction {r['kv_reduction']:.2f}x")

    def save():
        save_checkpoint(c.out, model, tokenizer, c.model, opt, step, c)

    t_start = time.time()
    with stop_on_signals():
        try:
            bar = tqdm(total=c.steps, initial=step, desc="train", unit="step", disable=not interactive)
            while step < c.steps:
                if c.eval_every and step % c.eval_every == 0:
                    run_eval()
                try:
                    m = train_step(model, tokenizer, train, step, c, amp, reward_fn, progress=interactive)
                except Interrupted:
                    opt.zero_grad(set_to_none=True)  # the step did not happen
                    raise
                with signals_held():  # an update and its log record land together, or neither does
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    step += 1
                    if master:
                        write_log(log_path, {k: m[k] for k in STEP_KEYS})
                bar.update(1)
                say(step_line(m, c.steps))
                if c.save_every and step % c.save_every == 0 and step < c.steps:
                    try_save(save, step)
            bar.close()
            if c.eval_every:
                run_eval()
            with signals_held():
                save()
        except Interrupted as e:
            if c.fsdp:  # saving is a collective, and the processes may be inside different ones now
                say(f"\n{e}: with --fsdp a signal does not save; resume from the last periodic checkpoint")
                sys.exit(128 + e.signum)
            with signals_held():
                try_save(save, step)
            say(f"\n{e}: saved step {step} to {c.out}/checkpoint; continue with --resume {c.out}")
            sys.exit(128 + e.signum)
        except OSError as e:
            sys.exit(f"error: could not save the checkpoint in {c.out} ({e}); the previous one, if any, is kept")
    if ddp:
        dist.destroy_process_group()
    if master:
        summary(evals, eval_ev.rate, time.time() - t_start, c.out)


def try_save(save, step):
    """A periodic save that fails (disk full, ...) keeps the previous checkpoint and training goes on."""
    try:
        save()
    except OSError as e:
        tqdm.write(f"warning: could not save step {step} ({e}); the previous checkpoint is kept")


def summary(evals, rate, seconds, out):
    print(f"\ndone in {seconds / 60:.1f} min; checkpoint in {out}/checkpoint, log in {out}/log.jsonl")
    if len(evals) < 1:
        return
    first, last = evals[0], evals[-1]
    print(f"{'held-out accuracy':32s} {'before':>8s} {'after':>8s}")
    print(f"{'full cache':32s} {first['acc_full']:8.1%} {last['acc_full']:8.1%}")
    print(f"{f'ε = {rate:g} (greedy top-K)':32s} {first['acc']:8.1%} {last['acc']:8.1%}")
    print(f"{'peak-KV reduction':32s} {first['kv_reduction']:7.2f}x {last['kv_reduction']:7.2f}x")
    print(f"{'wall time':32s} {'':>8s} {seconds / 60:5.1f} min")


if __name__ == "__main__":
    main()
