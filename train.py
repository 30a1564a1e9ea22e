"""Train NGC on Countdown: Dr. GRPO over tokens and evictions (paper §4.4–4.6, Appendix A.1).

    python train.py --task countdown                           # the shipped tiny model, on the CPU
    python train.py --task countdown --model DIR --out runs/r1 # a Hugging Face Qwen2 directory

One step: P prompts x G rollouts through the NGC engine (a round every δ tokens at the
curriculum's ε), binary reward, advantage A = r - mean(group), then the replay pass in
micro-batches, L = L_token + L_mem (DESIGN §4), AdamW, grad-norm clipping, constant LR.
Defaults are the paper's; a checkpoint directory may carry an ngc.json whose values replace
them (the tiny model's does), and any flag replaces both.
"""
import argparse
import contextlib
import json
import os
import shutil
import sys
import time

import torch
from tqdm import tqdm

import countdown
from model import CheckpointError, from_pretrained, load_tokenizer, save_pretrained
from ngc import Eviction, Sampling, rollout
from replay import replay

HERE = os.path.dirname(os.path.abspath(__file__))
MODES = {  # mode -> (evict during rollouts, replay masks for log-probs, eviction loss)
    "ngc": (True, True, True),
    "token-only": (True, True, False),  # ablation: replay masks, no L_mem
    "targeted-dropout": (True, False, False),  # ablation: evict, but score tokens under the causal mask
    "no-evict": (False, False, False),  # the full-cache upper bound
}
PAPER = dict(  # Countdown settings of the paper (§5.2, Table 1), for large models
    prompt="plain", difficulty="paper", train_problems=327_680, eval_problems=1024, seed=0,
    steps=250, prompts=32, group=16, max_new_tokens=1024, temperature=0.9, top_k=50,
    mode="ngc", delta=256, block=32, window=5,
    retention="0.9,0.8,0.7,0.6,0.5", stage_steps=25, alpha=0.6, eviction_rate=None,
    interoception=False, interoception_rates="0.25,0.5,0.75", min_length=0,
    lr=5e-6, beta1=0.9, beta2=0.95, adam_eps=1e-15, weight_decay=0.0, clip=1.0,
    micro_batch=4, term_grad_norms=True, eval_every=50, eval_rate=None, eval_batch=64, save_every=50,
)


def run_defaults(model_dir: str) -> dict:
    """The paper's defaults, replaced by the checkpoint's ngc.json where it has one."""
    d = dict(PAPER)
    path = os.path.join(model_dir, "ngc.json")
    if os.path.exists(path):
        with open(path) as f:
            extra = json.load(f)
        unknown = set(extra) - set(d)
        if unknown:
            raise ValueError(f"{path} has unknown keys {sorted(unknown)}")
        d.update(extra)
    return d


# ---------------------------------------------------------------------------------------
# Eviction-rate curriculum (paper §4.6)


def retention_at(step: int, stages: list[float], stage_steps: int, alpha: float) -> float:
    """Staircase over retention p0 = 1 - ε: hold ρ_ℓ for the first (1 - α) of stage ℓ, then
    blend linearly to ρ_{ℓ+1}; the last stage holds ρ_K."""
    last = len(stages) - 1
    stage = min(step // stage_steps, last)
    if stage == last:
        return stages[last]
    s = (step % stage_steps) / stage_steps
    if s < 1 - alpha:
        return stages[stage]
    return stages[stage] + (s - (1 - alpha)) / alpha * (stages[stage + 1] - stages[stage])


def eviction_rate_at(step: int, c) -> float:
    if c.eviction_rate is not None:
        return c.eviction_rate
    return 1 - retention_at(step, floats(c.retention), c.stage_steps, c.alpha)


def floats(text) -> list[float]:
    return [float(x) for x in str(text).split(",")] if text is not None else []


# ---------------------------------------------------------------------------------------
# The objective (DESIGN §4)


def policy_losses(model, ro, adv, ev, c, n_total):
    """L_token and L_mem (None when the mode has none) of rollouts ro with advantages adv (B,).

    Both are normalised by the whole step's rollout count n_total (and L_token by the max
    completion length: Dr. GRPO's constant), so micro-batch losses add up to the step's loss."""
    _, masks, mem = MODES[c.mode]
    tok_lp, ev_lp = replay(model, ro, causal=not masks)
    l_token = -(tok_lp.sum(1) * adv).sum() / (n_total * c.max_new_tokens)  # eq. (2)
    l_mem = None
    if mem and ev_lp is not None:
        per_layer = ev_lp.sum(1) / ro.n_rounds.clamp(min=1)[:, None]  # (B, L): mean over each rollout's rounds
        l_mem = -(adv[:, None] * per_layer).sum() / n_total  # eq. (3), summed over layers
    return l_token, l_mem, tok_lp


def train_step(model, opt, tokenizer, problems, step, c, gen, amp, reward_fn=countdown.reward):
    t0 = time.perf_counter()
    device = model.lm_head.weight.device
    P, G = c.prompts, c.group
    eps = eviction_rate_at(step, c)
    evicting = MODES[c.mode][0]
    ev = Eviction(c.delta, c.block, c.window, eps) if evicting else None
    group_eps = None
    if c.interoception:  # one ε per group, written into its prompts (paper §5.2, Figure 6)
        choices = torch.tensor(floats(c.interoception_rates)) * eps / final_eviction_rate(c)
        group_eps = choices[torch.randint(len(choices), (P,), generator=gen, device=gen.device).cpu()].clamp(0.01, 1)
    rates = None if group_eps is None else group_eps.repeat_interleave(G)
    batch = [problems[(step * P + i) % len(problems)] for i in range(P)]
    prompts = [countdown.encode(tokenizer, p, c.prompt, None if group_eps is None else float(group_eps[i]))
               for i, p in enumerate(batch) for _ in range(G)]
    sampling = Sampling(c.max_new_tokens, c.temperature, c.top_k)
    with amp:
        ro = rollout(model, prompts, sampling, ev, rates=rates, eos_ids=model.config.eos_ids, generator=gen,
                     progress=True)
    t_rollout = time.perf_counter() - t0
    texts = tokenizer.decode_batch(ro.completions(), skip_special_tokens=True)
    correct = torch.tensor([reward_fn(t, batch[i // G]) for i, t in enumerate(texts)])
    reward = torch.where(ro.lengths.cpu() < c.min_length, 0.0, correct)  # Appendix A.1 penalty
    adv = (reward.view(P, G) - reward.view(P, G).mean(1, keepdim=True)).flatten().to(device)

    # Replay the rollouts that carry signal (A = 0 contributes nothing), in micro-batches.
    params = [p for p in model.parameters() if p.requires_grad]
    grads, losses = {}, {"token": 0.0, "mem": 0.0 if MODES[c.mode][2] else None}
    learn = torch.nonzero(adv).flatten()
    for rows in learn.split(c.micro_batch) if len(learn) else []:
        sub = ro.select(rows)
        with amp:
            l_token, l_mem, _ = policy_losses(model, sub, adv[rows], ev, c, n_total=P * G)
        terms = {"token": l_token, **({"mem": l_mem} if l_mem is not None else {})}
        if c.term_grad_norms:  # a separate gradient per term, to log each one's norm
            for i, (name, loss) in enumerate(terms.items()):
                g = torch.autograd.grad(loss, params, retain_graph=i + 1 < len(terms), allow_unused=True)
                acc = grads.setdefault(name, [torch.zeros_like(p) for p in params])
                for a, gi in zip(acc, g):
                    if gi is not None:
                        a += gi
        else:
            sum(terms.values()).backward()
        for name, loss in terms.items():
            losses[name] += loss.item()
    for name, acc in grads.items():
        for p, a in zip(params, acc):
            p.grad = a if p.grad is None else p.grad + a
    norms = {f"grad_norm_{k}": torch.linalg.vector_norm(torch.stack([a.norm() for a in v])).item()
             for k, v in grads.items()}
    grad_norm = 0.0
    if len(learn):
        grad_norm = torch.nn.utils.clip_grad_norm_(params, c.clip).item()
        opt.step()
    opt.zero_grad(set_to_none=True)

    new_tokens = (ro.lengths - ro.prompt_lens).sum().item()
    return {"step": step, "reward": reward.mean().item(), "accuracy": correct.mean().item(), "eps": eps,
            "response_len": (ro.lengths - ro.prompt_lens).float().mean().item(),
            "rounds": ro.n_rounds.float().mean().item(), "L_token": losses["token"], "L_mem": losses["mem"],
            "grad_norm": grad_norm, **norms, "peak_kv": ro.peak_kv.float().mean().item(),
            "step_time": time.perf_counter() - t0, "tokens_per_s": new_tokens / t_rollout}


def final_eviction_rate(c) -> float:
    return c.eviction_rate if c.eviction_rate is not None else 1 - floats(c.retention)[-1]


# ---------------------------------------------------------------------------------------
# Checkpoints: Hugging Face layout plus trainer state, written to a temporary dir and renamed


def save_checkpoint(run_dir, model, tokenizer, opt, gen_state, step, c):
    final, tmp = os.path.join(run_dir, "checkpoint"), os.path.join(run_dir, "checkpoint.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_pretrained(model, tmp)
    tokenizer.save(os.path.join(tmp, "tokenizer.json"))
    ngc = {k: v for k, v in vars(c).items() if k in PAPER}
    with open(os.path.join(tmp, "ngc.json"), "w") as f:
        json.dump(ngc, f, indent=2)
    torch.save({"step": step, "optimizer": opt.state_dict(), "generator": gen_state, "config": ngc},
               os.path.join(tmp, "trainer.pt"))
    if os.path.exists(final):
        os.replace(final, final + ".old")
    os.replace(tmp, final)
    shutil.rmtree(final + ".old", ignore_errors=True)


def make_optimizer(model, c):
    return torch.optim.AdamW(model.parameters(), lr=c.lr, betas=(c.beta1, c.beta2), eps=c.adam_eps,
                             weight_decay=c.weight_decay)


def write_log(path, record):
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def keep_log_before(path, step):
    """On resume, drop log lines of steps that will run again."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = [line for line in f if json.loads(line)["step"] < step]
    with open(path + ".tmp", "w") as f:
        f.writelines(lines)
    os.replace(path + ".tmp", path)


# ---------------------------------------------------------------------------------------
# The command


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default="countdown", choices=["countdown"])
    p.add_argument("--model", default=os.path.join(HERE, "tiny"),
                   help="Qwen2 checkpoint directory: config.json, *.safetensors, tokenizer.json (default: tiny/)")
    p.add_argument("--out", default=None, help="run directory for log.jsonl and checkpoint/ (default: runs/<mode>)")
    p.add_argument("--resume", default=None, metavar="RUN_DIR", help="continue the run saved in RUN_DIR")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default=None,
                   help="compute dtype; weights and optimizer stay fp32 (default: bf16 on cuda, fp32 on cpu)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    g = p.add_argument_group("task and run")
    g.add_argument("--seed", type=int)
    g.add_argument("--steps", type=int, help="optimizer steps")
    g.add_argument("--prompt", choices=sorted(countdown.PROMPTS), help="prompt style")
    g.add_argument("--difficulty", choices=sorted(countdown.DIFFICULTIES))
    g.add_argument("--train-problems", type=int)
    g = p.add_argument_group("rollouts")
    g.add_argument("--prompts", type=int, help="P: distinct prompts per step")
    g.add_argument("--group", type=int, help="G: rollouts per prompt")
    g.add_argument("--max-new-tokens", type=int, help="completion length cap")
    g.add_argument("--temperature", type=float)
    g.add_argument("--top-k", type=int, help="0 disables top-k")
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
    g.add_argument("--min-length", type=int, help="reward 0 when prompt+completion is shorter (Appendix A.1)")
    g = p.add_argument_group("optimisation")
    g.add_argument("--lr", type=float)
    g.add_argument("--beta1", type=float)
    g.add_argument("--beta2", type=float)
    g.add_argument("--adam-eps", type=float)
    g.add_argument("--weight-decay", type=float)
    g.add_argument("--clip", type=float, help="grad-norm clipping")
    g.add_argument("--micro-batch", type=int, help="rollouts per replay forward/backward")
    g.add_argument("--term-grad-norms", action=argparse.BooleanOptionalAction,
                   help="log the grad norm of L_token and L_mem separately (one extra backward)")
    g = p.add_argument_group("evaluation and checkpoints")
    g.add_argument("--eval-every", type=int, help="held-out evaluation every N steps (0: never)")
    g.add_argument("--eval-problems", type=int)
    g.add_argument("--eval-rate", type=float, help="ε for evaluation (default: the final training ε)")
    g.add_argument("--eval-batch", type=int)
    g.add_argument("--save-every", type=int, help="checkpoint every N steps (and at the end)")
    return p.parse_args(argv)


def resolve(args):
    """Fill every unset flag from the resumed run, the checkpoint's ngc.json or the paper."""
    if args.resume:
        state = torch.load(os.path.join(args.resume, "checkpoint", "trainer.pt"), weights_only=False)
        base, args.model, args.out = state["config"], os.path.join(args.resume, "checkpoint"), args.resume
    else:
        base = run_defaults(args.model)
    for k, v in base.items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    args.out = args.out or os.path.join("runs", args.mode)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.dtype = args.dtype or ("bf16" if args.device.startswith("cuda") else "fp32")
    if not 0 < args.alpha <= 1:
        raise ValueError(f"--alpha {args.alpha} must lie in (0, 1]")
    for eps in [eviction_rate_at(s, args) for s in (0, args.steps)] + floats(args.interoception_rates):
        Eviction(args.delta, args.block, args.window, eps)  # one-line errors for bad δ, b, w, ε
    if args.prompts < 1 or args.group < 2:
        raise ValueError("--prompts must be at least 1 and --group at least 2 (advantages are within a group)")
    return args


def main(argv=None, reward_fn=countdown.reward):
    args = parse_args(argv)
    try:
        if args.resume and not os.path.exists(os.path.join(args.resume, "checkpoint", "trainer.pt")):
            raise CheckpointError(f"nothing to resume in {args.resume!r}: it has no checkpoint/trainer.pt")
        c = resolve(args)
        if c.threads:
            torch.set_num_threads(c.threads)
        device = torch.device(c.device)
        model = from_pretrained(c.model, dtype=torch.float32, device=device)
        tokenizer = load_tokenizer(c.model)
        if not model.config.eos_ids:
            raise CheckpointError(f"{c.model}/config.json has no eos_token_id; rollouts could never end early")
    except (CheckpointError, ValueError) as e:
        sys.exit(f"error: {e}")
    amp = (torch.autocast(device.type, dtype=torch.bfloat16) if c.dtype == "bf16" else contextlib.nullcontext())
    opt = make_optimizer(model, c)
    gen = torch.Generator(device=device).manual_seed(c.seed)
    step = 0
    if c.resume:
        state = torch.load(os.path.join(c.resume, "checkpoint", "trainer.pt"), weights_only=False)
        opt.load_state_dict(state["optimizer"])
        gen.set_state(state["generator"])
        step = state["step"]
    os.makedirs(c.out, exist_ok=True)
    log_path = os.path.join(c.out, "log.jsonl")
    keep_log_before(log_path, step)

    difficulty = countdown.DIFFICULTIES[c.difficulty]
    print(f"NGC on Countdown: model {c.model} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f} M params), "
          f"{c.device} {c.dtype}, mode {c.mode}, P={c.prompts} x G={c.group}, δ={c.delta} b={c.block} w={c.window}, "
          f"ε -> {final_eviction_rate(c):g}, steps {step}..{c.steps}, run dir {c.out}")
    train, test = countdown.splits(c.seed, c.train_problems, c.eval_problems, difficulty, unique=False)
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(c.seed)).tolist()
    train = [train[i] for i in order]
    eval_ev = Eviction(c.delta, c.block, c.window, c.eval_rate or final_eviction_rate(c), greedy=True)
    evals = []

    def run_eval():
        from eval import evaluate
        with amp:
            r = evaluate(model, tokenizer, c.prompt, test, eval_ev, c.max_new_tokens, c.eval_batch,
                         interoception=c.interoception, progress=True)
        r = {"step": step, "eval": r}
        evals.append(r)
        write_log(log_path, r)
        tqdm.write(f"eval @ step {step}: accuracy full cache {r['eval']['acc_full']:.1%}, at ε={eval_ev.rate:g} "
                   f"{r['eval']['acc']:.1%}, peak-KV reduction {r['eval']['kv_reduction']:.2f}x")

    t_start = time.time()
    gen_state = gen.get_state()
    try:
        bar = tqdm(total=c.steps, initial=step, desc="train", unit="step")
        while step < c.steps:
            if c.eval_every and step % c.eval_every == 0:
                run_eval()
            gen_state = gen.get_state()
            m = train_step(model, opt, tokenizer, train, step, c, gen, amp, reward_fn)
            step += 1
            gen_state = gen.get_state()
            write_log(log_path, m)
            bar.update(1)
            bar.set_postfix(reward=f"{m['reward']:.2f}", eps=f"{m['eps']:.2f}", len=f"{m['response_len']:.0f}")
            if c.save_every and step % c.save_every == 0 and step < c.steps:
                save_checkpoint(c.out, model, tokenizer, opt, gen_state, step, c)
        bar.close()
        if c.eval_every:
            run_eval()
    except KeyboardInterrupt:
        save_checkpoint(c.out, model, tokenizer, opt, gen_state, step, c)
        print(f"\ninterrupted: saved step {step} to {c.out}/checkpoint; continue with --resume {c.out}")
        return
    save_checkpoint(c.out, model, tokenizer, opt, gen_state, step, c)
    summary(evals, eval_ev.rate, time.time() - t_start, c.out)


def summary(evals, rate, seconds, out):
    print(f"\ndone in {seconds / 60:.1f} min; checkpoint in {out}/checkpoint, log in {out}/log.jsonl")
    if len(evals) < 1:
        return
    first, last = evals[0]["eval"], evals[-1]["eval"]
    print(f"{'held-out accuracy':32s} {'before':>8s} {'after':>8s}")
    print(f"{'full cache':32s} {first['acc_full']:8.1%} {last['acc_full']:8.1%}")
    print(f"{f'ε = {rate:g} (greedy top-K)':32s} {first['acc']:8.1%} {last['acc']:8.1%}")
    print(f"{'peak-KV reduction':32s} {first['kv_reduction']:7.2f}x {last['kv_reduction']:7.2f}x")
    print(f"{'wall time':32s} {'':>8s} {seconds / 60:5.1f} min")


if __name__ == "__main__":
    main()
