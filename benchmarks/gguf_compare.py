"""The same GGUF file, the same logits? This engine beside a local llama.cpp build, teacher-forced
over 256 tokens (``python -m benchmarks.gguf_compare --model FILE.gguf --llama-cpp DIR``).

llama.cpp's side: its ``llama-perplexity`` (found in DIR, DIR/bin or DIR/build/bin) evaluates one
chunk of 514 tokens of a fixed text and saves its log-probabilities for the chunk's last 256
positions (``--kl-divergence-base``: each row as 16-bit steps above its top log-probability
minus 16 nats; the file also holds the chunk's token ids). This engine then evaluates exactly
those ids: float32 on the plain path (the spec: the file's dequantized weights), and bfloat16
on the fast path (the block kernels where built).

Printed for each: the mean and largest |log p - log p(llama.cpp)| of each next token, the
largest over every entry llama.cpp kept, how often the top token is the same; and whether the
spec stays within the stated bound (``--bound-mean`` / ``--bound-max``, nats): llama.cpp's CPU
rounds activations to 8 bits per block of 32 for its Q8_0 / Q4_0 products, so it is not
bit-equal to the spec; the default bound is of the size of that rounding's own error
(docs/benchmarks.md: llama.cpp Q8_0 against float32, mean 0.014-0.047, max 0.07-0.45).

Never run in CI: it needs a llama.cpp build. Without ``--llama-cpp`` it says so and stops.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import torch

from benchmarks.int8_quality import TEXT
from core.backend import Backend
from core.gguf import load_gguf
from tools.teacher_forced import teacher_forced_logits

CONTEXT = 514  # llama-perplexity's chunk: from position CONTEXT // 2 on, 256 positions are saved
NO_BUILD = ("no llama.cpp build given (--llama-cpp DIR): nothing is compared. This benchmark runs "
            "llama.cpp's llama-perplexity on the same GGUF file and compares its log-probabilities "
            "with this engine's over 256 teacher-forced tokens; build llama.cpp (cmake -B build && "
            "cmake --build build --target llama-perplexity) and pass its folder.")


def llama_perplexity(folder: Path) -> Path:
    for candidate in (folder, folder / "bin", folder / "build" / "bin"):
        if (candidate / "llama-perplexity").is_file():
            return candidate / "llama-perplexity"
    raise FileNotFoundError(f"no llama-perplexity in {folder}, {folder}/bin or {folder}/build/bin")


def run_llama_cpp(binary: Path, model: Path, threads: int, out: Path) -> Path:
    """llama.cpp's log-probabilities of one 514-token chunk of the text, saved at ``out``."""
    text = out.with_suffix(".txt")
    text.write_text(" ".join([TEXT] * 12))  # at least two chunks of tokens, as it requires
    subprocess.run([str(binary), "-m", str(model), "-f", str(text), "-c", str(CONTEXT),
                    "-b", str(CONTEXT), "--chunks", "1", "-t", str(threads),
                    "--kl-divergence-base", str(out)], check=True, capture_output=True)
    return out


def read_kld(path: Path) -> tuple[list[int], np.ndarray, np.ndarray]:
    """(the chunk's token ids, [rows, vocab] log-probabilities, [rows, vocab] which entries were
    kept: above the row's top - 16 nats) from a ``--kl-divergence-base`` file of one chunk."""
    data = path.read_bytes()
    if data[:8] != b"_logits_":
        raise ValueError(f"{path} is not a llama-perplexity --kl-divergence-base file")
    n_ctx, n_vocab, n_chunk = np.frombuffer(data, np.int32, 3, 8)
    tokens = np.frombuffer(data, np.int32, n_ctx * n_chunk, 20)
    width = 2 * ((n_vocab + 1) // 2) + 4  # uint16 a row: two float32 (scale, min), the values
    rows = np.frombuffer(data, np.uint16, (n_ctx - 1 - n_ctx // 2) * width, 20 + 4 * tokens.size)
    rows = rows.reshape(-1, width)
    header = rows[:, :4].copy().view(np.float32)  # [rows, 2]: scale, min log p
    values = rows[:, 4:4 + n_vocab]
    logprobs = header[:, :1] * values + header[:, 1:2]
    return tokens[:n_ctx].tolist(), logprobs.astype(np.float32), values > 0


def first(ids: list[int]) -> int:
    """The first position of a chunk whose log-probabilities llama.cpp saves."""
    return len(ids) // 2


def our_logprobs(model: Path, ids: list[int], dtype: torch.dtype, fast: bool) -> np.ndarray:
    """[256, vocab] this engine's log-probabilities at the positions llama.cpp saved (from the
    chunk's middle, ``first``, to its last but one)."""
    from fast.backend import FastBackend

    loaded = load_gguf(model, dtype, torch.device("cpu"))
    backend = FastBackend(loaded) if fast else Backend(loaded)
    logits = teacher_forced_logits(backend, ids, "whole")[first(ids):len(ids) - 1]
    return logits.float().log_softmax(-1).numpy()


def compare(ours: np.ndarray, theirs: np.ndarray, kept: np.ndarray, ids: list[int]) -> dict:
    if ours.shape != theirs.shape:
        raise ValueError(f"vocabularies differ: this engine {ours.shape[1]}, llama.cpp {theirs.shape[1]}")
    target = np.asarray(ids[first(ids) + 1:])[:, None]
    next_token = np.abs(np.take_along_axis(ours, target, 1) - np.take_along_axis(theirs, target, 1))
    return {"mean": float(next_token.mean()), "max": float(next_token.max()),
            "max_kept": float(np.abs(ours - theirs)[kept].max()),
            "same_top": float((ours.argmax(1) == theirs.argmax(1)).mean())}


def report(model: Path, kld: Path, bound_mean: float, bound_max: float) -> bool:
    ids, theirs, kept = read_kld(kld)
    rows = {"this engine, float32, plain path (the spec)": our_logprobs(model, ids, torch.float32, False),
            "this engine, bfloat16, fast path": our_logprobs(model, ids, torch.bfloat16, True)}
    print(f"{model.name}: {len(theirs)} teacher-forced positions against llama.cpp\n")
    print("| this engine | mean abs dlogp (next token) | max | max over kept entries | same top |")
    print("|---|---:|---:|---:|---:|")
    figures = {}
    for name, ours in rows.items():
        f = figures[name] = compare(ours, theirs, kept, ids)
        print(f"| {name} | {f['mean']:.4f} | {f['max']:.4f} | {f['max_kept']:.4f} | {f['same_top']:.1%} |")
    spec = next(iter(figures.values()))
    within = spec["mean"] <= bound_mean and spec["max"] <= bound_max
    print(f"\nthe spec {'is' if within else 'is NOT'} within the bound (mean <= {bound_mean}, "
          f"max <= {bound_max} nats)")
    return within


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gguf_compare", description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, help="the GGUF file (Q8_0, Q4_0, F16, ...)")
    p.add_argument("--llama-cpp", type=Path, help="a llama.cpp build folder (holding llama-perplexity)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--bound-mean", type=float, default=0.05)
    p.add_argument("--bound-max", type=float, default=0.5)
    args = p.parse_args(argv)
    if args.llama_cpp is None:
        print(NO_BUILD)
        return 0
    if args.model is None:
        p.error("--model FILE.gguf is needed with --llama-cpp")
    folder = Path(tempfile.mkdtemp(prefix="gguf_compare_"))
    try:
        kld = run_llama_cpp(llama_perplexity(args.llama_cpp), args.model, args.threads, folder / "base.kld")
        return 0 if report(args.model, kld, args.bound_mean, args.bound_max) else 1
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
