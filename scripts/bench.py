"""Speed figures for the NGC engine and the replay pass. Prints numbers, asserts nothing
(docs/speed.md).

    python scripts/bench.py        # a random tiny Qwen2 on the CPU (and on CUDA if present)
    python scripts/bench.py --model DIR --device cuda --dtype bf16 --batch 64 --new-tokens 1024
    python scripts/bench.py --shape r1 --device cuda --batch 32 --new-tokens 1024 \\
        --delta 256 --block 32     # random weights in DeepSeek-R1-Distill-Qwen-1.5B's shape
    python scripts/bench.py --model tiny --held-out --hf --batch 64 --delta 24 --block 4 \\
        --window 4 --threads 2     # the shipped model's rollouts as train.py makes them,
                                   # beside Hugging Face generate (pip install transformers)

Decode: tokens/s and ms per step with eviction on and off at the same batch (no EOS unless
--held-out), eager and, with --compile, compiled; on CUDA also the fraction of the
memory-bandwidth bound. Replay: forward+backward of the replay pass against a plain causal
forward+backward over the same tokens. Where a training run's time went: results/speed/.
"""
import os
import sys
import time
from dataclasses import replace

import torch

# the repository root first
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from model import Qwen2, Qwen2Config, init_weights
from ngc import Sampling, rollout
from replay import replay
from lib import distributed, settings
from lib.checkpoint import from_pretrained, load_config, load_tokenizer
from lib.cli import at_least, check_values, exits, need, one_line_errors, parser, positive
from lib.tasks import held_out, prompt_encoder

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
BENCH = replace(settings.COUNTDOWN, delta=64, block=8, window=5)  # bench.py's δ, b and w
SHARED = ["device", "dtype", "threads", "compile", "delta", "block", "window"]  # settings.py's
HELPS = {"model": "Qwen2 checkpoint directory (default: a random Qwen2 of --shape)",
         "device": "cpu, cuda or cuda:N (default: the CPU, then CUDA too if present)",
         "dtype": "the weights' dtype (default: fp32 on the CPU, bf16 on CUDA)",
         "compile": "also time the compiled decode step beside eager (CUDA graphs on CUDA)",
         "threads": "CPU threads for torch (default: torch's)"}
FLAGS = {  # bench.py's own: type, default, rule, help
    "batch": (int, 8, at_least(1), "prompts rolled out together"),
    "prompt_len": (int, 32, at_least(1), "tokens of each random prompt"),
    "new_tokens": (int, 256, at_least(1), "tokens each row decodes (at most, with --held-out)"),
    "rate": (float, 0.5, None, "ε: the fraction of blocks evicted per round"),
    "replay_batch": (int, 8, at_least(1), "rollouts per replay forward+backward"),
    "repeat": (int, 2, at_least(1), "timed runs of each, after one warm-up"),
    "peak_bandwidth": (float, 3.35, positive, "the device's peak memory bandwidth in TB/s (H100 "
                       "SXM's), for the bandwidth bound")}
SHAPES = {"tiny": dict(vocab_size=512, hidden_size=128, intermediate_size=384,
                       num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2),
          "r1": {}}  # Qwen2Config's defaults are DeepSeek-R1-Distill-Qwen-1.5B's shape


def timed(fn, device, repeat):
    """(seconds per call after a warm-up, the last output, on CUDA the peak memory's text)."""
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else lambda: None
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    fn()  # warm-up
    sync()
    start = time.perf_counter()
    for _ in range(repeat):
        out = fn()
    sync()
    peak = f", peak {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB" if cuda else ""
    return (time.perf_counter() - start) / repeat, out, peak


def bench(model, args, device):
    eviction = settings.eviction(args.cfg, args.rate)
    prompts, sampling, eos_ids = bench_prompts(model, args)
    generator = torch.Generator(device=device).manual_seed(0)
    speed = {}
    for compile in (False, True) if args.compile else (False,):
        for name, evicting in (("off", None), ("on", eviction)):
            sec, rolled, peak = timed(lambda: rollout(model, prompts, sampling, evicting,
                                                      eos_ids=eos_ids, generator=generator,
                                                      compile=compile), device, args.repeat)
            decoded = rolled.lengths - rolled.prompt_lens
            new, step = int(decoded.sum()), sec / int(decoded.max())
            speed[name, compile] = new / sec
            print(f"decode, eviction {name:3s}, "
                  f"{'compiled' if compile else 'eager   '}: {new / sec:9.0f} tokens/s "
                  f"{step * 1e3:8.2f} ms/step{bandwidth(model, rolled, evicting, step, args)}   "
                  f"({sec:.2f} s for {new} tokens from {args.batch} prompts; peak KV/seq "
                  f"{rolled.peak_kv.float().mean():.0f}, slots {rolled.kv_slots}{peak})")
    if args.hf:
        hf_speed = hf_generate(args.model, prompts, sampling, eos_ids, device,
                               model.lm_head.weight.dtype, args.repeat)
        print(f"eager rollout with eviction / Hugging Face generate: "
              f"{speed['on', False] / hf_speed:.2f}x the tokens/s")
    rolled = rollout(model, prompts, sampling, eviction, eos_ids=[], generator=generator)
    bench_replay(model, rolled.select(torch.arange(min(args.replay_batch, args.batch))), device,
                 args.repeat)


def bench_replay(model, rolled, device, repeat):
    """The replay's forward+backward over full-length rollouts, beside a plain causal one."""
    def fwd_bwd(causal):
        model.zero_grad(set_to_none=True)
        tok, evict = replay(model, rolled, causal=causal)
        (tok.sum() + (0 if evict is None else evict.sum())).backward()

    t_replay, _, replay_peak = timed(lambda: fwd_bwd(False), device, repeat)
    t_causal, _, causal_peak = timed(lambda: fwd_bwd(True), device, repeat)
    rows, length = rolled.tokens.shape
    print(f"replay fwd+bwd: {t_replay * 1e3:8.1f} ms{replay_peak}   "
          f"causal fwd+bwd: {t_causal * 1e3:8.1f} ms{causal_peak}   "
          f"ratio {t_replay / t_causal:.2f}   ({rows} x {length} tokens, "
          f"{int(rolled.n_rounds.max())} rounds)")


def bench_prompts(model, args):
    """(prompts, sampling, EOS ids): --model's held-out prompts, or random ones that never end."""
    if not args.held_out:
        prompts = torch.randint(0, model.config.vocab_size, (args.batch, args.prompt_len),
                                generator=torch.Generator().manual_seed(0))
        return prompts.tolist(), settings.sampling(args.cfg), []
    cfg = settings.run_defaults(args.model)
    encode, tokenizer = prompt_encoder(cfg.task, cfg.prompt), load_tokenizer(args.model)
    prompts = [encode(tokenizer, problem) for problem in held_out(cfg, args.batch)]
    sampling = replace(settings.sampling(cfg), max_new_tokens=args.new_tokens)
    return prompts, sampling, model.config.eos_ids


def hf_generate(model_dir, prompts, sampling: Sampling, eos_ids, device, dtype, repeat) -> float:
    """Hugging Face generate's tokens/s (the full cache) on the same prompts, up to each EOS."""
    transformers = need("transformers", "bench.py --hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    never_ends = not eos_ids
    eos = eos_ids or [hf.config.eos_token_id or 0]

    def generate():  # Hugging Face's generate is itself no_grad
        torch.manual_seed(0)
        return hf.generate(input_ids=ids, attention_mask=mask, do_sample=True,
                           temperature=sampling.temperature, top_k=sampling.top_k,
                           top_p=sampling.top_p, max_new_tokens=sampling.max_new_tokens,
                           pad_token_id=0, eos_token_id=eos,
                           min_new_tokens=sampling.max_new_tokens if never_ends else 0)[:, width:]

    sec, new, _ = timed(generate, device, repeat)
    ended = torch.isin(new, torch.tensor(eos, device=device)).long()
    # up to and with EOS
    tokens = int(new.numel() if never_ends else ((ended.cumsum(1) - ended) == 0).sum())
    print(f"Hugging Face generate, full cache: {tokens / sec:9.0f} tokens/s "
          f"{sec / new.shape[1] * 1e3:8.2f} ms/step   "
          f"({sec:.2f} s for {tokens} tokens from {len(prompts)} prompts; "
          f"transformers {transformers.__version__})")
    return tokens / sec


def bandwidth(model, rolled, eviction, step_s, args) -> str:
    """On CUDA: the step time's fraction of the memory-bandwidth bound, the bytes a decode step
    must read (every weight, an untied embedding table left out, and every alive KV entry once) /
    the peak bandwidth. Alive entries per layer, over the steps: prompt + half the completion; with
    eviction the mean count before a round - δ/2 (the cache grows by one a step from count - δ)."""
    if rolled.tokens.device.type != "cuda":
        return ""
    cfg = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters()
                  if cfg.tie_word_embeddings or p is not model.model.embed_tokens.weight)
    rounds = torch.arange(rolled.kv_before_round.shape[1], device=rolled.n_rounds.device)
    before = rolled.kv_before_round[rounds < rolled.n_rounds[:, None]]  # (rounds, L)
    alive = (rolled.prompt_lens.float().mean().item() + args.new_tokens / 2
             if eviction is None or len(before) == 0
             else before.float().mean().item() - eviction.delta / 2)
    entry = 2 * cfg.num_key_value_heads * cfg.head_dim * model.lm_head.weight.element_size()
    read = weights + alive * cfg.num_hidden_layers * entry * rolled.tokens.shape[0]  # bytes a step
    return f" ({read / (args.peak_bandwidth * 1e12) / step_s:5.1%} of the bandwidth bound)"


def check(args) -> list[str]:
    check_values(args, {name: rule for name, (_, _, rule, _) in FLAGS.items() if rule}
                 | {"threads": settings.RULES["threads"]})
    try:
        settings.eviction(args.cfg, args.rate)
    except ValueError as e:
        raise ValueError(f"--delta {args.delta} --block {args.block} --window {args.window} "
                         f"--rate {args.rate}: {e}")
    if args.model:
        load_config(args.model)  # a missing or foreign checkpoint: one line, before any device work
    if (args.held_out or args.hf) and not args.model:
        raise ValueError("--held-out and --hf read a checkpoint directory: "
                         "give --model DIR (e.g. --model tiny)")
    if args.held_out:
        settings.run_defaults(args.model, "countdown")  # its held-out problems are Countdown's
    if args.hf:
        need("transformers", "bench.py --hf")
    if args.device:
        return [distributed.pick_device(args.device)]
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def parse_args(argv=None):
    """bench.py's flags; args.cfg: BENCH with those of settings.py (SHARED) given, sampling
    --new-tokens at temperature 1."""
    p = parser(__doc__)
    p.add_argument("--shape", choices=list(SHAPES), default="tiny",
                   help="random model without --model: tiny (0.9 M params) or r1 "
                        "(R1-Distill-Qwen-1.5B's shape)")
    settings.add_flags(p, None, ["model"], HELPS)  # None: a random model
    settings.add_flags(p, BENCH, SHARED, HELPS)
    for name, (kind, default, _, text) in FLAGS.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=kind, default=default,
                       help=f"{text} (default {default})")
    p.add_argument("--held-out", action="store_true",
                   help="--model's held-out prompts, ending at EOS, as train.py")
    p.add_argument("--hf", action="store_true", help="also time Hugging Face generate on the "
                   "same prompts (needs transformers and --model)")
    args = p.parse_args(argv)
    given = {k: getattr(args, k) for k in SHARED if getattr(args, k) is not None}
    args.cfg = replace(BENCH, **given, max_new_tokens=args.new_tokens, temperature=1.0)
    vars(args).update({k: getattr(args.cfg, k) for k in SHARED})
    return args


def bench_model(args, device, dtype):
    if args.model:
        with one_line_errors():
            return from_pretrained(args.model, dtype=dtype, device=device)
    with torch.device(device):
        model = Qwen2(Qwen2Config(**SHAPES[args.shape])).to(dtype)
    return init_weights(model)


@exits(memory="lower --batch")  # bad input, out of memory, a signal: one line
def main(argv=None):
    args = parse_args(argv)
    with one_line_errors():
        devices = check(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    for name in devices:
        device = torch.device(name)
        dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
        model = bench_model(args, device, dtype)
        params = sum(p.numel() for p in model.parameters()) / 1e6
        print(f"== {device.type} {str(dtype).removeprefix('torch.')}, {params:.2f} M params, "
              f"threads {torch.get_num_threads()}, "
              f"δ={args.delta} b={args.block} w={args.window} ε={args.rate}")
        bench(model, args, device)


if __name__ == "__main__":
    main()
