"""What every test shares: tiny random checkpoints, prompts, engine drivers, the greedy reference.

Everything is built on the fly (no download). Checkpoints are tiny (vocab 512, 2 layers,
hidden 64) with a large ``initializer_range`` so greedy decoding produces varied tokens
instead of collapsing onto one id.

The one reference is Hugging Face ``generate(do_sample=False)``, one prompt at a time, no
padding (``GreedyReference``). Tokens are compared up to the reference's first near-tie: a
position whose top-2 logits are within ``TIE_TOL`` (tiny random models have near-ties that
legitimately flip under another batch composition); it never loosens beyond that.
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field
from pathlib import Path

import torch

from invariants import check_accounting

DEMO_MODEL_DIR = Path(__file__).resolve().parent.parent / "demo_model"
VOCAB_SIZE = 512
MAX_POS = 512
TIE_TOL = 1e-3  # reference top-2 logits closer than this: a near-tie, stop comparing there

# ----------------------------------------------------------------------------- checkpoints

_COMMON = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               max_position_embeddings=MAX_POS, initializer_range=0.15, rms_norm_eps=1e-6,
               bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _rope(kind: str = "default", theta: float = 10000.0, **extra) -> dict:
    return dict(rope_parameters={"rope_type": kind, "rope_theta": theta, **extra})


# name -> (transformers config class, what this architecture exercises in the loader)
ARCH_CONFIGS: dict[str, tuple[str, dict]] = {
    # GQA, head_dim (32) != hidden/heads (16), untied lm_head
    "llama": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                  tie_word_embeddings=False, **_rope())),
    # tied embeddings + llama3 rope scaling
    "llama3_tied": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2,
                                        tie_word_embeddings=True,
                                        **_rope("llama3", 500000.0, factor=8.0, low_freq_factor=1.0,
                                                high_freq_factor=4.0,
                                                original_max_position_embeddings=64))),
    # q/k/v bias, MQA (1 kv head)
    "qwen2": ("Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=1,
                                  tie_word_embeddings=False, **_rope(theta=1000000.0))),
    # q/k RMSNorm, explicit head_dim
    "qwen3": ("Qwen3Config", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                  tie_word_embeddings=False, **_rope(theta=1000000.0))),
    # sliding window small enough that ~100-token prompts are windowed
    "mistral": ("MistralConfig", dict(num_attention_heads=4, num_key_value_heads=2,
                                      sliding_window=48, tie_word_embeddings=False, **_rope())),
}
ARCHS = list(ARCH_CONFIGS)
SEEDS = {name: 11 + i for i, name in enumerate(ARCHS)}

# A tiny Qwen3 whose context fits the chapter's 4096-token prompt (test_prefix_cache).
LONG_QWEN3 = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16, max_position_embeddings=4096 + 64)


def checkpoint_config(arch: str, **overrides):
    """The transformers config of ``arch`` (see ``ARCH_CONFIGS``), any field overridden."""
    import transformers

    cls_name, arch_fields = ARCH_CONFIGS[arch]
    return getattr(transformers, cls_name)(**{**_COMMON, **arch_fields, **overrides})


def build_checkpoint(arch: str, out_dir: str, seed: int | None = None, **overrides) -> str:
    """Save a random float32 HF checkpoint of ``arch`` (config fields overridable) in ``out_dir``."""
    from transformers import AutoModelForCausalLM

    cfg = checkpoint_config(arch, **overrides)
    seed = SEEDS[arch] if seed is None else seed
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    _randomise_vectors(model, seed + 1000)
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tied == cfg.tie_word_embeddings, "the checkpoint's tying is not what the config says"
    model.save_pretrained(out_dir)
    return out_dir


def _randomise_vectors(model, seed: int) -> None:
    """HF initialises biases to 0 and norm weights to 1: randomise every 1-D parameter so a
    loader that forgets biases or norm weights is caught."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                noise = torch.randn(p.shape, generator=g)
                p.copy_(1.0 + 0.2 * noise if "norm" in name else 0.1 * noise)


def build_tokenizer(out_dir: str, vocab_size: int = VOCAB_SIZE):
    """Save a word-level tokenizer covering exactly ``vocab_size`` ids next to a checkpoint.

    ids 0..3 are <pad>, <s>, </s>, <unk>; id i >= 4 is the word ``w{i}``. Every id the random
    model can emit therefore decodes to something well defined. No post-processor: encoding
    adds no BOS/EOS, so ids are unambiguous.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
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


# ----------------------------------------------------------------------------- the engine

# A pool that holds every test workload (8,192 tokens at block size 16) without sizing one
# for 256 sequences of the checkpoint's whole context, as the engine's default would.
TEST_POOL_TOKENS = 8192


def make_llm(model_dir, **overrides):
    """Engine with test defaults (cpu, float32, seed 0, a pool of ``TEST_POOL_TOKENS``);
    ``overrides`` are engine arguments."""
    from engine import LLM

    defaults = dict(device="cpu", dtype="float32", seed=0)
    block_size = overrides.get("block_size") or 16
    sized = {"num_kv_blocks", "kv_cache_memory", "kv_cache_memory_bytes"} & set(overrides)
    if not sized and isinstance(block_size, int) and block_size > 0:
        defaults["num_kv_blocks"] = TEST_POOL_TOKENS // block_size
    return LLM(str(model_dir), **{**defaults, **overrides})


@functools.lru_cache(maxsize=None)
def shared_backend(model_dir: str, fast_paths: bool = True):
    """One loaded model per checkpoint, and its backend, shared by every engine core a test
    builds from parts (a model is never changed by an engine)."""
    from core.backend import Backend
    from fast.backend import FastBackend
    from model import load_model

    model = load_model(model_dir, "float32", torch.device("cpu"))
    return FastBackend(model) if fast_paths else Backend(model)


def make_core(model_dir, fast_paths: bool = True, num_kv_blocks: int | None = None, **settings):
    """An ``EngineCore`` built from parts around the shared model (``settings``:
    ``EngineCore.build``'s); cheaper than an ``LLM``, which loads its own."""
    from engine import EngineCore

    backend = shared_backend(str(model_dir), fast_paths)
    blocks = num_kv_blocks or TEST_POOL_TOKENS // settings.get("block_size", 16)
    return EngineCore.build(backend.model, blocks, backend=backend,
                            eos_token_ids=backend.model.config.eos_token_ids, **settings)


def add(core, prompt, params, request_id: str | None = None, cache_salt: str | None = None) -> str:
    """Queue one request on an engine core, its output only when it finishes (as
    ``LLM.add_request``); returns its id (automatic: "c<n>")."""
    from core.sampling_params import RequestOutputKind
    from core.submit import Request

    request_id = request_id or f"c{next(_core_ids)}"
    core.add_requests([Request(request_id, prompt, params, cache_salt=cache_salt,
                               output_kind=RequestOutputKind.FINAL_ONLY)])
    return request_id


_core_ids = itertools.count()


def greedy(max_tokens: int, **kw):
    """Greedy sampling that never stops at EOS: the output length is ``max_tokens``
    unless a stop token is given."""
    from engine import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def sequence_of(llm, request_id: str):
    """The queued or running ``Sequence`` of ``request_id`` (None once it left the scheduler)."""
    queued = list(llm.scheduler.running) + list(llm.scheduler.waiting)
    return next((seq for seq in queued if seq.request_id == request_id), None)


def drain(llm, max_steps: int = 10000) -> dict:
    """Step until idle, checking the accounting after every step; request id -> output.
    ``llm``: an ``LLM`` or an ``EngineCore``."""
    outputs = {}
    busy = (lambda: llm.has_unfinished) if hasattr(llm, "has_unfinished") else llm.has_unfinished_requests
    for _ in range(max_steps):
        if not busy():
            return outputs
        for out in llm.step():
            assert out.request_id not in outputs, f"request {out.request_id} finished twice"
            outputs[out.request_id] = out
        check_accounting(llm)
    raise AssertionError(f"engine still busy after {max_steps} steps (livelock?)")


def assert_no_leak(llm) -> None:
    """After generate() returns, nothing may hold a KV block."""
    stats = llm.stats()
    assert stats["blocks_in_use"] == 0, f"blocks still in use: {stats}"
    bad = [i for i, b in enumerate(llm.block_manager.blocks) if b.ref_count != 0]
    assert not bad, f"blocks with non-zero ref_count after generate: {bad[:10]}"


# ----------------------------------------------------------------------------- the reference

@dataclass
class Ref:
    """HF's greedy continuation of one prompt."""

    tokens: list[int]
    ties: list[bool]                                  # per step: top-2 logits within TIE_TOL
    logprobs: list[torch.Tensor] = field(repr=False)  # per step: log_softmax of the raw logits

    def head(self, n: int) -> Ref:
        return Ref(self.tokens[:n], self.ties[:n], self.logprobs[:n])

    def first_tie(self, end: int) -> int:
        """Positions before this one are compared: the first near-tie, or ``end``."""
        return next((i for i, tie in enumerate(self.ties[:end]) if tie), end)


_REFS: dict[tuple[str, tuple[int, ...]], Ref] = {}  # (model dir, prompt) -> longest reference


@functools.lru_cache(maxsize=None)
def _hf_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    # HF fills unset generate() options from the checkpoint's generation_config, so an
    # eos_token_id=None passed to generate() alone would fall back to the checkpoint's eos.
    model.generation_config.eos_token_id = None
    model.generation_config.bos_token_id = None
    return model


def _hf_generate(model_dir: str, prompt: tuple[int, ...], max_new_tokens: int) -> Ref:
    from transformers import GenerationConfig

    # eos_token_id=None: HF never stops before max_new_tokens (the engine runs with
    # ignore_eos=True). No min_new_tokens: that would mask the eos logit.
    cfg = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=0,
                           eos_token_id=None, pad_token_id=0, bos_token_id=None,
                           output_logits=True, return_dict_in_generate=True)
    ids = torch.tensor([list(prompt)], dtype=torch.long)
    with torch.no_grad():
        out = _hf_model(model_dir).generate(ids, attention_mask=torch.ones_like(ids),
                                            generation_config=cfg)
    tokens = out.sequences[0, len(prompt):].tolist()
    assert len(tokens) == max_new_tokens, "HF stopped early: eos handling broken in the reference"
    ties, logprobs = [], []
    for token, logits in zip(tokens, out.logits):
        logits = logits[0].float()
        assert logits[token] == logits.max(), "a logits processor altered HF's greedy choice"
        top2 = torch.topk(logits, 2).values
        ties.append(bool(top2[0] - top2[1] < TIE_TOL))
        logprobs.append(torch.log_softmax(logits, dim=-1))
    return Ref(tokens, ties, logprobs)


class GreedyReference:
    """HF greedy tokens of each prompt run alone, memoised per (checkpoint, prompt), and the
    checks that compare the engine's outputs with them. ``compared`` / ``total`` count the
    positions this instance checked, for ``assert_not_vacuous``."""

    def __init__(self, model_dir) -> None:
        self.model_dir = str(model_dir)
        self.compared = 0
        self.total = 0

    def get(self, prompt, max_tokens: int) -> Ref:
        key = (self.model_dir, tuple(int(t) for t in prompt))
        ref = _REFS.get(key)
        if ref is None or len(ref.tokens) < max_tokens:
            ref = _REFS[key] = _hf_generate(self.model_dir, key[1], max_tokens)
        return ref.head(max_tokens)

    def compare(self, prompt, got, max_tokens: int, what: str = "", stop_ids=(),
                finish_reason: str | None = None) -> int:
        """Assert ``got`` equals the reference up to its first near-tie; returns positions compared.

        With ``stop_ids`` the expected output is the reference cut after its first stop token
        (finish reason "stop"); without, all ``max_tokens`` tokens (finish reason "length").
        Output length and finish reason are checked whenever no near-tie precedes the end.
        """
        ref, got = self.get(prompt, max_tokens), list(got)
        end = next((j + 1 for j, t in enumerate(ref.tokens) if t in stop_ids), max_tokens)
        expected = ref.tokens[:end]
        k = ref.first_tie(end)
        if got[:k] != expected[:k]:
            j = next(i for i in range(k) if i >= len(got) or got[i] != expected[i])
            raise AssertionError(f"{what}: token {j} differs from HF greedy on the prompt alone: "
                                 f"got {got} vs reference {expected} (prompt of {len(prompt)} tokens)")
        if stop_ids:
            assert len(got) <= max_tokens, f"{what}: {len(got)} tokens, max_tokens={max_tokens}"
        else:
            assert len(got) == max_tokens, f"{what}: {len(got)} tokens generated, max_tokens={max_tokens}"
        if k == end:  # no near-tie: the whole output is determined
            assert got == expected, f"{what}: got {got}, reference {expected} (stop ids {list(stop_ids)})"
            reason = "stop" if expected[-1] in stop_ids else "length"
            assert finish_reason in (None, reason), f"{what}: finish reason {finish_reason!r}, expected {reason!r}"
        self.compared += k
        self.total += end
        return k

    def compare_all(self, prompts, outputs, max_tokens: int, min_fraction: float = 0.5) -> int:
        """``compare`` every output (a RequestOutput or a token list) with its prompt's reference;
        fails if under ``min_fraction`` of the positions were compared (a vacuous pass)."""
        assert len(outputs) == len(prompts), f"got {len(outputs)} outputs for {len(prompts)} prompts"
        compared = 0
        for i, (prompt, out) in enumerate(zip(prompts, outputs)):
            tokens = getattr(out, "token_ids", out)
            compared += self.compare(prompt, tokens, max_tokens, f"prompt {i}",
                                     finish_reason=getattr(out, "finish_reason", None))
        total = len(prompts) * max_tokens
        assert total > 0 and compared >= min_fraction * total, (
            f"only {compared}/{total} positions compared (near-ties): the test would be vacuous")
        return compared

    def assert_not_vacuous(self, min_fraction: float = 0.8) -> None:
        assert self.total > 0, "nothing was compared"
        assert self.compared >= min_fraction * self.total, (
            f"only {self.compared}/{self.total} positions compared (near-ties): vacuous")


def assert_within_rounding(got, want, share: float = 0.05) -> None:
    """Logits ``got`` [positions, vocab] are ``want``'s within ``share`` of its largest, and the
    top token is ``want``'s wherever ``want``'s top two are further apart than twice that
    position's largest error (no bounded error can swap them); most positions are so."""
    import torch
    err = (got - want).abs()
    assert err.max() <= share * want.abs().max()
    top2 = want.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * err.amax(-1)
    assert clear.float().mean() >= 0.5, clear
    assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])
