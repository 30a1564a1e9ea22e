"""Fixtures and helpers shared by the test files (test_*.py, here and test_ngc.py at the top); pytest loads this
file first, as a plugin (pytest.ini: -p conftest), so its fixtures reach every test file.

Every model here is a tiny random Qwen2 written to disk in the Hugging Face layout
(config.json, model.safetensors, tokenizer.json) and loaded back through from_pretrained,
the same path as the real checkpoint. Everything runs on the CPU in fp32. The checkpoints and
rollouts below are deterministic, so one copy serves the whole session. Test files import the
plain helpers by name: `from conftest import EOS, prompts_of`.
"""
import itertools
import json
import math
import os
import signal
import time
from dataclasses import replace

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from evaluation import baselines
from lib import mathtask, rundir, settings
import ngc
import train

from gumbel import kept_keys
from lib.checkpoint import from_pretrained, load_tokenizer, save_pretrained
from model import LayerCache, Qwen2, Qwen2Config, init_weights
from ngc import Eviction, Sampling, rollout


torch.set_num_threads(1)  # tiny models: one thread is fastest, and immune to a busy second core
os.environ["OMP_NUM_THREADS"] = "1"  # the same for the scripts the tests start (torch reads it)
# A suite started in a script's background (`pytest &`) inherits SIGINT ignored, and so would every
# script the signal tests start: they test the default, so the suite restores it for its children.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
EOS = 1
TINY_MODEL = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, eos_token_id=EOS)  # GQA: 2 query heads per KV head


def write_checkpoint(path, seed=0, std=0.1, **overrides):
    """A random Qwen2 saved as config.json + model.safetensors + tokenizer.json."""
    cfg = Qwen2Config(**{**TINY_MODEL, **overrides})
    model = init_weights(Qwen2(cfg), std=std, seed=seed)
    save_pretrained(model, str(path))
    vocab = {"<pad>": 0, "<eos>": EOS, **{f"w{i}": i for i in range(2, cfg.vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(path, "tokenizer.json"))
    return str(path)


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def model(ckpt):
    torch.manual_seed(0)
    return from_pretrained(ckpt).eval()


def prompts_of(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, TINY_MODEL["vocab_size"], (n,), generator=g).tolist() for n in lengths]


# ---------------------------------------------------------------------------------------
# The scripts' checks: a stand-in for the work they reach, their one-line errors, the files they leave


class Reached(Exception):
    """Raised by a stand-in for the first thing a script does once every check has passed."""


def reached(*args, **kwargs):
    raise Reached(*args)


def one_line_error(run) -> str:
    with pytest.raises(SystemExit) as err:
        run()
    message = str(err.value)  # cli.exits: printed to stderr, exit code 2
    assert err.value.code == 2 and message.startswith("error: ") and "\n" not in message, message
    return message


def files_under(path) -> dict:
    return {str(p): p.read_bytes() if p.is_file() else None for p in sorted(path.rglob("*"))}


@pytest.fixture(scope="module")
def math_run(tmp_path_factory):
    """A math run's checkpoint/ as train.py writes it: every saved setting in ngc.json, task math
    with no Countdown prompt or difficulty (null), the held-out file it names beside it."""
    root = tmp_path_factory.mktemp("math_run")
    mathtask.make_demo(str(root / "data"), n_train=4, n_test=3)
    path = write_checkpoint(root / "checkpoint", seed=2)
    c = replace(settings.MATH, data=str(root / "data" / "train.jsonl"), eval_data=str(root / "data" / "test.jsonl"),
                delta=8, block=2, window=3, max_new_tokens=8, eval_max_new_tokens=8)
    (root / "checkpoint" / "ngc.json").write_text(json.dumps(settings.saved(c)))
    return path


# ---------------------------------------------------------------------------------------
# The rollout that the replay, gradient and objective tests share (§4.5, App. A.3)


EV = Eviction(delta=12, block=3, window=4, rate=0.5)


@pytest.fixture(scope="session")
def sampled(model):
    """Sampled tokens and Gumbel-top-k evictions: prompts of 5..17 tokens (one longer than δ,
    so prefill is chunked around a round), EOS for some rows and max length for others."""
    g = torch.Generator().manual_seed(3)
    ro = rollout(model, prompts_of([5, 17, 9, 3, 11, 7]), Sampling(max_new_tokens=60, temperature=1.0, top_k=0),
                 EV, eos_ids=[EOS], generator=g)
    return ro


# ---------------------------------------------------------------------------------------
# A checkpoint with a run's settings (ngc.json), and train.py on it


# The keys of a step record in log.jsonl, in order (train.step_gradients writes them; a test there
# checks it), for the tests that write logs by hand.
STEP_KEYS = ["step", "eps", "reward", "accuracy", "response_len", "rounds", "peak_kv", "tokens_per_s",
             "zero_adv_groups", "sampled_logprob", "L_token", "L_mem", "grad_norm", "rollout_time",
             "replay_time", "step_time"]
TRAIN_DEFAULTS = dict(difficulty="tiny", train_problems=64, eval_problems=4, prompts=2, group=4, max_new_tokens=24,
                      temperature=1.0, top_k=0, delta=8, block=2, window=3, retention="0.75,0.5", stage_steps=1,
                      micro_batch=3, eval_every=0, save_every=0, lr=1e-3,
                      eval_max_new_tokens=24)  # not the math recipe's 3850 in its evaluations


@pytest.fixture(scope="session")
def train_ckpt(tmp_path_factory):
    path = write_checkpoint(tmp_path_factory.mktemp("train_model"), seed=1)
    with open(os.path.join(path, "ngc.json"), "w") as f:
        json.dump(TRAIN_DEFAULTS, f)
    return path


def parity_reward(text, problem):
    """A stand-in reward with variance inside a group (the random model never solves Countdown)."""
    return float(sum(map(ord, text)) % 2)


def run_train(ckpt, out, *flags):
    """train.py on checkpoint ckpt into run directory out (a --resume among flags: continuing the run there)."""
    where = [] if "--resume" in flags else ["--model", ckpt, "--out", str(out)]
    train.main([*where, "--threads", "1", *flags], reward_fn=parity_reward)
    return [json.loads(line) for line in open(os.path.join(out, "log.jsonl"))]


def save_small_checkpoint(train_ckpt, run_dir, step=3, scale=1.5):
    m = from_pretrained(train_ckpt)
    with torch.no_grad():
        m.lm_head.weight.mul_(scale)  # something a fresh load of train_ckpt would not have
    c = train.resolve(train.parse_args(["--model", train_ckpt, "--out", str(run_dir), "--overwrite"]))
    opt = train.make_optimizer(m, c)
    rundir.save_checkpoint(str(run_dir), m, opt, load_tokenizer(train_ckpt), train_ckpt, step, settings.saved(c))
    return m


# ---------------------------------------------------------------------------------------
# A training run in a child process, to be signalled


SIGNAL_RUN = "import sys, train; train.main(sys.argv[1:], reward_fn=lambda t, p: float(sum(map(ord, t)) % 2))"


def wait_for_log_lines(path, n, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline and (not path.exists() or len(path.read_text().splitlines()) < n):
        time.sleep(0.05)


# ---------------------------------------------------------------------------------------
# One eviction round on a hand-built layer cache (§4.2, §5.1)


def hand_built_cache(S=12, D=4, H=4, Hkv=2, w=3, seed=0, holes=(2, 7)):
    """A hand-built layer cache for one row: keys at positions 0..S-1, some slots dead."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(1, Hkv, S, D, generator=g)
    q = torch.randn(1, H, w, D, generator=g)
    kpos = torch.arange(S)[None]
    alive = torch.ones(1, S, dtype=torch.bool)
    alive[0, list(holes)] = False
    qpos = torch.arange(S - w, S)[None]
    return q, keys, kpos, alive, qpos


def one_round(c, block, rate, policy, prompt=None):
    """The engine's eviction round on the hand-built cache c under a --policy name (or Eviction
    keywords): σ and log p(σ). prompt: (tokens (1, P), length (1,)); default: the first two keys."""
    sigma, logps = rounds(c, block, rate, policy, 1, prompt)
    return sigma[0][sigma[0] >= 0].tolist(), logps[0, 0].item()


def rounds(c, block, rate, policy, n, prompt=None):
    """The round of one_round in n rows that hold copies of c, drawn at once: σ (n, K), log p (n, 1)."""
    q, keys, kpos, alive, qpos = (x.expand(n, *x.shape[1:]) for x in c)
    layer = LayerCache(n, keys.shape[1], keys.shape[3], keys.shape[2], torch.float32, "cpu")
    layer.append(keys, keys, kpos, alive)
    window = ngc.QueryWindow(1, n, q.shape[2], q.shape[1], q.shape[3], torch.float32, "cpu")
    window.q[0], window.pos, window.valid = q, qpos, torch.ones(qpos.shape, dtype=torch.bool)
    layout = Eviction(delta=64, block=block, window=q.shape[2], rate=rate)
    e = baselines.build(policy, baselines.PolicyInputs(layout, None, None, "countdown")) if isinstance(policy, str) \
        else replace(layout, **policy)  # eval.py's construction by name; these policies read no model or tokenizer
    tokens, lengths = prompt or (kpos[:1, :2], torch.tensor([2]))
    row = torch.arange(n)
    context = ngc.Round(row, None, None, None, tokens.expand(n, -1), lengths.expand(n))
    (sigma,), logps, _ = ngc.eviction_round([layer], window, row, torch.full((n,), rate), e,
                                            context=context)
    survivors = kept_keys(alive, sigma, block)  # the rest are gone, the survivors moved to the front
    assert torch.equal(layer.pos[layer.alive], kpos[survivors]) and torch.equal(layer.fill, survivors.sum(1))
    return sigma, logps


def keep(policy, c, block, rate, prompt=None):
    return one_round(c, block, rate, policy, prompt)[0]


def psi_by_hand(c):
    """ψ (S,): softmax per query head and query over the alive keys it may see, averaged (paper §4.2)."""
    q, keys, kpos, alive, qpos = c
    H, w, D = q.shape[1:]
    psi = torch.zeros(alive.shape[1])
    for h, i in itertools.product(range(H), range(w)):
        seen = [t for t in range(alive.shape[1]) if alive[0, t] and t <= qpos[0, i]]
        logits = torch.stack([q[0, h, i] @ keys[0, h // (H // keys.shape[1]), t] / math.sqrt(D) for t in seen])
        psi[seen] += logits.softmax(0) / (H * w)
    return psi
