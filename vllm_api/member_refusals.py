"""What this engine refuses of vLLM 0.32's ``AsyncLLM``, ``LLM``, ``LLMEngine`` and
``SamplingParams`` members, each as ``name -> (feature, reason)``; refusals.py adds them to
the classes. (``ModelConfig``'s are in model_config.py, ``EngineArgs``'s are engine
arguments: engine_args.py.) Everything vLLM lists and no table names is implemented.
"""
from __future__ import annotations

WEIGHTS = ("weight-transfer updates", "vLLM's weight-transfer engine (NCCL, a second process) has "
           "no peer here: change the one worker's weights in place, by model.load_weights "
           "through apply_model, or by a worker extension through collective_rpc, then "
           "reset_prefix_cache()")
LORA = ("LoRA adapters", "the engine loads base weights only")
POOLING = ("pooling", "the engine runs generative models only")
INTERNAL = ("vLLM's engine-internal objects", "this engine's parts are llm_engine.engine_core, "
            "scheduler, block_manager and prefix_cache")
CONFIG = ("vLLM's engine-internal config", "pass engine arguments instead; model_config is "
          "provided")
ONE_ENGINE = ("data-parallel scaling", "one engine in one process")
FAULTS = ("fault tolerance", "one engine in one process: a failed step marks it dead "
          "(check_health raises EngineDeadError)")
CHECKPOINTING = ("engine checkpoint / restore", "the engine's state lives in this process only")

ASYNC_REFUSED = {
    "add_request": ("AsyncLLM.add_request's output collector", "stream with generate()"),
    "encode": POOLING,
    "add_lora": LORA, "remove_lora": LORA, "pin_lora": LORA,
    **{name: WEIGHTS for name in (
        "update_weights", "start_weight_update", "finish_weight_update",
        "start_draft_weight_update", "init_weight_transfer_engine",
        "shutdown_weight_transfer_engine", "update_weight_version", "get_weight_version",
        "compute_weight_checksums")},
    "release_kv_cache_memory": ("sleep mode", "weights and KV cache always stay in memory"),
    "checkpoint_prepare": CHECKPOINTING, "checkpoint_restore": CHECKPOINTING,
    "get_status": FAULTS, "handle_fault": FAULTS,
    "scale_elastic_ep": ONE_ENGINE,
    "notify_kv_transfer_request_rejected": ("KV transfer", "no KV transfer between engines"),
    "get_num_queued_tokens": ("admission control", "there are no queue limits to report "
                              "against; get_num_unfinished_requests() counts the requests"),
    "from_vllm_config": ("building from a VllmConfig", "pass engine arguments (AsyncLLM(model, "
                         "**kwargs) or from_engine_args)"),
    "vllm_config": CONFIG, "scheduler_config": CONFIG, "observability_config": CONFIG,
    "renderer": INTERNAL, "input_processor": INTERNAL,
}

LLM_REFUSED = {
    "renderer": INTERNAL, "input_processor": INTERNAL,
    "chat_template_config": CONFIG,
    "request_counter": INTERNAL,
    "pooling_io_processors": POOLING, "pooling_task": POOLING,
}

ENGINE_REFUSED = {
    "renderer": INTERNAL, "input_processor": INTERNAL,
    "model_executor": ("vLLM's model executor", "reach the model with apply_model() or "
                       "collective_rpc(); llm_engine.model is the model itself"),
    "vllm_config": CONFIG, "observability_config": CONFIG,
    "from_vllm_config": ("building from a VllmConfig", "pass engine arguments (LLMEngine(model, "
                         "**kwargs) or from_engine_args)"),
}

SAMPLING_REFUSED = {
    "for_sampler_warmup": ("sampler warm-up parameters", "the engine does not warm up"),
    "update_from_generation_config": ("SamplingParams.update_from_generation_config",
                                      "the engine applies the checkpoint's EOS ids and "
                                      "defaults itself at submission"),
    "update_from_tokenizer": ("SamplingParams.update_from_tokenizer", "bad_words are "
                              "tokenized by the engine at submission"),
}
