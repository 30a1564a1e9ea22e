"""The tasks' problems, prompts and rewards, for a run's settings (settings.py)."""
from dataclasses import replace

import torch

import countdown
from lib import mathtask
from lib.cli import Error

TASK_REWARD = {"countdown": countdown.reward, "math": mathtask.reward}
SAMPLE = countdown.Problem(nums=(3, 5, 2), target=16)  # a problem to spell each prompt style with


def load_problems(cfg):
    """(training problems in the data seed's order, held-out problems) of settings cfg: Countdown's
    generated (held out: validation, what train.py evaluates on), math's read from --data and
    --eval-data."""
    seed = cfg.seed if cfg.data_seed is None else cfg.data_seed
    if cfg.task == "countdown":
        difficulty = countdown.DIFFICULTIES[cfg.difficulty]
        train, test = countdown.splits(seed, cfg.train_problems, cfg.eval_problems, difficulty,
                                       unique=False, split="validation")
    else:
        train = (mathtask.load(cfg.data, cfg.question_field, cfg.answer_field)[: cfg.train_problems]
                 if cfg.data else [])
        test = (mathtask.load(cfg.eval_data, cfg.question_field, cfg.answer_field) if cfg.eval_data
                else [])[: cfg.eval_problems]
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed)).tolist()
    return [train[i] for i in order], test


def held_out(cfg, n: int | None = None, split: str = "validation") -> list:
    """The first n problems (default: the run's eval_problems; None: all) of a run's held-out split:
    Countdown's validation or test set (the same for every seed), math's --eval-data."""
    if cfg.task == "math" and not cfg.eval_data:  # a missing file: mathtask.load's message names it
        raise ValueError("--task math needs --eval-data FILE (AIME/AMC as JSONL or Parquet)")
    flag, k = ("--problems", n) if n is not None else ("--eval-problems", cfg.eval_problems)
    if cfg.task == "countdown":
        test = countdown.held_out(countdown.DIFFICULTIES[cfg.difficulty], split)
        if k is not None and k > len(test):
            raise ValueError(f"{flag} {k}: the held-out {split} split has {len(test)} problems")
        return test[:k]
    test = load_problems(replace(cfg, train_problems=0, data=None))[1]
    if n is not None and n > len(test):
        raise ValueError(f"--problems {n}: the run's test split has {len(test)} problems")
    return test[:n]


def prompt_encoder(task: str, style: str | None = None, eviction_rate=None, blind: bool = False):
    """encode(tokenizer, problem) -> prompt ids (Countdown's in `style`, with the budget tag when
    eviction_rate is given, the rate hidden when blind)."""
    if task == "math":
        return mathtask.encode
    return lambda tokenizer, problem: countdown.encode(tokenizer, problem, style, eviction_rate,
                                                       blind)


def prompt_text(cfg, problem, rate=None) -> str:
    """A problem's prompt text in run cfg (Countdown's with the budget tag at ε = rate)."""
    if cfg.task == "math":
        return mathtask.prompt_text(problem)
    return countdown.PROMPTS[cfg.prompt](problem, rate, cfg.blind_tag)


def check_prompts(cfg, tokenizer, model_dir: str, problems: list, positions: int | None = None,
                  new_tokens=0):
    """An Error unless the tokenizer of model_dir spells every word of the run's prompts, each
    budget tag it may write included (a word written as its unknown token: the run would learn from
    noise or score 0%), and no prompt with its new_tokens passes the model's positions. A tokenizer
    that spells none of the words (the tests' w2, w3, ...) is left alone."""
    rates = [k / 100 for k in range(1, 101)] if cfg.interoception and problems else []
    texts = ([prompt_text(cfg, p) for p in problems]
             + [prompt_text(cfg, problems[0], r) for r in rates])
    unknown, words = unspelled(tokenizer, texts)
    if unknown and len(unknown) < words:
        rate = 0.5 if cfg.interoception else None
        styles = [style for style in sorted(countdown.PROMPTS) if cfg.task == "countdown" and not
                  unspelled(tokenizer, [countdown.PROMPTS[style](SAMPLE, rate, cfg.blind_tag)])[0]]
        fix = (f"it spells the prompt styles {', '.join(styles)}: give one with --prompt"
               if styles and cfg.prompt not in styles
               else "the tokenizer is not this model's, or the prompts are not its task")
        raise Error(f"{model_dir}/tokenizer.json cannot spell {len(unknown)} of this run's prompt "
                    f"words ({', '.join(unknown[:3])}{', ...' * (len(unknown) > 3)}), which would "
                    f"be its unknown token: {fix}")
    longest = max((len(encoding) for start in range(0, len(texts), 4096)  # R1's recipe: 327,680
                   for encoding in tokenizer.encode_batch(texts[start:start + 4096],
                                                          add_special_tokens=False)), default=0)
    longest += len(countdown.encode_prompt(tokenizer, ""))  # R1's chat template, if in the vocab
    if positions and longest + new_tokens > positions:
        raise Error(f"prompts of up to {longest} tokens and {new_tokens} new ones pass the "
                    f"{positions} positions of {model_dir} (max_position_embeddings in its "
                    f"config.json): lower --max-new-tokens")


def unspelled(tokenizer, texts: list[str]) -> tuple[list[str], int]:
    """The words of texts that the tokenizer writes with its unknown token (a byte-level one has
    none), and how many distinct words texts have."""
    unk = getattr(tokenizer.model, "unk_token", None)
    unk_id = tokenizer.token_to_id(unk) if unk else None
    words = list(dict.fromkeys(word for text in texts for word in text.split()))
    encodings = tokenizer.encode_batch(words, add_special_tokens=False)
    return [word for word, encoding in zip(words, encodings) if unk_id in encoding.ids], len(words)
