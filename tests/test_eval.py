"""eval.py: peak-KV reduction and pass@k, its command line; the helper scripts off the happy path."""
import io
import itertools
import json
import math
import os
import shutil
import subprocess
import sys
import types

import pytest
import torch

from evaluation import baselines, scoring
from lib import tasks
import bench
import countdown as cd
import eval as eval_script
import make_tiny
import reproduce
import show
import train

from ngc import Eviction, Sampling, rollout
from conftest import (TRAIN_DEFAULTS, Reached, files_under, one_line_error, parity_reward, prompts_of, reached, run_train,
                      write_checkpoint)


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
    assert abs(eval_script.kv_reduction(ref, pol) - (72 / 42 + 48 / 36) / 2) < 1e-12  # = 32/21
    # Negative control: the ratio of mean peaks (a different estimator) differs.
    assert abs(eval_script.kv_reduction(ref, pol) - 120 / 78) > 1e-3
    # With samples, a problem's peak is the mean over its samples.
    assert abs(eval_script.kv_reduction(torch.tensor([[10.0, 30.0]]), torch.tensor([[5.0, 10.0]])) - 20 / 7.5) < 1e-6


def test_every_row_divides_the_no_evict_models_full_cache(train_ckpt, monkeypatch):
    """One reference (§5.1's c_base): with --base-model, every row's peak-KV reduction divides the base model's
    full-cache peaks of the same problems, the evaluated model's own full cache included. By hand, two problems,
    one sample: the base model's full cache peaks at 100 and 40 entries, the evaluated model's at 120 and 60,
    its ngc rows at 40 and 40: ngc (100/40 + 40/40)/2 = 1.75, none (100/120 + 40/60)/2 = 0.75."""
    stand_in = type("Model", (), {"lm_head": torch.nn.Linear(1, 1), "config": types.SimpleNamespace(num_hidden_layers=2)})
    evaluated, base = stand_in(), stand_in()
    peaks = {(evaluated, None): [120.0, 60.0], (base, None): [100.0, 40.0], (evaluated, "ngc"): [40.0, 40.0]}
    lengths = {(evaluated, None): 90.0, (base, None): 70.0, (evaluated, "ngc"): 30.0}

    def by_hand(model, tokenizer, problems, sampling, eviction, *args, **kwargs):
        key = (model, None if eviction is None else "ngc")
        one = lambda values: torch.tensor(values, dtype=torch.float64).view(2, 1)
        return {"reward": one([1.0, 0.0]), "length": one([lengths[key]] * 2), "rounds": one([0.0, 0.0]),
                "peak_kv": one(peaks[key]), "texts": [[""], [""]]}

    monkeypatch.setattr(eval_script, "roll_out_and_score", by_hand)
    monkeypatch.setattr(eval_script, "make_eviction", lambda name, *args: None if name == "none" else Eviction(8, 2, 3, 0.5))
    c = eval_script.run_defaults(train_ckpt)
    rows = eval_script.compare(evaluated, None, c, [0, 1], ["none", "ngc"], [0.5], samples=None, progress=False,
                              base_model=base)
    none, ngc = rows
    assert ngc["kv_reduction"] == pytest.approx(1.75) and none["kv_reduction"] == pytest.approx(0.75)
    assert ngc["base_length"] == none["base_length"] == 70.0 and ngc["length"] == 30.0
    assert none["full_cache_entries"] == [60.0, 30.0]  # per problem, one layer's entries: 120 / 2, 60 / 2
    # Negative control: against its own full cache (the old reference) ngc's row would read (3 + 1.5)/2 = 2.25.
    own = eval_script.compare(evaluated, None, c, [0, 1], ["none", "ngc"], [0.5], samples=None, progress=False)
    assert own[1]["kv_reduction"] == pytest.approx(2.25) and own[0]["kv_reduction"] == 1.0


def test_cli_base_model_is_the_reference_of_every_row(train_ckpt, tmp_path, capsys):
    base = write_checkpoint(tmp_path / "base", seed=7)  # the same tokenizer, other weights
    out = tmp_path / "rows.jsonl"
    eval_script.main(["--model", train_ckpt, "--base-model", base, "--policy", "none", "ngc", "--problems", "2",
                     "--samples", "0", "--out", str(out)])
    assert f"against {base}'s full cache" in capsys.readouterr().out
    none, ngc = [json.loads(line) for line in out.read_text().splitlines()]
    assert none["base_length"] == ngc["base_length"] and len(none["full_cache_entries"]) == 2
    assert one_line_error(lambda: eval_script.main(["--model", train_ckpt, "--base-model", str(tmp_path / "nothing"),
                                                   "--problems", "2"])).startswith("error: ")
    assert one_line_error(lambda: eval_script.main(["--model", train_ckpt, "--run-settings", base])) == (
        f"error: --run-settings {base} has no ngc.json: give a run's checkpoint directory")


def test_pass_at_k_matches_its_closed_form():
    for n, k in [(1, 1), (5, 1), (5, 2), (8, 4), (10, 10)]:
        for c in range(n + 1):
            # closed form: the chance that k of n draws without replacement include a correct one
            subsets = list(itertools.combinations(range(n), k))
            brute = sum(any(i < c for i in s) for s in subsets) / len(subsets)
            stable = 1.0 if n - c < k else 1 - math.prod(1 - k / i for i in range(n - c + 1, n + 1))
            got = eval_script.pass_at_k(n, [c], k)
            assert abs(got - brute) < 1e-12 and abs(got - stable) < 1e-12
    assert eval_script.pass_at_k(4, [0, 4, 2], 1) == pytest.approx((0 + 1 + 0.5) / 3)
    # Negative control: the biased plug-in estimate 1 - (1 - c/n)^k is not the same.
    assert abs(eval_script.pass_at_k(8, [2], 4) - (1 - (1 - 2 / 8) ** 4)) > 1e-2


# ---------------------------------------------------------------------------------------
# eval.py's CLI


def test_cli_two_policies_two_rates_share_one_reference(train_ckpt, tmp_path, monkeypatch, capsys):
    calls = []

    def counting(model, prompts, sampling, eviction=None, **kw):
        calls.append((len(prompts), None if eviction is None else (eviction.score, eviction.greedy, eviction.rate)))
        return rollout(model, prompts, sampling, eviction, **kw)

    monkeypatch.setattr(scoring, "rollout", counting)
    out = tmp_path / "results.jsonl"
    eval_script.main(["--model", train_ckpt, "--task", "countdown", "--policy", "ngc", "knorm", "--eviction-rate", "0.5",
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
    assert not list(out.parent.glob(out.name + ".*.tmp"))  # no temporary file left
    assert len(printed.strip().splitlines()) == 6 and "KV reduction" in printed

    calls.clear()  # sampled: k completions per problem, pass@k, `none` is the reference itself
    monkeypatch.setitem(tasks.TASK_REWARD, "countdown", lambda text, problem: float(len(text) % 2))  # some variance
    eval_script.main(["--model", train_ckpt, "--policy", "none", "ngc-sample", "--eviction-rate", "0.5", "--samples", "3",
             "--problems", "2", "--out", str(out)])
    assert [c[0] for c in calls] == [6, 6] and calls[1][1] == (None, False, 0.5)  # ngc-sample: Gumbel-top-k
    none, sampled = [json.loads(line) for line in out.read_text().splitlines()]
    assert none["kv_reduction"] == 1.0 and none["eviction_rate"] == 0.0 and none["rounds"] == 0
    assert sampled["samples"] == 3 and set(sampled["pass_at_k"]) == {"1", "2", "3"}
    p = sampled["pass_at_k"]
    assert p["1"] == pytest.approx(sampled["accuracy"]) and p["1"] <= p["2"] <= p["3"] and p["3"] in (0, 0.5, 1)


def test_eval_on_a_runs_checkpoint_prints_its_training_evaluation(train_ckpt, tmp_path, monkeypatch):
    """A batch's noise depends on its size, so eval.py's default batch is the run's eval_batch: on a run's checkpoint
    and train.py's split (validation) it draws the samples train.py's last evaluation drew and prints its pass@1,
    the full cache's and at the run's ε, under the run's own evaluation sampling (eval_temperature, eval_top_p,
    eval_max_new_tokens, set in its ngc.json). The control: another batch size draws other samples."""
    model = tmp_path / "model"
    shutil.copytree(train_ckpt, model)
    (model / "ngc.json").write_text(json.dumps({**TRAIN_DEFAULTS, "eval_temperature": 0.6, "eval_top_p": 0.9,
                                                "eval_max_new_tokens": 12}))
    flags = ["--steps", "1", "--eval-every", "1", "--eval-batch", "5", "--eval-samples", "4", "--eval-problems", "6"]
    logged = [r["eval"] for r in run_train(str(model), tmp_path / "run", *flags) if "eval" in r][-1]
    monkeypatch.setitem(tasks.TASK_REWARD, "countdown", parity_reward)  # train.py's stand-in reward

    def evaluated(*batch):
        out = tmp_path / f"eval{len(batch)}.jsonl"
        eval_script.main(["--model", str(tmp_path / "run" / "checkpoint"), "--policy", "none", "ngc", "--eviction-rate",
                         "0.5", "--out", str(out), *batch])  # TRAIN_DEFAULTS' retention ends at 0.5
        rows = [json.loads(line) for line in out.read_text().splitlines()]
        return [(r["accuracy"], r["kv_reduction"]) for r in rows]

    printed = [(logged["pass1_full"], 1.0), (logged["pass1"], logged["pass1_kv_reduction"])]
    assert evaluated("--split", "validation") == printed  # the reduction of the same completions
    assert logged["pass1_kv_reduction"] != logged["kv_reduction"]  # not the greedy tokens' one
    assert evaluated("--split", "validation", "--batch-size", "64") != printed


@pytest.mark.parametrize("flags, message", [
    (["--policy", "lru"], "argument --policy: invalid choice: 'lru' (choose from 'ngc', 'ngc-sample'"), (["--eviction-rate", "1.5"], "must lie in (0, 1]"),
    (["--samples", "-1"], "--samples -1 must be at least 0"), (["--problems", "335"], "held-out test split has 334 problems"),
    (["--eviction-rate", "x"], "invalid float"), (["--out", "/no/such/dir/r.jsonl"], "No such file or directory"),
    (["--out", "/tmp"], "/tmp (Is a directory)")])
def test_cli_bad_input_fails_with_one_line(train_ckpt, flags, message, monkeypatch):
    monkeypatch.setattr(scoring, "rollout", None)  # nothing may run
    with pytest.raises(SystemExit) as err:
        eval_script.main(["--model", train_ckpt, *flags])
    assert str(err.value).startswith("error: ") and message in str(err.value) and "\n" not in str(err.value)


def test_eval_out_of_memory_is_one_line_naming_the_flag(train_ckpt, monkeypatch):
    """The CPU's allocator failing mid-evaluation (for real: an allocation it cannot make)."""
    monkeypatch.setattr(eval_script, "evaluate_policies", lambda *a: torch.empty(2 ** 60, dtype=torch.uint8))
    with pytest.raises(SystemExit) as err:
        eval_script.main(["--model", train_ckpt, "--policy", "ngc", "--problems", "1"])
    assert str(err.value) == ("error: out of memory (CPU: can't allocate memory: you tried to allocate "
                              "1152921504606846976 bytes); lower --batch-size")


def test_cli_plot_without_matplotlib_fails_early(train_ckpt, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if matplotlib were not installed
    monkeypatch.setattr(eval_script, "load", None)  # fails before loading anything
    with pytest.raises(SystemExit) as err:
        eval_script.main(["--model", train_ckpt, "--plot", str(tmp_path / "acc.png")])
    assert str(err.value) == "error: --plot needs matplotlib: pip install matplotlib"


# ---------------------------------------------------------------------------------------
# Output paths that cannot be created, other layouts and presets, the budget tag


def output_under_a_file(tmp_path, ckpt, train_ckpt):
    """Each script's command line with its output path under a regular file (which no directory can be)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    return blocker, {
        "train": lambda: train.main(["--model", train_ckpt, "--out", str(blocker / "run")]),
        "eval": lambda: eval_script.main(["--model", train_ckpt, "--out", str(blocker / "r.jsonl")]),
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
    out = subprocess.run([sys.executable, "-m", "lib.mathtask", "--make-demo", str(tmp_path / "a-file" / "d")],
                         cwd=os.path.dirname(train.__file__), capture_output=True, text=True)
    assert out.returncode == 2 and len(out.stderr.splitlines()) == 1 and out.stderr.startswith("error: cannot create")


def test_cli_evaluates_another_layout_than_the_runs(train_ckpt, monkeypatch):
    """--delta, --block and --window replace the run's δ, b and w (its ngc.json) for every policy;
    without them the rollouts use the run's own (the control)."""
    seen = []

    def spy(model, prompts, sampling, eviction=None, **kw):
        seen.append(None if eviction is None else (eviction.delta, eviction.block, eviction.window))
        return rollout(model, prompts, sampling, eviction, **kw)

    monkeypatch.setattr(scoring, "rollout", spy)
    flags = ["--model", train_ckpt, "--policy", "ngc", "knorm", "--problems", "2"]
    eval_script.main(flags + ["--delta", "9", "--block", "3", "--window", "2"])
    assert seen == [None, (9, 3, 2), (9, 3, 2)]  # the full-cache reference, then each policy
    seen.clear()
    eval_script.main(flags)
    run = (TRAIN_DEFAULTS["delta"], TRAIN_DEFAULTS["block"], TRAIN_DEFAULTS["window"])
    assert seen == [None, run, run] and run != (9, 3, 2)


def test_cli_evaluates_another_problem_preset_than_the_runs(train_ckpt, monkeypatch):
    """--difficulty evaluates on that preset's held-out problems (tiny-back: the tiny ones that backtrack);
    without it, on the run's (the control)."""
    seen = []

    def spy(model, tokenizer, problems, *args, **kw):
        seen.append(list(problems))
        raise Reached

    monkeypatch.setattr(eval_script, "roll_out_and_score", spy)
    for flags in ([], ["--difficulty", "tiny-back"]):
        with pytest.raises(Reached):
            eval_script.main(["--model", train_ckpt, "--problems", "12"] + flags)
    run, back = seen
    assert back == cd.held_out(cd.SMALL_BACK, "test")[:12] != run
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

    monkeypatch.setattr(eval_script, "prompt_encoder", spy)
    eval_script.main(["--model", train_ckpt, "--policy", "ngc", "--eviction-rate", "0.5", "--problems", "2",
                     "--samples", "0"] + (["--tag", tag] if tag else []))
    assert seen[0][0] is None and seen[1] == written  # the full-cache reference (no tag), then ngc at ε = 0.5


def test_eval_refuses_a_tag_it_cannot_write(train_ckpt):
    with pytest.raises(SystemExit) as err:
        eval_script.main(["--model", train_ckpt, "--tag", "1.5"])
    assert "argument --tag: '1.5': give rate, blind or a rate in [0, 1]" in str(err.value)


# ---------------------------------------------------------------------------------------
# The helper scripts off the happy path: every input checked before anything is created; a
# failure is one line `error: ...` and exit status 2 (cli.exits), never a traceback


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
    for module, name in ((eval_script, "load"), (show, "load"), (train, "load"), (bench, "bench"),
                         (bench, "from_pretrained")):
        monkeypatch.setattr(module, name, reached)  # nothing may be loaded or run
    run = {"train": lambda: train.main(["--model", train_ckpt, "--out", str(tmp_path / "run"), "--device", device]),
           "eval": lambda: eval_script.main(["--model", train_ckpt, "--out", str(tmp_path / "r.jsonl"), "--device", device]),
           "show": lambda: show.main(["--model", train_ckpt, "--before", train_ckpt, "--out", str(tmp_path / "f.html"),
                                      "--device", device]),
           "bench": lambda: bench.main(["--device", device])}
    assert one_line_error(run[script]) == f"error: {message}"
    assert list(tmp_path.iterdir()) == []


def test_a_checkpoint_trained_on_one_task_is_refused_for_the_other(math_run, countdown_run, tmp_path, monkeypatch):
    """A math run's checkpoint has no Countdown prompt (ngc.json: null): eval.py --task countdown
    used to raise KeyError: None; show.py compared it with tiny/, a Countdown model."""
    for module in (eval_script, show):
        monkeypatch.setattr(module, "load", reached)
    monkeypatch.setattr(reproduce.subprocess, "Popen", reached)  # nothing may train
    out = tmp_path / "out"
    refused = lambda flag, path, trained, task: (  # settings.run_defaults: the one check of every script
        f"error: {flag} {path} was trained on {trained} (its ngc.json), not {task}: give a {task} model, such as "
        f"{os.path.relpath(show.BEFORE[task])}, or a copy of {path} without ngc.json to start from its weights")
    assert one_line_error(lambda: eval_script.main(["--model", math_run, "--task", "countdown", "--out", str(out)])) == \
        refused("--model", math_run, "math", "countdown")
    assert one_line_error(lambda: eval_script.main(["--model", countdown_run, "--task", "math", "--eval-data",
                                                   "x.jsonl"])) == \
        refused("--model", countdown_run, "countdown", "math")
    assert one_line_error(lambda: show.main(["--model", math_run, "--before", countdown_run, "--out", str(out)])) == \
        refused("--before", countdown_run, "countdown", "math")
    assert one_line_error(lambda: show.main(["--model", countdown_run, "--before", math_run, "--out", str(out)])) == \
        refused("--before", math_run, "math", "countdown")
    assert one_line_error(lambda: reproduce.main(["--model", math_run, "--out", str(out)])) == \
        refused("--model", math_run, "math", "countdown")
    assert list(tmp_path.iterdir()) == []
    # the control: each checkpoint with its own task passes every check and gets to its loading
    for argv in (["--model", math_run], ["--model", math_run, "--task", "math"], ["--model", countdown_run]):
        with pytest.raises(Reached):
            eval_script.main(argv + ["--problems", "1"])
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
    monkeypatch.setattr(eval_script, "load", reached)
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    before = files_under(tmp_path)
    error = one_line_error(lambda: eval_script.main(["--model", math_run, "--eval-data", str(path), "--out",
                                                    str(tmp_path / "r.jsonl")]))
    assert error.startswith(f"error: {path}{message}"), error
    assert files_under(tmp_path) == before


def test_eval_reads_the_fields_it_is_told_and_refuses_them_for_countdown(math_run, train_ckpt, tmp_path, monkeypatch):
    monkeypatch.setattr(eval_script, "load", reached)
    rows = tmp_path / "sol.jsonl"
    rows.write_text('{"question": "Q?", "sol": "1"}\n')
    with pytest.raises(Reached):  # --answer-field, the flag the missing-answer error names
        eval_script.main(["--model", math_run, "--eval-data", str(rows), "--answer-field", "sol"])
    assert one_line_error(lambda: eval_script.main(["--model", train_ckpt, "--answer-field", "sol"])) == \
        "error: --answer-field is for --task math; this evaluation's task is countdown"


def test_eval_draws_progress_bars_only_on_a_terminal(train_ckpt, monkeypatch):
    seen = []
    monkeypatch.setattr(eval_script, "compare", lambda *args, **kw: seen.append(kw["progress"]) or reached())

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    with pytest.raises(Reached):  # pytest's stderr is not a terminal: a log file gets no bars
        eval_script.main(["--model", train_ckpt, "--problems", "1"])
    monkeypatch.setattr(sys, "stderr", Terminal())
    with pytest.raises(Reached):
        eval_script.main(["--model", train_ckpt, "--problems", "1"])
    assert seen == [False, True]


