"""Structured outputs in the core: a request's grammar, compiled once at submission, one matcher
per sequence, and the token bitmask each step applies to that sequence's row of the logits.

The grammar engine is xgrammar (a dependency made for this: a compiled grammar gives, for a
matcher's state, the bitmask of the tokens that keep the output valid). A constraint is what
vLLM's ``StructuredOutputsParams`` carries -- ``json`` (a schema), ``regex``, ``choice``,
``grammar`` (EBNF) or ``json_object`` -- read by attribute, so the core needs no class of the
vLLM layer. ``GrammarCompiler`` compiles it at submission (an unparsable constraint is a
``ParameterError`` then, naming the kind, before anything is queued) and keeps the compiled
grammar per constraint, so a schema sent a thousand times compiles once.

The step: the sampler asks each constrained row's ``SequenceGrammar`` to fill its bitmask (a
read: the matcher does not move) and masks the row; the output processor advances the matcher
with the accepted token in the step's commit. A step that fails before its commit has moved no
matcher, so the retried step sees each one where it was.
"""
from __future__ import annotations

import json
import warnings
from dataclasses import dataclass

import torch

from core.errors import ParameterError

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class GrammarSpec:
    """One constraint as the compiler's cache key: its kind, its text, its whitespace rule."""

    kind: str
    text: str
    any_whitespace: bool = True


def spec_of(constraint) -> GrammarSpec:
    """The ``GrammarSpec`` of a ``StructuredOutputsParams``-like object (exactly one kind set)."""
    given = [k for k in (*KINDS, "structural_tag") if getattr(constraint, k, None) is not None]
    if len(given) != 1:
        raise ParameterError(f"structured_outputs takes exactly one constraint "
                             f"({', '.join(KINDS)}); got {given or 'none'}",
                             parameter="structured_outputs", value=given, rule="one_kind")
    kind, any_ws = given[0], not getattr(constraint, "disable_any_whitespace", False)
    value = getattr(constraint, kind)
    if kind == "json":
        return GrammarSpec(kind, value if isinstance(value, str) else _dump(value), any_ws)
    if kind == "json_object":
        return GrammarSpec(kind, "", any_ws)
    if kind == "choice":
        return GrammarSpec(kind, choice_grammar(value), any_ws)
    if not isinstance(value, str):
        raise ParameterError(f"structured_outputs.{kind} must be a string, got "
                             f"{type(value).__name__}", parameter="structured_outputs",
                             value=value, rule=f"{kind}_type")
    return GrammarSpec(kind, value, any_ws)


def _dump(schema) -> str:
    try:
        return json.dumps(schema)  # as given: the order of "properties" is the order generated
    except (TypeError, ValueError) as exc:
        raise ParameterError(f"the JSON schema cannot be written as JSON: {exc}",
                             parameter="structured_outputs", value=str(exc),
                             rule="json_syntax") from None


def _whitespace(spec: GrammarSpec) -> dict:
    """xgrammar's options for the whitespace rule, as vLLM passes them: without any whitespace,
    also no space after the separators."""
    if spec.any_whitespace:
        return dict(any_whitespace=True)
    return dict(any_whitespace=False, separators=(",", ":"))


def choice_grammar(choices) -> str:
    """An EBNF grammar accepting exactly one of ``choices`` (quotes and backslashes escaped)."""
    if not isinstance(choices, (list, tuple)) or not choices or \
            not all(isinstance(c, str) for c in choices):
        raise ParameterError("structured_outputs.choice must be a non-empty list of strings",
                             parameter="structured_outputs", value=choices, rule="choice")
    escaped = (c.replace("\\", "\\\\").replace('"', '\\"') for c in choices)
    return "root ::= " + " | ".join(f'"{c}"' for c in escaped)


class GrammarCompiler:
    """Compiles constraints for one tokenizer and vocabulary; one compiled grammar per
    ``GrammarSpec`` (``num_compiled`` counts real compilations). Built on first use, so an
    engine whose requests never constrain anything never loads xgrammar."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids=()) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.stop_token_ids = sorted(stop_token_ids) or None
        self._compiler = None
        self._cache: dict[GrammarSpec, object] = {}
        self.num_compiled = 0

    def compile(self, constraint):
        """The compiled grammar of ``constraint``, from the cache when it was compiled before."""
        spec = spec_of(constraint)
        if spec not in self._cache:
            self._cache[spec] = self._compile(spec)
            self.num_compiled += 1
        return self._cache[spec]

    def _xgrammar(self):
        if self._compiler is None:
            if self.tokenizer is None:
                raise ParameterError("structured outputs need the tokenizer (the engine has "
                                     "none: skip_tokenizer_init=True, or no tokenizer files)",
                                     parameter="structured_outputs", value=None,
                                     rule="no_tokenizer")
            import xgrammar as xgr
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_token_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler

    def _compile(self, spec: GrammarSpec):
        compiler = self._xgrammar()
        if spec.kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', **_whitespace(spec))
        if spec.kind == "json":
            try:
                json.loads(spec.text)
            except ValueError as exc:
                raise ParameterError(f"the JSON schema is not valid JSON: {exc}",
                                     parameter="structured_outputs", value=str(exc),
                                     rule="json_syntax") from None
        try:
            if spec.kind == "json":
                return compiler.compile_json_schema(spec.text, **_whitespace(spec))
            if spec.kind == "regex":
                return compiler.compile_regex(spec.text)
            return compiler.compile_grammar(spec.text)  # EBNF: "grammar", or "choice"'s
        except (RuntimeError, ValueError) as exc:
            raise ParameterError(f"the {spec.kind} constraint does not compile: "
                                 f"{_first_line(exc)}", parameter="structured_outputs",
                                 value=_first_line(exc), rule=spec.kind) from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class SequenceGrammar:
    """One sequence's matcher over a compiled grammar: ``fill`` reads the allowed tokens,
    ``accept`` (the commit's) advances it."""

    def __init__(self, compiled) -> None:
        import xgrammar as xgr
        self.matcher = xgr.GrammarMatcher(compiled)
        self.num_accepted = 0

    @property
    def constrains(self) -> bool:
        """False once the grammar is done (its stop token accepted): then nothing is masked."""
        return not self.matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int, request_id: str) -> None:
        """Advance with an accepted token. A token the mask did not allow (it never is) leaves
        the matcher where it was, with a warning, as vLLM logs it."""
        if not self.constrains:
            return
        if self.matcher.accept_token(int(token)):
            self.num_accepted += 1
        else:
            warnings.warn(f"request {request_id}: token {token} does not continue its grammar; "
                          f"the grammar stays where it was")


def apply_grammars(logits: torch.Tensor, seqs) -> torch.Tensor:
    """``logits`` [B, V] with each constrained row's disallowed tokens at -inf (a copy when any
    row is constrained; ``logits`` itself otherwise). ``seqs[row].grammar``: a
    ``SequenceGrammar`` or None. Rows without a grammar are not touched."""
    rows = [r for r, s in enumerate(seqs)
            if getattr(s, "grammar", None) is not None and s.grammar.constrains]
    if not rows:
        return logits
    import xgrammar as xgr
    bitmask = xgr.allocate_token_bitmask(len(seqs), logits.shape[-1])
    for row in rows:
        seqs[row].grammar.fill(bitmask, row)
    out = logits.clone()
    xgr.apply_token_bitmask_inplace(out, bitmask.to(out.device), indices=rows)
    return out
