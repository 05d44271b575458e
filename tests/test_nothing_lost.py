"""Nothing lost when something goes wrong, one test per class of failure:

* one caller's clean-up never touches another caller's request (ids are reused);
* a step that fails after the forward (a hook raising while blocks are saved) is rolled back
  and run again, instead of wedging the engine;
* an abort asked for from inside a step (a hook) is applied after the step's work;
* a checkpoint is loaded exactly as Hugging Face would run it, or refused naming the problem;
* text is not lost where the prompt ends inside a character;
* a cache_salt that cannot be hashed is refused naming it; the prompt-token metric counts a
  prompt once, preemptions or not.

(An interrupt at every line of the bookkeeping: test_interrupts.py.)
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, RequestOutputKind, SamplingParams
from helpers import (DEMO_MODEL_DIR, GreedyReference, assert_no_leak, drain, greedy, make_llm,
                     random_prompt)
from invariants import assert_idle, check_accounting, engine_core


FINAL = RequestOutputKind.FINAL_ONLY


# ----------------------------------------------------------------------------- ids and clean-up

def test_a_callers_clean_up_never_aborts_another_callers_request(llama_dir):
    """generate() on a short and a long prompt; once the short one ("0") has finished, another
    client queues its own request under the freed id "0" (here from a hook the engine calls
    between, so it happens at a known moment). When generate() returns, its clean-up must
    leave that request alone: it runs to its end."""
    llm = make_llm(llama_dir, block_size=4)
    real_hash, requests, other = llm.prefix_cache.hash_fn, engine_core(llm).output_processor.requests, {}

    def hash_fn(data: bytes, seed: int) -> int:
        if not other and "0" not in requests:
            other["id"] = llm.llm_engine.add_request("0", random_prompt(6, 2), greedy(40, output_kind=FINAL))
        return real_hash(data, seed)

    llm.prefix_cache.hash_fn = hash_fn
    outs = llm.generate([random_prompt(5, 1), random_prompt(30, 3)], [greedy(1), greedy(30)],
                        use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [1, 30] and other["id"] == "0"
    finished = drain(llm)
    assert finished["0"].finished and len(finished["0"].token_ids) == 40
    assert finished["0"].finish_reason == "length"
    assert_idle(llm)


def test_a_progress_bar_factory_is_used_as_vllm_does(llama_dir):
    """use_tqdm may be the bar's factory (vLLM calls it with total=...); it sees every request."""
    made = []

    class Bar:
        def __init__(self, total, **kwargs):
            self.total, self.n = total, 0
            made.append(self)

        def update(self, n):
            self.n += n

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    make_llm(llama_dir).generate([random_prompt(5, 1), random_prompt(9, 2)], greedy(3), use_tqdm=Bar)
    assert [(bar.total, bar.n) for bar in made] == [(2, 2)]


# ----------------------------------------------------------------------------- failing hooks

def test_a_hash_hook_failing_while_blocks_are_saved_costs_one_retried_step(llama_dir, reference):
    """The README invites swapping hash_fn. One that raises once, while a step commits (the
    forward done, the blocks being saved): the step raises, is rolled back, and the next step
    runs it again; every request then finishes with Hugging Face's tokens."""
    llm = make_llm(llama_dir, block_size=4, hash_strategy="recompute", max_num_batched_tokens=16)
    core, real_hash = engine_core(llm), llm.prefix_cache.hash_fn
    committing, fired = [], []
    commit = core.scheduler.commit
    core.scheduler.commit = lambda chunks: committing.append(1) or commit(chunks)

    def hash_fn(data: bytes, seed: int) -> int:
        if committing and not fired:
            fired.append(1)
            raise RuntimeError("hash service unavailable")
        return real_hash(data, seed)

    llm.prefix_cache.hash_fn = hash_fn
    prompts = [random_prompt(n, seed=n) for n in (9, 14, 23)]
    ids = [llm.add_request(p, greedy(6)) for p in prompts]
    with pytest.raises(RuntimeError, match="hash service"):
        while not fired:
            committing.clear()
            llm.step()
    check_accounting(llm)
    outputs = drain(llm)
    reference.compare_all(prompts, [outputs[i] for i in ids], 6)
    assert_idle(llm)


def test_an_abort_from_inside_a_step_is_applied_after_it(tokenizer_ckpt):
    """The tokenizer aborting a request while a step decodes that very request's token: the
    step finishes, the abort lands after it, and generate() returns every output -- the
    aborted one with finish_reason "abort"."""
    llm = make_llm(tokenizer_ckpt)
    tokenizer, aborted, calls = llm.get_tokenizer(), [], []
    decode = tokenizer.decode

    def decode_and_abort(*args, **kwargs):
        calls.append(1)  # two per token: the 3rd call decodes request 1's first token
        if len(calls) == 3:
            aborted.append(llm.abort("1"))
        return decode(*args, **kwargs)

    tokenizer.decode = decode_and_abort
    prompts = [random_prompt(9, 4), random_prompt(13, 5)]
    outs = llm.generate(prompts, greedy(5), use_tqdm=False)
    assert aborted == [True]
    assert [o.request_id for o in outs] == ["0", "1"]
    assert outs[1].finish_reason == "abort" and outs[1].finished
    GreedyReference(tokenizer_ckpt).compare(prompts[0], outs[0].token_ids, 5, "the request left running")
    assert_idle(llm)


# ----------------------------------------------------------------------------- loading

def copy_checkpoint(src: str, dst: Path) -> Path:
    for f in Path(src).iterdir():
        shutil.copy(f, dst)
    return dst


def edit_config(path: Path, **fields) -> None:
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **fields}))


def test_the_decoder_is_chosen_by_model_type_as_hf_does(checkpoints, tmp_path):
    """A Qwen2 checkpoint whose config says LlamaForCausalLM: HF builds a Qwen2 (model_type),
    q/k/v biases included; so does the engine."""
    path = copy_checkpoint(checkpoints["qwen2"], tmp_path)
    edit_config(path, architectures=["LlamaForCausalLM"])
    prompts = [random_prompt(n, seed=60 + n) for n in (7, 20)]
    outs = make_llm(path).generate(prompts, greedy(8), use_tqdm=False)
    GreedyReference(str(path)).compare_all(prompts, outs, 8)


def test_weights_the_config_does_not_use_are_refused(checkpoints, tmp_path):
    (tmp_path / "biased").mkdir()
    biased = copy_checkpoint(checkpoints["llama"], tmp_path / "biased")
    weights = load_file(str(biased / "model.safetensors"))
    weights["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(4 * 32)
    save_file(weights, str(biased / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model.safetensors .*layers.0.self_attn.q_proj.bias"):
        make_llm(biased)
    (tmp_path / "short").mkdir()
    short = copy_checkpoint(checkpoints["llama"], tmp_path / "short")
    edit_config(short, num_hidden_layers=1)
    with pytest.raises(ValueError, match=r"model.layers.1.*num_hidden_layers=1"):
        make_llm(short)


def test_only_the_files_hf_reads_are_read(checkpoints, tmp_path):
    """A stray z_backup.safetensors with other weights beside model.safetensors changes
    nothing; a folder with only such a file is refused, naming it."""
    path = copy_checkpoint(checkpoints["llama"], tmp_path)
    other = {k: torch.randn_like(v) for k, v in load_file(str(path / "model.safetensors")).items()}
    save_file(other, str(path / "z_backup.safetensors"))
    prompt = random_prompt(12, seed=61)
    (out,) = make_llm(path).generate([prompt], greedy(8), use_tqdm=False)
    GreedyReference(checkpoints["llama"]).compare(prompt, out.token_ids, 8, "beside a backup")
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="z_backup.safetensors"):
        make_llm(path)


def test_a_nan_weight_is_refused_naming_it(checkpoints, tmp_path):
    path = copy_checkpoint(checkpoints["llama"], tmp_path)
    weights = load_file(str(path / "model.safetensors"))
    weights["model.layers.1.mlp.down_proj.weight"][3, 5] = float("nan")
    save_file(weights, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.down_proj.weight .*NaN"):
        make_llm(path)


# ----------------------------------------------------------------------------- text

def test_a_character_split_by_the_prompt_is_in_the_output_text():
    """A token prompt ending with 2 of the 3 byte tokens of "€": the first output token
    completes it, and the output's text holds the whole character."""
    llm = LLM(str(DEMO_MODEL_DIR), device="cpu", dtype="float32", num_kv_blocks=64)
    ids = llm.get_tokenizer()("price: 5€", add_special_tokens=False)["input_ids"]
    (out,) = llm.generate([{"prompt_token_ids": ids[:-1]}],
                          SamplingParams(temperature=0.0, max_tokens=1, allowed_token_ids=[ids[-1]]),
                          use_tqdm=False)
    assert out.outputs[0].token_ids == [ids[-1]]
    assert out.outputs[0].text == "€"


# ----------------------------------------------------------------------------- smaller ones

def test_a_cache_salt_that_cannot_be_encoded_is_refused_naming_it(llama_dir):
    llm = make_llm(llama_dir)
    with pytest.raises(ValueError, match="cache_salt cannot be encoded"):
        llm.generate([{"prompt_token_ids": [5, 6, 7], "cache_salt": "a\udc80b"}], greedy(2),
                     use_tqdm=False)
    assert_no_leak(llm)


def test_prompt_tokens_count_each_prompt_once_despite_preemptions(llama_dir):
    llm = make_llm(llama_dir, block_size=4, num_kv_blocks=14, max_num_batched_tokens=16)
    prompts = [random_prompt(n, seed=90 + n) for n in (13, 17, 21, 11)]
    llm.generate(prompts, greedy(20), use_tqdm=False)
    assert llm.stats()["preemptions"] > 0
    metrics = {m.name: m.value for m in llm.get_metrics()}
    assert metrics["vllm:prompt_tokens"] == sum(map(len, prompts))
