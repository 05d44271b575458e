"""Sizes, the random Qwen3 checkpoint every system loads, and the prompts of each workload."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch

HF_PAGE_SIZE = 256  # transformers' default page_size for continuous batching

# The model shapes ``--model-sizes`` names; random weights, built on the fly (never downloaded).
MODEL_SHAPES = {
    # The bench's own small Qwen3 (its cost is dominated by a 16M-parameter embedding).
    "42m": dict(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                num_attention_heads=8, num_key_value_heads=4, head_dim=64),
    # Qwen3-0.6B's shape (its config.json: tied embeddings, rope_theta 1e6, rms_norm_eps 1e-6).
    "0.6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                 num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=128),
    # --quick's ~8M model.
    "8m": dict(vocab_size=16000, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, head_dim=64),
}
SCALES = {"full": 1, "quarter": 4}  # the divisor of the number of requests


@dataclass
class Sizes:
    """Everything that --quick shrinks."""

    num_requests: int = 64
    a_prompt_min: int = 128
    a_prompt_max: int = 1024
    a_new_tokens: int = 128
    b_prefix: int = 1024
    b_suffix: int = 64
    b_new_tokens: int = 64
    hash_prompt: int = 4096
    hash_reps: int = 200
    decode_batch: int = 32
    decode_prompt: int = 128
    decode_steps: int = 10
    matmul_n: int = 1024
    max_batched_tokens: int = 2048
    model: dict = field(default_factory=lambda: dict(MODEL_SHAPES["42m"]))

    @classmethod
    def quick(cls) -> "Sizes":
        # A smaller model too (~8M params), so the in-process part fits in < 2 min on 2 cores.
        return cls(num_requests=16, a_prompt_min=32, a_prompt_max=256, a_new_tokens=32,
                   b_prefix=256, b_suffix=16, b_new_tokens=16, hash_prompt=1024, hash_reps=50,
                   decode_steps=5, model=dict(MODEL_SHAPES["8m"]))

    def scaled(self, scale: str) -> "Sizes":
        """``quarter``: a quarter of the requests (the prompts keep their lengths)."""
        return replace(self, num_requests=max(1, self.num_requests // SCALES[scale]))

    def with_model(self, shape: dict) -> "Sizes":
        return replace(self, model=dict(shape))


@dataclass
class Workload:
    """The same prompts and output length for every system; greedy, EOS ignored."""

    name: str
    prompts: list[list[int]]
    max_new_tokens: int
    description: str

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return len(self.prompts) * self.max_new_tokens


def random_tokens(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    # Ids 0-2 are pad/bos/eos in the built checkpoint: keep prompts clear of them.
    return rng.integers(3, vocab, size=n).tolist()


def workload_no_sharing(s: Sizes, vocab: int, seed: int = 1) -> Workload:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(s.a_prompt_min, s.a_prompt_max + 1, size=s.num_requests)
    prompts = [random_tokens(rng, int(n), vocab) for n in lengths]
    return Workload("(a) no sharing", prompts, s.a_new_tokens,
                    f"{s.num_requests} req, random prompts {s.a_prompt_min}-{s.a_prompt_max} tok, "
                    f"{s.a_new_tokens} new")


def workload_shared_prefix(s: Sizes, vocab: int, seed: int = 2) -> Workload:
    rng = np.random.default_rng(seed)
    prefix = random_tokens(rng, s.b_prefix, vocab)
    prompts = [prefix + random_tokens(rng, s.b_suffix, vocab) for _ in range(s.num_requests)]
    return Workload("(b) shared prefix", prompts, s.b_new_tokens,
                    f"{s.num_requests} req, {s.b_prefix}-tok shared prefix + {s.b_suffix}-tok "
                    f"suffixes, {s.b_new_tokens} new")


def warmup_workload(vocab: int) -> Workload:
    rng = np.random.default_rng(99)
    return Workload("warmup", [random_tokens(rng, n, vocab) for n in (40, 70, 100, 33)], 8, "warmup")


def kv_capacity_tokens(w: Workload) -> int:
    """KV room for every request at full length at once, rounded to HF's page (so both fit)."""
    return sum(-(-(len(p) + w.max_new_tokens) // HF_PAGE_SIZE) * HF_PAGE_SIZE for p in w.prompts)


# ----------------------------------------------------------------------------- the checkpoint

def build_checkpoint(out_dir: str, model_kwargs: dict, seed: int = 0, max_pos: int = 8192) -> str:
    """A random Qwen3 checkpoint (float32 on disk) made on the fly; nothing is downloaded.

    Written with this interpreter's transformers; vLLM's venv pins an older one (< 5.20),
    which reads this config as written (``rope_parameters`` included).
    """
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(**model_kwargs, tie_word_embeddings=True, max_position_embeddings=max_pos,
                      initializer_range=0.02, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
                      pad_token_id=0,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(out_dir)
    return out_dir


HF_ATTENTION = "sdpa"  # named, so each HF peer's settings can say which attention it ran


def load_hf(model_dir: str, dtype: torch.dtype, device: torch.device):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, trust_remote_code=False,
                                                 attn_implementation=HF_ATTENTION).to(device)
    return model.eval()


def model_facts(model_dir: str) -> dict:
    """Parameter counts and the shapes the FLOP formulas need."""
    model = load_hf(model_dir, torch.float32, torch.device("cpu"))
    cfg = model.config
    total = sum(p.numel() for p in model.parameters())  # tied weights are counted once
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    untied_head = head.numel() if head.data_ptr() != embed.data_ptr() else 0
    return dict(params=total, params_without_embedding=total - embed.numel() - untied_head,
                vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                intermediate_size=cfg.intermediate_size,
                num_layers=cfg.num_hidden_layers, num_heads=cfg.num_attention_heads,
                num_kv_heads=cfg.num_key_value_heads,
                head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)


def torch_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]
