"""Several processes (distributed.py): torchrun, Gloo on the CPU."""
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import eval as eval_script
from lib import rundir
import train

from lib.checkpoint import from_pretrained
from conftest import EV, SIGNAL_RUN, wait_for_log_lines


def torchrun(tmp_path, *args, nproc=2, timeout=240, env=None):
    """Run `torchrun --standalone --nproc_per_node nproc args...` from the repository directory."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), *args]
    here = os.path.dirname(train.__file__)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": here, **(env or {})}
    proc = subprocess.run(cmd, cwd=here, capture_output=True, text=True, timeout=timeout,
                          env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


DDP_STEP = """
import os, sys, torch, torch.distributed as dist, train
from lib import distributed
from lib.checkpoint import from_pretrained
ckpt, rollouts, out = sys.argv[1:]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.set_num_threads(1)
ro, adv, ev, c = torch.load(rollouts, weights_only=False)
rows = torch.arange(len(adv)).chunk(world)[rank]  # this process's prompts: whole groups
for reduce in ("mean", "fsdp", "sum"):  # each from a fresh model; one process group for the three steps
    if reduce == "sum":  # the negative control: gradients summed over the processes, not averaged
        distributed.average_gradients = lambda params: [dist.all_reduce(p.grad) for p in params]
    model = from_pretrained(ckpt)
    if reduce == "fsdp":
        distributed.shard(model)
    opt = train.make_optimizer(model, c)
    train.backward(model, ro.select(rows), adv[rows], c)
    grads = [p.grad.full_tensor() if reduce == "fsdp" else p.grad.clone() for p in model.parameters()]
    torch.nn.utils.clip_grad_norm_(list(model.parameters()), c.clip)
    opt.step()
    params, _ = distributed.full_state(model, opt)
    if rank == 0:
        torch.save({"grads": grads, "params": list(params.values())}, f"{out}/{reduce}.pt")
# Leave without Python's teardown: a Gloo group (and FSDP's references to it) torn down during
# interpreter finalization can abort the process (SIGABRT, "terminate called without an active
# exception"); torchrun then kills the other rank and the run fails. rank 0's files are written.
dist.destroy_process_group()
sys.stdout.flush(), sys.stderr.flush()
os._exit(0)
"""


def test_two_processes_take_the_single_process_step(train_ckpt, sampled, tmp_path):
    """One step of 2 processes, each replaying its half of the rollouts with averaged gradients
    (whole copies, or FSDP shards), equals one step of 1 process on all of them (1e-6); summed
    gradients (the control) do not. (Adam's first step is nearly blind to a gradient's scale, so
    the control shows on the gradients.)"""
    c = train.resolve(train.parse_args(["--model", train_ckpt, "--out", str(tmp_path / "run"), "--lr", "1e-3"]))
    adv = torch.tensor([0.5, -0.5, 1.0, -1.0])  # two groups of two, one for each process
    ro = sampled.select(torch.arange(4))
    torch.save((ro, adv, EV, c), tmp_path / "rollouts.pt")
    (tmp_path / "step.py").write_text(DDP_STEP)
    model = from_pretrained(train_ckpt)
    opt = train.make_optimizer(model, c)
    train.backward(model, ro, adv, c)
    grads = [p.grad.clone() for p in model.parameters()]
    torch.nn.utils.clip_grad_norm_(list(model.parameters()), c.clip)
    opt.step()
    torchrun(tmp_path, str(tmp_path / "step.py"), train_ckpt, str(tmp_path / "rollouts.pt"), str(tmp_path))
    for reduce in ("mean", "fsdp", "sum"):  # one torchrun takes the three steps (each start costs seconds)
        two = torch.load(tmp_path / f"{reduce}.pt")
        grad_err = max((a - b).abs().max().item() for a, b in zip(two["grads"], grads))
        param_err = max((a - b).abs().max().item() for a, b in zip(two["params"], model.parameters()))
        print(f"{reduce}: max |grad - single| {grad_err:.2e}, max |param - single| {param_err:.2e}")
        if reduce in ("mean", "fsdp"):
            assert grad_err < 1e-6 and param_err < 1e-6
        else:
            assert grad_err > 1e-3


def test_eval_over_two_processes_gives_the_rows_of_one(train_ckpt, tmp_path):
    flags = ["--model", train_ckpt, "--policy", "none", "ngc", "knorm", "--eviction-rate", "0.5", "--problems", "4",
             "--batch-size", "3", "--samples", "0"]  # greedy tokens: sampled ones draw per-process noise
    eval_script.main(flags + ["--out", str(tmp_path / "one.jsonl")])
    torchrun(tmp_path, "scripts/eval.py", *flags, "--out", str(tmp_path / "two.jsonl"))
    one, two = ((tmp_path / f"{n}.jsonl").read_text().splitlines() for n in ("one", "two"))
    assert len(one) == 3 and one == two


def test_two_process_run_interrupted_and_resumed_logs_what_an_uninterrupted_one_does(train_ckpt, tmp_path):
    """SIGTERM to torchrun mid-run: rank 0 saves; --resume on 2 processes then writes the log an
    uninterrupted 2-process run writes (timings aside)."""
    (tmp_path / "run.py").write_text(SIGNAL_RUN)
    here = os.path.dirname(train.__file__)
    flags = ["--model", train_ckpt, "--threads", "1", "--eval-every", "3", "--eval-problems", "2"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(tmp_path / "run.py")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": here}
    proc = subprocess.Popen(cmd + flags + ["--out", str(tmp_path / "cut"), "--steps", "200"], cwd=here, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for_log_lines(tmp_path / "cut" / "log.jsonl", 3, timeout=120)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    saved = rundir.load_trainer_state(str(tmp_path / "cut"))["step"]
    assert 2 <= saved < 200 and "continue with --resume" in out, out
    torchrun(tmp_path, str(tmp_path / "run.py"), "--resume", str(tmp_path / "cut"), "--steps", str(saved + 1))
    torchrun(tmp_path, str(tmp_path / "run.py"), *flags, "--out", str(tmp_path / "straight"), "--steps", str(saved + 1))
    straight, resumed = (rundir.read_log(str(tmp_path / n / "log.jsonl")) for n in ("straight", "cut"))
    strip = lambda log: [{k: v for k, v in r.items() if not k.endswith("_time") and k != "tokens_per_s"} for r in log]
    assert [r["step"] for r in straight if "eval" not in r] == list(range(saved + 1))
    assert strip(resumed) == strip(straight)
    assert any(r.get("grad_norm") for r in straight)  # it learned, so the comparison means something


LATE_RUN = SIGNAL_RUN.replace("import sys, train; ", """import os, sys, time, train
out, rank = sys.argv[sys.argv.index("--out" if "--out" in sys.argv else "--resume") + 1], int(os.environ["RANK"])
open(f"{out}.rank{rank}", "w").write(str(os.getpid()))
if rank == int(os.environ["LATE_RANK"]):  # once two steps are logged, late to the step's collectives
    real = train.backward
    def late(*args):
        if len(open(os.path.join(out, "log.jsonl")).read().splitlines()) >= 2:
            open(out + ".late", "w").close()
            time.sleep(600)
        return real(*args)
    train.backward = late
""")


@pytest.mark.parametrize("killed", [1, 0])
def test_a_lost_process_ends_every_other_with_one_line_and_the_run_resumes(train_ckpt, tmp_path, killed):
    """SIGKILL of one process of a 2-process run while the other waits for it in a collective (Gloo):
    the survivor ends with one line, no traceback, exit code 2; process 0, if it survives, saves the
    step it reached (the control for process 1: it only says which checkpoint is kept); torchrun
    --resume then takes every step once."""
    (tmp_path / "run.py").write_text(LATE_RUN)
    here, run = os.path.dirname(train.__file__), tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": here, "LATE_RANK": str(killed)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "--monitor-interval", "5", "--log-dir", str(tmp_path / "logs"), "--redirects", "3", str(tmp_path / "run.py"),
           "--model", train_ckpt, "--out", str(run), "--threads", "1", "--steps", "200", "--save-every", "1"]
    proc = subprocess.Popen(cmd, cwd=here, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 180
        while not (tmp_path / "run.late").exists() and time.time() < deadline and proc.poll() is None:
            time.sleep(0.1)
        time.sleep(1)  # the other process is in the step's first collective, waiting
        os.kill(int((tmp_path / f"run.rank{killed}").read_text()), signal.SIGKILL)
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    survivor = 1 - killed
    err = next((tmp_path / "logs").glob(f"*/attempt_0/{survivor}/stderr.log")).read_text()
    saved = rundir.load_trainer_state(str(run))["step"]
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, out + err
    assert err.startswith("error: a process of this run is gone (RuntimeError: ") and err.strip().endswith(
        f"continue with --resume {run} (on as many processes)"), err
    assert (f"saved step {saved} to {run}/checkpoint" if survivor == 0 else
            f"process 1 of 2 stopped; the checkpoint of step {saved} is kept in {run}/checkpoint") in err, err
    assert saved >= 2  # the step process 0 reached: saved by it, or by the periodic save (every step)
    torchrun(tmp_path, str(tmp_path / "run.py"), "--resume", str(run), "--steps", str(saved + 1),
             env={"LATE_RANK": "-1"})
    assert [r["step"] for r in rundir.read_log(str(run / "log.jsonl"))] == list(range(saved + 1))
