"""A run's settings: each field with its default (the paper's Countdown recipe), the --help line
of train.py's flag and its rule; MATH, the math recipe. A run's values are its task's recipe,
under the checkpoint's ngc.json, under its flags (train.resolve); it saves all but RUN_ONLY in
ngc.json and trainer.pt. A new setting is one field."""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field, fields, replace
from types import UnionType
from typing import get_args, get_origin, get_type_hints

import countdown
from ngc import Eviction, Sampling
from lib import mathtask
from lib.checkpoint import read_json
from lib.cli import Error, at_least, check_values, positive

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root (tiny/)
# the model of each task, shipped in the repository root
EXAMPLE = {task: os.path.join(HERE, name)
           for task, name in [("countdown", "tiny"), ("math", "tiny-math")]}


def in_unit(low_open: bool):  # a rule like cli.at_least: (0, 1] or [0, 1)
    return lambda v: (0 < v <= 1 if low_open else 0 <= v < 1) or \
        f"must lie in {'(0, 1]' if low_open else '[0, 1)'}"


def setting(default, help=None, rule=None, choices=None):
    """A field of Settings: its default, train.py's --help line (None: no flag), the rule a value
    must pass (value -> True, or why it is wrong) and the values it may take."""
    return field(default=default, metadata=dict(help=help, rule=rule, choices=choices))


@dataclass(frozen=True)
class Settings:
    # What a run is, where it runs and writes
    model: str = setting(EXAMPLE["countdown"], "Qwen2 checkpoint directory: config.json, "
                         "*.safetensors, tokenizer.json (default: tiny/)")
    out: str | None = setting(None, "run directory for log.jsonl and checkpoint/ (default: "
                              "runs/<mode>)")
    overwrite: bool = setting(False, "start afresh in an --out that already holds a run")
    resume: str | None = setting(None, "continue the run saved in this directory; a flag given "
                                 "with it changes that setting from there on")
    device: str | None = setting(None, "cuda, cuda:N or cpu (default: cuda when present)")
    dtype: str | None = setting(None, "compute dtype; weights and optimizer stay fp32 (default: "
                                "bf16 on cuda, fp32 on cpu)", choices=["bf16", "fp32"])
    threads: int | None = setting(None, "CPU threads for torch (saved: a resume with as many is "
                                  "bit-exact)", at_least(1))
    compile: bool = setting(False, "capture the decode step with torch.compile (CUDA graphs on "
                            "CUDA): eager's rollouts up to float rounding; far faster on CUDA, "
                            "slower on the CPU for a short run (docs/speed.md)")
    fsdp: bool = setting(False, "under torchrun: shard the model, gradients and optimizer state "
                         "across the processes (FSDP2)")
    # The task and its problems
    task: str = setting("countdown", "countdown (generated problems) or math (DAPO-17k from "
                        "--data, AIME/AMC from --eval-data)", choices=["countdown", "math"])
    prompt: str | None = setting("plain", "prompt style", choices=sorted(countdown.PROMPTS))
    difficulty: str | None = setting("paper", "problem generator preset (tiny-back: searches that "
                                     "go back; tiny-deep: past the first pair)",
                                     choices=sorted(countdown.DIFFICULTIES))
    train_problems: int | None = setting(327_680, "training problems (drawn for countdown, the "
                                         "first N of --data)", at_least(1))
    eval_problems: int | None = setting(None, "held-out problems per evaluation: the first N of "
                                        "the split (train.py: validation; eval.py: test; default: "
                                        "all)",
                                        at_least(1))
    data: str | None = setting(None, "math: training problems, .jsonl or .parquet (DAPO-Math-17k "
                               "layout)")
    eval_data: str | None = setting(None, "math: held-out problems, .jsonl or .parquet (AIME/AMC "
                                    "layout)")
    question_field: str | None = setting(None, "math: the question's field in --data/--eval-data "
                                         "rows (a.b for nested)")
    answer_field: str | None = setting(None, "math: the answer's field (a.b for nested)")
    seed: int = setting(0, "seed of the rollouts and evictions (and of the problems without "
                        "--data-seed)")
    data_seed: int | None = setting(None, "seed of the problems and their order (default: --seed): "
                                    "fix it to compare seeds on one held-out set")
    steps: int = setting(250, "optimizer steps", at_least(1))
    # Rollouts (§5.2, Table 1)
    prompts: int = setting(32, "P: distinct prompts per step", at_least(1))
    group: int = setting(16, "G: rollouts per prompt (advantages are within a group)", at_least(2))
    max_new_tokens: int = setting(1024, "completion length cap", at_least(1))
    temperature: float = setting(0.9, "sampling temperature (log-probs use it too)", positive)
    top_k: int = setting(50, "0 disables top-k", at_least(0))
    top_p: float = setting(1.0, "nucleus sampling, 1 disables it", in_unit(low_open=True))
    # Eviction (§4.1-4.3) and its curriculum (§4.6)
    mode: str = setting("ngc", "ngc | token-only (no L_mem) | targeted-dropout (causal log-probs) "
                        "| no-evict (full cache)",
                        choices=["ngc", "token-only", "targeted-dropout", "no-evict"])
    delta: int = setting(256, "δ: a round every δ tokens of a sequence")
    block: int = setting(32, "b: block size")
    window: int = setting(5, "w: scoring queries")
    retention: tuple[float, ...] = setting((0.9, 0.8, 0.7, 0.6, 0.5), "curriculum stages "
                                           "ρ_0,...,ρ_K (retention = 1 - ε)")
    stage_steps: int = setting(25, "Δ: steps per curriculum stage", at_least(1))
    alpha: float = setting(0.6, "fraction of a stage spent blending to the next",
                           in_unit(low_open=True))
    interoception: bool = setting(False, "one ε per group, written into its prompts' budget tag "
                                  "(<eviction_rate> ... </eviction_rate>, countdown.rate_tag)")
    interoception_rates: tuple[float, ...] = setting((0.25, 0.5, 0.75), "the rates groups draw "
                                                     "from (scaled by curriculum progress)")
    blind_tag: bool = setting(False, "with --interoception, the control: the same per-group ε, the "
                              "tag without the rate (as many tokens: same length, same blocks)")
    min_length: int = setting(0, "reward 0 when prompt+completion is shorter (Appendix A.1)",
                              at_least(0))
    meta_token: bool = setting(False, "force the meta-token before each round (Appendix, "
                               "meta-tokens; added as the mean of 'tl;dr')")
    eviction_temperature: float = setting(1.0, "τ: training samples blocks by Gumbel-top-k over "
                                          "log s_j / τ; 1 is the paper's, below 1 nearer the "
                                          "greedy top K (a departure: docs/departures.md)",
                                          positive)
    eviction_draws: int = setting(1, "K: a group's members share their token noise in sets of K, "
                                  "which differ by their eviction draws; L_mem's advantage is over "
                                  "the set (1: the paper's; docs/departures.md)", at_least(1))
    full_cache_groups: int = setting(0, "the last N prompt groups of each step roll out with the "
                                     "full cache (ε = 0) and teach the tokens alone (0: the "
                                     "paper's; docs/departures.md)", at_least(0))
    # Optimisation
    lr: float = setting(5e-6, "AdamW learning rate, constant", positive)
    beta1: float = setting(0.9, "AdamW β1", in_unit(low_open=False))
    beta2: float = setting(0.95, "AdamW β2", in_unit(low_open=False))
    adam_eps: float = setting(1e-15, "AdamW ε", positive)
    weight_decay: float = setting(0.0, "AdamW weight decay", at_least(0))
    clip: float = setting(1.0, "grad-norm clipping", positive)
    micro_batch: int = setting(4, "rollouts per replay pass", at_least(1))
    mem_norm: str = setting("paper", "L_mem's normaliser: paper (eq. 4: per rollout and layer the "
                            "mean over its rounds) | joint (summed over rounds and layers, / "
                            "L_token's constant: the joint policy's gradient)",
                            choices=["paper", "joint"])
    # Evaluation and checkpoints
    eval_every: int = setting(50, "held-out evaluation every N steps (0: never)", at_least(0))
    eval_batch: int = setting(64, "rollouts per evaluation batch", at_least(1))
    save_every: int = setting(50, "checkpoint every N steps (0: only at the end)", at_least(0))
    eval_samples: int | None = setting(4, "pass@1 over this many sampled completions per problem, "
                                       "evictions greedy top-K (§5.1); 0: greedy tokens only",
                                       at_least(0))
    # No flag: ngc.json sets these for train.py's evaluations and eval.py alike (settings.sampling)
    eval_temperature: float | None = setting(None, rule=positive)
    eval_top_p: float | None = setting(None, rule=in_unit(low_open=True))
    eval_max_new_tokens: int | None = setting(None, rule=at_least(1))


GROUPS = {  # the --help groups, each from this flag on
    "task": "task and run", "prompts": "rollouts", "mode": "eviction (paper §4.1-4.3, §4.6)",
    "lr": "optimisation", "eval_every": "evaluation and checkpoints"}


COUNTDOWN = Settings()  # the paper's Countdown settings (§5.2, Table 1), for large models
MATH = replace(  # DAPO-17k (§5.4, Appendix A.1 "DAPO-17k training hyperparameters")
    COUNTDOWN, task="math", prompt=None, difficulty=None, train_problems=None, eval_problems=None,
    steps=469, prompts=256, group=8, max_new_tokens=1050, temperature=1.0, top_k=0, delta=350,
    min_length=350,  # Appendix A.1: reward 0 for a rollout that ends before the first round (δ)
    beta2=0.999, adam_eps=1e-8, eval_samples=32, eval_temperature=0.6, eval_top_p=0.95,
    eval_max_new_tokens=3850,
    stage_steps=50,  # the paper gives no math curriculum: Countdown's, in stages of 50 steps
)
RECIPES = {"countdown": COUNTDOWN, "math": MATH}

HELP = {f.name: f.metadata["help"] for f in fields(Settings) if f.metadata["help"]}  # the flags
CHOICES = {f.name: f.metadata["choices"] for f in fields(Settings) if f.metadata["choices"]}
RULES = {f.name: f.metadata["rule"] for f in fields(Settings) if f.metadata["rule"]}
TYPES = get_type_hints(Settings)  # int, float | None, tuple[float, ...], ...
RUN_ONLY = ["model", "out", "overwrite", "resume", "device", "dtype", "compile", "fsdp"]  # unsaved
SESSION = ["model", "device", "dtype", "compile", "fsdp"]  # recorded, unsaved: a resume may differ
SAVED = [name for name in TYPES if name not in RUN_ONLY]
WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string",
         tuple: 'comma-separated numbers, such as "0.9,0.7,0.5"'}


def kind(name: str) -> type:
    """Setting name's type without its None: bool, int, float, str or tuple."""
    hint = get_args(TYPES[name])[0] if isinstance(TYPES[name], UnionType) else TYPES[name]
    return get_origin(hint) or hint


def eviction(cfg: Settings, rate: float, **how) -> Eviction:
    """The run's rounds (δ, b, w) at ε = rate; how: Eviction's other fields."""
    return Eviction(cfg.delta, cfg.block, cfg.window, rate, **how)


def sampling(cfg: Settings, held_out: bool = False, greedy: bool = False,
             meta_token: int | None = None) -> Sampling:
    """Training's token sampling, or with held_out the evaluations' (train.py's and eval.py's):
    eval_temperature, eval_top_p and eval_max_new_tokens where the run sets them."""
    pick = lambda evaluated, trained: evaluated if held_out and evaluated is not None else trained
    return Sampling(pick(cfg.eval_max_new_tokens, cfg.max_new_tokens),
                    pick(cfg.eval_temperature, cfg.temperature), cfg.top_k,
                    top_p=pick(cfg.eval_top_p, cfg.top_p), greedy=greedy, meta_token=meta_token)


def floats(text) -> tuple[float, ...]:
    """A comma list ("0.9,0.7,0.5", as ngc.json and flags write it) or a list, as a tuple."""
    items = text if isinstance(text, (list, tuple)) else str(text).split(",")
    return tuple(float(x) for x in items)


def written(value):
    """A setting's value as ngc.json and flags write it (a tuple as a comma list)."""
    return ",".join(f"{x:g}" for x in value) if isinstance(value, tuple) else value


def from_dict(d: dict, base: Settings = COUNTDOWN) -> Settings:
    """`base` with the values of d (ngc.json, trainer.pt or flags)."""
    values = dict(d)
    for k in [name for name in TYPES if kind(name) is tuple and values.get(name) is not None]:
        try:
            values[k] = floats(values[k])
        except ValueError:
            raise Error(f"--{k.replace('_', '-')} {values[k]!r} must be comma-separated "
                        "numbers") from None
    return replace(base, **values)


def saved(cfg: Settings) -> dict:
    """The settings a run saves (ngc.json, trainer.pt), comma lists written back as text."""
    return {k: written(getattr(cfg, k)) for k in SAVED}


def session(cfg: Settings) -> dict:
    return {k: getattr(cfg, k) for k in SESSION}


def recorded(cfg: Settings) -> dict:
    """What trainer.pt records; a resume reports the differences."""
    return {**session(cfg), **saved(cfg)}


def value_error(name: str, value) -> str | None:
    """Why `value` (as JSON gives it) cannot be setting `name`'s, after "it" (None: it can)."""
    optional, words = isinstance(TYPES[name], UnionType), WORDS[kind(name)]
    if value is None:
        return None if optional else f"must be {words}, not null"
    try:
        fits = (isinstance(value, (str, list)) and bool(floats(value)) if kind(name) is tuple
                else type(value) in {float: (int, float)}.get(kind(name), (kind(name),)))
    except (TypeError, ValueError):
        fits = False
    if not fits:
        return f"must be {words}" + (" or null" if optional else "")
    if value not in CHOICES.get(name, [value]):
        return f"must be one of {', '.join(CHOICES[name])}"
    return None if RULES.get(name, lambda v: True)(value) is True else RULES[name](value)


def check_saved(values, path: str) -> dict:
    """The settings a run saved (ngc.json, trainer.pt's), or an Error naming path and the first key
    or value no setting takes."""
    if not isinstance(values, dict):
        raise Error(f"{path} holds a JSON {type(values).__name__}, not an object of settings")
    if unknown := set(values) - set(SAVED):
        raise Error(f"{path} has unknown keys {sorted(unknown)}; the known ones are train.py's "
                    "flags")
    countdown_run = values.get("task", "countdown") == "countdown"
    for key, value in values.items():
        if value is None and countdown_run and key in ("prompt", "difficulty"):
            raise Error(f"{path}: {key} is null; a Countdown run's must be one of "
                        f"{', '.join(CHOICES[key])}")  # null in a math run's ngc.json
        if wrong := value_error(key, value):
            raise Error(f"{path}: {key} is {json.dumps(value)}; it {wrong}")
    return values


def read_ngc_json(model_dir: str) -> dict:
    """A checkpoint's ngc.json ({} without one), checked (check_saved)."""
    path = os.path.join(model_dir, "ngc.json")
    return check_saved(read_json(path, "; fix or delete it"), path) if os.path.exists(path) else {}


def run_defaults(model_dir: str, task: str | None = None, flag: str = "--model") -> Settings:
    """The recipe of `task` (else of the task ngc.json names, else Countdown's) under the
    checkpoint's ngc.json; an Error if ngc.json names another task (every script's check)."""
    extra = read_ngc_json(model_dir)
    trained = extra.get("task", task)
    if task and trained != task:
        example = EXAMPLE[task]
        example = example if os.path.relpath(example).startswith("..") else os.path.relpath(example)
        raise Error(f"{flag} {model_dir} was trained on {trained} (its ngc.json), not {task}: "
                    f"give a {task} model, such as {example}, or a copy of {model_dir} without "
                    "ngc.json to start from its weights")
    task = trained or "countdown"
    return from_dict({**extra, "task": task, "model": model_dir}, RECIPES[task])


def check(cfg: Settings):
    """An Error for the first setting of cfg that a run cannot use, at any of its steps."""
    if cfg.out is not None and not cfg.out.strip():
        raise Error("--out is empty; give the run directory")
    check_values(cfg, RULES)
    for name, what, rule in (("retention", "stage", in_unit(low_open=False)),
                             ("interoception_rates", "rate", in_unit(low_open=True))):
        for i, value in enumerate(getattr(cfg, name)):  # every stage, every rate a group draws
            if rule(value) is not True:
                raise Error(f"--{name.replace('_', '-')} {saved(cfg)[name]}: {what} {i + 1}, "
                            f"{value:g}, {rule(value)}")
    if cfg.task == "math":
        if not cfg.data or (cfg.eval_every and not cfg.eval_data):
            raise Error("--task math reads its problems from files: give --data FILE and "
                        "--eval-data FILE (or --eval-every 0), JSONL or Parquet (mathtask.py)")
        if cfg.interoception or cfg.blind_tag:
            raise Error("--interoception writes the budget into Countdown's prompts; --task math "
                        "has no such tag")
        for path in (cfg.data, cfg.eval_data):
            if path and not os.path.isfile(path):
                raise Error(f"no such file: {path}{mathtask.demo_hint(path)}")
    if cfg.blind_tag and not cfg.interoception:
        raise Error("--blind-tag is the control for --interoception: add --interoception")


def add_flags(p, defaults: Settings | None, names=None, helps=None, required=()):
    """Each setting with a help line (or those in `names`) as a --flag of p in its --help group,
    default None (unset); a saved one's help shows its value in `defaults`; helps: the script's."""
    target = p
    for name, line in HELP.items():
        target = p.add_argument_group(GROUPS[name]) if name in GROUPS else target  # shown if used
        if names is not None and name not in names:
            continue
        kw = ({"action": argparse.BooleanOptionalAction} if kind(name) is bool else
              {"type": kind(name) if kind(name) in (int, float) else str,
               "choices": CHOICES.get(name)})
        shown = written(defaults and getattr(defaults, name))
        help = (helps or {}).get(name, line)
        help += f" (default {shown})" if name in SAVED and shown is not None else ""
        target.add_argument(f"--{name.replace('_', '-')}", default=None,
                            help=help.replace("%", "%%"), required=name in required, **kw)
