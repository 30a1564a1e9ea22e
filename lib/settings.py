"""A run's settings, defined once: each is one line below with its default, its help and its check.

From this one definition come the per-task recipes (the paper's Countdown recipe; MATH replaces a few),
train.py's flags and their --help, the checks of a run's values and what a run saves (ngc.json, trainer.pt).
A run's values are its task's recipe, replaced by the checkpoint's ngc.json where it has one (the tiny
models' do), replaced in turn by any flag (train.resolve). A new setting is one line here plus its use.
"""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field, fields, replace

import countdown
from lib import mathtask
from lib.checkpoint import CheckpointError, read_json
from lib.cli import at_least, check_values, positive

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root, where tiny/ is

RUN, TASK, ROLLOUT, EVICTION, OPTIM, EVAL = ("run", "task and run", "rollouts", "eviction (paper §4.1-4.3, §4.6)",
                                           "optimisation", "evaluation and checkpoints")


def in_unit(low_open: bool):  # a rule like cli.at_least: (0, 1] or [0, 1)
    return lambda v: (0 < v <= 1 if low_open else 0 <= v < 1) or f"must lie in {'(0, 1]' if low_open else '[0, 1)'}"


def setting(default, help: str, group: str = TASK, check=None, saved: bool = True, cli: bool = True, **flag):
    """One setting: its default, --help, flag group, check (value -> True or why it is wrong), whether a run
    saves it (ngc.json, trainer.pt) and whether train.py has its flag; flag: more argparse keywords."""
    return field(default=default, metadata=dict(help=help, group=group, check=check, saved=saved, cli=cli, flag=flag))


@dataclass(frozen=True)
class Settings:
    # What a run is, where it runs and writes; not part of its recipe.
    model: str = setting(os.path.join(HERE, "tiny"), "Qwen2 checkpoint directory: config.json, *.safetensors, "
                         "tokenizer.json (default: tiny/)", RUN, saved=False)
    out: str | None = setting(None, "run directory for log.jsonl and checkpoint/ (default: runs/<mode>)", RUN,
                              saved=False)
    overwrite: bool = setting(False, "start afresh in an --out that already holds a run", RUN, saved=False,
                              action="store_true")
    resume: str | None = setting(None, "continue the run saved in RUN_DIR; a flag given with it changes that "
                                 "setting from there on (the change is printed)", RUN, saved=False, metavar="RUN_DIR")
    device: str | None = setting(None, "cuda, cuda:N or cpu (default: cuda when present)", RUN, saved=False)
    dtype: str | None = setting(None, "compute dtype; weights and optimizer stay fp32 (default: bf16 on cuda, fp32 "
                                "on cpu)", RUN, saved=False, choices=["bf16", "fp32"])
    threads: int | None = setting(None, "CPU threads for torch (saved: a resume with as many is bit-exact)", RUN,
                                  at_least(1))
    compile: bool = setting(False, "capture the decode step with torch.compile (CUDA graphs on CUDA): eager's "
                            "rollouts up to float rounding; far faster on CUDA, while on the CPU its compiles cost "
                            "more than a 60-step run saves (docs/speed.md)", RUN, saved=False, action="store_true")
    fsdp: bool = setting(False, "under torchrun: shard the model, gradients and optimizer state across the "
                         "processes (FSDP2) instead of a whole copy each", RUN, saved=False, action="store_true")
    # The task and its problems
    task: str = setting("countdown", "countdown (generated problems) or math (DAPO-17k from --data, AIME/AMC from "
                        "--eval-data)", choices=["countdown", "math"])
    prompt: str | None = setting("plain", "prompt style", choices=sorted(countdown.PROMPTS))
    difficulty: str | None = setting("paper", "problem generator preset (tiny-back: the tiny problems whose "
                                     "search must go back)", choices=sorted(countdown.DIFFICULTIES))
    train_problems: int | None = setting(327_680, "training problems (drawn for countdown, the first N of --data)",
                                         check=at_least(1))
    eval_problems: int | None = setting(1024, "held-out problems", EVAL, at_least(1))
    data: str | None = setting(None, "math: training problems, .jsonl or .parquet (DAPO-Math-17k layout)")
    eval_data: str | None = setting(None, "math: held-out problems, .jsonl or .parquet (AIME/AMC layout)")
    question_field: str | None = setting(None, "math: the question's field in --data/--eval-data rows (a.b for nested)")
    answer_field: str | None = setting(None, "math: the answer's field (a.b for nested)")
    seed: int = setting(0, "seed of the rollouts and evictions (and of the problems without --data-seed)")
    data_seed: int | None = setting(None, "seed of the training and held-out problems and their order (default: "
                                    "--seed); fix it to compare seeds on one held-out set")
    steps: int = setting(250, "optimizer steps", check=at_least(1))
    # Rollouts (§5.2, Table 1)
    prompts: int = setting(32, "P: distinct prompts per step", ROLLOUT, at_least(1))
    group: int = setting(16, "G: rollouts per prompt (advantages are within a group)", ROLLOUT, at_least(2))
    max_new_tokens: int = setting(1024, "completion length cap", ROLLOUT, at_least(1))
    temperature: float = setting(0.9, "sampling temperature (log-probs use it too)", ROLLOUT, positive)
    top_k: int = setting(50, "0 disables top-k", ROLLOUT, at_least(0))
    top_p: float = setting(1.0, "nucleus sampling, 1 disables it", ROLLOUT, in_unit(low_open=True))
    # Eviction (§4.1-4.3) and its curriculum (§4.6)
    mode: str = setting("ngc", "ngc | token-only (no L_mem) | mem-only (no L_token) | targeted-dropout | no-evict "
                        "(full cache)", EVICTION, choices=["ngc", "token-only", "mem-only", "targeted-dropout", "no-evict"])
    delta: int = setting(256, "δ: a round every δ tokens of a sequence", EVICTION)
    block: int = setting(32, "b: block size", EVICTION)
    window: int = setting(5, "w: scoring queries", EVICTION)
    retention: tuple[float, ...] = setting((0.9, 0.8, 0.7, 0.6, 0.5), "curriculum stages ρ_0,...,ρ_K (retention "
                                           "= 1 - ε)", EVICTION)
    stage_steps: int = setting(25, "Δ: steps per curriculum stage", EVICTION, at_least(1))
    alpha: float = setting(0.6, "fraction of a stage spent blending to the next", EVICTION, in_unit(low_open=True))
    eviction_rate: float | None = setting(None, "a fixed ε instead of the curriculum", EVICTION)
    interoception: bool = setting(False, "one ε per group, written into its prompts' budget tag "
                                  "(<eviction_rate> ... </eviction_rate>, countdown.rate_tag)", EVICTION)
    interoception_rates: tuple[float, ...] = setting((0.25, 0.5, 0.75), "the rates groups draw from (scaled by "
                                                     "curriculum progress)", EVICTION)
    blind_tag: bool = setting(False, "with --interoception, the control: the same per-group ε, the tag "
                              "without the rate (as many tokens: same length, same blocks)", EVICTION)
    min_length: int = setting(0, "reward 0 when prompt+completion is shorter (Appendix A.1)", EVICTION, at_least(0))
    meta_token: bool = setting(False, "force the meta-token <|tldr|> as the last token before each round (Appendix, "
                               "meta-tokens; added to a checkpoint that lacks it as the mean embedding of 'tl;dr')",
                               EVICTION)
    # Optimisation
    lr: float = setting(5e-6, "AdamW learning rate, constant", OPTIM, positive)
    beta1: float = setting(0.9, "AdamW β1", OPTIM, in_unit(low_open=False))
    beta2: float = setting(0.95, "AdamW β2", OPTIM, in_unit(low_open=False))
    adam_eps: float = setting(1e-15, "AdamW ε", OPTIM, positive)
    weight_decay: float = setting(0.0, "AdamW weight decay", OPTIM, at_least(0))
    clip: float = setting(1.0, "grad-norm clipping", OPTIM, positive)
    micro_batch: int = setting(4, "rollouts per replay forward/backward", OPTIM, at_least(1))
    mem_norm: str = setting("paper", "L_mem's normaliser: paper (eq. 4: per rollout and layer the mean over its rounds, "
                            "/ the step's rollouts) | joint (summed over rounds and layers, / L_token's constant: "
                            "the joint policy's gradient)", OPTIM, choices=["paper", "joint"])
    mem_weight: float = setting(1.0, "W in L = L_token + W · L_mem", OPTIM, positive)
    term_grad_norms: bool = setting(False, "log ‖∇L_token‖ and ‖∇L_mem‖ apart (one more backward per term and "
                                    "micro-batch, a gradient buffer per term)", OPTIM)
    # Evaluation and checkpoints
    eval_every: int = setting(50, "held-out evaluation every N steps (0: never)", EVAL, at_least(0))
    eval_rate: float | None = setting(None, "ε for evaluation (default: the final training ε)", EVAL)
    eval_batch: int = setting(64, "rollouts per evaluation batch", EVAL, at_least(1))
    save_every: int = setting(50, "checkpoint every N steps (0: only at the end)", EVAL, at_least(0))
    eval_samples: int | None = setting(4, "pass@1 over this many sampled completions per held-out problem, tokens at the "
                                "rollouts' sampling, evictions greedy top-K (§5.1); 0: greedy tokens only", EVAL,
                                at_least(0))
    eval_temperature: float | None = setting(None, "eval.py: sampling temperature", EVAL, positive, cli=False)
    eval_top_p: float | None = setting(None, "eval.py: nucleus", EVAL, in_unit(low_open=True), cli=False)
    eval_max_new_tokens: int | None = setting(None, "eval.py: completion length cap", EVAL, at_least(1), cli=False)


SAVED = [f.name for f in fields(Settings) if f.metadata["saved"]]
SESSION = ["device", "dtype", "compile", "fsdp"]  # not saved (a resume may run elsewhere), but recorded
LISTS = [f.name for f in fields(Settings) if isinstance(f.default, tuple)]

COUNTDOWN = Settings()  # the paper's Countdown settings (§5.2, Table 1), for large models
MATH = replace(  # DAPO-17k (§5.4, Appendix A.1 "DAPO-17k training hyperparameters")
    COUNTDOWN, task="math", prompt=None, difficulty=None, train_problems=None, eval_problems=None,
    steps=469, prompts=256, group=8, max_new_tokens=1050, temperature=1.0, top_k=0, delta=350,
    min_length=350,  # Appendix A.1: reward 0 for a rollout that ends before the first round (δ)
    beta2=0.999, adam_eps=1e-8, eval_samples=32, eval_temperature=0.6, eval_top_p=0.95, eval_max_new_tokens=3850,
    stage_steps=50,  # the paper does not give the math run's curriculum: Countdown's, in stages of 50 steps
)
RECIPES = {"countdown": COUNTDOWN, "math": MATH}


def floats(text) -> tuple[float, ...]:
    """A comma list ("0.9,0.7,0.5", as ngc.json and flags write it) or a list, as a tuple."""
    return tuple(float(x) for x in (text if isinstance(text, (list, tuple)) else str(text).split(",")))


def from_dict(d: dict, base: Settings = COUNTDOWN) -> Settings:
    """`base` with the values of d (ngc.json, trainer.pt or flags); a ValueError for a bad comma list."""
    values = {}
    for k, v in d.items():
        if k in LISTS and v is not None:
            try:
                v = floats(v)
            except ValueError:
                raise ValueError(f"--{k.replace('_', '-')} {v!r} must be comma-separated numbers")
        values[k] = v
    return replace(base, **values)


def saved(c: Settings) -> dict:
    """The settings a run saves (ngc.json, trainer.pt), comma lists written back as text."""
    text = lambda v: ",".join(f"{x:g}" for x in v) if isinstance(v, tuple) else v
    return {k: text(getattr(c, k)) for k in SAVED}


def read_ngc_json(model_dir: str) -> dict:
    """A checkpoint's ngc.json ({} without one), or a one-line CheckpointError for a key or value no setting takes."""
    path = os.path.join(model_dir, "ngc.json")
    if not os.path.exists(path):
        return {}
    extra = read_json(path, "; fix or delete it")
    if not isinstance(extra, dict):
        raise CheckpointError(f"{path} holds a JSON {type(extra).__name__}; it must be an object of train.py's "
                              f"settings, such as {{\"steps\": 60}}")
    unknown = set(extra) - set(SAVED)
    if unknown:
        raise CheckpointError(f"{path} has unknown keys {sorted(unknown)}; the known ones are train.py's flags")
    for key, value in extra.items():
        wrong = value_error(FIELDS[key], value)
        if wrong:
            raise CheckpointError(f"{path}: {key} is {json.dumps(value)}; it {wrong}")
    for key in ("prompt", "difficulty"):  # null in a math run's ngc.json; Countdown's problems need them
        if extra.get("task", "countdown") == "countdown" and key in extra and extra[key] is None:
            raise CheckpointError(f"{path}: {key} is null; a Countdown run's must be one of "
                                  f"{', '.join(FIELDS[key].metadata['flag']['choices'])}")
    return extra


FIELDS = {f.name: f for f in fields(Settings)}
KINDS = {"bool": "true or false", "int": "an integer", "float": "a number", "str": "a string",
         "tuple[float, ...]": 'comma-separated numbers, such as "0.9,0.7,0.5"'}


def value_error(f, value) -> str | None:
    """Why `value` (as JSON gives it) cannot be setting f's, in words after "it" (None: it can)."""
    kind = f.type.removesuffix(" | None")
    if value is None:
        return None if f.type.endswith("| None") else f"must be {KINDS[kind]}, not null"
    if not of_kind(kind, value):
        return f"must be {KINDS[kind]}" + (" or null" if f.type.endswith("| None") else "")
    choices = f.metadata["flag"].get("choices")
    if choices and value not in choices:
        return f"must be one of {', '.join(choices)}"
    rule = f.metadata["check"]
    return None if rule is None or rule(value) is True else rule(value)


def of_kind(kind: str, value) -> bool:
    if kind == "bool" or isinstance(value, bool):
        return kind == "bool" and isinstance(value, bool)
    if kind == "tuple[float, ...]":
        try:
            return bool(floats(value)) and not isinstance(value, (int, float))
        except (TypeError, ValueError):
            return False
    return isinstance(value, {"int": int, "float": (int, float), "str": str}[kind])


def trained_task(model_dir: str) -> str | None:
    """The task a checkpoint's ngc.json names (a run's always does), or None."""
    return read_ngc_json(model_dir).get("task")


def session(c: Settings) -> dict:
    return {k: getattr(c, k) for k in SESSION}


def recorded(c: Settings) -> dict:
    """What trainer.pt records; a resume reports the differences."""
    return {**session(c), **saved(c)}


def run_defaults(model_dir: str, task: str | None = None) -> Settings:
    """The recipe of `task` (else of the task ngc.json names, else Countdown's) under the checkpoint's
    ngc.json; a CheckpointError if ngc.json names another task (its values are that task's recipe)."""
    path = os.path.join(model_dir, "ngc.json")
    extra = read_ngc_json(model_dir)
    if task and extra.get("task", task) != task:
        raise CheckpointError(f"{path} is the settings of a {extra['task']} run; --task {task} cannot use them: train "
                              f"it with --task {extra['task']}, or copy the directory without ngc.json to start a "
                              f"{task} run from its weights")
    task = task or extra.get("task") or "countdown"
    try:
        return from_dict({**extra, "task": task, "model": model_dir}, RECIPES[task])
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}")


def check(c: Settings):
    """A ValueError with a one-line message for the first setting of c that a run cannot use."""
    if c.out is not None and not c.out.strip():
        raise ValueError("--out is empty; give the run directory")
    check_values(c, {f.name: f.metadata["check"] for f in fields(Settings) if f.metadata["check"]})
    if c.task == "math":
        if not c.data or (c.eval_every and not c.eval_data):
            raise ValueError("--task math reads its problems from files: --data FILE (training) and --eval-data FILE "
                             "(held-out; or --eval-every 0), JSONL or Parquet; see mathtask.py for the datasets")
        if c.interoception or c.blind_tag:
            raise ValueError("--interoception writes the budget into Countdown's prompts; --task math has no such tag")
        for path in (c.data, c.eval_data):
            if path and not os.path.isfile(path):
                raise ValueError(f"no such file: {path}{mathtask.demo_hint(path)}")
    if c.blind_tag and not c.interoception:
        raise ValueError("--blind-tag is the control for --interoception (the same per-group ε, the rate hidden); "
                         "add --interoception")


def add_flags(p, defaults: Settings | None, names=None, helps=None, required=()):
    """Every setting (or those in `names`) as a --flag of p, defaulting to None (the script fills unset ones).
    A saved one's help ends with its value in `defaults` (None: not shown); helps: a script's own helps."""
    groups = {}
    for f in fields(Settings):
        wanted = f.metadata["cli"] if names is None else f.name in names
        if not wanted:
            continue
        group = p if f.metadata["group"] == RUN else groups.setdefault(f.metadata["group"],
                                                                       p.add_argument_group(f.metadata["group"]))
        kw, default = dict(f.metadata["flag"]), defaults and getattr(defaults, f.name)
        if isinstance(f.default, bool):
            kw.setdefault("action", argparse.BooleanOptionalAction)
        elif "action" not in kw:
            kw["type"] = int if f.type.startswith("int") else float if f.type.startswith("float") else str
        shown = ",".join(f"{x:g}" for x in default) if isinstance(default, tuple) else default
        help = (helps or {}).get(f.name, f.metadata["help"])
        help += f" (default {shown})" if f.metadata["saved"] and default is not None else ""
        group.add_argument(f"--{f.name.replace('_', '-')}", default=None, help=help.replace("%", "%%"),
                           required=f.name in required, **kw)
