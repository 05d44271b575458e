"""The engine of step14_5: ``LLM``, its step loop, and the paged prefix cache on an incremental hash.

One engine step: schedule -> one model forward for every scheduled token -> sample ->
append -> free finished sequences. Full blocks are named by a chain hash (xxhash of the
previous block's hash and the block's token ids); the prefix cache maps hash -> block so a
new request with a known prefix skips that part of its prefill.

The chapter's point: the chain lives on each ``Sequence`` (``_block_hashes``, ``_prev_hash``),
so ``_lookup_prefix_cache`` is dict probes only and ``_save_prefix_cache`` reuses the hash
the sequence already has. ``hash_strategy="recompute"`` keeps the chapter's "before" column
runnable: the whole chain is rebuilt on every lookup and hashed again when saving.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import xxhash

from block_manager import Block, BlockManager, KVCachePool
from model import SeqChunk, load_model
from outputs import CompletionOutput, RequestOutput
from sampler import Sampler
from sampling_params import SamplingParams
from scheduler import (
    TOKEN_BYTES,
    TOKEN_DTYPE,
    ScheduledChunk,
    Scheduler,
    SchedulerConfig,
    Sequence,
)

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Sequence"]

HASH_STRATEGIES = ("incremental", "recompute")


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
        if self.config.seed is not None:
            torch.manual_seed(self.config.seed)
        self.model, hf_config = load_model(model, self.config.dtype, self.device)
        self.model_config = self.model.config
        self.dtype = next(self.model.parameters()).dtype
        self.tokenizer = _load_tokenizer(Path(model))
        self.eos_token_ids = set(_eos_token_ids(Path(model), self.model_config))
        self.max_model_len = min(self.config.max_model_len or self.model_config.max_position_embeddings,
                                 self.model_config.max_position_embeddings)
        self.block_size = self.config.block_size
        self.kv_cache = self._allocate_kv_cache()
        self.block_manager = BlockManager(self.num_blocks, self.block_size)
        self.scheduler = Scheduler(
            SchedulerConfig(self.config.max_num_seqs, self.config.max_num_batched_tokens,
                            self.block_size, self.config.enable_prefix_caching),
            self.block_manager, self._lookup_prefix_cache, self._prefix_in_flight)
        self.sampler = Sampler(self.device, self.config.seed)
        self.hash_strategy = self.config.hash_strategy
        self._hash_fn = xxhash.xxh3_64_intdigest  # (data, seed); tests swap in a weak one
        self._counters = dict(hash_computations=0, prompt_tokens_computed=0,
                              generation_tokens=0, steps=0)
        self._requests: dict[str, Sequence] = {}
        self._unclaimed: list[RequestOutput] = []

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

    # ------------------------------------------------------------------ the chapter: prefix cache

    @property
    def _prefix_cache(self) -> dict[int, Block]:
        """hash -> cached block (owned by the block manager, which evicts entries on reuse)."""
        return self.block_manager.cached_blocks

    def _chain_hash(self, tokens, prev_hash: int, start: int, end: int) -> int:
        """xxhash of token ids [start, end) as little-endian int64 bytes, seeded with the
        previous block's hash. ``tokens``: the sequence's ``token_view()`` (the hot path: a
        view of its id buffer, so only the block's bytes are copied), or any list / array."""
        self._counters["hash_computations"] += 1
        if isinstance(tokens, memoryview):
            block = tokens[start:end].tobytes()
        else:
            block = np.asarray(tokens[start:end], dtype=TOKEN_DTYPE).tobytes()
        return self._hash_fn(block, prev_hash)

    def _precompute_block_hashes(self, seq: Sequence) -> None:
        """Extend ``seq``'s chain to all its full blocks; a no-op when it is up to date."""
        bs, hashes = self.block_size, seq._block_hashes
        first = len(hashes) * bs
        if first + bs > seq.num_tokens:
            return
        tokens, prev = seq.token_view(), seq._prev_hash
        for start in range(first, seq.num_tokens - bs + 1, bs):
            prev = self._chain_hash(tokens, prev, start, start + bs)
            hashes.append(prev)

    def _rebuild_chain(self, seq: Sequence) -> list[int]:
        """The "before" column: hash every full block from scratch (N calls per lookup)."""
        bs, tokens = self.block_size, seq.token_view()
        hashes, prev = [], seq.root_hash
        for start in range(0, seq.num_tokens - bs + 1, bs):
            prev = self._chain_hash(tokens, prev, start, start + bs)
            hashes.append(prev)
        return hashes

    def _lookup_prefix_cache(self, seq: Sequence) -> tuple[list[int], int, int]:
        """Longest verified cached prefix of ``seq``: (block ids, cached tokens, last hash).

        Scans forward and stops at the first miss: the chain makes a later hit impossible,
        and each hit is checked against the block's tokens and parent (collision-safe).
        The last token is never served from cache, since its logits are needed.
        """
        if self.hash_strategy == "recompute":
            hashes = self._rebuild_chain(seq)
        else:
            self._precompute_block_hashes(seq)
            hashes = seq._block_hashes
        max_blocks = min((seq.num_tokens - 1) // self.block_size, len(hashes))
        tokens, width = seq.token_bytes(), self.block_size * TOKEN_BYTES
        cached = self._prefix_cache
        block_ids: list[int] = []
        parent = None
        for i in range(max_blocks):
            block = cached.get(hashes[i])
            if (block is None or block.parent != parent
                    or block.token_bytes != tokens[i * width:(i + 1) * width]
                    or (i == 0 and block.salt != seq.cache_salt)):
                break
            block_ids.append(block.block_id)
            parent = block.lifetime
        if self.hash_strategy == "recompute":
            seq._block_hashes = hashes[:len(block_ids)]  # saving hashes the rest again
        last_hash = hashes[len(block_ids) - 1] if block_ids else 0
        return block_ids, len(block_ids) * self.block_size, last_hash

    def _prefix_in_flight(self, seq: Sequence, num_cached_blocks: int) -> bool:
        """True if a running sequence is still computing the block ``seq`` would compute next.

        Admitting ``seq`` now would compute that block twice; one step later it is a hit.
        """
        hashes = seq._block_hashes
        if num_cached_blocks >= len(hashes) or num_cached_blocks >= (seq.num_tokens - 1) // self.block_size:
            return False
        h, end = hashes[num_cached_blocks], (num_cached_blocks + 1) * self.block_size
        return any(other.num_computed_tokens < end and len(other._block_hashes) > num_cached_blocks
                   and other._block_hashes[num_cached_blocks] == h for other in self.scheduler.running)

    def _save_prefix_cache(self, seq: Sequence, h: int, end: int) -> None:
        """Register the block ending at token ``end`` (its K/V are written) under hash ``h``.

        If an identical verified block is already cached (same prompt computed in the same
        step), ``seq`` switches to it and frees its copy, so later blocks chain from one parent.
        """
        index = end // self.block_size - 1
        blocks = self.block_manager.blocks
        block = blocks[seq.block_table[index]]
        parent = blocks[seq.block_table[index - 1]] if index > 0 else None
        if parent is not None and parent.block_hash is None:
            return  # unreachable by lookups (they walk from cached parents): nothing to register
        parent_lifetime = parent.lifetime if parent is not None else None
        token_bytes = seq.block_bytes(index, self.block_size)
        if self.block_manager.cache_block(block, h, token_bytes, parent_lifetime, seq.cache_salt):
            return
        existing = self._prefix_cache.get(h)
        if (existing is not None and existing is not block and existing.parent == parent_lifetime
                and existing.token_bytes == token_bytes and existing.salt == seq.cache_salt):
            self.block_manager.share(existing)
            self.block_manager.free([block.block_id])
            seq.block_table[index] = existing.block_id

    def _hash_for_save(self, seq: Sequence, end: int) -> int:
        """The hash of the block ending at ``end``: reused from the seq, or (recompute) hashed again."""
        index = end // self.block_size - 1
        if self.hash_strategy == "incremental":
            if index >= len(seq._block_hashes):  # a block completed during decode: hashed once
                self._precompute_block_hashes(seq)
            return seq._block_hashes[index]
        del seq._block_hashes[index:]
        h = self._chain_hash(seq.token_view(), seq._prev_hash, end - self.block_size, end)
        seq._block_hashes.append(h)
        return h

    def _do_prefill_step(self, seq: Sequence, num_tokens: int) -> None:
        """Record a computed chunk (a decode token is a chunk of one) and save each block it filled."""
        start = seq.num_computed_tokens
        end = start + num_tokens
        seq.num_computed_tokens = end
        self._counters["prompt_tokens_computed"] += max(0, min(end, seq.num_prompt_tokens) - start)
        if not self.config.enable_prefix_caching:
            return
        bs = self.block_size
        for boundary in range((start // bs + 1) * bs, end + 1, bs):
            self._save_prefix_cache(seq, self._hash_for_save(seq, boundary), boundary)

    def reset_prefix_cache(self) -> None:
        self.block_manager.reset_prefix_cache()

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
        if isinstance(prompt, dict) and prompt.get("cache_salt") is not None:
            params = dataclasses.replace(params, cache_salt=prompt["cache_salt"])  # vLLM's per-prompt salt
        token_ids = self._tokenize(prompt)
        self._validate_prompt(token_ids, params)
        seq = Sequence(token_ids, params)
        text = prompt.get("prompt") if isinstance(prompt, dict) else prompt
        seq.prompt_text = text if isinstance(text, str) else None
        return seq

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
        for chunk in chunks:
            self._do_prefill_step(chunk.seq, chunk.num_tokens)
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
        sched = self.scheduler.stats
        bm = self.block_manager
        return dict(
            self._counters,
            prefix_cache_queries=sched.prefix_cache_queries,
            prefix_cache_hits=sched.prefix_cache_hits,
            prefix_cache_hit_rate=sched.prefix_cache_hits / max(sched.prefix_cache_queries, 1),
            prompt_tokens_cached=sched.prompt_tokens_cached,
            preemptions=sched.preemptions,
            evictions=bm.num_evictions,
            num_blocks=bm.num_blocks,
            blocks_in_use=bm.num_blocks_in_use,
            blocks_cached=len(bm.cached_blocks),
            free_blocks=bm.num_free_blocks,
        )


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
