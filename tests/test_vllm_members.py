"""vLLM 0.32's class surface (vllm_api/vllm_members.json, read from vLLM's sources by
tools/vllm_members.py) on live objects: every public member of AsyncLLM, LLM, LLMEngine,
EngineArgs, ModelConfig and SamplingParams is there or refused at use naming its feature,
methods take vLLM's parameters (names, positional order, async where vLLM's are), and every
EngineArgs field is accepted off (None or vLLM's default) and refused otherwise by name."""
from __future__ import annotations

import asyncio
import dataclasses
import inspect
import re

import pytest

from engine import LLM, AsyncLLM, EngineArgs, SamplingParams
from helpers import make_llm
from tools.vllm_surface_doc import DOC, rewrite
from vllm_api.engine_arg_refusals import FEATURE_OF
from vllm_api.engine_args import translate_engine_args
from vllm_api.errors import UnsupportedAttributeError, UnsupportedFeatureError
from vllm_api.member_surface import status_of
from vllm_api.refusals import refusal_of, vllm_members

METHODS = ("method", "async method", "classmethod", "staticmethod")


@pytest.fixture(scope="module")
def objects(llama_dir):
    llm = make_llm(llama_dir)
    async_llm = AsyncLLM(llama_dir, device="cpu", dtype="float32", num_kv_blocks=32)
    yield {"LLM": llm, "LLMEngine": llm.llm_engine, "AsyncLLM": async_llm,
           "EngineArgs": EngineArgs(model=llama_dir), "SamplingParams": SamplingParams(),
           "ModelConfig": llm.llm_engine.model_config}
    async_llm.shutdown()


def members(kinds=None):
    return [(cls, name, m) for cls, listing in vllm_members().items()
            for name, m in listing["members"].items() if kinds is None or m["kind"] in kinds]


def test_every_vllm_member_is_there_or_a_named_refusal(objects):
    missing = [f"{cls}.{name}" for cls, name, _ in members()
               if refusal_of(type(objects[cls]), name) is None and not hasattr(objects[cls], name)]
    assert missing == []


def test_refused_methods_raise_naming_the_feature(objects):
    for cls, name, member in members(METHODS):
        refusal = refusal_of(type(objects[cls]), name)
        if refusal is None:
            continue
        with pytest.raises(UnsupportedFeatureError, match=refusal[0].split(":")[0][:30]):
            result = getattr(objects[cls], name)()
            if inspect.iscoroutine(result):
                asyncio.run(result)


def test_refused_attributes_raise_naming_the_feature_and_read_as_missing(objects):
    refused = [(c, n) for c, n, m in members() if m["kind"] not in METHODS
               and refusal_of(type(objects[c]), n) is not None]
    assert refused  # renderer, input_processor, vllm_config, ...
    for cls, name in refused:
        feature = refusal_of(type(objects[cls]), name)[0]
        with pytest.raises(UnsupportedAttributeError) as caught:
            getattr(objects[cls], name)
        assert feature in str(caught.value)
        assert getattr(objects[cls], name, None) is None and not hasattr(objects[cls], name)


def test_methods_take_vllms_parameters(objects):
    wrong = []
    for cls, name, member in members(METHODS):
        if refusal_of(type(objects[cls]), name) is None:
            problem = signature_gap(getattr(objects[cls], name), member)
            if problem:
                wrong.append(f"{cls}.{name}: {problem}")
    assert wrong == []


def signature_gap(ours, member) -> str | None:
    """What vLLM's call shapes would break on ours: a positional parameter elsewhere, a
    keyword ours lacks, or sync where vLLM's is async."""
    params = inspect.signature(ours).parameters.values()
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    named = {p.name for p in params}
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params)
    theirs = member["params"]
    cut = next((i for i, p in enumerate(theirs) if p.startswith("*")), len(theirs))
    shared = min(cut, len(positional))  # the order both take positionally must agree
    if positional[:shared] != theirs[:shared]:
        return f"positional {positional[:shared]} != vLLM's {theirs[:shared]}"
    lacking = [p for p in theirs[shared:] if not p.startswith("*") and p not in named]
    if lacking and not takes_any:
        return f"no keyword(s) {lacking}"
    if member["kind"] == "async method" and not (inspect.iscoroutinefunction(ours)
                                                 or inspect.isasyncgenfunction(ours)):
        return "not async"
    return None


def test_engine_args_is_vllms_dataclass_and_builds_an_engine(llama_dir):
    args = EngineArgs(model=llama_dir, device="cpu", dtype="float32", num_kv_blocks=16)
    fields = {f.name for f in dataclasses.fields(args)}
    vllm_fields = {n for n, m in vllm_members()["EngineArgs"]["members"].items()
                   if m["kind"] == "field"}
    assert vllm_fields <= fields
    llm = LLM(**dataclasses.asdict(args))  # the benchmarks' LLM(**asdict(args))
    assert llm.llm_engine.model_config.max_model_len == llm.max_model_len
    assert llm.config.num_kv_blocks == 16


def test_engine_arg_fields_of_features_not_served_are_refused_by_name():
    for name, feature in FEATURE_OF.items():
        translate_engine_args({name: None}, ())
        with pytest.raises(ValueError, match=re.escape(feature)):
            translate_engine_args({name: "on, please"}, ())


def test_model_config_reads_like_vllms(objects):
    config = objects["ModelConfig"]
    llm = objects["LLM"]
    assert config.max_model_len == llm.max_model_len and config.dtype == llm.dtype
    assert config.get_vocab_size() == config.hf_config.vocab_size == config.vocab_size
    assert config.architecture == config.hf_config.architectures[0]
    assert config.mm_processor_kwargs is None and config.is_multimodal_model is False
    assert config.get_num_layers() == config.hf_config.num_hidden_layers
    assert llm.model_config is llm.llm_engine.model_config


def test_statuses_cover_every_member():
    for cls, name, _ in members():
        assert status_of(cls, name)[0] in ("implemented", "neutral", "refused at use")


def test_the_docs_carry_the_current_member_table():
    text = DOC.read_text()
    assert rewrite(text) == text, "run: python -m tools.vllm_surface_doc"


def test_refusal_tables_name_only_vllm_members_the_class_lacks(objects):
    """A refusal is made when asked for (refusals.py), so the tables are checked here: each
    name is a member of vLLM's class, implemented nowhere in ours, in vLLM's kind when read on
    the class itself."""
    wrong = []
    for cls, obj in objects.items():
        klass, listing = type(obj), vllm_members()[cls]["members"]
        for name in klass.REFUSED_MEMBERS:
            if name not in listing:
                wrong.append(f"{cls}.{name}: not a vLLM member")
            elif any(name in vars(k) for k in klass.__mro__):
                wrong.append(f"{cls}.{name}: implemented")
            elif listing[name]["kind"] == "async method" and not inspect.iscoroutinefunction(
                    getattr(klass, name)):
                wrong.append(f"{cls}.{name}: not async")
            elif name not in dir(obj):
                wrong.append(f"{cls}.{name}: missing from dir()")
    assert wrong == []


def test_refused_class_methods_raise_on_the_class(objects):
    """vLLM's class and static methods are called on the class (``LLMEngine.from_vllm_config``)."""
    for cls, name, member in members(("classmethod", "staticmethod")):
        refusal = refusal_of(type(objects[cls]), name)
        if refusal is not None:
            with pytest.raises(UnsupportedFeatureError, match=refusal[0].split(":")[0][:30]):
                getattr(type(objects[cls]), name)()
