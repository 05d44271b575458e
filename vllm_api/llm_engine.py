"""vLLM's ``LLMEngine`` on the core: requests in, ``step()`` by step, outputs out.

It reads vLLM's engine arguments (``EngineConfig``), loads the checkpoint and its side files,
sizes the KV pool, picks the backend (the fast layer's, or the plain path with
``fast_paths=False``) and builds one ``EngineCore`` from those parts. Then it only translates:
vLLM's prompt forms into token ids, vLLM's options into the core's, automatic request ids,
the core's errors into vLLM's words.
"""
from __future__ import annotations

import functools
import itertools
import os
from pathlib import Path

import torch

from core.backend import Backend
from engine import EngineCore
from core.outputs import RequestOutput
from core.requests import OutputSink, RequestState
from core.sampling_params import RequestOutputKind
from fast.backend import build_backend
from fast.tuning import CpuTuning
from vllm_api.checkpoint_files import eos_token_ids, generation_config, load_tokenizer
from vllm_api.config import EngineConfig
from vllm_api.engine_args import refuse_constructor_internals, translate_engine_args
from vllm_api import intake
from vllm_api.intake import reject_unsupported
from vllm_api.kv_sizing import num_kv_blocks, resolve_max_model_len
from vllm_api.loading import load_checkpoint
from vllm_api.kv_events import build_stream, start_publisher
from vllm_api.block_hash import hash_fn_for
from vllm_api.llm_extras import LLMExtras
from vllm_api.logits_processors import build_processors, load_processor_classes
from vllm_api.member_refusals import ENGINE_REFUSED
from vllm_api.model_config import ModelConfig
from vllm_api.output_view import OutputProcessorView
from vllm_api.refusals import refuses
from vllm_api.sampling_params import SamplingParams
from vllm_api.vllm_config import VllmConfig
from vllm_api.worker import worker_class

SAMPLING_DEFAULT_KEYS = ("repetition_penalty", "presence_penalty", "frequency_penalty",
                         "temperature", "top_k", "top_p", "min_p", "max_new_tokens")


@refuses("LLMEngine", ENGINE_REFUSED)
class LLMEngine(LLMExtras):
    """vLLM's ``LLMEngine``: outputs per each request's ``output_kind`` (vLLM's default,
    CUMULATIVE, is everything so far)."""

    paused = False  # sleep(level=0) until wake_up(): step() runs nothing (llm_extras.py)
    log_stats = False  # vLLM's attributes of a single, non-logging, in-process engine
    logger_manager = None
    dp_group = None
    external_launcher_dp = False
    should_execute_dummy_batch = False

    def __init__(self, model: str | os.PathLike, **engine_args) -> None:
        worker_cls = worker_class(engine_args.pop("worker_extension_cls", None))
        refuse_constructor_internals(engine_args)
        self.config = EngineConfig(**translate_engine_args(engine_args,
                                                           EngineConfig.__dataclass_fields__))
        self.device = torch.device(self.config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model_path = Path(model)
        publisher = start_publisher(self.config.kv_events_config)  # bound before the long load
        try:
            self._start(model, worker_cls, publisher)
        except BaseException:
            if publisher is not None:
                publisher.shutdown()  # the port is free again for the caller's next try
            raise

    def _start(self, model, worker_cls, publisher) -> None:
        trust = self.config.trust_remote_code  # False: no code of the checkpoint runs
        loaded = load_checkpoint(self.model_path, self.config.dtype, self.device,
                                 self.config.hf_overrides, self.config.load_format, self.config.seed,
                                 trust, self.config.quantization)
        self.tokenizer = (None if self.config.skip_tokenizer_init
                          else load_tokenizer(Path(self.config.tokenizer or model), trust))
        self.generation_config = generation_config(self.model_path, self.config.generation_config,
                                                   self.config.override_generation_config)
        self.eos_token_ids = set(eos_token_ids(self.model_path, loaded.config))
        self.logits_processor_classes = load_processor_classes(self.config.logits_processors)
        self.engine_core = self._build_core(loaded)
        self.engine_core.model_runner.sampler.batch_processors = build_processors(
            self.logits_processor_classes, self.processor_config, self.device)
        self.kv_events = build_stream(self.config.kv_events_config, self.prefix_cache,
                                      self.config.block_size, publisher)  # None unless enabled
        self.request_counter = itertools.count()  # automatic request ids (vLLM's name)
        self.worker = worker_cls(self)  # collective_rpc's one worker, its extension's state kept

    def _build_core(self, model) -> EngineCore:
        cfg = self.config
        max_model_len = resolve_max_model_len(cfg.max_model_len, model.config.max_position_embeddings)
        num_blocks = num_kv_blocks(cfg, model.config, model.dtype, self.device, max_model_len)
        return EngineCore.build(
            model, num_blocks, block_size=cfg.block_size, max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            enable_prefix_caching=cfg.enable_prefix_caching, hash_strategy=cfg.hash_strategy,
            backend=self._backend(model), tokenizer=self.tokenizer,
            eos_token_ids=self.eos_token_ids, max_model_len=max_model_len, seed=cfg.seed,
            logprobs_mode=cfg.logprobs_mode, max_logprobs=cfg.max_logprobs,
            hash_fn=hash_fn_for(cfg.prefix_caching_hash_algo),
            scheduling_policy=cfg.scheduling_policy, kv_disk_dir=cfg.kv_disk_dir,
            kv_disk_size=cfg.kv_disk_size, kv_disk_write=cfg.kv_disk_write)

    def _backend(self, model) -> Backend:
        """The fast layer's backend and, on CPU, its process tuning; or the plain path."""
        if not self.config.fast_paths:
            return Backend(model)
        tuning = CpuTuning(max_threads=self.config.num_threads) if self.device.type == "cpu" else None
        if tuning is not None:
            tuning.apply()
        return build_backend(model, fast_paths=True, enforce_eager=self.config.enforce_eager,
                             tuning=tuning)

    # ------------------------------------------------------------------ the core's parts

    @property
    def scheduler(self):
        return self.engine_core.scheduler

    @property
    def block_manager(self):
        return self.engine_core.block_manager

    @property
    def prefix_cache(self):
        return self.engine_core.prefix_cache

    @property
    def model(self):
        return self.engine_core.model

    @functools.cached_property
    def model_config(self) -> ModelConfig:
        """vLLM's ModelConfig view; the model's own config fields read through it too."""
        return ModelConfig(self)

    @functools.cached_property
    def processor_config(self) -> VllmConfig:
        """What a custom logits processor is built with: vLLM's config sections it reads."""
        cfg = self.config
        return VllmConfig(
            model_config=self.model_config,
            scheduler_config=VllmConfig.section(max_num_seqs=cfg.max_num_seqs,
                                                max_num_batched_tokens=cfg.max_num_batched_tokens,
                                                policy=cfg.scheduling_policy,
                                                max_model_len=self.max_model_len),
            cache_config=VllmConfig.section(block_size=cfg.block_size,
                                            enable_prefix_caching=cfg.enable_prefix_caching),
            device_config=VllmConfig.section(device=self.device, device_type=self.device.type))

    @property
    def output_processor(self) -> OutputProcessorView:
        return OutputProcessorView(self)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def num_blocks(self) -> int:
        return self.block_manager.num_blocks

    @property
    def max_model_len(self) -> int:
        return self.engine_core.limits.max_model_len

    @property
    def steps(self) -> int:
        return self.engine_core.steps

    # ------------------------------------------------------------------ the loop

    def step(self) -> list[RequestOutput]:
        """One step; the outputs of ``add_request``'s requests (per their ``output_kind``),
        including any produced while a ``generate()`` call was stepping. Nothing while
        paused (``sleep(level=0)``)."""
        with self.engine_core.lock:  # sleep() sets paused under it: no step starts after sleep()
            if self.paused:
                return []
            try:
                return self.engine_core.step()
            finally:
                self.flush_kv_events()

    def flush_kv_events(self) -> None:
        """Publish the cache events since the last flush as one batch (kv_events.py)."""
        if self.kv_events is not None:
            self.kv_events.flush()

    # ------------------------------------------------------------------ requests

    def add_request(self, request_id: str | None, prompt, params: SamplingParams | None = None,
                    arrival_time=None, lora_request=None, tokenization_kwargs=None,
                    trace_headers=None, priority: int = 0, **unsupported) -> str:
        """Queue one request (applied between steps); its outputs come from ``step()``."""
        reject_unsupported(lora_request, tokenization_kwargs=tokenization_kwargs, **unsupported)
        if request_id is not None and not isinstance(request_id, str):
            raise TypeError(f"request_id must be a string, got {type(request_id).__name__}")
        state, = self.add_requests([(prompt, params)], request_ids=[request_id],
                                   priorities=[priority])
        return state.request_id

    def add_requests(self, requests: list, output_kind: RequestOutputKind | None = None,
                     sink: OutputSink | None = None, request_ids=None,
                     priorities=None) -> list[RequestState]:
        """Check every (prompt, params) first, then queue them all: the intake's door
        (vllm_api/intake.py), where the core's errors take vLLM's words."""
        return intake.add_requests(self, requests, output_kind, sink, request_ids, priorities)

    def check_priority(self, priority) -> None:
        """An integer; other than 0 only under scheduling_policy="priority" (vLLM's words)."""
        intake.check_priority(priority, self.config.scheduling_policy)

    def abort_request(self, request_ids, internal: bool = False) -> None:
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            self.abort(request_id)

    def abort(self, request_id: str) -> bool:
        return self.engine_core.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        """True while a request runs or waits, or its output has not been returned yet."""
        return self.engine_core.has_unfinished

    def get_num_unfinished_requests(self) -> int:
        return self.engine_core.num_unfinished

    # ------------------------------------------------------------------ vLLM's accessors

    def get_tokenizer(self):
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The checkpoint's sampling defaults (generation_config.json: temperature, top_p,
        top_k, min_p, penalties, max_new_tokens -> max_tokens), as vLLM reads them."""
        found = {k: self.generation_config[k] for k in SAMPLING_DEFAULT_KEYS
                 if self.generation_config.get(k) is not None}
        if "max_new_tokens" in found:
            found["max_tokens"] = found.pop("max_new_tokens")
        return SamplingParams(**found)

    def reset_prefix_cache(self, reset_running_requests: bool = False,
                           reset_connector: bool = False) -> bool:
        try:
            return self.engine_core.reset_prefix_cache(reset_running_requests)
        finally:
            self.flush_kv_events()

    def shutdown(self) -> None:
        """Abort every request still in the engine (vLLM's tests call it in clean-up); close
        the KV event publisher."""
        self.engine_core.shutdown()
        self.flush_kv_events()
        publisher = getattr(self.kv_events, "publisher", None)
        if publisher is not None:
            publisher.shutdown()

    def stats(self) -> dict:
        return self.engine_core.stats()
