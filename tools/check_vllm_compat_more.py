"""More client code, run on this engine and on vLLM's CPU build (issue 30's features): the
max_model_len cap, ``LogprobsMode``, ``collective_rpc`` on a worker, ``LLM.beam_search``, KV
cache events read by a plain ZMQ subscriber (with ``prefix_caching_hash_algo="sha256"`` both
engines name blocks alike), ``AsyncLLM``, and ``load_format="dummy"`` with ``hf_overrides``.

    python -m tools.check_vllm_compat_more [--vllm-python /path/to/vllm-venv/bin/python]

Same checkpoint, comparison and report as tools/check_vllm_compat.py; each engine starts three
times (the LLM, an AsyncLLM, a dummy model), so vLLM takes several minutes.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import tempfile
import time

from tools.check_vllm_compat import _guard, build_checkpoint, compare, summary

ENGINE_ARGS = dict(dtype="float32", max_model_len=512, max_num_seqs=16, block_size=32, seed=0,
                   enforce_eager=True, enable_prefix_caching=True, max_num_batched_tokens=512,
                   kv_cache_memory_bytes=64 << 20, prefix_caching_hash_algo="sha256")
PROMPT_IDS = [12, 7, 300, 45, 1999, 5, 100, 200]


def import_api(backend: str) -> dict:
    """The only lines a user changes: where the names come from."""
    if backend == "vllm":
        from vllm import LLM, SamplingParams
        from vllm.config import KVEventsConfig
        from vllm.config.model import LogprobsMode
        from vllm.distributed.kv_events import KVEventBatch
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm import AsyncLLMEngine
        from vllm.sampling_params import BeamSearchParams
        from vllm.utils import random_uuid
    else:
        from engine import (LLM, AsyncEngineArgs, AsyncLLMEngine, BeamSearchParams,
                            KVEventBatch, KVEventsConfig, LogprobsMode, SamplingParams,
                            random_uuid)
    return dict(LLM=LLM, SamplingParams=SamplingParams, KVEventsConfig=KVEventsConfig,
                LogprobsMode=LogprobsMode, KVEventBatch=KVEventBatch, AsyncLLMEngine=AsyncLLMEngine,
                AsyncEngineArgs=AsyncEngineArgs, BeamSearchParams=BeamSearchParams,
                random_uuid=random_uuid)


def snippet_max_model_len_cap(api, llm, ctx):
    """A 500-token prompt asking for 32 tokens at max_model_len=512: 12 tokens, "length"."""
    prompt = {"prompt_token_ids": [5 + i % 1900 for i in range(500)]}
    out = llm.generate([prompt], api["SamplingParams"](temperature=0, max_tokens=32), use_tqdm=False)
    return summary(out)


def snippet_logprobs_mode(api, llm, ctx):
    """vLLM's tests import LogprobsMode from vllm.config.model and iterate its values."""
    from typing import get_args
    return dict(facts=sorted(get_args(api["LogprobsMode"])))


def snippet_collective_rpc(api, llm, ctx):
    """vLLM's test_collective_rpc: a function run on each worker, ``self`` is the worker."""
    def echo_rank(self):
        return self.rank
    return dict(facts=llm.collective_rpc(echo_rank))


def snippet_beam_search(api, llm, ctx):
    """vLLM's beam search test shape: token prompts, BeamSearchParams, best sequences."""
    outs = llm.beam_search([{"prompt_token_ids": PROMPT_IDS}],
                           api["BeamSearchParams"](beam_width=3, max_tokens=6, ignore_eos=True))
    seqs = outs[0].sequences
    return dict(tokens=[s.tokens for s in seqs], texts=[s.text for s in seqs],
                floats=[s.cum_logprob for s in seqs])


def snippet_kv_events(api, llm, ctx):
    """vLLM's kv_events subscriber example: SUB socket, frames (topic, seq, payload), payload
    decoded with KVEventBatch; a 70-token prompt stores two 32-token blocks."""
    import msgspec
    import zmq

    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{ctx['port']}")
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    decoder = msgspec.msgpack.Decoder(type=api["KVEventBatch"])
    prompt = {"prompt_token_ids": [300 + i for i in range(70)]}
    stored = []
    try:
        for _ in range(50):  # until the subscription reaches the publisher (ZMQ slow joiner)
            llm.generate([prompt], api["SamplingParams"](temperature=0, max_tokens=1), use_tqdm=False)
            while sub.poll(500):
                _, _, payload = sub.recv_multipart()
                stored += [e for e in decoder.decode(payload).events if type(e).__name__ == "BlockStored"]
            if stored:
                break
            llm.reset_prefix_cache()
    finally:
        sub.close(linger=0)
    first = stored[0]
    return dict(facts=[first.block_hashes, first.parent_block_hash, first.token_ids,
                       first.block_size])


def snippet_async_llm(api, ctx, model):
    """An async serving wrapper's shape (from vllm import AsyncLLMEngine;
    from_engine_args(engine_args=...); request ids from vllm.utils.random_uuid; async for over
    generate(), keeping the last output)."""
    args = {k: v for k, v in ENGINE_ARGS.items() if k != "prefix_caching_hash_algo"}
    engine = api["AsyncLLMEngine"].from_engine_args(
        engine_args=api["AsyncEngineArgs"](model=model, **args))

    async def run():
        final = None
        async for output in engine.generate({"prompt_token_ids": PROMPT_IDS},
                                            api["SamplingParams"](temperature=0, max_tokens=10),
                                            request_id=api["random_uuid"]()):
            final = output
        return final
    try:
        return summary([asyncio.run(run())])
    finally:
        engine.shutdown()


def snippet_dummy_overrides(api, ctx, model):
    """vLLM's tests: load_format="dummy" and hf_overrides shrinking the model; shape only
    (random weights differ between engines)."""
    args = {k: v for k, v in ENGINE_ARGS.items() if k != "prefix_caching_hash_algo"}
    llm = api["LLM"](model=model, load_format="dummy", hf_overrides={"num_hidden_layers": 2}, **args)
    out = llm.generate([{"prompt_token_ids": PROMPT_IDS}],
                       api["SamplingParams"](temperature=0, max_tokens=5, ignore_eos=True),
                       use_tqdm=False)
    del llm
    return dict(shape=[len(out[0].outputs[0].token_ids)])


SNIPPETS = [snippet_max_model_len_cap, snippet_logprobs_mode, snippet_collective_rpc,
            snippet_beam_search, snippet_kv_events]
SEPARATE = [snippet_async_llm, snippet_dummy_overrides]


def run_snippets(backend: str, model: str) -> dict:
    api, ctx = import_api(backend), {"port": free_port()}
    events = api["KVEventsConfig"](enable_kv_cache_events=True, publisher="zmq",
                                   endpoint=f"tcp://*:{ctx['port']}")
    results, started = {}, time.perf_counter()
    llm = api["LLM"](model=model, kv_events_config=events, **ENGINE_ARGS)
    results["_startup_s"] = round(time.perf_counter() - started, 1)
    for snippet in SNIPPETS:
        results[snippet.__name__] = _guard(snippet, api, llm, ctx)
    del llm
    for snippet in SEPARATE:
        results[snippet.__name__] = _guard(snippet, api, ctx, model)
    return results


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_backend(python: str, backend: str, model: str, out: str) -> dict:
    import subprocess
    env = dict(os.environ, VLLM_ALLOW_INSECURE_SERIALIZATION="1")  # vLLM: collective_rpc(fn)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    entry = (["-m", "tools.check_vllm_compat_more"] if backend == "ours"
             else ["-P", os.path.abspath(__file__)])
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([python, *entry, "--backend", backend, "--model", model, "--out", out],
                          env={**env, "PYTHONPATH": root} if backend == "vllm" else env, cwd=root,
                          capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0 or not os.path.exists(out):
        raise RuntimeError(f"{backend} run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    with open(out) as f:
        return json.load(f)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-python")
    parser.add_argument("--workdir")
    parser.add_argument("--backend", choices=("ours", "vllm"), help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.backend:
        with open(args.out, "w") as f:
            json.dump(run_snippets(args.backend, args.model), f)
        return 0
    workdir = args.workdir or tempfile.mkdtemp(prefix="vllm_compat_more_")
    model = os.path.join(workdir, "model")
    if not os.path.exists(os.path.join(model, "config.json")):
        build_checkpoint(model)
    ours = run_backend(sys.executable, "ours", model, os.path.join(workdir, "ours.json"))
    theirs = (run_backend(args.vllm_python, "vllm", model, os.path.join(workdir, "vllm.json"))
              if args.vllm_python else None)
    failures = 0
    for snippet in SNIPPETS + SEPARATE:
        name = snippet.__name__
        verdict, detail = (compare(ours[name], theirs[name]) if theirs else
                           ("runs" if ours[name]["ok"] else "FAIL", ours[name].get("error", "")))
        failures += verdict not in ("runs", "same")
        print(f"  {name.removeprefix('snippet_'):<20} {verdict:<5} {detail}")
    return 1 if failures else 0


if __name__ == "__main__":  # vLLM spawns processes that re-import this file
    sys.exit(main())
