"""Structured outputs (issue 51): vLLM's ``StructuredOutputsParams`` through xgrammar on the demo
model's real tokenizer -- valid JSON for a schema on every path (plain, eager, kernels, int8),
every kind (json, regex, choice, grammar, json_object), under n > 1, with the prefix cache on,
and when a step fails; the grammar compiled once per constraint; bad input in vLLM's words."""
from __future__ import annotations

import json
import re

import pytest

from engine import (
    BeamSearchParams,
    SamplingParams,
    StructuredOutputsParams,
    UnsupportedFeatureError,
    VLLMValidationError,
)
from helpers import DEMO_MODEL_DIR, greedy, make_llm

PATHS = {"plain": dict(fast_paths=False), "eager": dict(enforce_eager=True), "kernels": {},
         "int8": dict(quantization="int8")}
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 10},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                                  "maxItems": 2}}}
PROMPTS = ["The record of the person is", "def describe(person):\n    return"]


def constrained(max_tokens: int = 80, temperature: float = 0.0, **constraint) -> SamplingParams:
    constraint = constraint or dict(json=SCHEMA, disable_any_whitespace=True)
    return SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=7 if temperature
                          else None, structured_outputs=StructuredOutputsParams(**constraint))


def check_record(text: str) -> dict:
    record = json.loads(text)
    assert set(record) == {"name", "age", "tags"}, record
    assert isinstance(record["name"], str) and len(record["name"]) <= 10
    assert isinstance(record["age"], int) and 0 <= record["age"] <= 150
    assert isinstance(record["tags"], list) and len(record["tags"]) <= 2
    return record


@pytest.fixture(scope="module")
def llm():
    return make_llm(DEMO_MODEL_DIR)


@pytest.mark.parametrize("path", PATHS)
def test_json_for_a_schema_on_every_path(path):
    llm = make_llm(DEMO_MODEL_DIR, **PATHS[path])
    free = llm.generate(PROMPTS, greedy(12), use_tqdm=False)
    mixed = llm.generate(PROMPTS + PROMPTS, [constrained()] * 2 + [greedy(12)] * 2,
                         use_tqdm=False)
    for out in mixed[:2]:
        assert out.outputs[0].finish_reason == "stop"  # the grammar ended it with EOS
        check_record(out.outputs[0].text)
    # The unconstrained rows of the same batch are not touched.
    assert [o.outputs[0].token_ids for o in mixed[2:]] == [o.outputs[0].token_ids for o in free]
    assert llm.llm_engine.engine_core.grammars.num_compiled == 1


def test_each_kind_of_constraint(llm):
    regex = r"[a-z]{3}-[0-9]{2}"
    cases = [
        (dict(regex=regex), lambda t: re.fullmatch(regex, t)),
        (dict(choice=["yes", "no", 'say "maybe"']), lambda t: t in ("yes", "no", 'say "maybe"')),
        (dict(grammar='root ::= "def " name "(" name? ")"\nname ::= [a-z_]{1,8}'),
         lambda t: re.fullmatch(r"def [a-z_]{1,8}\([a-z_]{0,8}\)", t)),
        (dict(json_object=True, disable_any_whitespace=True),
         lambda t: isinstance(json.loads(t), dict)),
        (dict(json=json.dumps(SCHEMA), disable_any_whitespace=True), check_record),
    ]
    outs = llm.generate([PROMPTS[0]] * len(cases),  # a free object may run long: room to close it
                        [constrained(max_tokens=300, **kw) for kw, _ in cases], use_tqdm=False)
    for (kw, valid), out in zip(cases, outs):
        assert valid(out.outputs[0].text), (kw, out.outputs[0].text)


def test_any_whitespace_is_the_default_and_disable_any_whitespace_removes_it(llm):
    """Compact JSON with disable_any_whitespace (separators "," and ":", as vLLM asks xgrammar);
    free whitespace between tokens otherwise (the demo model, trained on prose, takes it)."""
    (tight,) = llm.generate(PROMPTS[:1], constrained(), use_tqdm=False)
    text = tight.outputs[0].text
    assert text == json.dumps(json.loads(text), ensure_ascii=False, separators=(",", ":"))
    (loose,) = llm.generate(PROMPTS[:1], constrained(max_tokens=30, json=SCHEMA),
                            use_tqdm=False)
    assert loose.outputs[0].text.startswith("{") and "\n" in loose.outputs[0].text


def test_parallel_samples_each_follow_the_schema(llm):
    (out,) = llm.generate(PROMPTS[:1], SamplingParams(
        n=3, temperature=0.9, seed=3, max_tokens=100,
        structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)),
        use_tqdm=False)
    records = [check_record(c.text) for c in out.outputs if c.finish_reason == "stop"]
    assert len(records) == 3 and len({c.text for c in out.outputs}) > 1


def test_with_the_prefix_cache_a_second_request_reads_cached_blocks_and_is_the_same(llm):
    prompt = "The record of the person in the database, written as JSON, is the following:"
    first, second = (llm.generate([prompt], constrained(), use_tqdm=False)[0] for _ in range(2))
    assert second.num_cached_tokens > 0
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    check_record(second.outputs[0].text)


class FailOnce:
    """A forward hook that raises once, on its ``when``-th call (a decode step of the batch)."""

    def __init__(self, llm, when: int) -> None:
        self.calls, self.when = 0, when
        self.handle = llm.model.layers[1].register_forward_hook(self)

    def __call__(self, module, args, output):
        self.calls += 1
        if self.calls == self.when:
            raise RuntimeError("a step failed")


@pytest.mark.parametrize("when", [2, 6])
def test_a_failed_step_moves_no_matcher_and_the_output_equals_the_unfailed_run(llm, when):
    params = [constrained(), constrained(regex=r"[a-z]{4}-[0-9]{3}", max_tokens=20),
              constrained(temperature=0.8)]
    want = [o.outputs[0].token_ids for o in llm.generate([PROMPTS[0]] * 3, params,
                                                         use_tqdm=False)]
    fault = FailOnce(llm, when)
    for i, sp in enumerate(params):
        llm.add_request(PROMPTS[0], sp, request_id=f"r{i}")
    done, failures = {}, 0
    try:
        while llm.has_unfinished_requests():
            try:
                done.update({o.request_id: o for o in llm.step()})
            except RuntimeError:
                failures += 1
                for seq_state in llm.llm_engine.engine_core.output_processor.seq_states.values():
                    assert seq_state.grammar.num_accepted == seq_state.num_output_tokens
    finally:
        fault.handle.remove()
    assert failures == 1
    assert [done[f"r{i}"].outputs[0].token_ids for i in range(3)] == want
    check_record(done["r0"].outputs[0].text)
    assert re.fullmatch(r"[a-z]{4}-[0-9]{3}", done["r1"].outputs[0].text)


def test_a_schema_compiles_once_however_often_it_is_sent(llm):
    grammars = llm.llm_engine.engine_core.grammars
    before = grammars.num_compiled
    schema = {**SCHEMA, "title": "once"}
    llm.generate(PROMPTS * 3, constrained(max_tokens=4, json=schema), use_tqdm=False)
    llm.generate(PROMPTS, [constrained(max_tokens=4, json=schema),
                           constrained(max_tokens=4, json=json.dumps(schema))], use_tqdm=False)
    assert grammars.num_compiled == before + 1
    # the order of "properties" is the order generated (as vLLM compiles it): another grammar
    swapped = {**schema, "properties": dict(reversed(list(schema["properties"].items())))}
    llm.generate(PROMPTS[:1], constrained(max_tokens=4, json=swapped), use_tqdm=False)
    assert grammars.num_compiled == before + 2


@pytest.mark.parametrize("constraint,text", [
    (dict(json="{not json"), "^Invalid JSON grammar specification.$"),
    (dict(json={"type": "no-such-type"}), "^Failed to transform json schema into a grammar: "),
    (dict(json={"type": "array", "uniqueItems": True}),
     "^The provided JSON schema contains features not supported by xgrammar.$"),
    (dict(regex="(ab"), "^Failed to transform regex into a grammar: "),
    (dict(grammar="root ::= "), "^Invalid grammar specification.$"),
])
def test_bad_constraints_are_refused_at_submission_in_vllms_words(llm, constraint, text):
    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(**constraint))
    with pytest.raises(VLLMValidationError, match=text):
        llm.generate(PROMPTS, [greedy(4), params], use_tqdm=False)
    assert not llm.has_unfinished_requests()  # one bad request queues nothing


def test_two_kinds_at_once_or_none_in_vllms_words():
    with pytest.raises(VLLMValidationError, match="^You can only use one kind of structured "
                                                  "outputs constraint but multiple are specified"):
        StructuredOutputsParams(json=SCHEMA, regex="a+")
    with pytest.raises(VLLMValidationError, match="^You must use one kind of structured outputs "
                                                  "constraint but none are specified"):
        StructuredOutputsParams(disable_any_whitespace=True)


@pytest.mark.parametrize("constraint,feature", [
    (dict(structural_tag='{"type": "structural_tag"}'), "structural tags"),
    (dict(json=SCHEMA, whitespace_pattern=r"[ ]?"), "whitespace_pattern"),
    (dict(json=SCHEMA, disable_additional_properties=True), "disable_additional_properties"),
])
def test_other_backends_options_are_refused_by_name(llm, constraint, feature):
    params = SamplingParams(structured_outputs=StructuredOutputsParams(**constraint))
    with pytest.raises(UnsupportedFeatureError, match=feature):
        llm.generate(PROMPTS[:1], params, use_tqdm=False)


def test_beam_search_with_a_grammar_is_refused_by_name(llm):
    params = BeamSearchParams(beam_width=2, max_tokens=8,
                              structured_outputs=StructuredOutputsParams(regex="[a-z]+"))
    with pytest.raises(UnsupportedFeatureError, match="structured outputs with beam search"):
        llm.beam_search([{"prompt": PROMPTS[0]}], params)


def test_without_a_tokenizer_structured_outputs_say_why():
    llm = make_llm(DEMO_MODEL_DIR, skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="structured outputs need the tokenizer"):
        llm.generate([[5, 6, 7]], SamplingParams(
            max_tokens=3, detokenize=False,
            structured_outputs=StructuredOutputsParams(regex="a+")), use_tqdm=False)
