"""The tasks' recipes (the paper's hyperparameters), their problems, prompts and rewards.

A run's settings are the paper's recipe for its task, replaced by the checkpoint's ngc.json
where it has one (the tiny models' do), replaced in turn by any command-line flag.
"""
import json
import os
from types import SimpleNamespace

import torch

import countdown
import mathtask
from checkpoint import CheckpointError

COUNTDOWN = dict(  # the paper's Countdown settings (§5.2, Table 1), for large models
    task="countdown", prompt="plain", difficulty="paper", train_problems=327_680, eval_problems=1024,
    data=None, eval_data=None, question_field=None, answer_field=None, seed=0, data_seed=None,
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
    stage_steps=50,  # the paper does not give the math run's curriculum: Countdown's, in stages of 50 steps
)
RECIPES = {"countdown": COUNTDOWN, "math": MATH}
LISTS = ("retention", "interoception_rates")  # comma lists, parsed once into lists of floats
AT_LEAST_ONE = ("steps", "prompts", "train_problems", "eval_problems", "max_new_tokens", "stage_steps",
                "micro_batch", "eval_batch")
AT_LEAST_ZERO = ("top_k", "min_length", "eval_every", "save_every", "weight_decay")
POSITIVE = ("temperature", "lr", "adam_eps", "clip")

TASK_REWARD = {"countdown": countdown.reward, "math": mathtask.reward}


def as_settings(c) -> dict:
    """Run settings c (train.py's resolved flags) as ngc.json and trainer.pt keep them: the
    recipe's keys, comma lists written back as text."""
    text = lambda v: ",".join(f"{x:g}" for x in v) if isinstance(v, list) else v
    return {k: text(getattr(c, k)) for k in COUNTDOWN}


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


def data_seed(c) -> int:
    """The seed of a run's problems and their order: --data-seed, else --seed (which always seeds
    the rollouts and evictions)."""
    return c.seed if getattr(c, "data_seed", None) is None else c.data_seed


def load_problems(c):
    """(training problems in the data seed's order, held-out problems) of settings c: Countdown's
    are generated from the data seed, math problems are read from --data and --eval-data."""
    if c.task == "countdown":
        difficulty = countdown.DIFFICULTIES[c.difficulty]
        train, test = countdown.splits(data_seed(c), c.train_problems, c.eval_problems, difficulty, unique=False)
    else:
        train = mathtask.load(c.data, c.question_field, c.answer_field)[: c.train_problems] if c.data else []
        test = (mathtask.load(c.eval_data, c.question_field, c.answer_field) if c.eval_data else [])[: c.eval_problems]
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(data_seed(c))).tolist()
    return [train[i] for i in order], test


def held_out(d: dict, n: int | None = None) -> list:
    """The first n (default all) held-out problems of a run with settings d, or a one-line ValueError."""
    if d["task"] == "math" and not (d["eval_data"] and os.path.isfile(d["eval_data"])):
        raise ValueError(f"--task math needs --eval-data FILE (AIME/AMC as JSONL or Parquet); got {d['eval_data']}")
    _, test = load_problems(SimpleNamespace(**{**d, "train_problems": 0, "data": None}))
    if n is not None and n > len(test):
        raise ValueError(f"--problems {n}: the run's test split has {len(test)} problems")
    return test[:n]


def prompt_encoder(task: str, style: str | None = None, eviction_rate=None, blind: bool = False):
    """encode(tokenizer, problem) -> prompt ids for the task (Countdown: in prompt style `style`,
    with the budget tag when eviction_rate is given, the rate hidden when blind)."""
    if task == "math":
        return mathtask.encode
    return lambda tokenizer, problem: countdown.encode(tokenizer, problem, style, eviction_rate, blind)


def check_settings(c):
    """Check run settings c (train.py's flags over the recipe) and parse its comma lists into
    lists of floats, in place; a ValueError with a one-line message for the first bad one."""
    for k in LISTS:
        try:
            c.__dict__[k] = [float(x) for x in str(getattr(c, k)).split(",")]
        except ValueError:
            raise ValueError(f"--{k.replace('_', '-')} {getattr(c, k)!r} must be comma-separated numbers")
    for k in AT_LEAST_ONE + AT_LEAST_ZERO + POSITIVE:
        v, least = getattr(c, k), 1 if k in AT_LEAST_ONE else 0
        if v is not None and ((v <= 0) if k in POSITIVE else (v < least)):
            raise ValueError(f"--{k.replace('_', '-')} {v} must be " + ("positive" if k in POSITIVE else f"at least {least}"))
    if c.threads is not None and c.threads < 1:
        raise ValueError(f"--threads {c.threads} must be at least 1")
    if not (0 <= c.beta1 < 1 and 0 <= c.beta2 < 1):
        raise ValueError(f"--beta1 {c.beta1} and --beta2 {c.beta2} must lie in [0, 1)")
    if c.task == "math":
        if not c.data or (c.eval_every and not c.eval_data):
            raise ValueError("--task math reads its problems from files: --data FILE (training) and --eval-data FILE "
                             "(held-out; or --eval-every 0), JSONL or Parquet; see mathtask.py for the datasets")
        if c.interoception or c.blind_tag:
            raise ValueError("--interoception writes the budget into Countdown's prompts; --task math has no such tag")
        for path in (c.data, c.eval_data):
            if path and not os.path.isfile(path):
                raise ValueError(f"no such file: {path}")
    if not 0 < c.top_p <= 1:
        raise ValueError(f"--top-p {c.top_p} must lie in (0, 1]")
    if not 0 < c.alpha <= 1:
        raise ValueError(f"--alpha {c.alpha} must lie in (0, 1]")
    if c.blind_tag and not c.interoception:
        raise ValueError("--blind-tag is the control for --interoception (the same per-group ε, the rate hidden); "
                         "add --interoception")
    if c.prompts < 1 or c.group < 2:
        raise ValueError("--prompts must be at least 1 and --group at least 2 (advantages are within a group)")
