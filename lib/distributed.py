"""Several processes under torchrun: data parallel, or FSDP2 with --fsdp. Each process takes its
share of a step's groups and the gradients are averaged, so a step equals the single-process one;
evaluation splits the problems the same way. With one process every function here is a no-op.
"""
import atexit
import contextlib
import os
import sys
import traceback

import torch
import torch.distributed as dist


def launched() -> bool:  # by torchrun
    return "RANK" in os.environ


def pick_device(name: str | None) -> str:
    """--device checked (default: cuda when present); under torchrun "cuda" is cuda:LOCAL_RANK."""
    name = name or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name!r} is not a device; use cpu, cuda or cuda:N")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {name}: use cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: no CUDA GPU is visible here; use --device cpu")
    return (f"cuda:{os.environ['LOCAL_RANK']}" if name == "cuda" and "LOCAL_RANK" in os.environ
            else name)


def start(device: torch.device):
    """Under torchrun, join the process group (NCCL on GPUs, Gloo on the CPU), after every argument
    check, so that no process fails alone after the rendezvous."""
    if not launched():
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    # on every exit (errors and signals too): a live group torn down at exit can abort
    atexit.register(stop)


def stop():
    if dist.is_initialized():
        dist.destroy_process_group()


def peer_lost(e: BaseException) -> bool:
    """Whether e is a failed collective: a process of the run is gone (killed, out of memory)."""
    return rank_and_world()[1] > 1 and any(
        "torch/distributed" in frame.filename.replace(os.sep, "/")
        for frame in traceback.extract_tb(e.__traceback__))


def rank_and_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def comm_device():  # where collectives run: NCCL needs the tensors on the GPU
    return (torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl"
            else torch.device("cpu"))


def average_gradients(params):
    """Average p.grad over the processes; when no process has one, they stay None."""
    world = rank_and_world()[1]
    if world == 1:
        return
    from torch.distributed.tensor import DTensor  # only here: its import costs a second
    if isinstance(params[0], DTensor):  # FSDP averaged them already
        return
    if mean_over_processes({"any": any(p.grad is not None for p in params)})["any"] == 0:
        return
    for p in params:
        if p.grad is None:  # this process had no learning signal: it adds zeros
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad)
        p.grad.div_(world)


def mean_over_processes(values: dict) -> dict:  # each holds the same number of rollouts
    world = rank_and_world()[1]
    t = torch.tensor([float(v) for v in values.values()], dtype=torch.float64)
    if world > 1:
        t = t.to(comm_device())
        dist.all_reduce(t)
    return dict(zip(values, (t / world).tolist()))


def gather_in_order(mine: list, n: int) -> list:
    """All processes' results of n jobs dealt out round-robin, in job order."""
    world = rank_and_world()[1]
    if world == 1:
        return mine
    parts = [None] * world
    dist.all_gather_object(parts, mine)
    return [parts[i % world][i // world] for i in range(n)]


def shard(model):
    """FSDP2 (--fsdp): every decoder layer, then the rest; its reduce-scatter averages gradients."""
    from torch.distributed.fsdp import fully_shard
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)


def is_sharded(module) -> bool:
    fsdp = sys.modules.get("torch.distributed.fsdp")  # not loaded: nothing is sharded
    return fsdp is not None and isinstance(module, fsdp.FSDPModule)


def pad_micro_batches(model, chunks: list, device) -> list:
    """Under FSDP each backward is a collective: the micro-batches (rows, token advantages,
    eviction advantages) padded to the most any process has with a row of advantage 0."""
    if not is_sharded(model):
        return chunks
    most = torch.tensor([len(chunks)], device=comm_device())
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    row = chunks[0][0][:1] if chunks else torch.zeros(1, dtype=torch.long, device=device)
    zero = torch.zeros(1, device=device)
    return chunks + [(row, zero, zero)] * (int(most) - len(chunks))


@contextlib.contextmanager
def whole_model(model):
    """Rollouts under FSDP: every layer gathered through the decode loop (whose number of forwards
    differs between processes), then sharded again."""
    units = [m for m in model.modules() if is_sharded(m)]
    for u in units:
        u.unshard()
        u.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for u in units:  # back to FSDP's defaults: the root stays gathered after its forward
            u.reshard()
            u.set_reshard_after_forward(u is not model, recurse=False)


# the whole model's and optimizer's state dicts; under FSDP, a collective
def full_state(model, opt):
    if not is_sharded(model):
        return model.state_dict(), opt.state_dict()
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return (get_model_state_dict(model, options=options),
            get_optimizer_state_dict(model, opt, options=options))


def load_optimizer_state(model, opt, opt_state):
    if not is_sharded(model):
        return opt.load_state_dict(opt_state)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
    set_optimizer_state_dict(model, opt, opt_state, options=StateDictOptions(full_state_dict=True))
