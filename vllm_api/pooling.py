"""vLLM's pooling names (``PoolingParams`` and the embedding / classification / scoring
outputs): importable and constructible, refused when used -- this engine runs generative
models only, so ``LLM.encode`` / ``embed`` / ``classify`` / ``score`` / ``reward`` and a
``PoolingParams`` given to ``generate`` raise, naming pooling."""
from __future__ import annotations

from dataclasses import dataclass, field

POOLING_REASON = "the engine runs generative models only (no embedding, classification, " \
                 "scoring or reward heads)"


@dataclass
class PoolingParams:
    """What a pooling request would ask for (vLLM's fields; never served here)."""

    truncate_prompt_tokens: int | None = None
    dimensions: int | None = None
    normalize: bool | None = None
    use_activation: bool | None = None
    task: str | None = None
    requires_token_ids: bool = False
    extra_kwargs: dict | None = None
    output_kind: object = None

    def clone(self) -> "PoolingParams":
        return PoolingParams(**self.__dict__)


@dataclass
class PoolingOutput:
    data: object


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class PoolingRequestOutput:
    """One pooling request's result (vLLM's shape; this engine never produces one)."""

    request_id: str
    outputs: object
    prompt_token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    finished: bool = True


class EmbeddingRequestOutput(PoolingRequestOutput):
    pass


class ClassificationRequestOutput(PoolingRequestOutput):
    pass


class ScoringRequestOutput(PoolingRequestOutput):
    pass
