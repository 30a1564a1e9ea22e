"""Several processes (distributed.py): torchrun, Gloo on the CPU."""
import os
import signal
import subprocess
import sys

import torch

import eval as evaluation
from lib import rundir
import train

from lib.checkpoint import from_pretrained
from conftest import EV, SIGNAL_RUN, wait_for_log_lines


def torchrun(tmp_path, *args, nproc=2, timeout=240):
    """Run `torchrun --standalone --nproc_per_node nproc args...` from the repository directory."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), *args]
    here = os.path.dirname(train.__file__)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": here}
    proc = subprocess.run(cmd, cwd=here, capture_output=True, text=True, timeout=timeout,
                          env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


DDP_STEP = """
import os, sys, torch, torch.distributed as dist, train
from lib import distributed
from lib.checkpoint import from_pretrained
ckpt, rollouts, out, reduce = sys.argv[1:]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.set_num_threads(1)
ro, adv, ev, c = torch.load(rollouts, weights_only=False)
rows = torch.arange(len(adv)).chunk(world)[rank]  # this process's prompts: whole groups
if reduce == "sum":  # the negative control: gradients summed over the processes, not averaged
    distributed.average_gradients = lambda params, grads=None: [dist.all_reduce(p.grad) for p in params]
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
    torch.save({"grads": grads, "params": list(params.values())}, out)
# Leave without Python's teardown: a Gloo group (and FSDP's references to it) torn down during
# interpreter finalization can abort the process (SIGABRT, "terminate called without an active
# exception"); torchrun then kills the other rank and the run fails. rank 0's file is written.
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
    for reduce in ("mean", "fsdp", "sum"):
        torchrun(tmp_path, str(tmp_path / "step.py"), train_ckpt, str(tmp_path / "rollouts.pt"),
                 str(tmp_path / f"{reduce}.pt"), reduce)
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
    evaluation.main(flags + ["--out", str(tmp_path / "one.jsonl")])
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
