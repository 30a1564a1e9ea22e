"""Evaluation and reports: peak-KV reduction and pass@k, eval.py's CLI, show.py and reproduce.py."""
import io
import itertools
import json
import math
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from html.parser import HTMLParser
from types import SimpleNamespace

import pytest
import torch

import baselines
import bench
import countdown as cd
import eval as evaluation
import make_tiny
import reproduce
import settings
import show
import tasks
import train

from checkpoint import load_tokenizer
from ngc import Eviction, Sampling, rollout
from replay import death_times, visibility
from conftest import (EV, STEP_KEYS, TINY_MODEL, TRAIN_DEFAULTS, Reached, files_under, one_line_error, prompts_of, reached,
                      run_train, write_checkpoint)


# ---------------------------------------------------------------------------------------
# Peak-KV reduction (§5.1) and pass@k


def test_peak_kv_reduction_of_a_constructed_case(model):
    """3 layers, δ=8, b=2, ε=0.5, no EOS. Prompt 5 + 20 new tokens: 24 tokens fed (the last one
    sampled is never fed). Without eviction the peak is 3·24 = 72. With it, each layer holds 8,
    keeps 4; 4+8 = 12, keeps 6; 6+8 = 14, keeps 8: peak 3·14 = 42. With 12 new tokens: 16 fed,
    peak 3·16 = 48 against 3·12 = 36."""
    e = Eviction(delta=8, block=2, window=3, rate=0.5, greedy=True)
    peaks = []
    for m in (20, 12):
        s = Sampling(max_new_tokens=m, greedy=True)
        full, evicted = (rollout(model, prompts_of([5]), s, x) for x in (None, e))
        peaks.append((int(full.peak_kv), int(evicted.peak_kv)))
    assert peaks == [(72, 42), (48, 36)]
    ref, pol = torch.tensor([[72.0], [48.0]], dtype=torch.float64), torch.tensor([[42.0], [36.0]], dtype=torch.float64)
    assert abs(evaluation.kv_reduction(ref, pol) - (72 / 42 + 48 / 36) / 2) < 1e-12  # = 32/21
    # Negative control: the ratio of mean peaks (a different estimator) differs.
    assert abs(evaluation.kv_reduction(ref, pol) - 120 / 78) > 1e-3
    # With samples, a problem's peak is the mean over its samples.
    assert abs(evaluation.kv_reduction(torch.tensor([[10.0, 30.0]]), torch.tensor([[5.0, 10.0]])) - 20 / 7.5) < 1e-6


def test_pass_at_k_matches_its_closed_form():
    for n, k in [(1, 1), (5, 1), (5, 2), (8, 4), (10, 10)]:
        for c in range(n + 1):
            # closed form: the chance that k of n draws without replacement include a correct one
            subsets = list(itertools.combinations(range(n), k))
            brute = sum(any(i < c for i in s) for s in subsets) / len(subsets)
            stable = 1.0 if n - c < k else 1 - math.prod(1 - k / i for i in range(n - c + 1, n + 1))
            got = evaluation.pass_at_k(n, [c], k)
            assert abs(got - brute) < 1e-12 and abs(got - stable) < 1e-12
    assert evaluation.pass_at_k(4, [0, 4, 2], 1) == pytest.approx((0 + 1 + 0.5) / 3)
    # Negative control: the biased plug-in estimate 1 - (1 - c/n)^k is not the same.
    assert abs(evaluation.pass_at_k(8, [2], 4) - (1 - (1 - 2 / 8) ** 4)) > 1e-2


# ---------------------------------------------------------------------------------------
# eval.py's CLI


def test_cli_two_policies_two_rates_share_one_reference(train_ckpt, tmp_path, monkeypatch, capsys):
    calls = []

    def counting(model, prompts, sampling, eviction=None, **kw):
        calls.append((len(prompts), None if eviction is None else (eviction.score, eviction.greedy, eviction.rate)))
        return rollout(model, prompts, sampling, eviction, **kw)

    monkeypatch.setattr(evaluation, "rollout", counting)
    out = tmp_path / "results.jsonl"
    evaluation.main(["--model", train_ckpt, "--task", "countdown", "--policy", "ngc", "knorm", "--eviction-rate", "0.5",
             "0.75", "--problems", "3", "--samples", "0", "--out", str(out)])  # 0: greedy tokens
    printed = capsys.readouterr().out
    print(printed)
    assert [c for c in calls if c[1] is None] == [(3, None)]  # one reference run, shared
    assert [c[1] for c in calls if c[1]] == [(None, True, 0.5), (None, True, 0.75), (baselines.knorm, True, 0.5),
                                             (baselines.knorm, True, 0.75)]  # ngc: greedy top-K on ψ
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["policy"], r["eviction_rate"]) for r in rows] == [("ngc", 0.5), ("ngc", 0.75), ("knorm", 0.5),
                                                                 ("knorm", 0.75)]
    for r in rows:
        assert r["problems"] == 3 and r["samples"] == 1 and 0 <= r["accuracy"] <= 1 and r["rounds"] > 0
        assert r["kv_reduction"] > 1 and "pass_at_k" not in r
    assert rows[1]["kv_reduction"] > rows[0]["kv_reduction"]  # evicting more shrinks the peak more
    assert not os.path.exists(str(out) + ".tmp")
    assert len(printed.strip().splitlines()) == 6 and "KV reduction" in printed

    calls.clear()  # sampled: k completions per problem, pass@k, `none` is the reference itself
    monkeypatch.setitem(tasks.TASK_REWARD, "countdown", lambda text, problem: float(len(text) % 2))  # some variance
    evaluation.main(["--model", train_ckpt, "--policy", "none", "ngc-sample", "--eviction-rate", "0.5", "--samples", "3",
             "--problems", "2", "--out", str(out)])
    assert [c[0] for c in calls] == [6, 6] and calls[1][1] == (None, False, 0.5)  # ngc-sample: Gumbel-top-k
    none, sampled = [json.loads(line) for line in out.read_text().splitlines()]
    assert none["kv_reduction"] == 1.0 and none["eviction_rate"] == 0.0 and none["rounds"] == 0
    assert sampled["samples"] == 3 and set(sampled["pass_at_k"]) == {"1", "2", "3"}
    p = sampled["pass_at_k"]
    assert p["1"] == pytest.approx(sampled["accuracy"]) and p["1"] <= p["2"] <= p["3"] and p["3"] in (0, 0.5, 1)


@pytest.mark.parametrize("flags, message", [
    (["--policy", "lru"], "unknown policy 'lru'"), (["--eviction-rate", "1.5"], "must lie in (0, 1]"),
    (["--samples", "-1"], "--samples -1 must be at least 0"), (["--problems", "501"], "held-out set has 500 problems"),
    (["--eviction-rate", "x"], "invalid float"), (["--out", "/no/such/dir/r.jsonl"], "does not exist"),
    (["--out", "/tmp"], "/tmp is a directory")])
def test_cli_bad_input_fails_with_one_line(train_ckpt, flags, message, monkeypatch):
    monkeypatch.setattr(evaluation, "rollout", None)  # nothing may run
    with pytest.raises(SystemExit) as err:
        evaluation.main(["--model", train_ckpt, *flags])
    assert str(err.value).startswith("error: ") and message in str(err.value) and "\n" not in str(err.value)


def test_cli_plot_without_matplotlib_fails_early(train_ckpt, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if matplotlib were not installed
    monkeypatch.setattr(evaluation, "load", None)  # fails before loading anything
    with pytest.raises(SystemExit) as err:
        evaluation.main(["--model", train_ckpt, "--plot", str(tmp_path / "acc.png")])
    assert str(err.value) == "error: --plot needs matplotlib: pip install matplotlib"


# ---------------------------------------------------------------------------------------
# show.py: which keys each layer evicted, and at which round


def test_show_death_rounds_are_the_replay_masks(model, ckpt, sampled):
    """A key is alive at the end at layer l iff the replay mask lets the last token see it; an
    evicted key's round r is the one whose last query (token (r+1)δ-1) still sees it and whose next
    token does not."""
    tokenizer, delta = load_tokenizer(ckpt), EV.delta
    death = death_times(sampled.kept, sampled.n_rounds, sampled.tokens.shape[1], delta, EV.block)  # (B, L, T)
    for b in range(len(sampled.lengths)):
        T, R = int(sampled.lengths[b]), int(sampled.n_rounds[b])
        texts, rounds = show.fates(sampled, b, tokenizer)  # (L, T)
        assert texts == [tokenizer.decode([t], skip_special_tokens=False) for t in sampled.tokens[b, :T].tolist()]
        assert rounds.shape == (model.config.num_hidden_layers, T) and R >= 2
        for layer in range(rounds.shape[0]):
            vis = visibility(death[:, layer])[b, :T, :T]  # (T, T): row t, the keys token t saw
            r = rounds[layer]
            assert torch.equal(r == show.ALIVE, vis[T - 1])
            s = (r != show.ALIVE).nonzero().flatten()
            last = (r[s] + 1) * delta - 1  # the last token before round r
            assert (r[s] < R).all() and (last + 1 <= T - 1).all()
            assert vis[last, s].all() and not vis[last + 1, s].any()
            # at ε = 0.5 every round that fired evicted something at every layer
            assert set(r[s].tolist()) == set(range(R)), (b, layer)
    # Negative control: without eviction every key stays.
    full = rollout(model, prompts_of([5, 9]), Sampling(max_new_tokens=30, greedy=True))
    for b in range(2):
        _, rounds = show.fates(full, b, tokenizer)
        assert rounds.shape[1] == int(full.lengths[b]) and (rounds == show.ALIVE).all()


class PageParser(HTMLParser):
    """The page's text, and each table as its header texts and its rows (label, [cell classes])."""

    def __init__(self):
        super().__init__()
        self.text, self.tables, self.cell = [], [], None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "table":
            self.tables.append({"head": [], "rows": []})
        elif tag == "tr" and self.tables:
            self.tables[-1]["rows"].append([None, []])
        elif tag == "th" and self.tables:
            self.cell = ""
        elif tag == "td":
            self.tables[-1]["rows"][-1][1].append(attrs["class"].split()[0])

    def handle_endtag(self, tag):
        if tag == "th" and self.cell is not None:
            table = self.tables[-1]
            if len(table["rows"]) == 1:  # the header row
                table["head"].append(self.cell)
            else:
                table["rows"][-1][0] = self.cell
            self.cell = None

    def handle_data(self, data):
        self.text.append(data)
        if self.cell is not None:
            self.cell += data


def fate_class(r):
    return "alive" if r == show.ALIVE else f"r{r}"


def test_show_page_lists_every_token_of_every_rollout_and_every_layer(ckpt, train_ckpt, tmp_path, monkeypatch,
                                                                      capsys):
    made = []

    def recording(model, prompts, sampling, eviction=None, **kw):
        made.append((prompts, sampling, eviction, rollout(model, prompts, sampling, eviction, **kw)))
        return made[-1][-1]

    monkeypatch.setattr(show, "rollout", recording)
    out = tmp_path / "forgets.html"
    show.main(["--model", train_ckpt, "--before", ckpt, "--problems", "2", "--out", str(out)])
    printed = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in printed[:4]] == ["problem 1 untrained", "problem 1   trained",
                                                            "problem 2 untrained", "problem 2   trained"]
    assert not os.path.exists(str(out) + ".tmp")
    page = out.read_text(encoding="utf-8")
    for outside in ("<script", "<link", "src=", "href=", "url(", "http", "@import"):
        assert outside not in page  # self-contained
    parsed = PageParser()
    parsed.feed(page)
    text = "".join(parsed.text)
    assert "ε = 0.5, δ = 8, b = 2, w = 3" in text
    assert os.path.relpath(train_ckpt) in text and os.path.relpath(ckpt) in text
    tokenizer = load_tokenizer(ckpt)
    _, test = tasks.load_problems(replace(settings.run_defaults(train_ckpt), train_problems=0, data=None))
    assert [p[0] for p in made] == [[cd.encode(tokenizer, q) for q in test[:2]]] * 2  # eval.py's prompts
    assert all(s.greedy and s.max_new_tokens == 24 and e.greedy and e.score is None and e.rate == 0.5
               for _, s, e, _ in made)  # NGC's greedy top-K on greedy tokens
    rollouts = [made[0][-1], made[1][-1]]  # untrained, trained
    assert len(parsed.tables) == 4  # problem-major, the untrained model first
    n_rounds = 0
    for i, table in enumerate(parsed.tables):
        ro, b = rollouts[i % 2], i // 2
        T = int(ro.lengths[b])
        texts, rounds = show.fates(ro, b, tokenizer)
        assert str(test[b]) in text and f"problem {b + 1}" in text
        assert table["head"] == [""] + texts  # every token, in reading order
        layers = range(TINY_MODEL["num_hidden_layers"])
        assert [label for label, _ in table["rows"][1:]] == [f"layer {l}" for l in layers]
        for (_, cells), fate in zip(table["rows"][1:], rounds.tolist()):
            assert len(cells) == T and cells == [fate_class(r) for r in fate]
        n_rounds = max(n_rounds, int(ro.n_rounds[b]))
        assert int(rounds.max()) == int(ro.n_rounds[b]) - 1 >= 1  # evictions at every round, 2 at least
    assert all(f"round {k + 1}" in text for k in range(n_rounds)) and ("correct" in text or "wrong" in text)
    # Negative control: the two models' grids of one problem differ, so a table checked against the
    # other model's rollout would fail.
    assert parsed.tables[0]["head"] != parsed.tables[1]["head"] or parsed.tables[0]["rows"] != parsed.tables[1]["rows"]


def test_show_prompts_are_evals_with_the_interoception_tag(train_ckpt, tmp_path, monkeypatch):
    run = tmp_path / "run"
    shutil.copytree(train_ckpt, run)
    (run / "ngc.json").write_text(json.dumps({**TRAIN_DEFAULTS, "interoception": True}))
    seen = {}

    def recording(name):
        def record(model, prompts, sampling, eviction=None, **kw):
            seen.setdefault(name, []).append(prompts)
            return rollout(model, prompts, sampling, eviction, **kw)
        return record

    monkeypatch.setattr(show, "rollout", recording("show"))
    monkeypatch.setattr(evaluation, "rollout", recording("eval"))
    show.main(["--model", str(run), "--before", str(run), "--problems", "2", "--eviction-rate", "0.25",
               "--out", str(tmp_path / "f.html")])
    evaluation.main(["--model", str(run), "--policy", "ngc", "--eviction-rate", "0.25", "--problems", "2", "--samples", "0"])
    assert seen["show"] == [seen["eval"][1]] * 2  # eval's ngc run (its first is the full-cache reference)
    plain = seen["eval"][0]  # no eviction: no tag
    assert all(len(a) > len(b) for a, b in zip(seen["show"][0], plain))  # Negative control


def test_show_png(ckpt, train_ckpt, tmp_path):
    pytest.importorskip("matplotlib")
    out, png = tmp_path / "f.html", tmp_path / "f.png"
    show.main(["--model", train_ckpt, "--before", ckpt, "--problems", "1", "--out", str(out), "--png", str(png)])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert not os.path.exists(str(png) + ".tmp")


def test_target_survival_by_hand():
    prompt = ["<bos>", "reach", "7", "with", "1"]
    a = dict(tokens=prompt + ["x"], prompt_len=5, n_rounds=2, correct=True,  # death rounds (L=2, T=6), 0-based
             rounds=torch.tensor([[-1, 0, -1, 1, 0, -1], [0, 0, 1, -1, -1, -1]]))
    b = dict(tokens=prompt + ["reach", "7", "reach", "8", " reach", "7"], prompt_len=5, n_rounds=1, correct=False,
             rounds=torch.zeros(2, 11, dtype=torch.long))
    s = show.survival([a, b], [SimpleNamespace(target=7)] * 2, max_round=3)
    assert s["rounds"][0] == dict(round=1, rollouts=2, target=0.5, other_prompt=0.25)  # a: 1 and 4/8; b: 0 and 0
    assert s["rounds"][1] == dict(round=2, rollouts=1, target=0.5, other_prompt=0.375)  # b never reached round 2
    assert s["rounds"][2] == dict(round=3, rollouts=0, target=None, other_prompt=None)
    assert s["kept_target"] == dict(rollouts=1, accuracy=1.0) and s["lost_target"] == dict(rollouts=1, accuracy=0.0)
    assert s["restated"] == dict(rollouts=0.5, per_rollout=1.0)  # b writes `reach 7` twice (not the prompt's)
    with pytest.raises(ValueError, match="not one token"):
        show.survival([a], [SimpleNamespace(target=8)])


def test_failures_find_where_eviction_first_changes_the_completion():
    def run(completion, correct, prompt=("<bos>", "reach", "7")):  # δ = 4: rounds at 4, 8, 12 tokens
        return dict(tokens=list(prompt) + completion.split(), prompt_len=len(prompt), correct=correct)
    full = [run("5 + 2 = 7 yes", True), run("5 * 2 = 10 no back", True), run("5 + 2 = 9 no back", True),
            run("5 + 2", False), run("5 + 2 = 7 yes", True), run("5 + 2 = 9 no back 5 * 2 = 10", True),
            run("5 + 2 = 7 yes <answer> 5 + 2", True)]
    evicted = [run("5 + 2 = 7 yes", True), run("5 * 2 = 11 no back", False),  # token 7: a computed number
               run("5 + 2 = 9 yes", False),  # token 8, a verdict, written by the query at 7: 3 tokens after round 1
               run("5 + 2", False),  # the full cache fails too
               run("6 + 2 = 8 no", False),  # token 3, an operand (a number, not after an operator): before round 1
               run("5 + 2 = 9 no back 4 * 2 = 8", False),  # token 10, after `back`: 1 token after round 2
               run("5 + 2 = 7 yes <answer> 5 * 2", False)]  # token 11, an operator of the answer: 2 after round 2
    assert show.first_divergence(full[1], evicted[1], 4) == (1, 2, "a computed number")
    assert show.first_divergence(full[2], evicted[2], 4) == (1, 3, "a verdict")
    assert show.first_divergence(full[4], evicted[4], 4) == (0, 2, "another token")
    assert show.first_divergence(full[5], evicted[5], 4) == (2, 1, "a move after `back`")
    assert show.first_divergence(full[6], evicted[6], 4) == (2, 2, "the answer")
    assert show.first_divergence(full[0], evicted[0], 4) is None
    f = show.failures(full, evicted, delta=4)
    assert f == dict(rollouts=7, wrong=6, full_cache_wrong_too=1, no_divergence=0,
                     rounds_before={"0": 1, "1": 2, "2": 2}, tokens_after_round=[0, 1, 2, 1],
                     full_cache_wrote={"a computed number": 1, "a move after `back`": 1, "a verdict": 1,
                                       "another token": 1, "the answer": 1})


def test_show_writes_the_survival_file_alone(train_ckpt, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(show, "target_position", lambda run, problem: 1)  # the test tokenizer splits numbers
    out = tmp_path / "s.json"
    show.main(["--model", train_ckpt, "--before", train_ckpt, "--problems", "2", "--survival", str(out)])
    assert not [line for line in capsys.readouterr().out.splitlines() if line.rstrip().endswith(":")]  # nothing empty
    s = json.loads(out.read_text())
    assert s["untrained"] == s["trained"] and s["problems"] == 2 and list(tmp_path.iterdir()) == [out]
    assert s["untrained"]["kept_target"]["rollouts"] + s["untrained"]["lost_target"]["rollouts"] == 2
    f = s["trained"]["failures"]  # the full cache rolled out beside: every failure is counted once
    assert f["rollouts"] == 2
    assert f["full_cache_wrong_too"] + f["no_divergence"] + sum(f["full_cache_wrote"].values()) == f["wrong"]


@pytest.mark.parametrize("flags, message", [
    (["--eviction-rate", "1.5"], "must lie in (0, 1]"), (["--problems", "0"], "--problems 0 must be at least 1"),
    (["--problems", "501"], "held-out set has 500 problems"), (["--out", "/no/such/dir/f.html"], "does not exist"),
    (["--out", "/tmp"], "/tmp is a directory"), (["--model", "/no/such/run"], "no config.json in '/no/such/run'"),
    (["--before", "/no/such/model"], "no config.json in '/no/such/model'"),
    (["--png", "/no/such/dir/f.png"], "does not exist")])
def test_show_bad_input_fails_with_one_line(train_ckpt, tmp_path, flags, message, monkeypatch):
    monkeypatch.setattr(show, "load", None)  # nothing may be loaded
    with pytest.raises(SystemExit) as err:
        show.main(["--model", train_ckpt, "--out", str(tmp_path / "f.html"), *flags])
    assert str(err.value).startswith("error: ") and message in str(err.value) and "\n" not in str(err.value)
    assert list(tmp_path.iterdir()) == []


def test_show_png_without_matplotlib_fails_early(train_ckpt, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if matplotlib were not installed
    monkeypatch.setattr(show, "load", None)
    with pytest.raises(SystemExit) as err:
        show.main(["--model", train_ckpt, "--out", str(tmp_path / "f.html"), "--png", str(tmp_path / "f.png")])
    assert str(err.value) == "error: --png needs matplotlib: pip install matplotlib"


# ---------------------------------------------------------------------------------------
# reproduce.py: curves, tables and the limit study


def test_reproduce_curves_take_steps_without_gradient_norms(tmp_path):
    """reproduce.py draws Figure 5 from logs whose steps may carry null grad norms (no learning
    signal, or --no-term-grad-norms): the figure is written, nothing raises."""
    pytest.importorskip("matplotlib")
    import reproduce
    for name, norms in (("ngc", [0.5, None, 0.7]), ("token-only", [None, None, None])):
        (tmp_path / "runs" / name).mkdir(parents=True)
        with open(tmp_path / "runs" / name / "log.jsonl", "w") as f:
            for step, g in enumerate(norms):
                f.write(json.dumps({**dict.fromkeys(STEP_KEYS), "step": step, "reward": 0.5,
                                    "grad_norm_token": g, "grad_norm_mem": g}) + "\n")
    for seed in (1,):  # a second seed of ngc, with other norms: the figure shows means over seeds
        (tmp_path / "runs" / f"ngc-seed{seed}").mkdir(parents=True)
        (tmp_path / "runs" / f"ngc-seed{seed}" / "log.jsonl").write_text("".join(
            json.dumps({**dict.fromkeys(STEP_KEYS), "step": step, "reward": 0.1, "grad_norm_token": 1.0,
                        "grad_norm_mem": None}) + "\n" for step in range(3)))
    reproduce.curves(str(tmp_path), ["ngc", "token-only"], 1, str(tmp_path / "ablations.png"))
    assert (tmp_path / "ablations.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(FileNotFoundError):  # token-only has no second seed
        reproduce.curves(str(tmp_path), ["ngc", "token-only"], 2, str(tmp_path / "ablations.png"))
    reproduce.curves(str(tmp_path), ["ngc"], 2, str(tmp_path / "ablations-2.png"))
    assert (tmp_path / "ablations-2.png").read_bytes()[:4] == b"\x89PNG"


def test_reproduce_tables_give_the_spread_across_seeds_and_the_binomial_error():
    """over_seeds: one row per (run, policy, ε) with the mean over seeds, the standard deviation
    across seeds, and the mean binomial standard error sqrt(p(1-p)/n), n = problems x samples."""
    import reproduce
    row = dict(policy="ngc", length=100.0, rounds=4.0, kv_reduction=2.0, problems=200)
    rows = [dict(row, run="ngc", eviction_rate=0.5, seed=0, accuracy=0.3, samples=2),
            dict(row, run="ngc", eviction_rate=0.5, seed=1, accuracy=0.5, samples=2, kv_reduction=3.0),
            dict(row, run="ngc", eviction_rate=0.7, seed=0, accuracy=0.1, samples=1)]
    two, one = reproduce.over_seeds(rows)
    assert (two["eviction_rate"], two["seeds"], one["seeds"]) == (0.5, 2, 1)
    assert abs(two["accuracy"] - 0.4) < 1e-12 and abs(two["kv_reduction"] - 2.5) < 1e-12
    assert abs(two["accuracy_sd"] - (0.02 ** 0.5)) < 1e-12  # sample sd of 0.3, 0.5
    assert abs(two["accuracy_se"] - ((0.21 / 400) ** 0.5 + (0.25 / 400) ** 0.5) / 2) < 1e-12
    assert one["accuracy_sd"] == 0.0 and abs(one["accuracy_se"] - (0.09 / 200) ** 0.5) < 1e-12
    table = reproduce.markdown([two, one])
    assert "| 40.0% ± 14.1 | 2.4 |" in table and "| 10.0% | 2.1 |" in table
    assert [reproduce.run_name("ngc", k) for k in range(3)] == ["ngc", "ngc-seed1", "ngc-seed2"]
    # the plots' error bars: the spread across seeds, else one evaluation's binomial standard error
    assert evaluation.error_bar(two) == two["accuracy_sd"] and evaluation.error_bar(one) == one["accuracy_se"]
    assert evaluation.error_bar(dict(accuracy=0.3, problems=200, samples=2)) == (0.21 / 400) ** 0.5


def test_reproduce_limit_study_tabulates_each_run_s_evaluations_during_training(tmp_path):
    """reproduce.py --limit: one row per run and logged evaluation, the default run first, each
    with its accuracy at ε, the full cache's, its binomial standard error and the reduction."""
    import reproduce
    runs = {"default": tmp_path / "runs" / "ngc", **{n: tmp_path / "limit" / n for n in reproduce.LIMIT}}
    for i, (name, run_dir) in enumerate(runs.items()):
        (run_dir / "checkpoint").mkdir(parents=True)
        (run_dir / "checkpoint" / "ngc.json").write_text(json.dumps({"eval_problems": 100 * (i + 1)}))
        evals = [{"step": s, "eval": {"acc": 0.1 * (i + 1), "acc_full": 0.9 - s / 1000, "kv_reduction": 2.0 + i}}
                 for s in (0, 20 * (i + 1))]
        steps = [dict.fromkeys(STEP_KEYS, 0.0) | {"step": s} for s in range(2)]
        (run_dir / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps + evals))
    rows = reproduce.limit_rows(str(tmp_path))
    assert [(r["recipe"], r["step"]) for r in rows] == [(n, s) for i, n in enumerate(runs) for s in (0, 20 * (i + 1))]
    p8 = rows[-1]
    assert p8["flags"] == "--prompts 8 --group 16 --eval-every 30" and p8["problems"] == 400
    assert (p8["accuracy"], p8["accuracy_full"], p8["kv_reduction"]) == (0.4, 0.9 - 0.08, 5.0)
    table = reproduce.limit_markdown(rows)
    assert "| p8g16 | `--prompts 8 --group 16 --eval-every 30` | 80 | 82.0% | 40.0% | 2.4 | 5.00x |" in table
    assert "| default | `` | 0 | 90.0% | 10.0% | 3.0 | 2.00x |" in table  # sqrt(0.1 * 0.9 / 100) = 3.0 points


def test_reproduce_diagnosis_averages_the_training_log_between_evaluations(tmp_path):
    """reproduce.py --diagnose: each evaluation during training gets the means of the steps since
    the previous one (steps 0-1 for the evaluation at step 2, then 2-3), none before step 0, and
    a gradient norm a mode does not log (null) stays empty rather than averaged as zero."""
    import reproduce
    for i, name in enumerate(reproduce.DIAGNOSE):
        run_dir = tmp_path / "runs" / f"diag-{name}"
        run_dir.mkdir(parents=True)
        steps = [dict.fromkeys(STEP_KEYS, 0.0) | {"step": s, "reward": s / 10, "zero_adv_groups": 0.5 * (s % 2),
                                                          "grad_norm_mem": None if i == 1 else 1.0 + s} for s in range(4)]
        evals = [{"step": s, "eval": {"acc": 0.1 * s, "acc_full": 0.9, "kv_reduction": 2.0, "length": 80.0,
                                      "rounds": 3.0}} for s in (0, 2, 4)]
        log = [evals[0], *steps[:2], evals[1], *steps[2:], evals[2]]
        (run_dir / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log))
    rows = reproduce.diagnosis_rows(str(tmp_path))
    assert [(r["run"], r["step"], r["steps_since"]) for r in rows] == [
        (n, s, k) for n in reproduce.DIAGNOSE for s, k in ((0, 0), (2, 2), (4, 2))]
    first, second, third = rows[:3]
    assert first["reward"] is None and first["grad_norm_mem"] is None
    assert second["reward"] == pytest.approx(0.05) and third["reward"] == pytest.approx(0.25)
    assert second["zero_adv_groups"] == pytest.approx(0.25) and third["grad_norm_mem"] == pytest.approx(3.5)
    assert rows[4]["grad_norm_mem"] is None and rows[4]["reward"] == pytest.approx(0.05)
    assert rows[0]["flags"] == "--steps 120 --eval-every 30 --term-grad-norms"
    table = reproduce.diagnosis_markdown(rows, [])
    assert "| ngc-120 | `--steps 120 --eval-every 30 --term-grad-norms` | 4 | 90.0% | 40.0% | 2.00x | 0.250 | 0.25 | 0.000 | 3.500 |" in table


def test_reproduce_headline_puts_each_seed_s_step_0_beside_its_final_evaluation(tmp_path, monkeypatch):
    """reproduce.py --headline: before = train.py's step-0 evaluation in the run's log, after =
    eval.py's rows of the final checkpoint; NGC as a fraction of the full cache; mean and sd."""
    import reproduce
    for k in range(2):
        for name in reproduce.HEADLINE:
            run_dir = tmp_path / "runs" / reproduce.run_name(name, k)
            run_dir.mkdir(parents=True)
            evals = [{"step": s, "eval": {"acc": 0.01 * (s + k + 1), "acc_full": 0.9, "kv_reduction": 1.8}} for s in (0, 60)]
            (run_dir / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals))

    def fake_eval(out, study, run, policies, rates, seed, problems=None):
        acc = 0.4 + 0.1 * seed if run == "ngc" else 0.0
        return [dict(policy="none", accuracy=0.8, problems=200, length=80.0, rounds=0.0, kv_reduction=1.0),
                dict(policy="ngc", accuracy=acc, problems=200, length=140.0, rounds=6.0, kv_reduction=2.2)]

    monkeypatch.setattr(reproduce, "eval_study", fake_eval)
    rows = reproduce.headline_rows(str(tmp_path), 2)
    ngc1 = [r for r in rows if r["run"] == "ngc" and r["seed"] == 1][0]
    assert (ngc1["before"], ngc1["after"], ngc1["full_after"], ngc1["kv_after"]) == (0.02, 0.5, 0.8, 2.2)
    assert ngc1["of_full"] == pytest.approx(0.625)
    table = reproduce.headline_markdown(rows)
    assert "| ngc | 1 | 90.0% → 80.0% | 2.0% → 50.0% | 62% | 1.80x → 2.20x |" in table
    assert "| ngc | mean | 90.0% → 80.0% | 1.5% → 45.0% | 56% | 1.80x → 2.20x |" in table
    assert "| ngc | sd | 0.0 → 0.0 | 0.7 → 7.1 | 9% | |" in table


def output_under_a_file(tmp_path, ckpt, train_ckpt):
    """Each script's command line with its output path under a regular file (which no directory can be)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    return blocker, {
        "train": lambda: train.main(["--model", train_ckpt, "--out", str(blocker / "run")]),
        "eval": lambda: evaluation.main(["--model", train_ckpt, "--out", str(blocker / "r.jsonl")]),
        "show": lambda: show.main(["--model", train_ckpt, "--before", ckpt, "--out", str(blocker / "f.html")]),
        "make_tiny": lambda: make_tiny.main(["--out", str(blocker / "tiny"), "--steps", "1"]),
        "reproduce": lambda: reproduce.main(["--out", str(blocker / "results")]),
    }


@pytest.mark.parametrize("script", ["train", "eval", "show", "make_tiny", "reproduce"])
def test_an_output_path_that_cannot_be_created_is_one_line(ckpt, train_ckpt, tmp_path, script):
    blocker, run = output_under_a_file(tmp_path, ckpt, train_ckpt)
    with pytest.raises(SystemExit) as err:
        run[script]()
    message = str(err.value)
    assert message.startswith("error: ") and "\n" not in message and str(blocker) in message, message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"] and blocker.read_text() == "x"


def test_the_demo_set_refuses_a_folder_that_cannot_be_created(tmp_path):
    (tmp_path / "a-file").write_text("x")
    out = subprocess.run([sys.executable, "mathtask.py", "--make-demo", str(tmp_path / "a-file" / "d")],
                         cwd=os.path.dirname(os.path.abspath(__file__)), capture_output=True, text=True)
    assert out.returncode == 1 and len(out.stderr.splitlines()) == 1 and out.stderr.startswith("error: cannot create")


def test_cli_evaluates_another_layout_than_the_runs(train_ckpt, monkeypatch):
    """--delta, --block and --window replace the run's δ, b and w (its ngc.json) for every policy;
    without them the rollouts use the run's own (the control)."""
    seen = []

    def spy(model, prompts, sampling, eviction=None, **kw):
        seen.append(None if eviction is None else (eviction.delta, eviction.block, eviction.window))
        return rollout(model, prompts, sampling, eviction, **kw)

    monkeypatch.setattr(evaluation, "rollout", spy)
    flags = ["--model", train_ckpt, "--policy", "ngc", "knorm", "--problems", "2"]
    evaluation.main(flags + ["--delta", "9", "--block", "3", "--window", "2"])
    assert seen == [None, (9, 3, 2), (9, 3, 2)]  # the full-cache reference, then each policy
    seen.clear()
    evaluation.main(flags)
    run = (TRAIN_DEFAULTS["delta"], TRAIN_DEFAULTS["block"], TRAIN_DEFAULTS["window"])
    assert seen == [None, run, run] and run != (9, 3, 2)


def test_cli_evaluates_another_problem_preset_than_the_runs(train_ckpt, monkeypatch):
    """--difficulty evaluates on that preset's held-out problems (tiny-back: the tiny ones that backtrack);
    without it, on the run's (the control)."""
    seen = []

    def spy(model, tokenizer, problems, *args, **kw):
        seen.append(list(problems))
        raise Reached

    monkeypatch.setattr(evaluation, "roll_out_and_score", spy)
    for flags in ([], ["--difficulty", "tiny-back"]):
        with pytest.raises(Reached):
            evaluation.main(["--model", train_ckpt, "--problems", "5"] + flags)
    run, back = seen
    assert back == cd.held_out(cd.SMALL_BACK)[:5] != run
    assert all(cd.backtracks(p) for p in back) and not all(cd.backtracks(p) for p in run)


@pytest.mark.parametrize("tag, written", [("0.25", (0.25, False)), ("rate", (0.5, False)), ("blind", (0.5, True)),
                                          (None, (None, False))])
def test_eval_tag_writes_the_budget_tag_it_is_given(train_ckpt, monkeypatch, tag, written):
    """eval.py --tag: the evicting runs' prompts carry the tag with that rate (rate: the ε evaluated,
    blind: the tag without it), whatever ε is evaluated; the full-cache reference never does. Without
    --tag a run trained without --interoception has no tag (the control)."""
    seen = []

    def spy(task, style=None, eviction_rate=None, blind=False):
        seen.append((eviction_rate, blind))
        return tasks.prompt_encoder(task, style, eviction_rate, blind)

    monkeypatch.setattr(evaluation, "prompt_encoder", spy)
    evaluation.main(["--model", train_ckpt, "--policy", "ngc", "--eviction-rate", "0.5", "--problems", "2",
                     "--samples", "0"] + (["--tag", tag] if tag else []))
    assert seen[0][0] is None and seen[1] == written  # the full-cache reference (no tag), then ngc at ε = 0.5


def test_eval_refuses_a_tag_it_cannot_write(train_ckpt):
    with pytest.raises(SystemExit) as err:
        evaluation.main(["--model", train_ckpt, "--tag", "1.5"])
    assert "argument --tag: '1.5': give rate, blind or a rate in [0, 1]" in str(err.value)


def test_reproduce_claims_compare_ngc_with_the_best_baseline_and_the_oracle():
    """claims.md: each claim against its goal. The best task-agnostic baseline and the best task
    rule are the strongest of each kind on either model, NGC's multiple of the one and its margin
    over the other in SEs, the fraction of the gap from the best baseline to the oracle on NGC's own
    model that NGC closes; the oracle never counts as a baseline; "met" follows each goal."""
    import reproduce
    row = lambda run, policy, acc, rate=0.5, length=80.0: dict(
        run=run, policy=policy, eviction_rate=rate, accuracy=acc, accuracy_sd=0.01, accuracy_se=0.02, seeds=3,
        kv_reduction=2.2, length=length)
    baselines = [row("no-evict", "none", 0.96, 0.0), row("no-evict", "oracle", 0.8)] + [
        row("no-evict", p, 0.4 if p == "task-rule" else 0.05) for p in reproduce.BASELINES]
    sweep = [row("ngc", "ngc", 0.8 - e / 2, e) for e in reproduce.SWEEP]  # 0.5, 0.45, 0.4 at ε = 0.6, 0.7, 0.8
    studies = {"untrained": [row("u", "none", 0.6, 0.0), row("u", "ngc", 0.1)],
               "baselines": baselines, "ngc": [row("ngc", "none", 0.98, 0.0), row("ngc", "ngc", 0.6),
                                               row("ngc", "oracle", 0.9), row("ngc", "task-rule", 0.45),
                                               row("ngc", "random", 0.1)],
               "greedy": [row("ngc", "ngc", 0.55)], "token-only": [row("t", "ngc", 0.3)],
               "targeted-dropout": [row("d", "ngc", 0.02)], "sweep": sweep,
               "sweep-baselines": [row("no-evict", "task-rule", 0.45 if e == 0.8 else 0.2, e) for e in reproduce.SWEEP[1:]],
               "interoception": [row("i", "ngc", 0.2, e, 90.0) for e in reproduce.INTERO_SWEEP],
               "interoception-blind": [row("b", "ngc", 0.05, e) for e in reproduce.INTERO_SWEEP],
               "tag-0.25": [row("i", "ngc", 0.1, reproduce.TAG_CHECK, 70.0)],
               "tag-blind": [row("i", "ngc", 0.12, reproduce.TAG_CHECK, 75.0)],
               "shifted-ngc": [row("ngc", "none", 0.97, 0.0), row("ngc", "ngc", 0.3)],
               "shifted-untrained": [row("u", "none", 0.95, 0.0), row("u", "ngc", 0.1)],
               "shifted-baselines": [row("no-evict", "task-rule", 0.35)]}

    def claims(studies):
        text = reproduce.claims_markdown(studies)
        return text, {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines()[2:]}

    text, lines = claims(studies)
    assert "full cache before training 60.0% ± 1.0, after no-evict training 96.0% ± 1.0 (+36.0 points) | yes" \
        in lines["the model learns to reason"]
    assert "60.0% ± 1.0 at 2.20× (62% of 96.0% ± 1.0;" in text and lines["NGC keeps the reasoning under a smaller " \
                                                                       "peak cache"].endswith("| **no** |")
    assert "98.0% ± 1.0 against 60.0% ± 1.0 before training | yes" in lines["training NGC keeps the full cache's reasoning"]
    # the best task-agnostic baseline is random on NGC's own model (10%), not the task rule (40-45%)
    assert "best random 10.0% ± 1.0 on NGC's own model: NGC is 6.0× it" in text
    assert "NGC closes 33% of the gap from it to the oracle there (90.0% ± 1.0)" in text  # (0.6 - 0.45) / (0.9 - 0.45)
    assert "best task-rule 45.0% ± 1.0 on NGC's own model: NGC +15.0 points (2 SE = 5.7) | yes" in text  # 2 √(2 × 0.02²)
    assert "token-only 30.0% ± 1.0: 50% of NGC, 15.0× targeted dropout | yes" in text
    assert "targeted dropout 2.0% ± 1.0 | yes" in text
    assert "ε = 0.8: 20.0% ± 1.0 vs blind 5.0% ± 1.0 (+15.0 points, 2 SE = 5.7)" in text
    assert "tag 0.75 20.0% ± 1.0 (length 90), tag 0.25 10.0% ± 1.0 (length 70), tag - 12.0% ± 1.0 (length 75) | yes" in text
    assert "ε = 0.6 +30.0 points, ε = 0.7 +25.0 points, ε = 0.8 -5.0 points | **no**" in text  # 0.4 < 0.45 at 0.8
    assert "NGC 30.0% ± 1.0 of a full cache's 97.0% ± 1.0 (31%; training layouts 61%); untrained 10.0% ± 1.0" in text
    # Negative controls: were the oracle counted as a baseline, the best would be the oracle itself; a rule
    # within 2 SE of NGC, token-only above NGC, a full cache below the start's and a layout score no better
    # than untrained each fail their goals.
    assert "best baseline oracle" not in text and "best oracle" not in text
    closer = dict(studies, ngc=[r if r["policy"] != "task-rule" else row("ngc", "task-rule", 0.55)
                                for r in studies["ngc"]])
    assert "NGC +5.0 points (2 SE = 5.7) | **no**" in claims(closer)[0]
    above = dict(studies, **{"token-only": [row("t", "ngc", 0.65)]})
    assert claims(above)[1]["the token policy learns to write for eviction"].endswith("| **no** |")
    fell = dict(studies, untrained=[row("u", "none", 0.99, 0.0), row("u", "ngc", 0.1)])
    assert claims(fell)[1]["training NGC keeps the full cache's reasoning"].endswith("| **no** |")
    kept = dict(studies, **{"shifted-ngc": [row("ngc", "none", 0.4, 0.0), row("ngc", "ngc", 0.3)]})
    assert claims(kept)[1]["what NGC keeps, not where it sits"].endswith("| yes |")  # 75% of 40%, above 10%
    unlearned = dict(kept, **{"shifted-untrained": [row("u", "none", 0.95, 0.0), row("u", "ngc", 0.3)]})
    assert claims(unlearned)[1]["what NGC keeps, not where it sits"].endswith("| **no** |")
    without = {k: v for k, v in studies.items() if not k.startswith(("interoception", "tag-"))}  # --no-interoception
    assert "not measured (--no-interoception) | - |" in reproduce.claims_markdown(without)
    one_layout = {k: v for k, v in studies.items() if not k.startswith("shifted-")}  # a prompt of one layout
    assert "not measured (the model's prompt has one layout) | - |" in reproduce.claims_markdown(one_layout)


# ---------------------------------------------------------------------------------------
# The helper scripts off the happy path: every input checked before anything is created; a
# failure is one line `error: ...` and exit status 1 (sys.exit with a message), never a traceback


@pytest.fixture(scope="module")
def countdown_run(tmp_path_factory):
    path = write_checkpoint(tmp_path_factory.mktemp("countdown_run"), seed=3)
    with open(os.path.join(path, "ngc.json"), "w") as f:
        json.dump({**TRAIN_DEFAULTS, "task": "countdown"}, f)
    return path


@pytest.mark.parametrize("device, message", [
    pytest.param("cuda", "--device cuda: no CUDA GPU is visible here; use --device cpu",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="the message of a machine without CUDA")),
    ("tpu", "--device 'tpu' is not a device; use cpu, cuda or cuda:N")])
@pytest.mark.parametrize("script", ["train", "eval", "show", "bench"])
def test_a_device_that_is_not_here_is_the_same_one_line_in_every_script(train_ckpt, tmp_path, monkeypatch, script,
                                                                         device, message):
    for module, name in ((evaluation, "load"), (show, "load"), (train, "load"), (bench, "bench"),
                         (bench, "from_pretrained")):
        monkeypatch.setattr(module, name, reached)  # nothing may be loaded or run
    run = {"train": lambda: train.main(["--model", train_ckpt, "--out", str(tmp_path / "run"), "--device", device]),
           "eval": lambda: evaluation.main(["--model", train_ckpt, "--out", str(tmp_path / "r.jsonl"), "--device", device]),
           "show": lambda: show.main(["--model", train_ckpt, "--before", train_ckpt, "--out", str(tmp_path / "f.html"),
                                      "--device", device]),
           "bench": lambda: bench.main(["--device", device])}
    assert one_line_error(run[script]) == f"error: {message}"
    assert list(tmp_path.iterdir()) == []


def test_a_checkpoint_trained_on_one_task_is_refused_for_the_other(math_run, countdown_run, tmp_path, monkeypatch):
    """A math run's checkpoint has no Countdown prompt (ngc.json: null): eval.py --task countdown
    used to raise KeyError: None; show.py compared it with tiny/, a Countdown model."""
    for module in (evaluation, show):
        monkeypatch.setattr(module, "load", reached)
    monkeypatch.setattr(reproduce.subprocess, "Popen", reached)  # nothing may train
    out = tmp_path / "out"
    assert one_line_error(lambda: evaluation.main(["--model", math_run, "--task", "countdown", "--out", str(out)])) == \
        f"error: {math_run} was trained on math (its ngc.json); evaluate it with --task math"
    assert one_line_error(lambda: evaluation.main(["--model", countdown_run, "--task", "math", "--eval-data",
                                                   "x.jsonl"])) == \
        f"error: {countdown_run} was trained on countdown (its ngc.json); evaluate it with --task countdown"
    assert one_line_error(lambda: show.main(["--model", math_run, "--before", countdown_run, "--out", str(out)])) == (
        f"error: --before {countdown_run} was trained on countdown (its ngc.json) but --model {math_run} on math; "
        f"compare with a math model, such as --before {os.path.relpath(show.BEFORE['math'])}")
    assert "was trained on math (its ngc.json) but --model" in one_line_error(
        lambda: show.main(["--model", countdown_run, "--before", math_run, "--out", str(out)]))
    assert one_line_error(lambda: reproduce.main(["--model", math_run, "--out", str(out)])) == (
        f"error: --model {math_run} was trained on math (its ngc.json); reproduce.py's studies are Countdown's: "
        f"start from a Countdown model such as tiny/")
    assert list(tmp_path.iterdir()) == []
    # the control: each checkpoint with its own task passes every check and gets to its loading
    for argv in (["--model", math_run], ["--model", math_run, "--task", "math"], ["--model", countdown_run]):
        with pytest.raises(Reached):
            evaluation.main(argv + ["--problems", "1"])
    with pytest.raises(Reached) as r:  # show.py's --before follows the run's task: tiny-math/ for math
        show.main(["--model", math_run, "--problems", "1", "--out", str(out)])
    assert r.value.args[0] == show.BEFORE["math"] and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name, content, message", [
    ("empty.jsonl", b"", ": no problems in the file"),
    ("latin-1.jsonl", '{"problem": "Qu\u00e9?", "answer": "1"}\n'.encode("latin-1"), ": not UTF-8 text (byte 0xe9"),
    ("no-answer.jsonl", b'{"problem": "Q?", "sol": "1"}\n', ":1: no answer in reward_model.ground_truth or answer "
     "(its fields: problem, sol); name the answer's field with --answer-field"),
    ("missing.jsonl", None, ": no such file")])
def test_math_eval_data_that_cannot_be_read_is_one_line_naming_the_file(math_run, tmp_path, monkeypatch, name,
                                                                        content, message):
    monkeypatch.setattr(evaluation, "load", reached)
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    before = files_under(tmp_path)
    error = one_line_error(lambda: evaluation.main(["--model", math_run, "--eval-data", str(path), "--out",
                                                    str(tmp_path / "r.jsonl")]))
    assert error.startswith(f"error: {path}{message}"), error
    assert files_under(tmp_path) == before


def test_eval_reads_the_fields_it_is_told_and_refuses_them_for_countdown(math_run, train_ckpt, tmp_path, monkeypatch):
    monkeypatch.setattr(evaluation, "load", reached)
    rows = tmp_path / "sol.jsonl"
    rows.write_text('{"question": "Q?", "sol": "1"}\n')
    with pytest.raises(Reached):  # --answer-field, the flag the missing-answer error names
        evaluation.main(["--model", math_run, "--eval-data", str(rows), "--answer-field", "sol"])
    assert one_line_error(lambda: evaluation.main(["--model", train_ckpt, "--answer-field", "sol"])) == \
        "error: --answer-field is for --task math; this evaluation's task is countdown"


def test_eval_draws_progress_bars_only_on_a_terminal(train_ckpt, monkeypatch):
    seen = []
    monkeypatch.setattr(evaluation, "compare", lambda *args, **kw: seen.append(kw["progress"]) or reached())

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    with pytest.raises(Reached):  # pytest's stderr is not a terminal: a log file gets no bars
        evaluation.main(["--model", train_ckpt, "--problems", "1"])
    monkeypatch.setattr(sys, "stderr", Terminal())
    with pytest.raises(Reached):
        evaluation.main(["--model", train_ckpt, "--problems", "1"])
    assert seen == [False, True]


def test_show_says_only_what_there_is_about_the_failures():
    f = dict(rollouts=4, wrong=0, full_cache_wrong_too=0, no_divergence=0, full_cache_wrote={})
    assert show.failure_line(f) == "none wrong under eviction"
    f = dict(f, wrong=3, full_cache_wrong_too=2, no_divergence=1)
    assert show.failure_line(f) == ("3 wrong under eviction, 2 of them also with the full cache; 1 with no differing "
                                    "token (one completion a prefix of the other)")
    f = dict(f, wrong=4, no_divergence=0, full_cache_wrote={"a verdict": 2})
    assert show.failure_line(f) == ("4 wrong under eviction, 2 of them also with the full cache; the rest first leave "
                                    "its completion at: a verdict 2")


@pytest.mark.parametrize("flags, message", [
    (["--new-tokens", "0"], "--new-tokens 0 must be at least 1"), (["--batch", "0"], "--batch 0 must be at least 1"),
    (["--prompt-len", "0"], "--prompt-len 0 must be at least 1"), (["--repeat", "0"], "--repeat 0 must be at least 1"),
    (["--replay-batch", "-1"], "--replay-batch -1 must be at least 1"), (["--threads", "0"], "--threads 0 must be"),
    (["--peak-bandwidth", "0"], "--peak-bandwidth 0.0 must be positive"),
    (["--rate", "0"], "--delta 64 --block 8 --window 5 --rate 0.0: eviction rate ε=0.0 must lie in (0, 1]"),
    (["--delta", "4"], "--delta 4 --block 8 --window 5 --rate 0.5: eviction cadence δ=4 must be larger"),
    (["--model", "/no/such/model"], "no config.json in '/no/such/model'"),
    (["--held-out"], "--held-out and --hf read a checkpoint directory: give --model DIR"),
    (["--hf", "--model", "tiny-math"], "bench.py --hf needs transformers: pip install transformers"),
    (["--held-out", "--model", "tiny-math"], "--held-out takes Countdown's held-out problems; tiny-math is not"),
    (["--profile", "/no/such/run"], "--profile /no/such/run: no log.jsonl there")])
def test_bench_checks_every_flag_before_it_runs(flags, message, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # not installed (an import raises ImportError)
    monkeypatch.setattr(bench, "bench", reached)
    monkeypatch.setattr(bench, "from_pretrained", reached)
    assert one_line_error(lambda: bench.main(flags)).startswith(f"error: {message}")
    with pytest.raises(Reached):  # the control: the defaults get to the benchmark
        bench.main(["--device", "cpu"])


def test_bench_profile_sums_a_runs_logged_phases(train_ckpt, tmp_path, capsys):
    """bench.py --profile: the rollouts', replays' and evaluations' seconds are those train.py logged; a log
    written before they were logged gets its rollout time back from its tokens/s."""
    log = run_train(train_ckpt, tmp_path / "run", "--steps", "2", "--eval-every", "2")
    steps, evals = [r for r in log if "reward" in r], [r for r in log if "eval" in r]
    for r in steps:
        assert 0 < r["rollout_time"] and 0 < r["replay_time"] and r["rollout_time"] + r["replay_time"] < r["step_time"]
    assert [r["step"] for r in evals] == [0, 2] and all(r["eval_time"] > 0 for r in evals)
    capsys.readouterr()

    def profiled():
        bench.main(["--profile", str(tmp_path / "run")])
        return {line[:32].strip(): float(line[32:].split()[0]) for line in capsys.readouterr().out.splitlines()[1:]}

    rows = profiled()
    assert rows["rollouts"] == pytest.approx(sum(r["rollout_time"] for r in steps), abs=0.051)
    assert rows["replay fwd+bwd"] == pytest.approx(sum(r["replay_time"] for r in steps), abs=0.051)
    assert rows["rollouts"] + rows["replay fwd+bwd"] + rows["rest of the steps"] == pytest.approx(
        sum(r["step_time"] for r in steps), abs=0.11)
    assert rows["evaluation at step 2"] == pytest.approx(evals[1]["eval_time"], abs=0.051)
    older = [{k: v for k, v in r.items() if k not in ("rollout_time", "replay_time")} for r in log]
    (tmp_path / "run" / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in older))
    rows_older = profiled()
    assert rows_older["rollouts"] == pytest.approx(rows["rollouts"], abs=0.051)
    assert rows_older["replay fwd+bwd and the rest"] == pytest.approx(
        rows["replay fwd+bwd"] + rows["rest of the steps"], abs=0.11)


def finished_run(train_ckpt, run_dir, *flags):
    """A finished run in run_dir as train.py leaves it: checkpoint/ngc.json with the settings of
    `train.py --model train_ckpt FLAGS`, trainer.pt at its last step, and a log whose last step is
    the last of --steps (no final evaluation: these settings have none)."""
    c = train.resolve(train.parse_args(["--model", train_ckpt, "--out", str(run_dir), "--overwrite", *flags]))
    assert not c.eval_every
    (run_dir / "checkpoint").mkdir(parents=True)
    (run_dir / "checkpoint" / "ngc.json").write_text(json.dumps(settings.saved(c)))
    torch.save({"step": c.steps}, run_dir / "checkpoint" / "trainer.pt")
    (run_dir / "log.jsonl").write_text("".join(json.dumps(dict.fromkeys(STEP_KEYS, 0.0) | {"step": s}) + "\n"
                                               for s in range(c.steps)))


def test_reproduce_reuses_a_run_only_with_the_settings_it_would_train(train_ckpt, tmp_path, monkeypatch):
    """A finished run trained with other --train-args used to be reported as this command's."""
    monkeypatch.setattr(reproduce.subprocess, "Popen", reached)  # nothing may train
    out = tmp_path / "results"
    run_dir = out / "runs" / "ngc"
    finished_run(train_ckpt, run_dir, "--seed", "0", "--threads", "7", "--steps", "2", "--lr", "0.5")
    before = files_under(tmp_path)
    assert one_line_error(lambda: reproduce.main(["--out", str(out), "--model", train_ckpt,
                                                  "--train-args=--steps 2"])) == (
        f"error: {run_dir} holds a run with other settings than this command asks for (lr 0.5 → 0.001); to keep it, "
        f"give this command another --out; to train it again, delete {run_dir}")
    assert files_under(tmp_path) == before  # nothing created, nothing lost
    # the control: the settings it was trained with (threads aside) reuse it, and nothing trains
    runs = {os.path.join("runs", "ngc"): ["--seed", "0"]}
    reproduce.check_runs(str(out), train_ckpt, runs, 1, ["--steps", "2", "--lr", "0.5"])
    reproduce.train_all(str(out), train_ckpt, 1, runs, ["--steps", "2", "--lr", "0.5"])
    assert files_under(tmp_path) == before


@pytest.mark.parametrize("train_args, message", [
    ("--seed 3", "--train-args cannot set --seed: reproduce.py chooses it for every run"),
    ("--ou x", "--train-args cannot set --out"), ("--lr x", "--train-args: argument --lr: invalid float value: 'x'"),
    ("--bogus 1", "--train-args: unrecognized arguments: --bogus 1"), ("--lr -1", "--lr -1.0 must be positive"),
    ("--task math", "--train-args sets --task math; reproduce.py's studies are Countdown's")])
def test_reproduce_checks_its_train_args_before_anything(train_ckpt, tmp_path, monkeypatch, train_args, message):
    monkeypatch.setattr(reproduce.subprocess, "Popen", reached)
    assert one_line_error(lambda: reproduce.main(["--out", str(tmp_path / "results"), "--model", train_ckpt,
                                                  f"--train-args={train_args}"])).startswith(f"error: {message}")
    assert list(tmp_path.iterdir()) == []


def test_reproduce_trains_each_study_at_its_own_number_of_seeds():
    import reproduce
    runs = reproduce.study_runs(3, 2, 1)
    assert sorted(runs) == sorted(os.path.join("runs", n) for n in [
        "ngc", "ngc-seed1", "ngc-seed2", "no-evict", "no-evict-seed1", "no-evict-seed2", "token-only",
        "token-only-seed1", "targeted-dropout", "targeted-dropout-seed1", "interoception", "interoception-blind"])
    assert runs[os.path.join("runs", "interoception-blind")] == ["--interoception", "--blind-tag", "--seed", "0"]
    assert not any("interoception" in name for name in reproduce.study_runs(1, 1, 0))  # --no-interoception


def test_reproduce_reuses_an_evaluation_only_for_the_same_arguments_after_the_checkpoint(tmp_path):
    import reproduce
    ckpt = tmp_path / "runs" / "ngc" / "checkpoint"
    ckpt.mkdir(parents=True)
    (ckpt / "model.safetensors").write_text("x")
    path, argv = str(tmp_path / "e.jsonl"), ["--model", str(ckpt), "--policy", "ngc", "--samples", "1"]
    assert not reproduce.evaluated(path, argv)  # nothing written yet
    (tmp_path / "e.jsonl").write_text("{}\n")
    (tmp_path / "e.jsonl.argv").write_text(" ".join(argv) + "\n")
    os.utime(ckpt / "model.safetensors", (1, 1))
    assert reproduce.evaluated(path, argv)
    assert not reproduce.evaluated(path, argv[:-1] + ["2"])  # other arguments
    os.utime(ckpt / "model.safetensors", None)  # the checkpoint is newer than the evaluation: trained again
    os.utime(path, (1, 1))
    assert not reproduce.evaluated(path, argv)
