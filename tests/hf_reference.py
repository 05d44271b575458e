"""Helpers for the HF-parity tests: tiny random HF checkpoints + greedy references.

Everything here is built on the fly (no download).  Checkpoints are tiny
(vocab 512, 2 layers, hidden 64) with a large ``initializer_range`` so greedy
decoding produces varied tokens instead of collapsing onto one id.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

VOCAB_SIZE = 512
MAX_POS = 512
TIE_TOL = 1e-3  # top-2 logits closer than this -> near-tie, stop comparing there

_COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    max_position_embeddings=MAX_POS,
    initializer_range=0.15,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def _config(name: str):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    if name == "llama":
        # GQA, head_dim (32) != hidden/heads (16), untied lm_head
        return LlamaConfig(**_COMMON, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=32, tie_word_embeddings=False,
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if name == "llama3_tied":
        # tied embeddings + llama3 rope scaling
        return LlamaConfig(**_COMMON, num_attention_heads=4, num_key_value_heads=2,
                           tie_word_embeddings=True,
                           rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                            "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 64})
    if name == "qwen2":
        # q/k/v bias, MQA (1 kv head)
        return Qwen2Config(**_COMMON, num_attention_heads=4, num_key_value_heads=1,
                           tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    if name == "qwen3":
        # q/k RMSNorm, explicit head_dim
        return Qwen3Config(**_COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                           tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    if name == "mistral":
        # sliding window small enough that ~100-token prompts are windowed
        return MistralConfig(**_COMMON, num_attention_heads=4, num_key_value_heads=2,
                             sliding_window=48, tie_word_embeddings=False,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    raise KeyError(name)


ARCHS = ["llama", "llama3_tied", "qwen2", "qwen3", "mistral"]
SEEDS = {"llama": 11, "llama3_tied": 12, "qwen2": 13, "qwen3": 14, "mistral": 15}


def build_checkpoint(name: str, out_dir: str) -> str:
    """Create a random float32 HF checkpoint of architecture ``name`` in ``out_dir``."""
    from transformers import AutoModelForCausalLM

    cfg = _config(name)
    torch.manual_seed(SEEDS[name])
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    # HF initialises biases to 0 and norm weights to 1: randomise every 1-D
    # parameter so a loader that forgets biases / norm weights is caught.
    g = torch.Generator().manual_seed(SEEDS[name] + 1000)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.ndim == 1:
                if "norm" in pname:
                    p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
                else:
                    p.copy_(0.1 * torch.randn(p.shape, generator=g))
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    else:
        assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    model.save_pretrained(out_dir)
    return out_dir


def build_tokenizer(out_dir: str, vocab_size: int = VOCAB_SIZE):
    """Save a word-level tokenizer covering exactly ``vocab_size`` ids next to a checkpoint.

    ids 0..3 are <pad>, <s>, </s>, <unk>; id i >= 4 is the word ``w{i}``.  Every
    id the random model can emit therefore decodes to something well defined.
    No post-processor: encoding adds no BOS/EOS, so ids are unambiguous.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {t: i for i, t in enumerate(specials)}
    vocab.update({f"w{i}": i for i in range(len(specials), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>", unk_token="<unk>")
    assert len(fast) == vocab_size
    fast.save_pretrained(out_dir)
    return fast


def random_prompt(length: int, seed: int, vocab: int = VOCAB_SIZE) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (length,), generator=g).tolist()


# ---------------------------------------------------------------- HF reference

@dataclass
class Ref:
    tokens: list[int]
    ties: list[bool]                      # per generated step: top-2 within TIE_TOL
    logprobs: list[torch.Tensor] = field(repr=False)  # per step: log_softmax of raw logits


@functools.lru_cache(maxsize=None)
def _load(model_dir: str):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                             attn_implementation="eager")
    m.eval()
    # HF fills unset generate() options from the checkpoint's generation_config, so
    # an eos_token_id=None passed to generate() alone would fall back to eos=2.
    m.generation_config.eos_token_id = None
    m.generation_config.bos_token_id = None
    return m


_REF_CACHE: dict = {}


def _hf_one(model_dir: str, prompt: tuple, max_new_tokens: int) -> Ref:
    key = (model_dir, prompt, max_new_tokens)
    if key in _REF_CACHE:
        return _REF_CACHE[key]
    # A longer cached reference for the same prompt is a valid prefix.
    for (d, p, n), r in _REF_CACHE.items():
        if d == model_dir and p == prompt and n >= max_new_tokens:
            ref = Ref(r.tokens[:max_new_tokens], r.ties[:max_new_tokens],
                      r.logprobs[:max_new_tokens])
            _REF_CACHE[key] = ref
            return ref
    from transformers import GenerationConfig

    model = _load(model_dir)
    # eos_token_id=None: HF must never stop before max_new_tokens (the engine
    # runs with ignore_eos=True).  No min_new_tokens: that would mask eos logits.
    gen_cfg = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens,
                               min_new_tokens=0, eos_token_id=None, pad_token_id=0,
                               bos_token_id=None, output_logits=True,
                               return_dict_in_generate=True)
    ids = torch.tensor([list(prompt)], dtype=torch.long)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen_cfg)
    gen = out.sequences[0, len(prompt):].tolist()
    assert len(gen) == max_new_tokens, "HF stopped early; eos handling broken in reference"
    tokens, ties, lps = [], [], []
    for step, logits in enumerate(out.logits):
        logits = logits[0].float()
        top2 = torch.topk(logits, 2).values
        # greedy must be argmax of the raw logits (no processor altered it)
        assert logits[gen[step]] == logits.max()
        tokens.append(gen[step])
        ties.append(bool(top2[0] - top2[1] < TIE_TOL))
        lps.append(torch.log_softmax(logits, dim=-1))
    ref = Ref(tokens, ties, lps)
    _REF_CACHE[key] = ref
    return ref


def hf_greedy(model_dir: str, prompts, max_new_tokens: int):
    """HF ``generate(do_sample=False)`` one prompt at a time (no padding).

    Returns ``(tokens, ties)``: per prompt the generated ids and per step whether
    the reference's top-2 logits were within ``TIE_TOL``.
    """
    refs = [_hf_one(str(model_dir), tuple(p), max_new_tokens) for p in prompts]
    return [r.tokens for r in refs], [r.ties for r in refs]


def hf_refs(model_dir: str, prompts, max_new_tokens: int) -> list[Ref]:
    return [_hf_one(str(model_dir), tuple(p), max_new_tokens) for p in prompts]


def assert_same_tokens(ours, ref, ties, min_fraction: float = 0.5):
    """Token-for-token equality up to (excluding) the first near-tie of each reference.

    Fails if fewer than ``min_fraction`` of all reference positions were actually
    compared, so a test can't pass vacuously.
    """
    assert len(ours) == len(ref), f"got {len(ours)} outputs for {len(ref)} prompts"
    compared = total = 0
    for i, (o, r, t) in enumerate(zip(ours, ref, ties)):
        o = list(o)
        assert len(o) == len(r), f"prompt {i}: generated {len(o)} tokens, reference has {len(r)}"
        n = t.index(True) if True in t else len(r)
        assert o[:n] == r[:n], (
            f"prompt {i}: mismatch at position "
            f"{next(j for j in range(n) if o[j] != r[j])}: ours {o[:n]} vs HF {r[:n]}")
        compared += n
        total += len(r)
    assert total > 0
    assert compared >= min_fraction * total, (
        f"only {compared}/{total} positions compared (near-ties) - test would be vacuous")
    return compared


# ------------------------------------------------------------- engine helpers

def make_llm(model_dir, **kw):
    """Engine with test defaults (cpu, float32); ``kw`` overrides."""
    from engine import LLM

    opts = dict(device="cpu", dtype="float32", seed=0)
    opts.update(kw)
    return LLM(str(model_dir), **opts)


def assert_no_leak(llm):
    """After generate() returns, nothing may hold a KV block."""
    stats = llm.stats()
    assert stats["blocks_in_use"] == 0, f"blocks still in use: {stats}"
    bad = [i for i, b in enumerate(llm.block_manager.blocks) if b.ref_count != 0]
    assert not bad, f"blocks with non-zero ref_count after generate: {bad[:10]}"
