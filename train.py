"""Train NGC: Dr. GRPO over tokens and evictions (paper §4.4–4.6, Appendix A.1), on Countdown or math.

    python train.py --task countdown                           # the shipped tiny model, on the CPU
    python train.py --task countdown --model DIR --out runs/r1 # a Hugging Face Qwen2 directory
    python train.py --task math --model DIR --data dapo.jsonl --eval-data aime25.jsonl
    python train.py --resume runs/r1                           # continue a run where it stopped
    torchrun --nproc_per_node 8 train.py ...                   # data parallel over 8 GPUs

One step: P prompts x G rollouts through the NGC engine (a round every δ tokens at the
curriculum's ε), binary reward, advantage A = r - mean(group), then the replay pass in
micro-batches, L = L_token + L_mem (eqs. 3-5), one backward, grad-norm clipping, AdamW at a
constant LR. Defaults are the paper's recipe for the task (tasks.py); a checkpoint directory may
carry an ngc.json whose values replace them (the tiny model's does), and any flag replaces both.

This file is the method, top to bottom: modes, curriculum, objective, one step, the loop, then the
command line. Run directory and its guard (signals, divergence, failed saves), processes, checkpoints
and evaluation are called, not written, here.
"""
import argparse
import contextlib
import functools
import os
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

import countdown
import distributed
import rundir
from checkpoint import META_TOKEN, CheckpointError, load
from cli import exits, one_line_errors, parser
from eval import before_after, evaluate
from ngc import Eviction, Sampling, check_eviction, rollout
from replay import replay
from tasks import RECIPES, TASK_REWARD, as_settings, check_settings, load_problems, prompt_encoder, run_defaults

HERE = os.path.dirname(os.path.abspath(__file__))


@dataclass(frozen=True)
class Mode:
    evict: bool  # evict during rollouts
    replay_masks: bool  # token log-probs under the per-layer replay masks (else the plain causal mask)
    eviction_loss: bool  # add L_mem
    token_loss: bool = True  # follow L_token (else it is only logged)


MODES = {
    "ngc": Mode(evict=True, replay_masks=True, eviction_loss=True),
    "token-only": Mode(evict=True, replay_masks=True, eviction_loss=False),  # ablation: no L_mem
    "mem-only": Mode(evict=True, replay_masks=True, eviction_loss=True, token_loss=False),  # diagnosis: no L_token
    "targeted-dropout": Mode(evict=True, replay_masks=False, eviction_loss=False),  # ablation: causal log-probs
    "no-evict": Mode(evict=False, replay_masks=False, eviction_loss=False),  # the full-cache upper bound
}


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
    """ε at a step: the fixed --eviction-rate, or 1 - the curriculum's retention (step None: the last ε)."""
    if c.eviction_rate is not None:
        return c.eviction_rate
    return 1 - (c.retention[-1] if step is None else retention_at(step, c.retention, c.stage_steps, c.alpha))


# ---------------------------------------------------------------------------------------
# The objective (paper eqs. 3-5, Dr. GRPO)


def group_advantages(reward, group: int):
    """A_i = r_i - mean of its group's rewards (Dr. GRPO: no division by the std). reward (P·G,)."""
    r = reward.view(-1, group)
    return (r - r.mean(1, keepdim=True)).flatten()


def policy_losses(model, ro, adv, mode: Mode, max_new_tokens: int, n_total: int):
    """L_token and L_mem (None when the mode has none) of rollouts ro with advantages adv (B,).

    Both are normalised by the whole step's rollout count n_total (and L_token by the max
    completion length: Dr. GRPO's constant), so micro-batch losses add up to the step's loss."""
    tok_lp, ev_lp = replay(model, ro, causal=not mode.replay_masks)
    l_token = -(tok_lp.sum(1) * adv).sum() / (n_total * max_new_tokens)  # eq. (3)
    l_mem = None
    if mode.eviction_loss and ev_lp is not None:
        per_layer = ev_lp.sum(1) / ro.n_rounds.clamp(min=1)[:, None]  # (B, L): mean over each rollout's rounds
        l_mem = -(adv[:, None] * per_layer).sum() / n_total  # eq. (4), summed over layers
    return l_token, l_mem


class TermGradNorms:
    """--term-grad-norms (the paper's Figure 5): ‖∇L_token‖ and ‖∇L_mem‖ apart. One extra backward
    per micro-batch accumulates ∇L_token into a buffer; ∇L_mem is the total minus it."""

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


def backward(model, ro, adv, c, amp=contextlib.nullcontext()):
    """Replay the rollouts that carry signal (A = 0 contributes nothing) in micro-batches,
    accumulate ∇(L_token + L_mem), and average it over the processes. The losses are normalised
    by this process's rollout count, so the average is the single-process gradient of all of them."""
    params = [p for p in model.parameters() if p.requires_grad]
    mode = MODES[c.mode]
    diag = TermGradNorms(params) if c.term_grad_norms else None
    l_token_sum, l_mem_sum = 0.0, 0.0 if mode.eviction_loss else None
    learn = torch.nonzero(adv).flatten()
    chunks = [(rows, adv[rows]) for rows in learn.split(c.micro_batch)] if len(learn) else []
    chunks = distributed.pad_micro_batches(model, chunks, adv.device)  # FSDP: as many on every process
    for rows, a in chunks:
        with amp:
            l_token, l_mem = policy_losses(model, ro.select(rows), a, mode, c.max_new_tokens, n_total=len(adv))
        if diag and mode.token_loss:
            diag.add(l_token)
        loss = l_token if mode.token_loss else 0 * l_token  # (a graph still: with FSDP every backward runs)
        (loss if l_mem is None else loss + l_mem).backward()
        l_token_sum += l_token.item()
        if l_mem is not None:  # None: no rollout of this micro-batch had a round, so L_mem adds 0
            l_mem_sum += l_mem.item()
    distributed.average_gradients(params)
    if diag:
        distributed.average_gradients(params, diag.acc)
    losses = distributed.mean_over_processes({"L_token": l_token_sum, **({"L_mem": l_mem_sum} if mode.eviction_loss else {})})
    norms = diag.norms(mode.eviction_loss) if diag else {"grad_norm_token": None, "grad_norm_mem": None}
    return {"L_token": losses["L_token"], "L_mem": losses.get("L_mem"), **norms}


# ---------------------------------------------------------------------------------------
# One step: rollout → reward → advantage → replay → backward → clip


def step_generator(seed: int, rank: int, step: int, device) -> torch.Generator:
    """The noise of one step on one rank (tokens, Gumbel draws, interoception rates), derived from
    (seed, rank, step) alone: a resumed run draws exactly what an uninterrupted one would have."""
    return torch.Generator(device=device).manual_seed(int(np.random.SeedSequence([seed, rank, step]).generate_state(1)[0]))


def step_gradients(model, tokenizer, problems, step, c, amp, reward_fn, progress=False):
    """One step's gradients, clipped, and its log record; the caller then steps the optimizer (so
    that an update and its record land together, see main). With several processes each rolls
    out its share of the P prompts, whole groups each, and the gradients are averaged across them."""
    t0 = time.perf_counter()
    device = model.lm_head.weight.device
    rank, world = distributed.rank_and_world()
    P, G, mode = c.prompts // world, c.group, MODES[c.mode]  # this process's prompts
    gen = step_generator(c.seed, rank, step, device)
    eps = eviction_rate_at(step, c)
    ev = Eviction(c.delta, c.block, c.window, eps) if mode.evict else None
    group_eps = None
    if c.interoception:  # one ε per group, written into its prompts (paper §5.3, Figure 6)
        choices = torch.tensor(c.interoception_rates) * eps / eviction_rate_at(None, c)
        group_eps = choices[torch.randint(len(choices), (P,), generator=gen, device=gen.device).cpu()].clamp(0.01, 1)
    rates = None if group_eps is None else group_eps.repeat_interleave(G)
    batch = [problems[(step * c.prompts + rank * P + i) % len(problems)] for i in range(P)]
    prompts = [prompt_encoder(c.task, c.prompt, None if group_eps is None else float(group_eps[i]), c.blind_tag)(
        tokenizer, p) for i, p in enumerate(batch) for _ in range(G)]
    meta = tokenizer.token_to_id(META_TOKEN) if c.meta_token else None
    sampling = Sampling(c.max_new_tokens, c.temperature, c.top_k, top_p=c.top_p, meta_token=meta)
    with amp, distributed.whole_model(model):
        ro = rollout(model, prompts, sampling, ev, rates=rates, eos_ids=model.config.eos_ids, generator=gen,
                     progress=progress, compile=c.compile)
    t_rollout = time.perf_counter() - t0
    texts = tokenizer.decode_batch(ro.completions(), skip_special_tokens=True)
    correct = torch.tensor([reward_fn(t, batch[i // G]) for i, t in enumerate(texts)])
    reward = torch.where(ro.lengths.cpu() < c.min_length, 0.0, correct)  # Appendix A.1 penalty
    adv = group_advantages(reward, G).to(device)
    losses = backward(model, ro, adv, c, amp)
    grad_norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], c.clip).item()

    n_new = (ro.lengths - ro.prompt_lens).float()
    means = distributed.mean_over_processes(dict(
        reward=reward.mean(), accuracy=correct.mean(), response_len=n_new.mean(), rounds=ro.n_rounds.float().mean(),
        peak_kv=ro.peak_kv.float().mean(), tokens_per_s=n_new.sum() / t_rollout,
        sampled_logprob=ro.logprobs.sum(1).mean(),  # not finite: the model's logits are not (diverged)
        zero_adv_groups=(adv.view(-1, G) == 0).all(1).float().mean()))  # groups that teach nothing
    means["tokens_per_s"] *= world  # all processes together
    return {"step": step, **means, "eps": eps, **losses, "grad_norm": grad_norm,
            "step_time": time.perf_counter() - t0}


def make_optimizer(model, c, state=None):
    """AdamW over the model's parameters (under FSDP, its shards), with a resumed run's state."""
    opt = torch.optim.AdamW(model.parameters(), lr=c.lr, betas=(c.beta1, c.beta2), eps=c.adam_eps,
                            weight_decay=c.weight_decay)
    if state is not None:
        distributed.load_optimizer_state(model, opt, state)
    return opt


# ---------------------------------------------------------------------------------------
# The loop


@exits  # a RunStopped (a signal, divergence, a failed save) ends the process with its status
def main(argv=None, reward_fn=None):
    c, state, model, tokenizer = setup(argv)
    device = torch.device(c.device)
    distributed.start(device)  # under torchrun; every process has checked its arguments, none has written
    master = distributed.rank_and_world()[0] == 0  # the one process that prints, logs and saves
    if c.fsdp:
        distributed.shard(model)
    amp = torch.autocast(device.type, dtype=torch.bfloat16) if c.dtype == "bf16" else contextlib.nullcontext()
    opt = make_optimizer(model, c, state and state["optimizer"])
    save = lambda step: rundir.save_checkpoint(c.out, model, opt, tokenizer, c.model, step, as_settings(c))
    run = rundir.Run(c.out, save, saved=state and state["step"])  # a resume starts at its checkpoint's step
    log_path = os.path.join(c.out, "log.jsonl")
    say = tqdm.write if master else lambda text: None
    log = functools.partial(rundir.write_log, log_path) if master else lambda record: None
    with one_line_errors():  # the run directory, its log cut back to run.step; a resume says what it changes
        kept = rundir.prepare(c.out, c.overwrite, run.step, state and state["config"], as_settings(c)) if master else []
    interactive = master and sys.stderr.isatty()  # bars on a terminal; plain lines in a log file
    say(banner(c, model, run.step))
    train, test = load_problems(c)
    eval_ev = Eviction(c.delta, c.block, c.window, c.eval_rate or eviction_rate_at(None, c), greedy=True)
    encode = prompt_encoder(c.task, c.prompt, eval_ev.rate if c.interoception else None, c.blind_tag)
    reward_fn = reward_fn or TASK_REWARD[c.task]
    evals = [r["eval"] for r in kept if "eval" in r]  # a resume's, too

    def run_eval():
        with amp, distributed.whole_model(model):
            r = evaluate(model, tokenizer, test, eval_ev, c.max_new_tokens, encode, reward_fn, c.eval_batch,
                         progress=interactive, meta_token=tokenizer.token_to_id(META_TOKEN) if c.meta_token else None,
                         compile=c.compile)
        evals.append(r)
        log({"step": run.step, "eval": r})
        say(f"eval @ step {run.step}: accuracy full cache {r['acc_full']:.1%}, at ε={eval_ev.rate:g} "
            f"{r['acc']:.1%}, peak-KV reduction {r['kv_reduction']:.2f}x")

    t_start = time.time()
    with rundir.guard(run, c.lr, c.fsdp, say):
        bar = tqdm(total=c.steps, initial=run.step, desc="train", unit="step", disable=not interactive)
        while run.step < c.steps:
            if c.eval_every and run.step % c.eval_every == 0:
                run_eval()
            m = step_gradients(model, tokenizer, train, run.step, c, amp, reward_fn, progress=interactive)
            rundir.check_finite({k: m[k] for k in ("sampled_logprob", "L_token", "L_mem", "grad_norm")})
            with rundir.signals_held():  # an update and its log record land together, or neither does
                opt.step()
                opt.zero_grad(set_to_none=True)
                run.step += 1
                log({k: m[k] for k in rundir.STEP_KEYS})
            bar.update(1)
            say(step_line(m, c.steps))
            if c.save_every and run.step % c.save_every == 0 and run.step < c.steps:
                run.try_save()
        bar.close()
        if c.eval_every:
            run_eval()
        with rundir.signals_held():
            run.save()
    distributed.stop()
    say(f"\ndone in {(time.time() - t_start) / 60:.1f} min; checkpoint in {c.out}/checkpoint, log in {log_path}")
    if evals:
        say(before_after(evals, eval_ev.rate, time.time() - t_start))


# ---------------------------------------------------------------------------------------
# The command line


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
    p = parser(__doc__)
    p.add_argument("--task", choices=list(RECIPES), help="countdown (generated problems) or math (DAPO-17k from "
                   "--data, AIME/AMC from --eval-data); default: the checkpoint's ngc.json, else countdown")
    p.add_argument("--model", default=os.path.join(HERE, "tiny"),
                   help="Qwen2 checkpoint directory: config.json, *.safetensors, tokenizer.json (default: tiny/)")
    p.add_argument("--out", default=None, help="run directory for log.jsonl and checkpoint/ (default: runs/<mode>)")
    p.add_argument("--overwrite", action="store_true", help="start afresh in an --out that already holds a run")
    p.add_argument("--resume", default=None, metavar="RUN_DIR", help="continue the run saved in RUN_DIR; a flag "
                   "given with it changes that setting from there on (the change is printed)")
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when present)")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default=None,
                   help="compute dtype; weights and optimizer stay fp32 (default: bf16 on cuda, fp32 on cpu)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    p.add_argument("--compile", action="store_true", help="capture the decode step with torch.compile (CUDA graphs "
                   "on CUDA): eager's rollouts up to float rounding, faster")
    p.add_argument("--fsdp", action="store_true", help="under torchrun: shard the model, gradients and optimizer "
                   "state across the processes (FSDP2) instead of a whole copy each")
    g = p.add_argument_group("task and run")
    g.add_argument("--seed", type=int, help="seed of the rollouts and evictions (and of the problems without --data-seed)")
    g.add_argument("--data-seed", type=int, help="seed of the training and held-out problems and their order "
                   "(default: --seed); fix it to compare seeds on one held-out set")
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
    g.add_argument("--mode", choices=list(MODES), help="ngc | token-only (no L_mem) | mem-only (no L_token) | "
                   "targeted-dropout | no-evict (full cache)")
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
    g.add_argument("--blind-tag", action=argparse.BooleanOptionalAction, help="with --interoception, the control: "
                   "the same per-group ε, the tag <eviction_rate>-%%</eviction_rate> (same length, same blocks)")
    g.add_argument("--min-length", type=int, help="reward 0 when prompt+completion is shorter (Appendix A.1)")
    g.add_argument("--meta-token", action=argparse.BooleanOptionalAction,
                   help=f"force the meta-token {META_TOKEN} as the last token before each round (Appendix, meta-tokens; "
                        "added to a checkpoint that lacks it as the mean embedding of 'tl;dr')")
    g = p.add_argument_group("optimisation")
    g.add_argument("--lr", type=float, help="AdamW learning rate, constant")
    g.add_argument("--beta1", type=float, help="AdamW β1")
    g.add_argument("--beta2", type=float, help="AdamW β2")
    g.add_argument("--adam-eps", type=float, help="AdamW ε")
    g.add_argument("--weight-decay", type=float, help="AdamW weight decay")
    g.add_argument("--clip", type=float, help="grad-norm clipping")
    g.add_argument("--micro-batch", type=int, help="rollouts per replay forward/backward")
    g.add_argument("--term-grad-norms", action=argparse.BooleanOptionalAction,
                   help="log ‖∇L_token‖ and ‖∇L_mem‖ apart (one more backward per micro-batch, one more gradient copy)")
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


def resolve(args, state=None):
    """Fill every unset flag from the resumed run's state, the checkpoint's ngc.json or the paper,
    then check them all. Raises CheckpointError or ValueError with a one-line message."""
    if args.resume:  # the run's own settings, its checkpoint and directory
        base, args.model, args.out = rundir.resume_from(args.resume, args.out, state)
    else:
        base = run_defaults(args.model, args.task)
    for k, v in base.items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    check_settings(args)
    for eps in [eviction_rate_at(s, args) for s in (0, args.steps)] + args.interoception_rates + [args.eval_rate or 0.5]:
        check_eviction(args.delta, args.block, args.window, eps)  # one-line errors for bad δ, b, w, ε
    args.device = distributed.pick_device(args.device)
    world = int(os.environ.get("WORLD_SIZE", 1))
    if args.fsdp and not distributed.launched():
        raise ValueError("--fsdp runs under torchrun: torchrun --nproc_per_node N train.py ... --fsdp")
    args.term_grad_norms = args.term_grad_norms and not args.fsdp  # their extra backward is not sharded
    if args.prompts % world:
        raise ValueError(f"--prompts {args.prompts} must be a multiple of the {world} processes (each takes whole groups)")
    args.dtype = args.dtype or ("bf16" if args.device.startswith("cuda") else "fp32")
    args.out = args.out or os.path.join("runs", args.mode)
    rundir.check_run_dir(args.out, args.resume, args.overwrite)
    return args


def setup(argv):
    """The run's settings, its saved state (a resume's, else None), model and tokenizer. Bad flags
    or files end the script with one line, before anything is written."""
    args = parse_args(argv)
    with one_line_errors():
        state = rundir.load_trainer_state(args.resume) if args.resume else None
        c = resolve(args, state)
        if c.threads:
            torch.set_num_threads(c.threads)
        model, tokenizer = load(c.model, c.device, c.meta_token)  # before the optimizer: g may add a row
        if not model.config.eos_ids:
            raise CheckpointError(f"{c.model}/config.json has no eos_token_id; rollouts could never end early")
    return c, state, model, tokenizer


def banner(c, model, step) -> str:
    """The run in one line: model, device, mode, batch, eviction, steps, run directory."""
    return (f"NGC on {c.task}: model {c.model} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f} M params), "
            f"{c.device} {c.dtype}" + (f" x {distributed.rank_and_world()[1]} processes" if distributed.launched() else "")
            + f", mode {c.mode}, P={c.prompts} x G={c.group}, δ={c.delta} b={c.block} w={c.window}, "
            f"ε -> {eviction_rate_at(None, c):g}, steps {step}..{c.steps}, run dir {c.out}")


def step_line(m, steps) -> str:
    mem = "" if m["L_mem"] is None else f" | L_mem {m['L_mem']:+.4f}"
    return (f"step {m['step'] + 1}/{steps} | reward {m['reward']:.3f} | ε {m['eps']:.2f} | "
            f"len {m['response_len']:.0f} | L_token {m['L_token']:+.5f}{mem} | {m['step_time']:.1f} s")


if __name__ == "__main__":
    main()
