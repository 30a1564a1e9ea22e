"""Faults a researcher meets between runs: files edited by hand (ngc.json, config.json, the shard
index, log.jsonl), scripts and studies stopped by a signal and run again, and the checks that must
come before any work. Each test makes the fault happen for real and checks the one line, the exit
and that nothing was lost."""
import contextlib
import errno
import io
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import bench
import eval as eval_script
import make_tiny
import reproduce
from evaluation import scoring
from lib import cli, rundir
import show
import train
from lib.checkpoint import from_pretrained
from lib.cli import Error
from conftest import Reached, files_under, one_line_error, reached, run_train, save_small_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository: tiny/, scripts/
TINY, TINY_MATH = os.path.join(ROOT, "tiny"), os.path.join(ROOT, "tiny-math")


# ---------------------------------------------------------------------------------------
# Files a user edits: one line naming the file, the key and what it accepts, in every script


SCRIPTS = {  # each script that reads a model directory, as a user runs it; what it would write goes under out
    "train": lambda model, out: train.main(["--model", model, "--out", str(out / "run")]),
    "eval": lambda model, out: eval_script.main(["--model", model, "--out", str(out / "r.jsonl")]),
    "show": lambda model, out: show.main(["--model", model, "--before", model, "--out", str(out / "f.html")]),
    "reproduce": lambda model, out: reproduce.main(["--model", model, "--out", str(out / "results")]),
    "bench": lambda model, out: bench.main(["--model", model, "--device", "cpu"]),
}
NGC_EDITS = [("steps", "60", 'steps is "60"; it must be an integer'),
             ("steps", 60.5, "steps is 60.5; it must be an integer"),
             ("eval_every", None, "eval_every is null; it must be an integer, not null"),
             ("steps", 0, "steps is 0; it must be at least 1"),
             ("difficulty", "hard", 'difficulty is "hard"; it must be one of paper, tiny'),
             ("prompt", "fancy", 'prompt is "fancy"; it must be one of plain, tiny-shift, tiny-shift-unseen'),
             ("lr", "1e-3", 'lr is "1e-3"; it must be a number'),
             ("retention", "0.9;0.5", 'retention is "0.9;0.5"; it must be comma-separated numbers'),
             ("interoception", 1, "interoception is 1; it must be true or false"),
             ("prompt", None, "prompt is null; a Countdown run's must be one of plain, tiny-shift, tiny-shift-unseen")]
CONFIG_EDITS = [("hidden_size", "64", 'hidden_size is "64"; it must be a positive integer'),
                ("num_hidden_layers", 2.5, "num_hidden_layers is 2.5; it must be a positive integer"),
                ("vocab_size", None, "vocab_size is null; it must be a positive integer"),
                ("rms_norm_eps", "1e-6", 'rms_norm_eps is "1e-6"; it must be a positive number'),
                ("eos_token_id", "1", 'eos_token_id is "1"; it must be a token id, a list of them, or null'),
                ("tie_word_embeddings", "false", 'tie_word_embeddings is "false"; it must be true or false')]


def edited_copy(src, dest, file, key, value):
    """A copy of checkpoint directory src at dest, with `key` of JSON file `file` set to value."""
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(src, dest)
    d = json.loads((dest / file).read_text())
    (dest / file).write_text(json.dumps({**d, key: value}))
    return str(dest)


@pytest.fixture
def nothing_runs(monkeypatch):
    """Every script stops at the first thing it does once its checks have passed."""
    for module, name in ((rundir, "prepare"), (eval_script, "compare"), (show, "trace_rollouts"),
                         (bench, "bench"), (reproduce.subprocess, "Popen")):
        monkeypatch.setattr(module, name, reached)


@pytest.mark.parametrize("script", [s for s in SCRIPTS if s != "bench"])  # bench.py reads no ngc.json
def test_an_edited_ngc_json_is_one_line_naming_the_key_in_every_script(train_ckpt, tmp_path, nothing_runs, script):
    out = tmp_path / "out"
    out.mkdir()
    for key, value, says in NGC_EDITS + [("stepz", 60, "has unknown keys ['stepz']")]:
        model = edited_copy(train_ckpt, tmp_path / "model", "ngc.json", key, value)
        message = one_line_error(lambda: SCRIPTS[script](model, out))
        assert message.startswith(f"error: {model}/ngc.json") and says in message, (key, value, message)
        assert list(out.iterdir()) == []
    with pytest.raises(Reached):  # the control: the file as it was passes every check
        SCRIPTS[script](edited_copy(train_ckpt, tmp_path / "model", "ngc.json", "steps", 60), out)


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_an_edited_config_json_is_one_line_naming_the_key_in_every_script(train_ckpt, tmp_path, nothing_runs, script):
    out = tmp_path / "out"
    out.mkdir()
    for key, value, says in CONFIG_EDITS:
        model = edited_copy(train_ckpt, tmp_path / "model", "config.json", key, value)
        assert one_line_error(lambda: SCRIPTS[script](model, out)) == f"error: {model}/config.json: {says}"
        assert list(out.iterdir()) == []
    with pytest.raises(Reached):
        SCRIPTS[script](edited_copy(train_ckpt, tmp_path / "model", "config.json", "hidden_size", 64), out)


def test_a_setting_this_version_lacks_is_one_line_naming_the_file(train_ckpt, small_run, tmp_path, nothing_runs):
    """ngc.json and trainer.pt pass the same checks: a key no setting takes (a switch of an earlier
    version, such as --mem-weight) is refused in one line naming the file; the run as saved resumes."""
    run, trainer = tmp_path / "run", tmp_path / "run" / "checkpoint" / "trainer.pt"
    shutil.copytree(small_run, run)
    with pytest.raises(Reached):  # the control: rundir.prepare, every check passed
        train.main(["--resume", str(run), "--steps", "3", "--threads", "1"])
    state = torch.load(trainer, weights_only=False)
    torch.save({**state, "config": {**state["config"], "mem_weight": 1.0}}, trainer)
    assert one_line_error(lambda: train.main(["--resume", str(run), "--steps", "3"])) == (
        f"error: {trainer} has unknown keys ['mem_weight']; the known ones are train.py's flags")
    torch.save({**state, "config": {**state["config"], "steps": "3"}}, trainer)
    assert one_line_error(lambda: train.main(["--resume", str(run), "--steps", "3"])) == (
        f'error: {trainer}: steps is "3"; it must be an integer')


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_weights_that_are_not_finite_are_refused_by_every_script_naming_the_file(train_ckpt, tmp_path, nothing_runs,
                                                                                 script):
    """A NaN in a checkpoint (a diverged run's, a bad conversion): eval.py used to print an ordinary table,
    show.py its page, train.py to make the run directory and then blame --lr."""
    out = tmp_path / "out"
    out.mkdir()
    for bad in (float("nan"), float("inf")):
        model = tmp_path / "model"
        shutil.rmtree(model, ignore_errors=True)
        shutil.copytree(train_ckpt, model)
        state = load_file(model / "model.safetensors")
        state["model.layers.1.mlp.up_proj.weight"][3, 5] = bad
        save_file(state, model / "model.safetensors")
        assert one_line_error(lambda: SCRIPTS[script](str(model), out)) == (
            f"error: {model}/model.safetensors: model.layers.1.mlp.up_proj.weight holds values that are not finite "
            f"(NaN or inf): these weights are no model; use a checkpoint saved before they went bad")
        assert list(out.iterdir()) == []
    state["model.layers.1.mlp.up_proj.weight"][3, 5] = 0.0
    save_file(state, model / "model.safetensors")
    with pytest.raises(Reached):  # the control: the weights made finite again
        SCRIPTS[script](str(model), out)


@pytest.mark.parametrize("text, says", [("{not json", "is not valid JSON"),
                                        ('{"metadata": {}}', "has no weight_map of tensor names to shard files"),
                                        ('{"weight_map": ["model.norm.weight"]}', "has no weight_map")])
def test_a_broken_shard_index_is_one_line_naming_it(ckpt, tmp_path, text, says):
    model = tmp_path / "model"
    shutil.copytree(ckpt, model)
    (model / "model.safetensors").rename(model / "model-00001-of-00001.safetensors")
    index = model / "model.safetensors.index.json"
    index.write_text(text)
    with pytest.raises(Error) as err:
        from_pretrained(str(model))
    assert str(err.value).startswith(f"{index} {says}")
    assert one_line_error(lambda: eval_script.main(["--model", str(model)])).startswith(f"error: {index} {says}")
    names = from_pretrained(ckpt).state_dict().keys() - {"lm_head.weight"}
    index.write_text(json.dumps({"weight_map": dict.fromkeys(names, "model-00001-of-00001.safetensors")}))
    from_pretrained(str(model))  # the control: the index repaired


@pytest.fixture(scope="module")
def small_run(train_ckpt, tmp_path_factory):
    """A run directory of two steps, a checkpoint after each."""
    run = tmp_path_factory.mktemp("small_run")
    run_train(train_ckpt, run, "--steps", "2", "--save-every", "1")
    return run


@pytest.mark.parametrize("line", [b"null", b'{"reward": 0.5}', b'{"step": "1"}', b'{"step": 1, "eval": 0.5}',
                                  b'{"step": 1, "note": "caf\xe9"}'])
def test_an_edited_log_line_stops_a_resume_in_one_line_naming_it(small_run, tmp_path, line):
    run = tmp_path / "run"
    shutil.copytree(small_run, run)
    first, rest = (run / "log.jsonl").read_bytes().split(b"\n", 1)
    (run / "log.jsonl").write_bytes(first + b"\n" + line + b"\n" + rest)
    before = files_under(run)
    assert one_line_error(lambda: train.main(["--resume", str(run), "--threads", "1"])) == (
        f'error: {run}/log.jsonl line 2 is not a record (a JSON object with an integer "step", any "eval" an '
        f'object); repair or remove that line')
    assert files_under(run) == before  # nothing lost, nothing half-written


def test_an_input_that_cannot_be_read_is_one_line_naming_it(train_ckpt, tmp_path, nothing_runs):
    """ngc.json or log.jsonl this user cannot read (another user's; here a directory in its place, which
    root cannot read either): one line naming the file, not 'not valid JSON' or a traceback."""
    out = tmp_path / "out"
    out.mkdir()
    model = tmp_path / "model"
    shutil.copytree(train_ckpt, model)
    (model / "ngc.json").unlink()
    (model / "ngc.json").mkdir()
    for script in [s for s in SCRIPTS if s != "bench"]:
        assert one_line_error(lambda: SCRIPTS[script](str(model), out)) == \
            f"error: cannot read {model}/ngc.json (Is a directory); fix or delete it", script
    assert list(out.iterdir()) == []


def test_a_log_that_cannot_be_read_stops_a_resume_in_one_line(small_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(small_run, run)
    (run / "log.jsonl").unlink()
    (run / "log.jsonl").mkdir()
    assert one_line_error(lambda: train.main(["--resume", str(run), "--threads", "1"])) == \
        f"error: cannot read {run}/log.jsonl (Is a directory)"


def refuse_lock(real_open):
    """os.open as it behaves for a lock file this user may not open (root passes any permission bits)."""
    def open_(path, *args, **kwargs):
        if os.path.basename(path) == rundir.LOCK:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
        return real_open(path, *args, **kwargs)
    return open_


def test_a_lock_that_cannot_be_opened_is_one_line(train_ckpt, tmp_path, monkeypatch):
    run = tmp_path / "run"
    (run / "lock").mkdir(parents=True)
    fix = "it must be a file this user can write: fix its permissions or remove it"
    assert one_line_error(lambda: train.main(["--model", train_ckpt, "--out", str(run), "--threads", "1"])) == \
        f"error: cannot open the run directory's lock {run}/lock (Is a directory); {fix}"
    (run / "lock").rmdir()
    (run / "lock").write_text("")
    monkeypatch.setattr(os, "open", refuse_lock(os.open))
    assert one_line_error(lambda: train.main(["--model", train_ckpt, "--out", str(run), "--threads", "1"])) == \
        f"error: cannot open the run directory's lock {run}/lock (Permission denied); {fix}"
    assert os.listdir(run) == ["lock"]


# ---------------------------------------------------------------------------------------
# Checks that come before the work


def test_eval_refuses_a_policy_the_model_cannot_use_before_any_rollout(math_run, ckpt, monkeypatch):
    monkeypatch.setattr(scoring, "rollout", reached)
    assert one_line_error(lambda: eval_script.main(["--model", math_run, "--policy", "none", "task-rule"])) == (
        "error: --policy task-rule keeps the block of a Countdown prompt's target; this evaluation's task is math: "
        "leave task-rule out")
    assert one_line_error(lambda: eval_script.main(["--model", ckpt, "--policy", "none", "task-rule"])) == (
        "error: --policy task-rule keeps the token after 'reach' (the tiny prompt's target); this tokenizer has no "
        "such token")
    with pytest.raises(Reached):  # the control: the shipped tiny/ has the word
        eval_script.main(["--model", TINY, "--policy", "none", "task-rule", "--problems", "1"])


def test_an_empty_output_path_is_refused_before_any_work(ckpt, train_ckpt, tmp_path, monkeypatch, nothing_runs):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(make_tiny, "build_tokenizer", reached)  # pretraining would start here
    cases = [(lambda: eval_script.main(["--model", train_ckpt, "--out", ""]), "--out is empty; give a file name"),
             (lambda: eval_script.main(["--model", train_ckpt, "--plot", ""]), "--plot is empty; give a file name"),
             (lambda: show.main(["--model", train_ckpt, "--before", ckpt, "--out", ""]), "--out is empty"),
             (lambda: make_tiny.main(["--out", "", "--steps", "1"]), "--out is empty"),
             (lambda: train.main(["--model", train_ckpt, "--out", ""]), "--out is empty; give the run directory"),
             (lambda: reproduce.main(["--model", train_ckpt, "--out", ""]), "the output directory is empty")]
    for run, says in cases:
        assert one_line_error(run).startswith(f"error: {says}")
    assert list(tmp_path.iterdir()) == []


def test_an_output_file_another_process_removed_first_is_no_error(tmp_path, monkeypatch):
    """Under torchrun each process checks --out: both can create the probe, one removes it."""
    path, real_open = tmp_path / "rows.jsonl", open

    def open_then_lose_it(*args, **kwargs):  # the other process removes it between open and remove
        handle = real_open(*args, **kwargs)
        os.remove(path)
        return handle
    monkeypatch.setattr(cli, "open", open_then_lose_it, raising=False)
    cli.check_output_file(str(path), "--out")
    assert not path.exists()


def test_a_prompt_the_tokenizer_cannot_spell_is_refused(tmp_path, monkeypatch):
    """--prompt plain on tiny/: most of its tokens were <unk>, and it evaluated to 0% without a word."""
    monkeypatch.setattr(eval_script, "compare", reached)
    monkeypatch.setattr(rundir, "prepare", reached)
    says = ("words (Using, the, numbers, ...), which would be its unknown token: it spells the prompt styles "
            "tiny-shift, tiny-shift-unseen: give one with --prompt")
    for run in (lambda: eval_script.main(["--model", TINY, "--prompt", "plain", "--problems", "1"]),
                lambda: train.main(["--model", TINY, "--prompt", "plain", "--out", str(tmp_path / "r")])):
        said = one_line_error(run)
        assert said.startswith(f"error: {TINY}/tokenizer.json cannot spell ") and said.endswith(says), said
    with pytest.raises(Reached):  # the control: a layout tiny/ never trained on, but spelled
        eval_script.main(["--model", TINY, "--prompt", "tiny-shift-unseen", "--problems", "1"])
    assert list(tmp_path.iterdir()) == []


def test_a_tokenizer_that_is_not_the_model_s_is_refused_in_one_line(tmp_path, monkeypatch, nothing_runs):
    """A tokenizer.json beside tiny/'s weights whose ids all lie inside tiny/'s vocabulary but which lacks
    words of its Countdown prompt (as tiny-math/'s did beside an earlier tiny/): those words
    became <unk>, eval.py reported 0.0%, train.py trained, as the check left alone a tokenizer that spells
    no prompt style. Likewise a tag the run writes (interoception) that the tokenizer cannot spell, and
    prompts with their new tokens past the model's positions. The control: tiny/ as shipped passes, and
    the tests' random vocabularies (no word at all) are still left alone."""
    model = tmp_path / "model"
    shutil.copytree(TINY, model)
    make_tiny.build_tokenizer([w for w in make_tiny.WORDS if w not in ("Countdown", "reach")]).save(
        str(model / "tokenizer.json"))
    says = (f"error: {model}/tokenizer.json cannot spell 2 of this run's prompt words (Countdown, reach), which "
            f"would be its unknown token: the tokenizer is not this model's, or the prompts are not its task")
    for script in ("train", "eval", "show"):
        assert one_line_error(lambda: SCRIPTS[script](str(model), tmp_path)) == says, script
    vocab = json.loads(Path(TINY, "tokenizer.json").read_text())
    del vocab["model"]["vocab"]["%"]  # a word of the tag interoception writes: `3 7 %` for ε = 0.37
    (model / "tokenizer.json").write_text(json.dumps(vocab))
    with pytest.raises(Reached):  # no tag, no interoception: every word is there
        SCRIPTS["train"](str(model), tmp_path)
    for run in (lambda: train.main(["--model", str(model), "--out", str(tmp_path / "r"), "--interoception"]),
                lambda: eval_script.main(["--model", str(model), "--tag", "rate"])):  # eval.py's tag too
        assert one_line_error(run).startswith(f"error: {model}/tokenizer.json cannot spell 1 of this run's prompt "
                                              f"words (%), which")
    assert one_line_error(lambda: train.main(["--model", TINY, "--out", str(tmp_path / "r"), "--max-new-tokens",
                                              "1010"])) == (
        f"error: prompts of up to 18 tokens and 1010 new ones pass the 1024 positions of {TINY} "
        f"(max_position_embeddings in its config.json): lower --max-new-tokens")
    for script in ("train", "eval"):
        with pytest.raises(Reached):
            SCRIPTS[script](TINY, tmp_path)
    assert list(tmp_path.iterdir()) == [model]


def test_the_math_demo_files_that_are_not_shipped_say_how_to_make_them(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # tiny-math/ngc.json names data/math-demo/*.jsonl, relative to here
    make = "the demo set is not shipped: make it with python -m lib.mathtask --make-demo data/math-demo"
    assert one_line_error(lambda: train.main(["--model", TINY_MATH, "--out", "run"])) == \
        f"error: no such file: data/math-demo/train.jsonl; {make}"
    assert one_line_error(lambda: eval_script.main(["--model", TINY_MATH])) == \
        f"error: data/math-demo/test.jsonl: no such file; {make}"
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------
# Signals: every script stops with one line and exit code 128 + the signal, writing nothing


def marked(module: str, function: str, argv) -> list[str]:
    """The command running module.main(argv) with `marker` printed as `function` (called inside
    the work) first starts: the moment to send a signal."""
    code = (f"import sys, {module} as m\nreal = m.{function}\n"
            f"def marked(*a, **k):\n    print('marker', flush=True)\n    return real(*a, **k)\n"
            f"m.{function} = marked\nm.main(sys.argv[1:])")
    return [sys.executable, "-u", "-c", code, *argv]


def wait_for(proc, marker, timeout=120) -> str:
    """proc's stdout up to the first line holding marker."""
    seen, deadline = [], time.time() + timeout
    while time.time() < deadline:
        line = proc.stdout.readline()
        seen.append(line)
        if marker in line or not line:
            return "".join(seen)
    raise AssertionError(f"no {marker!r} in {seen}")


@pytest.mark.parametrize("script, sig", [("eval", signal.SIGINT), ("show", signal.SIGTERM),
                                         ("make_tiny", signal.SIGINT), ("bench", signal.SIGTERM)])
def test_a_signal_stops_every_script_in_one_line(ckpt, train_ckpt, tmp_path, script, sig):
    out = tmp_path / "out"
    commands = {  # each with work enough to take many seconds, and the line that says the work has started
        "eval": (marked("eval", "roll_out_and_score", ["--model", train_ckpt, "--problems", "200", "--batch-size", "1",
                                            "--out", str(out)]), "marker"),
        "show": (marked("show", "rollout", ["--model", ckpt, "--before", ckpt, "--problems", "200",
                                            "--out", str(out)]), "marker"),
        "make_tiny": ([sys.executable, "-u", "make_tiny.py", "--out", str(out), "--steps", "100000",
                       "--train-problems", "2000", "--threads", "1"], "M parameters"),
        "bench": ([sys.executable, "-u", "bench.py", "--device", "cpu", "--new-tokens", "4096", "--repeat", "9",
                   "--threads", "1"], "== cpu")}
    command, marker = commands[script]
    proc = subprocess.Popen(command, cwd=os.path.join(ROOT, "scripts"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # from scripts/: `import eval` finds it
    try:
        printed = wait_for(proc, marker)
        proc.send_signal(sig)
        rest, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + sig, printed + rest + err
    assert err.strip().splitlines()[-1] == f"{signal.Signals(sig).name}: stopped; no file is half-written", err
    assert "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------
# A study stopped and run again


def test_a_run_stopped_in_its_final_evaluation_is_resumed_to_log_it(train_ckpt, tmp_path):
    run = tmp_path / "runs" / "ngc"
    run_train(train_ckpt, run, "--steps", "2", "--eval-every", "2", "--eval-samples", "0")
    assert reproduce.finished(str(run))
    log = run / "log.jsonl"
    log.write_text("".join(line + "\n" for line in log.read_text().splitlines()[:-1]))  # the final eval's record
    assert not reproduce.finished(str(run))
    command = reproduce.train_command(str(tmp_path), os.path.join("runs", "ngc"), train_ckpt, 1, [], ["--steps", "2"])
    assert command[2:] == ["--resume", str(run), "--threads", "1"]  # the flags train.py accepts on a resume
    run_train(train_ckpt, run, *command[2:])
    assert reproduce.finished(str(run))
    assert [(r["step"], "eval" in r) for r in rundir.read_log(str(log))] == [(0, True), (0, False), (1, False),
                                                                             (2, True)]


def test_a_study_stopped_by_a_signal_continues_with_the_same_command(tmp_path):
    """reproduce.py on tiny/ (a small recipe), SIGINT while its first two runs train: it stops them (no
    train.py left running), says how to go on, and the same command resumes them, each step logged
    once, their first console lines kept, trains the rest and writes the tables."""
    out = tmp_path / "results"
    command = [sys.executable, "-u", "scripts/reproduce.py", "--no-interoception", "--no-ablations", "--model", TINY,
               "--out", str(out),
               "--jobs", "2", "--problems", "1", "--samples", "1", "--draws", "2", "--curve", "0.5", "--train-args", "--steps 10 --eval-every 5 "
               "--eval-samples 0 --save-every 0 --prompts 2 --group 2 --max-new-tokens 24 --eval-problems 1 "
               "--train-problems 64"]
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    runs = [out / "runs" / name for name in ("ngc", "no-evict")]  # the first two of the plan, trained together
    try:
        deadline = time.time() + 180
        while proc.poll() is None and time.time() < deadline and not all(
                len(rundir.read_log(str(r / "log.jsonl"))) >= 3 for r in runs):  # step 0's eval and two steps
            time.sleep(0.05)
        trainers = [int((r / "lock").read_text()) for r in runs]
        proc.send_signal(signal.SIGINT)
        printed, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 130, printed + err
    assert err.strip().startswith("SIGINT: stopped; finished runs and evaluations are kept and interrupted runs saved "
                                  "their step: run the same command to continue (python scripts/reproduce.py "
                                  "--no-interoception --no-ablations")
    assert len(err.strip().splitlines()) == 1, err
    for pid in trainers:  # no train.py left training
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    first = [(r.with_suffix(".log")).read_text() for r in runs]
    again = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout + again.stderr
    for run, before in zip(runs, first):
        log = rundir.read_log(str(run / "log.jsonl"))
        assert [r["step"] for r in log if "reward" in r] == list(range(10))
        assert [r["step"] for r in log if "eval" in r] == [0, 5, 10]
        console = run.with_suffix(".log").read_text()
        resumed = f"--resume {run} --threads {reproduce.threads_per_run(2)}"
        assert console.startswith(before) and resumed in console[len(before):]
    assert "1. The baselines at ε* = " in (out / "summary.md").read_text()
    assert "not measured (--no-ablations)" in (out / "claims.md").read_text()


# ---------------------------------------------------------------------------------------
# Writers side by side, and readers of what they write


WRITER = "import sys; from lib import files; [files.write_text(sys.argv[1], sys.argv[2] * 50_000) for _ in range(200)]"


def test_two_writers_of_one_file_each_land_whole(tmp_path):
    """Two processes write one file 200 times each: a reader only ever finds one writer's whole
    text, neither writer fails, and no temporary file is left."""
    path, whole = tmp_path / "rows.jsonl", {c * 50_000 for c in "ab"}
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(path), c], cwd=ROOT, stderr=subprocess.PIPE)
               for c in "ab"]
    reads = []
    while any(w.poll() is None for w in writers):
        if path.exists():
            reads.append(path.read_text())
    assert [w.wait() for w in writers] == [0, 0], [w.stderr.read().decode()[-300:] for w in writers]
    assert len(reads) > 10 and all(text in whole for text in reads) and path.read_text() in whole
    assert os.listdir(tmp_path) == ["rows.jsonl"]


def test_a_checkpoint_being_replaced_is_whole_at_every_instant(train_ckpt, tmp_path, monkeypatch):
    """The swap of checkpoint/: at each rename it makes, checkpoint/ is there and loads (the old
    step's or the new one's)."""
    save_small_checkpoint(train_ckpt, tmp_path, step=1)
    real_replace, loads = os.replace, []

    def replace(a, b):
        loads.append(rundir.saved_step(tmp_path))
        real_replace(a, b)

    monkeypatch.setattr(os, "replace", replace)
    save_small_checkpoint(train_ckpt, tmp_path, step=2)
    monkeypatch.undo()
    assert len(loads) >= 5 and set(loads) == {1, 2}  # never None: no instant without a checkpoint


def test_a_checkpoint_saved_under_umask_022_is_readable_by_everyone(train_ckpt, tmp_path):
    umask = os.umask(0o022)
    try:
        save_small_checkpoint(train_ckpt, tmp_path)
    finally:
        os.umask(umask)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "checkpoint").iterdir()}
    assert modes == dict.fromkeys(modes, 0o644) and "model.safetensors" in modes


# ---------------------------------------------------------------------------------------
# A console that cannot print ε


def test_an_ascii_console_gets_every_line_spelled_in_ascii(train_ckpt, tmp_path, monkeypatch):
    """Output to a file under PYTHONIOENCODING=ascii (a console of that encoding): each --help and a
    one-step run print their whole text, ε and δ spelled eps and delta."""
    def printed(main, *argv):
        console = io.TextIOWrapper(io.BytesIO(), encoding="ascii")
        monkeypatch.setattr(sys, "stdout", console)
        with contextlib.suppress(SystemExit):
            main(list(argv))
        monkeypatch.undo()
        console.flush()
        return console.buffer.getvalue()

    for main in (train.main, eval_script.main, show.main):
        text = printed(main, "--help")
        assert b"--model" in text and b"eps" in text and text.endswith(b"\n"), main.__module__
    text = printed(train.main, "--model", train_ckpt, "--out", str(tmp_path / "run"), "--steps", "1",
                   "--threads", "1")
    assert b"delta=8" in text and b"step 1/1" in text and b"done in" in text
