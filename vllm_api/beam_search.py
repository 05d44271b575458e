"""``LLM.beam_search``: the search loop of beam.py, run on an ``LLM``'s ``generate``."""
from __future__ import annotations

from vllm_api.beam import (
    BEAM_LOGPROBS_FACTOR,
    BeamInstance,
    BeamSearchOutput,
    BeamSearchParams,
    BeamSearchSequence,
    beam_score,
    check_supported,
)
from vllm_api.intake import parse_prompt, reject_unsupported
from vllm_api.sampling_params import SamplingParams


def beam_search(llm, prompts, params: BeamSearchParams, lora_request=None, use_tqdm: bool = False,
                concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
    """vLLM's ``LLM.beam_search``: one ``BeamSearchOutput`` per prompt, in order."""
    if not isinstance(params, BeamSearchParams):
        raise TypeError(f"params must be BeamSearchParams, got {type(params).__name__}")
    reject_unsupported(lora_request)
    check_supported(params)
    instances = [BeamInstance([BeamSearchSequence(prompt, list(prompt["prompt_token_ids"]))])
                 for prompt in token_prompts(llm, prompts)]
    step_params = SamplingParams(logprobs=BEAM_LOGPROBS_FACTOR * params.beam_width, max_tokens=1,
                                 temperature=params.temperature, detokenize=False)
    limit = concurrency_limit or max(len(instances), 1)
    for start in range(0, len(instances), limit):
        batch = instances[start:start + limit]
        for _ in range(params.max_tokens):
            if not search_step(llm, batch, step_params, params):
                break
    return [finish(llm, instance, params) for instance in instances]


def token_prompts(llm, prompts) -> list[dict]:
    """Each prompt (text, token ids, or a prompt dict) as a tokens prompt keeping its salt."""
    engine = llm.llm_engine
    parsed = [parse_prompt(p, engine.tokenizer, engine.model_config.vocab_size)
              for p in ([prompts] if isinstance(prompts, (str, dict)) else prompts)]
    return [{"prompt_token_ids": p.token_ids.tolist() if hasattr(p.token_ids, "tolist")
             else list(p.token_ids), "prompt": p.text, "cache_salt": p.cache_salt}
            for p in parsed]


def search_step(llm, batch: list[BeamInstance], step_params, params: BeamSearchParams) -> bool:
    """Extend every live beam by one token; False when no beam is left."""
    beams = [beam for instance in batch for beam in instance.beams]
    if not beams:
        return False
    prompts = [{"prompt_token_ids": beam.tokens, "cache_salt": beam.orig_prompt["cache_salt"]}
               for beam in beams]
    outputs = iter(llm.generate(prompts, step_params, use_tqdm=False))
    eos_ids = llm.llm_engine.eos_token_ids
    for instance in batch:
        candidates = []
        for beam in instance.beams:
            for child in extend(beam, next(outputs).outputs[0].logprobs[0]):
                ended = child.tokens[-1] in eos_ids and not params.ignore_eos
                (instance.completed if ended else candidates).append(child)
        candidates.sort(key=lambda b: beam_score(b, eos_ids, params.length_penalty), reverse=True)
        instance.beams = candidates[:params.beam_width]
    return True


def extend(beam: BeamSearchSequence, position: dict) -> list[BeamSearchSequence]:
    """One child of ``beam`` per candidate token of this position."""
    return [BeamSearchSequence(beam.orig_prompt, beam.tokens + [token], beam.logprobs + [position],
                               beam.lora_request, beam.cum_logprob + float(logprob))
            for token, logprob in position.items()]


def finish(llm, instance: BeamInstance, params: BeamSearchParams) -> BeamSearchOutput:
    """The best ``beam_width`` of complete and live beams, with their text (prompt included,
    as vLLM decodes it)."""
    eos_ids, tokenizer = llm.llm_engine.eos_token_ids, llm.llm_engine.tokenizer
    ranked = sorted(instance.completed + instance.beams, reverse=True,
                    key=lambda b: beam_score(b, eos_ids, params.length_penalty))
    best = ranked[:params.beam_width]
    for beam in best:
        if tokenizer is not None:
            beam.text = tokenizer.decode(beam.tokens, skip_special_tokens=params.skip_special_tokens)
    return BeamSearchOutput(best)
