"""The prefix cache's disk tier (core/kv_disk.py): the chain outlives the process, and a file
on disk never gives a wrong token.

A restarted engine serves a prompt's blocks from the tier with Hugging Face's tokens, on the
plain, fast and int8 paths, hashing each block once; every way a file can be wrong is a
counted miss; a weight change moves to a new namespace; two engines share a directory; the
budget holds; an interrupt during a write leaves no readable file and a usable engine; a
failed step leaves the tier and the map as they were.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from core import kv_disk
from helpers import assert_no_leak, greedy, make_llm, random_prompt
from vllm_api.kv_events import BlockRemoved, BlockStored

PATHS = {"plain": dict(fast_paths=False), "fast": {}, "int8": dict(quantization="int8")}
BS = 4
PROMPT = random_prompt(38, seed=52)          # 9 full blocks of 4 before the last token's
NUM_BLOCKS = (len(PROMPT) - 1) // BS
N = 5


def tokens_of(llm, prompt=PROMPT, n: int = N) -> list[int]:
    return list(llm.generate([prompt], greedy(n), use_tqdm=False)[0].outputs[0].token_ids)


def stats(llm) -> dict:
    return llm.llm_engine.engine_core.stats()


def tier_of(llm) -> kv_disk.DiskTier:
    return llm.llm_engine.prefix_cache.tier


def files(root) -> list[Path]:
    return sorted(Path(root).rglob(f"*{kv_disk.SUFFIX}"))


def filled(llama_dir, disk, **kw) -> tuple[list[int], kv_disk.DiskTier]:
    """One engine writes the prompt's blocks (``kv_disk_write="save"``) and ends."""
    llm = make_llm(llama_dir, block_size=BS, kv_disk_dir=str(disk), kv_disk_write="save", **kw)
    out = tokens_of(llm)
    return out, tier_of(llm)


@pytest.mark.parametrize("path", PATHS)
def test_a_restarted_engine_serves_the_prefix_from_disk_with_hf_tokens(llama_dir, reference, tmp_path, path):
    cold = tokens_of(make_llm(llama_dir, block_size=BS, **PATHS[path]))
    first, _ = filled(llama_dir, tmp_path, **PATHS[path])
    llm = make_llm(llama_dir, block_size=BS, kv_disk_dir=str(tmp_path), **PATHS[path])
    out = llm.generate([PROMPT], greedy(N), use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == first == cold
    if path != "int8":
        reference.compare(PROMPT, out.outputs[0].token_ids, N, f"{path} from the tier")
    s = stats(llm)
    assert out.num_cached_tokens == NUM_BLOCKS * BS
    assert s["kv_disk_hits"] == NUM_BLOCKS and s["kv_disk_bad_files"] == 0
    assert s["kv_disk_bytes_read"] > 0
    # the chain is hashed once (the lookup; then decode blocks), the tier reads it: no more
    assert s["hash_computations"] == (len(PROMPT) + N - 1) // BS  # each full block, once
    # the loaded blocks are in the pool's map now: a second request hits the pool, not the disk
    tokens_of(llm)
    assert stats(llm)["kv_disk_hits"] == NUM_BLOCKS


def test_evicted_blocks_come_back_from_disk_in_the_same_engine(llama_dir, tmp_path):
    other = random_prompt(40, seed=53)
    small = dict(block_size=BS, num_kv_blocks=11)  # the other prompt evicts the first one's blocks
    cold = make_llm(llama_dir, **small)
    expected = [tokens_of(cold), tokens_of(cold, other), tokens_of(cold)]
    llm = make_llm(llama_dir, kv_disk_dir=str(tmp_path), **small)
    got = [tokens_of(llm), tokens_of(llm, other), tokens_of(llm)]
    assert got == expected
    s = stats(llm)
    assert s["evictions"] > 0 and s["kv_disk_writes"] > 0 and s["kv_disk_hits"] > 0


def test_preemption_and_aborts_with_the_tier(llama_dir, tmp_path):
    prompts = [random_prompt(9 + i, seed=60 + i) for i in range(4)]
    small = dict(block_size=BS, num_kv_blocks=13, max_num_seqs=4)  # decodes outgrow it: preemptions
    cold = make_llm(llama_dir, **small)
    expected = [list(o.outputs[0].token_ids) for o in cold.generate(prompts, greedy(10), use_tqdm=False)]
    llm = make_llm(llama_dir, kv_disk_dir=str(tmp_path), **small)
    for _ in range(2):
        got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy(10), use_tqdm=False)]
        assert got == expected
    assert stats(llm)["preemptions"] > 0
    rid = llm.llm_engine.add_request("abort-me", {"prompt_token_ids": prompts[0]}, greedy(10)) or "abort-me"
    llm.llm_engine.step()
    llm.llm_engine.abort_request([rid])
    assert [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy(10), use_tqdm=False)] == expected
    assert_no_leak(llm)


# ------------------------------------------------------------------ each way a file can be wrong


def _rewrite(path: Path, **change) -> None:
    """Re-pack a file with some header field, its tokens or its salt changed (a valid checksum:
    only the verification against the chain can refuse it)."""
    header, tokens, salt, payload = kv_disk._unpack(path.read_bytes())
    tokens = change.pop("tokens", tokens)
    salt = change.pop("salt", salt)
    header.update(change, tokens=len(tokens), salt=None if salt is None else len(salt.encode()))
    path.write_bytes(kv_disk._pack(header, tokens, (salt or "").encode(), payload))


def _truncate(path: Path, tier) -> None:
    path.write_bytes(path.read_bytes()[:-100])


def _flip(path: Path, tier) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


def _wrong_tokens(path: Path, tier) -> None:
    header, tokens, _, _ = kv_disk._unpack(path.read_bytes())
    _rewrite(path, tokens=tokens[8:] + tokens[:8])


def _other_parent(path: Path, tier) -> None:
    _rewrite(path, parent=12345)


def _other_salt(path: Path, tier) -> None:
    _rewrite(path, salt="someone else")


def _other_model(path: Path, tier) -> None:
    _rewrite(path, fingerprint="0" * 32)


def _not_a_file(path: Path, tier) -> None:
    path.write_bytes(b"hello")


WRONG = {"truncated": _truncate, "flipped byte": _flip, "wrong tokens": _wrong_tokens,
         "other parent": _other_parent, "other salt": _other_salt, "other model": _other_model,
         "garbage": _not_a_file}


@pytest.mark.parametrize("how", WRONG)
def test_a_wrong_file_is_a_counted_miss(llama_dir, tmp_path, how):
    first, tier = filled(llama_dir, tmp_path)
    chain = _chain(llama_dir)
    WRONG[how](tier.path_of(chain[3]), tier)
    llm = make_llm(llama_dir, block_size=BS, kv_disk_dir=str(tmp_path))
    assert tokens_of(llm) == first
    s = stats(llm)
    assert s["kv_disk_hits"] == 3 and s["kv_disk_bad_files"] == 1


def _chain(llama_dir) -> list[int]:
    return _chain_of(make_llm(llama_dir, block_size=BS))


def _chain_of(llm) -> list[int]:
    from scheduler import Sequence
    cache = llm.llm_engine.prefix_cache
    seq = Sequence(PROMPT, 1)
    cache._precompute_block_hashes(seq)
    return seq._block_hashes


@pytest.mark.parametrize("setting", [dict(block_size=8), dict(dtype="bfloat16")])
def test_another_block_size_or_dtype_reads_nothing_of_it(llama_dir, tmp_path, setting):
    filled(llama_dir, tmp_path)
    kw = {"block_size": BS, **setting}
    cold = tokens_of(make_llm(llama_dir, **kw))
    llm = make_llm(llama_dir, kv_disk_dir=str(tmp_path), **kw)
    assert tokens_of(llm) == cold
    assert stats(llm)["kv_disk_hits"] == 0
    # a file of the other namespace put where this one looks is refused, not served
    src = files(tmp_path)[0]
    tier = tier_of(llm)
    for h in _chain_of(llm)[:1]:
        (tier.dir / f"{h:x}{kv_disk.SUFFIX}").write_bytes(src.read_bytes())
    fresh = make_llm(llama_dir, kv_disk_dir=str(tmp_path), **kw)
    assert tokens_of(fresh) == cold and stats(fresh)["kv_disk_bad_files"] >= 1


def test_another_salt_never_reads_the_files(llama_dir, tmp_path):
    llm = make_llm(llama_dir, block_size=BS, kv_disk_dir=str(tmp_path), kv_disk_write="save")
    salted = {"prompt_token_ids": PROMPT, "cache_salt": "tenant a"}
    first = list(llm.generate([salted], greedy(N), use_tqdm=False)[0].outputs[0].token_ids)
    other = make_llm(llama_dir, block_size=BS, kv_disk_dir=str(tmp_path))
    b = {"prompt_token_ids": PROMPT, "cache_salt": "tenant b"}
    assert list(other.generate([b], greedy(N), use_tqdm=False)[0].outputs[0].token_ids) == first
    assert stats(other)["kv_disk_hits"] == 0
    same = make_llm(llama_dir, block_size=BS, kv_disk_dir=str(tmp_path))
    assert list(same.generate([salted], greedy(N), use_tqdm=False)[0].outputs[0].token_ids) == first
    assert stats(same)["kv_disk_hits"] == NUM_BLOCKS


# ------------------------------------------------------------------ weights, sharing, budget


def test_a_weight_change_moves_to_a_new_namespace(llama_dir, tmp_path):
    llm = make_llm(llama_dir, block_size=BS, kv_disk_dir=str(tmp_path), kv_disk_write="save")
    tokens_of(llm)
    old = tier_of(llm).namespace
    twin = make_llm(llama_dir, block_size=BS)
    for model in (llm.llm_engine.model, twin.llm_engine.model):
        with torch.no_grad():
            model.norm.weight.mul_(1.5)
    expected = tokens_of(twin)
    hits = stats(llm)["kv_disk_hits"]
    assert tokens_of(llm) == expected
    assert tier_of(llm).namespace != old and stats(llm)["kv_disk_hits"] == hits
    restarted = make_llm(llama_dir, block_size=BS, kv_disk_dir=str(tmp_path))
    assert tier_of(restarted).namespace == old  # the checkpoint's own weights: the old files serve


def test_two_engines_share_one_directory(llama_dir, tmp_path):
    other = random_prompt(41, seed=54)
    a = make_llm(llama_dir, block_size=BS, kv_disk_dir=str(tmp_path), kv_disk_write="save")
    b = make_llm(llama_dir, block_size=BS, kv_disk_dir=str(tmp_path), kv_disk_write="save")
    expected = tokens_of(a), tokens_of(b, other)
    assert (tokens_of(b), tokens_of(a, other)) == expected  # each reads what the other wrote
    assert stats(b)["kv_disk_hits"] == NUM_BLOCKS and stats(a)["kv_disk_hits"] == (len(other) - 1) // BS
    c = make_llm(llama_dir, block_size=BS, kv_disk_dir=str(tmp_path))
    assert (tokens_of(c), tokens_of(c, other)) == expected
    assert stats(c)["kv_disk_bad_files"] == 0
    assert not list(Path(tmp_path).rglob("*.tmp"))


def test_the_budget_is_kept_least_recently_used_first(llama_dir, tmp_path):
    _, tier = filled(llama_dir, tmp_path / "probe")
    size = files(tmp_path / "probe")[0].stat().st_size
    budget = 4.5 * size
    llm = make_llm(llama_dir, block_size=BS, kv_disk_dir=str(tmp_path / "d"), kv_disk_write="save",
                   kv_disk_size=budget / 2**30)
    tokens_of(llm)
    kept = files(tmp_path / "d")
    assert sum(p.stat().st_size for p in kept) <= budget and len(kept) == 4
    chain, tier = _chain_of(llm), tier_of(llm)  # the prompt's 9 blocks; a 10th was decoded
    assert not {tier.path_of(h) for h in chain[:6]} & set(kept)  # the oldest writes left first
    assert {tier.path_of(h) for h in chain[6:]} <= set(kept)
    assert stats(llm)["kv_disk_removed"] == len(chain) + 1 - 4


# ------------------------------------------------------------------ interrupts and failures


@pytest.mark.parametrize("exc", [KeyboardInterrupt, OSError])
def test_an_interrupt_during_a_write_leaves_nothing_readable(llama_dir, tmp_path, monkeypatch, exc):
    real, calls = os.fsync, []

    def fsync(fd):
        calls.append(fd)
        if len(calls) == 3:
            raise exc("during a write")
        return real(fd)

    llm = make_llm(llama_dir, block_size=BS, kv_disk_dir=str(tmp_path), kv_disk_write="save")
    cold = tokens_of(make_llm(llama_dir, block_size=BS))
    monkeypatch.setattr(kv_disk.os, "fsync", fsync)
    if exc is KeyboardInterrupt:
        with pytest.raises(KeyboardInterrupt):
            tokens_of(llm)
    else:
        assert tokens_of(llm) == cold
        assert stats(llm)["kv_disk_write_errors"] == 1
    monkeypatch.setattr(kv_disk.os, "fsync", real)
    assert not list(Path(tmp_path).rglob("*.tmp"))
    for path in files(tmp_path):
        kv_disk._unpack(path.read_bytes())  # every file there is whole
    assert tokens_of(llm) == cold  # the engine goes on
    restarted = make_llm(llama_dir, block_size=BS, kv_disk_dir=str(tmp_path))
    assert tokens_of(restarted) == cold and stats(restarted)["kv_disk_bad_files"] == 0


class FailOnce:
    def __init__(self, llm) -> None:
        self.armed = True
        llm.llm_engine.model.layers[0].register_forward_hook(self)

    def __call__(self, module, args, output):
        if self.armed:
            self.armed = False
            raise RuntimeError("the step that loads from disk fails")


def test_a_failed_step_leaves_the_tier_and_the_map_as_they_were(llama_dir, tmp_path):
    first, _ = filled(llama_dir, tmp_path)
    before = {p: p.read_bytes() for p in files(tmp_path)}
    llm = make_llm(llama_dir, block_size=BS, kv_disk_dir=str(tmp_path), kv_disk_write="save")
    FailOnce(llm)
    with pytest.raises(RuntimeError):
        tokens_of(llm)
    assert llm.llm_engine.prefix_cache.num_cached_blocks == 0  # the loaded blocks never became visible
    assert {p: p.read_bytes() for p in files(tmp_path)} == before
    assert tokens_of(llm) == first
    assert {p: p.read_bytes() for p in files(tmp_path)}.items() >= before.items()
    assert_no_leak(llm)


def test_kv_events_name_the_disk_medium(llama_dir, tmp_path):
    llm = make_llm(llama_dir, block_size=BS, kv_disk_dir=str(tmp_path), kv_disk_write="save",
                   kv_disk_size=3 * 2**-20, kv_events_config={"enable_kv_cache_events": True,
                                                               "publisher": "null"})
    batches = []
    llm.llm_engine.kv_events.subscribe(batches.append)
    tokens_of(llm)
    events = [e for b in batches for e in b.events]
    disk = {type(e) for e in events if getattr(e, "medium", None) == kv_disk.MEDIUM_DISK}
    assert disk == {BlockStored, BlockRemoved}
    assert any(isinstance(e, BlockStored) and e.medium == "GPU" for e in events)


def test_recompute_strategy_reads_the_tier_too(llama_dir, tmp_path):
    """The chapter's "before" column over the same tier: same tokens, blocks from disk."""
    first, _ = filled(llama_dir, tmp_path)
    llm = make_llm(llama_dir, block_size=BS, kv_disk_dir=str(tmp_path), hash_strategy="recompute")
    assert tokens_of(llm) == first and stats(llm)["kv_disk_hits"] == NUM_BLOCKS


def test_run_py_shows_one_restart(capsys):
    import run
    assert run.main(["--restart", "--no-progress", "--max-tokens", "4", "--num-requests", "2"]) == 0
    out = capsys.readouterr().out
    assert "tokens identical: True" in out and "blocks read from disk" in out


def test_a_waiting_request_reads_its_blocks_from_disk_once(llama_dir, tmp_path):
    first, _ = filled(llama_dir, tmp_path)
    other = random_prompt(30, seed=55)
    llm = make_llm(llama_dir, block_size=BS, num_kv_blocks=14, kv_disk_dir=str(tmp_path))
    outs = llm.generate([other, PROMPT], greedy(N), use_tqdm=False)  # PROMPT waits for blocks
    assert list(outs[1].outputs[0].token_ids) == first
    s = stats(llm)
    assert s["steps"] > N + 1  # it did wait: it was looked up on several steps
    assert s["kv_disk_hits"] == NUM_BLOCKS  # and read once


def test_an_interrupt_during_an_eviction_write_fails_only_that_step(llama_dir, tmp_path, monkeypatch):
    """Evict mode writes while the step plans: an interrupt there stops the step before its
    forward; the next step plans again, the evicted block's file is whole or absent."""
    other = random_prompt(40, seed=53)
    small = dict(block_size=BS, num_kv_blocks=11)
    cold = make_llm(llama_dir, **small)
    expected = [tokens_of(cold), tokens_of(cold, other)]
    llm = make_llm(llama_dir, kv_disk_dir=str(tmp_path), **small)
    assert tokens_of(llm) == expected[0]
    real, calls = os.fsync, []

    def fsync(fd):
        calls.append(fd)
        if len(calls) == 2:
            raise KeyboardInterrupt("during an eviction's write")
        return real(fd)

    monkeypatch.setattr(kv_disk.os, "fsync", fsync)
    with pytest.raises(KeyboardInterrupt):
        tokens_of(llm, other)
    assert tokens_of(llm, other) == expected[1]
    assert tokens_of(llm) == expected[0]
    assert_no_leak(llm)
    assert not list(Path(tmp_path).rglob("*.tmp"))
    for path in files(tmp_path):
        kv_disk._unpack(path.read_bytes())


def test_weights_written_unseen_then_reset_move_to_a_new_namespace(llama_dir, tmp_path):
    """``param.data`` writes are not seen by version counters; ``reset_prefix_cache()`` is the
    call that makes them seen -- by the tier's namespace too."""
    llm = make_llm(llama_dir, block_size=BS, kv_disk_dir=str(tmp_path), kv_disk_write="save")
    tokens_of(llm)
    old = tier_of(llm).namespace
    llm.llm_engine.model.norm.weight.data.mul_(1.5)
    llm.reset_prefix_cache()
    assert tier_of(llm).namespace != old
    tokens_of(llm)
    assert stats(llm)["kv_disk_hits"] == 0
