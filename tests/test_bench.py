"""bench.py: its checks; results/speed/profile_run.py: where a run's time went."""
import importlib.util
import os
import sys

import pytest

import bench

from conftest import Reached, one_line_error, reached, run_train

PROFILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results",
                       "speed", "profile_run.py")


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
    (["--held-out", "--model", "tiny-math"], "--model tiny-math was trained on math (its ngc.json), not countdown")])
def test_bench_checks_every_flag_before_it_runs(flags, message, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # not installed (an import raises ImportError)
    monkeypatch.setattr(bench, "bench", reached)
    monkeypatch.setattr(bench, "from_pretrained", reached)
    assert one_line_error(lambda: bench.main(flags)).startswith(f"error: {message}")
    with pytest.raises(Reached):  # the control: the defaults get to the benchmark
        bench.main(["--device", "cpu"])


def test_profile_sums_a_runs_logged_phases(train_ckpt, tmp_path, capsys):
    """results/speed/profile_run.py: the rollouts', replays' and evaluations' seconds are those train.py
    logged; a directory without a log is one line."""
    spec = importlib.util.spec_from_file_location("profile_run", PROFILE)
    profile_run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(profile_run)
    assert one_line_error(lambda: profile_run.main(["/no/such/run"])) == \
        "error: /no/such/run has no log.jsonl; give a run directory train.py wrote"
    log = run_train(train_ckpt, tmp_path / "run", "--steps", "2", "--eval-every", "2")
    steps, evals = [r for r in log if "reward" in r], [r for r in log if "eval" in r]
    for r in steps:
        assert 0 < r["rollout_time"] and 0 < r["replay_time"] and r["rollout_time"] + r["replay_time"] < r["step_time"]
    assert [r["step"] for r in evals] == [0, 2] and all(r["eval_time"] > 0 for r in evals)
    capsys.readouterr()

    def profiled():
        profile_run.main([str(tmp_path / "run")])
        return {line[:32].strip(): float(line[32:].split()[0]) for line in capsys.readouterr().out.splitlines()[1:]}

    rows = profiled()
    assert rows["rollouts"] == pytest.approx(sum(r["rollout_time"] for r in steps), abs=0.051)
    assert rows["replay fwd+bwd"] == pytest.approx(sum(r["replay_time"] for r in steps), abs=0.051)
    assert rows["rollouts"] + rows["replay fwd+bwd"] + rows["rest of the steps"] == pytest.approx(
        sum(r["step_time"] for r in steps), abs=0.11)
    assert rows["evaluation at step 2"] == pytest.approx(evals[1]["eval_time"], abs=0.051)
