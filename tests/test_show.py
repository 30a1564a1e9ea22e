"""show.py: which keys each layer evicted and when, and the page."""
import json
import os
import shutil
import sys
from dataclasses import replace
from html.parser import HTMLParser

import pytest
import torch

import countdown as cd
import eval as eval_script
from evaluation import scoring
from lib import settings, tasks
import show

from lib.checkpoint import load_tokenizer
from ngc import Sampling, rollout
from replay import death_times, visibility
from conftest import EV, TINY_MODEL, TRAIN_DEFAULTS, prompts_of


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
    assert not list(out.parent.glob(out.name + ".*.tmp"))  # no temporary file left
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
    monkeypatch.setattr(scoring, "rollout", recording("eval"))
    show.main(["--model", str(run), "--before", str(run), "--problems", "2", "--eviction-rate", "0.25",
               "--out", str(tmp_path / "f.html")])
    eval_script.main(["--model", str(run), "--policy", "ngc", "--eviction-rate", "0.25", "--problems", "2", "--samples", "0"])
    assert seen["show"] == [seen["eval"][1]] * 2  # eval's ngc run (its first is the full-cache reference)
    plain = seen["eval"][0]  # no eviction: no tag
    assert all(len(a) > len(b) for a, b in zip(seen["show"][0], plain))  # Negative control


def test_show_png(ckpt, train_ckpt, tmp_path):
    pytest.importorskip("matplotlib")
    out, png = tmp_path / "f.html", tmp_path / "f.png"
    show.main(["--model", train_ckpt, "--before", ckpt, "--problems", "1", "--out", str(out), "--png", str(png)])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert not list(png.parent.glob(png.name + ".*.tmp"))


@pytest.mark.parametrize("flags, message", [
    (["--eviction-rate", "1.5"], "must lie in (0, 1]"), (["--problems", "0"], "--problems 0 must be at least 1"),
    (["--problems", "167"], "held-out validation split has 166 problems"), (["--out", "/no/such/dir/f.html"], "No such file or directory"),
    (["--out", "/tmp"], "/tmp (Is a directory)"), (["--model", "/no/such/run"], "no config.json in '/no/such/run'"),
    (["--before", "/no/such/model"], "no config.json in '/no/such/model'"),
    (["--png", "/no/such/dir/f.png"], "No such file or directory")])
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
