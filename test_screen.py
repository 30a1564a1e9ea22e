"""screen.py: variants trained as child processes and tabulated from their logs, shared runs trained
once, a rerun that trains nothing (and resumes what is unfinished), and its checks before any work."""
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

import rundir
import screen
from conftest import wait_for_log_lines, write_checkpoint

HERE = os.path.dirname(os.path.abspath(__file__))
# A miniature of tiny/'s recipe: 2 steps of 2 prompts x 2 rollouts, 3 held-out problems x 1 sample.
MINI = dict(prompt="tiny-shift", difficulty="tiny", train_problems=64, eval_problems=3, eval_samples=1, steps=2,
            prompts=2, group=2, max_new_tokens=12, temperature=1.0, top_k=0, delta=8, block=2, window=3,
            retention="0.75,0.5", stage_steps=1, micro_batch=4, eval_batch=8, save_every=1, lr=1e-3)


@pytest.fixture(scope="module")
def mini(tmp_path_factory):
    """A tiny random Qwen2 with tiny/'s tokenizer (the task rule finds its 'reach') and MINI as its ngc.json."""
    path = write_checkpoint(tmp_path_factory.mktemp("mini"), vocab_size=1129, eos_token_id=2)
    shutil.copy(os.path.join(HERE, "tiny", "tokenizer.json"), path)
    with open(os.path.join(path, "ngc.json"), "w") as f:
        json.dump(MINI, f)
    return path


def variants(mini):
    return ["--variant", "paper", mini, "--variant", "joint", mini, "--mem-norm", "joint", "--mem-weight", "2"]


def files_and_times(out):
    return {str(p.relative_to(out)): p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()
            and p.name not in ("screen.md", "screen.jsonl")}


def test_screen_trains_each_run_once_tabulates_the_logs_and_a_rerun_trains_nothing(mini, tmp_path, capsys):
    """Two variants that differ only in L_mem: two ngc runs, one token-only run and one evaluation of
    the untrained model between them. The rows are the logs' numbers. A rerun starts no child; a run
    whose final evaluation is missing is resumed (train.py --resume), the rest left alone."""
    argv = ["--out", str(tmp_path), "--threads", "1", *variants(mini)]
    screen.main(argv)
    rows = [json.loads(line) for line in (tmp_path / "screen.jsonl").read_text().splitlines()]
    assert [(r["variant"], r["flags"]) for r in rows] == [("paper", ""), ("joint", "--mem-norm joint --mem-weight 2")]
    assert sorted(os.listdir(tmp_path / "runs")) == ["joint-ngc", "joint-ngc.log", "paper-ngc", "paper-ngc.log",
                                                     "paper-token-only", "paper-token-only.log"]
    assert sorted(os.listdir(tmp_path / "evals")) == ["paper-untrained.jsonl", "paper-untrained.jsonl.argv",
                                                      "paper-untrained.log"]
    saved = json.loads((tmp_path / "runs" / "joint-ngc" / "checkpoint" / "ngc.json").read_text())
    assert (saved["mode"], saved["mem_norm"], saved["mem_weight"], saved["term_grad_norms"]) == ("ngc", "joint", 2.0, True)
    log = rundir.read_log(str(tmp_path / "runs" / "joint-ngc" / "log.jsonl"))
    before, after = (next(r["eval"] for r in log if r.get("step") == s and "eval" in r) for s in (0, 2))
    joint = rows[1]
    assert (joint["full_before"], joint["eps_after"], joint["eps_after_se"]) == (before["pass1_full"], after["pass1"],
                                                                                 after["pass1_se"])
    assert joint["token_only_run"] == rows[0]["token_only_run"] == str(tmp_path / "runs" / "paper-token-only")
    assert (joint["problems"], joint["samples"]) == (3, 1) and 0 <= joint["zero_adv_groups"] <= 1
    table = (tmp_path / "screen.md").read_text()
    assert "| joint | " in table and "`--mem-norm joint --mem-weight 2`" in table and len(table.splitlines()) == 8
    first = files_and_times(tmp_path)
    capsys.readouterr()

    screen.main(argv)  # the same command again: every run and evaluation reused
    out = capsys.readouterr().out
    assert files_and_times(tmp_path) == first and "train.py" not in out and "eval.py" not in out
    assert out.count("reused") == 6 and (tmp_path / "screen.md").read_text() == table

    path = tmp_path / "runs" / "paper-ngc" / "log.jsonl"  # as if stopped before its final evaluation
    path.write_text("".join(line + "\n" for line in path.read_text().splitlines()[:-1]))
    screen.main(argv)
    out = capsys.readouterr().out
    assert f"train.py --resume {tmp_path / 'runs' / 'paper-ngc'} " in out and out.count("reused") == 5
    assert screen.finished(screen.plan(str(tmp_path), screen.split_variants(argv)[1], 1)[0].ngc)
    changed = {k for k, t in files_and_times(tmp_path).items() if first.get(k) != t}
    assert changed and all(k.startswith(os.path.join("runs", "paper-ngc")) for k in changed)


def test_a_row_s_diagnostics_are_the_means_over_the_ngc_run_s_steps(mini, tmp_path):
    """Hand-written logs: the zero-advantage share is the mean over steps, the gradient ratio the mean
    of per-step ratios over the steps with ‖∇L_token‖ > 0, the minutes the steps' time."""
    v = screen.plan(str(tmp_path), [["a", mini]], None)[0]
    steps = [(0.5, 2.0, 1.0, 30.0), (0.0, 3.0, 0.0, 60.0), (1.0, 1.0, 2.0, 90.0)]  # zero-adv, ‖∇L_mem‖, ‖∇L_token‖, s
    evals = [{"step": s, "eval": {"pass1_full": f, "pass1_full_se": 0.01, "pass1": e, "pass1_se": 0.02}}
             for s, f, e in [(0, 0.5, 0.1), (2, 0.75, 0.25)]]
    for run in (v.ngc, v.token_only):
        os.makedirs(run.dir)
        rundir.write_log(os.path.join(run.dir, "log.jsonl"), evals[0])
        for i, (zero, mem, tok, t) in enumerate(steps):
            rundir.write_log(os.path.join(run.dir, "log.jsonl"), {"step": i, "reward": 0.0, "zero_adv_groups": zero,
                                                                 "grad_norm_mem": mem, "grad_norm_token": tok,
                                                                 "step_time": t})
        rundir.write_log(os.path.join(run.dir, "log.jsonl"), evals[1])
    os.makedirs(os.path.dirname(v.evals))
    rows = [{"policy": p, "accuracy": a, "se": 0.03, "problems": 3, "samples": 1} for p, a in (("task-rule", 0.4),
                                                                                              ("random", 0.2))]
    (tmp_path / "evals" / "a-untrained.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "evals" / "a-untrained.jsonl.argv").write_text("\n".join([*v.eval_argv, "--out", v.evals]) + "\n")
    r = screen.row(v)
    assert r["zero_adv_groups"] == pytest.approx(0.5)  # (0.5 + 0 + 1) / 3
    assert r["grad_ratio"] == pytest.approx(1.25)  # (2/1 + 1/2) / 2: the step with ‖∇L_token‖ = 0 left out
    assert r["minutes"] == pytest.approx(3.0)  # (30 + 60 + 90) s
    assert (r["full_before"], r["full_after"], r["eps_before"], r["eps_after"]) == (0.5, 0.75, 0.1, 0.25)
    assert (r["token_only_eps_after"], r["task_rule"], r["random"], r["random_se"]) == (0.25, 0.4, 0.2, 0.03)
    assert "| a | " in screen.markdown([r]) and "50.0 → 75.0 ± 1.0 | 10.0 → 25.0 ± 2.0" in screen.markdown([r])


@pytest.mark.parametrize("specs, message", [
    ([], "give at least one --variant"),
    ([["a"]], "give --variant NAME MODEL_DIR"),
    ([["a", "/no/such/model"]], "variant a: no config.json in '/no/such/model'"),
    ([["a", "MINI"], ["a", "MINI", "--lr", "1e-4"]], "variant name 'a' is used twice"),
    ([["a b", "MINI"]], "must be letters, digits"),
    ([["a", "MINI", "--mode", "no-evict"]], "variant a: --mode is the screen's to set"),
    ([["a", "MINI", "--resume", "x"]], "variant a: --resume is the screen's to set"),
    ([["a", "MINI", "--lr", "-1"]], "variant a: --lr -1.0 must be positive"),
    ([["a", "MINI", "--no-such-flag"]], "variant a: unrecognized arguments: --no-such-flag"),
    ([["a", "MINI", "--retention", "0.9,0.75"]], "variant a: the screen compares Countdown's pass@1 over sampled completions at ε = 0.5; this run is countdown, eval_samples 1, evaluated at ε = 0.25 (add --eval-rate 0.5)"),
    ([["a", "MINI", "--data-seed", "3"]], "variant a: it holds out other problems"),
    ([["a", "MINI"], ["b", "MINI", "--mem-weight", "1"]], "variant b: the same run as variant a"),
])
def test_bad_variants_fail_in_one_line_before_anything_is_made(mini, tmp_path, specs, message):
    argv = ["--out", str(tmp_path / "out")] + [a for s in specs for a in ["--variant", *(mini if x == "MINI" else x
                                                                                       for x in s)]]
    with pytest.raises(SystemExit) as err:
        screen.main(argv)
    assert str(err.value).startswith("error: ") and message in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "out").exists()


def test_a_run_directory_with_other_settings_is_refused(mini, tmp_path):
    v = screen.plan(str(tmp_path), [["a", mini]], None)[0]
    os.makedirs(os.path.join(v.ngc.dir, "checkpoint"))
    with open(os.path.join(v.ngc.dir, "checkpoint", "ngc.json"), "w") as f:
        json.dump({**v.ngc.saved, "lr": 0.5}, f)
    with pytest.raises(SystemExit) as err:
        screen.main(["--out", str(tmp_path), "--variant", "a", mini])
    assert str(err.value) == (f"error: {v.ngc.dir} holds a run with other settings (lr 0.5 → 0.001); delete it to "
                              f"train it again, or give another --out")


def test_ctrl_c_lets_the_training_child_save_then_ends_in_one_line_with_130(mini, tmp_path):
    """SIGINT to the screen (as Ctrl-C sends it): its train.py child gets one SIGINT, saves its step and
    ends; the screen then exits 130 with one line, and the same command would resume that run."""
    run = tmp_path / "runs" / "a-ngc"
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "screen.py"), "--out", str(tmp_path), "--threads", "1",
                             "--variant", "a", mini, "--steps", "200"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        wait_for_log_lines(run / "log.jsonl", 3)  # the evaluation at step 0 and two steps
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:  # a child that did not end (in its own session, no signal of ours reaches it) is stopped here
        try:
            rundir.check_free(str(run))
        except ValueError:
            os.kill(int((run / "lock").read_text()), signal.SIGKILL)
    assert proc.returncode == 130 and err.splitlines() == [
        "interrupted: finished runs are kept, a run in progress saved its step; the same command continues"], out + err
    assert "saved step" in (tmp_path / "runs" / "a-ngc.log").read_text()
    assert rundir.load_trainer_state(str(run))["step"] >= 2
    rundir.check_free(str(run))  # the child has ended: nothing holds the run directory


def test_the_baselines_are_evaluated_on_the_runs_problem_preset(mini, tmp_path):
    """A variant trained on another preset than its model's ngc.json (--difficulty tiny-back) has its
    untrained baselines evaluated on that preset's held-out problems; one on the model's own passes none."""
    own, back = (screen.eval_argv(mini, screen.resolve(mini, flags, str(tmp_path / "run")))
                 for flags in ([], ["--difficulty", "tiny-back"]))
    assert back == own + ["--difficulty", "tiny-back"] and "--difficulty" not in own
