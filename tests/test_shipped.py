"""make_tiny.py and what ships built by it: the search and word-problem traces it pretrains on
(countdown.trace, mathtask.demo_trace), the tiny/ and tiny-math/ models, the default run from tiny/
and README's math demonstration."""
import hashlib
import json
import os
import random
import re
from dataclasses import replace

import pytest
import torch

import countdown as cd
import eval as eval_script
from lib import settings, tasks
import make_tiny
from lib import mathtask as mt
import train
from lib.checkpoint import from_pretrained, load_tokenizer
from conftest import one_line_error
from countdown import check_trace, trace
from make_tiny import build_tokenizer, split_problems
from ngc import Eviction, Sampling, rollout


# ---------------------------------------------------------------------------------------
# make_tiny.py's search traces and the shipped tiny/ model


TINY_DIR = os.path.join(os.path.dirname(train.__file__), "tiny")


def test_trace_example():
    p = cd.Problem((3, 5, 2), 16)
    assert cd.shift_prompt(p) == "<bos> Countdown : reach 16 with 3 5 2 . . . . . . . . ."
    assert trace(p) == "[ 5 3 2 ] 5 + 3 = 8 [ 8 2 ] + 10 no * 16 yes <answer> ( 5 + 3 ) * 2 </answer>"


def test_traces_replay_to_correct_answers():
    problems = cd.generate(400, 123, cd.SMALL)
    for p in problems:
        t = trace(p)
        assert check_trace(p, t), (p, t)
        assert cd.reward(t, p) == 1.0
    lengths = [len(trace(p).split()) for p in problems]
    assert max(lengths) < 400


def test_search_depends_on_target_only_through_verdicts():
    """The trace never restates the target: two problems with the same numbers search
    identically until the first one's "yes" (where the other one says "no")."""
    by_nums = {}
    for p in cd.generate(400, 7, cd.SMALL):
        by_nums.setdefault(tuple(sorted(p.nums)), {})[p.target] = p
    pairs = 0
    for group in by_nums.values():
        ps = sorted(group.values(), key=lambda p: len(trace(p)))
        for short, long in zip(ps, ps[1:]):
            a, b = trace(short).split(), trace(long).split()
            k = a.index("yes")
            assert a[:k] == b[:k] and b[k] == "no"
            pairs += 1
    assert pairs > 20


def test_restating_traces_write_the_target_after_numbers_and_still_replay():
    """trace(problem, p, rng): each `[ ... ]` and each `back` is followed by `reach <target>` with
    probability p, check_trace accepts the restatement of the right target only, and p = 0 draws nothing."""
    p = cd.Problem((3, 5, 2), 16)
    assert trace(p, 1.0, random.Random(0)) == ("[ 5 3 2 ] reach 16 5 + 3 = 8 [ 8 2 ] reach 16 + 10 no * 16 yes "
                                              "<answer> ( 5 + 3 ) * 2 </answer>")
    assert not check_trace(p, trace(p, 1.0, random.Random(0)).replace("reach 16 +", "reach 15 +"))
    rng, restated = random.Random(1), 0
    for q in cd.generate(300, 5, cd.SMALL):
        t = trace(q, 0.25, rng)
        assert check_trace(q, t) and t.replace(f" reach {q.target}", "") == trace(q), (q, t)
        restated += t.count("reach")
    slots = sum(trace(q).count("[") + trace(q).split().count("back") for q in cd.generate(300, 5, cd.SMALL))
    assert 0.2 < restated / slots < 0.3
    rng = random.Random(2)
    trace(p, 0.0, rng)
    assert rng.random() == random.Random(2).random()


def test_pretraining_examples_restate_at_one_rate_whatever_the_tag():
    """tiny/'s pretraining examples: a trace restates the target after each `[ ... ]` and `back` with
    probability RESTATE under a tag of a low or a high rate, a blind tag or none: the tag says
    nothing about it."""
    tok = build_tokenizer()
    problems = cd.generate(1500, 4, cd.SMALL)

    def restated_by_tag():
        rng, by = random.Random(0), {"low": [], "high": [], "blind": [], "none": []}
        for q in problems:
            prompt, completion = make_tiny.countdown_example(tok, q, rng)
            words = tok.decode(prompt + completion).split()
            slots = words.count("[") + words.count("back")  # where a trace may restate the target
            reach = words.count("reach") - 1  # the prompt's own `reach` aside
            at = words.index("<eviction_rate>") + 1 if "<eviction_rate>" in words else None
            tens, units = words[at: at + 2] if at else ("none", "")
            pct = int(tens) * 10 + int(units) if tens.isdigit() else None
            kind = {"-": "blind", "none": "none"}.get(tens) or ("low" if pct < 25 else "high" if pct > 75 else None)
            if kind:
                by[kind].append(reach / slots)
        return {k: sum(v) / len(v) for k, v in by.items()}

    rates = restated_by_tag()
    assert make_tiny.RESTATE == 0.25 and all(abs(v - 0.25) < 0.05 for v in rates.values()), rates


def test_shift_layouts_move_the_targets_block_and_keep_every_block_and_length():
    """tiny-shift: one body shifted by whole blocks of 4, so the target's block index is 1 or 3 in
    training and 2 in tiny-shift-unseen, every layout has the same length (rounds fire at the same
    tokens), the target's block has the same contents in every layout and the next one starts with the
    last number."""
    tok = build_tokenizer()
    blocks = {}
    for q in cd.generate(300, 2, cd.SMALL):
        for style in ("tiny-shift", "tiny-shift-unseen"):
            ids = tok.encode(cd.PROMPTS[style](q)).ids
            assert tok.token_to_id("<unk>") not in ids and len(ids) == 18
            words = cd.PROMPTS[style](q).split()
            at = words.index("reach") + 1  # the target
            blocks.setdefault(style, set()).add(at // 4)
            first = at - at % 4  # the target block's first position
            block, after = words[first: first + 4], words[first + 4: first + 6]
            assert block == [str(q.target), "with", *map(str, q.nums[:2])] and after == [str(q.nums[2]), "."], words
    assert blocks == {"tiny-shift": {1, 3}, "tiny-shift-unseen": {2}}
    tagged, blind = (cd.encode(tok, cd.Problem((3, 5, 2), 16), "tiny-shift", 0.5, b) for b in (False, True))
    assert tok.decode(tagged[-5:]) == "<eviction_rate> 5 0 % </eviction_rate>" and len(tagged) == len(blind)


def _tag(tok, rate, blind=False):
    """The budget tag's tokens in tiny/'s prompt, as the tokenizer's words."""
    words = [tok.id_to_token(i) for i in cd.encode(tok, cd.Problem((3, 5, 2), 16), "tiny-shift", rate, blind)]
    return words[words.index("<eviction_rate>"):]


def test_the_budget_tag_writes_its_rate_tens_then_units():
    """tiny/'s vocabulary (make_tiny.py's) reads ε = 0.42 as the
    integer tokens 4 and 2, so that rates are ordered as their tokens are (tens, then units); blind: as
    many tokens, no digit; every whole percent in [0, 1] is written, 1 as `10 0`, and nothing else."""
    tok = build_tokenizer(make_tiny.WORDS)
    assert load_tokenizer(TINY_DIR).get_vocab() == tok.get_vocab()
    assert _tag(tok, 0.42) == ["<eviction_rate>", "4", "2", "%", "</eviction_rate>"]
    assert _tag(tok, 0.42, blind=True) == ["<eviction_rate>", "-", "-", "%", "</eviction_rate>"]
    half, three_quarters = _tag(tok, 0.5), _tag(tok, 0.75)
    changed = [k for k, (a, b) in enumerate(zip(half, three_quarters)) if a != b]
    assert len(half) == len(three_quarters) and changed == [1, 2]  # the two digits, nothing else
    assert (half[1:3], three_quarters[1:3]) == (["5", "0"], ["7", "5"])
    tags = [_tag(tok, pct / 100) for pct in range(101)]
    assert all(len(t) == 5 and t[0] == "<eviction_rate>" and t[3:] == ["%", "</eviction_rate>"] for t in tags)
    assert [10 * int(t[1]) + int(t[2]) for t in tags] == list(range(101)) and tags[100][1:3] == ["10", "0"]
    assert sorted(tags, key=lambda t: (int(t[1]), int(t[2]))) == tags  # tens first: the rates' order
    assert {tuple(_tag(tok, pct / 100, blind=True)) for pct in range(101)} == {tuple(_tag(tok, 0.42, blind=True))}
    assert _tag(tok, 0.333)[1:3] == ["3", "3"] and _tag(tok, 0.996)[1:3] == ["10", "0"]  # whole percents
    with pytest.raises(ValueError, match=r"eviction rate 1.2 is not in \[0, 1\]"):
        cd.rate_tag(1.2)


def test_a_vocabulary_that_cannot_spell_the_tag_is_refused():
    """A vocabulary that lacks a word of the budget tag (here `%`) is refused in one line by the runs' prompt
    check when the run writes the tag; tiny/'s own spells it (the control), and without the tag there is no
    word to lack."""
    lacking = build_tokenizer([w for w in make_tiny.WORDS if w != "%"])
    run = replace(settings.run_defaults(TINY_DIR), interoception=True)
    with pytest.raises(ValueError, match=r"cannot spell 1 of this run's prompt words \(%\)") as err:
        tasks.check_prompts(run, lacking, "a build without %", [tasks.SAMPLE])
    assert "\n" not in str(err.value)
    tasks.check_prompts(run, load_tokenizer(TINY_DIR), TINY_DIR, [tasks.SAMPLE])  # the control
    tasks.check_prompts(replace(run, interoception=False), lacking, "no tag", [tasks.SAMPLE])


def test_bare_back_returns_without_the_numbers_and_still_replays():
    """A dead end returns with `back` alone (restated target or not), the next move starts again
    from the first `[ ... ]`'s numbers, and check_trace replays it; a wrong move after a bare back fails."""
    p = cd.Problem((8, 7, 1), 63)
    bare = trace(p)
    assert bare == ("[ 8 7 1 ] 8 + 7 = 15 [ 15 1 ] + 16 no * 15 no - 14 no / 15 no back 8 * 7 = 56 [ 56 1 ] + 57 no "
                    "* 56 no - 55 no / 56 no back 8 - 7 = 1 [ 1 1 ] + 2 no * 1 no - 0 no / 1 no back 8 + 1 = 9 [ 9 7 ] "
                    "+ 16 no * 63 yes <answer> ( 8 + 1 ) * 7 </answer>")
    assert "back [" not in bare and bare.count("back") == 3 and check_trace(p, bare)
    assert not check_trace(p, bare.replace("back 8 - 7 = 1", "back 8 - 7 = 2"))  # negative control
    rng = random.Random(5)
    for q in cd.generate(300, 6, cd.SMALL):
        t = trace(q, 0.25, rng)
        assert check_trace(q, t) and cd.reward(t, q) == 1.0, (q, t)

def _first_move(text):
    """A trace's first move, `a op b` (a trace written without restating the target)."""
    return " ".join(text.split()[5:8])


def test_shuffled_traces_replay_solve_and_keep_the_leaves_order():
    """trace(problem, restate, rng, shuffle): with probability shuffle the pairs and each pair's
    operations are tried in a random order; every such trace replays (check_trace) to a right
    answer, its leaves keep their order (+ * - /), and the same seed writes the same traces."""
    problems = cd.generate(400, 13, cd.SMALL)
    mixed = [trace(q, 0.25, random.Random(k), shuffle=1.0) for k, q in enumerate(problems)]
    for q, t in zip(problems, mixed):
        assert check_trace(q, t) and cd.reward(t, q) == 1.0, (q, t)
        for leaves in re.findall(r"\] (?:reach \d+ )?((?:[-+*/] \d+ (?:no|yes) ?)+)", t):
            ops = leaves.split()[::3]
            assert ops == sorted(ops, key="+*-/".index), t
    assert sum(t.replace(f" reach {q.target}", "") != trace(q) for q, t in zip(problems, mixed)) > 300
    assert mixed == [trace(q, 0.25, random.Random(k), shuffle=1.0) for k, q in enumerate(problems)]
    assert mixed != [trace(q, 0.25, random.Random(k + 1), shuffle=1.0) for k, q in enumerate(problems)]
    assert not check_trace(problems[0], mixed[0].replace(" yes ", " no "))  # the control: a wrong verdict


@pytest.mark.parametrize("shuffle", [0.0, 0.25, 1.0])
def test_a_share_shuffle_of_traces_tries_another_first_move(shuffle):
    """A shuffled search tries the canonical first move (the first pair's +) first with probability
    s/3 · 1/k (k: that pair's operations, s: the pairs that write the same move), so the share of
    traces whose first move is another one is shuffle times the mean of 1 - s/(3k): a shuffle never
    or always applied fails."""
    problems, rng = cd.generate(4000, 17, cd.SMALL), random.Random(0)
    other = [_first_move(trace(q, 0.0, rng, shuffle)) != _first_move(trace(q)) for q in problems]
    expected = 0.0
    for q in problems:
        a, b, c = sorted(q.nums, reverse=True)
        same = sum(pair == (a, b) for pair in [(a, b), (a, c), (b, c)])
        expected += shuffle * (1 - same / (3 * len(cd.moves(a, b)))) / len(problems)
    assert abs(sum(other) / len(problems) - expected) < 0.03, (sum(other) / len(problems), expected)


def test_an_unshuffled_trace_is_todays_and_draws_nothing_more(tmp_path):
    """shuffle = 0 writes the traces and draws the random numbers of trace(problem, restate, rng):
    make_tiny's examples pinned byte for byte (a digest of 2,000 of them with tiny/'s vocabulary, taken
    when the one-token budget tag was removed; the digest before it, of that tag's examples, was taken
    before --shuffle-order existed); tiny/'s tokenizer is make_tiny's build, byte for byte."""
    rng, same = random.Random(4), random.Random(4)
    for q in cd.generate(300, 8, cd.SMALL):
        assert trace(q, 0.25, rng, shuffle=0.0) == trace(q, 0.25, same)
    assert rng.random() == same.random()
    problems = cd.generate(2000, 11, cd.SMALL)

    def digest(**kw):
        tok, rng = build_tokenizer(make_tiny.WORDS), random.Random(3)
        examples = [make_tiny.countdown_example(tok, q, rng, **kw) for q in problems]
        return hashlib.sha256("".join(map(repr, examples)).encode()).hexdigest()

    assert digest() == "774aa31ec7067bb6fad0c48144ba450519c3260acd22181f2e3a42bcbcafff6d"
    assert digest(shuffle=0.01) != digest()  # the control: one shuffled trace in a hundred changes them
    build_tokenizer(make_tiny.WORDS).save(str(tmp_path / "tokenizer.json"))
    assert (tmp_path / "tokenizer.json").read_bytes() == open(os.path.join(TINY_DIR, "tokenizer.json"), "rb").read()


@pytest.mark.parametrize("flags, message", [
    (["--steps", "0"], "--steps 0 must be at least 1"),  # was an UnboundLocalError after building the model
    (["--max-new-tokens", "-1"], "--max-new-tokens -1 must be at least 1"),  # was a traceback after training
    (["--batch", "0"], "--batch 0 must be at least 1"), (["--micro", "0"], "--micro 0 must be at least 1"),
    (["--threads", "0"], "--threads 0 must be at least 1"), (["--warmup", "-1"], "--warmup -1 must be at least 0"),
    (["--layers", "0"], "--layers 0 must be at least 1"), (["--ffn", "0"], "--ffn 0 must be at least 1"),
    (["--n-test", "0"], "--n-test 0 must be at least 1"), (["--train-problems", "0"], "--train-problems 0 must be"),
    (["--lr", "0"], "--lr 0.0 must be positive"), (["--lr", "nan"], "--lr nan must be positive"),
    (["--heads", "3"], "--d 192 --heads 3: the heads must be"),
    (["--d", "100"], "--d 100 --heads 4: the heads must be"), (["--task", "maths"], "argument --task: invalid choice"),
    (["--n-test", "501"], "--n-test 501: the tiny difficulty's held-out set (countdown.held_out) has 500 problems"),
    (["--shuffle-order", "1.5"], "--shuffle-order 1.5 must lie in [0, 1]"),
    (["--shuffle-order", "nan"], "--shuffle-order nan must lie in [0, 1]"),
    (["--task", "math", "--shuffle-order", "0.5"], "--shuffle-order is Countdown's (tiny/)"),
    (["--delta", "4"], "eviction cadence δ=4 must be larger than the window w=4"),
    (["--retention", "0.9,1.2"], "the run's retention 0.9,1.2 must lie in [0, 1)"),
    (["--retention", "0.9,x"], "--retention '0.9,x' must be comma-separated numbers")])
def test_make_tiny_checks_every_flag_before_it_builds_anything(tmp_path, monkeypatch, flags, message):
    monkeypatch.setattr(make_tiny, "init_weights", None)  # nothing may be built
    monkeypatch.setattr(make_tiny, "report", None)  # nor evaluated
    argv = ["--out", str(tmp_path / "t"), "--train-problems", "10", "--n-test", "5", *flags]
    said = one_line_error(lambda: make_tiny.main(argv))
    assert said.startswith(f"error: {message}") and list(tmp_path.iterdir()) == [], said


def test_make_tiny_never_replaces_what_it_did_not_build(tmp_path, monkeypatch):
    """--out is replaced whole: a directory holding anything but a build's four files, or a file,
    is refused and kept as it was; a directory of an earlier build passes."""
    monkeypatch.setattr(make_tiny, "init_weights", None)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "keep.txt").write_text("mine")
    (tmp_path / "a-file").write_text("mine too")
    for out, message in ((tmp_path / "notes", f"--out {tmp_path / 'notes'} holds keep.txt, which a build would delete"),
                         (tmp_path / "a-file", f"--out {tmp_path / 'a-file'} is a file")):
        argv = ["--out", str(out), "--steps", "1", "--train-problems", "10", "--n-test", "5"]
        said = one_line_error(lambda: make_tiny.main(argv))
        assert said.startswith(f"error: {message}"), said
    assert (tmp_path / "notes" / "keep.txt").read_text() == "mine" and (tmp_path / "a-file").read_text() == "mine too"
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a-file", "keep.txt", "notes"]
    make_tiny.check_out(TINY_DIR)  # the control: an earlier build (tiny/ itself) may be rebuilt in place


@pytest.mark.parametrize("corrupt", [
    lambda t: t.replace("* 16 yes", "* 17 yes"),  # wrong arithmetic at a leaf
    lambda t: t.replace("+ 10 no", "+ 10 yes"),  # wrong verdict
    lambda t: t.replace("5 + 3 = 8", "5 + 3 = 9"),  # wrong move
    lambda t: t.replace("[ 8 2 ]", "[ 8 3 ]"),  # wrong numbers left
    lambda t: t.replace("( 5 + 3 ) * 2", "( 5 + 3 ) * 3"),  # answer misses a number
    lambda t: t.replace(" </answer>", ""),  # no closed answer
    lambda t: t[: t.index("<answer>")],  # truncated
])
def test_corrupted_trace_fails_replay(corrupt):
    p = cd.Problem((3, 5, 2), 16)
    t = trace(p)
    assert check_trace(p, t)
    bad = corrupt(t)
    assert bad != t and not check_trace(p, bad)


def test_corrupted_traces_fail_in_bulk():
    for p in cd.generate(100, 9, cd.SMALL):
        words = trace(p).split()
        for k, w in enumerate(words):
            if w.isdigit():  # change any one number of the search or the answer
                bad = " ".join(words[:k] + [str(int(w) + 1)] + words[k + 1:])
                assert not check_trace(p, bad), bad


def test_tokenizer_round_trips_a_trace():
    tok = build_tokenizer()
    unk = tok.token_to_id("<unk>")
    for p in cd.generate(100, 3, cd.SMALL):
        text = cd.shift_prompt(p) + " " + trace(p)
        ids = tok.encode(text).ids
        assert unk not in ids and ids[0] == tok.token_to_id("<bos>") and ids.count(ids[0]) == 1
        assert len(ids) == len(text.split())  # one token per word, numbers included
        assert tok.decode(ids, skip_special_tokens=False) == text
        tagged = cd.encode(tok, p, "tiny-shift", eviction_rate=0.5)  # the --interoception prompt
        assert unk not in tagged and tok.decode(tagged[-5:]) == "<eviction_rate> 5 0 % </eviction_rate>"
        completion = tok.decode(tok.encode(trace(p)).ids + [tok.token_to_id("<eos>")], skip_special_tokens=True)
        assert cd.reward(completion, p) == 1.0


def test_held_out_set_is_disjoint_from_pretraining_and_from_every_runs_training():
    """One held-out set for every seed: none of its problems is among the 300,000 tiny/ was
    pretrained on (make_tiny.py's split at its defaults) nor among any seed's training problems
    (train.py's, tasks.load_problems), as a set intersection over canonical problem keys. Of the
    problems of it whose search must leave its first pair (tiny-deep), a third are the validation
    split that train.py evaluates on (recipes are chosen there), the rest the test split that
    eval.py reads by default (claims report there): disjoint, and together the whole set."""
    pretrain, test = split_problems(0, 500)  # make_tiny.py's defaults: --seed 0 --n-test 500
    held, pretrained = {cd._key(p) for p in test}, {cd._key(p) for p in pretrain}
    assert len(held) == len(test) == 500 and not held & pretrained
    shipped = settings.run_defaults(TINY_DIR)
    assert shipped.difficulty == "tiny-deep"
    deep = [p for p in test if cd.backtracks(p, depth=2)]
    validation, final = (tasks.held_out(shipped, split=split) for split in cd.SPLITS)
    assert (len(validation), len(final)) == (len(deep) // 3, len(deep) - len(deep) // 3) == (47, 95)
    assert sorted(validation + final, key=deep.index) == deep and not set(validation) & set(final)
    assert final == [p for p in deep if p not in validation]  # in the held-out stream's order
    for seed in (0, 1, 2):
        train, seed_test = tasks.load_problems(replace(shipped, seed=seed))
        assert seed_test == validation[:shipped.eval_problems] == validation
        assert not held & {cd._key(p) for p in train}
    # Negative control: the earlier held-out problems of seed 1 (the first 200 of its own stream)
    # are mostly problems tiny/ was pretrained on, and the check sees it.
    earlier = cd._take(cd._stream(random.Random(1), cd.SMALL), 200, unique=True)
    assert len({cd._key(p) for p in earlier} & pretrained) > 100


def _solved(model, tok, problems, sampling, eviction=None):
    """How many problems one rollout each solves, prompted as the shipped run prompts them."""
    encode = tasks.prompt_encoder("countdown", settings.run_defaults(TINY_DIR).prompt)
    out = eval_script.roll_out_and_score(model, tok, problems, sampling, eviction, encode,
                                        generator=torch.Generator().manual_seed(0), batch_size=len(problems))
    return out["reward"].sum().item()


def test_shipped_tiny_model_loads_and_solves():
    """The full cache solves nearly every held-out problem, greedy or sampled, those whose search
    goes back too; on these, the untrained model under eviction (NGC's scores, ε = 0.5) solves
    few: what the default run must learn is what to keep."""
    model, tok = from_pretrained(TINY_DIR), load_tokenizer(TINY_DIR)
    cfg = model.config
    assert cfg.vocab_size == tok.get_vocab_size()
    assert cfg.bos_token_id == tok.token_to_id("<bos>") and cfg.eos_ids == [tok.token_to_id("<eos>")]
    assert sum(os.path.getsize(os.path.join(TINY_DIR, f)) for f in os.listdir(TINY_DIR)) < 8e6
    _, test = split_problems(0, 50, n_train=1)
    greedy, sampled = Sampling(max_new_tokens=256, greedy=True), Sampling(max_new_tokens=256)
    assert _solved(model, tok, test, greedy) >= 45 and _solved(model, tok, test, sampled) >= 45
    back = [p for p in test if cd.backtracks(p)]
    run = settings.run_defaults(TINY_DIR)
    evicted = Eviction(run.delta, run.block, run.window, 0.5, greedy=True)
    assert len(back) >= 20 and _solved(model, tok, back, greedy) >= 0.9 * len(back)
    assert _solved(model, tok, back, greedy, evicted) <= 0.2 * len(back)


def _build_small(out, seed, *flags):
    make_tiny.main(["--out", str(out), "--seed", str(seed), "--steps", "3", "--warmup", "1", "--batch", "8",
                    "--micro", "4", "--d", "32", "--layers", "1", "--heads", "2", "--ffn", "64",
                    "--train-problems", "500", "--n-test", "2", *flags])
    return {f.name: f.read_bytes() for f in sorted(out.iterdir())}


def test_make_tiny_rebuilds_bit_for_bit(tmp_path, capsys):
    """make_tiny.py in miniature: the same seed writes the same four files byte for byte (this
    is how tiny/ is reproducible); another seed writes other weights (the control)."""
    first, again, other = (_build_small(tmp_path / name, seed) for name, seed in [("a", 0), ("b", 0), ("c", 1)])
    assert sorted(first) == ["config.json", "model.safetensors", "ngc.json", "tokenizer.json"]
    assert first == again
    assert other["model.safetensors"] != first["model.safetensors"]
    assert not any(p.name.endswith((".tmp", ".old")) for p in tmp_path.iterdir())
    assert "final loss" in capsys.readouterr().out


NEXT_TOY = ["--shuffle-order", "0.25", "--max-new-tokens", "64", "--delta", "20", "--retention",
            "0.9,0.7,0.35"]


@pytest.fixture(scope="module")
def digit_build(tmp_path_factory):
    """A miniature build with the next toy's flags: (its directory, its four files' bytes)."""
    out = tmp_path_factory.mktemp("mixed") / "model"
    return out, _build_small(out, 0, *NEXT_TOY)


def test_make_tiny_builds_the_next_toy_bit_for_bit(digit_build, tmp_path):
    """--shuffle-order and the run's flags: the same flags and seed write the same four
    files; ngc.json is tiny/'s run with the flags' values; the vocabulary has no one-token rate; the
    weights differ from the default build's (the control)."""
    out, first = digit_build
    assert _build_small(tmp_path / "again", 0, *NEXT_TOY) == first
    run = json.loads(first["ngc.json"])
    assert run == {**make_tiny.TINY_RUN, "max_new_tokens": 64, "delta": 20, "retention": "0.9,0.7,0.35"}
    assert list(run) == list(make_tiny.TINY_RUN)
    tok = load_tokenizer(str(out))
    assert tok.token_to_id("50%") is None and tok.token_to_id("%") is not None
    default = _build_small(tmp_path / "default", 0)
    assert json.loads(default["ngc.json"]) == make_tiny.TINY_RUN
    assert default["model.safetensors"] != first["model.safetensors"]


def test_the_run_draws_its_groups_rates_and_writes_them_in_digits(digit_build, tmp_path, monkeypatch):
    """train.py --interoception on a digit-tag build: the groups draw rates anywhere in (0, 1] (here
    0.03, 0.42 and 1), the prompt check accepts them, and each group's prompts end with its rate's
    tens and units (blind: `- -`, the same length)."""
    seen = {}

    def spy(model, prompts, sampling, eviction=None, rates=None, **kw):
        seen[run] = prompts, rates
        return rollout(model, prompts, replace(sampling, max_new_tokens=4), eviction, rates=rates, **kw)

    monkeypatch.setattr(train, "rollout", spy)
    out, _ = digit_build
    for run, flags in (("rate", []), ("blind", ["--blind-tag"])):
        train.main(["--model", str(out), "--out", str(tmp_path / run), "--threads", "1", "--steps", "1",
                    "--prompts", "8", "--group", "2", "--eval-every", "0", "--save-every", "0", "--interoception",
                    "--interoception-rates", "0.03,0.42,1", "--retention", "0.5", *flags])
    (tagged, rates), (blind, blind_rates) = seen["rate"], seen["blind"]
    assert torch.equal(rates, blind_rates) and {round(r, 6) for r in rates.tolist()} == {0.03, 0.42, 1.0}
    tok = load_tokenizer(str(out))
    for a, b, rate in zip(tagged, blind, rates.tolist()):
        tens, units = divmod(round(100 * rate), 10)
        assert tok.decode(a[-5:]) == f"<eviction_rate> {tens} {units} % </eviction_rate>"
        assert len(a) == len(b) and tok.decode(b[-5:]) == "<eviction_rate> - - % </eviction_rate>"


def test_default_run_starts_from_the_shipped_model(tmp_path, capsys):
    """`python train.py --task countdown` with no --model: tiny/ and its ngc.json, shrunk to one
    small step and one evaluation."""
    from make_tiny import TINY_RUN
    with open(os.path.join(TINY_DIR, "ngc.json")) as f:
        assert json.load(f) == TINY_RUN  # the shipped run defaults are the ones make_tiny.py writes
    train.main(["--task", "countdown", "--out", str(tmp_path), "--threads", "1", "--steps", "1", "--prompts", "2",
                "--group", "2", "--max-new-tokens", "48", "--eval-problems", "4", "--eval-every", "1"])
    printed = capsys.readouterr().out
    assert "model " + TINY_DIR in printed and f"δ={TINY_RUN['delta']}" in printed
    assert "ε = 0.5, pass@1 (greedy top-K)" in printed and "peak-KV reduction" in printed
    steps = [json.loads(line) for line in open(tmp_path / "log.jsonl")]
    assert [s["step"] for s in steps if "reward" in s] == [0] and sum("eval" in s for s in steps) == 2
    assert settings.run_defaults(str(tmp_path / "checkpoint")).prompt == "tiny-shift"


def test_blind_tag_is_interoception_without_the_rate(tmp_path, monkeypatch):
    """--interoception --blind-tag, the control of §5.3's comparison: the groups draw the same ε
    as under --interoception, and the prompts have the same length and differ only where the
    tag states the rate ("-" instead of the rate's number)."""
    seen = {}

    def spy(model, prompts, sampling, eviction=None, rates=None, **kw):
        seen[run] = prompts, rates
        return rollout(model, prompts, replace(sampling, max_new_tokens=4), eviction, rates=rates, **kw)

    monkeypatch.setattr(train, "rollout", spy)
    for run, flags in (("rate", []), ("blind", ["--blind-tag"])):
        train.main(["--out", str(tmp_path / run), "--threads", "1", "--steps", "1", "--prompts", "4", "--group", "2",
                    "--eval-every", "0", "--save-every", "0", "--interoception", *flags])
    (tagged, rates), (blind, blind_rates) = seen["rate"], seen["blind"]
    assert rates is not None and torch.equal(rates, blind_rates) and len(set(rates.tolist())) > 1
    tok = load_tokenizer(TINY_DIR)
    for a, b, rate in zip(tagged, blind, rates.tolist()):
        changed = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
        assert len(a) == len(b) and changed == [len(a) - 4, len(a) - 3]  # <eviction_rate> TENS UNITS % ...
        pct = round(100 * rate)
        assert tok.decode(a[-5:]) == f"<eviction_rate> {pct // 10} {pct % 10} % </eviction_rate>"
        assert tok.decode(b[-5:]) == "<eviction_rate> - - % </eviction_rate>"


# ---------------------------------------------------------------------------------------
# make_tiny.py --task math: word-problem traces and the shipped tiny-math/ model (the math
# pipeline of §5.4 in miniature)


TINY_MATH_DIR = os.path.join(os.path.dirname(train.__file__), "tiny-math")
SHELF = mt.Problem("A shelf has 8 rows of 12 books. Mia adds 37 more books. How many books are on the shelf?", "133")


def test_math_trace_example():
    assert mt.demo_trace(SHELF) == (
        "1 : 12 , 2 : 24 , 3 : 36 , 4 : 48 , 5 : 60 , 6 : 72 , 7 : 84 , 8 : 96 , so 96 books . "
        "96 + 37 : 6 + 7 = 13 , 90 + 30 + 10 = 130 , 130 + 3 = 133 . \\boxed { 133 }")
    apples = mt.Problem("Tom has 8 boxes of 12 apples and gives away 37 apples. How many apples are left?", "59")
    assert mt.demo_trace(apples).endswith(
        "so 96 apples . 96 - 37 : 16 - 7 = 9 , 90 - 10 - 30 = 50 , 50 + 9 = 59 . \\boxed { 59 }")
    with pytest.raises(ValueError, match="not one of mathtask.TEMPLATES"):
        mt.demo_trace(mt.Problem("What is 2 + 3?", "5"))


def _column_result(x, y, text):
    """Check a column sum step by step and return its result: each step `p op q [op r] = s` is
    right, the units line starts from x's units digit (+ 10 when it borrows) and takes y's, the
    last line adds the tens line's result and the units line's units digit."""
    steps = []
    for step in text.split(" , "):
        left, right = step.split(" = ")
        words = left.split()
        value = int(words[0])
        for op, n in zip(words[1::2], words[2::2]):
            value = value + int(n) if op == "+" else value - int(n)
        assert value == int(right) >= 0, step
        steps.append((words, value))
    (first, units), (_, tens), (last, result) = steps
    assert int(first[0]) in (x % 10, x % 10 + 10) and int(first[2]) == y % 10, text
    assert last == [str(tens), "+", str(units % 10)], text
    return result


@pytest.mark.parametrize("op", ["+", "-"])
def test_columns_add_and_subtract(op):
    for x in range(0, 300, 7):
        for y in range(0, x + 1, 3):
            assert _column_result(x, y, mt.columns(x, op, y)) == (x + y if op == "+" else x - y), (x, op, y)
    with pytest.raises(AssertionError):  # the control: a dropped carry is caught
        _column_result(96, 37, mt.columns(96, "+", 37).replace(" + 10 = 130", " = 130"))


def test_math_traces_decode_to_reward_one():
    """Every demo template, 400 problems: trace ids + EOS decode (joined with spaces, specials
    skipped) to a completion whose last \\boxed{...} is the answer; no word is <unk>."""
    tok = build_tokenizer(make_tiny.MATH_WORDS)
    unk, eos = tok.token_to_id("<unk>"), tok.token_to_id("<eos>")
    problems, _ = mt.demo_splits(5, 400, 1)
    assert {u for p in problems for u in mt.DEMO_LAST_STEP if f" {u}" in p.question} == set(mt.DEMO_LAST_STEP)
    for p in problems:
        ids = tok.encode(mt.demo_trace(p)).ids
        assert unk not in ids and len(ids) == len(mt.demo_trace(p).split())
        completion = tok.decode(ids + [eos], skip_special_tokens=True)
        assert completion == mt.demo_trace(p) and mt.reward(completion, p) == 1.0


@pytest.mark.parametrize("corrupt", [
    lambda t: t.replace("{ 133 }", "{ 134 }"),  # wrong answer
    lambda t: t.replace(" }", ""),  # the box never closes
    lambda t: t[: t.index("\\boxed")],  # truncated before the box
    lambda t: t.replace("\\boxed", "boxed"),  # no box
])
def test_corrupted_math_trace_scores_zero(corrupt):
    t = mt.demo_trace(SHELF)
    assert mt.reward(t, SHELF) == 1.0
    bad = corrupt(t)
    assert bad != t and mt.reward(bad, SHELF) == 0.0


def test_math_prompts_are_mathtask_encode_without_unk():
    """The prompts pretraining sees are mathtask.encode's (the plain fallback: this vocabulary has
    no R1 chat tokens), one token per word, none <unk>, for every demo problem; the targets start
    at the first trace token. Control: a word outside the demo questions is <unk>."""
    tok = build_tokenizer(make_tiny.MATH_WORDS)
    unk = tok.token_to_id("<unk>")
    train_set, test_set = mt.demo_splits(0, 2000, 200)
    for p in train_set + test_set:
        ids = mt.encode(tok, p)
        assert unk not in ids and ids == tok.encode(mt.prompt_text(p)).ids
        assert tok.decode(ids) == " ".join(mt.prompt_text(p).split())
    assert unk in mt.encode(tok, mt.Problem("A farmer has 3 cows.", "3"))
    by_prompt = {tuple(mt.encode(tok, p)): p for p in train_set[:40]}
    for x, y in make_tiny.batches(tok, train_set[:40], random.Random(0), 40, 8, make_tiny.math_example):
        for row, target in zip(x.tolist(), y.tolist()):
            start = next(i for i, v in enumerate(target) if v != -100) + 1  # the first completion token
            completion = tok.decode([v for v in target if v != -100], skip_special_tokens=True)
            assert mt.reward(completion, by_prompt[tuple(row[:start])]) == 1.0


def _build_small_math(out, seed):
    return _build_small(out, seed, "--task", "math", "--train-problems", "300", "--max-new-tokens", "16")


def test_make_tiny_math_rebuilds_bit_for_bit(tmp_path, capsys):
    """make_tiny.py --task math in miniature: one seed writes the same four files byte for byte,
    another seed other weights (the control); ngc.json is the math run's."""
    first, again, other = (_build_small_math(tmp_path / name, seed) for name, seed in [("a", 0), ("b", 0), ("c", 1)])
    assert sorted(first) == ["config.json", "model.safetensors", "ngc.json", "tokenizer.json"]
    assert first == again
    assert other["model.safetensors"] != first["model.safetensors"]
    assert json.loads(first["ngc.json"]) == {**make_tiny.MATH_RUN, "max_new_tokens": 16}  # the run's, its flag's
    assert not any(p.name.endswith((".tmp", ".old")) for p in tmp_path.iterdir())
    assert "final loss" in capsys.readouterr().out


def test_shipped_tiny_math_model_solves_and_eviction_hurts():
    """tiny-math/ loads through from_pretrained, is small, and solves most of 16 held-out demo
    problems greedily from mathtask.encode's prompts; evicting half the cache every δ tokens
    with its untrained scores (ngc.json's δ, b, w) solves fewer."""
    model, tok = from_pretrained(TINY_MATH_DIR), load_tokenizer(TINY_MATH_DIR)
    cfg = model.config
    assert cfg.vocab_size == tok.get_vocab_size() and cfg.eos_ids == [tok.token_to_id("<eos>")]
    assert sum(os.path.getsize(os.path.join(TINY_MATH_DIR, f)) for f in os.listdir(TINY_MATH_DIR)) < 8e6
    with open(os.path.join(TINY_MATH_DIR, "ngc.json")) as f:
        run = json.load(f)
    assert run == make_tiny.MATH_RUN
    defaults = settings.saved(settings.run_defaults(TINY_MATH_DIR))  # every key is one of train.py's settings
    assert defaults["task"] == "math" and {k: defaults[k] for k in run} == run
    _, test = mt.demo_splits(0, 1, 200)
    test = test[:16]  # held out: the first problems of the seed's stream never reach pretraining
    sampling = Sampling(max_new_tokens=run["max_new_tokens"], greedy=True)
    full = eval_script.roll_out_and_score(model, tok, test, sampling, None, encode=mt.encode, reward_fn=mt.reward)
    assert full["reward"].sum() >= 13, full["texts"]
    evicted = eval_script.roll_out_and_score(model, tok, test, sampling, Eviction(run["delta"], run["block"], run["window"], 0.5, greedy=True),
                          encode=mt.encode, reward_fn=mt.reward)
    assert evicted["reward"].sum() <= full["reward"].sum() - 4, evicted["texts"]


def test_the_math_demo_trains_from_tiny_math(tmp_path, capsys):
    """README's CPU demonstration: `train.py --task math --model tiny-math` on the demo set, shrunk
    to one small step and one evaluation, runs with tiny-math/ngc.json's recipe."""
    mt.make_demo(tmp_path / "data", n_train=16, n_test=4)
    model = os.path.join(os.path.dirname(train.__file__), "tiny-math")
    train.main(["--model", model, "--out", str(tmp_path / "run"), "--threads", "1", "--steps", "1", "--prompts", "2",
                "--group", "2", "--data", str(tmp_path / "data" / "train.jsonl"),
                "--eval-data", str(tmp_path / "data" / "test.jsonl"), "--eval-every", "1"])
    out = capsys.readouterr().out
    assert "NGC on math" in out and "δ=32" in out and "ε = 0.5, greedy tokens" in out
    assert settings.run_defaults(str(tmp_path / "run" / "checkpoint")).task == "math"


# ---------------------------------------------------------------------------------------
# The method files as a reader meets them


ENGINE = ["model.py", "gumbel.py", "replay.py", "ngc.py", "countdown.py", "train.py"]


def test_the_code_fits_100_columns_and_the_engine_imports_nothing_from_lib():
    """Lines of at most 100 characters in the method files, lib/, evaluation/ and scripts/ (so that
    a line count is of the code as it stays), and the engine (the method files but train.py)
    reaches no plumbing."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = ENGINE + [os.path.join(d, f) for d in ("lib", "evaluation", "scripts")
                     for f in sorted(os.listdir(os.path.join(root, d))) if f.endswith(".py")]
    for name in code:
        text = open(os.path.join(root, name), encoding="utf-8").read()
        long = [i + 1 for i, line in enumerate(text.splitlines()) if len(line) > 100]
        assert not long, f"{name}: lines {long} are over 100 characters"
    for name in ENGINE:
        text = open(os.path.join(root, name), encoding="utf-8").read()
        assert name == "train.py" or not re.search(r"^(from|import) lib\b", text, re.M), name
