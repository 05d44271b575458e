"""The build-it-yourself track (track/): every step's checks pass on the reference (the
engine's own prefix_cache.py) and fail on the untouched skeleton, each on that step's own
methods, so the checks provably can fail; plausible mistakes fail the step they belong to,
with a message that names the scenario and what differed but never a hash of the answer; the
command works; the English and Chinese instructions name the same files, steps and commands."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import xxhash

import track
from prefix_cache import PrefixCache, PrefixMatch
from track import CHAPTER_METHODS, STEPS, TrackError, implementation, load_class
from track.checks import Chain, oracle, scenarios_of
from track.runner import run_step

ROOT = Path(__file__).resolve().parent.parent
NUMBERS = [s.number for s in STEPS]


def failures(results) -> list:
    return [r for r in results if not r.ok]


@pytest.mark.parametrize("number", NUMBERS)
def test_the_reference_passes_every_scenario(number):
    results = run_step(number, implementation(load_class("reference"), number))
    assert len(results) >= 4 and not failures(results), failures(results)


@pytest.mark.parametrize("only", [False, True], ids=["steps 1..N", "step N alone"])
@pytest.mark.parametrize("number", NUMBERS)
def test_the_skeleton_fails_every_scenario_on_its_own_step(number, only):
    """Alone, with the engine's code for every other step, each scenario of step N fails on
    step N's NotImplementedError; as the learner runs it (steps 1..N), every scenario fails."""
    results = run_step(number, implementation(load_class("skeleton"), number, only=only))
    assert results and all(not r.ok for r in results)
    if only:
        own = [r for r in results if r.problems[0].startswith(
            f"your code raised NotImplementedError: step {number}:")]
        assert own == results, [r.problems for r in results if r not in own]


def test_the_checks_are_not_vacuous():
    """The oracle's observations are the chapter's: the table's two columns, hits in a real
    generate, a collision really collides, the in-flight scenario really waits."""
    table = {s.name: oracle(s.script) for s in scenarios_of(4) + scenarios_of(5) if "table" in s.name}
    inc, rec = (table[f"the chapter's table, {c} column"] for c in ("incremental", "recompute"))
    rows = [f"row {r!r}: hash calls" for r in ("cold request", "of which at save", "same Sequence "
            "looked up again", "same prompt, new Sequence", "two copies in one step")]
    n = len(track.checks.prompt()) // track.checks.BLOCK
    assert [rec[r] for r in rows] == [2 * n, n, n, n, 4 * n]
    assert [inc[r] for r in rows] == [n, 0, 0, n, 2 * n]
    generated = oracle(track.checks.generate_incremental)
    assert generated["stats()['prefix_cache_hits']"] > 0
    assert oracle(track.checks.in_flight)["next_in_flight of the lookup"] is True
    collided = oracle(track.checks.collision)
    assert collided["cached tokens of the lookup"] == 0 and collided["hash calls of the lookup"] > 0


def test_the_life_of_a_sequence_is_checked_not_just_one_lookup():
    """The scenarios of track/lifecycle.py really preempt, re-admit the same Sequence with its chain
    filled, evict while it waits, free a twin's copy, and hit block multiples; and the one that
    says a request is computing a block has that request admitted and committed."""
    from track import collisions
    decode = oracle(next(s.script for s in scenarios_of(4) if "preempted during decode" in s.name))
    calls = decode["hash calls of each lookup of second"]
    assert decode["preemptions"] == 1 and len(calls) > 3 and calls[1] == 1 and not any(calls[2:])
    assert decode["cached tokens at each lookup of second"][1] > 0  # its own cached blocks, generated ones too
    mid = {s.name: oracle(s.script) for s in scenarios_of(5) if "middle of a chunked prefill" in s.name}
    evicting = next(v for k, v in mid.items() if "evicted while it waits" in k)
    assert evicting["preemptions"] == 1 and any("evicted" in why for why in evicting["why each lookup of long stopped"])
    assert evicting["cached tokens at each lookup of long"][-1] < max(evicting["cached tokens at each lookup of long"])
    for s in scenarios_of(4) + scenarios_of(5):
        if "freed copy" in s.name or "freed copies" in s.name:
            twin = oracle(s.script)
            assert twin["blocks that carry a hash"] == twin["cache entries"] == 32, s.name
            assert twin["evictions after the other request"] == 0
    at512 = oracle(next(s.script for s in scenarios_of(5) if "512 tokens (exactly" in s.name))
    assert at512["cold request: hash calls"] == 64 and at512["new Sequence: hash calls at save"] == 1
    for s in scenarios_of(4) + scenarios_of(5):
        if "commit's saves" in s.name:
            assert oracle(s.script)["hash_fn calls by the saves"] == 0 < oracle(s.script)["hash_fn calls in all"]
    waits = oracle(collisions.in_flight_behind_collision)
    assert waits["next_in_flight of d's lookup"] is True and "request 'c' is computing it" in waits["why d's lookup stopped"]


def test_a_check_never_builds_or_loads_the_kernels(tmp_path):
    """Steps 4 and 5 run a real generate on the plain path: fast/kernels.py is never imported, no
    extension is built (a fresh TORCH_EXTENSIONS_DIR stays empty), and the slow part is announced
    before it starts."""
    script = ("import sys\nfrom track.__main__ import main\nrc = main(['check', '4', '--impl', 'reference'])\n"
              "print('KERNELS LOADED:', 'fast.kernels' in sys.modules)\nsys.exit(rc)\n")
    extensions = tmp_path / "torch_extensions"
    extensions.mkdir()
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions)}
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout
    assert "KERNELS LOADED: False" in out and not any(extensions.iterdir())
    notice = out.index("... next: a real generate on the demo model (plain path, no compiled kernels)")
    assert notice < out.index("ok   a real generate on the demo model (incremental)")


# A learner's class that wrote every step as the reference did; each mistake below changes one
# method of it, and names the scenario it must fail (the others may pass).
Written = type("Written", (PrefixCache,), {m: vars(PrefixCache)[m] for m in CHAPTER_METHODS})


class Uncounted(Written):
    def _chain_hash(self, tokens, prev_hash, start, end):
        return self.hash_fn(tokens[start:end].tobytes(), prev_hash)


class WholeBuffer(Written):
    def _chain_hash(self, tokens, prev_hash, start, end):
        self.hash_computations += 1
        return self.hash_fn(tokens[start:].tobytes(), prev_hash)


class RehashEveryCall(Written):
    def _precompute_block_hashes(self, seq, source=None):
        seq._block_hashes.clear()
        super()._precompute_block_hashes(seq)


class NoVerify(Written):
    def _holds(self, block, seq, index, parents):
        return True


class LastTokenFromCache(Written):
    def _lookup_prefix_cache(self, seq):
        match = super()._lookup_prefix_cache(seq)
        nxt = len(match.blocks)
        if nxt < len(match.chain) and match.chain[nxt] in self._prefix_cache:
            match.blocks.append(self._prefix_cache[match.chain[nxt]])
            match.num_cached_tokens += self.block_size
        return match


class SnippetSave(Written):
    """The chapter's snippet read literally: only the chunk's end is a block boundary."""

    def _do_prefill_step(self, seq, start, end):
        if end % self.block_size:
            return []
        return super()._do_prefill_step(seq, end - self.block_size, end)


class RehashAtSave(Written):
    def _hash_for_save(self, seq, index, parent):
        prev = parent.block_hash if parent is not None else seq._root_hash
        return self._chain_hash(seq.token_view(), prev, index * self.block_size, (index + 1) * self.block_size)


class UnsaltedRebuild(Written):
    def _rebuild_chain(self, seq):
        root, seq._root_hash = seq._root_hash, 0
        try:
            return super()._rebuild_chain(seq)
        finally:
            seq._root_hash = root


def save(self, seq, index, block, parent, *, verify=True, pop="always", orphans=False,
         overwrite=False, salt=True, twin_by_tokens=False):
    """The reference's _save_prefix_cache with one of its rules switched off."""
    if block.block_hash is not None or (not orphans and parent is not None and parent.block_hash is None):
        return None
    h = self._hash_for_save(seq, index, parent)
    if pop == "always" or (pop == "own" and self._in_flight.get(h) is seq):
        self._in_flight.pop(h, None)
    existing, parents = self._prefix_cache.get(h), [parent] if parent else []
    if existing is None or (overwrite and not self._holds(existing, seq, index, parents)):
        if pop == "when saved":
            self._in_flight.pop(h, None)
        block.set_identity(h, seq.block_bytes(index, self.block_size),
                           parent.lifetime if parent else None, seq.cache_salt if salt else None)
        self._prefix_cache[h] = block
        return None
    if twin_by_tokens:
        return existing if existing.token_bytes == seq.block_bytes(index, self.block_size) else None
    return existing if not verify or self._holds(existing, seq, index, parents) else None


def saver(**rule_off):
    return lambda self, seq, index, block, parent: save(self, seq, index, block, parent, **rule_off)


class TwinUnverified(Written):  # W3: any block under the same hash is a twin
    _save_prefix_cache = saver(verify=False)


class InFlightKept(Written):  # W1: a saved block's hash stays in flight
    _save_prefix_cache = saver(pop="never")


class InFlightKeptOnCollision(Written):  # W1, half: only a block that got the entry leaves
    _save_prefix_cache = saver(pop="when saved")


class SavesOrphans(Written):  # W2: a block after an uncached parent is saved
    _save_prefix_cache = saver(orphans=True)


class CollisionTakesEntry(Written):
    _save_prefix_cache = saver(overwrite=True)


class SaltDropped(Written):
    _save_prefix_cache = saver(salt=False)


class TwinByTokens(Written):  # W3, half: a twin holds the tokens, whatever its parent and salt
    _save_prefix_cache = saver(twin_by_tokens=True)


class InFlightOwnMarkOnly(Written):  # W1, another half: only the saving sequence's own mark leaves
    _save_prefix_cache = saver(pop="own")


def prefill(self, seq, start, end, *, twin_parent=True, chunk_parent="own"):
    """The reference's _do_prefill_step with one of its rules switched off."""
    bs, blocks, twins = self.block_size, self.block_manager.blocks, []
    parent = blocks[seq.block_table[start // bs - 1]] if start >= bs and chunk_parent else None
    if chunk_parent == "after block 1" and start == bs:  # off by one: `start > bs`
        parent = None
    if chunk_parent == "the map's" and parent is not None and self.hash_strategy == "incremental":
        parent = self._prefix_cache.get(seq._block_hashes[start // bs - 1], parent)
    for index in range(start // bs, end // bs):
        block = blocks[seq.block_table[index]]
        twin = self._save_prefix_cache(seq, index, block, parent)
        if twin is not None:
            twins.append((index, twin))
        parent = twin or block if twin_parent else block
    return twins


class ParentIgnoresTwin(Written):
    def _do_prefill_step(self, seq, start, end):
        return prefill(self, seq, start, end, twin_parent=False)


class ParentNoneAtChunkStart(Written):
    def _do_prefill_step(self, seq, start, end):
        return prefill(self, seq, start, end, chunk_parent=False)


class ChunkParentOffByOne(Written):
    def _do_prefill_step(self, seq, start, end):
        return prefill(self, seq, start, end, chunk_parent="after block 1")


class ChunkParentFromTheMap(Written):  # the cached block under the parent's hash, not its own block
    def _do_prefill_step(self, seq, start, end):
        return prefill(self, seq, start, end, chunk_parent="the map's")


class PastedIncremental(Written):
    """The incremental branch pasted into the recompute one."""

    def _hash_for_save(self, seq, index, parent):
        if index >= len(seq._block_hashes):
            self._precompute_block_hashes(seq)
        return seq._block_hashes[index]


class QueriedLeftOut(Written):
    def _lookup_prefix_cache(self, seq):
        match = super()._lookup_prefix_cache(seq)
        return PrefixMatch(match.blocks, match.num_cached_tokens, match.chain, match.next_in_flight)


def lookup(self, seq, *, wait_at_last=False, wait_on_collision=True, verify="every hit",
           prompt_only=False):
    """The reference's _lookup_prefix_cache with one of its rules switched off."""
    chain = self._chain_for_lookup(seq)
    tokens = seq.num_prompt_tokens if prompt_only else seq.num_tokens
    max_blocks = min((tokens - 1) // self.block_size, len(chain))
    blocks, waits = [], wait_on_collision
    while len(blocks) < max_blocks:
        block, i = self._prefix_cache.get(chain[len(blocks)]), len(blocks)
        holds = {"every hit": lambda: self._holds(block, seq, i, blocks),
                 "block 0": lambda: i > 0 or self._holds(block, seq, i, blocks),
                 "tokens": lambda: block.token_bytes == seq.block_bytes(i, self.block_size)}[verify]
        if block is None or not holds():
            waits = waits or block is None
            break
        blocks.append(block)
    edge = len(chain) if wait_at_last else max_blocks
    in_flight = waits and len(blocks) < edge and self._is_in_flight(seq, len(blocks), chain)
    return PrefixMatch(blocks, len(blocks) * self.block_size, chain, in_flight, seq.num_tokens)


class QueriesThePromptOnly(Written):
    def _lookup_prefix_cache(self, seq):
        match = super()._lookup_prefix_cache(seq)
        match.queried = seq.num_prompt_tokens
        return match


class WaitsForTheLastBlock(Written):
    def _lookup_prefix_cache(self, seq):
        return lookup(self, seq, wait_at_last=True)


class NoWaitBehindACollision(Written):
    def _lookup_prefix_cache(self, seq):
        return lookup(self, seq, wait_on_collision=False)


class VerifiesBlock0Only(Written):
    def _lookup_prefix_cache(self, seq):
        return lookup(self, seq, verify="block 0")


class HitByTokens(Written):  # a hit holds the tokens, whatever its parent and salt
    def _lookup_prefix_cache(self, seq):
        return lookup(self, seq, verify="tokens")


class ServesThePromptOnly(Written):  # at most the prompt's blocks, never a generated one
    def _lookup_prefix_cache(self, seq):
        return lookup(self, seq, prompt_only=True)


class BackwardDeepestHit(Written):
    """Scans from the deepest block back and verifies only the first hit it meets."""

    def _lookup_prefix_cache(self, seq):
        chain = self._chain_for_lookup(seq)
        max_blocks = min((seq.num_tokens - 1) // self.block_size, len(chain))
        n = 0
        for i in reversed(range(max_blocks)):
            block, parent = self._prefix_cache.get(chain[i]), self._prefix_cache.get(chain[i - 1]) if i else None
            if block is not None and (i == 0 or parent is not None) and self._holds(
                    block, seq, i, [parent] if i else []):
                n = i + 1
                break
        in_flight = n < max_blocks and self._is_in_flight(seq, n, chain)
        return PrefixMatch([self._prefix_cache[h] for h in chain[:n]], n * self.block_size, chain,
                           in_flight, seq.num_tokens)


class RecomputeSeedZero(Written):
    """The "before" at save seeds block 0 with 0, not the chain's seed (the salt's hash)."""

    def _hash_for_save(self, seq, index, parent):
        if self.hash_strategy != "recompute":
            return PrefixCache._hash_for_save(self, seq, index, parent)
        prev, bs = parent.block_hash if parent is not None else 0, self.block_size
        return self._chain_hash(seq.token_view(), prev, index * bs, (index + 1) * bs)


WEAK = "weak hash_fn: "
MISTAKES = [
    (Uncounted, 1, "the chain of the 527-token prompt", "hash calls: yours 0, the engine's 32"),
    (WholeBuffer, 1, "one block, seed 0", "the block's hash: block 0's hash differs"),
    (RehashEveryCall, 2, "the same Sequence, precomputed twice", "hash calls of call 2: yours 32, the engine's 0"),
    (NoVerify, 3, "a hash that collides (hash_fn keeps 2 bits)", "the rule: a hit is a cached block that holds"),
    (LastTokenFromCache, 3, "a prompt of exactly 32 full blocks, seen before", "cached tokens of the lookup: yours 512"),
    (SnippetSave, 4, "a cold request, prefilled in 100-token chunks (boundaries inside chunks)",
     "the map: cached block ids"),
    (RehashAtSave, 4, "the chapter's table, incremental column", "row 'of which at save': hash calls: yours 32, the engine's 0"),
    (UnsaltedRebuild, 5, "_rebuild_chain of a Sequence with cache_salt 'alice' and generated tokens",
     "the chain: block 0's hash differs from the engine's (it is the first block)"),
    (TwinUnverified, 4, WEAK + "a collision at save: a cached block under the same hash holds other tokens",
     "the rule: a block cached under the same hash is a twin only if it holds these tokens"),
    (CollisionTakesEntry, 4, WEAK + "a collision at save: a cached block under the same hash holds other tokens",
     "the first block keeps the entry"),
    (InFlightKept, 4, WEAK + "in flight after a save: a lookup misses on a hash another request has saved",
     "next_in_flight of f's lookup: yours True, the engine's False"),
    (InFlightKeptOnCollision, 4, WEAK + "in flight after a save: a lookup misses on a hash another request "
     "has saved", "the rule: once a block's save is decided (saved, twin or collision) its hash is no longer"),
    (SavesOrphans, 4, WEAK + "a block after a private one (its parent collided, so is not cached)",
     "the rule: a block whose parent is not cached is not saved"),
    (SavesOrphans, 5, WEAK + "a block after a private one (its parent collided, so is not cached), under "
     "recompute", "hash_fn's seed must be an int (the parent block's hash), got None"),
    (ParentIgnoresTwin, 4, "a twin: the same prompt computed again without reading the cache",
     "the next block's parent is then the twin"),
    (ParentNoneAtChunkStart, 4, "a new Sequence after a prefill in 100-token chunks hits every full block",
     "the rule: a block saved at a chunk's start has the block before it as its parent"),
    (PastedIncremental, 5, "a prompt sharing the first 300 tokens of one seen before, under recompute",
     "the rule: the 'before' keeps no chain on the Sequence"),
    (SaltDropped, 4, "a salted prompt seen before, looked up with the same cache_salt",
     "the rule: a saved block records the request's cache_salt"),
    (QueriedLeftOut, 3, "a cold lookup", "tokens queried by the lookup: yours 0, the engine's 527"),
    (QueriesThePromptOnly, 3, "a Sequence with 21 generated tokens looked up again (as after a preemption)",
     "tokens queried by the lookup: yours 527, the engine's 548"),
    (WaitsForTheLastBlock, 3, "a prompt of exactly 32 full blocks while another request computes its last "
     "block", "the rule: only a block the lookup could serve is waited for"),
    (NoWaitBehindACollision, 3, WEAK + "a lookup misses on a collided entry while another request computes "
     "the block", "next_in_flight of d's lookup: yours False, the engine's True"),
    (RecomputeSeedZero, 5, "a salted prompt seen before, looked up with the same cache_salt, under recompute",
     "the rule: a saved block records the request's cache_salt"),
    (VerifiesBlock0Only, 3, WEAK + "block 0 seen before, block 1 collides (same hash, other tokens)",
     "the rule: every hit is verified with _holds, not only the first"),
    (BackwardDeepestHit, 3, WEAK + "block 0 collides (other tokens), block 1 holds the same tokens as before",
     "the rule: a prefix is served only if each of its blocks is a verified hit"),
    (HitByTokens, 3, WEAK + "the same tokens under another cache_salt whose root collides",
     "cached tokens of d's lookup: yours 32, the engine's 0"),
    (ServesThePromptOnly, 3, "a Sequence with 21 generated tokens looked up again, after a request with the "
     "same tokens", "cached tokens of the lookup: yours 512, the engine's 544"),
    (TwinByTokens, 4, WEAK + "the same tokens under another cache_salt whose root collides, computed without "
     "reading the cache", "the rule: a twin is a block _holds accepts"),
    (TwinByTokens, 5, WEAK + "the same tokens under another cache_salt whose root collides, computed without "
     "reading the cache, under recompute", "blocks of b's table that hold a's tokens: yours [0, 1], the engine's []"),
    (InFlightOwnMarkOnly, 4, WEAK + "in flight after another's save: a lookup misses on a hash one request marked "
     "and another saved", "next_in_flight of z's lookup: yours True, the engine's False"),
    (ChunkParentOffByOne, 4, "a new Sequence after a prefill in 16-token chunks (one block a step) hits every "
     "full block", "the rule: a block saved at a chunk's start has the block before it as its parent"),
    (ChunkParentOffByOne, 5, "under recompute: a new Sequence after a prefill in 16-token chunks hits every "
     "full block", "the rule: at a chunk's start the 'before' chains the block from its parent block's hash"),
    (ChunkParentFromTheMap, 4, WEAK + "a block after a private one, prefilled one block a step",
     "the rule: a chunk's first block has the sequence's own block before it as its parent"),
]


@pytest.mark.parametrize("cls, number, scenario, says", MISTAKES, ids=[m[0].__name__ for m in MISTAKES])
def test_a_mistake_fails_its_step_naming_the_scenario_not_the_answer(cls, number, scenario, says):
    results = {r.scenario: r for r in run_step(number, implementation(cls, number), with_model=False)}
    assert not results[scenario].ok
    message = results[scenario].message()
    assert says in message, message
    answers = oracle(next(s.script for s in scenarios_of(number) if s.name == scenario)).values()
    hashes = {h for v in answers if isinstance(v, Chain) for h in v if h > 2 ** 32}  # not the weak hash's 0..3
    assert not any(str(h) in message or f"{h:x}" in message for h in hashes), "a hash of the answer"


def test_a_class_that_inherits_a_step_is_refused():
    class Lazy(PrefixCache):  # defines nothing: every method would be the engine's
        pass
    with pytest.raises(TrackError, match="does not define _chain_hash"):
        implementation(Lazy, 1)


def test_start_copies_the_skeleton_and_reset_keeps_the_old_file(tmp_path, monkeypatch):
    mine = tmp_path / "my_prefix_cache.py"
    monkeypatch.setattr(track, "MINE", mine)
    monkeypatch.setattr(track, "HERE", tmp_path)
    track.start()
    assert mine.read_text() == track.SKELETON.read_text()
    mine.write_text("# my work\n")
    assert "already exists" in track.start() and mine.read_text() == "# my work\n"
    track.start(force=True)
    assert mine.read_text() == track.SKELETON.read_text()
    assert (tmp_path / "my_prefix_cache.py.bak").read_text() == "# my work\n"


def test_the_command_passes_the_reference_and_fails_the_skeleton(capsys):
    from track.__main__ import main
    good = subprocess.run([sys.executable, "-m", "track", "check", "2", "--impl", "reference"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert good.returncode == 0 and "step 2 passed" in good.stdout, good.stdout + good.stderr
    assert main(["check", "3", "--impl", "skeleton"]) == 1  # in this process: no second start
    bad = capsys.readouterr().out
    assert "FAIL a hash that collides (hash_fn keeps 2 bits)" in bad, bad
    assert "NotImplementedError: step 3" in bad and "the rule:" not in bad  # nothing written, no rule broken


def test_the_diff_is_the_chapters_change_cut_from_the_engines_code(capsys):
    from track.__main__ import main
    assert main(["diff"]) == 0
    diff = capsys.readouterr().out
    assert diff.startswith('--- the "before": hash_strategy="recompute"'), diff
    for line in ("-    return self._rebuild_chain(seq)", "+    self._precompute_block_hashes(seq)",
                 "+    return seq._block_hashes", "-def _rehash_block(", "+def _precompute_block_hashes("):
        assert line in diff, line
    assert 'if self.hash_strategy == "recompute"' not in diff  # each column alone


def test_pytest_runs_one_test_per_scenario_with_the_teaching_message():
    """``python -m pytest track`` on the skeleton: each scenario a test named by step and scenario,
    failing with the message ``python -m track check`` prints (the reference passes: above)."""
    bad = subprocess.run([sys.executable, "-m", "pytest", "track", "-k", "step2", "--impl", "skeleton",
                          "-n", "0", "-p", "no:cacheprovider", "-rf"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and f"{len(scenarios_of(2))} failed" in bad.stdout, bad.stdout + bad.stderr
    assert "test_scenario[step2: a cold Sequence of 527 tokens]" in bad.stdout
    assert "your code raised NotImplementedError: step 2: write _precompute_block_hashes" in bad.stdout


# ----------------------------------------------------------------------------- the instructions

README = {lang: (ROOT / "track" / name).read_text()
          for lang, name in (("en", "README.md"), ("zh", "README.zh-CN.md"))}
STEP_HEADING = {"en": re.compile(r"^### Step (\d+)", re.M), "zh": re.compile(r"^### 第 (\d+) 步", re.M)}


def named(text: str) -> dict:
    """What a README names: commands, files, chapter methods."""
    return {"commands": sorted(set(re.findall(r"python -m track[^`\n]*?(?=`|\s*$|\s{2,}#)", text, re.M))),
            "files": sorted(set(re.findall(r"[\w./-]+\.(?:py|md)\b", text)) - {"README.md", "README.zh-CN.md"}),
            "methods": sorted(set(re.findall(r"`(_[a-z_]+)", text)))}


def steps_of(lang: str) -> dict[int, list[str]]:
    """Step number -> the chapter methods its section names."""
    text, heads = README[lang], list(STEP_HEADING[lang].finditer(README[lang]))
    after_last = text.find("\n## ", heads[-1].start())  # the section after the steps, if any
    ends = [h.start() for h in heads[1:]] + [after_last if after_last != -1 else len(text)]
    return {int(h[1]): sorted(set(re.findall(r"`(_[a-z_]+)", text[h.start():end])))
            for h, end in zip(heads, ends)}


def test_both_readmes_name_the_same_files_steps_and_commands():
    assert named(README["en"]) == named(README["zh"])
    assert steps_of("en") == steps_of("zh")
    assert list(steps_of("en")) == NUMBERS
    for s in STEPS:
        assert set(s.methods) <= set(steps_of("en")[s.number]), s
        assert f"python -m track check {s.number}" in named(README["en"])["commands"]
    for path in named(README["en"])["files"]:
        if not path.endswith(("my_prefix_cache.py", ".bak")):
            assert (ROOT / path).exists() or (ROOT / "track" / path).exists(), path


def test_the_track_never_loads_the_fast_layer():
    """Step 4 (a real generate) in a fresh interpreter: no fast-layer module is imported, so no
    C++ kernel is built or loaded while a learner waits."""
    code = ("import sys\n"
            "from track.checks import real_generate\n"
            "from prefix_cache import PrefixCache\n"
            "real_generate(PrefixCache, 'incremental')\n"
            "assert not [m for m in sys.modules if m == 'fast' or m.startswith('fast.')], "
            "[m for m in sys.modules if m.startswith('fast')]\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
def test_the_track_readmes_claim_only_what_is_checked():
    """The number of wrong implementations the READMEs state is this file's list; neither promises
    that every wrong implementation fails, nor a check time that a step's real generate exceeds."""
    n = len({m[0] for m in MISTAKES})
    assert f"keeps {n} plausible wrong implementations" in " ".join(README["en"].split())
    assert f"列出的{n}种看似合理的错误实现" in "".join(README["zh"].split())
    assert "三十来种" not in README["zh"] and "2 到 5 秒" not in README["zh"]
    assert "about 2 s" not in README["en"] and "15 s" in README["en"] and "15 秒" in README["zh"]
