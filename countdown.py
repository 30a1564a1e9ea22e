"""The Countdown task of the NGC paper (Stream-of-Search / TinyZero style): numbers and a target,
e.g. (3, 5, 2) and 16; the reward is 1.0 when the last <answer> ... </answer> is an equation using
every number exactly once with + - * / and parentheses whose value is the target, e.g. (3 + 5) * 2.
Answers are read by a small parser with exact Fraction arithmetic, never eval. Problems are solvable
by construction (paper: 327,680 train and 1,024 held-out, 3 and 4 numbers). `trace` writes the
depth-first search the tiny models are pretrained on (make_tiny.py), `check_trace` replays one.
"""
import itertools
import operator
import random
import re
from dataclasses import dataclass, replace
from fractions import Fraction
from functools import lru_cache, partial

@dataclass(frozen=True)
class Problem:
    nums: tuple[int, ...]
    target: int

@dataclass(frozen=True)
class Difficulty:
    n_nums: tuple[int, ...] = (3, 4)          # how many input numbers (chosen uniformly)
    num_range: tuple[int, int] = (1, 99)      # inclusive range of each input number
    target_range: tuple[int, int] = (10, 100) # inclusive range of the target
    held_out: int = 1536                      # the held-out pool: a third validation, 1,024 test
    backtracks: int = 0                       # only searches that go back: 1 past the first move,
                                              # 2 past the first pair (backtracks)

PAPER = Difficulty()  # Countdown-Tasks-3to4-like: 3-4 numbers in 1..99, targets 10..100
# SMALL: the tiny models' problems; tiny/ was pretrained on none of its 500 held out
SMALL = Difficulty(n_nums=(3,), num_range=(1, 15), target_range=(10, 100), held_out=500)
SMALL_BACK = replace(SMALL, backtracks=1)  # those of SMALL that go back: 278 of its 500 held out
SMALL_DEEP = replace(SMALL, backtracks=2)  # those that leave the first pair: 142 of the 500
HELD_OUT_SEED = 0  # the stream the held-out set is drawn from, whatever a run's seed
VALIDATION_SEED = 1  # which third of the held-out pool is the validation split
SPLITS = ("validation", "test")  # recipes are chosen on validation problems, claims read test ones

def backtracks(p, depth=1) -> bool:
    """Whether `trace`'s depth-first search over 3 numbers (first move: the two largest added) must
    go back past its first move (depth 1: no operation, + * - or exact /, on that sum and the
    third number reaches the target) or past its first pair (2: no move on the two largest does)."""
    a, b, c = sorted(p.nums, reverse=True)
    firsts = [a + b] if depth == 1 else [v for _, v in moves(a, b)]
    return all(w != p.target for v in firsts for w in _ops(max(v, c), min(v, c)))

def _key(p):  # a problem's identity
    return (tuple(sorted(p.nums)), p.target)

def _ops(a, b):
    """a + b, a * b, a - b and a / b for a >= b: nothing negative, division only when exact."""
    return [a + b, a * b, a - b, a // b] if b and a % b == 0 else [a + b, a * b, a - b]

def moves(a, b):
    """(op, value) for a >= b, in search order."""
    return list(zip("+*-/", _ops(a, b)))

def _target(nums, rng, lo, hi):
    """Fold nums by random pairs and ops, the last drawn from those landing in [lo, hi]; or None."""
    vals, r = list(nums), rng.random  # rng.random() is much faster than randint/sample
    while len(vals) > 1:
        a = vals.pop(int(r() * len(vals)))
        b = vals.pop(int(r() * len(vals)))
        ops = _ops(a, b) if a >= b else _ops(b, a)
        if not vals:  # the last op must land the target in range
            ops = [v for v in ops if lo <= v <= hi]
        if not ops:
            return None
        vals.append(ops[int(r() * len(ops))])
    return vals[0]

def _stream(rng, difficulty):
    """Endless solvable problems of the preset's sizes and ranges, whether or not they backtrack."""
    (lo, hi), r = difficulty.num_range, rng.random
    while True:
        k = rng.choice(difficulty.n_nums)
        while True:  # resample the numbers until they reach the target range
            nums = [lo + int(r() * (hi - lo + 1)) for _ in range(k)]
            target = _target(nums, rng, *difficulty.target_range)
            if target is not None:
                break
        yield Problem(tuple(nums), target)

def _take(stream, n, skip=frozenset(), unique=False, patience=50_000):
    """The next n problems whose identity is not in skip (nor repeated, if unique)."""
    out, seen, misses = [], set(), 0
    while len(out) < n:
        p = next(stream)
        k = _key(p)
        if k in skip or (unique and k in seen):
            misses += 1
            if misses > patience:
                raise RuntimeError(f"could not draw {n} distinct problems; try unique=False")
            continue
        misses = 0
        seen.add(k)
        out.append(p)
    return out

def _kept(p, difficulty) -> bool:  # every problem, or those that go back if the preset asks
    return not difficulty.backtracks or backtracks(p, difficulty.backtracks)

def _problems(rng, difficulty):
    return (p for p in _stream(rng, difficulty) if _kept(p, difficulty))

def generate(n, seed, difficulty=PAPER):
    """n problems, reproducible from seed, every one solvable (repeats possible)."""
    return list(itertools.islice(_problems(random.Random(seed), difficulty), n))

def held_out(difficulty=PAPER, split=None):
    """The held-out set, one for every seed: of the first difficulty.held_out distinct problems of
    the HELD_OUT_SEED stream, those of the preset (with backtracks, a subset of the same ones).
    split "validation": a third of them, drawn with VALIDATION_SEED; "test": the rest; None: all,
    in order."""
    return _split(list(_pool(difficulty)), split)

@lru_cache(maxsize=8)  # a run, its evaluations and the tests draw the same sets again
def _pool(difficulty):
    stream = _stream(random.Random(HELD_OUT_SEED), difficulty)
    return tuple(p for p in _take(stream, difficulty.held_out, unique=True) if _kept(p, difficulty))

def _split(pool, split):
    if split is None:
        return pool
    validation = set(random.Random(VALIDATION_SEED).sample(range(len(pool)), len(pool) // 3))
    return [p for i, p in enumerate(pool) if (i in validation) == (split == "validation")]

def splits(seed=0, n_train=327_680, n_test=1_024, difficulty=PAPER, unique=True, split=None):
    """(train, held-out): the first n_test problems of the held-out split (countdown.held_out),
    whatever the seed, and n_train from the seed's own stream, none of the held-out set's, distinct
    when unique (SMALL has only a few thousand distinct problems: unique=False). With seed
    HELD_OUT_SEED, train is the stream after the held-out set."""
    test = held_out(difficulty, split)
    if n_test is not None and n_test > len(test):
        raise ValueError(f"--eval-problems {n_test}: the held-out {split or 'set'} has {len(test)} "
                         "problems")
    return list(_train_set(seed, n_train, difficulty, unique)), test[:n_test]

@lru_cache(maxsize=8)
def _train_set(seed, n_train, difficulty, unique):
    skip = {_key(p) for p in _pool(difficulty)}
    return tuple(_take(_problems(random.Random(seed), difficulty), n_train, skip, unique))

def prompt_text(problem, eviction_rate=None, blind=False):
    """The task text; with eviction_rate, the paper's budget tag is appended (blind: the tag
    without the rate, "-" in its place: the control for interoception)."""
    text = (f"Using the numbers {list(problem.nums)}, create an equation that equals "
            f"{problem.target}. You can use basic arithmetic operations (+, -, *, /) and "
            f"each number must be used exactly once. Show your work, then give the final "
            f"equation in <answer> </answer> tags, for example <answer> (1 + 2) / 3 </answer>.")
    if eviction_rate is not None:
        pct = 100 * eviction_rate
        pct = f"{round(pct)}" if abs(pct - round(pct)) < 1e-9 else f"{pct:.1f}"
        pct = "-" if blind else pct
        text += f"\n<eviction_rate>{pct}%</eviction_rate>"
    return text

R1_CHAT = ("<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>")

def encode_prompt(tokenizer, text):
    """Token ids; wrapped in the DeepSeek-R1 chat template when the vocab has it."""
    if all(tokenizer.token_to_id(t) is not None for t in R1_CHAT):
        bos, user, assistant = R1_CHAT
        text = f"{bos}{user}{text}{assistant}<think>\n"
    return tokenizer.encode(text, add_special_tokens=False).ids  # template adds BOS itself

def shift_prompt(problem, eviction_rate=None, blind=False, unseen=False):
    """The prompt of tiny/: one body and 8 filler dots, 0 or 8 of them before it (a function of the
    problem), so the target's block index changes (1 or 3; blocks of 4) while the length and the
    block's contents do not. unseen: 4 before and 4 after, a layout never trained on (block 2) at
    the same length, so rounds fire at the same tokens. With eviction_rate, rate_tag's tag."""
    before = 4 if unseen else 8 * ((3 * problem.target + sum(problem.nums)) % 2)
    body = f"Countdown : reach {problem.target} with {' '.join(map(str, problem.nums))} ."
    tag = "" if eviction_rate is None else rate_tag(eviction_rate, blind)
    return "<bos>" + " ." * before + f" {body}" + " ." * (8 - before) + tag

def rate_tag(eviction_rate, blind=False) -> str:
    """The tiny prompts' budget tag: ε in whole percent, tens then units as two integer tokens
    (` <eviction_rate> 4 2 % </eviction_rate>` for ε = 0.42, `10 0 %` for 1) so that the order of
    rates reads; blind (the control): `- - %`, as many tokens without the value."""
    pct = round(100 * eviction_rate)
    if not 0 <= pct <= 100:
        raise ValueError(f"the budget tag's eviction rate {eviction_rate} is not in [0, 1]")
    return f" <eviction_rate> {'- -' if blind else f'{pct // 10} {pct % 10}'} % </eviction_rate>"

PROMPTS = {"plain": prompt_text, "tiny-shift": shift_prompt,  # style: (problem, rate, blind) -> str
           "tiny-shift-unseen": partial(shift_prompt, unseen=True)}
SHIFTED = {"tiny-shift": "tiny-shift-unseen"}  # a training prompt -> its layouts never trained on
# --difficulty -> preset
DIFFICULTIES = {"paper": PAPER, "tiny": SMALL, "tiny-back": SMALL_BACK, "tiny-deep": SMALL_DEEP}

def encode(tokenizer, problem, style="plain", eviction_rate=None, blind=False):
    """A problem's prompt token ids in the given style (with the budget tag if rate given)."""
    return encode_prompt(tokenizer, PROMPTS[style](problem, eviction_rate, blind))

# The reward: a small recursive-descent parser, exact Fraction arithmetic, no eval

MAX_CHARS, MAX_DIGITS, MAX_DEPTH = 200, 6, 32
_TOKEN = re.compile(r"\s*(?:([0-9]+)|([-+*/×÷()]))\s*")
_ALIASES = {"×": "*", "÷": "/"}
_ARITH = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}

def _tokenize(text):
    """Integers, + - * / (also × ÷) and parentheses; ValueError on anything else."""
    if "**" in text:
        raise ValueError("no powers")
    toks, pos = [], 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise ValueError(f"unexpected {text[pos]!r}")
        num, op = m.groups()
        if num is not None and len(num) > MAX_DIGITS:
            raise ValueError("number too long")
        toks.append(int(num) if num is not None else _ALIASES.get(op, op))
        pos = m.end()
    return toks

def _parse(toks):
    """expr := term (+|- term)*; term := atom (*|/ atom)*; atom := int | ( expr ).
    No unary minus, no powers. Raises ValueError / ZeroDivisionError."""
    pos = 0

    def next_if(*ops):
        nonlocal pos
        if pos < len(toks) and toks[pos] in ops:
            pos += 1
            return toks[pos - 1]

    def atom(depth):
        nonlocal pos
        if depth > MAX_DEPTH or pos >= len(toks):
            raise ValueError("too deep or truncated")
        t = toks[pos]
        pos += 1
        if isinstance(t, int):
            return Fraction(t)
        if t != "(":
            raise ValueError("expected a number or (")
        v = expr(depth + 1)
        if not next_if(")"):
            raise ValueError("expected )")
        return v

    def chain(depth, operand, ops):  # operand (op operand)*, left to right
        v = operand(depth)
        while op := next_if(*ops):
            v = _ARITH[op](v, operand(depth))
        return v

    def term(depth):
        return chain(depth, atom, "*/")

    def expr(depth):
        return chain(depth, term, "+-")

    v = expr(0)
    if pos != len(toks):
        raise ValueError("trailing tokens")
    return v

def evaluate_expression(text):
    """The exact value of an arithmetic expression, or None if invalid."""
    if len(text) > MAX_CHARS:
        return None
    try:
        return _parse(_tokenize(text))
    except (ValueError, ZeroDivisionError):
        return None

def extract_answer(completion):
    """Text inside the last complete <answer> ... </answer>, or None. The tags pair like brackets:
    a closing tag with no opening tag before it is ignored, and a nested pair leaves its tags
    inside the outer answer (which then does not parse)."""
    opened, answer = [], None
    for tag in re.finditer(r"</?answer>", completion):
        if tag.group() == "<answer>":
            opened.append(tag.end())
        elif opened:
            answer = completion[opened.pop():tag.start()].strip()
    return answer

def reward(completion, problem):
    """1.0 if the last answer uses each number exactly once and equals the target.
    One trailing '= rhs' is allowed (e.g. '(3 + 5) * 2 = 16') if rhs equals the target too."""
    answer = extract_answer(completion)
    if answer is None or len(answer) > MAX_CHARS:
        return 0.0
    lhs, *rhs = answer.split("=")
    if len(rhs) > 1 or any(evaluate_expression(side) != problem.target for side in [lhs, *rhs]):
        return 0.0
    return 1.0 if sorted(map(int, re.findall(r"[0-9]+", lhs))) == sorted(problem.nums) else 0.0

# Search traces: the depth-first search the tiny models are pretrained on (make_tiny.py)

MAX_LEAF = 999  # larger leaves are not written: the tiny models' vocabulary has the integers 0..999

def numbers(nums) -> str:
    return "[ " + " ".join(map(str, sorted(nums, reverse=True))) + " ]"

def trace(problem, restate: float = 0.0, rng=None, shuffle: float = 0.0) -> str:
    """The depth-first search trace for a 3-number problem, answer included. A dead end returns with
    `back` alone, so the next move reads the numbers from the first `[ ... ]`. Deterministic, or
    (rng) with restate > 0, each `[ ... ]` and `back` followed by `reach <target>` with that
    probability, and with shuffle > 0, with that probability the pairs and each pair's operations
    tried in a random order (the leaves keep theirs). Neither draws from rng at 0."""
    nums = sorted(problem.nums, reverse=True)
    assert len(nums) == 3, "traces are written for 3 numbers"
    mixed = shuffle and rng.random() < shuffle
    order = (lambda xs: rng.sample(xs, len(xs))) if mixed else (lambda xs: xs)

    def reach() -> str:  # the target restated, with probability restate
        return f" reach {problem.target}" if restate and rng.random() < restate else ""

    out = [numbers(nums) + reach()]
    for i, j in order([(0, 1), (0, 2), (1, 2)]):  # pairs of the numbers sorted down
        a, b, c = nums[i], nums[j], nums[3 - i - j]
        for op, v in order(moves(a, b)):
            out.append(f"{a} {op} {b} = {v} {numbers([v, c])}{reach()}")
            for op2, w in moves(max(v, c), min(v, c)):
                if w > MAX_LEAF:
                    continue
                if w != problem.target:
                    out.append(f"{op2} {w} no")
                    continue
                inner = f"( {a} {op} {b} )"
                expr = f"{inner} {op2} {c}" if v >= c else f"{c} {op2} {inner}"
                return " ".join(out + [f"{op2} {w} yes <answer> {expr} </answer>"])
            out.append("back" + reach())
    raise ValueError(f"{problem} has no solution")

def check_trace(problem, text: str) -> bool:
    """Re-execute a trace: every move and leaf must be correct arithmetic on the numbers at
    hand, every verdict right, and the final answer must reach the target."""
    words, k = text.split(), 0
    start, nums = sorted(problem.nums, reverse=True), None

    def take(n):
        nonlocal k
        k += n
        return words[k - n: k]

    try:
        while k < len(words) and words[k] != "<answer>":
            if words[k] == "reach":  # a restatement of the target
                if int(take(2)[1]) != problem.target:
                    return False
            elif words[k] in ("[", "back"):  # the start, or a return to it
                k += words[k] == "back"
                if words[k: k + 1] == ["["] and take(len(start) + 2) != numbers(start).split():
                    return False
                nums = list(start)
            elif words[k] in ("+", "*", "-", "/") and nums is not None and len(nums) == 2:  # a leaf
                op, w, verdict = take(3)
                value = dict(moves(max(nums), min(nums))).get(op)
                if int(w) != value or verdict != ("yes" if value == problem.target else "no"):
                    return False
            else:  # a move: a op b = v [ x y ]
                a, op, b, eq, v = take(5)
                a, b, v = int(a), int(b), int(v)
                nums, value = list(nums), dict(moves(a, b)).get(op)
                nums.remove(a), nums.remove(b), nums.append(v)  # the pair becomes its value
                if eq != "=" or a < b or value != v or take(4) != numbers(nums).split():
                    return False
        return reward(" ".join(words[k:]), problem) == 1.0
    except (ValueError, TypeError, IndexError):
        return False
