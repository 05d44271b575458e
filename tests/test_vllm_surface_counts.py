"""The member-surface figures (vllm_api/member_surface.py, docs/vllm_api.md "Members of vLLM's
classes") are honest: a member whose implementation does nothing but refuse counts as refused
at use, and raises naming its feature; and vLLM 0.32's constructor parameters
(vllm_members.json) are each accepted here by name or refused at use by name."""
from __future__ import annotations

import asyncio
import functools
import importlib.util
import inspect
import textwrap

import pytest

from engine import LLM, AsyncLLM, SamplingParams
from helpers import make_llm
from vllm_api import engine_args as ea
from vllm_api.config import EngineConfig
from vllm_api.engine_arg_refusals import FEATURE_OF
from vllm_api.errors import UnsupportedFeatureError, refuse
from vllm_api.llm_engine import LLMEngine
from vllm_api.member_surface import STATUSES, classes, figures, refuse_only, status_of
from vllm_api.public import RepetitionDetectionParams, StructuredOutputsParams
from vllm_api.refusals import vllm_members
from vllm_api.sampling_params import UNSUPPORTED_FIELDS

METHODS = ("method", "async method", "classmethod", "staticmethod")
REASON = "a module-level reason"
OWN = EngineConfig.__dataclass_fields__


# ---------------------------------------------------------------- refuse-only members

class Sample:
    def only_refuses(self, *args, **kwargs):
        """Refused."""
        refuse("feature A", "reason A")

    alias = only_refuses

    def refuses_with_a_module_name(self, x):
        refuse("feature B", REASON)

    def raises(self):
        raise UnsupportedFeatureError("feature C", "reason C")

    @property
    def refused_property(self):
        refuse("feature D", "reason D")

    @staticmethod
    def refused_static():
        refuse("feature E", "reason E")

    def refuses_sometimes(self, level=0):
        if level:
            refuse("feature F", "reason F")

    def refuses_then_more(self):
        refuse("feature G", "reason G")
        return 1  # unreachable, but the body is not refuse-only

    def serves(self):
        return "served"

    def refuses_with_a_parameter(self, name):
        refuse(f"feature {name}", "reason H")

    @functools.wraps(only_refuses)
    def wraps_a_refusal(self, *args, **kwargs):
        print("does more than refuse")
        return Sample.only_refuses(self)


def test_refuse_only_reads_what_a_function_body_does():
    assert refuse_only(Sample, "only_refuses") == ("feature A", "reason A")
    assert refuse_only(Sample, "alias") == ("feature A", "reason A")
    assert refuse_only(Sample, "refuses_with_a_module_name") == ("feature B", REASON)
    assert refuse_only(Sample, "raises") == ("feature C", "reason C")
    assert refuse_only(Sample, "refused_property") == ("feature D", "reason D")
    assert refuse_only(Sample, "refused_static") == ("feature E", "reason E")
    assert refuse_only(Sample, "refuses_with_a_parameter") == ("f'feature {name}'", "reason H")
    for served in ("refuses_sometimes", "refuses_then_more", "serves", "wraps_a_refusal",
                   "no_such_member"):
        assert refuse_only(Sample, served) is None, served


def test_a_function_merely_named_refuse_is_not_a_refusal(tmp_path):
    (tmp_path / "lookalike.py").write_text(textwrap.dedent('''
        def refuse(feature, reason):
            return None  # not vllm_api.errors.refuse: nothing is refused

        class Lookalike:
            def method(self):
                refuse("feature", "reason")
    '''))
    spec = importlib.util.spec_from_file_location("lookalike", tmp_path / "lookalike.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.Lookalike().method() is None
    assert refuse_only(module.Lookalike, "method") is None


def test_methods_that_only_refuse_count_as_refused_and_servers_as_implemented():
    for name in ("encode", "embed", "classify", "score", "update_weights", "start_weight_update",
                 "init_weight_transfer_engine"):
        assert status_of("LLM", name)[0] == "refused at use", name
    for name in ("add_lora", "remove_lora", "pin_lora", "get_weight_version"):
        assert status_of("LLMEngine", name)[0] == "refused at use", name
    assert "pooling" in status_of("LLM", "encode")[1]
    # Served for some calls (sleep(level=0), a profile without a window): implemented.
    for cls, name in (("LLM", "sleep"), ("LLM", "start_profile"), ("LLM", "generate"),
                      ("LLM", "chat"), ("LLMEngine", "add_request"), ("LLM", "enqueue"),
                      ("LLM", "enqueue_chat"), ("LLM", "wait_for_completion")):
        assert status_of(cls, name) == ("implemented", ""), (cls, name)


def test_figures_add_up_and_count_every_status():
    for class_name, counts in figures().items():
        assert sum(counts[s] for s in STATUSES) == counts["members"], class_name
        statuses = [status_of(class_name, n)[0] for n in vllm_members()[class_name]["members"]]
        assert {s: statuses.count(s) for s in STATUSES} == {s: counts[s] for s in STATUSES}


@pytest.fixture(scope="module")
def objects(llama_dir):
    llm = make_llm(llama_dir)
    async_llm = AsyncLLM(llama_dir, device="cpu", dtype="float32", num_kv_blocks=32)
    yield {"LLM": llm, "LLMEngine": llm.llm_engine, "AsyncLLM": async_llm,
           "SamplingParams": SamplingParams()}
    async_llm.shutdown()


def test_every_method_counted_refused_raises_naming_its_feature(objects):
    """Table refusals and refuse-only implementations alike: called (None for each parameter
    it requires), each raises UnsupportedFeatureError naming the feature the table shows."""
    checked = set()
    for cls, obj in objects.items():
        for name, member in vllm_members()[cls]["members"].items():
            status, why = status_of(cls, name)
            if member["kind"] not in METHODS or status != "refused at use":
                continue
            method = getattr(obj, name)
            required = [p for p in inspect.signature(method).parameters.values()
                        if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY,
                                                                p.POSITIONAL_OR_KEYWORD)]
            with pytest.raises(UnsupportedFeatureError) as caught:
                result = method(*[None] * len(required))
                if inspect.iscoroutine(result):
                    asyncio.run(result)
            feature = why.split(": ")[0]
            assert feature in str(caught.value), (cls, name, feature, str(caught.value))
            checked.add(f"{cls}.{name}")
    assert {"LLM.encode", "LLM.update_weights", "LLMEngine.add_lora",
            "AsyncLLM.update_weights", "SamplingParams.update_from_tokenizer"} <= checked


# ---------------------------------------------------------------- constructors

def init_params(cls: str) -> list[str]:
    """vLLM's named constructor parameters of ``cls`` (no ``*`` / ``**kwargs``)."""
    return [p for p in vllm_members()[cls]["init"] if not p.startswith("*")]


def engine_arg_kind(name: str) -> str:
    """How the engine-argument translation (engine_args.py) takes vLLM's ``name``."""
    for kind, table in (("own", OWN), ("renamed", ea.RENAMED), ("neutral", ea.NEUTRAL),
                        ("unsupported", ea.UNSUPPORTED), ("feature off", FEATURE_OF)):
        if name in table:
            return kind
    return "unknown"


def refused_for_some_value(name: str) -> bool:
    kind = engine_arg_kind(name)
    return kind in ("unsupported", "feature off") or (
        kind == "neutral" and ea.NEUTRAL[name].values is not None)


def test_llm_takes_every_vllm_constructor_parameter_by_name(llama_dir):
    params = inspect.signature(LLM).parameters
    assert list(params)[0] == vllm_members()["LLM"]["init"][0] == "model"
    assert any(p.kind is p.VAR_KEYWORD for p in params.values())  # vLLM's **kwargs
    names = init_params("LLM")[1:]
    assert len(names) == 39  # and model: 40 named, with "*" and "**kwargs" the 42 listed
    assert [n for n in names if engine_arg_kind(n) == "unknown"] == []
    llm = LLM(llama_dir, **{n: None for n in names}, device="cpu", num_kv_blocks=16)
    assert llm.config.num_kv_blocks == 16 and llm.dtype is not None


def test_llm_constructor_parameters_it_cannot_serve_are_refused_by_name(llama_dir):
    refused = [n for n in init_params("LLM") if refused_for_some_value(n)]
    assert len(refused) >= 19  # tensor_parallel_size, cpu_offload_gb, spec_*, ... (not logits_processors)
    for name in refused:
        with pytest.raises(ValueError, match=f"^{name}="):
            LLM(llama_dir, **{name: "on, please"})


def test_engine_args_fields_are_each_translated_by_name():
    """vLLM's EngineArgs constructor is its fields: each is ours, renamed, neutral, or refused
    by name for a value that would turn its feature on."""
    fields = [n for n, m in vllm_members()["EngineArgs"]["members"].items()
              if m["kind"] == "field"]
    unknown = [n for n in fields if engine_arg_kind(n) == "unknown"]
    assert unknown == ["model", "worker_extension_cls"]  # the model; LLMEngine takes the other
    assert "worker_extension_cls" in inspect.getsource(LLMEngine.__init__)
    rest = [n for n in fields if n not in unknown]
    ea.translate_engine_args({n: None for n in rest}, OWN)  # None: the default, for every one
    for name in [n for n in rest if refused_for_some_value(n)]:
        with pytest.raises(ValueError, match=f"^{name}="):
            ea.translate_engine_args({name: "on, please"}, OWN)


def sampling_fields() -> dict[str, object]:
    return {n: m.get("default") for n, m in vllm_members()["SamplingParams"]["members"].items()
            if m["kind"] == "field"}


def test_sampling_params_take_vllms_fields_by_name():
    literal = {n: d for n, d in sampling_fields().items()
               if not (isinstance(d, str) and d.startswith("<"))}
    params = SamplingParams(**literal)  # each of vLLM's fields at vLLM's default
    for name, default in literal.items():  # None may read as the empty list it means
        assert getattr(params, name) == default or (default is None and getattr(params, name)
                                                    in ([], {})), name
    missing = [n for n in sampling_fields() if n not in inspect.signature(SamplingParams).parameters]
    assert not missing


ON = {"structured_outputs": StructuredOutputsParams(regex="a+"),
      "repetition_detection": RepetitionDetectionParams(2, 1, 2),
      "logprob_token_ids": [3], "prompt_logprob_token_ids": [3], "trace_decode_token_ids": [3],
      "watermarking": True, "flat_logprobs": True}


def test_sampling_params_fields_it_cannot_serve_are_refused_by_name():
    for name in UNSUPPORTED_FIELDS:
        params = SamplingParams(**{name: ON.get(name, 3)})  # constructs, as vLLM's does
        with pytest.raises(UnsupportedFeatureError, match=f"{name}="):
            params.check_against(vocab_size=100)


def test_sampling_params_take_output_text_buffer_length():
    """A field, as vLLM's: the value given is kept, stop strings set it (longest - 1)."""
    assert SamplingParams(output_text_buffer_length=0).output_text_buffer_length == 0
    assert SamplingParams(stop=["abc", "de"]).output_text_buffer_length == 2
    assert SamplingParams(stop=["abc"], include_stop_str_in_output=True).output_text_buffer_length == 0


@pytest.mark.parametrize("cls", ["LLMEngine", "AsyncLLM"])
def test_engine_constructor_parameters_vllm_builds_from_a_vllm_config(cls):
    """vLLM builds these from a VllmConfig (``vllm_config``, ``executor_class``, ...); here they
    take ``model`` and engine arguments. The one engine argument among them is refused by name;
    the rest are refused by name at construction (the test below)."""
    theirs = init_params(cls)
    assert theirs[0] == "vllm_config"
    assert list(inspect.signature(classes()[cls]).parameters) == ["model", "engine_args"]
    assert [n for n in theirs if engine_arg_kind(n) != "unknown"] == ["aggregate_engine_logging"]
    with pytest.raises(ValueError, match="^aggregate_engine_logging="):
        ea.translate_engine_args({"aggregate_engine_logging": "on, please"}, OWN)


@pytest.mark.parametrize("cls", ["LLMEngine", "AsyncLLM"])
def test_engine_constructor_parameters_are_refused_by_name(cls, llama_dir):
    for name in init_params(cls):
        if engine_arg_kind(name) == "unknown":
            with pytest.raises(UnsupportedFeatureError, match=name):
                classes()[cls](llama_dir, **{name: object()})
