"""The tasks: Countdown (§5.2, countdown.py) and mathematical reasoning (§5.4, mathtask.py):
generators, splits, prompts, loaders and rewards."""
import builtins
import itertools
import json
import os
import random
import re
import subprocess
import sys
import time
from dataclasses import replace
from fractions import Fraction

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors

import countdown as cd
from lib import mathtask as mt
from lib import settings
from conftest import one_line_error
from countdown import PAPER, SMALL, SMALL_BACK, SMALL_DEEP, Problem


# ---------------------------------------------------------------------------------------
# Countdown (§5.2, countdown.py): generator, prompt and reward


def solve(nums, target):
    """An expression that uses each number once and equals target, every intermediate a
    non-negative integer (the generator's rule), or None: a depth-first search over pairs of
    numbers, for the generator tests. Its answers need no test of their own: every one is
    checked with countdown's reward where it is used."""
    def dfs(items, dead):
        if len(items) == 1:
            return items[0][1] if items[0][0] == target else None
        state = tuple(sorted(v for v, _ in items))
        if state in dead:
            return None
        for i, j in itertools.combinations(range(len(items)), 2):
            (a, ea), (b, eb) = sorted((items[i], items[j]), key=lambda x: -x[0])
            rest = [x for k, x in enumerate(items) if k not in (i, j)]
            results = [(a + b, "+"), (a * b, "*"), (a - b, "-")] + ([(a // b, "/")] if b and a % b == 0 else [])
            for v, op in results:
                found = dfs(rest + [(v, f"({ea} {op} {eb})")], dead)
                if found is not None:
                    return found
        dead.add(state)
        return None
    expr = dfs([(n, str(n)) for n in nums], set())
    return expr[1:-1] if expr is not None and expr.startswith("(") else expr  # the outermost pair


# ---------------------------------------------------------------------------------------
# generator and splits


def test_generate_is_seeded_and_reproducible():
    a, b = cd.generate(2000, seed=7), cd.generate(2000, seed=7)
    assert a == b
    assert cd.generate(2000, seed=8) != a
    assert cd.generate(2000, seed=7, difficulty=SMALL) == cd.generate(2000, seed=7, difficulty=SMALL)


@pytest.mark.parametrize("difficulty", [PAPER, SMALL])
def test_generated_problems_are_in_range_and_solvable(difficulty):
    probs = cd.generate(3000, seed=3, difficulty=difficulty)
    assert len(probs) == 3000
    assert {len(p.nums) for p in probs} == set(difficulty.n_nums)
    lo, hi = difficulty.num_range
    tlo, thi = difficulty.target_range
    for p in probs:
        assert isinstance(p.nums, tuple)
        assert all(lo <= n <= hi for n in p.nums)
        assert tlo <= p.target <= thi
        expr = solve(p.nums, p.target)
        assert expr is not None, p
        assert cd.reward(f"<answer> {expr} </answer>", p) == 1.0
        assert cd.reward(f"<answer> {expr} </answer>", Problem(p.nums, p.target + 1)) == 0.0


def test_generator_keeps_only_numbers_whose_last_operation_lands_in_the_target_range():
    """Problems are solvable by construction: the numbers are folded with random operations and
    the last one is drawn among those that land in the target range; numbers where none does are
    drawn again. With a range that few draws reach, every problem still lands in it and is
    solvable with its own numbers."""
    narrow = cd.Difficulty(n_nums=(3,), num_range=(1, 5), target_range=(50, 64))
    problems = cd.generate(300, seed=0, difficulty=narrow)
    assert {p.target for p in problems} <= set(range(50, 65)) and len({p.target for p in problems}) > 1
    for p in problems:
        expr = solve(p.nums, p.target)
        assert expr is not None and cd.reward(f"<answer> {expr} </answer>", p) == 1.0, p


def test_difficulty_names_draw_their_presets_problems_to_both_ends_of_each_range():
    """--difficulty paper draws Countdown-Tasks-3to4-like problems (3 and 4 numbers in 1..99,
    targets 10..100) and tiny the tiny models' (3 numbers in 1..15), through the path train.py
    takes (tasks.load_problems), and every end of each range is reached."""
    from lib import tasks
    expected = {"paper": ({3, 4}, (1, 99), (10, 100)), "tiny": ({3}, (1, 15), (10, 100)),
                "tiny-back": ({3}, (1, 15), (10, 100)), "tiny-deep": ({3}, (1, 15), (10, 100))}
    assert set(cd.DIFFICULTIES) == set(expected)
    for name, (sizes, nums, targets) in expected.items():
        c = replace(settings.COUNTDOWN, difficulty=name, seed=0, train_problems=5000, eval_problems=0)
        train, _ = tasks.load_problems(c)
        assert {len(p.nums) for p in train} == sizes, name
        assert (min(n for p in train for n in p.nums), max(n for p in train for n in p.nums)) == nums, name
        assert (min(p.target for p in train), max(p.target for p in train)) == targets, name


def test_splits_are_disjoint_distinct_and_reproducible():
    train, test = cd.splits(seed=0, n_train=20_000)
    assert len(train) == 20_000 and len(test) == 1_024
    key = lambda p: (tuple(sorted(p.nums)), p.target)
    train_keys, test_keys = {key(p) for p in train}, {key(p) for p in test}
    assert len(test_keys) == len(test) and len(train_keys) == len(train)
    assert not train_keys & test_keys
    assert cd.splits(seed=0, n_train=20_000) == (train, test)
    other_train, other_test = cd.splits(seed=1, n_train=20_000)
    assert other_test == test and other_train != train  # one held-out set; the seed draws the training problems
    assert not {key(p) for p in other_train} & test_keys


def test_data_seed_fixes_the_problems_and_seed_alone_the_noise():
    from lib import tasks
    import train
    c = lambda **kw: replace(settings.COUNTDOWN, **{"difficulty": "tiny", "train_problems": 50, "eval_problems": 20,
                                                      **kw})
    assert tasks.load_problems(c(seed=1, data_seed=0)) == tasks.load_problems(c(seed=2, data_seed=0))
    assert tasks.load_problems(c(seed=0)) == tasks.load_problems(c(seed=5, data_seed=0))
    one, other = tasks.load_problems(c(seed=1)), tasks.load_problems(c(seed=1, data_seed=0))
    assert one[0] != other[0] and one[1] == other[1]  # the data seed draws the training problems, never the held-out
    noise = lambda seed: torch.rand(3, generator=train.step_generator(seed, 0, 0, "cpu"))
    assert not torch.equal(noise(1), noise(2))  # the rollouts' noise follows --seed alone


def test_tiny_splits_disjoint_even_with_repeats():
    train, test = cd.splits(seed=0, n_train=20_000, n_test=500, difficulty=SMALL, unique=False)
    key = lambda p: (tuple(sorted(p.nums)), p.target)
    assert len(train) == 20_000
    assert len({key(p) for p in test}) == 500
    with pytest.raises(ValueError, match="held-out set has 500"):
        cd.splits(seed=0, n_train=10, n_test=501, difficulty=SMALL, unique=False)
    assert not {key(p) for p in train} & {key(p) for p in test}
    # SMALL has only a few thousand distinct problems: asking for more distinct ones fails loudly
    with pytest.raises(RuntimeError):
        cd.splits(seed=0, n_train=20_000, n_test=16, difficulty=SMALL, unique=True)


def test_backtracks_is_whether_the_search_goes_back_after_its_first_move():
    """The traces' depth-first search first adds the two largest numbers; a problem backtracks unless
    that sum and the third number reach the target in one operation. By hand for 4 12 7: 12 + 7 = 19,
    then 23, 76 and 15 (19 / 4 is not exact); 20 = (12 - 7) * 4 and 88 = 12 * 7 + 4 need other first
    moves. The same verdict as a `back` in the search traces (trace) on every tiny held-out problem."""
    p = lambda target: Problem((4, 12, 7), target)
    assert [cd.backtracks(p(t)) for t in (23, 76, 15)] == [False] * 3
    assert cd.backtracks(p(20)) and cd.backtracks(p(88))
    assert cd.backtracks(Problem((2, 3, 10), 50))  # 10 * (3 + 2), while 10 + 3 = 13 reaches 15, 26 and 11
    verdicts = [(cd.backtracks(q), "back" in cd.trace(q)) for q in cd.held_out(SMALL)]
    assert all(mine == trace for mine, trace in verdicts) and 0 < sum(v for v, _ in verdicts) < len(verdicts)


def test_backtracks_at_depth_2_is_whether_the_search_leaves_the_first_pair():
    """Depth 2: no move on the two largest numbers leads to the target, so the search goes back after
    every one of them (a `back` for each of that pair's moves in the trace). By hand for 4 12 7: 20 =
    (12 - 7) * 4 leaves the first move but not the pair; 55 = 12 * 4 + 7 needs 12 and 4 first. The
    same verdict as the traces' on every tiny held-out problem; depth 1 says yes where 2 says no."""
    p = lambda target: Problem((4, 12, 7), target)
    assert cd.backtracks(p(20)) and not cd.backtracks(p(20), depth=2)
    assert cd.backtracks(p(55), depth=2) and cd.backtracks(p(55))
    small = cd.held_out(SMALL)
    pair_moves = lambda q: len(cd.moves(*sorted(q.nums, reverse=True)[:2]))
    verdicts = [(cd.backtracks(q, 2), cd.trace(q).split().count("back") >= pair_moves(q)) for q in small]
    assert all(mine == trace for mine, trace in verdicts)
    assert sum(cd.backtracks(q, 2) for q in small) < sum(cd.backtracks(q) for q in small)


def test_tiny_back_holds_out_the_tiny_problems_that_backtrack_and_trains_on_none_of_tinys():
    """--difficulty tiny-back: its held-out set is the tiny held-out problems that backtrack (so a model
    pretrained on tiny's training split has seen none of them), its training problems all backtrack and
    hold no tiny held-out problem."""
    key = lambda p: (tuple(sorted(p.nums)), p.target)
    small, back = cd.held_out(SMALL), cd.held_out(SMALL_BACK)
    assert back == [p for p in small if cd.backtracks(p)] and len(back) == 278
    train, test = cd.splits(seed=0, n_train=5000, n_test=200, difficulty=SMALL_BACK, unique=False)
    assert test == back[:200] and all(cd.backtracks(p) for p in train)
    assert not {key(p) for p in train} & {key(p) for p in small}
    with pytest.raises(ValueError, match="held-out set has 278"):
        cd.splits(seed=0, n_train=10, n_test=279, difficulty=SMALL_BACK, unique=False)
    deep = cd.held_out(SMALL_DEEP)  # tiny-deep: those that leave the first pair, the same way
    assert deep == [p for p in back if cd.backtracks(p, 2)] and len(deep) == 142
    train, test = cd.splits(seed=0, n_train=2000, n_test=142, difficulty=SMALL_DEEP, unique=False)
    assert test == deep and all(cd.backtracks(p, 2) for p in train)
    assert not {key(p) for p in train} & {key(p) for p in small}


# ---------------------------------------------------------------------------------------
# prompt


def test_prompt_text_and_eviction_rate_tag():
    p = Problem((3, 5, 2), 16)
    text = cd.prompt_text(p)
    assert "[3, 5, 2]" in text and "equals 16" in text and "<answer>" in text
    assert "eviction_rate" not in text
    assert cd.prompt_text(p, 0.5) == text + "\n<eviction_rate>50%</eviction_rate>"
    assert cd.prompt_text(p, 0.25).endswith("<eviction_rate>25%</eviction_rate>")
    assert cd.prompt_text(p, 0.125).endswith("<eviction_rate>12.5%</eviction_rate>")
    assert cd.prompt_text(p, 0.0).endswith("<eviction_rate>0%</eviction_rate>")
    assert cd.prompt_text(p, 0.7).endswith("<eviction_rate>70%</eviction_rate>")  # 70.00000000000001
    assert cd.prompt_text(p, 0.7, blind=True) == text + "\n<eviction_rate>-%</eviction_rate>"  # the control


def _tiny_tokenizer(chat):
    words = "Using the numbers [3, 5, 2] equals 16 . <think> \n".split(" ")
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(dict.fromkeys(words))}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if chat:
        tok.add_special_tokens(list(cd.R1_CHAT))
        tok.add_tokens(["<think>"])
        bos = cd.R1_CHAT[0]
        # like the real R1 tokenizer, the post-processor would prepend BOS on its own
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))])
    return tok


def test_encode_prompt_uses_r1_chat_template_only_when_present():
    text = "Using the numbers 16"
    chat = _tiny_tokenizer(chat=True)
    ids = cd.encode_prompt(chat, text)
    bos, user, assistant = (chat.token_to_id(t) for t in cd.R1_CHAT)
    think = chat.token_to_id("<think>")
    assert ids[:2] == [bos, user]
    assert ids.count(bos) == 1  # not duplicated by the post-processor
    assert ids[-2:] == [assistant, think]
    assert ids[2:-2] == chat.encode(text, add_special_tokens=False).ids
    # sanity: the post-processor really would have added a BOS
    assert chat.encode(f"{cd.R1_CHAT[0]}x").ids[:2] == [bos, bos]

    plain = _tiny_tokenizer(chat=False)
    assert plain.token_to_id(cd.R1_CHAT[1]) is None
    assert cd.encode_prompt(plain, text) == plain.encode(text, add_special_tokens=False).ids
    assert len(cd.encode_prompt(plain, text)) == 4


# ---------------------------------------------------------------------------------------
# reward


P = Problem((3, 5, 2), 16)


def _boom(*args, **kwargs):
    raise AssertionError("eval/exec/compile must never be called")


@pytest.fixture
def trapped_builtins(monkeypatch):
    """eval and exec raise for the whole test; compile raises while countdown or mathtask code
    runs (not throughout: pytest itself needs compile to report a failure)."""
    monkeypatch.setattr(builtins, "eval", _boom)
    monkeypatch.setattr(builtins, "exec", _boom)

    def trapped(fn):
        def wrapper(*args, **kwargs):
            prev, builtins.compile = builtins.compile, _boom
            try:
                return fn(*args, **kwargs)
            finally:
                builtins.compile = prev
        return wrapper

    for module, names in ((cd, ("reward", "evaluate_expression", "extract_answer")),
                          (mt, ("reward", "last_boxed", "normalize", "equivalent"))):
        for name in names:
            monkeypatch.setattr(module, name, trapped(getattr(module, name)))


@pytest.mark.parametrize("completion", [
    "<answer> (3 + 5) * 2 </answer>",
    "<answer>(3+5)*2</answer>",
    "<answer>2*(5+3)</answer>",
    "<answer> (5 + 3) × 2 </answer>",
    "<answer> (3 + 5) * 2 = 16 </answer>",
    "<answer>\n(3 + 5) * 2\n</answer>",
    "<think>try 3*5+2 = 17, no</think> so <answer> (3 + 5) * 2 </answer>",
    "<answer> 3 + 5 </answer> wait, that's wrong. <answer> (3 + 5) * 2 </answer>",
    "<answer>(5+3)*2</answer>\n</answer>",  # a stray closing tag after the last complete pair
])
def test_reward_correct(completion, trapped_builtins):
    assert cd.reward(completion, P) == 1.0


@pytest.mark.parametrize("completion", [
    "<answer> (3 + 5) + 2 </answer>",        # wrong value
    "<answer> 3 * 5 + 2 </answer>",          # wrong value (17)
    "<answer> (3 + 5) * 2 = 17 </answer>",   # wrong claimed value
    "<answer> (3 + 5) * 2 = 16 = 16 </answer>",
    "<answer> 16 </answer>",                 # numbers missing
    "<answer> 8 * 2 </answer>",              # 3 and 5 missing
    "<answer> (3 + 5) * 2 * 1 </answer>",    # extra number
    "<answer> (3 + 5) * 2 + 0 </answer>",    # extra number
    "<answer> (3 + 3 + 2) * 2 </answer>",    # 3 used twice, 5 missing (value 16)
    "<answer> (5 + 3) * 2 * (2 / 2) </answer>",  # 2 used three times (value 16)
    "<answer> 35 - 2 + 3 - 20 </answer>",    # digits glued / extra numbers
    "<answer> (3 + 5) * 2.0 </answer>",      # no decimals
    "<answer></answer>",
    "<answer> </answer>",
])
def test_reward_wrong(completion, trapped_builtins):
    assert cd.reward(completion, P) == 0.0


@pytest.mark.parametrize("completion", [
    "(3 + 5) * 2",                                    # no tags at all
    "<answer> (3 + 5) * 2",                           # unclosed
    "(3 + 5) * 2 </answer>",                          # unopened
    "</answer> (3 + 5) * 2 <answer>",                 # reversed
    "<answer (3 + 5) * 2 </answer>",                  # broken open tag
    "<Answer> (3 + 5) * 2 </Answer>",                 # tags are case-sensitive
    "<answer><answer> (3 + 5) * 2 </answer></answer>",
    "<answer> (3 + 5) * 2 </answer> <answer> 3 + 5 + 2 </answer>",  # last one is wrong
    "<answer> 3 + 5 + 2 </answer> actually it is (3 + 5) * 2",      # right one outside tags
    "<answer> 3 + 5 + 2 </answer> <answer> (3 + 5) * 2",            # last tag unclosed
])
def test_reward_malformed_tags_and_answer_outside_last_tag(completion, trapped_builtins):
    assert cd.reward(completion, P) == 0.0


def test_reward_rejects_unary_minus_and_powers_even_when_the_value_is_right(trapped_builtins):
    p = Problem((3, 5, 2), 13)
    assert cd.reward("<answer> 3 * 5 - 2 </answer>", p) == 1.0   # positive control
    assert cd.reward("<answer> -2 + 3 * 5 </answer>", p) == 0.0
    assert cd.reward("<answer> 5 * 3 + (-2) </answer>", p) == 0.0
    q = Problem((2, 4, 1), 16)
    assert cd.reward("<answer> 2 * 4 * 1 </answer>", Problem((2, 4, 1), 8)) == 1.0
    assert cd.reward("<answer> 2 ** 4 * 1 </answer>", q) == 0.0
    assert cd.reward("<answer> 2 ^ 4 * 1 </answer>", q) == 0.0


def test_reward_rejects_injected_code_and_runs_nothing(tmp_path, monkeypatch, trapped_builtins):
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "pwned"
    attacks = [
        "__import__('os').system('touch pwned')",
        "(3 + 5) * 2 if __import__('os').system('touch pwned') == 0 else 0",
        "open('pwned', 'w').write('x') and (3 + 5) * 2",
        "(lambda: __import__('os').system('touch pwned'))() or (3 + 5) * 2",
        "[c for c in ().__class__.__base__.__subclasses__()]",
        "(3 + 5) * 2; import os; os.system('touch pwned')",
        "exec('open(\"pwned\",\"w\")')",
        "eval" "('(3 + 5) * 2')",  # one string; split so that no line of the repository reads as a call
    ]
    for attack in attacks:
        for completion in (f"<answer>{attack}</answer>", f"<answer> {attack} = 16 </answer>"):
            assert cd.reward(completion, P) == 0.0
        assert cd.evaluate_expression(attack) is None
    assert not marker.exists()
    assert list(tmp_path.iterdir()) == []
    # the traps are live: eval and exec are replaced, and an evaluator built on compile is caught
    assert builtins.eval is _boom and builtins.exec is _boom
    monkeypatch.setattr(cd, "_tokenize", lambda text: compile(text, "<answer>", "eval"))
    with pytest.raises(AssertionError):
        cd.evaluate_expression("1")


def test_reward_resists_huge_numbers_deep_nesting_and_division_by_zero(trapped_builtins):
    t = time.perf_counter()
    assert cd.evaluate_expression("9**9**9") is None
    assert cd.reward("<answer> 9**9**9 </answer>", Problem((9, 9, 9), 729)) == 0.0
    assert cd.reward("<answer> 9 ** 9 ** 9 </answer>", Problem((9, 9, 9), 729)) == 0.0
    assert cd.evaluate_expression("1" * 7) is None                      # literal too long
    assert cd.reward("<answer>" + "9" * 100_000 + "</answer>", P) == 0.0  # int() digit limit
    big = "*".join(["999999"] * 28)                                     # 195 chars: allowed
    assert cd.evaluate_expression(big) == 999999 ** 28
    assert cd.evaluate_expression("1+" * 150 + "1") is None               # over 200 chars
    assert cd.evaluate_expression("(" * 30 + "16" + ")" * 30) == 16
    assert cd.evaluate_expression("(" * 40 + "16" + ")" * 40) is None     # too deep
    assert cd.reward("<answer>" + "(" * 5000 + "16" + ")" * 5000 + "</answer>", P) == 0.0
    assert cd.evaluate_expression("1 / 0") is None
    assert cd.evaluate_expression("5 / (3 - 3)") is None
    assert cd.reward("<answer> 5 / (3 - 3) </answer>", Problem((5, 3, 3), 0)) == 0.0
    assert cd.reward("<answer> (5 - 5) / 3 </answer>", Problem((5, 5, 3), 0)) == 1.0  # 0 / 3 is fine
    assert time.perf_counter() - t < 1.0


def test_evaluate_expression_grammar():
    ev = cd.evaluate_expression
    assert ev("3 + 5 * 2") == 13 and ev("(3 + 5) * 2") == 16
    assert ev("8 - 3 - 2") == 3 and ev("24 / 4 / 2") == 3      # left-associative
    assert ev("7 / 2") == Fraction(7, 2)
    assert ev("(8 / 3) * 3") == 8                               # exact, no float error
    assert ev("6 ÷ 3 × 4") == 8
    for bad in ["", "()", "3 +", "+ 3", "(3", "3)", "3 5", "3 (5)", "abc", "3 % 2", "0x10", "1e3", "½"]:
        assert ev(bad) is None, bad
    assert cd.extract_answer("a <answer> x </answer> b <answer> y </answer> c") == "y"
    assert cd.extract_answer("<answer> x </answer> </answer> <answer> y") == "x"  # the last complete pair
    assert cd.extract_answer("no tags") is None


def _random_tree(rng, nums):
    """A random fully parenthesised expression over nums and its exact value (None on /0)."""
    items = [(str(n), Fraction(n)) for n in nums]
    while len(items) > 1:
        (ea, a), (eb, b) = items.pop(rng.randrange(len(items))), items.pop(rng.randrange(len(items)))
        op = rng.choice("+-*/")
        if a is None or b is None or (op == "/" and b == 0):
            v = None
        else:
            v = {"+": a + b, "-": a - b, "*": a * b, "/": a / b if b else None}[op]
        sym = {"*": rng.choice(["*", "×"]), "/": rng.choice(["/", "÷"])}.get(op, op)
        items.append((f"({ea}{' ' * rng.randint(0, 2)}{sym} {eb})", v))
    return items[0]


def test_reward_10k_random_strings(trapped_builtins, tmp_path, monkeypatch):
    """Random expressions with a known verdict, then pure noise: right verdicts, no exceptions."""
    monkeypatch.chdir(tmp_path)
    rng = random.Random(0)
    n_right = 0
    for _ in range(5_000):
        nums = [rng.randint(0, 20) for _ in range(rng.choice([3, 4]))]
        used = list(nums)
        mutation = rng.random()
        if mutation < 0.15:
            used[0] = used[1]                  # a number used twice, one missing
        elif mutation < 0.3:
            used.append(rng.randint(0, 20))    # an extra number
        elif mutation < 0.4:
            used.pop()                         # a missing number
        expr, value = _random_tree(rng, used)
        if value is not None and value.denominator == 1 and value >= 0 and rng.random() < 0.8:
            target = int(value)
        else:
            target = rng.randint(0, 100)
        expected = float(value == target and sorted(used) == sorted(nums))
        got = cd.reward(f"think... <answer> {expr} </answer>", Problem(tuple(nums), target))
        assert got == expected, (expr, nums, target)
        n_right += got == 1.0
    assert n_right > 1_000  # the oracle is not trivially all zeros

    alphabet = list("0123456789+-*/()=  ×÷.^%abcxyz_'\"\\\n\t[]{}<>!&|~") + [
        "<answer>", "</answer>", "**", "__import__('os')", "16", "3", "5", "2", "é", "\x00"]
    n_tagged = 0
    for _ in range(5_000):
        s = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))
        n_tagged += cd.extract_answer(s) is not None
        got = cd.reward(s, P)
        assert got in (0.0, 1.0)
        if got == 1.0:  # only possible if the last answer is genuinely right
            ans = cd.extract_answer(s).split("=")[0]
            assert cd.evaluate_expression(ans) == 16 and sorted(map(int, re.findall(r"[0-9]+", ans))) == [2, 3, 5]
    assert n_tagged > 500  # a fair share of the noise reaches the parser
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------
# Mathematical reasoning (§5.4, mathtask.py): DAPO-Math-17k → AMC/AIME, boxed answers


BIG = "1000000000000000000001"  # 22 digits: a float cannot tell it from 10^21


MATH_REWARD_CASES = [  # (completion, ground truth, reward)
    # the last \boxed{...} is read
    ("\\boxed{42}", "42", 1.0),
    ("so the answer is \\boxed {42}", "42", 1.0),
    ("<think>6 * 7 = 42</think> The answer is $\\boxed{42}$.", "42", 1.0),
    ("\\boxed{41}, no wait: \\boxed{42}", "42", 1.0),
    ("\\boxed{\\boxed{42}}", "42", 1.0),
    ("\\boxed{42}. (I was asked to use \\boxed as the format.)", "42", 1.0),  # a bare \boxed is no box
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}", 1.0),  # nested braces
    ("\\boxed{" + "9" * 999 + "}", "9" * 999, 1.0),  # long but under the cap
    # normalisation, one item at a time
    ("\\boxed{ 42 }", "42", 1.0),                                   # spaces
    ("\\boxed{\\left( 1, 2 \\right)}", "(1,2)", 1.0),               # \left, \right
    ("\\boxed{10\\!000}", "10000", 1.0),                            # \!
    ("\\boxed{10\\,000}", "10000", 1.0),                            # \,
    ("\\boxed{$42$}", "42", 1.0),                                   # $
    ("\\boxed{\\text{(C)}}", "(C)", 1.0),                           # \text{}
    ("\\boxed{30^\\circ}", "30", 1.0),                              # ^\circ
    ("\\boxed{30^{\\circ}}", "30", 1.0),
    ("\\boxed{12.0}", "12", 1.0),                                   # trailing .0
    ("\\boxed{27}", "27.0", 1.0),                                   # AMC's float answers
    ("\\boxed{42.}", "42", 1.0),
    ("\\boxed{x = 5}", "5", 1.0),                                   # a leading "x ="
    ("\\boxed{n=5}", "5", 1.0),
    ("\\boxed{1,000}", "1000", 1.0),                                # thousands separators
    ("\\boxed{+42}", "42", 1.0),
    ("\\boxed{007}", "7", 1.0),
    # exact numbers
    ("\\boxed{" + BIG + "}", BIG, 1.0),
    ("\\boxed{\\frac{1}{2}}", "1/2", 1.0),
    ("\\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\tfrac{3}{6}}", "1/2", 1.0),
    ("\\boxed{-\\frac{3}{4}}", "-3/4", 1.0),
    ("\\boxed{\\frac{-3}{4}}", "-0.75", 1.0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    # rejected
    ("42", "42", 0.0),                                              # no box
    ("\\boxed42", "42", 0.0),                                       # no braces
    ("\\Boxed{42}", "42", 0.0),
    ("\\fbox{42}", "42", 0.0),
    ("\\boxed{}", "42", 0.0),                                       # empty box
    ("\\boxed{ $ $ }", "42", 0.0),
    ("\\boxed{42} no wait, \\boxed{41}", "42", 0.0),                # conflicting boxes ending wrong
    ("\\boxed{42}, \\boxed{41}, \\boxed{40}", "42", 0.0),
    ("\\boxed{42", "42", 0.0),                                      # unbalanced braces
    ("\\boxed{42} and finally \\boxed{\\frac{1}{2}", "42", 0.0),    # the last box never closes
    ("\\boxed{\\frac{4}{2}", "2", 0.0),
    ("\\boxed{" + "4" * 100_000 + "}", "4" * 100_000, 0.0),         # a 100k-character answer
    ("\\boxed{" + "1" * 100_000 + "}", "42", 0.0),
    ("\\boxed{" + BIG + "}", "1000000000000000000000", 0.0),       # differ in the last digit
    ("\\boxed{1000000000000000000000}", BIG, 0.0),
    ("\\boxed{1e21}", "1000000000000000000000", 0.0),
    ("\\boxed{0.333}", "1/3", 0.0),
    ("\\boxed{12.5}", "12", 0.0),
    ("\\boxed{-42}", "42", 0.0),
    ("\\boxed{\\frac{1}{3}}", "1/2", 0.0),
    ("\\boxed{-\\frac{1}{2}}", "1/2", 0.0),
    ("\\boxed{1/0}", "0", 0.0),
    ("\\boxed{1,00}", "100", 0.0),                                  # not a thousands separator
    ("\\boxed{x = 6}", "5", 0.0),
    ("\\boxed{2^{10}}", "1024", 0.0),                               # nothing is evaluated
    ("\\boxed{6*7}", "42", 0.0),
    ("\\boxed{__import__('os').getpid() * 0 + 42}", "42", 0.0),
]


@pytest.mark.parametrize("completion, truth, expected", MATH_REWARD_CASES,
                         ids=[f"{i}-{'accept' if r else 'reject'}" for i, (_, _, r) in enumerate(MATH_REWARD_CASES)])
def test_math_reward_table(completion, truth, expected, trapped_builtins):
    assert mt.reward(completion, mt.Problem("q", truth)) == expected


def test_math_reward_compares_the_last_box_with_the_truth(trapped_builtins):
    """Each completion the table accepts is rejected against another truth, and once a wrong
    box follows it: the verdict comes from the last box and the truth, not the completion alone."""
    accepted = [(completion, truth) for completion, truth, r in MATH_REWARD_CASES if r == 1.0]
    assert accepted
    for completion, truth in accepted:
        assert mt.reward(completion, mt.Problem("q", truth + "1")) == 0.0, (completion, truth)
        assert mt.reward(completion + " \\boxed{0}", mt.Problem("q", truth)) == 0.0, (completion, truth)


def test_last_boxed_and_normalize(trapped_builtins):
    lb = mt.last_boxed
    assert lb("\\boxed{a} \\boxed{b{c}d}") == "b{c}d"
    assert lb("\\boxed  {7}") == "7" and lb("\\boxed{}") == ""
    assert lb("\\boxed{7} \\boxed") == "7" and lb("\\boxed{7} \\boxed{") is None
    assert lb("no box") is None and lb("\\boxed{{}") is None
    cap = mt.MAX_ANSWER_CHARS
    assert lb("\\boxed{" + "1" * cap + "}") == "1" * cap and lb("\\boxed{" + "1" * (cap + 1) + "}") is None
    norm = mt.normalize
    assert norm(" \\left[ 1 ,\\; 2 \\right) ") == "[1,2)"
    assert norm("\\leftarrow") == "\\leftarrow"  # only \left itself is dropped
    assert norm("\\text{ m}") == "m" and norm("5\\!\\:\\,$") == "5"
    assert norm("90^\\circ") == "90" and norm("y=\\dfrac{1}{2}") == "\\frac{1}{2}"
    assert norm("12,345,678.5") == "12345678.5" and norm("1,23") == "1,23"
    assert mt.equivalent("3/6", "\\frac{1}{2}") and not mt.equivalent("0.3333333333", "1/3")
    assert mt.equivalent(BIG, BIG + ".000") and not mt.equivalent(BIG, "1e21")
    # Negative control: the float comparison these replace cannot tell the big integers apart.
    assert float(BIG) == float("1000000000000000000000")
    assert mt.equivalent("1" * 4999, "1" * 4999)  # over int()'s digit limit: compared as strings
    assert not mt.equivalent("", "") and not mt.equivalent("\\text{ }", "$")  # an empty answer never matches


def test_math_reward_runs_nothing_on_10k_noisy_strings(tmp_path, monkeypatch, trapped_builtins):  # tmp_path before the traps
    """Random strings built from the reward's own syntax: always 0 or 1, never an exception,
    never a file written, and 1 only when the last box really holds the answer."""
    monkeypatch.chdir(tmp_path)
    rng = random.Random(0)
    alphabet = ["\\boxed{", "\\boxed", "{", "}", "42", "4", "2", " ", "$", "\\frac", "\\left", "x=", ".0", ",",
                "-", "/", "\\text{", "^\\circ", "\\!", "__import__('os').system('touch pwned')", "\\", "é", "\x00"]
    n_ones = 0
    for _ in range(10_000):
        s = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        got = mt.reward(s, mt.Problem("q", "42"))
        assert got in (0.0, 1.0)
        if got:
            n_ones += 1
            assert mt._number(mt.normalize(mt.last_boxed(s))) == 42
    assert n_ones > 10  # the noise does reach right answers
    assert list(tmp_path.iterdir()) == []
    # the traps are live: eval and exec are replaced, and a reader built on compile is caught
    assert builtins.eval is _boom and builtins.exec is _boom
    monkeypatch.setattr(mt, "_number", lambda text: compile(text, "<boxed>", "eval"))
    with pytest.raises(AssertionError):
        mt.reward("\\boxed{42}", mt.Problem("q", "42"))


# ---------------------------------------------------------------------------------------
# loaders and the prompt


DAPO_ROW = {  # a row of BytedTsinghua-SIA/DAPO-Math-17k, with its verbatim prompt wrapper
    "data_source": "math_dapo",
    "prompt": [{"content": "Solve the following math problem step by step. The last line of your response should be "
                           "of the form Answer: $Answer (without quotes) where $Answer is the answer to the problem."
                           "\n\nWhat is $6 \\times 7$?\n\nRemember to put your answer on its own line after \"Answer:\".",
                "role": "user"}],
    "ability": "MATH",
    "reward_model": {"ground_truth": "42", "style": "rule-lighteval/MATH_v2"},
    "extra_info": {"index": "9a9b6eb4-a1cb-49d1-8c1e-62eaf2f74079"},
}


def _write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_load_reads_the_dapo_and_aime_amc_layouts(tmp_path):
    dapo = _write_jsonl(tmp_path / "dapo.jsonl", [
        DAPO_ROW,
        {"prompt": "What is 2 + 2?", "reward_model": {"ground_truth": "4"}, "solution": "4"},  # open-r1's copy
        {"prompt": [{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "What is 3 + 3?\n" + mt.INSTRUCTION}], "reward_model": {"ground_truth": "6"}},
    ])
    assert mt.load(dapo) == [mt.Problem("What is $6 \\times 7$?", "42"), mt.Problem("What is 2 + 2?", "4"),
                             mt.Problem("What is 3 + 3?", "6")]
    both = _write_jsonl(tmp_path / "both.jsonl", [{"prompt": "Q?", "problem": "P?", "reward_model": {"ground_truth": "1"},
                                                   "answer": "2"}])
    assert mt.load(both) == [mt.Problem("Q?", "1")]  # DAPO's fields win when a row has both layouts
    aime = _write_jsonl(tmp_path / "aime.jsonl", [
        {"problem_idx": 1, "problem": "Find $n$.", "answer": 70},  # MathArena: integer answers
        "",                                                      # blank lines are skipped
        {"id": 0, "question": "Find $m$.", "answer": 27.0, "url": "x"},  # math-ai/amc23: float answers
    ])
    problems = mt.load(aime)
    assert problems == [mt.Problem("Find $n$.", "70"), mt.Problem("Find $m$.", "27.0")]
    assert mt.reward("\\boxed{27}", problems[1]) == 1.0 and mt.reward("\\boxed{70}", problems[0]) == 1.0


def test_load_field_overrides_take_dotted_paths(tmp_path):
    path = _write_jsonl(tmp_path / "custom.jsonl", [
        {"data": {"text": "What is 1 + 1?"}, "meta": {"solution": {"final": "2"}}, "answer": "wrong"}])
    assert mt.load(path, question_field="data.text", answer_field="meta.solution.final") == [
        mt.Problem("What is 1 + 1?", "2")]
    assert mt.load(path, question_field="data.text") == [mt.Problem("What is 1 + 1?", "wrong")]  # the default
    chat = _write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "Q?"}], "gt": 3}])
    assert mt.load(chat, question_field="messages", answer_field="gt") == [mt.Problem("Q?", "3")]


@pytest.mark.parametrize("rows, kwargs, message", [
    (None, {}, "missing.jsonl: no such file"),
    ([], {}, "empty.jsonl: no problems"),
    (["", "  "], {}, "empty.jsonl: no problems"),
    ([DAPO_ROW, "{not json"], {}, "bad.jsonl:2: not valid JSON"),
    ([DAPO_ROW, "[1, 2]"], {}, "bad.jsonl:2: expected a JSON object"),
    ([{"problem": "Q?"}], {}, "bad.jsonl:1: no answer in reward_model.ground_truth or answer"),
    ([{"answer": "1"}], {}, "bad.jsonl:1: no question text in prompt, problem or question"),
    ([{"problem": "Q?", "answer": ""}], {}, "bad.jsonl:1: no answer"),
    ([{"problem": "Q?", "answer": [1]}], {}, "bad.jsonl:1: no answer"),
    ([{"prompt": [{"role": "system", "content": "hi"}], "answer": "1"}], {}, "bad.jsonl:1: no question text"),
    ([DAPO_ROW], {"answer_field": "reward_model.truth"}, "bad.jsonl:1: no answer in reward_model.truth"),
    ([DAPO_ROW], {"question_field": "question"}, "bad.jsonl:1: no question text in question"),
])
def test_load_bad_input_fails_with_one_line(tmp_path, rows, kwargs, message):
    name = message.split(":")[0]
    path = str(tmp_path / name) if rows is None else _write_jsonl(tmp_path / name, rows)
    with pytest.raises(ValueError) as e:
        mt.load(path, **kwargs)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert str(tmp_path) in str(e.value)  # the message names the file


def test_load_names_the_file_it_cannot_decode(tmp_path):
    path = tmp_path / "latin-1.jsonl"
    path.write_bytes(json.dumps({"problem": "Qué?", "answer": "1"}, ensure_ascii=False).encode("latin-1") + b"\n")
    with pytest.raises(ValueError) as e:
        mt.load(str(path))
    assert str(e.value) == f"{path}: not UTF-8 text (byte 0xe9 cannot be decoded); save it as UTF-8"
    with pytest.raises(ValueError) as e:  # the missing answer names the flag of train.py and eval.py that fixes it
        mt.load(_write_jsonl(tmp_path / "q.jsonl", [{"problem": "Q?", "sol": "1"}]))
    assert str(e.value).endswith("(its fields: problem, sol); name the answer's field with --answer-field")


def test_load_wrong_extension_and_parquet_without_pyarrow(tmp_path, monkeypatch):
    (tmp_path / "x.csv").write_text("problem,answer\n")
    with pytest.raises(ValueError, match="expected a .jsonl or .parquet file"):
        mt.load(str(tmp_path / "x.csv"))
    (tmp_path / "x.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as if pyarrow were not installed
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ValueError) as e:
        mt.load(str(tmp_path / "x.parquet"))
    assert str(e.value) == "reading .parquet needs pyarrow: pip install pyarrow"


def test_load_parquet(tmp_path):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.Table.from_pylist([DAPO_ROW, {**DAPO_ROW, "reward_model": {"ground_truth": "7", "style": "rule"}}]),
                   tmp_path / "dapo.parquet")
    pq.write_table(pa.Table.from_pylist([{"problem": "Find $n$.", "answer": 70}]), tmp_path / "aime.parquet")
    assert mt.load(str(tmp_path / "dapo.parquet")) == [mt.Problem("What is $6 \\times 7$?", "42"),
                                                       mt.Problem("What is $6 \\times 7$?", "7")]
    assert mt.load(str(tmp_path / "aime.parquet")) == [mt.Problem("Find $n$.", "70")]
    with pytest.raises(ValueError, match=r"aime.parquet:1: no answer in solution"):
        mt.load(str(tmp_path / "aime.parquet"), answer_field="solution")


def test_math_prompt_has_the_r1_instruction_once_and_the_chat_template():
    q = mt.Problem("What is 6 * 7?", "42")
    assert mt.prompt_text(q) == "What is 6 * 7?\nPlease reason step by step, and put your final answer within \\boxed{}."
    already = mt.Problem("Please reason step by step, and put your final answer within \\boxed{}. What is 6 * 7?", "42")
    assert mt.prompt_text(already) == already.question  # not appended twice
    chat, plain = _tiny_tokenizer(chat=True), _tiny_tokenizer(chat=False)
    ids = mt.encode(chat, q)
    bos, user, assistant = (chat.token_to_id(t) for t in cd.R1_CHAT)
    assert ids[:2] == [bos, user] and ids[-2:] == [assistant, chat.token_to_id("<think>")] and ids.count(bos) == 1
    assert ids == cd.encode_prompt(chat, mt.prompt_text(q))
    assert mt.encode(plain, q) == plain.encode(mt.prompt_text(q), add_special_tokens=False).ids
    # a DAPO row's prompt asks for \boxed{}, not for DAPO's own "Answer:" line
    p = mt.Problem(mt._question(DAPO_ROW, None), mt._answer(DAPO_ROW, None))
    assert "Answer:" not in mt.prompt_text(p) and mt.prompt_text(p).count("\\boxed{}") == 1


# ---------------------------------------------------------------------------------------
# the demo set


DEMO_RECOMPUTE = {  # each demo template's answer from its three numbers, written independently
    "apples are left": lambda a, b, c: a * b - c,
    "books are on the shelf": lambda a, b, c: a * b + c,
    "cents of change": lambda a, b, c: c - a * b,
    "each friend get": lambda a, b, c: a * b // c if a * b % c == 0 else None,
}


def test_demo_set_is_reproducible_correct_and_in_dapo_layout(tmp_path):
    train, test = mt.make_demo(str(tmp_path / "a"), seed=3, n_train=300, n_test=40)
    files = {n: (tmp_path / "a" / n).read_bytes() for n in ("train.jsonl", "test.jsonl")}
    mt.make_demo(str(tmp_path / "b"), seed=3, n_train=300, n_test=40)
    mt.make_demo(str(tmp_path / "c"), seed=4, n_train=300, n_test=40)
    assert all((tmp_path / "b" / n).read_bytes() == f for n, f in files.items())  # same seed, same bytes
    assert (tmp_path / "c" / "train.jsonl").read_bytes() != files["train.jsonl"]    # control: other seed
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["test.jsonl", "train.jsonl"]  # no .tmp left
    assert (len(train), len(test)) == (300, 40)
    assert len({p.question for p in train + test}) == 340  # distinct, test disjoint from train
    row = json.loads(files["train.jsonl"].splitlines()[0])
    assert row["prompt"][0]["role"] == "user" and row["prompt"][0]["content"] == mt.prompt_text(train[0])
    assert row["reward_model"]["ground_truth"] == train[0].answer
    assert mt.load(str(tmp_path / "a" / "train.jsonl")) == train  # loads back as generated
    used = set()
    for p in train + test:
        (key,) = [k for k in DEMO_RECOMPUTE if k in p.question]
        used.add(key)
        a, b, c = map(int, re.findall(r"\d+", p.question))
        assert p.answer == str(DEMO_RECOMPUTE[key](a, b, c)) and int(p.answer) >= 0, p
        assert mt.reward(f"So \\boxed{{{p.answer}}}.", p) == 1.0
        assert mt.reward(f"So \\boxed{{{int(p.answer) + 1}}}.", p) == 0.0
    assert used == set(DEMO_RECOMPUTE)


def test_demo_cli_writes_the_files_and_refuses_bad_sizes(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository, where lib/ is

    def cli(*flags):
        return subprocess.run([sys.executable, "-m", "lib.mathtask", "--make-demo", str(tmp_path / "d"), *flags],
                              cwd=root, capture_output=True, text=True)

    out = cli("--train", "20", "--test", "5")
    assert out.returncode == 0, out.stderr
    assert "wrote 20 train and 5 test problems" in out.stdout
    assert len(mt.load(str(tmp_path / "d" / "test.jsonl"))) == 5
    out = cli("--train", "0")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.splitlines() == ["error: --train 0 must be at least 1"]


def test_the_demo_set_refuses_more_problems_than_its_templates_allow(tmp_path, monkeypatch):
    """Drawing distinct problems from templates that allow fewer used to loop for ever."""
    monkeypatch.setattr(mt, "NAMES", ["Tom"])
    monkeypatch.setattr(mt, "TEMPLATES", [t for t in mt.TEMPLATES if "marbles" in t[0]])  # 121 (a, b), few c
    train, test = mt.demo_splits(0, 50, 10, patience=2000)  # the control: few enough
    assert len({p.question for p in train + test}) == 60
    with pytest.raises(ValueError, match="the demo set has too few distinct problems for 5000 train and 10 held-out"):
        mt.demo_splits(0, 5000, 10, patience=2000)
    said = one_line_error(lambda: mt.main(["--make-demo", str(tmp_path / "d"), "--train", "5000", "--test", "10"]))
    assert said.startswith("error: the demo set has too few distinct problems for 5000 train and 10 held-out")
    assert list(tmp_path.iterdir()) == []  # checked before the folder is made
