"""vLLM's ``LoRARequest`` (``vllm.lora.request``): constructs as vLLM's, refused when used.

This engine loads no adapters: a request that passes one (``generate(..., lora_request=)``,
``LLMEngine.add_request(..., lora_request=)``) is refused by ``api.intake.reject_unsupported``
with a message naming LoRA; ``enable_lora=True`` is refused at start-up (engine_args.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from vllm_api.errors import VLLMValidationError


@dataclass
class LoRARequest:
    """One LoRA adapter: a name, a positive integer id, a local path."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None
    tensorizer_config_dict: dict | None = None
    load_inplace: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise VLLMValidationError(f"id must be > 0, got {self.lora_int_id}",
                                      parameter="lora_int_id", value=self.lora_int_id)

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    def __hash__(self) -> int:
        return hash(self.lora_name)
