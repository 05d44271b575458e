"""vLLM's ``StructuredOutputsParams`` (and its old name ``GuidedDecodingParams``), served through
xgrammar (core/grammar.py), vLLM's default backend.

``SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))`` constrains a
request's output to ``json`` (a JSON schema, as a dict or a string), ``regex``, ``choice`` (one
of the strings), ``grammar`` (EBNF, xgrammar's dialect) or ``json_object=True`` (any JSON
object). ``disable_any_whitespace`` is read as vLLM's xgrammar backend reads it (JSON without
free whitespace between tokens). The options of vLLM's other backends, and structural tags,
are refused by name at submission (``check_structured``): this engine has xgrammar only.

Errors are vLLM's, word for word: two kinds at once, or none, at construction; at submission
an invalid JSON schema ("Invalid JSON grammar specification.", "Failed to transform json schema
into a grammar: ..."), a schema keyword xgrammar would silently ignore, an unparsable regex
("Failed to transform regex into a grammar: ...") or grammar ("Invalid grammar
specification."): the core compiles the constraint then (its errors reworded by
validation.py), so a request that queues never fails for its grammar.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields

from vllm_api.errors import VLLMValidationError, refuse

CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
# StructuredOutputsParams fields only vLLM's other backends read (guidance, outlines).
OTHER_BACKENDS = {
    "disable_additional_properties": "vLLM's guidance backend's option",
    "whitespace_pattern": "vLLM's outlines backend's option",
}
# JSON-schema keywords xgrammar does not enforce, per JSON type (vLLM refuses them for it).
UNSUPPORTED_JSON_KEYWORDS = {
    "integer": ("multipleOf",), "number": ("multipleOf",),
    "array": ("uniqueItems", "contains", "minContains", "maxContains"),
    "object": ("minProperties", "maxProperties", "propertyNames", "patternProperties"),
}


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
        count = sum(getattr(self, name) is not None for name in CONSTRAINTS)
        if count > 1:
            raise VLLMValidationError("You can only use one kind of structured outputs "
                                      f"constraint but multiple are specified: {self.__dict__}",
                                      parameter="structured_outputs", value=self.__dict__)
        if count < 1:
            raise VLLMValidationError("You must use one kind of structured outputs constraint "
                                      f"but none are specified: {self.__dict__}",
                                      parameter="structured_outputs", value=self.__dict__)

    def all_constraints_none(self) -> bool:
        """True when no constraint is set (never, after construction)."""
        return all(getattr(self, name) is None for name in CONSTRAINTS)

    def all_non_structural_tag_constraints_none(self) -> bool:
        return all(getattr(self, name) is None for name in CONSTRAINTS[:-1])

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


GuidedDecodingParams = StructuredOutputsParams  # vLLM < 0.11's name, still in scripts


def check_structured(constraint) -> None:
    """At submission: a ``StructuredOutputsParams`` this engine serves, or vLLM's error, or a
    refusal naming what is not served."""
    if not isinstance(constraint, StructuredOutputsParams):
        raise VLLMValidationError(f"structured_outputs must be StructuredOutputsParams, got "
                                  f"{type(constraint).__name__}",
                                  parameter="structured_outputs", value=constraint)
    if constraint.structural_tag is not None:
        refuse("structural tags", "structured_outputs.structural_tag: tool-call tags are not "
                                  "served; json, regex, choice, grammar and json_object are")
    for name, whose in OTHER_BACKENDS.items():
        if getattr(constraint, name) not in (None, False):
            refuse(f"structured_outputs.{name}", f"{whose}; structured outputs here use "
                                                f"xgrammar (use disable_any_whitespace)")
    if constraint.json is not None:
        check_json_schema(constraint.json)


def check_json_schema(schema) -> None:
    """vLLM's checks before xgrammar sees a schema: it parses, and uses no keyword xgrammar
    would ignore."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise VLLMValidationError("Invalid JSON grammar specification.",
                                      parameter="structured_outputs", value=str(exc)) from exc
    if _has_unsupported_keywords(schema):
        raise VLLMValidationError("The provided JSON schema contains features not supported "
                                  "by xgrammar.", parameter="structured_outputs", value=schema)


def _has_unsupported_keywords(node) -> bool:
    if isinstance(node, list):
        return any(_has_unsupported_keywords(item) for item in node)
    if not isinstance(node, dict):
        return False
    if any(key in node for key in UNSUPPORTED_JSON_KEYWORDS.get(node.get("type"), ())):
        return True
    return any(_has_unsupported_keywords(value) for value in node.values())
