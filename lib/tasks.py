"""The tasks' problems, prompts and rewards, for a run's settings (settings.py)."""
from dataclasses import replace

import torch

import countdown
from lib import mathtask

TASK_REWARD = {"countdown": countdown.reward, "math": mathtask.reward}


def data_seed(c) -> int:
    """The seed of a run's problems and their order: --data-seed, else --seed (which also seeds the rollouts)."""
    return c.seed if c.data_seed is None else c.data_seed


def load_problems(c):
    """(training problems in the data seed's order, held-out problems) of settings c: Countdown's
    generated, math's read from --data and --eval-data (a bad file is a one-line ValueError)."""
    if c.task == "countdown":
        difficulty = countdown.DIFFICULTIES[c.difficulty]
        train, test = countdown.splits(data_seed(c), c.train_problems, c.eval_problems, difficulty, unique=False)
    else:
        train = mathtask.load(c.data, c.question_field, c.answer_field)[: c.train_problems] if c.data else []
        test = (mathtask.load(c.eval_data, c.question_field, c.answer_field) if c.eval_data else [])[: c.eval_problems]
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(data_seed(c))).tolist()
    return [train[i] for i in order], test


def held_out(c, n: int | None = None) -> list:
    """The first n held-out problems of a run with settings c (default: the run's eval_problems;
    Countdown's held-out set has more), or a one-line ValueError."""
    if c.task == "math" and not c.eval_data:  # a missing file: mathtask.load's message names it
        raise ValueError("--task math needs --eval-data FILE (AIME/AMC as JSONL or Parquet)")
    if c.task == "countdown":  # one set for every seed, of which a run evaluates the first eval_problems
        test = countdown.held_out(countdown.DIFFICULTIES[c.difficulty])
        flag, k = ("--eval-problems", c.eval_problems) if n is None else ("--problems", n)
        if k > len(test):
            raise ValueError(f"{flag} {k}: the held-out set has {len(test)} problems")
        return test[:k]
    _, test = load_problems(replace(c, train_problems=0, data=None))
    if n is not None and n > len(test):
        raise ValueError(f"--problems {n}: the run's test split has {len(test)} problems")
    return test[:n]


def prompt_encoder(task: str, style: str | None = None, eviction_rate=None, blind: bool = False):
    """encode(tokenizer, problem) -> prompt ids for the task (Countdown: in `style`, with the budget tag
    when eviction_rate is given, the rate hidden when blind)."""
    if task == "math":
        return mathtask.encode
    return lambda tokenizer, problem: countdown.encode(tokenizer, problem, style, eviction_rate, blind)


SAMPLE = countdown.Problem(nums=(3, 5, 2), target=16)  # a problem to spell each prompt style with


def unknown_words(tokenizer, style: str, eviction_rate=None, blind: bool = False) -> list[str]:
    """The words of a Countdown prompt in `style` that the tokenizer writes as its unknown token
    (a word-level tokenizer's <unk>; a byte-level one has none)."""
    unk = getattr(tokenizer.model, "unk_token", None)
    text = countdown.prompt(tokenizer, SAMPLE, style, eviction_rate, blind)  # the tag as it reads it
    encoding = tokenizer.encode(text, add_special_tokens=False)
    return [text[a:b] for token, (a, b) in zip(encoding.tokens, encoding.offsets) if unk and token == unk]


def check_prompt(c, tokenizer, model_dir: str):
    """A ValueError when the tokenizer of model_dir cannot spell the run's Countdown prompt style
    while it spells another: such prompts are mostly <unk>, and evaluate to 0% or train on noise
    without a word. (A tokenizer that spells no style, a test's random one, is left alone.)"""
    if c.task != "countdown":
        return
    rate = 0.5 if c.interoception else None
    unknown = unknown_words(tokenizer, c.prompt, rate, c.blind_tag)
    spelled = [s for s in sorted(countdown.PROMPTS) if not unknown_words(tokenizer, s, rate, c.blind_tag)]
    if unknown and spelled:
        raise ValueError(f"the prompt style {c.prompt} has {len(unknown)} words that {model_dir}/tokenizer.json cannot "
                         f"spell ({', '.join(unknown[:3])}, ...): they would all be one unknown token; this model's "
                         f"tokenizer spells the styles {', '.join(spelled)}: give one with --prompt")
