"""A run's settings: the dataclass below, whose defaults are the paper's Countdown recipe; MATH, the math
recipe; the --help of train.py's flag for each; their rules and checks.

A run's values are its task's recipe, replaced by the checkpoint's ngc.json where it has one (the tiny
models' do), replaced in turn by any flag (train.resolve). A run saves every setting but where and how it
runs (RUN_ONLY) in ngc.json and trainer.pt. A new setting is a field, its help line and its rule, if any.
"""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, fields, replace

import countdown
from ngc import Eviction, Sampling
from lib import mathtask
from lib.checkpoint import read_json
from lib.cli import Error, at_least, check_values, positive

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root, where tiny/ is
# the model of each task, shipped in the repository root
EXAMPLE = {task: os.path.join(HERE, name) for task, name in [("countdown", "tiny"), ("math", "tiny-math")]}


@dataclass(frozen=True)
class Settings:
    # What a run is, where it runs and writes
    model: str = EXAMPLE["countdown"]
    out: str | None = None
    overwrite: bool = False
    resume: str | None = None
    device: str | None = None
    dtype: str | None = None
    threads: int | None = None
    compile: bool = False
    fsdp: bool = False
    # The task and its problems
    task: str = "countdown"
    prompt: str | None = "plain"
    difficulty: str | None = "paper"
    train_problems: int | None = 327_680
    eval_problems: int | None = None
    data: str | None = None
    eval_data: str | None = None
    question_field: str | None = None
    answer_field: str | None = None
    seed: int = 0
    data_seed: int | None = None
    steps: int = 250
    # Rollouts (§5.2, Table 1)
    prompts: int = 32
    group: int = 16
    max_new_tokens: int = 1024
    temperature: float = 0.9
    top_k: int = 50
    top_p: float = 1.0
    # Eviction (§4.1-4.3) and its curriculum (§4.6)
    mode: str = "ngc"
    delta: int = 256
    block: int = 32
    window: int = 5
    retention: tuple[float, ...] = (0.9, 0.8, 0.7, 0.6, 0.5)
    stage_steps: int = 25
    alpha: float = 0.6
    interoception: bool = False
    interoception_rates: tuple[float, ...] = (0.25, 0.5, 0.75)
    blind_tag: bool = False
    min_length: int = 0
    meta_token: bool = False
    eviction_temperature: float = 1.0
    eviction_draws: int = 1
    # Optimisation
    lr: float = 5e-6
    beta1: float = 0.9
    beta2: float = 0.95
    adam_eps: float = 1e-15
    weight_decay: float = 0.0
    clip: float = 1.0
    micro_batch: int = 4
    mem_norm: str = "paper"
    # Evaluation and checkpoints
    eval_every: int = 50
    eval_batch: int = 64
    save_every: int = 50
    eval_samples: int | None = 4
    eval_temperature: float | None = None  # these three: no train.py flag; ngc.json sets them for train.py's
    # evaluations and eval.py alike (settings.sampling)
    eval_top_p: float | None = None
    eval_max_new_tokens: int | None = None


COUNTDOWN = Settings()  # the paper's Countdown settings (§5.2, Table 1), for large models
MATH = replace(  # DAPO-17k (§5.4, Appendix A.1 "DAPO-17k training hyperparameters")
    COUNTDOWN, task="math", prompt=None, difficulty=None, train_problems=None, eval_problems=None,
    steps=469, prompts=256, group=8, max_new_tokens=1050, temperature=1.0, top_k=0, delta=350,
    min_length=350,  # Appendix A.1: reward 0 for a rollout that ends before the first round (δ)
    beta2=0.999, adam_eps=1e-8, eval_samples=32, eval_temperature=0.6, eval_top_p=0.95, eval_max_new_tokens=3850,
    stage_steps=50,  # the paper does not give the math run's curriculum: Countdown's, in stages of 50 steps
)
RECIPES = {"countdown": COUNTDOWN, "math": MATH}

HELP = {  # train.py's flags, by --help group (None: the first, ungrouped)
    None: dict(
        model="Qwen2 checkpoint directory: config.json, *.safetensors, tokenizer.json (default: tiny/)",
        out="run directory for log.jsonl and checkpoint/ (default: runs/<mode>)",
        overwrite="start afresh in an --out that already holds a run",
        resume="continue the run saved in this directory; a flag given with it changes that setting from there on",
        device="cuda, cuda:N or cpu (default: cuda when present)",
        dtype="compute dtype; weights and optimizer stay fp32 (default: bf16 on cuda, fp32 on cpu)",
        threads="CPU threads for torch (saved: a resume with as many is bit-exact)",
        compile="capture the decode step with torch.compile (CUDA graphs on CUDA): eager's rollouts up to float "
                "rounding; far faster on CUDA, slower on the CPU for a short run (docs/speed.md)",
        fsdp="under torchrun: shard the model, gradients and optimizer state across the processes (FSDP2)"),
    "task and run": dict(
        task="countdown (generated problems) or math (DAPO-17k from --data, AIME/AMC from --eval-data)",
        prompt="prompt style",
        difficulty="problem generator preset (tiny-back: searches that go back; tiny-deep: past the first pair)",
        train_problems="training problems (drawn for countdown, the first N of --data)",
        data="math: training problems, .jsonl or .parquet (DAPO-Math-17k layout)",
        eval_data="math: held-out problems, .jsonl or .parquet (AIME/AMC layout)",
        question_field="math: the question's field in --data/--eval-data rows (a.b for nested)",
        answer_field="math: the answer's field (a.b for nested)",
        seed="seed of the rollouts and evictions (and of the problems without --data-seed)",
        data_seed="seed of the problems and their order (default: --seed): fix it to compare seeds on one held-out set",
        steps="optimizer steps"),
    "rollouts": dict(
        prompts="P: distinct prompts per step", group="G: rollouts per prompt (advantages are within a group)",
        max_new_tokens="completion length cap", temperature="sampling temperature (log-probs use it too)",
        top_k="0 disables top-k", top_p="nucleus sampling, 1 disables it"),
    "eviction (paper §4.1-4.3, §4.6)": dict(
        mode="ngc | token-only (no L_mem) | targeted-dropout (causal log-probs) | no-evict (full cache)",
        delta="δ: a round every δ tokens of a sequence", block="b: block size", window="w: scoring queries",
        retention="curriculum stages ρ_0,...,ρ_K (retention = 1 - ε)", stage_steps="Δ: steps per curriculum stage",
        alpha="fraction of a stage spent blending to the next",
        interoception="one ε per group, written into its prompts' budget tag (<eviction_rate> ... "
                      "</eviction_rate>, countdown.rate_tag)",
        interoception_rates="the rates groups draw from (scaled by curriculum progress)",
        blind_tag="with --interoception, the control: the same per-group ε, the tag without the rate (as many "
                  "tokens: same length, same blocks)",
        min_length="reward 0 when prompt+completion is shorter (Appendix A.1)",
        meta_token="force the meta-token before each round (Appendix, meta-tokens; added as the mean of 'tl;dr')",
        eviction_temperature="τ: training samples blocks by Gumbel-top-k over log s_j / τ; 1 is the paper's, below 1 "
                             "nearer the greedy top K (a departure: docs/departures.md)",
        eviction_draws="K: a group's members share their token noise in sets of K, which differ by their "
                       "eviction draws; L_mem's advantage is over the set (1: the paper's; docs/departures.md)"),
    "optimisation": dict(
        lr="AdamW learning rate, constant", beta1="AdamW β1", beta2="AdamW β2", adam_eps="AdamW ε",
        weight_decay="AdamW weight decay", clip="grad-norm clipping", micro_batch="rollouts per replay pass",
        mem_norm="L_mem's normaliser: paper (eq. 4: per rollout and layer the mean over its rounds) | joint (summed "
                 "over rounds and layers, / L_token's constant: the joint policy's gradient)"),
    "evaluation and checkpoints": dict(
        eval_every="held-out evaluation every N steps (0: never)",
        eval_problems="held-out problems per evaluation: the first N of the split (train.py: validation; eval.py: "
                      "test; default: all)",
        eval_batch="rollouts per evaluation batch",
        save_every="checkpoint every N steps (0: only at the end)",
        eval_samples="pass@1 over this many sampled completions per problem, evictions greedy top-K (§5.1); 0: greedy "
                     "tokens only"),
}
CHOICES = {"dtype": ["bf16", "fp32"], "task": ["countdown", "math"], "prompt": sorted(countdown.PROMPTS),
           "difficulty": sorted(countdown.DIFFICULTIES), "mode": ["ngc", "token-only", "targeted-dropout", "no-evict"],
           "mem_norm": ["paper", "joint"]}


def in_unit(low_open: bool):  # a rule like cli.at_least: (0, 1] or [0, 1)
    return lambda v: (0 < v <= 1 if low_open else 0 <= v < 1) or f"must lie in {'(0, 1]' if low_open else '[0, 1)'}"


RULES = {  # value -> True, or why it is wrong
    **dict.fromkeys(["threads", "train_problems", "eval_problems", "steps", "prompts", "max_new_tokens",
                     "stage_steps", "micro_batch", "eval_batch", "eval_max_new_tokens",
                     "eviction_draws"], at_least(1)),
    **dict.fromkeys(["top_k", "min_length", "weight_decay", "eval_every", "save_every", "eval_samples"], at_least(0)),
    **dict.fromkeys(["temperature", "lr", "adam_eps", "clip", "eval_temperature", "eviction_temperature"],
                   positive),
    **dict.fromkeys(["top_p", "alpha", "eval_top_p"], in_unit(low_open=True)), "group": at_least(2),
    **dict.fromkeys(["beta1", "beta2"], in_unit(low_open=False))}
TYPES = {f.name: f.type for f in fields(Settings)}  # "int", "float | None", "tuple[float, ...]", ...
RUN_ONLY = ["model", "out", "overwrite", "resume", "device", "dtype", "compile", "fsdp"]  # not saved
SESSION = ["model", "device", "dtype", "compile", "fsdp"]  # not saved (a resume may run elsewhere), but recorded
SAVED = [name for name in TYPES if name not in RUN_ONLY]
WORDS = {"bool": "true or false", "int": "an integer", "float": "a number", "str": "a string",
         "tuple[float, ...]": 'comma-separated numbers, such as "0.9,0.7,0.5"'}


def eviction(c: Settings, rate: float, **how) -> Eviction:
    """The run's rounds (δ, b, w) at ε = rate; how: Eviction's other fields (greedy, temperature, score)."""
    return Eviction(c.delta, c.block, c.window, rate, **how)


def sampling(c: Settings, held_out: bool = False, greedy: bool = False, meta_token: int | None = None) -> Sampling:
    """Training's token sampling, or with held_out the evaluations' (train.py's and eval.py's alike):
    eval_temperature, eval_top_p and eval_max_new_tokens where the run sets them."""
    pick = lambda evaluated, trained: evaluated if held_out and evaluated is not None else trained
    return Sampling(pick(c.eval_max_new_tokens, c.max_new_tokens), pick(c.eval_temperature, c.temperature),
                    c.top_k, top_p=pick(c.eval_top_p, c.top_p), greedy=greedy, meta_token=meta_token)


def floats(text) -> tuple[float, ...]:
    """A comma list ("0.9,0.7,0.5", as ngc.json and flags write it) or a list, as a tuple."""
    return tuple(float(x) for x in (text if isinstance(text, (list, tuple)) else str(text).split(",")))


def written(value):
    """A setting's value as ngc.json and flags write it: a tuple as a comma list ("0.9,0.7,0.5"), else itself."""
    return ",".join(f"{x:g}" for x in value) if isinstance(value, tuple) else value


def from_dict(d: dict, base: Settings = COUNTDOWN) -> Settings:
    """`base` with the values of d (ngc.json, trainer.pt or flags); an Error for a bad comma list."""
    values = dict(d)
    for k in [name for name, kind in TYPES.items() if kind.startswith("tuple") and values.get(name) is not None]:
        try:
            values[k] = floats(values[k])
        except ValueError:
            raise Error(f"--{k.replace('_', '-')} {values[k]!r} must be comma-separated numbers") from None
    return replace(base, **values)


def saved(c: Settings) -> dict:
    """The settings a run saves (ngc.json, trainer.pt), comma lists written back as text."""
    return {k: written(getattr(c, k)) for k in SAVED}


def session(c: Settings) -> dict:
    return {k: getattr(c, k) for k in SESSION}


def recorded(c: Settings) -> dict:
    """What trainer.pt records; a resume reports the differences."""
    return {**session(c), **saved(c)}


def value_error(name: str, value) -> str | None:
    """Why `value` (as JSON gives it) cannot be setting `name`'s, in words after "it" (None: it can)."""
    kind, optional = TYPES[name].removesuffix(" | None"), TYPES[name].endswith(" | None")
    if value is None:
        return None if optional else f"must be {WORDS[kind]}, not null"
    try:
        fits = (isinstance(value, (str, list)) and bool(floats(value)) if kind.startswith("tuple") else
                type(value) in {"bool": (bool,), "int": (int,), "float": (int, float), "str": (str,)}[kind])
    except (TypeError, ValueError):
        fits = False
    if not fits:
        return f"must be {WORDS[kind]}" + (" or null" if optional else "")
    if value not in CHOICES.get(name, [value]):
        return f"must be one of {', '.join(CHOICES[name])}"
    return None if RULES.get(name, lambda v: True)(value) is True else RULES[name](value)


def check_saved(values, path: str) -> dict:
    """The settings a run saved (ngc.json, trainer.pt's), or an Error naming path and the first key or
    value no setting takes."""
    if not isinstance(values, dict):
        raise Error(f"{path} holds a JSON {type(values).__name__}; it must be an object of train.py's settings, "
                    f"such as {{\"steps\": 60}}")
    if unknown := set(values) - set(SAVED):
        raise Error(f"{path} has unknown keys {sorted(unknown)}; the known ones are train.py's flags")
    for key, value in values.items():
        if wrong := value_error(key, value):
            raise Error(f"{path}: {key} is {json.dumps(value)}; it {wrong}")
    for key in ("prompt", "difficulty"):  # null in a math run's ngc.json; Countdown's problems need them
        if values.get("task", "countdown") == "countdown" and key in values and values[key] is None:
            raise Error(f"{path}: {key} is null; a Countdown run's must be one of {', '.join(CHOICES[key])}")
    return values


def read_ngc_json(model_dir: str) -> dict:
    """A checkpoint's ngc.json ({} without one), checked (check_saved)."""
    path = os.path.join(model_dir, "ngc.json")
    return check_saved(read_json(path, "; fix or delete it"), path) if os.path.exists(path) else {}


def run_defaults(model_dir: str, task: str | None = None, flag: str = "--model") -> Settings:
    """The recipe of `task` (else of the task ngc.json names, else Countdown's) under the checkpoint's
    ngc.json. Every script's check that a model is of the task it needs: an Error if ngc.json names another
    (the model learned that task's prompts, and ngc.json's values are that task's recipe)."""
    extra = read_ngc_json(model_dir)
    trained = extra.get("task", task)
    if task and trained != task:
        example = EXAMPLE[task]
        example = example if os.path.relpath(example).startswith("..") else os.path.relpath(example)
        raise Error(f"{flag} {model_dir} was trained on {trained} (its ngc.json), not {task}: give a {task} model, "
                    f"such as {example}, or a copy of {model_dir} without ngc.json to start from its weights")
    task = trained or "countdown"
    return from_dict({**extra, "task": task, "model": model_dir}, RECIPES[task])


def check(c: Settings):
    """An Error for the first setting of c that a run cannot use, at any of its steps."""
    if c.out is not None and not c.out.strip():
        raise Error("--out is empty; give the run directory")
    check_values(c, RULES)
    for name, what, rule in (("retention", "stage", in_unit(low_open=False)), ("interoception_rates", "rate",
                                                                                in_unit(low_open=True))):
        for i, value in enumerate(getattr(c, name)):  # every stage of the schedule, every rate a group draws
            if rule(value) is not True:
                raise Error(f"--{name.replace('_', '-')} {saved(c)[name]}: {what} {i + 1}, {value:g}, {rule(value)}")
    if c.task == "math":
        if not c.data or (c.eval_every and not c.eval_data):
            raise Error("--task math reads its problems from files: --data FILE (training) and --eval-data FILE "
                        "(held-out; or --eval-every 0), JSONL or Parquet; see mathtask.py for the datasets")
        if c.interoception or c.blind_tag:
            raise Error("--interoception writes the budget into Countdown's prompts; --task math has no such tag")
        for path in (c.data, c.eval_data):
            if path and not os.path.isfile(path):
                raise Error(f"no such file: {path}{mathtask.demo_hint(path)}")
    if c.blind_tag and not c.interoception:
        raise Error("--blind-tag is the control for --interoception (the same per-group ε, the rate hidden); "
                    "add --interoception")


def add_flags(p, defaults: Settings | None, names=None, helps=None, required=()):
    """Each setting of HELP (or those in `names`) as a --flag of p, defaulting to None (the script fills unset
    ones). A saved one's help ends with its value in `defaults` (None: not shown); helps: a script's own."""
    for group, flags in HELP.items():
        target = p if group is None else p.add_argument_group(group)
        for name in [n for n in flags if names is None or n in names]:
            kind, default = TYPES[name].removesuffix(" | None"), defaults and getattr(defaults, name)
            kw = ({"action": argparse.BooleanOptionalAction} if kind == "bool" else
                  {"type": {"int": int, "float": float}.get(kind, str), "choices": CHOICES.get(name)})
            shown = written(default)
            help = (helps or {}).get(name, flags[name]) + (f" (default {shown})" if name in SAVED and shown is not None
                                                           else "")
            target.add_argument(f"--{name.replace('_', '-')}", default=None, help=help.replace("%", "%%"),
                                required=name in required, **kw)
