"""The vLLM features scripts use, for real: LLM.beam_search (against a beam search on Hugging
Face's logits, beams sharing their prefix through the cache), AsyncLLM (streams, aborts when
the caller leaves), collective_rpc on a worker, hf_overrides, load_format="dummy"."""
from __future__ import annotations

import asyncio
import json
import shutil

import pytest
import torch

from engine import AsyncEngineArgs, AsyncLLM, BeamSearchParams, LLM, RequestOutputKind, SamplingParams
from helpers import _hf_model, greedy, make_llm, random_prompt


# ----------------------------------------------------------------------------- beam search

def hf_beam_search(model_dir: str, prompt: list[int], width: int, steps: int) -> list[list[int]]:
    """The same algorithm (2 * width candidates a beam, no EOS stop, length penalty 1) on
    Hugging Face's own logits: the oracle."""
    model, beams = _hf_model(model_dir), [(list(prompt), 0.0)]
    for _ in range(steps):
        children = []
        for tokens, score in beams:
            with torch.no_grad():
                logits = model(torch.tensor([tokens])).logits[0, -1].float()
            top = torch.log_softmax(logits, -1).topk(2 * width)
            children += [(tokens + [t], score + v) for v, t in zip(top.values.tolist(), top.indices.tolist())]
        beams = sorted(children, key=lambda b: b[1] / len(b[0]), reverse=True)[:width]
    return [tokens for tokens, _ in beams]


def test_beam_search_matches_hugging_faces_logits_and_beams_share_blocks(llama_dir):
    llm = make_llm(llama_dir, block_size=4)
    prompt = random_prompt(10, 21)
    before = llm.stats()["prefix_cache_hits"]
    (out,) = llm.beam_search([{"prompt_token_ids": prompt}],
                             BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True))
    assert [s.tokens for s in out.sequences] == hf_beam_search(llama_dir, prompt, 3, 5)
    assert all(len(s.logprobs) == 5 and s.text is None for s in out.sequences)
    assert llm.stats()["prefix_cache_hits"] - before >= 4 * 3 * 8  # steps 2-5: 3 beams, 8+ tokens


def test_beam_width_one_is_greedy(llama_dir):
    llm = make_llm(llama_dir)
    prompt = random_prompt(12, 22)
    (out,) = llm.beam_search([prompt], BeamSearchParams(beam_width=1, max_tokens=6, ignore_eos=True))
    (greedy_out,) = llm.generate([prompt], greedy(6), use_tqdm=False)
    assert out.sequences[0].tokens == prompt + greedy_out.token_ids


def test_beam_search_params_check_as_vllm():
    with pytest.raises(ValueError, match="beam_width must be at least 1, got 0."):
        BeamSearchParams(beam_width=0, max_tokens=4)


# ----------------------------------------------------------------------------- AsyncLLM

async def collect(engine, prompt, params, request_id):
    return [out async for out in engine.generate({"prompt_token_ids": prompt}, params, request_id)]


def test_async_llm_streams_and_equals_the_offline_tokens(llama_dir):
    prompts = [random_prompt(9, 31), random_prompt(14, 32)]
    offline = [o.token_ids for o in make_llm(llama_dir).generate(prompts, greedy(6), use_tqdm=False)]
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=llama_dir, device="cpu", dtype="float32",
                                                       num_kv_blocks=64))
    try:
        async def both():
            return await asyncio.gather(*(collect(engine, p, greedy(6), f"r{i}")
                                          for i, p in enumerate(prompts)))
        streams = asyncio.run(both())
        assert [s[-1].outputs[0].token_ids for s in streams] == offline
        assert all(len(s) == 6 and s[-1].finished and not s[0].finished for s in streams)
        delta = greedy(6, output_kind=RequestOutputKind.DELTA)
        pieces = asyncio.run(collect(engine, prompts[0], delta, "d"))
        assert [t for o in pieces for t in o.outputs[0].token_ids] == offline[0]
    finally:
        engine.shutdown()


def test_leaving_the_stream_aborts_the_request(llama_dir):
    engine = AsyncLLM(llama_dir, device="cpu", dtype="float32", num_kv_blocks=64)
    try:
        async def leave_after_two():
            seen = 0
            async for _ in engine.generate(random_prompt(8, 33), greedy(400), "long"):
                seen += 1
                if seen == 2:
                    break
            return seen
        assert asyncio.run(leave_after_two()) == 2
        assert engine.get_num_unfinished_requests() == 0
        assert engine.llm_engine.stats()["blocks_in_use"] == 0
    finally:
        engine.shutdown()


def test_async_llm_engine_is_async_llm():
    from engine import AsyncLLMEngine
    assert AsyncLLMEngine is AsyncLLM


# ----------------------------------------------------------------------------- collective_rpc

def test_collective_rpc_runs_on_a_worker(llama_dir):
    llm = make_llm(llama_dir)

    def echo_rank(self):  # vLLM's tests/distributed test_collective_rpc
        return self.rank

    assert llm.collective_rpc(echo_rank) == [0]
    (info,) = llm.collective_rpc(lambda self, k: (str(self.device), type(self.model_runner.model).__name__, k),
                                 args=(3,))
    assert info == ("cpu", "CausalLM", 3)
    assert llm.collective_rpc("get_model") == [llm.model]
    with pytest.raises(AttributeError, match="the worker has no method 'nope'"):
        llm.collective_rpc("nope")


# ----------------------------------------------------------------------------- loading

def test_hf_overrides_dict_and_callable_reach_the_model(llama_dir):
    rope = {"rope_type": "linear", "factor": 2.0}
    by_dict = make_llm(llama_dir, hf_overrides={"rope_parameters": rope, "max_position_embeddings": 1024})
    by_callable = make_llm(llama_dir, hf_overrides=lambda c: (c.rope_parameters.update(rope), c)[1])
    plain = make_llm(llama_dir)
    assert by_dict.max_model_len == 1024 and by_dict.model.config.rope_parameters["factor"] == 2.0
    prompt = random_prompt(60, 34)
    outs = [llm.generate([prompt], greedy(8), use_tqdm=False)[0].token_ids
            for llm in (by_dict, by_callable, plain)]
    assert outs[0] == outs[1] != outs[2]  # linear scaling changes the positions' rotation


def test_hf_overrides_can_drop_layers_and_refuse_what_the_weights_lack(llama_dir):
    assert len(make_llm(llama_dir, hf_overrides={"num_hidden_layers": 1}).model.layers) == 1
    with pytest.raises(ValueError, match="hf_overrides need weights the checkpoint lacks"):
        make_llm(llama_dir, hf_overrides={"num_hidden_layers": 3})
    with pytest.raises(ValueError, match="hf_overrides must be a dict or a callable"):
        make_llm(llama_dir, hf_overrides="rope")


def test_object_arguments_take_json_on_the_command_line(llama_dir):
    from engine import EngineArgs, FlexibleArgumentParser
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--model", llama_dir, "--hf-overrides", '{"num_hidden_layers": 1}',
                              "--kv-events-config", '{"enable_kv_cache_events": true, "publisher": "null"}'])
    engine_args = EngineArgs.from_cli_args(args)
    assert engine_args.hf_overrides == {"num_hidden_layers": 1}
    llm = LLM.from_engine_args(engine_args)
    assert len(llm.model.layers) == 1 and llm.llm_engine.kv_events is not None


def test_load_format_dummy_needs_only_the_config(llama_dir, tmp_path):
    shutil.copy(f"{llama_dir}/config.json", tmp_path / "config.json")
    dummy = make_llm(tmp_path, load_format="dummy")
    again = make_llm(tmp_path, load_format="dummy")
    prompt = random_prompt(10, 35)
    out = dummy.generate([prompt], greedy(5), use_tqdm=False)[0].token_ids
    assert out == again.generate([prompt], greedy(5), use_tqdm=False)[0].token_ids  # seeded
    assert not torch.equal(dummy.model.embed_tokens.weight, make_llm(llama_dir).model.embed_tokens.weight)
    with pytest.raises(ValueError, match="load_format='pt' is not supported"):
        make_llm(llama_dir, load_format="pt")
