"""vLLM's offline API on the core: ``LLM(model_dir).generate(prompts)``, ``chat``, and the
request loop (``add_request`` / ``step``), a thin layer on ``self.llm_engine``.

The learner's handles: ``llm.prefix_cache`` (the chapter), ``llm.scheduler`` and
``llm.block_manager`` (the pool).
"""
from __future__ import annotations

import os

import numpy as np
import torch

from core.outputs import RequestOutput
from core.requests import Caller, OutputSink
from core.sampling_params import RequestOutputKind
from prefix_cache import PrefixCache
from vllm_api.beam_search import beam_search
from vllm_api.checkpoint_files import read_template, render_chat
from vllm_api.errors import refuse
from vllm_api.intake import add_requests, reject_unsupported
from vllm_api.llm_engine import LLMEngine
from vllm_api.llm_extras import LLMExtras
from vllm_api.member_refusals import LLM_REFUSED
from vllm_api.pooling import POOLING_REASON
from vllm_api.refusals import refuses
from vllm_api.sampling_params import SamplingParams


def _engine_attribute(name: str, doc: str) -> property:
    return property(lambda self: getattr(self.llm_engine, name), doc=doc)


@refuses("LLM", LLM_REFUSED)
class LLM(LLMExtras):
    """Offline inference on a local Hugging Face checkpoint: ``LLM(model_dir).generate(prompts)``."""

    runner_type = "generate"
    supported_tasks = ("generate",)

    def __init__(self, model: str | os.PathLike, **engine_args) -> None:
        self.llm_engine = LLMEngine(model, **engine_args)

    @property
    def prefix_cache(self) -> PrefixCache | None:
        """The chapter's PrefixCache (None when prefix caching is off)."""
        return self.llm_engine.prefix_cache

    scheduler = _engine_attribute("scheduler", "The Scheduler: waiting and running sequences.")
    block_manager = _engine_attribute("block_manager", "The BlockManager: the pool's blocks.")
    config = _engine_attribute("config", "The EngineConfig.")
    model = _engine_attribute("model", "The CausalLM (model.py).")
    model_config = _engine_attribute("model_config", "The model's ModelConfig.")
    tokenizer = _engine_attribute("tokenizer", "The Hugging Face tokenizer (None without one).")
    block_size = _engine_attribute("block_size", "Tokens per KV block.")
    num_blocks = _engine_attribute("num_blocks", "Blocks in the KV pool.")
    max_model_len = _engine_attribute("max_model_len", "Longest prompt + output allowed.")
    dtype = _engine_attribute("dtype", "The model's compute dtype.")
    model_path = _engine_attribute("model_path", "The checkpoint directory.")
    device = _engine_attribute("device", "The device the model runs on.")

    @property
    def engine_class(self) -> type:
        return type(self.llm_engine)

    @property
    def chat_template(self) -> str | None:
        """The chat template given as an engine argument (None: the tokenizer's)."""
        return self.config.chat_template

    @property
    def default_sampling_params(self) -> dict | None:
        """The checkpoint's sampling defaults vLLM applies (None when it has none)."""
        return self.model_config.get_diff_sampling_param() or None

    # ------------------------------------------------------------------ generate and chat

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True, *,
                 lora_request=None, priority=None, **unsupported) -> list[RequestOutput]:
        """Run prompts (strings, prompt dicts or token-id lists) to completion; outputs in
        input order. ``sampling_params``: one for all, a list (one per prompt), or None (the
        checkpoint's defaults, ``get_default_sampling_params()``). Safe to call from several
        threads at once: the calls share steps."""
        reject_unsupported(lora_request, **unsupported)
        self._check_awake()
        prompts = _as_prompt_list(prompts)
        requests = list(zip(prompts, _params_list(sampling_params, prompts)))
        caller = Caller()  # alive while this call is: its requests are dropped once it is gone
        sink = OutputSink(takes_aborted=True, owner=caller)
        try:
            states = add_requests(self.llm_engine, requests, RequestOutputKind.FINAL_ONLY, sink,
                                  priorities=_priority_list(priority, prompts))
            self._run(sink, len(states), use_tqdm)
        finally:  # on an error, leave nothing of this call behind (and touch nobody else's)
            self.llm_engine.engine_core.cancel(sink)
        order = {state.request_id: i for i, state in enumerate(states)}
        return sorted(sink.drain(), key=lambda out: order[out.request_id])

    def _check_awake(self) -> None:
        """vLLM's generate() would wait for ever on a paused engine; this one says so."""
        if self.llm_engine.paused:
            raise RuntimeError("the engine is paused (sleep(level=0)): generate() would never "
                               "finish; call wake_up(tags=['scheduling']) first")

    def _run(self, sink: OutputSink, num_requests: int, use_tqdm) -> None:
        """``use_tqdm``: False, True (tqdm's bar) or, as in vLLM, the factory of the bar."""
        if not use_tqdm:
            return self._run_until(sink, num_requests)
        from tqdm.auto import tqdm
        factory = use_tqdm if callable(use_tqdm) else tqdm
        with factory(total=num_requests, desc="Processed prompts", dynamic_ncols=True) as bar:
            while sink.num_finished < num_requests:
                self._run_until(sink, sink.num_finished + 1)
                bar.update(sink.num_finished - bar.n)

    def _run_until(self, sink: OutputSink, num_finished: int) -> None:
        """Step the core until ``sink`` holds ``num_finished`` finished requests; KV events
        (when enabled) published after."""
        engine = self.llm_engine
        try:
            engine.engine_core.run_until_finished(sink, num_finished)
        finally:
            if engine.kv_events is not None:
                engine.flush_kv_events()

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True, *, lora_request=None,
             priority=None, chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools=None, chat_template_kwargs=None,
             **unsupported) -> list[RequestOutput]:
        """vLLM's ``chat``: one conversation (a list of {"role", "content"} dicts) or a list of
        them, rendered with the tokenizer's chat template (or ``chat_template``), generated."""
        prompts = self._chat_prompts(messages, chat_template, add_generation_prompt,
                                     continue_final_message, tools, chat_template_kwargs,
                                     lora_request, unsupported)
        return self.generate(prompts, sampling_params, use_tqdm, priority=priority)

    def _chat_prompts(self, messages, chat_template, add_generation_prompt,
                      continue_final_message, tools, chat_template_kwargs, lora_request,
                      unsupported: dict) -> list[str]:
        unsupported.pop("chat_template_content_format", None)  # plain-text contents only
        reject_unsupported(lora_request, **unsupported)
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        template = read_template(chat_template or self.config.chat_template)
        return [render_chat(self.tokenizer, c, template, add_generation_prompt,
                            continue_final_message, tools, chat_template_kwargs or {})
                for c in conversations]

    # ------------------------------------------------------------------ queued, then waited for

    def enqueue(self, prompts, sampling_params=None, lora_request=None, priority=None,
                use_tqdm: bool = False, tokenization_kwargs=None,
                mm_processor_kwargs=None) -> list[str]:
        """vLLM's pre-queued path: queue the prompts without running them; returns their
        request ids. ``wait_for_completion()`` runs them and returns their outputs."""
        reject_unsupported(lora_request, tokenization_kwargs=tokenization_kwargs,
                           mm_processor_kwargs=mm_processor_kwargs)
        prompts = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        requests = list(zip(prompts, _params_list(sampling_params, prompts)))
        states = self.llm_engine.add_requests(requests, RequestOutputKind.FINAL_ONLY,
                                              self._queued_sink(),
                                              priorities=_priority_list(priority, prompts))
        self._queued += [state.request_id for state in states]
        return [state.request_id for state in states]

    def enqueue_chat(self, messages, sampling_params=None, use_tqdm: bool = False,
                     lora_request=None, priority=None, chat_template: str | None = None,
                     chat_template_content_format="auto", add_generation_prompt: bool = True,
                     continue_final_message: bool = False, tools=None,
                     chat_template_kwargs=None, tokenization_kwargs=None,
                     mm_processor_kwargs=None) -> list[str]:
        """``enqueue`` for conversations, rendered as ``chat`` renders them."""
        prompts = self._chat_prompts(messages, chat_template, add_generation_prompt,
                                     continue_final_message, tools, chat_template_kwargs,
                                     lora_request, dict(tokenization_kwargs=tokenization_kwargs,
                                                        mm_processor_kwargs=mm_processor_kwargs))
        return self.enqueue(prompts, sampling_params, priority=priority)

    def wait_for_completion(self, *, use_tqdm: bool = True) -> list[RequestOutput]:
        """Run every enqueued request to the end; their outputs, in the order they were
        enqueued (vLLM's order: by request id)."""
        self._check_awake()
        sink, ids = self._queued_sink(), self._queued
        try:
            self._run(sink, len(ids), use_tqdm)
        except BaseException:
            self.llm_engine.engine_core.cancel(sink)  # as generate(): nothing left behind
            self._queued, self._queued_outputs = [], None
            raise
        order = {rid: i for i, rid in enumerate(ids)}
        self._queued, self._queued_outputs = [], None
        return sorted(sink.drain(), key=lambda out: order[out.request_id])

    def _queued_sink(self) -> OutputSink:
        if getattr(self, "_queued_outputs", None) is None:
            self._queued_outputs, self._queued = OutputSink(takes_aborted=True), []
        return self._queued_outputs

    # ------------------------------------------------------------------ the request loop

    def add_request(self, prompt, sampling_params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue one request; returns its id. ``step()`` returns its output once finished."""
        if request_id is not None and not isinstance(request_id, str):
            raise TypeError(f"request_id must be a string, got {type(request_id).__name__}")
        state, = self.llm_engine.add_requests([(prompt, sampling_params)],
                                              RequestOutputKind.FINAL_ONLY, request_ids=[request_id])
        return state.request_id

    def step(self) -> list[RequestOutput]:
        """One engine step; the outputs of ``add_request``'s requests that finished."""
        return self.llm_engine.step()

    def abort(self, request_id: str) -> bool:
        return self.llm_engine.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.llm_engine.has_unfinished_requests()

    def reset_prefix_cache(self, reset_running_requests: bool = False,
                           reset_connector: bool = False) -> bool:
        """Drop every cached block no request holds; ``reset_connector``: no KV connector here."""
        return self.llm_engine.reset_prefix_cache(reset_running_requests)

    def stats(self) -> dict:
        return self.llm_engine.stats()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        return self.llm_engine.get_default_sampling_params()

    def beam_search(self, prompts, params, lora_request=None, use_tqdm: bool = False,
                    concurrency_limit: int | None = None):
        """vLLM's beam search, built on ``generate`` (beam.py); its beams share their prefix
        through the prefix cache."""
        return beam_search(self, prompts, params, lora_request, use_tqdm, concurrency_limit)

    # vLLM answers a call its model cannot serve with ValueError; so does this engine.
    def encode(self, *args, **kwargs):
        refuse("pooling (encode / embed / classify / score)", POOLING_REASON)

    embed = classify = score = encode


def _params_list(sampling_params, prompts: list) -> list:
    if isinstance(sampling_params, (list, tuple)):
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts")
        return list(sampling_params)
    return [sampling_params] * len(prompts)


def _priority_list(priority, prompts: list) -> list[int] | None:
    """``generate``'s ``priority``: None, or one integer per prompt (vLLM's check)."""
    if priority is None:
        return None
    if not isinstance(priority, (list, tuple)):
        priority = [priority] * len(prompts)
    if len(priority) != len(prompts):
        raise ValueError("The lengths of prompts and priority must be the same.")
    return list(priority)


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, np.ndarray) and prompts.dtype.kind in "OUS":
        return [p.decode() if isinstance(p, bytes) else p for p in prompts.tolist()]  # Ray Data
    if isinstance(prompts, (str, dict, np.ndarray, torch.Tensor)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, (int, np.integer)) for t in prompts):
        return [prompts]  # one prompt given as a flat list of token ids
    return prompts
