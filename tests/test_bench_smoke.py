"""Smoke test of bench.py: the whole benchmark end to end at a tiny size (ours + HF peers).

It checks that every part runs, that every system decodes the same tokens as ours, and that
the report has every row and target; it says nothing about speed. The size and dtype options
run on tiny stand-in shapes (the real 0.6B shape is only counted, on the meta device). vLLM is not run here (it
needs its own venv and ~2 min to start); its spec is checked against the workloads instead.
"""
from __future__ import annotations

import json
import math

import pytest
import torch

import bench
from benchmarks.ours_profile import weight_bytes_per_step
from benchmarks.peer_vllm import VllmPeer, compute_threads_from_log
from benchmarks.report import compare_tokens
from benchmarks.targets import TARGETS, USER_SIZE_TARGETS
from benchmarks.workloads import (MODEL_SHAPES, Sizes, build_checkpoint, workload_no_sharing,
                                  workload_shared_prefix)

SYSTEMS = ("ours", "ours (plain)", "HF generate_batch", "HF generate (padded)")
WORKLOADS = ("(a) no sharing", "(b) shared prefix")


def tiny_sizes() -> Sizes:
    return Sizes(num_requests=4, a_prompt_min=16, a_prompt_max=48, a_new_tokens=4,
                 b_prefix=32, b_suffix=8, b_new_tokens=4, hash_prompt=128, hash_reps=3,
                 decode_batch=4, decode_prompt=16, decode_steps=2, matmul_n=64,
                 max_batched_tokens=64,  # so later requests find the prefix cached
                 model=dict(vocab_size=512, hidden_size=64, intermediate_size=128,
                            num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16))


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    report = bench.main(["--threads", "default,1", "--peers", "hf", "--profile", "--json", str(out)],
                        sizes=tiny_sizes())
    return report["sections"][0], out


def table_rows(printed: str) -> set[tuple[str, str, str]]:
    rows = set()
    for line in printed.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| (") and len(cells) == 11:
            rows.add(tuple(cells[:3]))
    return rows


def test_report_has_every_row(bench_run):
    report, out = bench_run
    expected = {(w, t, s) for w in WORKLOADS for t in ("default", "1") for s in SYSTEMS}
    expected |= {(w, "default", "ours, busy neighbour") for w in WORKLOADS}
    assert {(r["workload"], r["threads"], r["system"]) for r in report["runs"]} == expected
    for run in report["runs"]:
        assert run["out_tok_s"] > 0 and run["output_tokens"] == 4 * 4
        assert run["compute_threads"] >= 1
    written = json.loads(out.read_text())["sections"][0]["runs"]
    assert written == json.loads(json.dumps(report["runs"], default=str))


def test_printed_table_has_every_row(tmp_path, capsys):
    bench.main(["--threads", "1", "--peers", "hf", "--no-hashing"], sizes=tiny_sizes())
    printed = capsys.readouterr().out
    expected = {(w, "1", s) for w in WORKLOADS for s in SYSTEMS + ("ours, busy neighbour",)}
    assert table_rows(printed) == expected
    assert "Targets:" in printed


def test_every_peer_decodes_like_ours(bench_run):
    report, _ = bench_run
    # HF and plain rows (2 workloads x 2 thread configurations x 3), plus the busy-neighbour rows
    assert len(report["agreement"]) == 2 * 2 * 3 + 2
    for a in report["agreement"]:
        assert a["identical"] == a["total"] == 4, a
        assert a["first_mismatch"] is None


def test_prefix_cache_and_hash_counts(bench_run):
    report, _ = bench_run
    ours_b = [r for r in report["runs"] if r["system"] == "ours" and r["workload"].startswith("(b)")]
    assert all(r["extra"]["prompt_tokens_cached"] > 0 for r in ours_b)
    by_system = {h["system"]: h for h in report["hashing"]}
    blocks = 128 // 16
    assert by_system["ours (incremental)"]["relookup_hashes"] == 0
    assert by_system["ours (recompute)"]["relookup_hashes"] == blocks
    # HF rebuilds its chain on every match, up to the last full block before the last token.
    assert by_system["HF match_prefix_blocks (blake2b)"]["relookup_hashes"] == blocks - 1
    assert by_system["HF match_prefix_blocks (blake2b)"]["cold_hit_blocks"] == blocks - 1


def test_targets_each_judged_once(bench_run):
    report, _ = bench_run
    verdicts = {t["target"]: t["verdict"] for t in report["targets"]}
    assert len(verdicts) == len(TARGETS)
    for goal, verdict in verdicts.items():
        expected = {"not run"} if "vLLM" in goal else {"PASS", "MISS"}
        assert verdict in expected, (goal, verdict)
    assert verdicts["every peer's tokens identical to ours, request by request"] == "PASS"
    assert 0 < report["prefill"]["mfu"] and 0 <= report["decode"]["non_matmul_share"] <= 1


def test_profile_by_phase(bench_run):
    report, _ = bench_run
    peaks, bandwidth = report["peaks"], report["bandwidth"]
    assert peaks["peak_flop_s"] == max(peaks["square_flop_s"], peaks["model_shaped_flop_s"]) > 0
    assert bandwidth["bytes_s"] == max(bandwidth["read_bytes_s"], bandwidth["copy_bytes_s"]) > 0
    assert [d["batch"] for d in report["decode_bounds"]] == [1, 4]
    for d in report["decode_bounds"]:
        assert d["weight_bytes"] == weight_bytes_per_step(report["model"], "float32")
        assert d["weight_kv_bound_ms"] > d["weight_bound_ms"] > 0 and d["over_weight_bound"] > 0
    assert report["prefill"]["profiled_tokens"] > 0 and report["prefill"]["top_ops_ms"]
    assert report["profile_load"]["cpus"] >= 1  # the load it was measured under is named


def test_compare_tokens_names_the_first_mismatch():
    identical, first = compare_tokens([[5, 6, 7], [1, 2, 3], [4, 4]], [[5, 6, 7], [1, 9, 3], [4, 0]])
    assert identical == 1
    assert first == "request 1, output token 1: ours 2, this 9"


def test_vllm_spec_carries_the_same_requests(tmp_path):
    s = tiny_sizes()
    model_dir = build_checkpoint(str(tmp_path), s.model)
    workloads = [workload_no_sharing(s, 512), workload_shared_prefix(s, 512)]
    spec = VllmPeer("/nonexistent/python", model_dir, "float32", s).spec(workloads, 512)
    assert [w["prompts"] for w in spec["workloads"]] == [w.prompts for w in workloads]
    assert [w["max_tokens"] for w in spec["workloads"]] == [4, 4]
    assert spec["max_num_batched_tokens"] == s.max_batched_tokens
    # KV room for the larger workload: (32+8+4 -> 256) x 4 requests x 2*2 layers*2 heads*16*4 B
    assert spec["kv_cache_memory_bytes"] == 4 * 256 * 2 * 2 * 2 * 16 * 4


def test_vllm_binding_read_from_its_log(tmp_path):
    log = tmp_path / "vllm.log"
    log.write_text("(EngineCore pid=1) INFO [ompmultiprocessing.py:185] \tlocal_rank=0, core ids=[0, 1]\n")
    assert compute_threads_from_log(str(log)) == 2
    log.write_text("nothing about binding\n")
    assert compute_threads_from_log(str(log)) is None


# ----------------------------------------------------------------------------- sizes and dtypes

STAND_INS = {  # two tiny shapes standing in for 42m and 0.6b (the second tied, wider, deeper)
    "tiny": tiny_sizes().model,
    "tiny-wide": dict(vocab_size=640, hidden_size=96, intermediate_size=192, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32),
}


@pytest.fixture(scope="module")
def sizes_run(tmp_path_factory):
    md = tmp_path_factory.mktemp("md") / "results.md"
    argv = ["--model-sizes", "tiny,tiny-wide:float32", "--dtypes", "float32,bfloat16",
            "--threads", "1", "--peers", "hf-padded", "--no-busy-neighbour", "--no-hashing",
            "--markdown", str(md)]
    return bench.main(argv, sizes=tiny_sizes(), shapes=STAND_INS), md


def test_every_size_and_dtype_is_a_section(sizes_run):
    report, _ = sizes_run
    got = [(s["model_size"], s["dtype"]) for s in report["sections"]]
    assert got == [("tiny", "float32"), ("tiny", "bfloat16"), ("tiny-wide", "float32")]
    params = {s["model_size"]: s["model"]["params"] for s in report["sections"]}
    assert params["tiny"] < params["tiny-wide"]
    for sec in report["sections"]:
        systems = {(r["workload"], r["system"]) for r in sec["runs"]}
        assert systems == {(w, s) for w in WORKLOADS
                           for s in ("ours", "ours (plain)", "HF generate (padded)")}


def test_float32_tokens_equal_across_paths_and_peers(sizes_run):
    report, _ = sizes_run
    for sec in report["sections"]:
        if sec["dtype"] == "float32":
            assert all(a["identical"] == a["total"] for a in sec["agreement"]), sec["agreement"]


def test_markdown_has_the_summary_and_every_section(sizes_run):
    _, md = sizes_run
    text = md.read_text()
    assert text.startswith("# Benchmark results") and "--model-sizes tiny,tiny-wide:float32" in text
    for title in ("tiny, float32, full scale", "tiny, bfloat16, full scale",
                  "tiny-wide, float32, full scale"):
        assert f"## {title}" in text
    summary = text.split("## Summary")[1].split("\n## ")[0]
    rows = [line for line in summary.splitlines() if line.startswith("| tiny")]
    assert len(rows) == 3 * 2  # every section x workload, one thread configuration
    assert "(run still in progress)" not in text


def test_qwen3_06b_shape_counts_its_parameters():
    """Qwen3-0.6B: 0.6B parameters, 0.44B without the (tied) embedding; counted on meta."""
    from transformers import AutoModelForCausalLM, Qwen3Config
    cfg = Qwen3Config(**MODEL_SHAPES["0.6b"], tie_word_embeddings=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    total = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight.numel()
    assert round(total / 1e9, 2) == 0.60 and round((total - embedding) / 1e9, 2) == 0.44
    facts = dict(params_without_embedding=total - embedding, vocab_size=151936, hidden_size=1024)
    assert round(weight_bytes_per_step(facts, "bfloat16") / 1e9, 1) == 1.2  # issue 20's 1.2 GB


def test_quarter_scale_and_user_size_targets():
    assert Sizes().scaled("quarter").num_requests == 16
    assert Sizes().scaled("full") == Sizes()
    args = bench.parse_args(["--model-sizes", "42m:float32,0.6b", "--dtypes", "bfloat16"])
    assert args.combos == [("42m", "float32"), ("0.6b", "bfloat16")]
    from benchmarks.targets import targets_for
    assert targets_for("0.6b", "bfloat16") == TARGETS + USER_SIZE_TARGETS
    assert targets_for("42m", "bfloat16") == TARGETS


@pytest.mark.parametrize("argv, message", [
    (["--peers", "vllm"], "needs --vllm-python"),
    (["--peers", "hf,sglang"], "unknown peer"),
    (["--threads", "two"], "neither 'default' nor a thread count"),
    (["--model-sizes", "7b"], "unknown size '7b'"),
    (["--model-sizes", "42m:float16"], "unknown dtype"),
    (["--dtypes", "float32,int8"], "--dtypes"),
    (["--model-sizes", "42m", "--model", "/some/dir"], "cannot go with --model"),
])
def test_bad_flags_are_named(argv, message, capsys):
    with pytest.raises((SystemExit, ValueError)) as err:
        bench.parse_args(argv)
    assert message in str(err.value)


def test_default_threads_undo_a_count_a_policy_lowered():
    """Under 'default' each system starts from torch's own default, not from the count the
    engine's thread policy left behind on a busy machine (HF rows once inherited 1 thread)."""
    from benchmarks.threads import DEFAULT, INITIAL_THREADS, torch_threads
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # as a policy that saw busy cores leaves it
    try:
        with torch_threads(DEFAULT):
            assert torch.get_num_threads() == INITIAL_THREADS
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_hf_rows_run_at_the_default_count(bench_run):
    report, _ = bench_run
    from benchmarks.threads import INITIAL_THREADS
    hf_default = [r for r in report["runs"] if r["system"].startswith("HF") and r["threads"] == "default"]
    assert hf_default and all(r["compute_threads"] == INITIAL_THREADS for r in hf_default)


def test_single_user_table_on_a_small_checkpoint(llama_dir):
    """benchmarks/single_user.py measures every row at a thread count, with the batch-1 decode
    bound from the checkpoint's weights and the measured bandwidth, and reports them all."""
    from benchmarks import single_user
    shape = single_user.Shape(long_prompt=64, prompt=32, batch=4, batch_new=8, single_new=16)
    table = single_user.run(llama_dir, [1], repeats=1, engine_kw=dict(enforce_eager=True), shape=shape)
    assert all(table.ours[(row, 1)] > 0 for row in shape.rows)
    assert table.bound[1] > 0 and single_user.streamed_bytes(llama_dir) > 0
    text = "\n".join(single_user.report(table))
    assert all(f"| {row} | 1 |" in text for row in shape.rows) and "llama.cpp" not in text.split("\n")[0]


def test_int8_table_on_a_small_checkpoint(llama_dir):
    """benchmarks/int8_bench.py measures every row for this engine in each format asked, with
    each format's batch-1 bound (int8 streams about half bf16's bytes, int4 half again), the
    machine named first, and reports them."""
    from benchmarks import int8_bench, single_user
    shape = single_user.Shape(long_prompt=64, prompt=32, batch=4, batch_new=8, single_new=16)
    rates, bounds, described = int8_bench.run(llama_dir, [1], 1, None, {}, shape,
                                              formats=("ours bf16", "ours int8", "ours int4"))
    # every row measured for both (a tiny model's decode rate is a difference of noisy times:
    # its value is the bench's to report, not this test's to judge)
    assert all(math.isfinite(rates[(system, row, 1)]) for system in ("ours bf16", "ours int8")
               for row in shape.rows)
    assert 1.6 < bounds[("ours int8", 1)] / bounds[("ours bf16", 1)] < 2.0
    assert 1.6 < bounds[("ours int4", 1)] / bounds[("ours int8", 1)] < 2.0  # half the bytes again
    text = "\n".join(int8_bench.report(rates, bounds, [1], shape))
    assert all(f"| {row} | 1 |" in text for row in shape.rows) and "llama.cpp" not in text
    assert "int4 / int8" in text and described[0].startswith("CPU: ")
    assert any("8-bit linears" in d for d in described if "int8" in d)


def test_decode_split_accounts_for_the_step(llama_dir):
    """The decode split's parts add up to the step (kernels, rest of the forward, outside)."""
    from benchmarks.decode_split import measure
    lines = measure(llama_dir, threads=1, steps=4, quantization=None)
    assert lines[0].startswith("threads 1: read bandwidth") and "of the bound" in lines[1]
    parts = [float(line.split(": ")[1].split(" ms")[0]) for line in lines[2:]]
    mean_ms = float(lines[1].split("mean ")[1].split(" ms")[0])
    assert any("outside the forward" in line for line in lines) and min(parts[-1], mean_ms) > 0
    # the parts split the mean step: their sum is it, up to each part's rounding to 0.01 ms
    assert abs(sum(parts) - mean_ms) <= 0.005 * (len(parts) + 1) + 1e-9


def test_int4_quality_rows_on_a_small_checkpoint(llama_dir):
    """benchmarks/int4_quality.py scores each format against the float32 engine on the same ids
    (llama.cpp's rows join when a build is given); the float32 reference is its own zero."""
    from benchmarks import int4_quality
    ids = list(range(3, 3 + 80))
    rows = dict(int4_quality.rows(llama_dir, ids, {}))
    assert set(rows) == {f"this engine, {f} (bfloat16, fast path)" for f in int4_quality.FORMATS} | {
        "this engine, bfloat16 (fast path)"}
    assert all(0 <= r["mean"] <= r["max"] and 0 <= r["agreement"] <= 1 for r in rows.values())
    reference = int4_quality.our_logprobs(llama_dir, ids, torch.float32, None, fast=False)
    assert int4_quality.against(reference, reference, ids) == {"mean": 0.0, "max": 0.0, "agreement": 1.0}


def test_depth_rows_on_a_small_checkpoint(llama_dir):
    """benchmarks/depth.py: decoding after a cached context and a follow-up prompt after it,
    both measured (tok/s) for a format; llama.cpp's rows only with a build."""
    from benchmarks import depth
    got = depth.measure_ours(llama_dir, 1, "int8", depth=96, follow=32, new=4, repeats=1)
    assert set(got) == set(depth.rows(96, 32)) and all(math.isfinite(r) and r > 0 for r in got.values())
