"""bench.py: this engine side by side with Hugging Face transformers, in one process.

Three systems run the same model and the same greedy, never-stopping workloads, one after
the other (never concurrently), each warmed up once at a small size first:

* ours:                 ``engine.LLM(...).generate`` (paged KV, continuous batching, prefix cache)
* HF ``generate_batch``: transformers' continuous batching on its paged cache, prefix sharing on
* HF ``generate``:       padded ``model.generate`` (left padding, one batch)

Workloads: (a) no sharing (random prompts of mixed length), (b) one long shared prefix with
distinct suffixes, (c) the prefix-cache hash chain alone (our two hash strategies and HF's
own prefix matcher on the same tokens). On top: prefill model-FLOPs utilisation against a
matmul peak measured in the same run, and the share of a batch-32 decode step spent outside
the model's matmuls. Ends with one markdown table and PASS/MISS against the project targets.

    python bench.py                  # full run (~35 min on 2 busy CPU cores with --threads 1)
    python bench.py --quick          # reduced sizes, < 2 min
    python bench.py --model DIR --dtype bfloat16 --json results.json
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import logging
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from engine import LLM, SamplingParams, Sequence  # noqa: E402

MIB = 1 << 20
HF_PAGE_SIZE = 256          # transformers' default page_size for continuous batching
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul",
              "aten::linear")


# ----------------------------------------------------------------------------- sizes

@dataclass
class Sizes:
    """Everything that --quick shrinks."""

    num_requests: int = 64
    a_prompt_min: int = 128
    a_prompt_max: int = 1024
    a_new_tokens: int = 128
    b_prefix: int = 1024
    b_suffix: int = 64
    b_new_tokens: int = 64
    hash_prompt: int = 4096
    hash_reps: int = 200
    decode_batch: int = 32
    decode_prompt: int = 128
    decode_steps: int = 10
    matmul_n: int = 1024
    max_batched_tokens: int = 2048
    model: dict = field(default_factory=lambda: dict(
        vocab_size=32000, hidden_size=512, intermediate_size=2048, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=4, head_dim=64))

    @classmethod
    def quick(cls) -> "Sizes":
        # A smaller model too (~8M params), so the whole run fits in < 2 min on 2 cores.
        return cls(num_requests=16, a_prompt_min=32, a_prompt_max=256, a_new_tokens=32,
                   b_prefix=256, b_suffix=16, b_new_tokens=16, hash_prompt=1024, hash_reps=50,
                   decode_steps=5, model=dict(
                       vocab_size=16000, hidden_size=256, intermediate_size=1024,
                       num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=64))


# ----------------------------------------------------------------------------- model

def build_checkpoint(out_dir: str, model_kwargs: dict, seed: int = 0, max_pos: int = 8192) -> str:
    """A random Qwen3 checkpoint (float32 on disk) made on the fly; nothing is downloaded."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(**model_kwargs, tie_word_embeddings=True, max_position_embeddings=max_pos,
                      initializer_range=0.02, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
                      pad_token_id=0, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(out_dir)
    return out_dir


def model_facts(model) -> dict:
    """Parameter counts and the shapes the FLOP formulas need."""
    cfg = model.config
    total = sum(p.numel() for p in model.parameters())  # tied weights are counted once
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    untied_head = head.numel() if head.data_ptr() != embed.data_ptr() else 0
    return dict(params=total, params_without_embedding=total - embed.numel() - untied_head,
                vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                num_layers=cfg.num_hidden_layers, num_heads=cfg.num_attention_heads,
                num_kv_heads=cfg.num_key_value_heads,
                head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)


def load_hf(model_dir: str, dtype: torch.dtype, device: torch.device):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
    return model.eval()


def torch_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


# ----------------------------------------------------------------------------- workloads

@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    max_new_tokens: int
    description: str

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return len(self.prompts) * self.max_new_tokens


def random_tokens(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    # Ids 0-2 are pad/bos/eos in the built checkpoint: keep prompts clear of them.
    return rng.integers(3, vocab, size=n).tolist()


def workload_no_sharing(s: Sizes, vocab: int, seed: int = 1) -> Workload:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(s.a_prompt_min, s.a_prompt_max + 1, size=s.num_requests)
    prompts = [random_tokens(rng, int(n), vocab) for n in lengths]
    return Workload("(a) no sharing", prompts, s.a_new_tokens,
                    f"{s.num_requests} req, random prompts {s.a_prompt_min}-{s.a_prompt_max} tok, "
                    f"{s.a_new_tokens} new")


def workload_shared_prefix(s: Sizes, vocab: int, seed: int = 2) -> Workload:
    rng = np.random.default_rng(seed)
    prefix = random_tokens(rng, s.b_prefix, vocab)
    prompts = [prefix + random_tokens(rng, s.b_suffix, vocab) for _ in range(s.num_requests)]
    return Workload("(b) shared prefix", prompts, s.b_new_tokens,
                    f"{s.num_requests} req, {s.b_prefix}-tok shared prefix + {s.b_suffix}-tok "
                    f"suffixes, {s.b_new_tokens} new")


def warmup_workload(vocab: int) -> Workload:
    rng = np.random.default_rng(99)
    return Workload("warmup", [random_tokens(rng, n, vocab) for n in (40, 70, 100, 33)], 8, "warmup")


def kv_capacity_tokens(w: Workload) -> int:
    """KV room for every request at full length at once, rounded to HF's page (so both fit)."""
    return sum(-(-(len(p) + w.max_new_tokens) // HF_PAGE_SIZE) * HF_PAGE_SIZE for p in w.prompts)


# ----------------------------------------------------------------------------- memory

def _rss_kib(field_name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    return 0


class PeakMemory:
    """Peak memory over a phase: CUDA max_memory_allocated, else the RSS high-water (VmHWM).

    On Linux, writing 5 to /proc/self/clear_refs resets VmHWM to the current RSS, so each
    phase gets its own high-water mark even though all systems share one process. The
    figure reported is the peak above the RSS at the start of the phase (weights + KV +
    activations of the system under test), plus the absolute peak.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __enter__(self) -> "PeakMemory":
        gc.collect()
        _malloc_trim()  # hand freed heap of earlier phases back, so the baseline is honest
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        else:
            self.resettable = _reset_hwm()
            self.base = _rss_kib("VmRSS") * 1024
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            self.peak = torch.cuda.max_memory_allocated(self.device)
        else:
            self.peak = _rss_kib("VmHWM") * 1024
            if not self.resettable:  # old kernel: the process-wide high-water is all there is
                self.base = 0

    @property
    def delta(self) -> int:
        return max(self.peak - self.base, 0)


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _malloc_trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


# ----------------------------------------------------------------------------- one run's result

@dataclass
class RunResult:
    workload: str
    system: str
    wall_s: float
    prompt_tokens: int
    output_tokens: int
    ttfts: list[float] | None      # per request, seconds; None when not measurable
    all_first_s: float | None      # time from start until every request had its first token
    peak_mem: int
    peak_mem_abs: int
    outputs: list[list[int]]
    settings: str
    extra: dict = field(default_factory=dict)

    @property
    def out_tps(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def prompt_tps(self) -> float | None:
        return self.prompt_tokens / self.all_first_s if self.all_first_s else None

    def ttft_mean(self) -> float | None:
        return statistics.fmean(self.ttfts) if self.ttfts else None

    def ttft_p90(self) -> float | None:
        return float(np.percentile(self.ttfts, 90)) if self.ttfts else None

    def summary(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k not in ("outputs", "ttfts")}
        d.update(out_tok_s=self.out_tps, prompt_tok_s=self.prompt_tps,
                 ttft_mean_s=self.ttft_mean(), ttft_p90_s=self.ttft_p90())
        return d


def _check_lengths(system: str, outputs: list[list[int]], w: Workload) -> None:
    """Every system must produce exactly max_new_tokens per request, or the rates mean nothing."""
    bad = [i for i, o in enumerate(outputs) if len(o) != w.max_new_tokens]
    if bad:
        raise RuntimeError(f"{system} on {w.name}: {len(bad)} request(s) did not produce "
                           f"{w.max_new_tokens} tokens (e.g. #{bad[0]}: {len(outputs[bad[0]])})")


# ----------------------------------------------------------------------------- ours

def ours_engine_args(w: Workload, s: Sizes, model_dir: str, dtype: str, device) -> dict:
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    elem = torch.empty((), dtype=torch_dtype(dtype)).element_size()
    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * elem
    return dict(block_size=16, kv_cache_memory=kv_capacity_tokens(w) * per_token,
                max_num_seqs=256, max_num_batched_tokens=s.max_batched_tokens,
                dtype=dtype, device=device, seed=0, enable_prefix_caching=True,
                hash_strategy="incremental")


def run_ours(model_dir: str, w: Workload, s: Sizes, dtype: str, device: torch.device) -> RunResult:
    """A fresh LLM (so the prefix cache starts cold), timed over one full generate()."""
    args = ours_engine_args(w, s, model_dir, dtype, str(device))
    params = SamplingParams(temperature=0.0, max_tokens=w.max_new_tokens, ignore_eos=True)
    with PeakMemory(device) as mem:
        llm = LLM(model_dir, **args)
        before = llm.stats()
        start = time.perf_counter()
        outs = llm.generate(w.prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        after = llm.stats()
    del llm
    outputs = [list(o.token_ids) for o in outs]
    _check_lengths("ours", outputs, w)
    counters = {k: after[k] - before[k] for k in ("prompt_tokens_computed", "prefix_cache_queries",
                                                 "prefix_cache_hits", "hash_computations",
                                                 "steps", "preemptions")}
    counters["prompt_tokens_cached"] = after["prompt_tokens_cached"] - before["prompt_tokens_cached"]
    settings = ", ".join(f"{k}={v}" for k, v in args.items())
    return RunResult(w.name, "ours", wall, w.prompt_tokens, w.output_tokens,
                     [o.metrics["ttft"] for o in outs],
                     max(o.metrics["first_token_time"] for o in outs) - start,
                     mem.delta, mem.peak, outputs, settings, counters)


def warmup_ours(model_dir: str, s: Sizes, vocab: int, dtype: str, device: torch.device) -> None:
    w = warmup_workload(vocab)
    llm = LLM(model_dir, **ours_engine_args(w, s, model_dir, dtype, str(device)))
    llm.generate(w.prompts, SamplingParams(temperature=0.0, max_tokens=w.max_new_tokens,
                                           ignore_eos=True), use_tqdm=False)


# ----------------------------------------------------------------------------- HF generate (padded)

class FirstForwardClock:
    """A logits processor that only notes when it is first called: the end of the prefill."""

    def __init__(self) -> None:
        self.t: float | None = None

    def __call__(self, input_ids, scores):
        if self.t is None:
            if scores.is_cuda:
                torch.cuda.synchronize(scores.device)  # the forward must really be done
            self.t = time.perf_counter()
        return scores


def hf_generate_config(max_new: int):
    from transformers import GenerationConfig
    # eos None and min_new_tokens: never stop early, like ignore_eos on our side.
    return GenerationConfig(do_sample=False, max_new_tokens=max_new, min_new_tokens=max_new,
                            eos_token_id=None, pad_token_id=0, num_beams=1)


def left_pad(prompts: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids.to(device), mask.to(device)


def hf_generate_padded(model, prompts, max_new: int, batch_size: int, start: float):
    """Batched padded generate; returns outputs and each request's first-token time."""
    from transformers import LogitsProcessorList
    outputs, first = [], []
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i:i + batch_size]
        ids, mask = left_pad(chunk, model.device)
        clock = FirstForwardClock()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask,
                                 generation_config=hf_generate_config(max_new),
                                 logits_processor=LogitsProcessorList([clock]))
        outputs += out[:, ids.shape[1]:].tolist()
        first += [clock.t - start] * len(chunk)
    return outputs, first


def run_hf_generate(model_dir: str, w: Workload, dtype: str, device: torch.device,
                    batch_size: int) -> RunResult:
    with PeakMemory(device) as mem:
        model = load_hf(model_dir, torch_dtype(dtype), device)
        start = time.perf_counter()
        outputs, first = hf_generate_padded(model, w.prompts, w.max_new_tokens, batch_size, start)
        wall = time.perf_counter() - start
    attn = model.config._attn_implementation
    del model
    _check_lengths("HF generate", outputs, w)
    settings = (f"model.generate, left padding, batch_size={batch_size}, greedy, "
                f"eos_token_id=None, min_new_tokens=max_new_tokens={w.max_new_tokens}, "
                f"attn_implementation={attn}, default (dynamic) cache")
    return RunResult(w.name, "HF generate (padded)", wall, w.prompt_tokens, w.output_tokens,
                     first, max(first), mem.delta, mem.peak, outputs, settings,
                     dict(padded_prompt_tokens=_padded_tokens(w.prompts, batch_size)))


def _padded_tokens(prompts, batch_size: int) -> int:
    return sum(len(prompts[i:i + batch_size]) * max(len(p) for p in prompts[i:i + batch_size])
               for i in range(0, len(prompts), batch_size))


# ----------------------------------------------------------------------------- HF generate_batch

def hf_cb_config(w: Workload, s: Sizes):
    from transformers import ContinuousBatchingConfig
    # Sized like ours: the same KV room in tokens, the same per-forward token budget.
    return ContinuousBatchingConfig(page_size=HF_PAGE_SIZE,
                                    num_blocks=kv_capacity_tokens(w) // HF_PAGE_SIZE,
                                    max_batch_tokens=s.max_batched_tokens,
                                    allow_block_sharing=True, scheduler_type="fifo", seed=0)


def run_hf_generate_batch(model_dir: str, w: Workload, s: Sizes, dtype: str,
                          device: torch.device) -> RunResult:
    cb = hf_cb_config(w, s)
    with PeakMemory(device) as mem:
        model = load_hf(model_dir, torch_dtype(dtype), device)
        start = time.perf_counter()
        with torch.inference_mode():
            res = model.generate_batch(w.prompts, generation_config=hf_generate_config(w.max_new_tokens),
                                       continuous_batching_config=cb, record_timestamps=True,
                                       progress_bar=False)
        wall = time.perf_counter() - start
    attn = _cb_attention(model)
    del model
    results = list(res.values())
    if len(results) != len(w.prompts) or any(r.error for r in results):
        raise RuntimeError(f"HF generate_batch on {w.name}: {len(results)}/{len(w.prompts)} results, "
                           f"errors: {[r.error for r in results if r.error][:1]}")
    outputs = [list(r.generated_tokens) for r in results]
    _check_lengths("HF generate_batch", outputs, w)
    ttfts = [r.timestamps[0] - r.created_time for r in results] if _has_timestamps(results) else None
    all_first = max(r.timestamps[0] for r in results) - start if ttfts else None
    settings = (f"generate_batch, ContinuousBatchingConfig(page_size={cb.page_size}, "
                f"num_blocks={cb.num_blocks}, max_batch_tokens={cb.max_batch_tokens}, "
                f"allow_block_sharing={cb.allow_block_sharing}, scheduler={cb.scheduler_type}), "
                f"record_timestamps=True (TTFT = timestamps[0] - created_time), greedy, "
                f"eos disabled, attention={attn}")
    return RunResult(w.name, "HF generate_batch", wall, w.prompt_tokens, w.output_tokens,
                     ttfts, all_first, mem.delta, mem.peak, outputs, settings)


def _has_timestamps(results) -> bool:
    return all(r.timestamps for r in results)


def _cb_attention(model) -> str:
    """The attention CB ran with: the model's own (sdpa) unless a flash-attn package is installed."""
    from transformers.utils import is_flash_attn_2_available
    impl = model.config._attn_implementation
    return impl if not is_flash_attn_2_available() else f"{impl} (flash-attn available: CB may switch)"


def warmup_hf(model_dir: str, s: Sizes, vocab: int, dtype: str, device: torch.device) -> None:
    w = warmup_workload(vocab)
    model = load_hf(model_dir, torch_dtype(dtype), device)
    hf_generate_padded(model, w.prompts, w.max_new_tokens, len(w.prompts), time.perf_counter())
    with torch.inference_mode():
        model.generate_batch(w.prompts, generation_config=hf_generate_config(w.max_new_tokens),
                             continuous_batching_config=hf_cb_config(w, s), progress_bar=False)


# ----------------------------------------------------------------------------- (c) hashing alone

def time_call(fn, reps: int) -> float:
    """Median seconds of fn() over reps calls (fn prepares nothing: setup happens outside)."""
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def bench_hash_ours(model_dir: str, tokens: list[int], strategy: str, reps: int, dtype: str,
                    device) -> dict:
    """Cold chain (fresh Sequence) and re-lookup (same Sequence) of _lookup_prefix_cache.

    The prompt is first prefilled once, so the cache holds all its blocks and a lookup walks
    the whole chain (the case the chain cost matters for). Also: cold with an empty cache.
    """
    n = len(tokens)
    llm = LLM(model_dir, block_size=16, num_kv_blocks=n // 16 + 8, max_num_seqs=4,
              max_num_batched_tokens=2048, max_model_len=n + 8, dtype=dtype, device=str(device),
              hash_strategy=strategy)
    arr = np.asarray(tokens, dtype=np.int64)
    empty = _hash_case(llm, arr, reps)
    llm.generate([tokens], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
                 use_tqdm=False)
    cold = _hash_case(llm, arr, reps)
    seq = Sequence(arr)
    llm._lookup_prefix_cache(seq)  # the first lookup of this seq; what follows is a re-lookup
    relook = _timed_lookups(llm, [seq] * reps)
    return dict(system=f"ours ({strategy})", cold_us=cold["us"], cold_hashes=cold["hashes"],
                cold_hit_blocks=cold["hit_blocks"], relookup_us=relook["us"],
                relookup_hashes=relook["hashes"], empty_cache_us=empty["us"],
                empty_cache_hashes=empty["hashes"])


def _hash_case(llm: LLM, arr: np.ndarray, reps: int) -> dict:
    return _timed_lookups(llm, [Sequence(arr) for _ in range(reps)])


def _timed_lookups(llm: LLM, seqs: list) -> dict:
    times, hashes, hit = [], [], 0
    for seq in seqs:
        h0 = llm.stats()["hash_computations"]
        t = time.perf_counter()
        block_ids, _, _ = llm._lookup_prefix_cache(seq)
        times.append(time.perf_counter() - t)
        hashes.append(llm.stats()["hash_computations"] - h0)
        hit = len(block_ids)
    return dict(us=statistics.median(times) * 1e6, hashes=int(statistics.median(hashes)),
                hit_blocks=hit)


def hf_prefix_matcher(block: int):
    """HF's prefix matcher (CacheAllocator.match_prefix_blocks) on a bare ledger.

    Only the two attributes match_prefix_blocks reads are set, so we time the matcher and
    its blake2b chain (compute_block_hash) with nothing of the cache tensor around it.
    """
    from transformers.generation.continuous_batching.cache_allocators import (
        FullAttentionCacheAllocator, cache_allocator as ca)
    alloc = object.__new__(FullAttentionCacheAllocator)  # skip __init__: no cache tensor needed
    alloc.tokens_per_page = block
    alloc.ledger = ca.BlockLedger()
    return ca, alloc


def bench_hash_hf(tokens: list[int], block: int, reps: int) -> dict:
    """HF has no per-request chain: every match (first or repeated) rebuilds the blake2b chain."""
    ca, alloc = hf_prefix_matcher(block)
    empty_us = time_call(lambda: alloc.match_prefix_blocks(tokens), reps) * 1e6
    empty_calls = _count_hf_hashes(ca, alloc, tokens)
    _register_chain(ca, alloc, tokens, block)  # as if the prompt had been computed once
    cold_us = time_call(lambda: alloc.match_prefix_blocks(tokens), reps) * 1e6
    calls = _count_hf_hashes(ca, alloc, tokens)
    hit = len(alloc.match_prefix_blocks(tokens))
    return dict(system="HF match_prefix_blocks (blake2b)", cold_us=cold_us, cold_hashes=calls,
                cold_hit_blocks=hit, relookup_us=cold_us, relookup_hashes=calls,
                empty_cache_us=empty_us, empty_cache_hashes=empty_calls)


def _register_chain(ca, alloc, tokens: list[int], block: int) -> None:
    parent = None
    for b in range(len(tokens) // block):
        parent = ca.compute_block_hash(parent, tokens[b * block:(b + 1) * block])
        alloc.ledger.hash_to_block[parent] = b


def _count_hf_hashes(ca, alloc, tokens: list[int]) -> int:
    """Count compute_block_hash calls by wrapping the module global the matcher looks up."""
    original, calls = ca.compute_block_hash, [0]

    def counting(parent, toks):
        calls[0] += 1
        return original(parent, toks)

    ca.compute_block_hash = counting
    try:
        alloc.match_prefix_blocks(tokens)
    finally:
        ca.compute_block_hash = original
    return calls[0]


# ----------------------------------------------------------------------------- MFU

def matmul_peak(n: int, dtype: torch.dtype, device: torch.device, trials: int = 7,
                inner: int = 10) -> float:
    """Best-of-trials FLOP/s of n x n x n matmuls: the roof the prefill is measured against."""
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    c = torch.empty(n, n, dtype=dtype, device=device)
    best = math.inf
    for _ in range(trials + 1):  # the first trial is a warm-up
        _sync(device)
        t = time.perf_counter()
        for _ in range(inner):
            torch.mm(a, b, out=c)
        _sync(device)
        best = min(best, (time.perf_counter() - t) / inner)
    return 2 * n ** 3 / best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def attention_flops(prompts: list[list[int]], facts: dict) -> int:
    """Causal QK^T and PV: 4 * layers * heads * head_dim * L(L+1)/2 per prompt of length L."""
    per_pair = 4 * facts["num_layers"] * facts["num_heads"] * facts["head_dim"]
    return sum(per_pair * len(p) * (len(p) + 1) // 2 for p in prompts)


def bench_prefill(model_dir: str, w: Workload, s: Sizes, facts: dict, peak: float, dtype: str,
                  device: torch.device) -> dict:
    """Our prefill alone: workload (a)'s prompts with max_tokens=1 on a fresh LLM."""
    args = ours_engine_args(w, s, model_dir, dtype, str(device))
    llm = LLM(model_dir, **args)
    before = llm.stats()["prompt_tokens_computed"]
    start = time.perf_counter()
    llm.generate(w.prompts, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
                 use_tqdm=False)
    seconds = time.perf_counter() - start
    computed = llm.stats()["prompt_tokens_computed"] - before
    dense = 2 * facts["params_without_embedding"] * computed
    attn = attention_flops(w.prompts, facts)
    return dict(prefill_s=seconds, prompt_tokens_computed=computed,
                dense_flops=dense, attention_flops=attn,
                dense_flop_s=dense / seconds, total_flop_s=(dense + attn) / seconds,
                matmul_peak_flop_s=peak, mfu=dense / seconds / peak,
                mfu_with_attention=(dense + attn) / seconds / peak)


# ----------------------------------------------------------------------------- decode overhead

def bench_decode_overhead(model_dir: str, s: Sizes, vocab: int, dtype: str,
                          device: torch.device) -> dict:
    """Share of a batch-N decode step spent outside matmuls (torch.profiler, self times).

    Matmul time = summed self time of aten::mm/addmm/bmm/baddbmm/matmul/linear (attention's
    softmax, RoPE, norms, gathers, sampling and Python all count as outside). The step time
    comes from the same number of steps run without the profiler, so profiler overhead does
    not inflate the share; the profiler's own wall-based share is reported too.
    """
    from torch.profiler import ProfilerActivity, profile

    rng = np.random.default_rng(3)
    n, steps = s.decode_batch, s.decode_steps
    llm = LLM(model_dir, block_size=16, max_num_seqs=n, max_num_batched_tokens=s.max_batched_tokens,
              num_kv_blocks=n * (-(-(s.decode_prompt + 3 * steps + 8) // 16)),
              dtype=dtype, device=str(device))
    params = SamplingParams(temperature=0.0, max_tokens=3 * steps + 8, ignore_eos=True)
    for _ in range(n):
        llm.add_request(random_tokens(rng, s.decode_prompt, vocab), params)
    _step_until_all_decoding(llm, n)
    for _ in range(2):
        llm.step()  # warm the pure-decode shape
    wall = _timed_steps(llm, n, steps)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        prof_wall = _timed_steps(llm, n, steps)
    mm_us, top = _matmul_time(prof, device, steps)
    return dict(batch=n, steps=steps, step_ms=wall / steps * 1e3,
                matmul_ms_per_step=mm_us / steps / 1e3,
                non_matmul_share=max(0.0, 1 - mm_us / 1e6 / wall),
                non_matmul_share_profiled_wall=max(0.0, 1 - mm_us / 1e6 / prof_wall),
                top_ops_ms_per_step=top)


def _step_until_all_decoding(llm: LLM, n: int) -> None:
    while llm.stats()["generation_tokens"] < n:
        llm.step()


def _timed_steps(llm: LLM, n: int, steps: int) -> float:
    """Seconds for `steps` decode steps, as steps x the median step (robust to a busy box)."""
    before = llm.stats()["generation_tokens"]
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        llm.step()
        times.append(time.perf_counter() - t)
    made = llm.stats()["generation_tokens"] - before
    if made != n * steps:
        raise RuntimeError(f"decode steps were not all batch {n}: {made} tokens in {steps} steps")
    return statistics.median(times) * steps


def _matmul_time(prof, device: torch.device, steps: int) -> tuple[float, dict]:
    """(matmul self time in us, the top ops by self time per step in ms)."""
    on_gpu = device.type == "cuda"
    rows = []
    for evt in prof.key_averages():
        us = evt.self_device_time_total if on_gpu else evt.self_cpu_time_total
        rows.append((evt.key, us))
    mm = sum(us for key, us in rows if key in MATMUL_OPS)
    top = dict(sorted(((k, u / 1e3 / steps) for k, u in rows), key=lambda r: -r[1])[:8])
    return mm, top


# ----------------------------------------------------------------------------- report

def fmt(x, spec: str = ".1f", unit: str = "") -> str:
    return "n/a" if x is None else f"{x:{spec}}{unit}"


def ratio_to_ours(rows: list[RunResult]) -> dict[tuple[str, str], float]:
    ours = {r.workload: r for r in rows if r.system == "ours"}
    return {(r.workload, r.system): ours[r.workload].out_tps / r.out_tps for r in rows}


def results_table(rows: list[RunResult]) -> str:
    ratios = ratio_to_ours(rows)
    lines = ["| workload | system | out tok/s | prompt tok/s | mean TTFT | p90 TTFT | peak mem (Δ / abs) | ours/this |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.workload} | {r.system} | {r.out_tps:.1f} | {fmt(r.prompt_tps)} | "
                     f"{fmt(r.ttft_mean(), '.2f', ' s')} | {fmt(r.ttft_p90(), '.2f', ' s')} | "
                     f"{r.peak_mem / MIB:.0f} / {r.peak_mem_abs / MIB:.0f} MiB | "
                     f"{ratios[(r.workload, r.system)]:.2f}x |")
    return "\n".join(lines)


def hash_table(rows: list[dict]) -> str:
    lines = ["| (c) hashing, block 16 | cold µs | cold hashes | re-lookup µs | re-lookup hashes | "
             "empty-cache µs | empty-cache hashes |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['system']} | {r['cold_us']:.1f} | {r['cold_hashes']} | "
                     f"{r['relookup_us']:.1f} | {r['relookup_hashes']} | {r['empty_cache_us']:.1f} | "
                     f"{r['empty_cache_hashes']} |")
    return "\n".join(lines)


def best_hf_ratio(rows: list[RunResult], workload: str) -> tuple[float, str]:
    """ours / the faster HF mode on a workload (by output tok/s, i.e. end-to-end wall time)."""
    hf = [r for r in rows if r.workload == workload and r.system != "ours"]
    ours = next(r for r in rows if r.workload == workload and r.system == "ours")
    fastest = max(hf, key=lambda r: r.out_tps)
    return ours.out_tps / fastest.out_tps, fastest.system


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def target_lines(rows: list[RunResult], prefill: dict, decode: dict, wa: str, wb: str) -> list[dict]:
    rb, sb = best_hf_ratio(rows, wb)
    ra, sa = best_hf_ratio(rows, wa)
    return [
        dict(target="(b) shared prefix >= 5x vs the faster HF mode", value=f"{rb:.2f}x vs {sb}",
             ok=rb >= 5),
        dict(target="(a) no sharing >= 1.5x vs the faster HF mode", value=f"{ra:.2f}x vs {sa}",
             ok=ra >= 1.5),
        dict(target="prefill >= 50 % of matmul peak", value=f"{prefill['mfu']:.0%}", ok=prefill["mfu"] >= 0.5),
        dict(target="decode non-matmul share < 20 % at batch 32",
             value=f"{decode['non_matmul_share']:.0%}", ok=decode["non_matmul_share"] < 0.2),
    ]


def agreement(rows: list[RunResult]) -> list[str]:
    """How many requests each HF mode decoded token-for-token like ours (a sanity check only:
    a random model has near-tied logits, so float differences can flip a greedy pick)."""
    out = []
    ours = {r.workload: r for r in rows if r.system == "ours"}
    for r in rows:
        if r.system != "ours":
            same = sum(a == b for a, b in zip(ours[r.workload].outputs, r.outputs))
            out.append(f"{r.workload} / {r.system}: {same}/{len(r.outputs)} requests identical to ours")
    return out


# ----------------------------------------------------------------------------- main

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint dir (default: a random ~48M Qwen3 built on the fly)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--quick", action="store_true", help="reduced sizes, < 2 min on 2 cores")
    p.add_argument("--hf-generate-batch-size", type=int, default=None,
                   help="batch size of padded model.generate (default: all requests in one batch)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads for every system (default: torch's own choice)")
    p.add_argument("--skip-hf", action="store_true", help="ours only (no comparison)")
    p.add_argument("--json", help="write the results to this path")
    return p.parse_args(argv)


def quiet_hf_logs() -> None:
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    cb_logger = logging.getLogger("ContinuousBatchingLogger")
    cb_logger.setLevel(logging.ERROR)
    # On CPU without psutil, HF logs an error for a memory breakdown it does not need here
    # (num_blocks and max_batch_tokens are given explicitly).
    cb_logger.addFilter(lambda rec: "psutil" not in rec.getMessage())


def warn_if_busy() -> None:
    """Every system here is CPU-bound: other load on the box skews all of them, and not
    equally. With >1 intra-op thread on a busy box, a small matmul in the main thread can
    wait milliseconds for a descheduled OpenMP worker, while HF generate_batch runs its loop
    in a worker thread that was seen not to pay this; --threads 1 levels the field."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    cpus = os.cpu_count() or 1
    if load > 0.5 * cpus:
        log(f"WARNING: 1-min load average {load:.1f} on {cpus} CPUs before start: other "
            f"processes share the cores, so absolute numbers (and ratios) are noisy; "
            f"--threads 1 is steadier on a busy box.")


def log(msg: str = "") -> None:
    print(msg, flush=True)


def run_workload(model_dir, w, s, args, device, rows: list[RunResult]) -> None:
    log(f"\n== {w.name}: {w.description} ({w.prompt_tokens} prompt tok, {w.output_tokens} out tok)")
    runners = [("ours", lambda: run_ours(model_dir, w, s, args.dtype, device))]
    if not args.skip_hf:
        bs = args.hf_generate_batch_size or len(w.prompts)
        runners += [("HF generate_batch", lambda: run_hf_generate_batch(model_dir, w, s, args.dtype, device)),
                    ("HF generate", lambda: run_hf_generate(model_dir, w, args.dtype, device, bs))]
    for name, fn in runners:
        log(f"  running {name} ...")
        r = fn()
        rows.append(r)
        log(f"  {r.system}: {r.wall_s:.1f} s, {r.out_tps:.1f} out tok/s, "
            f"mean TTFT {fmt(r.ttft_mean(), '.2f', ' s')}, peak Δmem {r.peak_mem / MIB:.0f} MiB"
            + (f", {r.extra}" if r.extra else ""))
        log(f"    settings: {r.settings}")


def main(argv=None, sizes: Sizes | None = None) -> dict:
    """Run everything; ``sizes`` overrides the presets (the smoke test passes tiny ones)."""
    args = parse_args(argv)
    s = sizes or (Sizes.quick() if args.quick else Sizes())
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.threads:
        torch.set_num_threads(args.threads)
    quiet_hf_logs()
    warn_if_busy()
    tmp = tempfile.TemporaryDirectory(prefix="bench_ckpt_")
    model_dir = args.model or build_checkpoint(tmp.name, s.model)
    hf_model = load_hf(model_dir, torch_dtype(args.dtype), device)
    facts = model_facts(hf_model)
    del hf_model
    vocab = facts["vocab_size"]
    log(f"bench.py{' --quick' if args.quick else ''}: device={device}, dtype={args.dtype}, "
        f"torch {torch.__version__} threads={torch.get_num_threads()}, cpus={os.cpu_count()}")
    log(f"model: {'random Qwen3 built on the fly ' + str(s.model) if not args.model else model_dir}"
        f" (--quick uses a smaller model than the full run)")
    log(f"params: {facts['params']:,} total, {facts['params_without_embedding']:,} without embedding")

    log("\nwarm-up (small, once per system) ...")
    warmup_ours(model_dir, s, vocab, args.dtype, device)
    if not args.skip_hf:
        warmup_hf(model_dir, s, vocab, args.dtype, device)

    rows: list[RunResult] = []
    wa, wb = workload_no_sharing(s, vocab), workload_shared_prefix(s, vocab)
    for w in (wa, wb):
        run_workload(model_dir, w, s, args, device, rows)

    log(f"\n== (c) hashing alone: {s.hash_prompt}-token prompt, block 16, median of {s.hash_reps}")
    tokens = random_tokens(np.random.default_rng(4), s.hash_prompt, vocab)
    hashes = [bench_hash_ours(model_dir, tokens, st, s.hash_reps, args.dtype, device)
              for st in ("recompute", "incremental")]
    if not args.skip_hf:
        hashes.append(bench_hash_hf(tokens, 16, s.hash_reps))

    log("\n== prefill MFU and decode overhead")
    peak = matmul_peak(s.matmul_n, torch_dtype(args.dtype), device)
    prefill = bench_prefill(model_dir, wa, s, facts, peak, args.dtype, device)
    decode = bench_decode_overhead(model_dir, s, vocab, args.dtype, device)

    report = build_report(args, s, device, facts, rows, hashes, prefill, decode, wa, wb)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2, default=str)
        log(f"\nwrote {args.json}")
    tmp.cleanup()
    return report


def build_report(args, s, device, facts, rows, hashes, prefill, decode, wa, wb) -> dict:
    log("\n## Results\n")
    log(f"device={device}, dtype={args.dtype}, threads={torch.get_num_threads()}, "
        f"model params={facts['params']:,} ({facts['params_without_embedding']:,} without embedding)")
    log(results_table(rows))
    log("\nout tok/s = generated tokens / generate() wall time; prompt tok/s = prompt tokens / time "
        "until every request had its first token; TTFT from request arrival (padded generate: the "
        "batch's first forward); peak mem = RSS high-water over the phase (load + run) above the "
        "RSS before it / absolute; ours/this = ours out tok/s / this out tok/s.")
    for line in agreement(rows):
        log(f"  check: {line}")
    log("")
    log(hash_table(hashes))
    log("cold = first lookup of a fresh request whose whole prefix is cached; re-lookup = the "
        "same request looked up again; empty-cache = first lookup with nothing cached.")
    log("")
    log(f"prefill MFU: {prefill['dense_flop_s'] / 1e9:.1f} GFLOP/s = 2 * {facts['params_without_embedding']:,} "
        f"params * {prefill['prompt_tokens_computed']} prompt tokens / {prefill['prefill_s']:.2f} s; "
        f"matmul peak ({s.matmul_n}^3 {args.dtype}, best of 7) {prefill['matmul_peak_flop_s'] / 1e9:.1f} "
        f"GFLOP/s -> {prefill['mfu']:.0%} (with causal attention FLOPs 4*layers*heads*head_dim*L(L+1)/2: "
        f"{prefill['mfu_with_attention']:.0%})")
    log(f"decode overhead at batch {decode['batch']}: step {decode['step_ms']:.1f} ms, matmuls "
        f"{decode['matmul_ms_per_step']:.1f} ms -> non-matmul share {decode['non_matmul_share']:.0%} "
        f"(profiled wall: {decode['non_matmul_share_profiled_wall']:.0%}); top self-time ops "
        f"(ms per step, under the profiler): "
        + ", ".join(f"{k} {v:.1f}" for k, v in list(decode["top_ops_ms_per_step"].items())[:5]))
    targets = target_lines(rows, prefill, decode, wa.name, wb.name) if not args.skip_hf else \
        target_lines_ours_only(prefill, decode)
    log("\nTargets:")
    for t in targets:
        log(f"  {verdict(t['ok'])}  {t['target']}: {t['value']}")
    return dict(args=vars(args), sizes=asdict(s), device=str(device), threads=torch.get_num_threads(),
                model=facts, runs=[r.summary() for r in rows], hashing=hashes, prefill=prefill,
                decode=decode, targets=targets, agreement=agreement(rows))


def target_lines_ours_only(prefill: dict, decode: dict) -> list[dict]:
    return [dict(target="prefill >= 50 % of matmul peak", value=f"{prefill['mfu']:.0%}", ok=prefill["mfu"] >= 0.5),
            dict(target="decode non-matmul share < 20 % at batch 32",
                 value=f"{decode['non_matmul_share']:.0%}", ok=decode["non_matmul_share"] < 0.2)]


if __name__ == "__main__":
    main()
