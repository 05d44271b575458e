"""vLLM's offline API on this engine: engine arguments, SamplingParams features against Hugging
Face where HF has them (repetition penalty, min_new_tokens, logprobs, prompt scores), n > 1,
stop strings, outputs' fields, LLMEngine / EngineArgs, TokensPrompt / TextPrompt, chat()."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine import (EngineArgs, LLMEngine, Logprob, RequestOutputKind, SamplingParams, TextPrompt,
                    TokensPrompt)
from invariants import assert_idle
from helpers import (MAX_POS, TIE_TOL, _hf_model, assert_no_leak, drain, greedy, make_llm,
                     random_prompt)
from vllm_api.errors import UnsupportedFeatureError


def hf_greedy_with(model_dir, prompt, max_new_tokens, eos_token_id=None, **gen_kwargs):
    """HF greedy ``generate`` with extra options; returns (tokens, number of positions before
    the first near-tie of the processed scores)."""
    from transformers import GenerationConfig

    cfg = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
                           pad_token_id=0, bos_token_id=None, output_scores=True,
                           return_dict_in_generate=True, **gen_kwargs)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = _hf_model(str(model_dir)).generate(ids, attention_mask=torch.ones_like(ids),
                                                 generation_config=cfg)
    tokens = out.sequences[0, len(prompt):].tolist()
    gaps = [float(s[0].topk(2).values.diff().abs()) for s in out.scores]
    sure = next((i for i, g in enumerate(gaps) if g < TIE_TOL), len(tokens))
    return tokens, sure


def hf_prompt_logprobs(model_dir, prompt) -> torch.Tensor:
    """log_softmax of HF's logits at every prompt position: row i scores prompt token i + 1."""
    with torch.no_grad():
        logits = _hf_model(str(model_dir))(torch.tensor([prompt])).logits[0].float()
    return logits.log_softmax(dim=-1)[:-1]


# ----------------------------------------------------------------------- engine arguments

def test_neutral_vllm_engine_arguments_are_accepted(tokenizer_ckpt):
    llm = make_llm(tokenizer_ckpt, tensor_parallel_size=1, enforce_eager=True, trust_remote_code=True,
                   disable_log_stats=True, tokenizer=tokenizer_ckpt, revision=None, swap_space=4,
                   enable_chunked_prefill=True, gpu_memory_utilization=0.5, generation_config="auto",
                   kv_cache_memory_bytes=1 << 20, max_model_len=256, seed=0, pipeline_parallel_size=1,
                   distributed_executor_backend="mp", load_format="auto", kv_cache_dtype="auto",
                   quantization=None, enable_lora=False, compilation_config={"level": 0})
    assert llm.max_model_len == 256 and llm.config.kv_cache_memory == 1 << 20
    assert llm.get_tokenizer() is llm.tokenizer is not None
    assert make_llm(tokenizer_ckpt, num_gpu_blocks_override=7).num_blocks == 7
    assert make_llm(tokenizer_ckpt, skip_tokenizer_init=True).get_tokenizer() is None


@pytest.mark.parametrize("kw,error,pattern", [
    (dict(tensor_parallel_size=2), ValueError, "tensor_parallel_size=2 is not supported: this engine runs in one process"),
    (dict(quantization="awq"), ValueError, "Unknown quantization method: awq"),
    (dict(enable_lora=True), ValueError, "enable_lora=True is not supported: LoRA"),
    (dict(speculative_config={"method": "ngram"}), ValueError, "speculative decoding"),
    (dict(kv_cache_dtype="fp8"), ValueError, "kv_cache_dtype='fp8'"),
    (dict(logprobs_mode="logits"), ValueError, "logprobs_mode must be one of"),
    (dict(no_such_argument=1), TypeError, "unknown engine argument"),
    (dict(max_model_len=MAX_POS + 1), ValueError, "greater than the checkpoint's max_position_embeddings"),
    (dict(generation_config="/no/such/dir"), FileNotFoundError, "generation_config"),
])
def test_unsupported_engine_arguments_say_why(llama_dir, kw, error, pattern):
    with pytest.raises(error, match=pattern):
        make_llm(llama_dir, **kw)


def test_engine_args_and_llm_engine_loop(llama_dir, reference):
    """vLLM's llm_engine_example: add_request / step / has_unfinished_requests; CUMULATIVE
    outputs every step (finished at the end), DELTA only the new tokens, FINAL_ONLY once."""
    engine = LLMEngine.from_engine_args(EngineArgs(llama_dir, device="cpu", dtype="float32"))
    prompts = [random_prompt(9, 50), random_prompt(17, 51), random_prompt(5, 52)]
    kinds = [RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY]
    for i, (prompt, kind) in enumerate(zip(prompts, kinds)):
        engine.add_request(f"req-{i}", TokensPrompt(prompt_token_ids=prompt),
                           greedy(6, output_kind=kind))
    seen = {f"req-{i}": [] for i in range(3)}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    cumulative, delta, final = seen["req-0"], seen["req-1"], seen["req-2"]
    assert [len(o.outputs[0].token_ids) for o in cumulative] == [1, 2, 3, 4, 5, 6]
    assert [o.finished for o in cumulative] == [False] * 5 + [True]
    assert [len(o.outputs[0].token_ids) for o in delta] == [1] * 6
    assert len(final) == 1 and final[0].finished
    reference.compare(prompts[0], cumulative[-1].outputs[0].token_ids, 6)
    reference.compare(prompts[1], [t for o in delta for t in o.outputs[0].token_ids], 6)
    reference.compare(prompts[2], final[0].outputs[0].token_ids, 6)
    assert engine.get_num_unfinished_requests() == 0
    assert not engine.has_unfinished_requests()


def test_engine_args_from_the_command_line(llama_dir):
    import argparse

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--model", llama_dir, "--max-num-seqs", "4", "--block-size", "8",
                              "--no-enable-prefix-caching", "--device", "cpu", "--dtype", "float32"])
    engine_args = EngineArgs.from_cli_args(args)
    assert engine_args.max_num_seqs == 4 and engine_args.block_size == 8
    assert engine_args.enable_prefix_caching is False and engine_args.max_model_len is None
    engine = LLMEngine.from_engine_args(engine_args)
    engine.add_request("cli", random_prompt(6, 3), greedy(3))
    while engine.has_unfinished_requests():
        engine.step()


def test_llm_engine_abort_and_duplicate_ids(llama_dir):
    engine = make_llm(llama_dir).llm_engine
    engine.add_request("a", random_prompt(10, 53), greedy(20))
    engine.add_request("b", random_prompt(10, 54), SamplingParams(n=2, max_tokens=20, seed=1))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("a", random_prompt(4, 55), greedy(2))
    with pytest.raises(TypeError, match="request_id must be a string"):
        engine.add_request(7, random_prompt(4, 55), greedy(2))
    engine.step()
    engine.abort_request(["a", "b"])
    assert not engine.has_unfinished_requests() and engine.step() == []
    assert not engine.has_unfinished_requests()


def test_request_options_this_engine_lacks_are_refused(llama_dir):
    llm = make_llm(llama_dir)
    with pytest.raises(ValueError, match="lora_request"):
        llm.generate([random_prompt(5, 1)], greedy(2), use_tqdm=False, lora_request=object())
    with pytest.raises(ValueError, match="Got priority 1 but Priority scheduling is not enabled."):
        llm.generate([random_prompt(5, 1)], greedy(2), use_tqdm=False, priority=[1])
    with pytest.raises(TypeError, match="params must be BeamSearchParams"):
        llm.beam_search([random_prompt(5, 1)], None)
    with pytest.raises(ValueError, match="pooling"):
        llm.embed(["x"])
    assert_idle(llm)


# ----------------------------------------------------------------------- generation config

def test_default_sampling_params_come_from_generation_config(llama_dir, tmp_path):
    d = tmp_path / "gen"
    shutil.copytree(llama_dir, d)
    gen = json.loads((d / "generation_config.json").read_text())
    gen.update(temperature=0.6, top_p=0.9, top_k=20, repetition_penalty=1.1, max_new_tokens=7,
               do_sample=True)
    (d / "generation_config.json").write_text(json.dumps(gen))
    llm = make_llm(d)
    sp = llm.get_default_sampling_params()
    assert (sp.temperature, sp.top_p, sp.top_k, sp.repetition_penalty, sp.max_tokens) == (0.6, 0.9, 20, 1.1, 7)
    (out,) = llm.generate([random_prompt(6, 2)], use_tqdm=False)  # None: the defaults above
    assert len(out.outputs[0].token_ids) <= 7
    assert make_llm(d, generation_config="vllm").get_default_sampling_params() == SamplingParams()
    overridden = make_llm(d, override_generation_config={"temperature": 0.2})
    assert overridden.get_default_sampling_params().temperature == 0.2
    assert make_llm(llama_dir).get_default_sampling_params() == SamplingParams()


# ----------------------------------------------------------------------- parity with HF

@pytest.mark.parametrize("penalty", [1.3, 0.8])
def test_repetition_penalty_matches_hf_generate(llama_dir, penalty):
    llm = make_llm(llama_dir)
    prompts = [random_prompt(n, 60 + n) for n in (8, 30)]
    outs = llm.generate(prompts, greedy(16, repetition_penalty=penalty), use_tqdm=False)
    compared = 0
    for prompt, out in zip(prompts, outs):
        ref, sure = hf_greedy_with(llama_dir, prompt, 16, repetition_penalty=penalty)
        assert out.outputs[0].token_ids[:sure] == ref[:sure]
        compared += sure
    assert compared >= 16
    plain = llm.generate(prompts, greedy(16), use_tqdm=False)
    assert [o.token_ids for o in plain] != [o.token_ids for o in outs]  # the penalty mattered
    assert_idle(llm)


def test_min_tokens_matches_hf_min_new_tokens(llama_dir, tmp_path, reference):
    prompt = random_prompt(20, 70)
    ref = reference.get(prompt, 16)
    k = next(i for i in range(1, ref.first_tie(16)) if ref.tokens[i] not in ref.tokens[:i])
    eos = ref.tokens[k]
    d = tmp_path / "eos"
    shutil.copytree(llama_dir, d)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    llm = make_llm(d)
    early, held = llm.generate([prompt, prompt], [SamplingParams(temperature=0.0, max_tokens=16),
                                                  SamplingParams(temperature=0.0, max_tokens=16,
                                                                 min_tokens=k + 3)], use_tqdm=False)
    assert early.token_ids == ref.tokens[:k + 1] and early.finish_reason == "stop"
    hf, sure = hf_greedy_with(llama_dir, prompt, 16, eos_token_id=eos, min_new_tokens=k + 3)
    n = min(sure, len(hf))
    assert held.token_ids[:n] == hf[:n] and len(held.token_ids) >= k + 3
    assert_idle(llm)


def test_logprobs_are_logprob_objects_matching_hf(llama_dir, reference):
    llm = make_llm(llama_dir)
    prompt = random_prompt(25, 71)
    (out,) = llm.generate([prompt], greedy(6, logprobs=4), use_tqdm=False)
    ref = reference.get(prompt, 6)
    completion = out.outputs[0]
    total = 0.0
    for pos in range(ref.first_tie(6)):
        entry = completion.logprobs[pos]
        chosen = completion.token_ids[pos]
        assert next(iter(entry)) == chosen and isinstance(entry[chosen], Logprob)
        assert entry[chosen].rank == 1 and entry[chosen].decoded_token is None  # no tokenizer
        for token, lp in entry.items():
            assert lp.logprob == pytest.approx(ref.logprobs[pos][token].item(), abs=1e-4)
            assert lp.rank == int((ref.logprobs[pos] > ref.logprobs[pos][token]).sum()) + 1
        total += entry[chosen].logprob
    assert completion.cumulative_logprob == pytest.approx(
        sum(completion.logprobs[p][t].logprob for p, t in enumerate(completion.token_ids)))
    assert total <= 0
    (plain,) = llm.generate([prompt], greedy(2), use_tqdm=False)
    assert plain.outputs[0].cumulative_logprob is None and plain.outputs[0].logprobs is None


def test_prompt_logprobs_match_hf_even_when_the_prompt_is_cached(llama_dir):
    """Prompt logprobs need every prompt position's logits: such a request never reads the
    prefix cache, whether chunked or not, and its values are HF's."""
    prompt = random_prompt(45, 72)
    expected = hf_prompt_logprobs(llama_dir, prompt)
    llm = make_llm(llama_dir, block_size=8, max_num_batched_tokens=16)
    llm.generate([prompt], greedy(2), use_tqdm=False)  # now cached
    (out,) = llm.generate([prompt], greedy(2, prompt_logprobs=3), use_tqdm=False)
    assert out.num_cached_tokens == 0
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for i, entry in enumerate(out.prompt_logprobs[1:]):
        token = prompt[i + 1]
        assert next(iter(entry)) == token
        assert entry[token].logprob == pytest.approx(expected[i, token].item(), abs=1e-4)
        top = expected[i].topk(3)
        assert [t for t in entry if t != token] == [t for t in top.indices.tolist() if t != token]
        assert entry[token].rank == int((expected[i] > expected[i, token]).sum()) + 1
    (again,) = llm.generate([prompt], greedy(2), use_tqdm=False)
    assert again.num_cached_tokens == 40 and again.prompt_logprobs is None
    assert_idle(llm)


def test_min_p_one_and_tiny_top_p_sample_the_greedy_token(llama_dir, reference):
    llm = make_llm(llama_dir)
    prompts = [random_prompt(14, 73), random_prompt(33, 74)]
    outs = llm.generate(prompts * 2, [SamplingParams(temperature=1.0, min_p=1.0, top_k=0, max_tokens=8,
                                                     ignore_eos=True)] * 2
                        + [SamplingParams(temperature=1.5, top_p=1e-6, top_k=-1, max_tokens=8,
                                          ignore_eos=True)] * 2, use_tqdm=False)
    reference.compare_all(prompts * 2, outs, 8)


# ----------------------------------------------------------------------- n > 1

def test_n_sequences_share_the_prompt_and_seed_plus_index(llama_dir):
    llm = make_llm(llama_dir, block_size=8)
    prompt = random_prompt(40, 75)
    sp = SamplingParams(n=4, temperature=1.0, seed=100, max_tokens=10, ignore_eos=True, logprobs=1)
    (out,) = llm.generate([prompt], sp, use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert all(c.finish_reason == "length" and c.cumulative_logprob is not None for c in out.outputs)
    assert llm.stats()["prefix_cache_hits"] >= 3 * 32  # the siblings read the first one's blocks
    for i, completion in enumerate(out.outputs):  # child i samples like a request seeded 100 + i
        alone = SamplingParams(temperature=1.0, seed=100 + i, max_tokens=10, ignore_eos=True)
        assert llm.generate([prompt], alone, use_tqdm=False)[0].token_ids == completion.token_ids
    assert_idle(llm)


def test_n_requests_in_generate_and_step_keep_their_ids(llama_dir):
    llm = make_llm(llama_dir)
    rid = llm.add_request(random_prompt(10, 76), SamplingParams(n=3, max_tokens=5, seed=3))
    outs = llm.generate([random_prompt(12, 77)], SamplingParams(n=2, max_tokens=4), use_tqdm=False)
    assert len(outs) == 1 and len(outs[0].outputs) == 2
    done = drain(llm)
    assert list(done) == [rid] and len(done[rid].outputs) == 3
    assert_idle(llm)


# ----------------------------------------------------------------------- text and stops

@pytest.fixture(scope="module")
def tok_llm(tokenizer_ckpt):
    return make_llm(tokenizer_ckpt)


def _greedy_text(llm, prompt, n=10):
    (out,) = llm.generate([prompt], greedy(n), use_tqdm=False)
    return out.outputs[0]


def _first_word_found_in_place(text: str, start: int = 2) -> int:
    """Index k of a word whose first occurrence in ``text`` (as a substring) is where it stands."""
    words, starts, at = text.split(), [], 0
    for word in words:
        at = text.index(word, at)
        starts.append(at)
        at += len(word)
    return next(k for k in range(start, len(words)) if text.find(words[k]) == starts[k])


def test_stop_strings_cut_the_text_as_vllm(tok_llm):
    """The output text is decoded after the prompt (vLLM's way), so it starts with the space
    before its first word; the text stops before the stop string unless asked otherwise."""
    prompt = "w5 w77 w300 w12"
    full = _greedy_text(tok_llm, prompt)
    assert full.text == " " + tok_llm.tokenizer.decode(full.token_ids)
    words = full.text.split()
    k = _first_word_found_in_place(full.text)
    at = full.text.find(words[k])
    (out,) = tok_llm.generate([prompt], greedy(10, stop=["w999", words[k]]), use_tqdm=False)
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == words[k]
    assert c.text == full.text[:at]
    assert c.token_ids == full.token_ids[:k + 1]  # the token completing the stop string stays
    (out,) = tok_llm.generate([prompt], greedy(10, stop=words[k], include_stop_str_in_output=True),
                              use_tqdm=False)
    assert out.outputs[0].text == full.text[:at + len(words[k])]
    two_words = f"{words[k - 1]} {words[k]}"  # a stop string spanning two tokens
    (out,) = tok_llm.generate([prompt], greedy(10, stop=two_words), use_tqdm=False)
    assert out.outputs[0].text == full.text[:full.text.find(two_words)]
    assert out.outputs[0].stop_reason == two_words
    assert_idle(tok_llm)


def test_stop_token_ids_leave_their_text_out(tok_llm):
    prompt = "w400 w401 w9 w9"
    full = _greedy_text(tok_llm, prompt)
    k = next(i for i in range(2, 10) if full.token_ids[i] not in full.token_ids[:i])
    stop_id = full.token_ids[k]
    outs = tok_llm.generate([prompt, prompt], [greedy(10, stop_token_ids=[stop_id]),
                                               greedy(10, stop_token_ids=[stop_id],
                                                      include_stop_str_in_output=True)],
                            use_tqdm=False)
    without, with_text = (o.outputs[0] for o in outs)
    assert without.stop_reason == stop_id and without.finish_reason == "stop"
    assert without.token_ids == full.token_ids[:k + 1]
    assert without.text == " " + tok_llm.tokenizer.decode(full.token_ids[:k])
    assert with_text.text == " " + tok_llm.tokenizer.decode(full.token_ids[:k + 1])


def test_text_matches_decode_and_logprobs_carry_decoded_tokens(tok_llm):
    (out,) = tok_llm.generate([TextPrompt(prompt="w20 w21 w22")], greedy(12, logprobs=2),
                              use_tqdm=False)
    c = out.outputs[0]
    assert out.prompt == "w20 w21 w22" and out.prompt_token_ids == [20, 21, 22]
    assert c.text == " " + tok_llm.tokenizer.decode(c.token_ids)  # decoded after the prompt
    assert all(lp.decoded_token == f"w{t}" for pos in c.logprobs for t, lp in pos.items() if t > 3)
    (raw,) = tok_llm.generate(["w20 w21 w22"], greedy(3, detokenize=False, logprobs=1), use_tqdm=False)
    assert raw.outputs[0].text == ""  # vLLM: "" with detokenize=False
    assert all(lp.decoded_token is None for pos in raw.outputs[0].logprobs for lp in pos.values())


def test_bad_words_are_never_generated(tok_llm):
    prompt = "w5 w77 w300 w12"
    full = _greedy_text(tok_llm, prompt, 8)
    banned = f"w{full.token_ids[0]}"
    (out,) = tok_llm.generate([prompt], greedy(8, bad_words=[banned]), use_tqdm=False)
    assert full.token_ids[0] not in out.outputs[0].token_ids


def test_num_cached_tokens_reports_prefix_hits(tok_llm):
    prompt = " ".join(f"w{i}" for i in range(100, 140))  # 40 tokens: 2 full blocks of 16
    first, = tok_llm.generate([prompt], greedy(3), use_tqdm=False)
    second, = tok_llm.generate([prompt], greedy(3), use_tqdm=False)
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 32
    assert second.token_ids == first.token_ids
    assert tok_llm.reset_prefix_cache() is True
    third, = tok_llm.generate([prompt], greedy(3), use_tqdm=False)
    assert third.num_cached_tokens == 0


# ----------------------------------------------------------------------- chat

CHAT_TEMPLATE = ("{% for m in messages %}{{ 'w10' if m['role'] == 'user' else 'w11' }} "
                 "{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w11 {% endif %}")


def test_chat_renders_the_template_and_generates(tokenizer_ckpt):
    llm = make_llm(tokenizer_ckpt, chat_template=CHAT_TEMPLATE)
    conversation = [{"role": "user", "content": "w5 w6"}, {"role": "assistant", "content": "w7"},
                    {"role": "user", "content": "w8"}]
    (out,) = llm.chat(conversation, greedy(5), use_tqdm=False)
    assert out.prompt == "w10 w5 w6 w11 w7 w10 w8 w11 "
    assert out.prompt_token_ids == [10, 5, 6, 11, 7, 10, 8, 11]
    (same,) = llm.generate([TokensPrompt(prompt_token_ids=out.prompt_token_ids)], greedy(5),
                           use_tqdm=False)
    assert same.outputs[0].token_ids == out.outputs[0].token_ids
    batch = llm.chat([conversation[:1], conversation], greedy(2), use_tqdm=False)
    assert [o.prompt_token_ids[:3] for o in batch] == [[10, 5, 6]] * 2 and len(batch[0].prompt_token_ids) == 4
    with pytest.raises(ValueError, match="chat template"):
        make_llm(tokenizer_ckpt).chat(conversation, greedy(2), use_tqdm=False)
    (zero,) = llm.chat(conversation, greedy(2), use_tqdm=False, priority=[0])  # vLLM's default
    assert zero.outputs[0].token_ids == out.outputs[0].token_ids[:2]
    with pytest.raises(ValueError, match="Got priority 1 but Priority scheduling is not enabled."):
        llm.chat(conversation, greedy(2), use_tqdm=False, priority=[1])  # vLLM's words
    assert_idle(llm)


# ----------------------------------------------------------------------- incremental text

def test_incremental_detokenizer_equals_decode_with_short_windows():
    """Byte-level BPE (the demo model's tokenizer) on multi-byte characters: the incremental
    text equals a full decode, never shows a broken character, and each token decodes a window
    of a few tokens however long the output gets (no quadratic re-decoding)."""
    import os

    from transformers import AutoTokenizer

    from core.detokenizer import IncrementalDetokenizer

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tok = AutoTokenizer.from_pretrained(os.path.join(root, "demo_model"))
    text = "def f(x):\n    return 'héllo wörld ✓ 日本語' * x  # ünïcode " * 6
    ids = tok.encode(text, add_special_tokens=False)
    windows = []
    real_decode = tok.decode
    tok.decode = lambda ids, **kw: windows.append(len(ids)) or real_decode(ids, **kw)
    detok = IncrementalDetokenizer(tok, SamplingParams(), context_ids=ids[:3])
    for token in ids[3:]:
        detok.update(token)
        assert "\ufffd" not in detok.text
    assert detok.text == real_decode(ids)[len(real_decode(ids[:3])):]
    assert max(windows) <= 12, max(windows)


def test_stop_string_holdback_for_streaming():
    class WordTokenizer:  # ids are words; decode joins them with spaces
        def decode(self, ids, **kw):
            return " ".join(f"w{i}" for i in ids)

    from core.detokenizer import IncrementalDetokenizer

    detok = IncrementalDetokenizer(WordTokenizer(), SamplingParams(stop=["w3 w4"]))
    assert [detok.update(t) for t in (1, 2, 3)] == [None, None, None]
    assert detok.text == "w1 w2 w3"
    assert detok.visible_text(finished=False) == "w1 w2 w3"[:-4]  # could begin "w3 w4": held back
    assert detok.visible_text(finished=True) == "w1 w2 w3"
    assert detok.update(4) == "w3 w4" and detok.text == "w1 w2 "
