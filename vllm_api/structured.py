"""vLLM's ``StructuredOutputsParams`` (and its old name ``GuidedDecodingParams``).

Scripts import and build these even when they never constrain anything (TRL at module level,
Outlines per call), so they construct and validate as vLLM's do; a request that carries one
is refused at submission by ``SamplingParams.verify`` ("structured outputs are not supported
by this engine ..."): constraining tokens needs a grammar backend this engine has not.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from vllm_api.errors import VLLMValidationError

CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """One output constraint (exactly one of ``CONSTRAINTS``) plus its options."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in CONSTRAINTS if getattr(self, name) is not None]
        if len(given) != 1:
            which = "none are" if not given else f"{', '.join(given)} are all"
            raise VLLMValidationError(f"structured outputs take exactly one constraint "
                                      f"({', '.join(CONSTRAINTS)}), but {which} specified",
                                      parameter="structured_outputs", value=given)

    def all_constraints_none(self) -> bool:
        """True when no constraint is set (never, after construction)."""
        return all(getattr(self, name) is None for name in CONSTRAINTS)

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


GuidedDecodingParams = StructuredOutputsParams  # vLLM < 0.11's name, still in scripts
