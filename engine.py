"""The engine of step14_5: ``LLM`` and its step loop.

One engine step: schedule -> one model forward for every scheduled token -> sample ->
commit (advance each sequence, cache the blocks it filled) -> append tokens -> return the
finished requests. The chapter itself -- the chain hash, the lookup, the save -- lives in
prefix_cache.py; the scheduler (scheduler.py) calls it when it admits a sequence and when
it commits a step. ``hash_strategy="recompute"`` keeps the chapter's "before" column
runnable; it changes how hashes are obtained and nothing else.
"""
from __future__ import annotations

import itertools
import json
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from block_manager import BlockManager, KVCachePool
from model import SeqChunk, load_model
from outputs import CompletionOutput, RequestOutput
from prefix_cache import HASH_STRATEGIES, PrefixCache
from sampler import Sampler
from sampling_params import SamplingParams
from scheduler import ScheduledChunk, Scheduler, SchedulerConfig, Sequence

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Sequence"]


@dataclass
class EngineConfig:
    block_size: int = 16
    num_kv_blocks: int | None = None        # explicit pool size; else sized from a budget
    kv_cache_memory: int | None = None      # KV budget in bytes
    gpu_memory_utilization: float = 0.9     # fraction of free device memory (CUDA)
    cpu_kv_cache_fraction: float = 0.1      # fraction of available RAM (CPU)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    device: str | None = None
    dtype: str | None = "auto"
    seed: int | None = 0
    enable_prefix_caching: bool = True
    hash_strategy: str = "incremental"

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.hash_strategy not in HASH_STRATEGIES:
            raise ValueError(f"hash_strategy must be one of {HASH_STRATEGIES}, got {self.hash_strategy!r}")


class LLM:
    """Offline inference on a local Hugging Face checkpoint: ``LLM(model_dir).generate(prompts)``."""

    def __init__(self, model: str | os.PathLike, **engine_args) -> None:
        unknown = set(engine_args) - set(EngineConfig.__dataclass_fields__)
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(sorted(unknown))}")
        self.config = EngineConfig(**engine_args)
        self.device = torch.device(self.config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model, _ = load_model(model, self.config.dtype, self.device)
        self.model_config = self.model.config
        self.dtype = next(self.model.parameters()).dtype
        self.tokenizer = _load_tokenizer(Path(model))
        self.eos_token_ids = set(_eos_token_ids(Path(model), self.model_config))
        self.max_model_len = min(self.config.max_model_len or self.model_config.max_position_embeddings,
                                 self.model_config.max_position_embeddings)
        self.kv_cache = self._allocate_kv_cache()
        self.block_manager = BlockManager(self.num_blocks, self.block_size)
        self.prefix_cache = (PrefixCache(self.block_manager, self.config.hash_strategy)
                             if self.config.enable_prefix_caching else None)
        self.scheduler = Scheduler(SchedulerConfig(self.config.max_num_seqs,
                                                   self.config.max_num_batched_tokens),
                                   self.block_manager, self.prefix_cache)
        self.sampler = Sampler(self.device, self.config.seed)
        self._counters = dict(generation_tokens=0, steps=0)
        self._request_ids = itertools.count()
        self._requests: dict[str, Sequence] = {}
        self._unclaimed: list[RequestOutput] = []

    @property
    def block_size(self) -> int:
        return self.config.block_size

    # ------------------------------------------------------------------ set-up

    def _allocate_kv_cache(self) -> KVCachePool:
        cfg = self.model_config
        per_block = KVCachePool.bytes_per_block(cfg.num_layers, self.block_size, cfg.num_kv_heads,
                                                cfg.head_dim, self.dtype)
        self.num_blocks = self.config.num_kv_blocks or self._blocks_from_budget(per_block)
        return KVCachePool(cfg.num_layers, self.num_blocks, self.block_size, cfg.num_kv_heads,
                           cfg.head_dim, self.dtype, self.device)

    def _blocks_from_budget(self, per_block: int) -> int:
        budget = self.config.kv_cache_memory or self._default_kv_budget()
        blocks = int(budget // per_block)
        if blocks < 1:
            raise ValueError(f"KV budget of {int(budget)} bytes (kv_cache_memory) is too small for one "
                             f"block of {self.block_size} tokens in each of "
                             f"{self.model_config.num_layers} layers ({per_block} bytes)")
        # More blocks than max_num_seqs full-length sequences can use would only waste memory.
        useful = self.config.max_num_seqs * -(-self.max_model_len // self.block_size)
        return min(blocks, useful)

    def _default_kv_budget(self) -> float:
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return free * self.config.gpu_memory_utilization
        return _available_ram() * self.config.cpu_kv_cache_fraction

    def reset_prefix_cache(self) -> bool:
        """Forget cached-and-free blocks; True if the cache is now empty (as vLLM's)."""
        return self.prefix_cache.reset() if self.prefix_cache else True

    # ------------------------------------------------------------------ requests

    def add_request(self, prompt, sampling_params: SamplingParams | None = None) -> str:
        """Queue one request; returns its id. Validates before anything is queued."""
        seq = self._make_sequence(prompt, sampling_params)
        self._enqueue(seq)
        return seq.request_id

    def _make_sequence(self, prompt, sampling_params: SamplingParams | None) -> Sequence:
        params = sampling_params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        salt = _cache_salt(prompt, params)
        token_ids = self._tokenize(prompt)
        self._validate_prompt(token_ids, params)
        text = prompt.get("prompt") if isinstance(prompt, dict) else prompt
        root = self.prefix_cache.root_hash(salt) if self.prefix_cache else 0
        return Sequence(token_ids, params, request_id=str(next(self._request_ids)), cache_salt=salt,
                        root_hash=root, prompt_text=text if isinstance(text, str) else None)

    def _tokenize(self, prompt) -> np.ndarray:
        """A string, a list / array / tensor of ids, or a vLLM-style dict with ``prompt`` or
        ``prompt_token_ids`` (and optionally ``cache_salt``)."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt and "prompt" not in prompt:
                raise ValueError("a dict prompt needs 'prompt' (text) or 'prompt_token_ids'")
            prompt = prompt.get("prompt_token_ids", prompt.get("prompt"))
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer, but the checkpoint has none; "
                                 "pass token ids instead")
            prompt = self.tokenizer(prompt)["input_ids"]
        elif isinstance(prompt, torch.Tensor):
            prompt = prompt.cpu().numpy()
        token_ids = np.asarray(prompt)
        if token_ids.size and (token_ids.ndim != 1 or not np.issubdtype(token_ids.dtype, np.integer)):
            raise ValueError(f"a prompt must be a string or a flat list of integer token ids, "
                             f"got an array of shape {token_ids.shape} and dtype {token_ids.dtype}")
        return token_ids.astype(np.int64)

    def _validate_prompt(self, token_ids: np.ndarray, params: SamplingParams) -> None:
        """Every check that can fail, before any memory or state is touched."""
        if token_ids.size == 0:
            raise ValueError("empty prompt: a request needs at least one token")
        vocab = self.model_config.vocab_size
        out_of_range = (token_ids < 0) | (token_ids >= vocab)
        if out_of_range.any():
            raise ValueError(f"token id {int(token_ids[out_of_range][0])} is out of range "
                             f"for vocab size {vocab}")
        total = token_ids.size + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(f"prompt ({token_ids.size} tokens) + max_tokens ({params.max_tokens}) "
                             f"= {total} exceeds max_model_len {self.max_model_len}")
        needed = -(-(total - 1) // self.block_size)  # the last generated token needs no K/V slot
        if needed > self.num_blocks:
            raise ValueError(f"request needs {needed} KV blocks (prompt + max_tokens = {total} "
                             f"tokens) but the whole pool has {self.num_blocks}; raise num_kv_blocks")

    def _enqueue(self, seq: Sequence) -> None:
        seq.arrival_time = time.perf_counter()
        self._requests[seq.request_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        """Cancel a queued or running request; its blocks return (cached ones stay reusable)."""
        seq = self._requests.pop(str(request_id), None)
        if seq is None:
            return False
        self.scheduler.abort(seq)
        return True

    def has_unfinished_requests(self) -> bool:
        """True while a request runs or waits, or has finished with its output not yet returned."""
        return self.scheduler.has_unfinished or bool(self._unclaimed)

    # ------------------------------------------------------------------ the step

    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward for all scheduled tokens, sample, append; return finished.

        Also returns requests (from ``add_request``) that finished inside a ``generate()`` call.
        """
        unclaimed, self._unclaimed = self._unclaimed, []
        return unclaimed + self._step()

    def _step(self) -> list[RequestOutput]:
        chunks = self.scheduler.schedule()
        if not chunks:
            if self.scheduler.has_unfinished:
                raise RuntimeError("scheduler made no progress although requests are pending")
            return []
        sampled = [c.seq for c in chunks if c.completes_sequence]
        logits = self._run_model(chunks)
        tokens, logprobs = self.sampler(logits, sampled)
        # Commit only once the forward and sampling succeeded: a step that raises leaves every
        # sequence as it was, to be scheduled again.
        self.scheduler.commit(chunks)
        self._counters["steps"] += 1
        finished = self._append_tokens(sampled, tokens, logprobs)
        return [self._make_output(seq) for seq in finished]

    def _run_model(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        seq_chunks = [SeqChunk(c.seq.num_computed_tokens, c.num_tokens, c.seq.block_table)
                      for c in chunks]
        input_ids = np.concatenate([c.seq.tokens[s.start:s.start + s.length]
                                    for c, s in zip(chunks, seq_chunks)])
        meta = self.model.prepare(seq_chunks, self.block_size)
        ends = np.cumsum([c.num_tokens for c in chunks]) - 1
        logits_index = [int(e) for c, e in zip(chunks, ends) if c.completes_sequence]
        return self.model(torch.from_numpy(input_ids).to(self.device), meta, self.kv_cache,
                          torch.tensor(logits_index, dtype=torch.long, device=self.device))

    def _append_tokens(self, seqs: list[Sequence], tokens: list[int], logprobs) -> list[Sequence]:
        finished = []
        now = time.perf_counter()
        for row, (seq, token) in enumerate(zip(seqs, tokens)):
            seq.append_token(token)
            self._counters["generation_tokens"] += 1
            if seq.first_token_time is None:
                seq.first_token_time = now
            if logprobs is not None and seq.logprobs is not None:
                seq.logprobs.append(logprobs[row])
            reason = self._finish_reason(seq, token)
            if reason is not None:
                self.scheduler.finish(seq, reason)
                seq.finished_time = now
                finished.append(seq)
        return finished

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.sampling_params
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _make_output(self, seq: Sequence) -> RequestOutput:
        self._requests.pop(seq.request_id, None)
        token_ids = seq.output_token_ids
        completion = CompletionOutput(0, self._decode(token_ids), token_ids, seq.finish_reason,
                                      seq.logprobs)
        metrics = dict(arrival_time=seq.arrival_time, first_token_time=seq.first_token_time,
                       finished_time=seq.finished_time, ttft=seq.first_token_time - seq.arrival_time)
        return RequestOutput(seq.request_id, seq.prompt_text, seq.prompt_token_ids, [completion],
                             metrics=metrics)

    def _decode(self, token_ids: list[int]) -> str | None:
        if self.tokenizer is None:
            return None
        try:
            return self.tokenizer.decode(token_ids, skip_special_tokens=True)
        except Exception as exc:  # a tokenizer failure must not lose the tokens of the batch
            warnings.warn(f"could not decode output tokens: {exc!r}; text is None")
            return None

    # ------------------------------------------------------------------ generate

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Run prompts (strings or token-id lists) to completion; outputs in input order."""
        prompts = _as_prompt_list(prompts)
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts")
            params = list(sampling_params)
        else:
            params = [sampling_params] * len(prompts)
        seqs = [self._make_sequence(p, sp) for p, sp in zip(prompts, params)]  # validate all first
        for seq in seqs:
            self._enqueue(seq)
        order = {seq.request_id: i for i, seq in enumerate(seqs)}
        results: list[RequestOutput | None] = [None] * len(seqs)
        try:
            self._run_until_done(order, results, use_tqdm)
        finally:
            for seq in seqs:  # on an error, leave nothing of this call behind
                if not seq.is_finished:
                    self.abort(seq.request_id)
        return results

    def _run_until_done(self, order: dict, results: list, use_tqdm: bool) -> None:
        bar = _progress_bar(len(results), use_tqdm)
        start, tokens_at_start = time.perf_counter(), self._counters["generation_tokens"]
        remaining = len(results)
        while remaining:
            for out in self._step():
                if out.request_id not in order:
                    self._unclaimed.append(out)  # an add_request() caller's: its next step() has it
                    continue
                results[order[out.request_id]] = out
                remaining -= 1
                bar.update(1)
            elapsed = time.perf_counter() - start
            rate = (self._counters["generation_tokens"] - tokens_at_start) / max(elapsed, 1e-9)
            bar.set_postfix_str(f"{rate:.1f} out tok/s", refresh=False)
        bar.close()

    # ------------------------------------------------------------------ stats

    def stats(self) -> dict:
        """Cumulative counters over this LLM's life (prefix-cache figures in tokens)."""
        sched, bm, pc = self.scheduler.stats, self.block_manager, self.prefix_cache
        return dict(
            self._counters,
            hash_computations=pc.hash_computations if pc else 0,
            prompt_tokens_computed=sched.prompt_tokens_computed,
            prompt_tokens_cached=sched.prompt_tokens_cached,
            prefix_cache_queries=sched.prefix_cache_queries,
            prefix_cache_hits=sched.prefix_cache_hits,
            prefix_cache_hit_rate=sched.prefix_cache_hits / max(sched.prefix_cache_queries, 1),
            preemptions=sched.preemptions,
            evictions=pc.num_evictions if pc else 0,
            num_blocks=bm.num_blocks,
            blocks_in_use=bm.num_blocks_in_use,
            blocks_cached=pc.num_cached_blocks if pc else 0,
            free_blocks=bm.num_free_blocks,
        )


def _cache_salt(prompt, params: SamplingParams) -> str | None:
    """vLLM takes ``cache_salt`` in the prompt dict."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    salt = salt if salt is not None else getattr(params, "cache_salt", None)
    if salt is not None and not isinstance(salt, str):
        raise ValueError(f"cache_salt must be a string, got {type(salt).__name__}")
    return salt


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, (str, dict, np.ndarray, torch.Tensor)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, (int, np.integer)) for t in prompts):
        return [prompts]  # one prompt given as a flat list of token ids
    return prompts


def _progress_bar(total: int, enabled: bool):
    from tqdm.auto import tqdm
    return tqdm(total=total, desc="generate", unit="req", disable=not enabled, dynamic_ncols=True)


def _load_tokenizer(path: Path):
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any((path / n).is_file() for n in names):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


def _eos_token_ids(path: Path, model_config) -> tuple[int, ...]:
    """EOS ids from generation_config.json when present, else from config.json."""
    gen = path / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        if eos is not None:
            return tuple(eos) if isinstance(eos, list) else (int(eos),)
    return model_config.eos_token_ids


def _available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30
