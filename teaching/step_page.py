"""``python run.py --html FILE``: a page that plays a small run of the engine step by step.

The same workload runs on two engines, ``hash_strategy="recompute"`` (the chapter's "before",
Paged Prefix Cache) and ``"incremental"`` (step14_5). After every engine step a snapshot is
taken in Python from what the engine holds and recorded: the KV pool (each block's owners, ref
count, hash and state), every sequence (its block table and the chain of hashes it keeps), the
step's prefix-cache events (``PrefixCache.subscribe``) and the counters of ``llm.stats()``. The page (step_page.html,
inline script and style, nothing fetched) only draws those snapshots; it computes nothing.

The workload plays the chapter's scenes on a pool of 16 blocks of 4 tokens:

1. a cold request;
2. a second request sharing its prefix, sent while the first is still decoding;
3. two copies of one prompt sent together: the second waits a step for the blocks the first is
   computing (the in-flight rule), then hits;
4. a follow-up turn: the first conversation plus its answer, hitting blocks completed in decode;
5. two long requests that outgrow the pool: cached blocks are evicted and one request is
   preempted, then looked up again.

Each step is narrated (step_story.py): what happened and why, derived from the snapshots and
events; a run of decode-only steps is folded into one line.

Open the page with ``#step=N`` in its address to start at step N, ``#step=N&view=recompute``
to show the recompute engine's pool and chains.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from engine import LLM, SamplingParams
from prefix_cache import ChainEvent
from teaching import step_story

STRATEGIES = ("recompute", "incremental")
# enforce_eager: a teaching run never waits for the fast layer's compiler (fast/kernels.py).
PAGE_ENGINE = dict(block_size=4, num_kv_blocks=16, max_num_seqs=4, max_num_batched_tokens=64,
                   enforce_eager=True)
TEMPLATE = Path(__file__).with_name("step_page.html")
COUNTERS = ("hash_computations", "prefix_cache_hits", "evictions", "preemptions")
StepHook = Callable[[str, int, "Recorder"], None]  # (strategy, step number, recorder) after each step


def short(h: int | None) -> str:
    """The first 6 hex digits of a 64-bit hash ('' for none), as every view prints it."""
    return "" if h is None else f"{h:016x}"[:6]


# ----------------------------------------------------------------------------- snapshots

def pool_snapshot(llm: LLM) -> list[dict]:
    """Every block of the pool: id, ref count, state, short hash and the requests holding it."""
    owners: dict[int, list[str]] = {}
    for seq in llm.scheduler.running:
        for block_id in seq.block_table:
            owners.setdefault(block_id, []).append(seq.request_id)
    return [dict(id=b.block_id, ref=b.ref_count, state=b.state, hash=short(b.block_hash),
                 owners=owners.get(b.block_id, [])) for b in llm.block_manager.blocks]


def chain_snapshot(seq, block_size: int) -> list[dict]:
    """The chain the sequence keeps (``_block_hashes``): per block its tokens and hashes."""
    chain, parent = [], seq._root_hash
    for index, h in enumerate(seq._block_hashes):
        first, last = index * block_size, (index + 1) * block_size - 1
        chain.append(dict(index=index, tokens=f"{first}-{last}", generated=last >= seq.num_prompt_tokens,
                          hash=short(h), parent=short(parent)))
        parent = h
    return chain


def seq_snapshot(seq, status: str, block_size: int) -> dict:
    return dict(id=seq.request_id, status=status, prompt=seq.num_prompt_tokens, tokens=seq.num_tokens,
                computed=seq.num_computed_tokens, table=list(seq.block_table),
                chain=chain_snapshot(seq, block_size))


def event_snapshot(e: ChainEvent) -> dict:
    return dict(kind=e.kind, req=e.request_id, index=e.index, hash=short(e.block_hash),
                parent=short(e.parent_hash), block=e.block_id, source=e.source.value if e.source else "",
                reason=str(e.reason) if e.reason is not None else "")


@dataclass
class Snapshot:
    """What one engine holds after one step, as plain data for the page."""

    scene: str
    pool: list[dict]
    seqs: list[dict]
    events: list[dict]
    counters: dict
    finished: list[str]
    room: list[dict]  # the step's admission checks: request, blocks needed, blocks free, admitted?

    @classmethod
    def take(cls, llm: LLM, scene: str, events: list[ChainEvent], finished: list[str],
             hashes_before: int, room: list[dict]) -> "Snapshot":
        """``hashes_before``: the hash counter before this step (for the step's own calls)."""
        bs, sched = llm.block_size, llm.scheduler
        seqs = ([seq_snapshot(s, "running", bs) for s in sched.running]
                + [seq_snapshot(s, "waiting", bs) for s in sched.waiting])
        stats = llm.stats()
        counters = {k: stats[k] for k in COUNTERS}
        counters["hash_step"] = stats["hash_computations"] - hashes_before
        return cls(scene, pool_snapshot(llm), seqs, [event_snapshot(e) for e in events], counters, finished,
                   room)


# ----------------------------------------------------------------------------- the workload

@dataclass
class Scene:
    name: str
    caption: str


# A scene's caption says only what was sent (the workload, true at every step of the scene);
# what the engine did with it at a step is that step's story (step_story.py), told from the state.
SCENES = {
    "cold": Scene("1. cold request", "Request 0 (19 tokens: 4 full blocks and 3 more) is sent to an "
                  "empty cache."),
    "shared": Scene("2. shared prefix", "Request 1 is sent with request 0's first 16 tokens (4 blocks) "
                    "and 5 of its own, while request 0 is still decoding."),
    "copies": Scene("3. two copies at once", "Requests 2 and 3 are sent together with the same "
                    "18-token prompt."),
    "follow-up": Scene("4. follow-up turn", "Request 4 is request 0's whole conversation (its prompt "
                       "and answer) plus 3 new tokens."),
    "pressure": Scene("5. preemption and eviction", "Requests 5 and 6 are sent together: 24 tokens each, 12 "
                      "to generate, so each needs 9 blocks when done, 18 in all, in a pool of 16."),
}


@dataclass
class Recorder:
    """Steps one engine through the workload and snapshots it after every step."""

    llm: LLM
    strategy: str
    on_step: StepHook | None = None
    snapshots: list[Snapshot] = field(default_factory=list)
    outputs: dict[str, list[int]] = field(default_factory=dict)
    events: list[ChainEvent] = field(default_factory=list)

    room: list[dict] = field(default_factory=list)
    last_looked_up: str | None = None  # the request of the latest lookup (its hit or miss)

    def __post_init__(self) -> None:
        self.llm.prefix_cache.subscribe(self._note)  # for the engine's whole run
        self._watch_admissions()

    def _note(self, event: ChainEvent) -> None:
        self.events.append(event)
        if event.kind in ("hit", "miss"):
            self.last_looked_up = event.request_id

    def _watch_admissions(self) -> None:
        """Note each admission's room check as the scheduler makes it (its plan's
        ``Reservation.can_take``, right after the request's lookup), so the story says why a
        request stayed waiting with the numbers the engine decided on, not the pool as it is
        after the step."""
        scheduler = self.llm.scheduler
        plan_admission = scheduler._plan_admission

        def noted(seq, reservation):
            check = reservation.can_take

            def can_take(num_fresh, shared):
                admitted = check(num_fresh, shared)
                self.room.append(dict(req=self.last_looked_up, new=num_fresh,
                                      cached_free=sum(b.ref_count == 0 and b.block_id not in reservation.held
                                                      for b in shared),
                                      free=reservation.num_free, admitted=admitted))
                return admitted
            reservation.can_take = can_take  # this plan only: a probe, the decision is unchanged
            try:
                return plan_admission(seq, reservation)
            finally:
                del reservation.can_take
        scheduler._plan_admission = noted  # this engine only

    def submit(self, prompt: list[int], max_tokens: int) -> str:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        return self.llm.add_request(prompt, params)

    def step(self, scene: str) -> None:
        events, self.room = self.events, []
        start, hashes_before = len(events), self.llm.stats()["hash_computations"]
        finished = []
        for out in self.llm.step():
            self.outputs[out.request_id] = list(out.prompt_token_ids) + list(out.token_ids)
            finished.append(out.request_id)
        self.snapshots.append(Snapshot.take(self.llm, scene, events[start:], finished, hashes_before, self.room))
        if self.on_step:
            self.on_step(self.strategy, len(self.snapshots), self)

    def until_idle(self, scene: str) -> None:
        while self.llm.has_unfinished_requests():
            self.step(scene)


def workload_tokens(llm: LLM, model_dir: str, seed: int = 0) -> np.ndarray:
    """120 token ids to cut prompts from: the demo model's first prompt, else seeded random ids."""
    spec = Path(model_dir) / "prompts.json"
    if spec.is_file():
        ids = json.loads(spec.read_text())["prompts"][0]["prompt_ids"]
        if len(ids) >= 120:
            return np.asarray(ids[:120])
    return np.random.default_rng(seed).integers(3, llm.model_config.vocab_size, 120)


def play(rec: Recorder, tokens: np.ndarray) -> None:
    """The five scenes, in order; each starts when the previous one has finished."""
    t = tokens.tolist()
    first = rec.submit(t[:19], 6)                     # 4 full blocks + 3 tokens
    rec.step("cold")
    rec.submit(t[:16] + t[40:45], 4)                  # the same 16-token prefix
    rec.until_idle("shared")
    rec.submit(t[60:78], 6)
    rec.submit(t[60:78], 6)
    rec.until_idle("copies")
    rec.submit(rec.outputs[first] + t[100:103], 4)
    rec.until_idle("follow-up")
    rec.submit(t[20:44], 12)                          # 6 blocks each, 9 when done: 18 > 16
    rec.submit(t[78:102], 12)
    rec.until_idle("pressure")


def record(model: str, engine_kw: dict | None = None, on_step: StepHook | None = None) -> dict:
    """Run the workload under both strategies; the page's data (both engines, step by step)."""
    runs = {}
    for strategy in STRATEGIES:
        llm = LLM(model, **(engine_kw or {}), **PAGE_ENGINE, hash_strategy=strategy)
        rec = Recorder(llm, strategy, on_step)
        play(rec, workload_tokens(llm, model))
        runs[strategy] = rec.snapshots
    check_same_schedule(runs)
    return page_data(runs, model)


def check_same_schedule(runs: dict[str, list[Snapshot]]) -> None:
    """The strategies differ in hashing only: same steps, same block tables, same pool use."""
    a, b = (runs[s] for s in STRATEGIES)
    if len(a) != len(b):
        raise RuntimeError(f"recompute took {len(a)} steps, incremental {len(b)}")
    for n, (x, y) in enumerate(zip(a, b), 1):
        if [(s["id"], s["table"]) for s in x.seqs] != [(s["id"], s["table"]) for s in y.seqs]:
            raise RuntimeError(f"step {n}: the strategies' block tables differ")


def page_data(runs: dict[str, list[Snapshot]], model: str) -> dict:
    """The page's data: per step and strategy the snapshot and its story (what happened, why)."""
    steps = [{s: dict(vars(runs[s][n])) for s in STRATEGIES} for n in range(len(runs[STRATEGIES[0]]))]
    stretches = {}
    for s in STRATEGIES:
        stories = step_story.tell([step[s] for step in steps], PAGE_ENGINE["block_size"],
                                  PAGE_ENGINE["max_num_seqs"])
        for step, story in zip(steps, stories):
            step[s]["story"] = story
        stretches[s] = [dict(first=a, last=b, line=stretch_line(steps, s, a, b))
                        for a, b in step_story.decode_stretches(stories)]
    scenes = {key: vars(scene) for key, scene in SCENES.items()}
    return dict(model=Path(model).name, engine=PAGE_ENGINE, strategies=STRATEGIES,
                scenes=scenes, steps=steps, stretches=stretches)


def stretch_line(steps: list[dict], strategy: str, first: int, last: int) -> str:
    """One line for a run of decode-only steps: who decoded, and that nothing else happened."""
    decoding = sorted({line.split()[1] for step in steps[first - 1:last]
                       for line in step[strategy]["story"]["lines"]}, key=int)
    who = (f"request {decoding[0]} decodes" if len(decoding) == 1
           else f"requests {', '.join(decoding)} each decode")
    steps_text = f"step {first}" if first == last else f"steps {first}-{last}"
    return f"{steps_text}: decode only: {who} one token per step; no lookup, save, eviction or hash call"


# ----------------------------------------------------------------------------- the page

def render(data: dict) -> str:
    """The page: the template with the snapshots inlined as JSON (``</`` escaped for <script>)."""
    payload = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")
    return TEMPLATE.read_text().replace("/*DATA*/null", payload)


def write_page(path: Path, model: str, engine_kw: dict | None = None) -> dict:
    data = record(model, engine_kw)
    path.write_text(render(data), encoding="utf-8")
    return data


def busiest_step(data: dict) -> int:
    """The step whose events have the most kinds (a good one to show first)."""
    kinds = [len({e["kind"] for e in step["incremental"]["events"]}) for step in data["steps"]]
    return 1 + kinds.index(max(kinds))


def find_chromium() -> str | None:
    """A Chromium on PATH (only PATH is searched, so a test can hide the browser), or None."""
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def screenshot(page: Path, png: Path, step: int, size: tuple[int, int] = (1400, 1000)) -> None:
    """Draw ``page`` at ``#step=step`` in headless Chromium and save it as ``png``."""
    browser = find_chromium()
    if browser is None:
        raise RuntimeError("no chromium found (Debian: apt-get install chromium)")
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                        f"--user-data-dir={profile}", f"--window-size={size[0]},{size[1]}",
                        f"--screenshot={png.resolve()}", f"{page.resolve().as_uri()}#step={step}"],
                       check=True, capture_output=True, timeout=60)
