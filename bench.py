"""Speed figures for the NGC engine and the replay pass. Prints numbers, asserts nothing.

    python bench.py                      # a random tiny Qwen2 on the CPU (and on CUDA if present)
    python bench.py --model DIR --device cuda --dtype bf16 --batch 64 --new-tokens 1024
    python bench.py --shape r1 --device cuda --batch 32 --new-tokens 1024 --delta 256 --block 32
                                         # random weights in DeepSeek-R1-Distill-Qwen-1.5B's shape

Decode: tokens/s and ms per decode step with eviction on and off at the same batch (no EOS,
so every row decodes --new-tokens tokens), eager and, with --compile, compiled; on CUDA also
the fraction of the memory-bandwidth bound (weights + alive KV read per step / peak
bandwidth). Replay: forward+backward of the replay pass (per-layer masks plus the recomputed
eviction log-probs) against a plain causal forward+backward over the same tokens.
"""
import sys
import time

import torch

import distributed
from checkpoint import CheckpointError, from_pretrained, load_config
from cli import exits, parser
from model import Qwen2, Qwen2Config, init_weights
from ngc import Eviction, Sampling, check_eviction, rollout
from replay import replay

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, repeat=3):
    fn()  # warm-up
    sync(device)
    t0 = time.perf_counter()
    for _ in range(repeat):
        out = fn()
    sync(device)
    return (time.perf_counter() - t0) / repeat, out


def bench(model, args, device):
    ev = Eviction(delta=args.delta, block=args.block, window=args.window, rate=args.rate)
    s = Sampling(max_new_tokens=args.new_tokens, temperature=1.0, top_k=50)
    g = torch.Generator(device=device).manual_seed(0)
    V = model.config.vocab_size
    prompts = torch.randint(0, V, (args.batch, args.prompt_len), generator=torch.Generator().manual_seed(0)).tolist()
    new = args.batch * args.new_tokens
    for compile in (False, True) if args.compile else (False,):
        for name, e in (("off", None), ("on", ev)):
            reset_memory(device)
            sec, ro = timed(lambda: rollout(model, prompts, s, e, eos_ids=[], generator=g, compile=compile),
                            device, args.repeat)
            step = sec / args.new_tokens  # prefill and rounds included
            print(f"decode, eviction {name:3s}, {'compiled' if compile else 'eager   '}: {new / sec:9.0f} tokens/s "
                  f"{step * 1e3:8.2f} ms/step{bandwidth(model, ro, e, step, args)}   ({sec:.2f} s for {args.batch} x "
                  f"{args.new_tokens} tokens; peak KV/seq {ro.peak_kv.float().mean():.0f}, slots {ro.kv_slots}"
                  f"{memory(device)})")
    ro = rollout(model, prompts, s, ev, eos_ids=[], generator=g).select(torch.arange(min(args.replay_batch, args.batch)))

    def step(causal):
        model.zero_grad(set_to_none=True)
        tok, evict = replay(model, ro, causal=causal)
        loss = tok.sum() + (0 if evict is None else evict.sum())
        loss.backward()

    reset_memory(device)
    t_replay, _ = timed(lambda: step(False), device, args.repeat)
    replay_memory = memory(device)
    reset_memory(device)
    t_causal, _ = timed(lambda: step(True), device, args.repeat)
    B, T = ro.tokens.shape
    print(f"replay fwd+bwd: {t_replay * 1e3:8.1f} ms{replay_memory}   causal fwd+bwd: {t_causal * 1e3:8.1f} ms"
          f"{memory(device)}   ratio {t_replay / t_causal:.2f}   ({B} x {T} tokens, {int(ro.n_rounds.max())} rounds)")


def bandwidth(model, ro, ev, step_s, args) -> str:
    """On CUDA: the step time's fraction of the memory-bandwidth bound, the bytes a decode step
    must read (every weight once, but of an untied embedding table only B rows; every alive
    KV entry once) / the device's peak bandwidth. Alive entries per layer, averaged over the
    steps: prompt + half the completion without eviction; with it the cache grows by one a
    step from (count before a round - δ) to the next round's count, so its mean is the mean
    count before a round minus δ/2."""
    if ro.tokens.device.type != "cuda":
        return ""
    cfg = model.config
    embed = model.model.embed_tokens.weight
    weights = sum(p.numel() * p.element_size() for p in model.parameters()
                  if cfg.tie_word_embeddings or p is not embed)
    R = ro.kv_before_round.shape[1]
    before = ro.kv_before_round[torch.arange(R, device=ro.n_rounds.device) < ro.n_rounds[:, None]]  # (rounds, L)
    if ev is None or len(before) == 0:
        alive = ro.prompt_lens.float().mean().item() + args.new_tokens / 2
    else:
        alive = before.float().mean().item() - ev.delta / 2
    entry = 2 * cfg.num_key_value_heads * cfg.head_dim * model.lm_head.weight.element_size()  # K and V
    read = weights + alive * cfg.num_hidden_layers * entry * ro.tokens.shape[0]  # bytes per step
    ideal_s = read / (args.peak_bandwidth * 1e12)
    return f" ({ideal_s / step_s:5.1%} of the bandwidth bound)"


def reset_memory(device):
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def memory(device) -> str:
    """Peak GPU memory since the last reset (weights included), or nothing on the CPU."""
    return f", peak {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB" if device.type == "cuda" else ""


def check(args) -> list[str]:
    """The devices to run on, after every flag is checked: a one-line ValueError or CheckpointError."""
    for flag in ("batch", "prompt_len", "new_tokens", "replay_batch", "repeat", "threads"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ValueError(f"--{flag.replace('_', '-')} {value} must be at least 1")
    if not args.peak_bandwidth > 0:
        raise ValueError(f"--peak-bandwidth {args.peak_bandwidth} must be positive (TB/s)")
    try:
        check_eviction(args.delta, args.block, args.window, args.rate)
    except ValueError as e:
        raise ValueError(f"--delta {args.delta} --block {args.block} --window {args.window} --rate {args.rate}: {e}")
    if args.model:
        load_config(args.model)  # a missing or foreign checkpoint: one line, before any device work
    if args.device:
        return [distributed.pick_device(args.device)]
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@exits  # SIGINT, SIGTERM: one line, exit code 130 or 143
def main(argv=None):
    p = parser(__doc__)
    p.add_argument("--model", help="Qwen2 checkpoint directory (default: a random Qwen2 of --shape)")
    p.add_argument("--shape", choices=["tiny", "r1"], default="tiny",
                   help="random model without --model: tiny (0.9 M params) or r1 (R1-Distill-Qwen-1.5B's shape)")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cpu, then cuda too if present)")
    p.add_argument("--dtype", choices=DTYPES, default=None, help="default fp32 on cpu, bf16 on cuda")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--delta", type=int, default=64)
    p.add_argument("--block", type=int, default=8)
    p.add_argument("--window", type=int, default=5)
    p.add_argument("--rate", type=float, default=0.5)
    p.add_argument("--replay-batch", type=int, default=8, help="rollouts per replay forward+backward")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    p.add_argument("--compile", action="store_true", help="also time rollout(compile=True) (CUDA graphs on CUDA)")
    p.add_argument("--peak-bandwidth", type=float, default=3.35,
                   help="the device's peak memory bandwidth in TB/s, for the bandwidth bound (default: H100 SXM)")
    args = p.parse_args(argv)
    try:
        devices = check(args)
    except (CheckpointError, ValueError) as e:
        sys.exit(f"error: {e}")
    if args.threads:
        torch.set_num_threads(args.threads)
    for name in devices:
        device = torch.device(name)
        dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
        if args.model:
            try:
                model = from_pretrained(args.model, dtype=dtype, device=device)
            except CheckpointError as e:
                sys.exit(f"error: {e}")
        elif args.shape == "r1":  # Qwen2Config's defaults are DeepSeek-R1-Distill-Qwen-1.5B's shape
            with torch.device(device):
                model = Qwen2(Qwen2Config()).to(dtype)
            init_weights(model)
        else:
            cfg = Qwen2Config(vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2)
            model = init_weights(Qwen2(cfg)).to(device=device, dtype=dtype)
        print(f"== {device.type} {str(dtype).removeprefix('torch.')}, {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M params, "
              f"threads {torch.get_num_threads()}, δ={args.delta} b={args.block} w={args.window} ε={args.rate}")
        bench(model, args, device)


if __name__ == "__main__":
    main()
