"""Checkpoints in the Hugging Face layout (config.json, (sharded) *.safetensors, tokenizer.json),
read and written without transformers, so R1's own directory and the tiny models load through the
same code; and the meta-token's surgery on a checkpoint (paper, Appendix "Compression via
Meta-Tokens")."""
import json
import os
from dataclasses import fields

import torch
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import save_file

from model import Qwen2, Qwen2Config
from lib.cli import Error
from lib.files import write_atomic, write_json


def read_json(path: str, advice: str = ""):
    """The JSON in path, or an Error that ends with `advice`."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as e:  # another user's file, a directory
        raise Error(f"cannot read {path} ({e.strerror}){advice}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise Error(f"{path} is not valid JSON ({e}){advice}") from None


def _token_id(value) -> bool:
    return type(value) is int and value >= 0  # a bool is no id


# config.json's keys that this Qwen2 reads, and what each accepts (a test, in words); REQUIRED have
# no default (a missing one would silently be R1-1.5B's), LIMITS lie far above any Qwen2 (R1-1.5B:
# 28 layers of 1536; Qwen2-72B: 80 of 8192)
REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads")
CONFIG_VALUES = {
    **dict.fromkeys((*REQUIRED, "max_position_embeddings"),
                    (lambda v: _token_id(v) and v > 0, "a positive integer")),
    **dict.fromkeys(("rope_theta", "rms_norm_eps"),
                    (lambda v: type(v) in (int, float) and v > 0, "a positive number")),
    "tie_word_embeddings": (lambda v: type(v) is bool, "true or false"),
    "bos_token_id": (lambda v: v is None or _token_id(v), "a token id or null"),
    "eos_token_id": (lambda v: v is None or _token_id(v) or type(v) is list
                     and all(map(_token_id, v)), "a token id, a list of them, or null")}
LIMITS = {"num_hidden_layers": 1024, "hidden_size": 65536, "intermediate_size": 1 << 20,
          "num_attention_heads": 1024, "num_key_value_heads": 1024, "vocab_size": 1 << 24,
          "max_position_embeddings": 1 << 24}


def load_config(path: str) -> Qwen2Config:
    """config.json of checkpoint directory `path`, or an Error naming a missing key or bad value."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise Error(f"no config.json in {path!r}: pass a Hugging Face Qwen2 checkpoint directory")
    d = read_json(cfg_path)
    if missing := [k for k in REQUIRED if not isinstance(d, dict) or k not in d]:
        raise Error(f"{cfg_path} lacks {', '.join(missing)}; a Qwen2 config.json has them all")
    for key, (accepts, words) in CONFIG_VALUES.items():
        if key in d and not accepts(d[key]):
            raise Error(f"{cfg_path}: {key} is {json.dumps(d[key])}; it must be {words}")
        if key in LIMITS and d.get(key, 0) > LIMITS[key]:
            raise Error(f"{cfg_path}: {key} is {d[key]}, above {LIMITS[key]}: no Qwen2 is that "
                        f"large")
    return config_from_dict(d)


SUPPORTED = {"model_type": "qwen2", "hidden_act": "silu", "rope_type": "default",
             "rope_scaling": None, "use_sliding_window": False}  # null or absent: the same


def config_from_dict(d: dict) -> Qwen2Config:
    """A config.json's contents as a Qwen2Config, refusing what this Qwen2 does not implement."""
    rope = d.get("rope_parameters") or {}  # newer config.json files keep rope_theta here
    for key, value in {**d, "rope_type": rope.get("rope_type")}.items():
        if key in SUPPORTED and (value or SUPPORTED[key]) != SUPPORTED[key]:
            raise Error(f"{key} is {json.dumps(value)}; this Qwen2 supports only "
                        f"{json.dumps(SUPPORTED[key])}")
    cfg = Qwen2Config(**{k: v for k, v in d.items() if k in {f.name for f in fields(Qwen2Config)}})
    cfg.rope_theta = rope.get("rope_theta", cfg.rope_theta)
    if d.get("head_dim", cfg.head_dim) != cfg.head_dim:
        raise Error(f"head_dim {d['head_dim']} != hidden_size / num_attention_heads; not supported")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise Error("num_attention_heads must be a multiple of num_key_value_heads")
    return cfg


def _weight_files(path: str) -> list[str]:
    """model.safetensors, or the shards that model.safetensors.index.json's weight_map names."""
    single, index = (os.path.join(path, "model.safetensors"),
                     os.path.join(path, "model.safetensors.index.json"))
    if not os.path.exists(index):
        if os.path.exists(single):
            return [single]
        raise Error(f"{path} has neither model.safetensors nor model.safetensors.index.json")
    d = read_json(index, "; re-download it or re-save the checkpoint")
    weight_map = d.get("weight_map") if isinstance(d, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) and v
                                                   for v in weight_map.values()):
        raise Error(f"{index} has no weight_map of tensor names to shard files; re-download it "
                    "or re-save the checkpoint")
    return sorted({os.path.join(path, name) for name in weight_map.values()})


def from_pretrained(path: str, dtype=torch.float32, device="cpu") -> Qwen2:
    """Load config.json and (sharded) safetensors weights, strictly: a missing, unexpected or
    mis-shaped tensor (checked on the files' headers, before any weight is read), or one holding a
    NaN or an infinity (a diverged run's, a bad conversion), is an Error."""
    cfg = load_config(path)
    with torch.device("meta"):
        model = Qwen2(cfg)
    files = {file: _open_weights(file, device) for file in _weight_files(path)}
    names = {name: (file, f) for file, f in files.items() for name in f.keys()
             if not name.endswith("rotary_emb.inv_freq")}  # RoPE's table: computed here, not loaded
    shapes = {name: torch.empty(f.get_slice(name).get_shape(), device="meta")
              for name, (_, f) in names.items()}
    _load_strictly(model, _tied(shapes, cfg), path)
    tensors = {}
    for name, (file, f) in names.items():
        tensors[name] = f.get_tensor(name).to(dtype)
        if not torch.isfinite(tensors[name]).all():
            raise Error(f"{file}: {name} holds values that are not finite (NaN or inf): these "
                        f"weights are no model; use a checkpoint saved before they went bad")
    _load_strictly(model, _tied(tensors, cfg), path)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.to(device)


def _open_weights(file: str, device):
    try:
        return safe_open(file, framework="pt", device=str(device))
    except Exception as e:  # missing, empty, truncated or not safetensors at all
        raise Error(f"{file} is not a readable safetensors file ({e}); "
                    f"re-download or re-save it") from None


def _tied(tensors: dict, cfg: Qwen2Config) -> dict:
    """Tied embeddings are one matrix, embed_tokens's; a copy saved as lm_head.weight is ignored."""
    if not cfg.tie_word_embeddings:
        return tensors
    tensors = {k: v for k, v in tensors.items() if k != "lm_head.weight"}
    return {**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"]} \
        if "model.embed_tokens.weight" in tensors else tensors


def _load_strictly(model: Qwen2, tensors: dict, path: str):
    """load_state_dict(strict=True); its report (missing, unexpected, mis-shaped) in one line."""
    try:
        model.load_state_dict(tensors, assign=True)
    except RuntimeError as e:
        report = "; ".join(line.strip() for line in str(e).splitlines()[1:])
        raise Error(f"the weights of {path} do not fit its config.json: {report[:400]}") from None


def load(path: str, device="cpu", meta_token: bool = False, dtype=torch.float32):
    """The model and tokenizer of checkpoint directory `path`; meta_token: with the meta-token g
    (added if the checkpoint lacks it, see add_meta_token)."""
    model, tokenizer = from_pretrained(path, dtype=dtype, device=device), load_tokenizer(path)
    # a run's checkpoint copies them
    for name in ("tokenizer_config.json", "generation_config.json"):
        if os.path.isfile(os.path.join(path, name)):
            read_json(os.path.join(path, name))
    top = max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1)
    # another model's tokenizer (R1's config has spare rows past its ids)
    if top >= model.config.vocab_size:
        raise Error(f"{os.path.join(path, 'tokenizer.json')} has token ids up to {top}, but "
                    f"vocab_size is {model.config.vocab_size}: the tokenizer is another model's")
    if meta_token:
        add_meta_token(model, tokenizer)
    return model, tokenizer


def save_pretrained(model: Qwen2, path: str, tensors: dict | None = None):
    """Write config.json and model.safetensors (model's weights, or `tensors`) into path."""
    os.makedirs(path, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous()
               for k, v in (tensors or model.state_dict()).items()}
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    config = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
              "use_sliding_window": False, "rope_scaling": None,
              **{f.name: getattr(model.config, f.name) for f in fields(model.config)},
              "torch_dtype": str(next(iter(tensors.values())).dtype).removeprefix("torch.")}
    write_json(os.path.join(path, "config.json"), config, indent=2)
    write_atomic(os.path.join(path, "model.safetensors"),
                 lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))


def load_tokenizer(path: str):
    from tokenizers import Tokenizer
    file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(file):
        raise Error(f"no tokenizer.json in {path!r}: copy it from the model's Hugging Face "
                    f"repository")
    try:
        return Tokenizer.from_file(file)
    except Exception as e:
        raise Error(f"{file} is not a readable tokenizer "
                    f"({str(e).splitlines()[0][:200]})") from None


def save_tokenizer(tokenizer, path: str, cfg: Qwen2Config, source: str | None = None):
    """Write tokenizer.json, tokenizer_config.json and generation_config.json into path, so that
    Hugging Face's AutoTokenizer and generate() need no guessing: the source checkpoint's two config
    files (chat template and all), what they lack filled in from cfg's special-token ids."""
    def source_json(name):  # a broken one: an Error naming it
        file = os.path.join(source, name) if source else ""
        return read_json(file) if os.path.isfile(file) else {}

    write_atomic(os.path.join(path, "tokenizer.json"), tokenizer.save)
    tok_cfg = source_json("tokenizer_config.json")
    tok_cfg.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    for name, token_id in {"bos_token": cfg.bos_token_id,
                           "eos_token": (cfg.eos_ids or [None])[0]}.items():
        if tok_cfg.get(name) is None and token_id is not None:
            tok_cfg[name] = tokenizer.id_to_token(token_id)
    # padded batches need one; <pad> if the vocab has it, else EOS
    if tok_cfg.get("pad_token") is None:
        tok_cfg["pad_token"] = ("<pad>" if tokenizer.token_to_id("<pad>") is not None
                                else tok_cfg.get("eos_token"))
    if tok_cfg.get("unk_token") is None:  # written even when null, or transformers invents one
        tok_cfg["unk_token"] = "<unk>" if tokenizer.token_to_id("<unk>") is not None else None
    gen_cfg = {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
               **source_json("generation_config.json")}
    for name, content in (("tokenizer_config.json", tok_cfg), ("generation_config.json", gen_cfg)):
        write_json(os.path.join(path, name), content, indent=2)


META_TOKEN = "<|meta|>"


@torch.no_grad()
def add_meta_token(model: Qwen2, tokenizer, text: str = "tl;dr", token: str = META_TOKEN) -> int:
    """The id of the meta-token g (paper, Appendix "Compression via Meta-Tokens"), added where the
    checkpoint lacks it (its row may be trained): a special token whose embedding (and untied LM
    head) row is the mean of `text`'s tokens' rows; the matrices grow only if g's id has no row (R1
    has spare rows). Call it before making the optimizer."""
    from tokenizers import AddedToken
    g = tokenizer.token_to_id(token)
    if g is not None and g < model.config.vocab_size:
        return g
    if g is None:
        tokenizer.add_special_tokens([AddedToken(token, special=True)])
        g = tokenizer.token_to_id(token)
    embed = model.model.embed_tokens
    # a word-level tokenizer maps unknown words to it
    unk = getattr(tokenizer.model, "unk_token", None)
    unk_id = tokenizer.token_to_id(unk) if unk else None
    ids = [i for i in tokenizer.encode(text, add_special_tokens=False).ids
           if i != unk_id and i < embed.num_embeddings]
    if not ids:
        print(f"note: the tokenizer has no tokens for {text!r}; {token}'s embedding is the mean "
              f"of all rows")
        ids = list(range(embed.num_embeddings))
    if g >= model.config.vocab_size:  # rows up to g: g's is set below (any between stay zero)
        extra = g + 1 - model.config.vocab_size
        grow = lambda w: nn.Parameter(torch.cat([w, w.new_zeros(extra, w.shape[1])]))
        embed.weight = grow(embed.weight)
        model.lm_head.weight = (embed.weight if model.config.tie_word_embeddings
                                else grow(model.lm_head.weight))
        embed.num_embeddings = model.lm_head.out_features = model.config.vocab_size = g + 1
    embed.weight[g] = embed.weight[ids].mean(0)
    if not model.config.tie_word_embeddings:
        model.lm_head.weight[g] = model.lm_head.weight[ids].mean(0)
    return g
