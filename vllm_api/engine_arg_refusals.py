"""The rest of vLLM 0.32's ``EngineArgs`` fields (vllm_members.json), by the feature each
belongs to, none of which this engine serves.

Each is accepted "off" -- None, False, 0, "", an empty container, "auto", or vLLM's own
default where that is a literal -- as a script passing vLLM's defaults along
(``LLM(**asdict(EngineArgs(...)))``) does; any other value is a ``ValueError`` naming the
feature. engine_args.py holds the arguments this engine implements, renames, or accepts as
neutral, and the unsupported ones with their own reasons.
"""
from __future__ import annotations

from vllm_api.refusals import vllm_members

BY_FEATURE = {
    "multimodal inputs": (
        "allowed_media_domains", "default_mm_loras", "disable_chunked_mm_input",
        "enable_mm_embeds", "enable_mm_processor_stats", "enable_tower_connector_lora",
        "interleave_mm_strings", "io_processor_plugin", "language_model_only", "media_io_kwargs",
        "mm_device_do_normalize", "mm_encoder_attn_backend", "mm_encoder_attn_dtype",
        "mm_encoder_fp8_scale_path", "mm_encoder_fp8_scale_save_margin",
        "mm_encoder_fp8_scale_save_path", "mm_encoder_only", "mm_encoder_tp_mode",
        "mm_hasher_algorithm", "mm_ipc_gpu_memory_gb", "mm_processor_cache_gb",
        "mm_processor_cache_type", "mm_processor_device", "mm_shm_cache_max_object_size_mb",
        "mm_tensor_ipc", "renderer_num_workers", "skip_mm_profiling", "video_pruning_method",
        "video_pruning_rate"),
    "multi-device and multi-node execution": (
        "cp_kv_cache_interleave_size", "cpu_distributed_timeout_seconds", "data_parallel_address",
        "data_parallel_backend", "data_parallel_external_lb", "data_parallel_hybrid_lb",
        "data_parallel_multi_port_external_lb", "data_parallel_rank", "data_parallel_rpc_port",
        "data_parallel_size_local", "data_parallel_start_rank", "dbo_decode_token_threshold",
        "dbo_prefill_token_threshold", "dcp_comm_backend", "dcp_kv_cache_interleave_size",
        "dcp_q_replicate", "decode_context_parallel_size", "device_ids",
        "disable_nccl_for_dp_synchronization", "distributed_timeout_seconds", "dp_sync_interval",
        "elastic_ep_max_dp_size", "enable_batch_sharded_sampling", "enable_dbo",
        "enable_elastic_ep", "enable_hc_sp", "enable_nccl_comm_suspend",
        "enable_shm_tensor_arena", "master_addr", "master_port", "nnodes", "node_rank",
        "numa_bind", "numa_bind_cpus", "numa_bind_nodes", "prefill_context_parallel_size",
        "ray_workers_use_nsight", "ubatch_size"),
    "mixture-of-experts models": (
        "all2all_backend", "enable_eplb", "enable_ep_weight_filter",
        "enable_return_routed_experts", "eplb_config", "expert_placement_strategy",
        "moe_backend"),
    "Mamba / hybrid models": (
        "disable_hybrid_kv_cache_manager", "enable_mamba_cache_stochastic_rounding",
        "enable_mamba_shared_prefix_checkpoint", "gdn_prefill_backend", "kda_decode_backend",
        "kda_prefill_backend", "mamba_backend", "mamba_block_size", "mamba_cache_dtype",
        "mamba_cache_mode", "mamba_cache_philox_rounds", "mamba_config", "mamba_ssm_cache_dtype",
        "mamba_ssu_algorithm", "replayssm_buffer_len", "use_replayssm"),
    "LoRA adapters": (
        "enable_mixed_moe_lora_format", "enable_moe_shared_loras", "lora_target_modules",
        "max_lora_cls_labels", "specialize_active_lora"),
    "weight and KV offloading": (
        "cpu_offload_params", "kv_offloading_backend", "kv_offloading_size", "offload_backend",
        "offload_group_size", "offload_num_in_group", "offload_params", "offload_prefetch_step"),
    "sleep mode": ("enable_cumem_allocator", "sleep_mode_offload_cudagraph",
                   "sleep_preserve_parameter_names"),
    "KV and encoder-cache transfer": ("ec_manager_config", "ec_transfer_config",
                                      "kv_sharing_fast_prefill"),
    "speculative decoding": ("per_request_spec_decode_metrics",),
    "vLLM's tracing, logging and metrics options": (
        "aggregate_engine_logging", "collect_detailed_traces", "cudagraph_metrics",
        "custom_histogram_buckets", "enable_layerwise_nvtx_tracing",
        "enable_logging_iteration_details", "enable_mfu_metrics", "jit_monitor_mode",
        "jit_monitor_verbose", "kv_cache_metrics", "kv_cache_metrics_sample", "log_config_file",
        "log_level", "logging_config", "otlp_traces_endpoint", "show_hidden_metrics_for_version",
        "fail_on_environ_validation"),
    "vLLM's kernel and backend selection": (
        "enable_flashinfer_autotune", "ir_op_priority", "kernel_config", "linear_backend",
        "optimization_level", "performance_mode", "sparse_indexer_topk_backend",
        "use_fp64_gumbel", "engram_config"),
    "vLLM's checkpoint loading options": (
        "allow_deprecated_quantization", "config_format", "hf_config_path", "ignore_patterns",
        "model_class_overrides", "model_loader_extra_config", "model_weights",
        "pt_load_map_location", "safetensors_load_strategy", "safetensors_prefetch_block_size",
        "safetensors_prefetch_num_threads"),
    "vLLM's scheduler options": (
        "kv_cache_dtype_skip_layers", "long_prefill_token_threshold_adaptive",
        "max_num_active_seqs", "max_num_queued_reqs", "max_num_queued_tokens",
        "max_num_scheduled_tokens", "prefill_schedule_interval",
        "prefix_cache_retention_interval", "prefix_match_unit", "scheduler_cls",
        "scheduler_reserve_full_isl", "swa_bounded_replay", "watermark", "watermark_config"),
    "fault tolerance": ("enable_fault_tolerance", "fault_tolerance_config"),
    "in-place weight transfer": ("weight_transfer_config",),
    "reasoning parsers": ("reasoning_config", "reasoning_parser_plugin"),
    "diffusion models": ("diffusion_config",),
    "auxiliary model outputs": ("aux_output_config", "return_sampling_mask", "tokens_only"),
    "trace replay": ("enable_trace_replay",),
    "vLLM's additional (platform) config": ("additional_config",),
}
FEATURE_OF = {name: feature for feature, names in BY_FEATURE.items() for name in names}
OFF = (None, False, 0, "", "auto")


def check_off(name: str, value) -> None:
    """Accept ``value`` for vLLM's argument ``name`` only where it leaves the feature off."""
    if _is_off(value) or value == _vllm_default(name):
        return
    raise ValueError(f"{name}={value!r} is not supported: {FEATURE_OF[name]} are not served by "
                     f"this engine (accepted: the default, off)")


def _is_off(value) -> bool:
    if isinstance(value, (list, tuple, dict, set)):
        return len(value) == 0
    return any(value is off or (type(value) is type(off) and value == off) for off in OFF)


def _vllm_default(name: str):
    default = vllm_members()["EngineArgs"]["members"][name].get("default")
    return None if isinstance(default, str) and default.startswith("<") else default
