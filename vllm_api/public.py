"""Every vLLM public name this engine provides, for ``from engine import *`` (engine.py
re-exports this module) -- vLLM's ``vllm``, ``vllm.sampling_params``, ``vllm.outputs``,
``vllm.inputs``, ``vllm.engine.arg_utils``, ``vllm.lora.request`` and the ``vllm.config``
classes scripts import. ``LLM`` and ``LLMEngine`` themselves live in engine.py.
docs/vllm_api.md says, name by name, what is implemented, neutral, or refused at use.
"""
from __future__ import annotations

from vllm_api.async_llm import AsyncLLM, AsyncLLMEngine
from vllm_api.beam import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from vllm_api.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVCacheEvent,
    KVEventBatch,
    KVEventsConfig,
)
from vllm_api.kv_events_zmq import ZmqEventPublisher
from vllm_api.errors import (
    EngineDeadError,
    EngineGenerateError,
    UnsupportedFeatureError,
    VLLMValidationError,
)
from vllm_api.logits_processors import (
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
    process_dict_updates,
)
from vllm_api.intake import (
    DataPrompt,
    EmbedsInput,
    EmbedsPrompt,
    ExplicitEncoderDecoderPrompt,
    PromptType,
    SingletonPrompt,
    TextPrompt,
    TokensInput,
    TokensPrompt,
    tokens_input,
)
from vllm_api.lora import LoRARequest
from vllm_api.metrics import Counter, Gauge, Histogram, Metric, Vector
from core.outputs import CompletionOutput, Logprob, RequestOutput
from vllm_api.outputs import STREAM_FINISHED, RequestError
from vllm_api.pooling import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingParams,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from vllm_api.refused_engines import (
    FlexibleArgumentParser,
    ModelRegistry,
    initialize_ray_cluster,
)
from vllm_api.sampling_params import (
    RepetitionDetectionParams,
    RequestOutputKind,
    SamplingParams,
    SamplingType,
)
from vllm_api.structured import GuidedDecodingParams, StructuredOutputsParams
from vllm_api.tokenizers import get_tokenizer
from vllm_api.type_aliases import (
    ConvertOption,
    ExternalBlockHash,
    HfOverrides,
    LogprobsMode,
    LogprobsOnePosition,
    ModelDType,
    PromptLogprobs,
    RunnerOption,
    SampleLogprobs,
    TokenizerMode,
    random_uuid,
)
from vllm_api.vllm_config import (
    CompilationConfig,
    CompilationMode,
    CUDAGraphMode,
    KVTransferConfig,
    PoolerConfig,
    ProfilerConfig,
    SpeculativeConfig,
    StructuredOutputsConfig,
    VllmConfig,
)



def __getattr__(name: str):
    """``EngineArgs`` / ``AsyncEngineArgs``: built from vLLM's field listing when first asked for."""
    if name in ("EngineArgs", "AsyncEngineArgs"):
        from vllm_api import engine_args
        return getattr(engine_args, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# The vLLM release whose API this engine follows (its names and members were read from it:
# vllm_names.json, vllm_members.json), so version gates in frameworks take that branch.
__version__ = "0.32.0"
__version_tuple__ = (0, 32, 0)

__all__ = [
    # vllm
    "AsyncEngineArgs", "AsyncLLMEngine", "ClassificationOutput", "ClassificationRequestOutput",
    "CompletionOutput", "EmbeddingOutput", "EmbeddingRequestOutput", "EngineArgs",
    "ModelRegistry", "PoolingOutput", "PoolingParams", "PoolingRequestOutput", "PromptType",
    "RequestOutput", "SamplingParams", "ScoringOutput", "ScoringRequestOutput", "TextPrompt",
    "TokensPrompt", "initialize_ray_cluster",
    # vllm.sampling_params
    "BeamSearchParams", "RepetitionDetectionParams", "RequestOutputKind", "SamplingType", "StructuredOutputsParams",
    "GuidedDecodingParams",
    # vllm.outputs
    "RequestError", "STREAM_FINISHED", "Logprob",
    # vllm.inputs
    "DataPrompt", "EmbedsInput", "EmbedsPrompt", "ExplicitEncoderDecoderPrompt",
    "SingletonPrompt", "TokensInput", "tokens_input",
    # vllm.lora.request
    "LoRARequest",
    # vllm.config
    "CompilationConfig", "CompilationMode", "CUDAGraphMode", "KVTransferConfig",
    "PoolerConfig", "ProfilerConfig", "SpeculativeConfig", "StructuredOutputsConfig",
    "KVEventsConfig", "VllmConfig",
    # vllm.config.model
    "LogprobsMode", "ModelDType", "TokenizerMode", "RunnerOption", "ConvertOption", "HfOverrides",
    # vllm.logprobs
    "LogprobsOnePosition", "SampleLogprobs", "PromptLogprobs",
    # vllm.v1.engine.async_llm, vllm.utils
    "AsyncLLM", "random_uuid",
    # vllm.distributed.kv_events
    "BlockStored", "BlockRemoved", "AllBlocksCleared", "KVCacheEvent", "KVEventBatch",
    "EventBatch", "ZmqEventPublisher", "MEDIUM_GPU", "ExternalBlockHash",
    # vllm.entrypoints.generate.beam_search.utils
    "BeamSearchOutput", "BeamSearchSequence",
    # vllm.v1.metrics.reader, vllm.utils.argparse_utils, vllm.exceptions
    "Counter", "Gauge", "Histogram", "Metric", "Vector", "FlexibleArgumentParser",
    "VLLMValidationError", "UnsupportedFeatureError",
    # vllm.v1.engine.exceptions
    "EngineDeadError", "EngineGenerateError",
    # vllm.v1.sample.logits_processor (process_dict_updates: its .builtin)
    "BatchUpdate", "LogitsProcessor", "MoveDirectionality", "process_dict_updates",
    # vllm (lazily), vllm.tokenizers, vllm.transformers_utils.tokenizer
    "get_tokenizer",
]
