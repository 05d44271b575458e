"""One restart, seen: ``python run.py --restart`` (the disk tier, core/kv_disk.py).

An engine serves the demo's longest prompt cold and writes every block it saves to a tier
directory under the chain hash; then a new engine -- the process restarted, the pool empty --
serves the same prompt from that directory. Printed for both: hash calls (the chain is hashed
once per request either way: the tier reads it off the ``Sequence``), blocks served from disk,
time to first token, and whether the tokens are the same.
"""
from __future__ import annotations

import tempfile

from engine import LLM, SamplingParams


def serve(model_dir: str, settings: dict, disk: str, prompt: list[int], max_tokens: int,
          write: str) -> dict:
    """A fresh engine on ``disk``, one request; its figures."""
    # the prompt's prefill in one step: the cold TTFT holds no tier write (they follow each step)
    one_step = max(settings.get("max_num_batched_tokens") or 0, len(prompt))
    llm = LLM(model_dir, **{**settings, "max_num_batched_tokens": one_step}, kv_disk_dir=disk,
              kv_disk_write=write)
    llm.generate([[1] * 8], SamplingParams(max_tokens=1), use_tqdm=False)  # first-forward set-up
    before = llm.llm_engine.engine_core.stats()["hash_computations"]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens),
                       use_tqdm=False)[0]
    stats = llm.llm_engine.engine_core.stats()
    return dict(tokens=list(out.outputs[0].token_ids), ttft=out.metrics["ttft"],
                hashes=stats["hash_computations"] - before, disk_hits=stats["kv_disk_hits"],
                cached=out.num_cached_tokens, written=stats["kv_disk_writes"])


def show(model_dir: str, settings: dict, prompt: list[int], max_tokens: int,
         directory: str | None = None) -> int:
    """Cold, then restarted from the tier; 0 if the tokens are the same."""
    with tempfile.TemporaryDirectory() as tmp:
        disk = directory or tmp
        cold = serve(model_dir, settings, disk, prompt, max_tokens, "save")
        warm = serve(model_dir, settings, disk, prompt, max_tokens, "evict")
    print(f"\nOne restart from the disk tier ({len(prompt)}-token prompt, {max_tokens} new tokens):")
    print(f"  cold       : {cold['hashes']:3d} hash calls, TTFT {cold['ttft'] * 1e3:8.1f} ms, "
          f"{cold['written']} blocks written to disk")
    print(f"  restarted  : {warm['hashes']:3d} hash calls, TTFT {warm['ttft'] * 1e3:8.1f} ms, "
          f"{warm['disk_hits']} blocks read from disk ({warm['cached']} tokens not computed)")
    same = cold["tokens"] == warm["tokens"]
    print(f"  tokens identical: {same}")
    return 0 if same else 1
