"""Training (train.py, rundir.py): one step in each mode, resume, the checkpoint swap, signals,
the log, bad input, the math task and --meta-token end to end."""
import json
import math
import os
import shutil
import signal
import stat
import subprocess
import sys
from dataclasses import FrozenInstanceError, fields, replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import SafetensorError

from evaluation import scoring
from lib import checkpoint, files, rundir, settings, tasks
import eval as eval_script
import make_tiny
from lib import mathtask as mt
import train

from lib.checkpoint import META_TOKEN, add_meta_token, from_pretrained, load_tokenizer
from ngc import rollout
from tokenizers import Tokenizer, models

from conftest import SIGNAL_RUN, STEP_KEYS, TRAIN_DEFAULTS, parity_reward, run_train, save_small_checkpoint, wait_for_log_lines


# ---------------------------------------------------------------------------------------
# Modes and resume


@pytest.mark.parametrize("mode", list(train.MODES))
def test_one_training_step_in_each_mode(train_ckpt, tmp_path, mode):
    before = from_pretrained(train_ckpt).state_dict()
    flags = ["--mode", mode, "--steps", "1"] + (["--eval-every", "1"] if mode == "ngc" else [])
    log = run_train(train_ckpt, tmp_path, *flags)
    step = [r for r in log if "eval" not in r][0]
    assert list(step) == STEP_KEYS  # one schema for every step record
    assert math.isfinite(step["L_token"]) and math.isfinite(step["grad_norm"]) and step["grad_norm"] > 0
    assert 0 <= step["zero_adv_groups"] <= 1
    if mode == "ngc":
        assert math.isfinite(step["L_mem"]) and step["L_mem"] != 0
        assert step["rounds"] > 0 and len([r for r in log if "eval" in r]) == 2
    else:
        assert step["L_mem"] is None
    assert (step["rounds"] > 0) == (mode != "no-evict")
    after = from_pretrained(os.path.join(tmp_path, "checkpoint")).state_dict()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert len(changed) == len(before)  # every tensor moved (Adam's first step is ±lr everywhere)


# ---------------------------------------------------------------------------------------
# L_mem's normaliser (--mem-norm)


# Two rollouts, n_total = 4 of the step, max_new_tokens = 10, advantages 0.5 and -0.5; log p(σ) per
# round x layer: rollout 0 has 2 rounds, rollout 1 one (its second row is padding, 0).
HAND_EV_LP = torch.tensor([[[-1.0, -2.0], [-3.0, -4.0]],
                           [[-0.5, -1.5], [0.0, 0.0]]])
# paper (eq. 4): layer means over rounds, rollout 0: (-1-3)/2 + (-2-4)/2 = -5; rollout 1: -0.5 - 1.5 = -2
#   L_mem = -(0.5·(-5) + (-0.5)·(-2)) / 4 = 1.5/4 = 0.375
# joint: sums over rounds and layers, rollout 0: -10; rollout 1: -2
#   L_mem = -(0.5·(-10) + (-0.5)·(-2)) / (4·10) = 4/40 = 0.1
HAND_L_MEM = [("paper", 0.375), ("joint", 0.1)]


@pytest.mark.parametrize("norm, expected", HAND_L_MEM)
def test_l_mem_of_a_hand_built_batch_under_each_normaliser(monkeypatch, norm, expected):
    tok_lp = torch.tensor([[0.0, -1.0, -2.0, 0.0], [-0.5, -0.5, 0.0, 0.0]])
    monkeypatch.setattr(train, "replay", lambda *args, **kwargs: (tok_lp, HAND_EV_LP))
    ro = SimpleNamespace(n_rounds=torch.tensor([2, 1]))
    terms = train.policy_losses(None, ro, torch.tensor([0.5, -0.5]), train.MODES["ngc"], 10, 4, norm)
    l_token, l_mem = terms["L_token"], terms["L_mem"]
    assert l_mem.item() == pytest.approx(expected, abs=1e-7)  # float32
    assert l_token.item() == pytest.approx(1 / 40, abs=1e-9)  # -(0.5·(-3) + (-0.5)·(-1)) / 40: either norm


def test_l_mem_takes_the_eviction_advantages_when_given(monkeypatch):
    """--eviction-draws: L_mem weighs each rollout by adv_mem (here adv's negation), L_token by adv."""
    tok_lp = torch.tensor([[0.0, -1.0, -2.0, 0.0], [-0.5, -0.5, 0.0, 0.0]])
    monkeypatch.setattr(train, "replay", lambda *args, **kwargs: (tok_lp, HAND_EV_LP))
    ro = SimpleNamespace(n_rounds=torch.tensor([2, 1]))
    adv = torch.tensor([0.5, -0.5])
    terms = train.policy_losses(None, ro, adv, train.MODES["ngc"], 10, 4, "paper", adv_mem=-adv)
    assert terms["L_mem"].item() == pytest.approx(-0.375, abs=1e-7)  # HAND_L_MEM's paper, negated
    assert terms["L_token"].item() == pytest.approx(1 / 40, abs=1e-9)  # as with adv alone


def spy_on_step(monkeypatch) -> dict:
    """{"rollout", "backward": (args, kwargs) of train.py's first call to each}, calls passed on."""
    seen = {}
    spy = lambda f, key: lambda *a, **k: seen.setdefault(key, (a, k)) and f(*a, **k)
    for name in ("rollout", "backward"):
        monkeypatch.setattr(train, name, spy(getattr(train, name), name))
    return seen


def test_eviction_draws_share_token_noise_in_sets_and_compare_evictions_within_them(
        train_ckpt, tmp_path, monkeypatch):
    """--eviction-draws 2 with groups of 4: rows 2k and 2k+1 take row 2k's token noise, and L_mem's
    advantage of each is half its reward's difference from its partner's (adv gives r_i - r_j)."""
    seen = spy_on_step(monkeypatch)
    run_train(train_ckpt, tmp_path, "--steps", "1", "--eviction-draws", "2")
    assert seen["rollout"][1]["token_noise_rows"].tolist() == [0, 0, 2, 2, 4, 4, 6, 6]
    (_, _, adv, _, _, adv_mem), _ = seen["backward"]
    pair = (adv[0::2] - adv[1::2]) / 2
    assert torch.equal(adv_mem, torch.stack([pair, -pair], 1).flatten())
    assert not torch.equal(adv_mem, adv)


def test_full_cache_groups_roll_out_at_rate_zero_and_teach_the_tokens_alone(
        train_ckpt, tmp_path, monkeypatch):
    """--full-cache-groups 1 of 2 prompts: the last group's rows roll out at ε = 0 and their L_mem
    advantage is 0; the first group's rows evict at the step's ε and keep adv for L_mem."""
    seen = spy_on_step(monkeypatch)
    run_train(train_ckpt, tmp_path, "--steps", "1", "--full-cache-groups", "1")
    rates = seen["rollout"][1]["rates"]
    assert rates[4:].tolist() == [0.0] * 4
    assert (rates[:4] > 0).all() and len(set(rates[:4].tolist())) == 1  # the step's ε
    (_, _, adv, _, _, adv_mem), _ = seen["backward"]
    assert torch.equal(adv_mem[:4], adv[:4]) and torch.equal(adv_mem[4:], torch.zeros(4))
    assert adv[4:].abs().sum() > 0  # the control: the full-cache group still teaches its tokens


@pytest.mark.parametrize("norm", ["paper", "joint"])
def test_the_logged_losses_are_those_of_the_whole_batch(ckpt, sampled, norm):
    """train.backward in micro-batches of 2 logs each term as policy_losses gives it on the whole batch,
    under either normaliser; the two normalisers give different L_mem (the control)."""
    adv = torch.linspace(-1, 1, len(sampled.n_rounds))
    model = from_pretrained(ckpt)
    c = settings.Settings(mode="ngc", max_new_tokens=60, micro_batch=2, mem_norm=norm)
    logged = train.backward(model, sampled, adv, c)
    for name in ("paper", "joint"):
        whole = train.policy_losses(model, sampled, adv, train.MODES["ngc"], 60, len(adv), name)
        assert (logged["L_mem"] == pytest.approx(whole["L_mem"].item(), rel=1e-5)) == (name == norm)
        assert logged["L_token"] == pytest.approx(whole["L_token"].item(), rel=1e-5)


def test_mem_norm_is_saved_with_the_run_and_defaults_for_older_runs(train_ckpt, tmp_path):
    """ngc.json and trainer.pt keep --mem-norm, so a resume runs on with it; a run saved before it
    existed resumes with the default (eq. 4) and reports no change."""
    run_train(train_ckpt, tmp_path, "--steps", "1", "--mem-norm", "joint")
    assert json.loads((tmp_path / "checkpoint" / "ngc.json").read_text())["mem_norm"] == "joint"
    state = rundir.load_trainer_state(str(tmp_path))
    assert train.resolve(train.parse_args(["--resume", str(tmp_path), "--steps", "2"]), state).mem_norm == "joint"
    older = {**state, "config": {k: v for k, v in state["config"].items() if k != "mem_norm"}}
    c = train.resolve(train.parse_args(["--resume", str(tmp_path)]), older)
    assert c.mem_norm == "paper"
    assert rundir.changed_settings({**older["session"], **older["config"]}, settings.recorded(c)) == []


def test_resume_continues_exactly(train_ckpt, tmp_path):
    """A run stopped after step 1 and resumed (on the thread count it saved: no --threads given)
    ends bit for bit where the uninterrupted run does: weights and optimizer state."""
    straight = run_train(train_ckpt, tmp_path / "a", "--steps", "2")  # (run_train: --threads 1)
    run_train(train_ckpt, tmp_path / "b", "--steps", "1")
    torch.set_num_threads(2)
    try:
        train.main(["--resume", str(tmp_path / "b"), "--steps", "2"], reward_fn=parity_reward)
        assert torch.get_num_threads() == 1  # the run's own
    finally:
        torch.set_num_threads(1)
    resumed = rundir.read_log(str(tmp_path / "b" / "log.jsonl"))
    assert [r["step"] for r in resumed] == [0, 1]
    for key in ("reward", "L_token", "L_mem", "grad_norm", "response_len"):
        assert straight[1][key] == resumed[1][key], key
    a, b = (from_pretrained(str(tmp_path / run / "checkpoint")).state_dict() for run in "ab")
    assert all(torch.equal(a[k], b[k]) for k in a)
    opt_a, opt_b = (rundir.load_trainer_state(str(tmp_path / run))["optimizer"]["state"] for run in "ab")
    assert all(torch.equal(opt_a[i][k], opt_b[i][k]) for i in opt_a for k in opt_a[i])
    # Negative control: a different seed gives a different second step.
    other = run_train(train_ckpt, tmp_path / "c", "--steps", "2", "--seed", "5")
    assert abs(other[1]["L_token"] - straight[1]["L_token"]) > 1e-6


def test_a_resumed_run_s_final_table_starts_from_the_run_s_first_evaluation(train_ckpt, tmp_path, monkeypatch):
    """The before/after table compares the run's step-0 evaluation with its last, also when the
    last process resumed the run (it logged only the later ones)."""
    tables = []
    monkeypatch.setattr(train, "before_after", lambda evals, rate, seconds, *where: tables.append(list(evals)) or "")
    flags = ["--eval-every", "1", "--eval-problems", "2"]
    run_train(train_ckpt, tmp_path, "--steps", "1", *flags)
    log = run_train(train_ckpt, tmp_path, "--steps", "2", *flags, "--resume", str(tmp_path))
    assert [r["step"] for r in log if "eval" in r] == [0, 1, 2]
    assert tables[-1] == [r["eval"] for r in log if "eval" in r]


# ---------------------------------------------------------------------------------------
# Run directories and checkpoint saves


def run_dir_state(path):
    return {p.name: (p.read_bytes() if p.is_file() else sorted(q.name for q in p.iterdir())) for p in path.iterdir()}


def test_a_new_run_never_overwrites_another(train_ckpt, tmp_path):
    run_train(train_ckpt, tmp_path, "--steps", "1")
    before = run_dir_state(tmp_path)
    with pytest.raises(SystemExit) as err:
        run_train(train_ckpt, tmp_path, "--steps", "1")
    assert "already holds a run" in str(err.value) and "--resume" in str(err.value) and "\n" not in str(err.value)
    assert run_dir_state(tmp_path) == before  # nothing touched
    with pytest.raises(SystemExit) as err:  # --resume continues in place; another --out is refused
        train.main(["--resume", str(tmp_path), "--out", str(tmp_path / "elsewhere")])
    assert "drop --out" in str(err.value) and not (tmp_path / "elsewhere").exists()
    log = run_train(train_ckpt, tmp_path, "--steps", "1", "--seed", "3", "--overwrite")
    assert [r["step"] for r in log] == [0] and run_dir_state(tmp_path) != before


def test_a_kill_at_any_point_of_the_checkpoint_swap_leaves_a_checkpoint(train_ckpt, tmp_path, monkeypatch):
    """Kill the save before each rename (file or directory) it makes and before it deletes the old
    copy: resume then finds a complete checkpoint (the old step or the new one), and the next save
    works and leaves nothing behind."""
    class Killed(BaseException):  # not an Exception: a kill runs no handler (a failed save's cleanup neither)
        pass

    real_replace, calls = os.replace, []
    monkeypatch.setattr(os, "replace", lambda a, b: calls.append((a, b)) or real_replace(a, b))
    save_small_checkpoint(train_ckpt, tmp_path / "count", step=1)
    monkeypatch.undo()
    n_renames = len(calls)
    assert n_renames >= 5  # the files of the model directory, then the two directory renames
    for kill_at in range(n_renames + 2):  # the last two: killed after the last rename, before/while deleting
        run = tmp_path / f"kill{kill_at}"
        save_small_checkpoint(train_ckpt, run, step=1, scale=1.0)
        count = iter(range(10 ** 6))

        def dying_replace(a, b):
            if next(count) == kill_at:
                raise Killed
            real_replace(a, b)

        def dying_rmtree(path, ignore_errors=False):
            if os.path.exists(path):
                if kill_at == n_renames + 1:  # half deleted
                    next(p for p in Path(path).iterdir() if p.is_file()).unlink()
                raise Killed

        monkeypatch.setattr(os, "replace", dying_replace)
        monkeypatch.setattr(rundir.shutil, "rmtree", dying_rmtree)
        with pytest.raises(Killed):
            save_small_checkpoint(train_ckpt, run, step=2, scale=2.0)
        monkeypatch.undo()
        state = rundir.load_trainer_state(str(run))  # resume's first move: recover, then read
        back = from_pretrained(str(run / "checkpoint"))
        assert state["step"] in (1, 2)
        expected = 2.0 if state["step"] == 2 else 1.0
        assert torch.equal(back.lm_head.weight, from_pretrained(train_ckpt).lm_head.weight * expected)
        assert sorted(p.name for p in run.iterdir()) == ["checkpoint"]
        save_small_checkpoint(train_ckpt, run, step=3)
        assert rundir.load_trainer_state(str(run))["step"] == 3 and sorted(p.name for p in run.iterdir()) == ["checkpoint"]


def test_files_replaced_keep_the_permissions_others_read_them_by(train_ckpt, tmp_path):
    """A run directory made readable to a group (chmod -R g+rX) by a user whose umask is private (077): a
    resume rewrites log.jsonl and swaps in a new checkpoint/, each keeping the mode it had. The control:
    a new file gets the umask's mode."""
    run = tmp_path / "run"
    run_train(train_ckpt, run, "--steps", "1")
    for p in [run, *run.rglob("*")]:
        p.chmod(0o750 if p.is_dir() else 0o640)
    umask = os.umask(0o077)
    try:
        run_train(train_ckpt, run, "--resume", str(run), "--steps", "2")
        files.write_text(str(tmp_path / "new.txt"), "x")
    finally:
        os.umask(umask)
    assert rundir.load_trainer_state(str(run))["step"] == 2
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in [run / "checkpoint", *run.rglob("*")] if p.name != "lock"}
    assert modes == {name: 0o750 if (run / name).is_dir() or name == "checkpoint" else 0o640 for name in modes}
    assert stat.S_IMODE((tmp_path / "new.txt").stat().st_mode) == 0o600


# What each writer raises on a full disk (ENOSPC; EFBIG under a file size limit alike): none is an OSError
FULL_DISK = {"safetensors": lambda: SafetensorError("Error while serializing: I/O error: No space left on device "
                                                    "(os error 28)"),
             "torch.save": lambda: RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534"),
             "json": lambda: OSError(28, "No space left on device")}


@pytest.mark.parametrize("writer", list(FULL_DISK))
def test_a_failed_save_keeps_the_previous_checkpoint_and_a_periodic_one_lets_training_go_on(
        train_ckpt, tmp_path, monkeypatch, capsys, writer):
    """Step 1 saves; from then on the disk is full for one writer. The periodic save of step 2
    fails: one warning line, the checkpoint of step 1 kept, checkpoint.tmp/ gone, training goes
    on; the final save (step 3) fails: one error line, exit status 2, the same checkpoint kept.
    A resume once there is room continues from step 1."""
    real = {"safetensors": checkpoint.save_file, "torch.save": torch.save, "json": files.write_text}
    name = {"safetensors": (checkpoint, "save_file"), "torch.save": (torch, "save"), "json": (files, "write_text")}

    def full(*args, **kwargs):  # a checkpoint's file, once the first checkpoint is in place
        if "checkpoint.tmp" in str(args[1 if writer != "json" else 0]) and (tmp_path / "checkpoint").exists():
            raise FULL_DISK[writer]()
        return real[writer](*args, **kwargs)

    monkeypatch.setattr(*name[writer], full)
    with pytest.raises(SystemExit) as err:
        run_train(train_ckpt, tmp_path, "--steps", "3", "--save-every", "1")
    monkeypatch.undo()
    out, message = capsys.readouterr().out, str(err.value)
    warning = [line for line in out.splitlines() if line.startswith("warning:")]
    assert len(warning) == 1 and warning[0].startswith("warning: could not save step 2: writing ")
    assert "the checkpoint of step 1 is kept" in warning[0] and warning[0].endswith("training goes on")
    assert message.startswith("error: could not save step 3: writing ") and "\n" not in message
    assert f"the checkpoint of step 1 is kept in {tmp_path}/checkpoint" in message
    assert f"continue with --resume {tmp_path}" in message and FULL_DISK[writer]().__class__.__name__ in message
    assert rundir.load_trainer_state(str(tmp_path))["step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint", "lock", "log.jsonl"]
    assert [r["step"] for r in rundir.read_log(str(tmp_path / "log.jsonl"))] == [0, 1, 2]  # training went on
    log = run_train(train_ckpt, tmp_path, "--resume", str(tmp_path), "--steps", "3")
    assert [r["step"] for r in log] == [0, 1, 2] and rundir.load_trainer_state(str(tmp_path))["step"] == 3


FULL_DISK_RUN = ("import resource, signal, sys, train; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
                 "limit = int(sys.argv.pop(1)); resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)); " + SIGNAL_RUN)


@pytest.mark.skipif(not hasattr(signal, "SIGXFSZ"), reason="file size limits are POSIX")
@pytest.mark.parametrize("fails", ["model.safetensors", "trainer.pt"])
def test_a_save_past_a_real_file_size_limit_keeps_the_previous_checkpoint(train_ckpt, tmp_path, fails):
    """A real write failure (EFBIG under RLIMIT_FSIZE, what a full disk does to each writer):
    safetensors' or torch.save's own error. The resumed run trains on past the failed periodic
    save, then exits 1 with one line at the final save; nothing half-written is left."""
    run_train(train_ckpt, tmp_path, "--steps", "1")
    sizes = {p.name: p.stat().st_size for p in (tmp_path / "checkpoint").iterdir()}
    small = max(v for k, v in sizes.items() if k not in ("model.safetensors", "trainer.pt"))
    assert small < sizes["model.safetensors"] < sizes["trainer.pt"]
    limit = (max(small, sizes["model.safetensors"] // 2) if fails == "model.safetensors"
             else (sizes["model.safetensors"] + sizes["trainer.pt"]) // 2)
    before = run_dir_state(tmp_path / "checkpoint")
    proc = subprocess.run([sys.executable, "-c", FULL_DISK_RUN, str(limit), "--resume", str(tmp_path),
                           "--steps", "3", "--save-every", "1", "--threads", "1"],
                          cwd=os.path.dirname(train.__file__), capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "Traceback" not in out, out
    error = proc.stderr.strip()
    assert error.startswith("error: could not save step 3: writing ") and "\n" not in error, out
    assert {"model.safetensors": "SafetensorError", "trainer.pt": "RuntimeError"}[fails] in error
    assert f"writing {'config.json and ' * (fails == 'model.safetensors')}{fails} in " in error
    assert f"the checkpoint of step 1 is kept in {tmp_path}/checkpoint" in error
    assert "warning: could not save step 2" in proc.stdout and "step 3/3" in proc.stdout
    assert run_dir_state(tmp_path / "checkpoint") == before  # the checkpoint of step 1, byte for byte
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint", "lock", "log.jsonl"]


# ---------------------------------------------------------------------------------------
# Signals and the log


@pytest.mark.parametrize("sig, code, resume", [(signal.SIGTERM, 143, True), (signal.SIGINT, 130, False),
                                               (signal.SIGHUP, 129, False)])
def test_a_signal_saves_and_exits_nonzero_and_resume_continues_exactly(train_ckpt, tmp_path, sig, code, resume):
    """SIGTERM (a scheduler), SIGINT (Ctrl-C) and SIGHUP (a closed terminal or ssh session) alike: the
    state of the steps taken is saved, and a resume takes exactly the steps an uninterrupted run would
    (checked after SIGTERM: one handler serves the three)."""
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", SIGNAL_RUN, "--model", train_ckpt, "--out", str(run),
                             "--threads", "1", "--steps", "200"], cwd=os.path.dirname(train.__file__),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(sig, signal.SIG_DFL))  # even under nohup
    wait_for_log_lines(run / "log.jsonl", 2)
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == code, out
    assert "Traceback" not in out and f"continue with --resume {run}" in out
    saved = rundir.load_trainer_state(str(run))["step"]
    logged = [r["step"] for r in rundir.read_log(str(run / "log.jsonl"))]
    assert 2 <= saved < 200 and logged == list(range(saved))  # the checkpoint and the log agree
    if not resume:
        return
    resumed = run_train(train_ckpt, run, "--resume", str(run), "--steps", str(saved + 2))
    straight = run_train(train_ckpt, tmp_path / "straight", "--steps", str(saved + 2))
    assert len(resumed) == len(straight) == saved + 2
    for a, b in zip(resumed, straight):
        for key in ("reward", "L_token", "L_mem", "response_len"):
            assert a[key] == pytest.approx(b[key], abs=1e-6), (a["step"], key)


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGXCPU])
def test_a_scheduler_s_warning_signal_saves_and_stops_the_run(train_ckpt, tmp_path, sig):
    """SLURM's --signal=USR1@N before its time limit, SIGXCPU at a CPU-time limit: by default each ends the
    process at once, the steps since the last checkpoint lost; here the run saves and stops in one line."""
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", SIGNAL_RUN, "--model", train_ckpt, "--out", str(run),
                             "--threads", "1", "--steps", "200", "--save-every", "0"],
                            cwd=os.path.dirname(train.__file__), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    wait_for_log_lines(run / "log.jsonl", 2)
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=60)
    saved = rundir.load_trainer_state(str(run))["step"]
    assert proc.returncode == 128 + sig and out.strip().endswith(
        f"{signal.Signals(sig).name}: saved step {saved} to {run}/checkpoint; continue with --resume {run}"), out
    assert [r["step"] for r in rundir.read_log(str(run / "log.jsonl"))] == list(range(saved)) and saved >= 2


def test_a_run_started_ignoring_sighup_goes_on_through_it(train_ckpt, tmp_path):
    """Under nohup (SIGHUP ignored from the start) a closed terminal does not stop the run; the control,
    SIGTERM, still saves and stops it."""
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", SIGNAL_RUN, "--model", train_ckpt, "--out", str(run), "--threads",
                             "1", "--steps", "200"], cwd=os.path.dirname(train.__file__), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    try:
        wait_for_log_lines(run / "log.jsonl", 2)
        proc.send_signal(signal.SIGHUP)
        steps = len((run / "log.jsonl").read_text().splitlines())
        wait_for_log_lines(run / "log.jsonl", steps + 2)
        assert proc.poll() is None  # still training
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 143 and f"continue with --resume {run}" in out, out
    assert rundir.load_trainer_state(str(run))["step"] >= steps + 2


def test_a_run_killed_before_its_first_save_starts_again_by_the_same_command(train_ckpt, tmp_path):
    """SIGKILL (the OOM killer, a lost node) before any checkpoint: the run directory holds a log and the
    lock, nothing to resume (--resume says so); the same command starts the run again there."""
    run = tmp_path / "run"
    command = ["--model", train_ckpt, "--out", str(run), "--threads", "1", "--steps", "6", "--save-every", "0"]
    proc = subprocess.Popen([sys.executable, "-c", SIGNAL_RUN, *command], cwd=os.path.dirname(train.__file__),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for_log_lines(run / "log.jsonl", 2)
    proc.kill()
    proc.wait()
    assert sorted(p.name for p in run.iterdir()) == ["lock", "log.jsonl"]
    with pytest.raises(SystemExit) as err:
        train.main(["--resume", str(run)])
    assert str(err.value) == (f"error: nothing to resume in '{run}': it has no checkpoint/trainer.pt (a run that "
                              f"never saved starts again by its own command)")
    train.main(command, reward_fn=parity_reward)  # the same command
    assert [r["step"] for r in rundir.read_log(str(run / "log.jsonl"))] == list(range(6))
    (run / "notes.txt").write_text("mine")  # the control: files not a run's are never taken
    shutil.rmtree(run / "checkpoint")
    with pytest.raises(SystemExit) as err:
        train.main(command)
    assert str(err.value) == f"error: {run} holds files that are not a run's (notes.txt); choose another --out"


@pytest.mark.parametrize("script", ["train", "eval"])
def test_a_console_that_goes_away_costs_only_its_lines(train_ckpt, tmp_path, script):
    """stdout a pipe whose reader is gone (`| head`, a closed terminal): the run trains to its end and
    saves, eval.py writes its --out; the lines are lost, nothing else, and the exit code is 0."""
    command = {"train": [SIGNAL_RUN, "--model", train_ckpt, "--out", str(tmp_path / "run"), "--threads", "1",
                         "--steps", "2"],
               "eval": ["import sys; sys.path.insert(0, 'scripts'); import eval; eval.main()", "--model", train_ckpt,
                        "--policy", "none", "ngc", "--problems", "2", "--samples", "0", "--out",
                        str(tmp_path / "rows.jsonl")]}[script]
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line
    proc = subprocess.run([sys.executable, "-c", *command], cwd=os.path.dirname(train.__file__), stdout=write,
                          stderr=subprocess.PIPE, text=True, timeout=300)
    os.close(write)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    if script == "train":
        assert rundir.load_trainer_state(str(tmp_path / "run"))["step"] == 2
    else:
        assert len((tmp_path / "rows.jsonl").read_text().splitlines()) == 2


def cuda_runs_out():  # what CUDA raises (no GPU here: its exception, as torch words it)
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.1 GiB total)")


OUT_OF_MEMORY = [(cuda_runs_out, "OutOfMemoryError: CUDA out of memory"),
                 (lambda: torch.empty(2 ** 60, dtype=torch.uint8),  # the CPU's allocator, for real
                  "CPU: can't allocate memory: you tried to allocate 1152921504606846976 bytes"),
                 (lambda: bytearray(2 ** 60), "MemoryError")]


@pytest.mark.parametrize("run_out, says", OUT_OF_MEMORY, ids=["cuda", "cpu", "python"])
def test_out_of_memory_saves_the_steps_taken_and_stops_in_one_line(train_ckpt, tmp_path, monkeypatch, run_out,
                                                                   says):
    """Out of memory in a step (on CUDA, in the CPU's allocator, in Python; at the third step's
    rollout): the state after the steps taken is saved, one line says what to lower, and a resume
    goes on from there."""
    calls = []

    def rollout_until_memory_runs_out(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            run_out()
        return rollout(*args, **kwargs)

    monkeypatch.setattr(train, "rollout", rollout_until_memory_runs_out)
    with pytest.raises(SystemExit) as err:
        run_train(train_ckpt, tmp_path, "--steps", "4")
    assert str(err.value) == (f"error: out of memory in step 3 ({says}); saved step 2 to "
                              f"{tmp_path}/checkpoint; lower --micro-batch (or --group, --max-new-tokens), then "
                              f"continue with --resume {tmp_path}")
    monkeypatch.undo()
    log = run_train(train_ckpt, tmp_path, "--resume", str(tmp_path))
    assert [r["step"] for r in log] == [0, 1, 2, 3]


def test_two_runs_on_one_run_directory_one_trains_the_other_stops_in_one_line(train_ckpt, tmp_path):
    """Two runs started at the same instant on one --out: one trains, the other exits 1 with one
    line naming the process that holds the directory, having written nothing (each step is logged
    once). A new run or a --resume there meanwhile is refused alike, before it touches anything.
    The winner killed with SIGKILL leaves no stuck lock: --resume then continues."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-c", SIGNAL_RUN, "--model", train_ckpt, "--out", str(run), "--threads", "1",
           "--steps", "200", "--save-every", "1"]
    procs = [subprocess.Popen(cmd, cwd=os.path.dirname(train.__file__), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        wait_for_log_lines(run / "log.jsonl", 3, timeout=120)
        winner = next(p for p in procs if f"{p.pid}\n" == (run / "lock").read_text())  # it wrote its id there
        loser = procs[1 - procs.index(winner)]
        out, err = loser.communicate(timeout=120)
        assert loser.returncode == 2 and winner.poll() is None, out + err
        assert err.strip() == (f"error: {run} is in use: process {winner.pid} is training there (it holds {run}/lock); "
                               f"wait for it to end or stop it, or choose another --out"), out + err
        assert "Traceback" not in out + err and "NGC on" not in out  # stopped before its banner
        for argv in (["--resume", str(run)], ["--model", train_ckpt, "--out", str(run)]):
            with pytest.raises(SystemExit) as stopped:
                train.main(argv + ["--threads", "1"])
            assert str(stopped.value) == err.strip()
        wait_for_log_lines(run / "log.jsonl", 5, timeout=120)
    finally:
        for p in procs:
            p.kill()
            p.communicate()
    steps = [r["step"] for r in rundir.read_log(str(run / "log.jsonl"))]
    assert steps == list(range(len(steps))) and len(steps) >= 5  # every step once
    saved = rundir.load_trainer_state(str(run))["step"]
    log = run_train(train_ckpt, run, "--resume", str(run), "--steps", str(saved + 1))
    assert [r["step"] for r in log] == list(range(saved + 1))


def test_resume_drops_a_cut_last_log_line_and_refuses_a_bad_middle_one(train_ckpt, tmp_path, capsys):
    run_train(train_ckpt, tmp_path, "--steps", "1", "--save-every", "1")
    log = tmp_path / "log.jsonl"
    log.write_text(log.read_text() + '{"step": 1, "rew')  # a crash in the middle of a write
    resumed = run_train(train_ckpt, tmp_path, "--resume", str(tmp_path), "--steps", "2")
    assert [r["step"] for r in resumed] == [0, 1] and "unfinished last line" in capsys.readouterr().out
    log.write_text("garbage\n" + log.read_text())
    with pytest.raises(SystemExit) as err:
        run_train(train_ckpt, tmp_path, "--resume", str(tmp_path), "--steps", "3")
    assert "log.jsonl line 1 is not a record" in str(err.value) and "\n" not in str(err.value)


def test_log_is_strict_json_and_plain_lines_without_a_terminal(train_ckpt, tmp_path, capsys):
    """Not a terminal (pytest captures): no progress bars, one plain line per step and per
    evaluation; every log record parses as strict JSON (no NaN) with the step schema."""
    run_train(train_ckpt, tmp_path, "--steps", "2", "--eval-every", "1", "--eval-problems", "2")
    out, err = capsys.readouterr()
    assert "\r" not in out + err and "\x1b" not in out + err and "it/s" not in err
    assert [line.split(" |")[0] for line in out.splitlines() if line.startswith("step ")] == ["step 1/2", "step 2/2"]
    assert sum(line.startswith("eval @ step") for line in out.splitlines()) == 3

    def no_constants(name):
        raise ValueError(f"{name} in log")

    records = [json.loads(line, parse_constant=no_constants) for line in open(tmp_path / "log.jsonl")]
    assert [list(r) for r in records if "eval" not in r] == [STEP_KEYS] * 2
    assert rundir.json_safe({"a": float("nan"), "b": {"c": float("inf")}, "d": 1.5}) == {"a": None, "b": {"c": None},
                                                                                         "d": 1.5}


# ---------------------------------------------------------------------------------------
# Bad input, and --help


def break_file(path, how):
    if how == "empty":
        path.write_bytes(b"")
    elif how == "truncated":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    else:
        path.write_text(how)


BAD_TRAIN_FLAGS = [
    (["--stage-steps", "0"], "--stage-steps 0 must be at least 1"), (["--train-problems", "0"], "at least 1"),
    (["--micro-batch", "0"], "--micro-batch 0 must be at least 1"), (["--max-new-tokens", "0"], "at least 1"),
    (["--temperature", "0"], "--temperature 0.0 must be positive"), (["--alpha", "1.5"], "must lie in (0, 1]"),
    (["--eval-batch", "0"], "at least 1"), (["--lr", "-1"], "--lr -1.0 must be positive"),
    (["--steps", "-3"], "--steps -3 must be at least 1"), (["--eval-problems", "0"], "at least 1"),
    (["--device", "foo"], "--device 'foo' is not a device"), (["--retention", "0.9,x"], "comma-separated numbers"),
    (["--retention", "1.5,0.5"], "--retention 1.5,0.5: stage 1, 1.5, must lie in [0, 1)"),
    (["--retention", "0.9,1.5,0.5"], "--retention 0.9,1.5,0.5: stage 2, 1.5, must lie in [0, 1)"),  # a middle one
    (["--interoception", "--interoception-rates", "0.25,0,0.75"], "--interoception-rates 0.25,0,0.75: rate 2, 0,"),
    (["--delta", "2"], "larger than the window"),
    (["--group", "1"], "--group"), (["--beta2", "1"], "must lie in [0, 1)"), (["--threads", "0"], "at least 1"),
    (["--steps", "x"], "invalid int value"), (["--adam-eps", "0"], "--adam-eps 0.0 must be positive"),
    (["--mem-norm", "mean"], "invalid choice: 'mean'"),
    (["--eviction-temperature", "0"], "--eviction-temperature 0.0 must be positive"),
    (["--eviction-draws", "3"], "--eviction-draws 3 must divide --group 4"),
    (["--eviction-draws", "2", "--mode", "no-evict"], "--eviction-draws needs a mode with an eviction loss"),
    (["--full-cache-groups", "2"], "--full-cache-groups 2 must be below --prompts 2"),
    (["--full-cache-groups", "1", "--mode", "no-evict"], "--full-cache-groups sets some groups' ε to 0"),
] + ([] if torch.cuda.is_available() else [(["--device", "cuda"], "no CUDA GPU is visible")])
BAD_FILES = [("model.safetensors", "empty", "not a readable safetensors file"),
             ("model.safetensors", "truncated", "not a readable safetensors file"),
             ("tokenizer.json", "{not json", "not a readable tokenizer"),
             ("config.json", "{not json", "config.json is not valid JSON"),
             ("config.json", '{"model_type": "qwen2", "vocab_size": 96}', "config.json lacks hidden_size"),
             ("ngc.json", "[1, 2", "ngc.json is not valid JSON"),
             ("tokenizer_config.json", "{not json", "tokenizer_config.json is not valid JSON"),
             ("tokenizer.json", Tokenizer(models.WordLevel({f"w{i}": i for i in range(120)}, unk_token="w0")).to_str(),
              "tokenizer.json has token ids up to 119, but")]  # another model's: more ids than rows


@pytest.mark.parametrize("flags, message", BAD_TRAIN_FLAGS, ids=[" ".join(f) for f, _ in BAD_TRAIN_FLAGS])
def test_bad_training_flags_fail_with_one_line_and_create_nothing(train_ckpt, tmp_path, flags, message):
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as err:
        train.main(["--model", train_ckpt, "--out", str(out), *flags])
    assert str(err.value).startswith("error: ") and message in str(err.value) and "\n" not in str(err.value)
    assert not out.exists()


@pytest.mark.parametrize("file, how, message", BAD_FILES, ids=[f"{f} {h[:9]}".replace("/", "") for f, h, _ in BAD_FILES])
def test_broken_checkpoint_files_fail_with_one_line_and_create_nothing(train_ckpt, tmp_path, file, how, message):
    model, out = tmp_path / "model", tmp_path / "run"
    shutil.copytree(train_ckpt, model)
    break_file(model / file, how)
    with pytest.raises(SystemExit) as err:
        train.main(["--model", str(model), "--out", str(out)])
    assert str(err.value).startswith("error: ") and message in str(err.value) and "\n" not in str(err.value)
    assert not out.exists()


def test_bad_resume_and_run_dirs_fail_with_one_line(train_ckpt, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the last case uses the default --out, runs/ngc, which must not hold a run
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    run_train(train_ckpt, tmp_path / "run", "--steps", "1")
    break_file(tmp_path / "run" / "checkpoint" / "trainer.pt", "truncated")
    cases = [(["--model", train_ckpt, "--out", str(a_file)], "is a file"),
             (["--resume", str(tmp_path / "none")], "nothing to resume"),
             (["--resume", str(tmp_path / "run")], "trainer.pt is unreadable"),
             (["--model", str(tmp_path / "none")], "no config.json")]
    if os.path.isdir("/proc/self"):  # a directory no one can create (as root, os.makedirs is what refuses)
        cases.append((["--model", train_ckpt, "--out", "/proc/ngc-run"], "run directory /proc/ngc-run"))
    for argv, message in cases:
        with pytest.raises(SystemExit) as err:
            train.main(argv)
        assert str(err.value).startswith("error: ") and message in str(err.value) and "\n" not in str(err.value)


class Payload:
    """A pickle that, loaded, would create the file `marker`: what a stranger's trainer.pt can carry."""
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_a_trainer_state_that_would_run_code_is_refused_and_not_run(train_ckpt, tmp_path):
    run_train(train_ckpt, tmp_path / "run", "--steps", "1")
    path, marker = tmp_path / "run" / "checkpoint" / "trainer.pt", tmp_path / "ran"
    state = torch.load(path, weights_only=True)
    torch.save({**state, "session": {"model": Payload(marker)}}, path)
    with pytest.raises(SystemExit) as err:
        train.main(["--resume", str(tmp_path / "run")])
    assert "trainer.pt holds more than tensors and numbers" in str(err.value) and "\n" not in str(err.value)
    assert rundir.saved_step(tmp_path / "run") is None  # reproduce.py's check: unreadable, not run
    assert not marker.exists()
    torch.load(path, weights_only=False)  # the control: loaded as a pickle, it runs
    assert marker.exists()


def test_help_shows_the_checkpoints_defaults(train_ckpt, capsys):
    with pytest.raises(SystemExit):
        train.parse_args(["--model", train_ckpt, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"(default {TRAIN_DEFAULTS['delta']})" in text and "(default 0.75,0.5)" in text  # ngc.json's, not the paper's
    with pytest.raises(SystemExit):
        train.parse_args(["--help"])
    assert f"(default {make_tiny.TINY_RUN['steps']})" in capsys.readouterr().out


def test_each_setting_is_defined_once(train_ckpt, tmp_path, capsys):
    """settings.py is the one definition: every setting but eval.py's three has a flag in --help,
    the modes it offers are train.MODES, and a run saves every setting but where and how it runs
    (--threads among them, so a resume runs on as many threads), which read back to the same values."""
    with pytest.raises(SystemExit):
        train.parse_args(["--model", train_ckpt, "--help"])
    text = capsys.readouterr().out
    flags = list(settings.HELP)
    assert sorted(flags + ["eval_temperature", "eval_top_p", "eval_max_new_tokens"]) == sorted(settings.TYPES)
    assert all(f"--{name.replace('_', '-')} " in text for name in flags) and "--eval-top-p" not in text
    assert settings.CHOICES["mode"] == list(train.MODES)
    c = train.resolve(train.parse_args(["--model", train_ckpt, "--out", str(tmp_path / "run"), "--threads", "1",
                                        "--retention", "0.8,0.6"]))
    saved = settings.saved(c)
    assert list(saved) == settings.SAVED and saved["threads"] == 1 and saved["retention"] == "0.8,0.6"
    assert "model" not in saved and "out" not in saved and "resume" not in saved
    back = settings.from_dict(saved)
    assert all(getattr(back, k) == getattr(c, k) for k in settings.SAVED) and back.retention == (0.8, 0.6)
    assert settings.from_dict({**saved, "retention": "0.8,0.5"}).retention != c.retention  # control
    with pytest.raises(FrozenInstanceError):  # settings are read, never changed in place
        c.lr = 1.0


# ---------------------------------------------------------------------------------------
# The math task (§5.4) through train.py and eval.py


def test_train_and_eval_run_the_math_task_end_to_end(train_ckpt, tmp_path, monkeypatch):
    """`train.py --task math` on the demo set in DAPO's layout: the paper's math recipe underneath
    (here shrunk), one step with the boxed-answer reward and the min-length penalty, an evaluation;
    `eval.py --task math` then gives pass@k for NGC and a baseline."""
    mt.make_demo(tmp_path / "data", n_train=8, n_test=3)
    data, held_out = str(tmp_path / "data" / "train.jsonl"), str(tmp_path / "data" / "test.jsonl")
    d = settings.run_defaults(train_ckpt, "math")
    assert (d.delta, d.max_new_tokens, d.prompts, d.group, d.steps) == (8, 24, 2, 4, 469)  # ngc.json wins
    assert (settings.MATH.delta, settings.MATH.min_length, settings.MATH.top_k, settings.MATH.beta2) == (350, 350, 0, 0.999)
    calls = []
    monkeypatch.setitem(tasks.TASK_REWARD, "math", lambda text, p: calls.append(p) or float(sum(map(ord, text)) % 2))
    log = run_train_task(train_ckpt, tmp_path / "run", "--task", "math", "--data", data, "--eval-data", held_out,
                         "--steps", "1", "--eval-every", "1", "--min-length", "20")
    step = [r for r in log if "eval" not in r][0]
    assert isinstance(calls[0], mt.Problem) and step["L_mem"] is not None
    assert json.loads((tmp_path / "run" / "checkpoint" / "ngc.json").read_text())["task"] == "math"
    for task in ("countdown", None):  # the math run's checkpoint, for Countdown: refused; with no --task it is math
        argv = ["--model", str(tmp_path / "run" / "checkpoint"), "--out", str(tmp_path / "cd"), "--eval-every", "0"]
        with pytest.raises(SystemExit) as err:
            train.main(argv + (["--task", task] if task else ["--data", "/no/such.jsonl"]))
        message = str(err.value)
        assert "\n" not in message and not (tmp_path / "cd").exists()
        assert message == (f"error: --model {tmp_path}/run/checkpoint was trained on math (its ngc.json), not "
                           f"countdown: give a countdown model, such as {os.path.relpath(settings.HERE + '/tiny')}, "
                           f"or a copy of {tmp_path}/run/checkpoint without ngc.json to start from its weights" if task
                           else "error: no such file: /no/such.jsonl")
    monkeypatch.setattr(scoring, "rollout", counting_rollout(seen := []))
    eval_script.main(["--model", str(tmp_path / "run" / "checkpoint"), "--policy", "none", "ngc", "knorm", "--samples", "2",
             "--out", str(tmp_path / "math.jsonl")])
    rows = [json.loads(line) for line in (tmp_path / "math.jsonl").read_text().splitlines()]
    assert [r["policy"] for r in rows] == ["none", "ngc", "knorm"] and all(set(r["pass_at_k"]) == {"1", "2"} for r in rows)
    s = seen[0]
    assert (s.temperature, s.top_p) == (0.6, 0.95)  # the paper's math evaluation (its cap is ngc.json's here)
    assert s.max_new_tokens == TRAIN_DEFAULTS["eval_max_new_tokens"] and settings.MATH.eval_max_new_tokens == 3850


def run_train_task(ckpt, out, *flags):
    train.main(["--model", ckpt, "--out", str(out), "--threads", "1", *flags])
    return rundir.read_log(os.path.join(out, "log.jsonl"))


def counting_rollout(seen):
    def wrapped(model, prompts, sampling, eviction=None, **kw):
        seen.append(sampling)
        return rollout(model, prompts, replace(sampling, max_new_tokens=8), eviction, **kw)
    return wrapped


@pytest.mark.parametrize("flags, message", [
    (["--task", "math"], "--task math reads its problems from files"),
    (["--task", "math", "--data", "/no/such.jsonl", "--eval-every", "0"], "no such file: /no/such.jsonl"),
    (["--task", "math", "--data", "x.jsonl", "--eval-every", "0", "--interoception"], "has no such tag"),
    (["--top-p", "0"], "--top-p 0.0 must lie in (0, 1]"),
    (["--blind-tag"], "add --interoception")])
def test_bad_math_flags_fail_with_one_line(train_ckpt, tmp_path, flags, message):
    with pytest.raises(SystemExit) as err:
        train.main(["--model", train_ckpt, "--out", str(tmp_path / "run"), *flags])
    assert str(err.value).startswith("error: ") and message in str(err.value) and "\n" not in str(err.value)


def break_data(good, bad, how):
    """bad: the demo file good made empty, not UTF-8 (Latin-1 text), or with a row without its answer."""
    text = good.read_bytes()
    if how == "empty":
        bad.write_bytes(b"")
    elif how == "not UTF-8":
        bad.write_bytes(text.replace(b"marbles", "marbl\u00e9s".encode("latin-1"), 1))
    else:
        rows = [json.loads(line) for line in text.splitlines()]
        del rows[1]["reward_model"]
        bad.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.parametrize("flag, how, says", [("--data", "empty", ""), ("--data", "not UTF-8", "UTF-8"),
                                             ("--eval-data", "no answer", "answer")])
def test_a_bad_math_data_file_fails_in_one_line_before_the_run_directory_is_made(train_ckpt, tmp_path, flag, how, says):
    """The data files are read and checked before --out is created: the error names the file, and
    the corrected command then runs in the same --out (no half-made run stands in its way)."""
    mt.make_demo(tmp_path / "data", n_train=8, n_test=3)
    files = {"--data": tmp_path / "data" / "train.jsonl", "--eval-data": tmp_path / "data" / "test.jsonl"}
    bad = tmp_path / "bad.jsonl"
    break_data(files[flag], bad, how)
    run = tmp_path / "run"
    argv = lambda data: ["--task", "math", "--steps", "1", "--eval-every", "1",
                         *(a for f, path in files.items() for a in (f, str(data if f == flag else path)))]
    with pytest.raises(SystemExit) as err:
        run_train_task(train_ckpt, run, *argv(bad))
    message = str(err.value)
    assert message.startswith(f"error: {bad}") and says in message and "\n" not in message, message
    assert not run.exists()
    log = run_train_task(train_ckpt, run, *argv(files[flag]))  # the corrected command
    assert [r["step"] for r in log if "eval" not in r] == [0]


# ---------------------------------------------------------------------------------------
# --meta-token (Appendix)


def test_train_meta_token_saves_g_and_eval_forces_it(train_ckpt, tmp_path, monkeypatch):
    """--meta-token: g is added at load, forced in the training and held-out rollouts, saved with the
    checkpoint (model, tokenizer, ngc.json), and eval.py forces it from the checkpoint's setting.
    A second load leaves the (possibly trained) row alone. Control: without the flag, no g anywhere."""
    seen = []

    def recording(model, prompts, sampling, eviction=None, **kw):
        ro = rollout(model, prompts, sampling, eviction, **kw)
        seen.append((sampling.meta_token, eviction is not None, bool(ro.forced.any())))
        return ro

    monkeypatch.setattr(train, "rollout", recording)
    monkeypatch.setattr(scoring, "rollout", recording)
    run_train(train_ckpt, tmp_path / "run", "--meta-token", "--steps", "1", "--eval-every", "1")
    out = str(tmp_path / "run" / "checkpoint")
    back, tok = from_pretrained(out), load_tokenizer(out)
    g = tok.token_to_id(META_TOKEN)
    assert g == 96 and back.config.vocab_size == 97 and json.loads(Path(out, "ngc.json").read_text())["meta_token"]
    assert all(meta == g for meta, _, _ in seen) and len(seen) == 9  # 2 evals (greedy and sampled, full and ε) and a step
    assert all(forced == evicting for _, evicting, forced in seen)
    row = back.model.embed_tokens.weight[g].clone()
    assert add_meta_token(back, tok) == g and torch.equal(back.model.embed_tokens.weight[g], row)
    seen.clear()
    eval_script.main(["--model", out, "--policy", "none", "ngc", "--problems", "2"])
    assert [meta for meta, _, _ in seen] == [g, g] and seen[1][2]
    seen.clear()
    run_train(train_ckpt, tmp_path / "plain", "--steps", "1")
    assert seen and all(meta is None and not forced for meta, _, forced in seen)
    assert load_tokenizer(str(tmp_path / "plain" / "checkpoint")).token_to_id(META_TOKEN) is None


# ---------------------------------------------------------------------------------------
# Failures a user meets: one line, nothing lost


def test_a_diverging_run_stops_with_one_line_and_keeps_the_last_finite_checkpoint(train_ckpt, tmp_path):
    """A learning rate far too high: the first update (finite gradients) wrecks the model, whose
    logits are then NaN. The next step stops the run with one line naming it, before any update,
    and the checkpoint of step 1 (finite weights) stays; the control at a sane rate runs on."""
    with pytest.raises(SystemExit) as err:
        run_train(train_ckpt, tmp_path / "run", "--steps", "4", "--lr", "1e30", "--save-every", "1")
    message = str(err.value)
    assert message.startswith("error: training diverged at step 2 (") and "\n" not in message
    assert "the checkpoint of step 1 is kept" in message and "lower --lr" in message
    assert rundir.load_trainer_state(str(tmp_path / "run"))["step"] == 1
    back = from_pretrained(str(tmp_path / "run" / "checkpoint"))
    assert all(torch.isfinite(p).all() for p in back.parameters())
    assert [r["step"] for r in rundir.read_log(str(tmp_path / "run" / "log.jsonl"))] == [0]
    log = run_train(train_ckpt, tmp_path / "sane", "--steps", "4", "--save-every", "1")  # the control
    assert [r["step"] for r in log] == [0, 1, 2, 3]


def test_weights_that_are_not_finite_are_never_saved(train_ckpt, tmp_path):
    m = from_pretrained(train_ckpt)
    c = train.resolve(train.parse_args(["--model", train_ckpt, "--out", str(tmp_path / "run")]))
    opt, tok = train.make_optimizer(m, c), load_tokenizer(train_ckpt)
    rundir.save_checkpoint(str(tmp_path / "run"), m, opt, tok, train_ckpt, 1, settings.saved(c))
    with torch.no_grad():
        m.lm_head.weight[0, 0] = float("inf")
    with pytest.raises(rundir.Diverged, match="after step 2 are not finite"):
        rundir.save_checkpoint(str(tmp_path / "run"), m, opt, tok, train_ckpt, 2, settings.saved(c))
    assert rundir.load_trainer_state(str(tmp_path / "run"))["step"] == 1


def test_a_resume_with_other_settings_says_which(train_ckpt, tmp_path, capsys):
    run_train(train_ckpt, tmp_path, "--steps", "1")
    capsys.readouterr()
    train.main(["--resume", str(tmp_path), "--steps", "2", "--lr", "2e-3", "--threads", "1"], reward_fn=parity_reward)
    out = capsys.readouterr().out
    assert "note: resuming at step 1 with changed settings: steps 1 → 2, lr 0.001 → 0.002" in out
    train.main(["--resume", str(tmp_path), "--threads", "1"], reward_fn=parity_reward)  # the control: no change
    assert "changed settings" not in capsys.readouterr().out


# A value other than the run's for each setting a resume may change (train_ckpt's run, --steps 1):
# flags and the settings each changes. The rest are derived in test_a_resume_... below.
RESUME_CHANGES = {"blind_tag": (["--blind-tag", "--interoception"], ["interoception", "blind_tag"]),
                  "weight_decay": (["--weight-decay", "0.1"], ["weight_decay"]),
                  "data": (["--data", "x.jsonl"], ["data"]), "eval_data": (["--eval-data", "x.jsonl"], ["eval_data"]),
                  "question_field": (["--question-field", "q"], ["question_field"]),
                  "answer_field": (["--answer-field", "a"], ["answer_field"]),
                  "retention": (["--retention", "0.8,0.4"], ["retention"]),
                  "interoception_rates": (["--interoception-rates", "0.3,0.6"], ["interoception_rates"]),
                  "data_seed": (["--data-seed", "7"], ["data_seed"]),
                  "dtype": (["--dtype", "bf16"], ["dtype"]), "compile": (["--compile"], ["compile"])}


def other_value(f, value):
    """Flags that set setting f to a valid value other than `value`."""
    flag = f"--{f.name.replace('_', '-')}"
    if isinstance(f.default, bool):
        return [flag if not value else f"--no-{flag[2:]}"]
    if f.name in settings.CHOICES:
        return [flag, next(c for c in settings.CHOICES[f.name] if c != value)]
    return [flag, str(value + 1 if isinstance(value, int) else value / 2)]


def test_a_resume_refuses_what_cannot_change_and_reports_every_change(train_ckpt, tmp_path, capsys):
    """--model, --task and --out cannot change a run, nor --overwrite start it again: with --resume,
    one that differs from the run's own is refused in one line, before anything is touched, while
    one equal to the run's own (README's command plus --resume) is accepted. Every other flag that
    gives a setting another value than the run's is reported (the note rundir.prepare prints), and
    only that setting; a machine setting (device, dtype) that differs from the run's last session is
    reported although no flag set it."""
    run_train(train_ckpt, tmp_path, "--steps", "1")
    before = run_dir_state(tmp_path)
    other = str(tmp_path / "other")
    for flags, dropped in [(["--model", other], f"--model {other}"), (["--task", "math"], "--task math"),
                           (["--out", other], f"--out {other}"), (["--overwrite"], "--overwrite"),
                           (["--task", "math", "--overwrite", "--model", train_ckpt], "--task math, --overwrite")]:
        with pytest.raises(SystemExit) as err:
            train.main(["--resume", str(tmp_path), *flags])
        assert str(err.value) == (f"error: --resume {tmp_path} continues that run with its own model, task and "
                                  f"directory; drop {dropped} (to start a new run, give --out instead of --resume)")
        assert run_dir_state(tmp_path) == before
    same = ["--task", "countdown", "--model", train_ckpt + "/", "--out", str(tmp_path)]  # the run's own
    log = run_train(train_ckpt, tmp_path, "--resume", str(tmp_path), "--steps", "2", *same)
    assert [r["step"] for r in log] == [0, 1] and "changed settings: steps 1 → 2\n" in capsys.readouterr().out
    state = rundir.load_trainer_state(str(tmp_path))
    saved = {**state["session"], **state["config"]}
    assert set(saved) == set(settings.SAVED) | set(settings.SESSION)
    cannot = {"model", "task", "overwrite", "out", "resume", "fsdp"}  # fsdp: refused outside torchrun
    with_flag = list(settings.HELP)
    checked = []
    for f in fields(settings.Settings):
        if f.name not in with_flag or f.name in cannot or (f.name == "device" and not torch.cuda.is_available()):
            continue
        flags, names = RESUME_CHANGES.get(f.name) or (other_value(f, saved[f.name]), [f.name])
        c = train.resolve(train.parse_args(["--resume", str(tmp_path), *flags]), state)
        changed = rundir.changed_settings(saved, settings.recorded(c))
        assert [x.split(" ")[0] for x in changed] == names, (flags, changed)
        checked.append(f.name)
    assert len(checked) >= 44
    session = {**state, "session": {**state["session"], "device": "cuda:0", "dtype": "bf16"}}  # a run saved on a GPU
    c = train.resolve(train.parse_args(["--resume", str(tmp_path), "--device", "cpu"]), session)
    assert rundir.changed_settings({**session["session"], **state["config"]}, settings.recorded(c)) == [
        "device cuda:0 → cpu", "dtype bf16 → fp32"]

