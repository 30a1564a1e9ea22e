"""The model (model.py, checkpoint.py): a Qwen2 with a KV cache, loaded from and saved to the Hugging
Face layout, and add_meta_token's surgery on its vocabulary."""
import json
import os
import shutil
import time
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from lib import checkpoint, rundir, settings
import train

from lib.checkpoint import META_TOKEN, add_meta_token, config_from_dict, from_pretrained, load_tokenizer
from lib.cli import Error
from model import KVCache, Qwen2, Qwen2Config, init_weights
from conftest import EOS, TINY_MODEL, TRAIN_DEFAULTS, prompts_of, save_small_checkpoint, write_checkpoint


# ---------------------------------------------------------------------------------------
# The model is Qwen2


def test_cached_decode_equals_full_forward(model):
    x = torch.tensor(prompts_of([20])[0])[None]
    pos = torch.arange(20)[None]
    full = model.logits(model(x, pos))
    cache = KVCache(model.config, 1, 20, torch.float32, "cpu")
    steps = [model.logits(model(x[:, :7], pos[:, :7], cache=cache, valid=torch.ones(1, 7, dtype=torch.bool)))]
    for t in range(7, 20):
        steps.append(model.logits(model(x[:, t:t + 1], pos[:, t:t + 1], cache=cache,
                                        valid=torch.ones(1, 1, dtype=torch.bool))))
    diff = (torch.cat(steps, 1) - full).abs().max().item()
    assert diff < 1e-5
    # RoPE is relative: a uniform shift of positions changes nothing, a gap changes logits.
    assert (model.logits(model(x, pos + 3)) - full).abs().max() < 1e-4
    gap = torch.where(pos >= 10, pos + 3, pos)
    assert (model.logits(model(x, gap)) - full).abs().max() > 1e-3


def test_sharded_and_single_file_checkpoints_agree(ckpt, tmp_path, model):
    state = load_file(os.path.join(ckpt, "model.safetensors"))
    names = sorted(state)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in halves.items():
        save_file({n: state[n] for n in part}, tmp_path / file)
    index = {"weight_map": {n: f for f, part in halves.items() for n in part}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "config.json").write_text(open(os.path.join(ckpt, "config.json")).read())
    sharded = from_pretrained(str(tmp_path))
    x = torch.tensor(prompts_of([9])[0])[None]
    pos = torch.arange(9)[None]
    assert torch.equal(sharded.logits(sharded(x, pos)), model.logits(model(x, pos)))


def test_tied_and_untied_heads_load(tmp_path):
    for tied in (True, False):
        path = write_checkpoint(tmp_path / str(tied), tie_word_embeddings=tied)
        names = load_file(os.path.join(path, "model.safetensors")).keys()
        assert ("lm_head.weight" in names) != tied
        m = from_pretrained(path)
        assert (m.lm_head.weight is m.model.embed_tokens.weight) == tied
        assert load_tokenizer(path).token_to_id("<eos>") == EOS


def test_bad_checkpoints_name_the_tensor(ckpt, tmp_path):
    state = load_file(os.path.join(ckpt, "model.safetensors"))
    config = open(os.path.join(ckpt, "config.json")).read()
    (tmp_path / "config.json").write_text(config)
    wrong = dict(state)
    wrong["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(3, 3)
    save_file(wrong, tmp_path / "model.safetensors")
    with pytest.raises(Error, match=r"model\.layers\.1\.self_attn\.k_proj\.weight.*shape"):
        from_pretrained(str(tmp_path))
    missing = {k: v for k, v in state.items() if k != "model.layers.2.mlp.up_proj.weight"}
    save_file(missing, tmp_path / "model.safetensors")
    with pytest.raises(Error, match=r"model\.layers\.2\.mlp\.up_proj\.weight"):
        from_pretrained(str(tmp_path))
    save_file({**state, "model.layers.0.mlp.extra.weight": torch.zeros(2)}, tmp_path / "model.safetensors")
    with pytest.raises(Error, match=r"Unexpected key.*model\.layers\.0\.mlp\.extra\.weight"):
        from_pretrained(str(tmp_path))
    with pytest.raises(Error, match="no config.json"):
        from_pretrained(str(tmp_path / "nowhere"))


def test_absurd_sizes_are_refused_before_a_layer_is_built(ckpt, tmp_path):
    """config.json's sizes against bounds no Qwen2 reaches (10^9 layers would build for hours), and
    against the weights' headers before a weight is read."""
    d = json.load(open(os.path.join(ckpt, "config.json")))
    shutil.copy(os.path.join(ckpt, "model.safetensors"), tmp_path)
    for key, value in (("num_hidden_layers", 10**9), ("vocab_size", 10**12)):
        (tmp_path / "config.json").write_text(json.dumps({**d, key: value}))
        start = time.perf_counter()
        with pytest.raises(Error, match=rf"config.json: {key} is {value}, above \d+: no Qwen2 is that large"):
            from_pretrained(str(tmp_path))
        assert time.perf_counter() - start < 5
    (tmp_path / "config.json").write_text(json.dumps({**d, "vocab_size": d["vocab_size"] + 1}))
    headers_only = lambda *a, **k: SimpleNamespace(keys=(f := safe_open(*a, **k)).keys, get_slice=f.get_slice)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(checkpoint, "safe_open", headers_only)  # no get_tensor: a read would fail
        with pytest.raises(Error, match=r"size mismatch for model\.embed_tokens\.weight"):
            from_pretrained(str(tmp_path))


def test_config_generations_and_refusals(ckpt, tmp_path):
    d = json.load(open(os.path.join(ckpt, "config.json")))
    new = {k: v for k, v in d.items() if k != "rope_theta"}
    new["rope_parameters"] = {"rope_type": "default", "rope_theta": 1234.0}
    assert config_from_dict(new).rope_theta == 1234.0
    assert config_from_dict({**d, "rope_theta": 99.0}).rope_theta == 99.0
    with pytest.raises(Error, match="rope_scaling"):
        config_from_dict({**d, "rope_scaling": {"type": "yarn", "factor": 4}})
    with pytest.raises(Error, match="sliding"):
        config_from_dict({**d, "use_sliding_window": True, "sliding_window": 64})
    assert config_from_dict({**d, "use_sliding_window": False, "sliding_window": 64}).hidden_size == 64


# ---------------------------------------------------------------------------------------
# A run's checkpoint loads back, here and in transformers


def test_checkpoint_loads_back_with_identical_logits(train_ckpt, tmp_path):
    m = save_small_checkpoint(train_ckpt, tmp_path)
    back = from_pretrained(os.path.join(tmp_path, "checkpoint"))
    x = torch.tensor(prompts_of([12])[0])[None]
    pos = torch.arange(12)[None]
    assert torch.equal(back.logits(back(x, pos)), m.logits(m(x, pos)))
    assert sorted(os.listdir(tmp_path / "checkpoint")) == [
        "config.json", "generation_config.json", "model.safetensors", "ngc.json", "tokenizer.json",
        "tokenizer_config.json", "trainer.pt"]
    assert settings.run_defaults(str(tmp_path / "checkpoint")).delta == TRAIN_DEFAULTS["delta"]
    assert settings.saved(settings.run_defaults(str(tmp_path / "checkpoint")))["retention"] == TRAIN_DEFAULTS["retention"]
    tok_cfg = json.loads((tmp_path / "checkpoint" / "tokenizer_config.json").read_text())
    assert tok_cfg["eos_token"] == "<eos>" and tok_cfg["pad_token"] == "<pad>"
    assert json.loads((tmp_path / "checkpoint" / "generation_config.json").read_text())["eos_token_id"] == EOS
    # Control: another scale gives other logits, so the equality above is not vacuous.
    other = save_small_checkpoint(train_ckpt, tmp_path / "b", scale=2.0)
    assert not torch.equal(other.logits(other(x, pos)), m.logits(m(x, pos)))


def test_checkpoint_carries_the_chat_template_and_generation_config(train_ckpt, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(train_ckpt, src)
    (src / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}", "eos_token": "<eos>"}))
    (src / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS, "temperature": 0.6, "top_p": 0.95}))
    m, tok = from_pretrained(str(src)), load_tokenizer(str(src))
    c = train.resolve(train.parse_args(["--model", str(src), "--out", str(tmp_path / "run")]))
    rundir.save_checkpoint(str(tmp_path / "run"), m, train.make_optimizer(m, c), tok, str(src), 0, settings.saved(c))
    out = tmp_path / "run" / "checkpoint"
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_cfg["chat_template"] == "{{ messages }}" and tok_cfg["pad_token"] == "<pad>"
    assert json.loads((out / "generation_config.json").read_text())["top_p"] == 0.95


def test_transformers_loads_the_checkpoint(train_ckpt, tmp_path):
    """The checkpoint is a complete Hugging Face directory: model and tokenizer load in transformers
    (when it is installed; it is never needed at run time) and give our logits."""
    transformers = pytest.importorskip("transformers")
    m = save_small_checkpoint(train_ckpt, tmp_path)
    path = str(tmp_path / "checkpoint")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(path)  # no token invented: pad and EOS are ours
    assert (tok.pad_token, tok.pad_token_id, tok.eos_token_id) == ("<pad>", 0, EOS) and len(tok) == 96
    # transformers 5 builds Qwen2's byte-level BPE class for model_type qwen2 whatever the file says;
    # this word-level test tokenizer (like tiny/'s) loads as it is with the generic class.
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(path)
    batch = tok(["w5 w6 w7", "w9"], padding=True, return_tensors="pt")
    assert batch["input_ids"].tolist() == [[5, 6, 7], [9, 0, 0]] and tok.pad_token_id == 0
    x = torch.tensor(prompts_of([12])[0])[None]
    with torch.no_grad():
        ours = m.logits(m(x, torch.arange(12)[None]))
        assert (hf(x).logits - ours).abs().max() < 1e-4


# ---------------------------------------------------------------------------------------
# add_meta_token: the meta-token's row (Appendix)


@pytest.mark.parametrize("tied", [False, True])
def test_add_meta_token_grows_the_vocabulary_with_the_mean_row(tmp_path, tied):
    """The tiny tokenizer covers all 96 rows, so g gets id 96 and one new row (tied or untied head),
    equal to the mean of the rows of the given text's tokens; every other row is unchanged."""
    path = write_checkpoint(tmp_path / "m", tie_word_embeddings=tied)
    model, tok = from_pretrained(path), load_tokenizer(path)
    emb, head = model.model.embed_tokens.weight.detach().clone(), model.lm_head.weight.detach().clone()
    g = add_meta_token(model, tok, text="w3 w7 w11")
    assert g == 96 and tok.token_to_id(META_TOKEN) == g and model.config.vocab_size == 97
    assert tok.encode(f"w3 {META_TOKEN} w5", add_special_tokens=False).ids == [3, g, 5]
    assert tok.decode([3, g, 5], skip_special_tokens=True) == "w3 w5"  # the reward never reads g
    new_emb, new_head = model.model.embed_tokens.weight, model.lm_head.weight
    assert new_emb.shape == new_head.shape == (97, 64) and (new_head is new_emb) == tied
    assert torch.equal(new_emb[:96], emb) and torch.equal(new_head[:96], head)
    mean = emb[[3, 7, 11]].mean(0)
    assert (new_emb[g] - mean).abs().max() < 1e-7
    assert (new_head[g] - (mean if tied else head[[3, 7, 11]].mean(0))).abs().max() < 1e-7
    assert (mean - emb[3]).abs().max() > 1e-2  # control: the mean is no single row
    assert new_emb.requires_grad and model.model.embed_tokens.num_embeddings == model.lm_head.out_features == 97
    out = model.logits(model(torch.tensor([[3, g, 5]]), torch.arange(3)[None]))
    assert out.shape == (1, 3, 97)


def test_add_meta_token_takes_a_spare_row_and_falls_back_when_the_text_is_unknown(ckpt, capsys):
    """R1 has more embedding rows than tokens: g takes the first spare one and nothing grows. The tiny
    word-level tokenizer does not know "tl;dr" (it maps it to <pad>, its unk): g is the mean of all rows."""
    model = init_weights(Qwen2(Qwen2Config(**{**TINY_MODEL, "vocab_size": 100})), std=0.1)
    tok = load_tokenizer(ckpt)  # 96 tokens for 100 rows
    assert tok.encode("tl;dr", add_special_tokens=False).ids == [0]
    emb, head = model.model.embed_tokens.weight.detach().clone(), model.lm_head.weight.detach().clone()
    g = add_meta_token(model, tok)
    assert g == 96 and model.config.vocab_size == 100 and model.lm_head.weight.shape == (100, 64)
    assert "has no tokens for 'tl;dr'" in capsys.readouterr().out
    assert (model.model.embed_tokens.weight[g] - emb.mean(0)).abs().max() < 1e-7
    assert (model.lm_head.weight[g] - head.mean(0)).abs().max() < 1e-7
    others = torch.arange(100) != g
    assert torch.equal(model.model.embed_tokens.weight[others], emb[others])
    assert torch.equal(model.lm_head.weight[others], head[others])
    assert (emb.mean(0) - emb[0]).abs().max() > 1e-2  # control: not <pad>'s own row
