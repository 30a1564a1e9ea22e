"""The tasks' problems, prompts and rewards, for a run's settings (settings.py)."""
from dataclasses import replace

import torch

import countdown
from lib import mathtask
from lib.cli import Error

TASK_REWARD = {"countdown": countdown.reward, "math": mathtask.reward}
SAMPLE = countdown.Problem(nums=(3, 5, 2), target=16)  # a problem to spell each prompt style with


def load_problems(c):
    """(training problems in the data seed's order, held-out problems) of settings c: Countdown's
    generated (held out: the validation split, which train.py evaluates on), math's read from --data
    and --eval-data (a bad file is a one-line ValueError). The data seed is --data-seed, else
    --seed."""
    seed = c.seed if c.data_seed is None else c.data_seed
    if c.task == "countdown":
        difficulty = countdown.DIFFICULTIES[c.difficulty]
        train, test = countdown.splits(seed, c.train_problems, c.eval_problems, difficulty,
                                       unique=False, split="validation")
    else:
        train = (mathtask.load(c.data, c.question_field, c.answer_field)[: c.train_problems]
                 if c.data else [])
        test = (mathtask.load(c.eval_data, c.question_field, c.answer_field) if c.eval_data
                else [])[: c.eval_problems]
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed)).tolist()
    return [train[i] for i in order], test


def held_out(c, n: int | None = None, split: str = "validation") -> list:
    """The first n problems (default: the run's eval_problems; None: all) of a run's held-out split,
    or a one-line ValueError. Countdown: validation (what train.py evaluates on) or test, one set
    each for every seed; math: --eval-data's problems for either split."""
    if c.task == "math" and not c.eval_data:  # a missing file: mathtask.load's message names it
        raise ValueError("--task math needs --eval-data FILE (AIME/AMC as JSONL or Parquet)")
    flag, k = ("--problems", n) if n is not None else ("--eval-problems", c.eval_problems)
    if c.task == "countdown":
        test = countdown.held_out(countdown.DIFFICULTIES[c.difficulty], split)
        if k is not None and k > len(test):
            raise ValueError(f"{flag} {k}: the held-out {split} split has {len(test)} problems")
        return test[:k]
    test = load_problems(replace(c, train_problems=0, data=None))[1]
    if n is not None and n > len(test):
        raise ValueError(f"--problems {n}: the run's test split has {len(test)} problems")
    return test[:n]


def prompt_encoder(task: str, style: str | None = None, eviction_rate=None, blind: bool = False):
    """encode(tokenizer, problem) -> prompt ids for the task (Countdown: in `style`, with the budget
    tag when eviction_rate is given, the rate hidden when blind)."""
    if task == "math":
        return mathtask.encode
    return lambda tokenizer, problem: countdown.encode(tokenizer, problem, style, eviction_rate,
                                                       blind)


def prompt_text(c, tokenizer, problem, rate=None) -> str:
    """The text of a problem's prompt in run c (Countdown: with the budget tag at ε = rate,
    countdown.prompt)."""
    if c.task == "math":
        return mathtask.prompt_text(problem)
    return countdown.prompt(tokenizer, problem, c.prompt, rate, c.blind_tag)


def check_prompts(c, tokenizer, model_dir: str, problems: list, positions: int | None = None,
                  new_tokens=0):
    """An Error unless the tokenizer of model_dir spells every word of the run's prompts: each
    problem's, with each budget tag the run may write. A word it does not know is its unknown token,
    and a run on such prompts trains on noise or scores 0% without a word (another model's
    tokenizer.json beside the weights, a --prompt or --data not the model's). A tokenizer with no
    unknown token (byte-level: R1's) spells every text; one that spells not one word of them is no
    language's (the tests' w2, w3, ...) and is left alone. positions: the model's
    max_position_embeddings, which no prompt and its new_tokens may pass."""
    # every percentage shown
    tags = [k / 100 for k in range(1, 101)] if c.interoception and problems else []
    try:
        texts = [prompt_text(c, tokenizer, p) for p in problems]
        texts += [prompt_text(c, tokenizer, problems[0], rate) for rate in tags]
    except ValueError as e:  # countdown.prompt: a budget tag the tokenizer cannot spell
        raise Error(f"{model_dir}/tokenizer.json: {e}") from None
    unknown, spelled_any, longest = spelling(tokenizer, texts)
    if unknown and spelled_any:
        # the style's own words
        if c.task == "countdown" and (words := unknown_words(tokenizer, c)):
            if spelled := [s for s in sorted(countdown.PROMPTS)
                           if not unknown_words(tokenizer, replace(c, prompt=s))]:
                raise Error(f"the prompt style {c.prompt} has {len(words)} words that "
                            f"{model_dir}/tokenizer.json cannot spell ({', '.join(words[:3])}, "
                            f"...): they would all be one unknown token; this model's tokenizer "
                            f"spells the styles {', '.join(spelled)}: give one with --prompt")
        raise Error(f"{model_dir}/tokenizer.json cannot spell {len(unknown)} words of this run's "
                    f"prompts ({', '.join(unknown[:3])}{', ...' if len(unknown) > 3 else ''}): "
                    f"each would be its unknown token, and the run would learn from noise or "
                    f"score 0%: the tokenizer is not this model's, or the prompts are not its task")
    # + R1's chat template, where the vocab has it
    longest += len(countdown.encode_prompt(tokenizer, ""))
    if positions and longest + new_tokens > positions:
        raise Error(f"prompts of up to {longest} tokens and {new_tokens} new ones pass the "
                    f"{positions} positions of {model_dir} (max_position_embeddings in its "
                    f"config.json): lower --max-new-tokens")


def spelling(tokenizer, texts: list[str]) -> tuple[list[str], bool, int]:
    """Over texts: the words the tokenizer writes as its unknown token (a word-level one's <unk>; a
    byte-level one has none), whether it spells any word, and the most tokens of one text."""
    unk = getattr(tokenizer.model, "unk_token", None)
    unknown, spelled_any, longest = {}, False, 0
    # a few thousand at a time: R1's recipe has 327,680 problems
    for start in range(0, len(texts), 4096):
        chunk = texts[start:start + 4096]
        for text, e in zip(chunk, tokenizer.encode_batch(chunk, add_special_tokens=False)):
            longest = max(longest, len(e))
            for token, (a, b) in zip(e.tokens, e.offsets) if unk else ():
                if token == unk:
                    unknown[text[a:b]] = None
                spelled_any |= token != unk
    return list(unknown), spelled_any, longest


def unknown_words(tokenizer, c) -> list[str]:
    """The words of run c's Countdown prompt style, on a sample problem, that the tokenizer cannot
    spell."""
    return spelling(tokenizer,
                    [prompt_text(c, tokenizer, SAMPLE, 0.5 if c.interoception else None)])[0]
