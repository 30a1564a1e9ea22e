"""Train NGC: Dr. GRPO over tokens and evictions (paper §4.4-4.6, App. A.1), Countdown or math.

    python train.py --task countdown                           # the shipped tiny model, on the CPU
    python train.py --task countdown --model DIR --out runs/r1 # a Hugging Face Qwen2 directory
    python train.py --task math --model DIR --data dapo.jsonl --eval-data aime25.jsonl
    python train.py --resume runs/r1                           # continue a run where it stopped
    torchrun --nproc_per_node 8 train.py ...                   # data parallel over 8 GPUs

One step: P prompts x G rollouts through the NGC engine (a round every δ tokens at the
curriculum's ε), binary reward, advantage A = r - mean(group), then the replay pass in
micro-batches, L = L_token + L_mem (eqs. 3-5), one backward, grad-norm clipping, AdamW at a
constant LR. Defaults are the paper's recipe for the task (lib/settings.py); a checkpoint
directory may carry an ngc.json whose values replace them (tiny/'s does); a flag replaces both.
"""
import contextlib
import functools
import os
import sys
import time
from dataclasses import dataclass, replace

import numpy as np
import torch
from tqdm import tqdm

from ngc import check_eviction, rollout
from replay import replay
from lib import distributed, rundir, settings
from lib.checkpoint import META_TOKEN, load
from lib.cli import Error, exits, one_line_errors, parser
from evaluation.scoring import before_after, eval_line, evaluate
from lib.tasks import TASK_REWARD, check_prompts, load_problems, prompt_encoder

LOSSES = ("L_token", "L_mem")  # the loss's terms (policy_losses); the step's record follows them


@dataclass(frozen=True)
class Mode:
    evict: bool  # evict during rollouts
    replay_masks: bool  # token log-probs under the per-layer replay masks (else the causal mask)
    eviction_loss: bool  # add L_mem


MODES = {
    "ngc": Mode(evict=True, replay_masks=True, eviction_loss=True),
    "token-only": Mode(evict=True, replay_masks=True, eviction_loss=False),  # ablation: no L_mem
    "targeted-dropout": Mode(evict=True, replay_masks=False, eviction_loss=False),  # causal log-p
    "no-evict": Mode(evict=False, replay_masks=False, eviction_loss=False),  # the full-cache bound
}


# ---- Eviction-rate curriculum (paper §4.6) ----------------------------------------------------
def retention_at(step: int, stages: list[float], stage_steps: int, alpha: float) -> float:
    """Staircase over retention p0 = 1 - ε (eq. 6): hold ρ_ℓ for the first (1 - α) of stage
    ℓ, then blend linearly to ρ_{ℓ+1}; the last stage holds ρ_K."""
    stage = step // stage_steps
    if stage >= len(stages) - 1:
        return stages[-1]
    into = (step % stage_steps) / stage_steps  # how far into the stage
    if into < 1 - alpha:
        return stages[stage]
    return stages[stage] + (into - (1 - alpha)) / alpha * (stages[stage + 1] - stages[stage])


def final_eviction_rate(cfg) -> float:
    return 1 - cfg.retention[-1]


# ---- The objective (paper eqs. 3-5, Dr. GRPO) ----------------------------------------------------
def group_advantages(reward, group: int):
    """A_i = r_i - the mean of its group's rewards (Dr. GRPO: no std). reward (P·G,)."""
    grouped = reward.view(-1, group)
    return (grouped - grouped.mean(1, keepdim=True)).flatten()


def policy_losses(model, ro, adv, mode: Mode, max_new_tokens: int, n_total: int, mem_norm="paper",
                  adv_mem=None):
    """The loss's terms for rollouts ro with advantages adv (B,): "L_token" (eq. 3) and, when the
    mode has it and a round fired, "L_mem" (eq. 4), whose advantages are adv_mem if given. Both are
    normalised by the whole step's rollout count n_total (L_token also by the max completion
    length, Dr. GRPO's constant), so the micro-batches' losses add up to the step's. mem_norm
    "paper" is eq. (4): per rollout and layer the mean of log p(σ) over its rounds, summed over
    layers; "joint" sums over rounds and layers and divides by L_token's constant, the exact
    gradient of one policy whose actions are tokens and evictions (§4.4)."""
    tok_lp, ev_lp = replay(model, ro, causal=not mode.replay_masks)  # (B, T), (B, R, L)
    adv_mem = adv if adv_mem is None else adv_mem
    terms = {"L_token": -(tok_lp.sum(1) * adv).sum() / (n_total * max_new_tokens)}  # eq. (3)
    if mode.eviction_loss and ev_lp is not None:
        if mem_norm == "paper":  # eq. (4)
            per_layer = ev_lp.sum(1) / ro.n_rounds.clamp(min=1)[:, None]  # (B, L): its rounds' mean
            terms["L_mem"] = -(adv_mem[:, None] * per_layer).sum() / n_total  # summed over layers
        else:  # every round at every layer (rounds that did not fire hold 0)
            terms["L_mem"] = -(adv_mem * ev_lp.sum((1, 2))).sum() / (n_total * max_new_tokens)
    return terms


def backward(model, ro, adv, cfg, amp=contextlib.nullcontext(), adv_mem=None):
    """Replay the rollouts with A != 0 in micro-batches and accumulate the loss's gradient,
    averaged over the processes (each normalised by its own rollout count: the single-process
    gradient). adv_mem: L_mem's advantages, if not adv's. Returns each term's sum (None: none)."""
    mode = MODES[cfg.mode]
    sums = dict.fromkeys(LOSSES if mode.eviction_loss else LOSSES[:1], 0.0)  # no round: L_mem 0
    adv_mem = adv if adv_mem is None else adv_mem
    learn = torch.nonzero((adv != 0) | (adv_mem != 0)).flatten()
    learn = learn[ro.lengths[learn].argsort(stable=True)]  # like lengths together: less padding
    chunks = [(rows, adv[rows], adv_mem[rows]) for rows in learn.split(cfg.micro_batch)
              ] if len(learn) else []
    chunks = distributed.pad_micro_batches(model, chunks, adv.device)  # FSDP: as many everywhere
    for rows, a, a_mem in chunks:
        with amp:
            terms = policy_losses(model, ro.select(rows), a, mode, cfg.max_new_tokens, len(adv),
                                  cfg.mem_norm, a_mem)
        losses = list(terms.values())
        sum(losses[1:], losses[0]).backward()
        for term, loss in terms.items():
            sums[term] += loss.item()
    distributed.average_gradients(trained_parameters(model))
    sums = distributed.mean_over_processes(sums)
    return {t: sums.get(t) for t in LOSSES}


# ---- One step: rollout, reward, advantage, replay, backward, clip -------------------------------
def step_generator(seed: int, rank: int, step: int, device) -> torch.Generator:
    """The noise of one step on one rank (tokens, Gumbel draws, interoception rates), derived from
    (seed, rank, step) alone: a resumed run draws exactly what an uninterrupted one would have."""
    mixed = np.random.SeedSequence([seed, rank, step]).generate_state(1)[0]
    return torch.Generator(device=device).manual_seed(int(mixed))


def step_gradients(model, tokenizer, problems, step, cfg, amp, reward_fn, progress=False):
    """One step's clipped gradients and log record; each process rolls out its share of groups."""
    t0 = time.perf_counter()
    device = model.lm_head.weight.device
    rank, world = distributed.rank_and_world()
    P, G, mode = cfg.prompts // world, cfg.group, MODES[cfg.mode]  # this process's prompts
    gen = step_generator(cfg.seed, rank, step, device)
    eps = 1 - retention_at(step, cfg.retention, cfg.stage_steps, cfg.alpha)  # the curriculum's ε
    ev = settings.eviction(cfg, eps, temperature=cfg.eviction_temperature) if mode.evict else None
    group_eps = rates = None
    if cfg.interoception:  # one ε per group, written into its prompts (paper §5.3, Figure 6)
        choices = torch.tensor(cfg.interoception_rates) * eps / final_eviction_rate(cfg)
        drawn = torch.randint(len(choices), (P,), generator=gen, device=gen.device).cpu()
        group_eps = choices[drawn].clamp(0.01, 1)
        rates = group_eps.repeat_interleave(G)
    elif cfg.full_cache_groups and ev is not None:  # the step's last groups keep every entry
        full = rank * P + torch.arange(P) >= cfg.prompts - cfg.full_cache_groups  # (P,)
        rates = torch.where(full, 0.0, eps).repeat_interleave(G)
    batch = [problems[(step * cfg.prompts + rank * P + i) % len(problems)] for i in range(P)]
    rate = lambda i: None if group_eps is None else float(group_eps[i])
    encoded = [prompt_encoder(cfg.task, cfg.prompt, rate(i), cfg.blind_tag)(tokenizer, p)
               for i, p in enumerate(batch)]
    prompts = [ids for ids in encoded for _ in range(G)]  # each group's G rollouts share it
    meta = tokenizer.token_to_id(META_TOKEN) if cfg.meta_token else None
    sampling = settings.sampling(cfg, meta_token=meta)
    K = cfg.eviction_draws  # members of a group that share their token noise
    noise_rows = torch.arange(P * G, device=device) // K * K if K > 1 else None
    with amp, distributed.whole_model(model):
        ro = rollout(model, prompts, sampling, ev, rates=rates, eos_ids=model.config.eos_ids,
                     generator=gen, progress=progress, compile=cfg.compile,
                     token_noise_rows=noise_rows)
    t_rollout = time.perf_counter() - t0
    texts = tokenizer.decode_batch(ro.completions(), skip_special_tokens=True)
    correct = torch.tensor([reward_fn(t, batch[i // G]) for i, t in enumerate(texts)])
    reward = torch.where(ro.lengths.cpu() < cfg.min_length, 0.0, correct)  # Appendix A.1 penalty
    adv = group_advantages(reward, G).to(device)
    # eviction draws: an eviction's advantage is over the members that share its token noise
    adv_mem = group_advantages(reward, K).to(device) if K > 1 else None
    if cfg.full_cache_groups and rates is not None:  # a full-cache row takes no eviction action
        adv_mem = (adv if adv_mem is None else adv_mem) * (rates > 0).to(device)
    t_replay = time.perf_counter()
    losses = backward(model, ro, adv, cfg, amp, adv_mem)
    t_replay = time.perf_counter() - t_replay
    grad_norm = torch.nn.utils.clip_grad_norm_(trained_parameters(model), cfg.clip).item()
    n_new = (ro.lengths - ro.prompt_lens).float()
    m = distributed.mean_over_processes(dict(
        reward=reward.mean(), accuracy=correct.mean(), response_len=n_new.mean(),
        rounds=ro.n_rounds.float().mean(), peak_kv=ro.peak_kv.float().mean(),
        tokens_per_s=n_new.sum() * world / t_rollout,  # all processes together
        zero_adv_groups=(adv.view(-1, G) == 0).all(1).float().mean(),  # groups that teach nothing
        sampled_logprob=ro.logprobs.sum(1).mean()))  # not finite: the logits are not (diverged)
    times = dict(rollout_time=t_rollout, replay_time=t_replay, step_time=time.perf_counter() - t0)
    return {"step": step, "eps": eps, **m, **losses, "grad_norm": grad_norm, **times}


def trained_parameters(model) -> list:
    return [p for p in model.parameters() if p.requires_grad]


def make_optimizer(model, cfg, opt_state=None):
    """AdamW over the model's parameters (under FSDP, its shards), with a resumed run's state."""
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                            eps=cfg.adam_eps, weight_decay=cfg.weight_decay)
    if opt_state is not None:
        distributed.load_optimizer_state(model, opt, opt_state)
    return opt


# ---- The loop ------------------------------------------------------------------------------------
def evaluator(cfg, model, tokenizer, test, reward_fn, amp, progress):
    """The final ε and the held-out evaluation: full cache and top K at ε, eval.py's sampling."""
    ev = settings.eviction(cfg, final_eviction_rate(cfg), greedy=True)
    encode = prompt_encoder(cfg.task, cfg.prompt, ev.rate if cfg.interoception else None,
                            cfg.blind_tag)
    meta = tokenizer.token_to_id(META_TOKEN) if cfg.meta_token else None
    sampling = settings.sampling(cfg, held_out=True)

    def evaluate_held_out():
        with amp, distributed.whole_model(model):
            return evaluate(model, tokenizer, test, ev, sampling, encode, reward_fn, cfg.eval_batch,
                            progress=progress, meta_token=meta, compile=cfg.compile,
                            samples=cfg.eval_samples, seed=cfg.seed)
    return ev.rate, evaluate_held_out


@exits  # a signal, divergence or a failed save ends the process with one line (rundir.guard)
def main(argv=None, reward_fn=None):
    cfg, resumed, model, tokenizer, (train, test) = setup(argv)
    distributed.start(device := torch.device(cfg.device))  # every process has checked its arguments
    master = distributed.rank_and_world()[0] == 0  # the one process that prints, logs and saves
    if cfg.fsdp:
        distributed.shard(model)
    amp = (torch.autocast(device.type, dtype=torch.bfloat16) if cfg.dtype == "bf16"
           else contextlib.nullcontext())
    opt = make_optimizer(model, cfg, resumed and resumed["optimizer"])
    save = lambda step: rundir.save_checkpoint(cfg.out, model, opt, tokenizer, weights(cfg), step,
                                               settings.saved(cfg), settings.session(cfg))
    run = rundir.Run(cfg.out, save, saved=resumed and resumed["step"])  # a resume: its saved step
    log_path = os.path.join(cfg.out, "log.jsonl")
    write = tqdm.write if master else lambda text: None
    log = functools.partial(rundir.write_log, log_path) if master else lambda record: None
    with one_line_errors():  # the directory, its lock, the log cut to run.step, a resume's changes
        earlier = rundir.prepare(cfg.out, resumed, settings.recorded(cfg)) if master else []
    interactive = master and sys.stderr.isatty()  # bars on a terminal; plain lines in a log file
    write(banner(cfg, model, run.step))
    reward_fn = reward_fn or TASK_REWARD[cfg.task]
    rate, evaluate_held_out = evaluator(cfg, model, tokenizer, test, reward_fn, amp, interactive)
    evals = [r["eval"] for r in earlier if "eval" in r]  # a resume's, too

    def run_evaluation():
        t0 = time.perf_counter()
        evals.append(r := evaluate_held_out())
        log({"step": run.step, "eval": r, "eval_time": time.perf_counter() - t0})
        write(eval_line(run.step, r, rate))

    t_start = time.time()
    with rundir.guard(run, cfg.lr, cfg.fsdp):
        bar = tqdm(total=cfg.steps, initial=run.step, desc="train", unit="step",
                   disable=not interactive)
        while run.step < cfg.steps:
            if cfg.eval_every and run.step % cfg.eval_every == 0:
                run_evaluation()
            m = step_gradients(model, tokenizer, train, run.step, cfg, amp, reward_fn, interactive)
            rundir.check_finite({k: m[k] for k in ("sampled_logprob", *LOSSES, "grad_norm")})
            with rundir.signals_held():  # an update and its record land together, or neither does
                opt.step()
                opt.zero_grad(set_to_none=True)
                run.step += 1
                log(m)
            bar.update(1)
            write(step_line(m, cfg.steps))
            if cfg.save_every and run.step % cfg.save_every == 0 and run.step < cfg.steps:
                run.try_save()
        bar.close()
        if cfg.eval_every:
            run_evaluation()
        run.save()
    distributed.stop()
    minutes = (time.time() - t_start) / 60
    write(f"\ndone in {minutes:.1f} min; checkpoint in {cfg.out}/checkpoint, log in {log_path}")
    if evals:
        split = "validation" if cfg.task == "countdown" else "held-out"  # tasks.load_problems
        write(before_after(evals, rate, time.time() - t_start, len(test), split))


# ---- The command line ----------------------------------------------------------------------------
def parse_args(argv=None):
    """A flag per setting (settings.py); --help shows the recipe, or --model's ngc.json's values."""
    pre = parser(add_help=False)
    settings.add_flags(pre, None, ["model", "task"])
    known = pre.parse_known_args(argv)[0]
    try:
        defaults = settings.run_defaults(known.model or settings.COUNTDOWN.model, known.task)
    except Error:
        defaults = settings.RECIPES[known.task or "countdown"]  # resolve() reports what is wrong
    p = parser(__doc__)
    settings.add_flags(p, defaults)
    return p.parse_args(argv)


def resolve(args, resumed=None) -> settings.Settings:
    """The run's settings: unset flags from the resumed run (resumed), else the checkpoint's
    ngc.json, else the paper's; all checked (an Error or another one-line ValueError)."""
    if args.resume:  # the run's own settings; its model: the one it started from (or its own)
        start = resumed["session"].get("model", os.path.join(args.resume, "checkpoint"))
        base = settings.from_dict({**resumed["config"], "model": start, "out": args.resume})
    else:
        base = settings.run_defaults(args.model or settings.COUNTDOWN.model, args.task)
    fixed = ("model", "out") if args.resume else ()  # with --resume: the run's own (resumed_state)
    flags = {k: v for k, v in vars(args).items() if v is not None and k not in fixed}
    cfg = settings.from_dict(flags, base)
    settings.check(cfg)
    check_eviction(cfg.delta, cfg.block, cfg.window, final_eviction_rate(cfg))  # one-line errors
    device = distributed.pick_device(cfg.device)
    world = int(os.environ.get("WORLD_SIZE", 1))
    if cfg.fsdp and not distributed.launched():
        raise Error("--fsdp runs under torchrun: torchrun --nproc_per_node N train.py ... --fsdp")
    if cfg.group % cfg.eviction_draws:
        raise Error(f"--eviction-draws {cfg.eviction_draws} must divide --group {cfg.group} "
                    f"(a group is sets of members that share their token noise)")
    if cfg.eviction_draws > 1 and not MODES[cfg.mode].eviction_loss:
        raise Error(f"--eviction-draws needs a mode with an eviction loss, not --mode {cfg.mode}")
    if cfg.full_cache_groups and (not MODES[cfg.mode].evict or cfg.interoception):
        raise Error("--full-cache-groups sets some groups' ε to 0: it needs an evicting --mode "
                    "and no --interoception (which sets each group's ε itself)")
    if cfg.full_cache_groups >= cfg.prompts:
        raise Error(f"--full-cache-groups {cfg.full_cache_groups} must be below --prompts "
                    f"{cfg.prompts}: some group must evict")
    if cfg.prompts % world:
        raise Error(f"--prompts {cfg.prompts} must be a multiple of the {world} processes (each "
                    f"takes whole groups)")
    dtype = cfg.dtype or ("bf16" if device.startswith("cuda") else "fp32")
    cfg = replace(cfg, device=device, dtype=dtype, out=cfg.out or os.path.join("runs", cfg.mode))
    rundir.check_run_dir(cfg.out, cfg.resume, cfg.overwrite)
    return cfg


def resumed_state(args) -> dict:
    """The saved state of the run --resume continues, once no other process trains there and the
    flags given with it that a run cannot change (model, task, directory) are the run's own."""
    rundir.lock(args.resume, check_only=True)
    resumed = rundir.load_trainer_state(args.resume)
    saved = {**resumed["session"], "task": resumed["config"]["task"], "out": args.resume}
    path = os.path.realpath
    same = lambda k, v: k in saved and (v == saved[k] if k == "task" else path(v) == path(saved[k]))
    given = [f"--{k} {v}" for k in ("model", "task", "out")
             if (v := getattr(args, k)) and not same(k, v)]
    given += ["--overwrite"] if args.overwrite else []
    if given:
        raise Error(f"--resume {args.resume} continues that run with its own model, task and "
                    f"directory; drop {', '.join(given)} (to start a new run, give --out instead "
                    f"of --resume)")
    return resumed


def weights(cfg) -> str:
    """The checkpoint a run starts from: its --model, or a resumed run's own checkpoint."""
    return os.path.join(cfg.resume, "checkpoint") if cfg.resume else cfg.model


def setup(argv):
    """Settings, a resume's saved state (else None), model, tokenizer and (training, held-out)
    problems. Bad flags or files end the script with one line, before anything is written."""
    args = parse_args(argv)
    with one_line_errors():
        resumed = resumed_state(args) if args.resume else None
        cfg = resolve(args, resumed)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        train, test = load_problems(cfg)  # the data files read and checked before anything is made
        model, tokenizer = load(weights(cfg), cfg.device, cfg.meta_token)  # g's row: before AdamW
        if not model.config.eos_ids:
            raise Error(f"{weights(cfg)}/config.json has no eos_token_id; rollouts would never end")
        check_prompts(cfg, tokenizer, weights(cfg), train + test,
                      model.config.max_position_embeddings, cfg.max_new_tokens)
    return cfg, resumed, model, tokenizer, (train, test)


def banner(cfg, model, step) -> str:
    params = sum(p.numel() for p in model.parameters()) / 1e6
    processes = f" x {distributed.rank_and_world()[1]} processes" if distributed.launched() else ""
    return (f"NGC on {cfg.task}: model {weights(cfg)} ({params:.1f} M params), "
            f"{cfg.device} {cfg.dtype}{processes}, mode {cfg.mode}, "
            f"P={cfg.prompts} x G={cfg.group}, δ={cfg.delta} b={cfg.block} w={cfg.window}, "
            f"ε -> {final_eviction_rate(cfg):g}, steps {step}..{cfg.steps}, run dir {cfg.out}")


def step_line(m, steps) -> str:
    losses = "".join(f" | {t} {m[t]:+.5f}" for t in LOSSES if m[t] is not None)
    return (f"step {m['step'] + 1}/{steps} | reward {m['reward']:.3f} | ε {m['eps']:.2f} | "
            f"len {m['response_len']:.0f}{losses} | {m['step_time']:.1f} s")


if __name__ == "__main__":
    main()
