"""One checkpoint, the shapes a CPU user feels: this engine beside llama.cpp (optional).

    python -m benchmarks.single_user --model CKPT [--threads 1,2] [--llamacpp-bin DIR --gguf FILE]

Rows (tok/s, best of ``--repeats``): prefill of one 512-token prompt; prefill of 16 x 256;
decode of 16 sequences (256-token prompts, 64 new); decode of one sequence (128 new). Decode
rates exclude the prefill: the time of N new tokens minus the time of 1, as llama.cpp's
``tg`` and ``batched-bench`` count them. Each thread count also gets the weight-streaming
bound of batch-1 decode: the bytes of every weight a token reads (all but the embedding),
over the read bandwidth measured at that thread count. llama.cpp, when given, runs its own
``llama-bench`` and ``llama-batched-bench`` on the same weights converted to GGUF (never a
dependency: docs/benchmarks.md says how to build it).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

@dataclass(frozen=True)
class Shape:
    """The sizes of the rows (the issue's table; the smoke test shrinks them)."""

    long_prompt: int = 512
    prompt: int = 256
    batch: int = 16
    batch_new: int = 64
    single_new: int = 128

    @property
    def rows(self) -> tuple[str, ...]:
        return (f"prefill, one {self.long_prompt}-token prompt",
                f"prefill, {self.batch} x {self.prompt} tokens",
                f"decode, batch {self.batch} ({self.prompt}-token prompts, {self.batch_new} new)",
                f"decode, batch 1, {self.single_new} tokens")


ROWS = Shape().rows


@dataclass
class Table:
    threads: list[int]
    shape: Shape
    ours: dict = field(default_factory=dict)       # (row, threads) -> tok/s
    llamacpp: dict = field(default_factory=dict)   # (row, threads) -> tok/s
    bound: dict = field(default_factory=dict)      # threads -> batch-1 decode bound, tok/s
    describe: str = ""


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(10, vocab - 10, size=(n, length)).tolist()


def timed_generate(llm, batch: list[list[int]], new: int) -> float:
    from engine import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    llm.reset_prefix_cache()
    # The reset also drops what the fast layer derived from the weights (packed copies); derive
    # them again untimed, as every step after the first finds them.
    llm.generate([batch[0][:1]], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    start = time.perf_counter()
    llm.generate(batch, params, use_tqdm=False)
    return time.perf_counter() - start


def measure_ours(model: str, threads: int, repeats: int, engine_kw: dict,
                 shape: Shape) -> tuple[dict, str]:
    """Each row's best tok/s at ``threads`` compute threads, and the backend's description."""
    llm = build_ours(model, threads, engine_kw, shape)
    best = dict.fromkeys(shape.rows, 0.0)
    for _ in range(repeats):
        best = {row: max(best[row], rate) for row, rate in measure_rows(llm, shape).items()}
    return best, llm.llm_engine.engine_core.model_runner.backend.describe()


def build_ours(model: str, threads: int, engine_kw: dict, shape: Shape):
    """This engine at ``threads`` compute threads, warmed up."""
    from engine import LLM
    torch.set_num_threads(threads)
    llm = LLM(model, num_threads=threads, max_num_seqs=shape.batch, max_num_batched_tokens=2048,
              enable_prefix_caching=False, **engine_kw)
    timed_generate(llm, prompts(1, 16, llm.model_config.vocab_size, 3), 8)  # warm-up
    return llm


def measure_rows(llm, shape: Shape) -> dict:
    """One measurement of each row (tok/s)."""
    vocab, rows = llm.model_config.vocab_size, shape.rows
    one, batch = prompts(1, shape.long_prompt, vocab, 1), prompts(shape.batch, shape.prompt, vocab, 2)
    short = prompts(1, 16, vocab, 3)
    prefill_batch = timed_generate(llm, batch, 1)
    return {rows[0]: shape.long_prompt / timed_generate(llm, one, 1),
            rows[1]: shape.batch * shape.prompt / prefill_batch,
            rows[2]: shape.batch * (shape.batch_new - 1) / (timed_generate(llm, batch, shape.batch_new) - prefill_batch),
            rows[3]: (shape.single_new - 1) / (timed_generate(llm, short, shape.single_new)
                                               - timed_generate(llm, short, 1))}


def streamed_bytes(model: str, quantization: str | None = None, itemsize: int | None = None) -> int:
    """Bytes of the weights one decode token reads: every tensor but the input embedding, each
    value ``itemsize`` bytes (None: as stored); with ``quantization="int8"``, a matrix is a byte
    per value and a float32 scale per row; ``"q8_0"`` / ``"int4"``: a byte / half a byte per
    value and a float16 scale per block of 32."""
    from safetensors import safe_open
    total = 0
    for path in sorted(Path(model).glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                if "embed_tokens" not in name:
                    shape = f.get_slice(name).get_shape()
                    if quantization == "int8" and len(shape) == 2:
                        total += int(np.prod(shape)) + 4 * shape[0]
                    elif quantization in ("q8_0", "int4") and len(shape) == 2:
                        values = int(np.prod(shape))
                        total += (values if quantization == "q8_0" else values // 2) + 2 * (values // 32)
                    else:
                        total += int(np.prod(shape)) * (itemsize or _itemsize(f.get_slice(name).get_dtype()))
    return total


def _itemsize(dtype: str) -> int:
    return {"F32": 4, "BF16": 2, "F16": 2}[dtype]


def read_bandwidth(threads: int, gib: float = 1.0) -> float:
    """Bytes per second that a sum over ``gib`` GiB of float32 reads (a read-only stream, as
    a matrix-vector product's weights are; the fastest read measured here), best of 5."""
    torch.set_num_threads(threads)
    data = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best


def measure_llamacpp(bin_dir: str, gguf: str, threads: int, repeats: int) -> dict:
    """llama-bench (pp512, tg128) and llama-batched-bench (16 x 256 prompts, 64 new)."""
    bench = subprocess.run([str(Path(bin_dir) / "llama-bench"), "-m", gguf, "-p", "512", "-n", "128",
                            "-t", str(threads), "-r", str(repeats), "-o", "json"],
                           capture_output=True, text=True, check=True)
    rates = {}
    for test in json.loads(bench.stdout):
        rates[ROWS[0] if test["n_prompt"] else ROWS[3]] = test["avg_ts"]
    batched = subprocess.run([str(Path(bin_dir) / "llama-batched-bench"), "-m", gguf, "-c", "8192",
                              "-b", "2048", "-ub", "512", "-npp", "256", "-ntg", "64", "-npl", "16",
                              "-t", str(threads), "--output-format", "jsonl"],
                             capture_output=True, text=True, check=True)
    row = json.loads([line for line in batched.stdout.splitlines() if line.startswith("{")][-1])
    rates[ROWS[1]], rates[ROWS[2]] = row["speed_pp"], row["speed_tg"]
    return rates


# The single-user checkpoint: Qwen3-0.6B's body as a Llama (llama.cpp converts it as such)
# with the demo model's vocabulary, bfloat16, random weights.
LLAMA_06 = dict(vocab_size=2048, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                num_attention_heads=16, num_key_value_heads=8, head_dim=128, rope_theta=1e6,
                rms_norm_eps=1e-6, max_position_embeddings=4096, tie_word_embeddings=False,
                bos_token_id=1, eos_token_id=2)


def build_llama_06(out_dir: str, seed: int = 0) -> str:
    """The single-user checkpoint, with the demo model's tokenizer (what llama.cpp's converter
    needs; the bench itself feeds token ids)."""
    import shutil
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(**LLAMA_06)).to(torch.bfloat16).save_pretrained(out_dir)
    demo = Path(__file__).resolve().parent.parent / "demo_model"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo / name, out_dir)
    return out_dir


def run(model: str, threads: list[int], repeats: int = 3, llamacpp_bin: str | None = None,
        gguf: str | None = None, engine_kw: dict | None = None, shape: Shape = Shape()) -> Table:
    table = Table(threads, shape)
    weights = streamed_bytes(model, (engine_kw or {}).get("quantization"))
    for t in threads:
        rates, table.describe = measure_ours(model, t, repeats, engine_kw or {}, shape)
        table.ours.update({(row, t): rate for row, rate in rates.items()})
        table.bound[t] = read_bandwidth(t) / weights
        if llamacpp_bin and gguf:
            table.llamacpp.update({(row, t): rate for row, rate in
                                   measure_llamacpp(llamacpp_bin, gguf, t, repeats).items()})
    return table


def report(table: Table) -> list[str]:
    peer = bool(table.llamacpp)
    lines = ["| metric | threads | " + ("llama.cpp | " if peer else "") + "this engine | "
             + ("ratio |" if peer else ""),
             "|---|---|" + ("---:|" if peer else "") + "---:|" + ("---:|" if peer else "")]
    for row in table.shape.rows:
        for t in table.threads:
            ours = table.ours[(row, t)]
            cells = [row, str(t)]
            if peer:
                theirs = table.llamacpp[(row, t)]
                cells += [f"{theirs:.1f}", f"{ours:.1f}", f"{ours / theirs:.2f}x"]
            else:
                cells.append(f"{ours:.1f}")
            lines.append("| " + " | ".join(cells) + " |")
    for t in table.threads:
        bound = table.bound[t]
        single = table.shape.rows[3]
        share = f"this engine {table.ours[(single, t)] / bound:.0%}"
        if peer:
            share = f"llama.cpp {table.llamacpp[(single, t)] / bound:.0%}, " + share
        lines.append(f"\nBatch-1 decode bound at {t} thread(s): {bound:.1f} tok/s (weights over the "
                     f"measured read bandwidth); reached: {share}.")
    lines.append(f"\nThis engine: {table.describe}.")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.single_user", description=__doc__.split("\n")[0])
    p.add_argument("--model", help="a local checkpoint directory (default: the single-user "
                                   "Llama built on the fly; --build DIR keeps it)")
    p.add_argument("--build", help="build the single-user checkpoint into DIR and exit")
    p.add_argument("--threads", default="1,2", help="compute threads, comma-separated")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--enforce-eager", action="store_true", help="without the compiled kernels")
    p.add_argument("--quantization", choices=["int8"], help="8-bit weights, quantized at load")
    p.add_argument("--llamacpp-bin", help="llama.cpp's build/bin (llama-bench, llama-batched-bench)")
    p.add_argument("--gguf", help="the same checkpoint converted by llama.cpp's convert_hf_to_gguf.py")
    args = p.parse_args(argv)
    if args.build:
        print(build_llama_06(args.build))
        return 0
    if args.model is None:
        import tempfile
        with tempfile.TemporaryDirectory(prefix="single_user_") as tmp:
            return main([*(argv or []), "--model", build_llama_06(tmp)])
    table = run(args.model, [int(t) for t in args.threads.split(",")], args.repeats,
                args.llamacpp_bin, args.gguf, dict(dtype=args.dtype, enforce_eager=args.enforce_eager,
                                                             quantization=args.quantization))
    print("\n".join(report(table)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
