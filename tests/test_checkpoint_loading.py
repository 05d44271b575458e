"""Checkpoint loading beyond one file: sharded safetensors, missing shards and tensors, bfloat16,
a tied checkpoint that also stores lm_head.weight (loaded as transformers loads it), an index
that names a file outside the checkpoint, a config field no model can have."""
from __future__ import annotations

import json
import math
import os
import shutil
import sys
import warnings
from pathlib import Path

import pytest
import torch

from helpers import (GreedyReference, _hf_model, assert_no_leak, checkpoint_config, greedy, make_llm,
                     random_prompt)


@pytest.fixture(scope="module")
def sharded_dir(checkpoints, tmp_path_factory) -> str:
    """The qwen3 checkpoint re-saved in several shards, with model.safetensors.index.json."""
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("sharded_qwen3")
    model = AutoModelForCausalLM.from_pretrained(checkpoints["qwen3"], dtype=torch.float32)
    model.save_pretrained(out, max_shard_size="100KB")
    assert (out / "model.safetensors.index.json").is_file()
    assert len(list(out.glob("*.safetensors"))) > 1
    return str(out)


def test_sharded_checkpoint_matches_single_file(checkpoints, sharded_dir):
    prompts = [random_prompt(n, seed=n) for n in (5, 19, 40)]
    outs = make_llm(sharded_dir).generate(prompts, greedy(8), use_tqdm=False)
    GreedyReference(checkpoints["qwen3"]).compare_all(prompts, outs, 8)


def test_missing_shard_is_named(sharded_dir, tmp_path):
    for f in (p for p in Path(sharded_dir).iterdir()):
        shutil.copy(f, tmp_path)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (tmp_path / shard).unlink()
    with pytest.raises(FileNotFoundError, match=shard):
        make_llm(tmp_path)


def test_missing_tensor_is_named(checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    for f in Path(checkpoints["llama"]).iterdir():
        shutil.copy(f, tmp_path)
    weights = load_file(str(tmp_path / "model.safetensors"))
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="layers.1.mlp.gate_up_proj.weight"):
        make_llm(tmp_path)


def test_bfloat16_runs_and_leaks_nothing(llama_dir):
    llm = make_llm(llama_dir, dtype="bfloat16", enable_prefix_caching=False)
    assert llm.dtype == torch.bfloat16
    outs = llm.generate([random_prompt(30, seed=1)] * 2, greedy(8), use_tqdm=False)
    assert outs[0].token_ids == outs[1].token_ids and len(outs[0].token_ids) == 8
    assert_no_leak(llm)


# ----------------------------------------------------------------------------- tied + lm_head

def tied_with_head(out: Path, head: str) -> str:
    """A sharded tied checkpoint (tie_word_embeddings true) whose last shard also stores
    ``lm_head.weight``: ``head`` "other" (its own values), "same" (the embedding's) or "only"
    (the embedding itself left out, as some exporters save a tied model)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_config(checkpoint_config("llama3_tied"), dtype=torch.float32)
    model.save_pretrained(out, max_shard_size="100KB")
    index_path = out / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    weight_map = index["weight_map"]
    first, last = weight_map["model.embed_tokens.weight"], sorted(set(weight_map.values()))[-1]
    assert first != last, "the lm_head must land in a later shard than the embedding"
    embedding = model.model.embed_tokens.weight.detach().clone()
    stored = torch.randn(embedding.shape, generator=torch.Generator().manual_seed(9)) * 0.15
    tensors = load_file(str(out / last))
    tensors["lm_head.weight"] = embedding if head != "other" else stored
    save_file(tensors, str(out / last), metadata={"format": "pt"})
    weight_map["lm_head.weight"] = last
    if head == "only":
        shard = load_file(str(out / first))
        del shard["model.embed_tokens.weight"], weight_map["model.embed_tokens.weight"]
        save_file(shard, str(out / first), metadata={"format": "pt"})
    index_path.write_text(json.dumps(index))
    return str(out)


@pytest.mark.parametrize("head", ["other", "same", "only"])
def test_tied_checkpoint_with_a_stored_lm_head_loads_as_hf(tmp_path, head):
    """transformers 5 unties a tied config whose files hold a different lm_head (and uses
    both); an equal one, or one stored instead of the embedding, stays tied."""
    ckpt = tied_with_head(tmp_path / "ckpt", head)
    hf = _hf_model(ckpt)
    hf_tied = hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    assert hf_tied == (head != "other")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        llm = make_llm(ckpt)
    model = llm.llm_engine.engine_core.model_runner.backend.model
    assert (model.lm_head.weight is model.embed_tokens.weight) == hf_tied
    assert torch.equal(model.lm_head.weight, hf.lm_head.weight)
    assert torch.equal(model.embed_tokens.weight, hf.model.embed_tokens.weight)
    untied_warnings = [w for w in caught if "lm_head.weight" in str(w.message)]
    assert len(untied_warnings) == (0 if hf_tied else 1)
    prompts = [random_prompt(n, seed=n) for n in (6, 33)]
    for path in (dict(), dict(fast_paths=False)):
        outs = make_llm(ckpt, **path).generate(prompts, greedy(10), use_tqdm=False)
        GreedyReference(ckpt).compare_all(prompts, outs, 10)


def test_untied_checkpoint_stays_untied_under_hf_overrides(tmp_path):
    ckpt = tied_with_head(tmp_path / "ckpt", "other")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        llm = make_llm(ckpt, hf_overrides={"max_position_embeddings": 256})
    model = llm.llm_engine.engine_core.model_runner.backend.model
    assert model.lm_head.weight is not model.embed_tokens.weight
    prompts = [random_prompt(n, seed=n) for n in (6, 33)]
    outs = llm.generate(prompts, greedy(10), use_tqdm=False)
    GreedyReference(ckpt).compare_all(prompts, outs, 10)


# ----------------------------------------------------------------------------- checkpoint code

def with_checkpoint_code(tokenizer_ckpt: str, out: Path, in_file: str) -> Path:
    """A copy of ``tokenizer_ckpt`` whose ``in_file`` (tokenizer_config.json or config.json)
    has an auto_map naming the checkpoint's own .py, which writes ``out / "MARKER"`` when run."""
    shutil.copytree(tokenizer_ckpt, out)
    (out / "own_code.py").write_text(
        f"open({str(out / 'MARKER')!r}, 'w').write('the checkpoint code ran')\n"
        "from transformers import LlamaConfig, PreTrainedTokenizerFast\n"
        "class OwnTokenizer(PreTrainedTokenizerFast):\n    pass\n"
        "class OwnConfig(LlamaConfig):\n    pass\n")
    settings = json.loads((out / in_file).read_text())
    if in_file == "tokenizer_config.json":  # a class transformers lacks: only the code has it
        settings.update(tokenizer_class="OwnTokenizer",
                        auto_map={"AutoTokenizer": [None, "own_code.OwnTokenizer"]})
    else:
        settings["auto_map"] = {"AutoConfig": "own_code.OwnConfig"}
    (out / in_file).write_text(json.dumps(settings))
    return out


@pytest.fixture
def no_stdin(monkeypatch) -> list:
    """Every prompt transformers would put on stdin, recorded (then refused)."""
    asked = []

    def refuse(prompt=""):
        asked.append(prompt)
        raise EOFError("stdin is closed")

    monkeypatch.setattr("builtins.input", refuse)
    return asked


@pytest.mark.parametrize("trust", [None, False], ids=["unset", "false"])
def test_tokenizer_code_never_runs_without_trust_remote_code(tokenizer_ckpt, tmp_path, no_stdin,
                                                             trust):
    ckpt = with_checkpoint_code(tokenizer_ckpt, tmp_path / "ckpt", "tokenizer_config.json")
    kwargs = {} if trust is None else dict(trust_remote_code=trust)
    with pytest.raises(ValueError, match="the tokenizer of checkpoint .* needs code from the "
                                         "checkpoint .* only with trust_remote_code=True"):
        make_llm(ckpt, **kwargs)
    assert no_stdin == [] and not (ckpt / "MARKER").exists()


def test_config_code_never_runs_for_a_built_in_model_type(tokenizer_ckpt, tmp_path, no_stdin,
                                                          reference):
    ckpt = with_checkpoint_code(tokenizer_ckpt, tmp_path / "ckpt", "config.json")
    llm = make_llm(ckpt, hf_overrides={"max_position_embeddings": 256})  # both config reads
    prompts = [random_prompt(n, seed=n) for n in (7, 40)]
    reference.compare_all(prompts, llm.generate(prompts, greedy(8), use_tqdm=False), 8)
    assert no_stdin == [] and not (ckpt / "MARKER").exists()


def test_trust_remote_code_true_is_passed_through(tokenizer_ckpt, tmp_path, no_stdin):
    """As in vLLM, the caller's True lets the checkpoint's tokenizer code run."""
    ckpt = with_checkpoint_code(tokenizer_ckpt, tmp_path / "ckpt", "tokenizer_config.json")
    llm = make_llm(ckpt, trust_remote_code=True)
    assert type(llm.get_tokenizer()).__name__ == "OwnTokenizer"
    assert (ckpt / "MARKER").read_text() == "the checkpoint code ran" and no_stdin == []


# ----------------------------------------------------------------------------- the index

_opened: list[str] | None = None  # while a test records: every file Python opens
_hooked = False  # an audit hook cannot be removed: one, for the whole run


def _record_open(event: str, args: tuple) -> None:
    if _opened is not None and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        _opened.append(os.fsdecode(args[0]))


@pytest.fixture
def opened(monkeypatch) -> list[str]:
    """The files the test opens: from Python (the audit hook) or through safetensors'
    ``safe_open`` (whose Rust code opens files unseen by the hook)."""
    import safetensors

    global _opened, _hooked
    if not _hooked:
        sys.addaudithook(_record_open)
        _hooked = True
    files = _opened = []
    real = safetensors.safe_open

    def recording_safe_open(filename, *args, **kwargs):
        files.append(str(filename))
        return real(filename, *args, **kwargs)

    monkeypatch.setattr(safetensors, "safe_open", recording_safe_open)
    yield files
    _opened = None


# the index's file for model.norm.weight, and a symlink (where, to what) the case needs
_ESCAPES = {
    "parent": ("../outside/shard.safetensors", None),
    "absolute": ("{tmp}/outside/shard.safetensors", None),
    "symlinked-dir": ("link/shard.safetensors", ("link", "../outside")),
    # the control of the Hugging Face cache's layout: a snapshot's file links to a blob
    "linked-file": ("shard.safetensors", ("shard.safetensors", "../outside/shard.safetensors")),
    "subfolder": ("sub/../../outside/shard.safetensors", None),
    "inside": ("sub/shard.safetensors", None),  # the control: the same file inside loads
}


@pytest.mark.parametrize("case", list(_ESCAPES))
def test_an_index_naming_a_file_outside_the_checkpoint_is_refused(llama_dir, tmp_path, opened,
                                                                  case):
    """Refused naming the entry, and nothing outside is opened, though the file there (a valid
    copy of the weights) would load."""
    from safetensors import safe_open

    name, link = _ESCAPES[case]
    name = name.format(tmp=tmp_path)
    ckpt, outside = tmp_path / "ckpt", tmp_path / "outside"
    shutil.copytree(llama_dir, ckpt)
    outside.mkdir()
    (ckpt / "sub").mkdir()
    for copy in (outside / "shard.safetensors", ckpt / "sub" / "shard.safetensors"):
        shutil.copy(ckpt / "model.safetensors", copy)
    if link:
        (ckpt / link[0]).symlink_to(link[1])
    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
        weight_map = {tensor: "model.safetensors" for tensor in f.keys()}
    weight_map["model.norm.weight"] = name
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    opened.clear()
    if case == "linked-file":  # a member of the folder, wherever its link points
        make_llm(ckpt)
        assert str(ckpt / "shard.safetensors") in opened
        return
    if case == "inside":
        make_llm(ckpt)
        assert str(ckpt / "sub" / "shard.safetensors") in opened
    else:
        with pytest.raises(ValueError, match="outside the checkpoint directory") as err:
            make_llm(ckpt)
        assert f"'model.norm.weight' -> {name!r}" in str(err.value)
        assert not [f for f in opened if f.endswith(".safetensors")]  # refused before any is read
    assert not [f for f in opened if Path(f).resolve().is_relative_to(outside)]


@pytest.mark.parametrize("index, named", [
    ("{", "cannot read checkpoint index"),
    ({"metadata": {}}, "weight_map must be a JSON object .* but it is missing"),
    ({"weight_map": ["model.safetensors"]}, "weight_map must be a JSON object .* but it is a list"),
    ({"weight_map": {"model.norm.weight": 5}}, "entry 'model.norm.weight' -> 5: the file name"),
    ({"weight_map": {"model.norm.weight": None}}, "entry 'model.norm.weight' -> None: the file"),
], ids=["not-json", "missing", "list", "number", "null"])
def test_an_index_whose_weight_map_is_not_names_to_files_is_refused(llama_dir, tmp_path, index,
                                                                    named):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(llama_dir, ckpt)
    text = index if isinstance(index, str) else json.dumps(index)
    (ckpt / "model.safetensors.index.json").write_text(text)
    with pytest.raises(ValueError, match=named) as err:
        make_llm(ckpt)
    assert str(ckpt / "model.safetensors.index.json") in str(err.value)


# ----------------------------------------------------------------------------- config fields

_ABSENT = "absent"  # the field left out of config.json (a string: test ids must not vary)
_DEFAULT_ROPE = {"rope_type": "default"}


@pytest.mark.parametrize("field, changes", [
    ("vocab_size", {"vocab_size": -5}), ("vocab_size", {"vocab_size": 0}),
    ("vocab_size", {"vocab_size": 512.0}), ("vocab_size", {"vocab_size": "512"}),
    ("vocab_size", {"vocab_size": True}),
    ("num_attention_heads", {"num_attention_heads": 0}),  # a Llama: ZeroDivisionError in HF
    ("num_attention_heads", {"num_attention_heads": -4}),
    ("num_attention_heads", {"num_attention_heads": 4.0}),
    ("num_key_value_heads", {"num_key_value_heads": 0}),
    ("num_key_value_heads", {"num_key_value_heads": 3}),  # does not divide 4 heads
    ("hidden_size", {"hidden_size": 0}), ("hidden_size", {"hidden_size": 66, "head_dim": _ABSENT}),
    ("num_hidden_layers", {"num_hidden_layers": 0}),
    ("num_hidden_layers", {"num_hidden_layers": -1}),
    ("intermediate_size", {"intermediate_size": 0}),
    ("head_dim", {"head_dim": 0}), ("head_dim", {"head_dim": "32"}),
    ("rms_norm_eps", {"rms_norm_eps": 0.0}), ("rms_norm_eps", {"rms_norm_eps": -1e-6}),
    ("rms_norm_eps", {"rms_norm_eps": math.nan}), ("rms_norm_eps", {"rms_norm_eps": math.inf}),
    ("rope_theta", {"rope_parameters": {**_DEFAULT_ROPE, "rope_theta": 0.0}}),
    ("rope_theta", {"rope_parameters": {**_DEFAULT_ROPE, "rope_theta": -10000}}),
    ("max_position_embeddings", {"max_position_embeddings": 0}),
    # the same check where an override sets the field, and where no weight is read
    ("num_hidden_layers", {"hf_overrides": {"num_hidden_layers": 0}}),
    ("num_key_value_heads", {"hf_overrides": {"num_key_value_heads": 3}}),
    ("vocab_size", {"vocab_size": -5, "load_format": "dummy"}),
], ids=lambda p: p if isinstance(p, str) else ",".join(f"{k}={v!r}" for k, v in p.items()))
def test_an_impossible_config_field_is_refused_naming_it(llama_dir, tmp_path, monkeypatch, field,
                                                       changes):
    """Refused naming the field and config.json before a tensor is built (transformers 5
    refuses a float or string count itself, but in words that name no file)."""
    import model

    def built(*args, **kwargs):
        raise AssertionError("a model was built from an impossible config")

    monkeypatch.setattr(model.CausalLM, "__init__", built)
    ckpt = tmp_path / "ckpt"
    shutil.copytree(llama_dir, ckpt)
    engine_args = {k: v for k, v in changes.items() if k in ("hf_overrides", "load_format")}
    config = json.loads((ckpt / "config.json").read_text())
    config.update((k, v) for k, v in changes.items() if k not in engine_args)
    config = {k: v for k, v in config.items() if v != _ABSENT}
    (ckpt / "config.json").write_text(json.dumps(config))
    overridden = " with hf_overrides" if "hf_overrides" in engine_args else ""
    with pytest.raises(ValueError, match=f"{field} is ") as err:
        make_llm(ckpt, **engine_args)
    assert f"checkpoint config {ckpt / 'config.json'}{overridden}: {field} is " in str(err.value)
