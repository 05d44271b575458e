"""What happened at one engine step, and why, in words: the step page's narration.

Every sentence is derived from two snapshots (the engine before and after the step) and the
step's prefix-cache events; no text is written per step. One line per request that did
something (a lookup that hit, missed or waited; admitted, or left waiting for lack of room;
preempted; prefilled, decoded, saved blocks; finished), one for the pool (evictions), one for
the hash calls. A lookup's line says where it stopped and why (the "miss" event's reason). A step in which the only thing that happened is decode tokens is "decode only";
the page folds a run of such steps into one line (``decode_stretches``).

The scheduler's rules the sentences name (scheduler.py): a request is admitted only if the
blocks it needs beyond its cached prefix fit in the pool; it waits a step when the block it
needs next is in flight (another request computing it); admission stops at the first request
that cannot be admitted; when a decode token finds no free block the most recently admitted
running request is preempted: its blocks are freed (full ones stay cached) and it waits,
first in line, to be prefilled again (a re-prefill, which its lookup shortens).
"""
from __future__ import annotations

from collections import Counter


def span(indices: list[int]) -> str:
    """Block indices as ranges: [0, 1, 2, 5] -> '0-2, 5'."""
    parts, start = [], None
    for i, n in enumerate(indices):
        if start is None:
            start = n
        if i + 1 == len(indices) or indices[i + 1] != n + 1:
            parts.append(str(start) if start == n else f"{start}-{n}")
            start = None
    return ", ".join(parts)


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def blocks(ids: list[int]) -> str:
    """Pool block ids as the page writes them: 'pool block 3', 'pool blocks 3 4'."""
    return ("pool block " if len(ids) == 1 else "pool blocks ") + " ".join(map(str, ids))


def state_line(snap: dict) -> str:
    """The pool and the queues after the step, counted from the snapshot."""
    pool, states = snap["pool"], Counter(b["state"] for b in snap["pool"])
    shared = [b["id"] for b in pool if b["ref"] > 1]
    running = [s["id"] for s in snap["seqs"] if s["status"] == "running"]
    waiting = [s["id"] for s in snap["seqs"] if s["status"] == "waiting"]
    in_use = states["in use"] + states["in use, cached"]
    text = (f"After this step: {in_use} pool blocks in use, {states['cached']} cached-and-free, "
            f"{states['free']} free; ")
    text += (f"shared (ref count > 1): blocks {' '.join(map(str, shared))}. " if shared
             else "no block is shared (every ref count is 0 or 1). ")
    text += f"Requests running: {', '.join(running) or 'none'}; waiting: {', '.join(waiting) or 'none'}."
    return text


class StepStory:
    """The narration of one step: ``lines`` and whether it was ``decode_only``."""

    def __init__(self, before: dict | None, after: dict, block_size: int, max_num_seqs: int,
                 preempted_earlier: set[str]) -> None:
        self.before = {s["id"]: s for s in before["seqs"]} if before else {}
        self.after = {s["id"]: s for s in after["seqs"]}
        self.snap, self.bs, self.max_num_seqs = after, block_size, max_num_seqs
        self.preempted_earlier = preempted_earlier
        self.events: dict[str | None, list[dict]] = {}
        for e in after["events"]:
            self.events.setdefault(e["req"], []).append(e)
        self.lines: list[str] = []
        self.decode_only = False
        self._tell()

    # ------------------------------------------------------------------ per request

    def _requests(self) -> list[str]:
        """Every request this step touched: before, after, finished, or in an event."""
        ids = list(self.before) + list(self.after) + self.snap["finished"] + list(self.events)
        return list(dict.fromkeys(r for r in ids if r is not None))

    def _was_running(self, rid: str) -> bool:
        return rid in self.before and self.before[rid]["status"] == "running"

    def _is(self, rid: str, status: str) -> bool:
        return rid in self.after and self.after[rid]["status"] == status

    def _lookup(self, rid: str, events: list[dict]) -> str | None:
        kinds = [e["kind"] for e in events]
        if not {"hit", "miss", "wait"} & set(kinds):
            return None
        hits = [e for e in events if e["kind"] == "hit"]
        found = (f"its lookup hit {plural(len(hits), 'block')} ({len(hits) * self.bs} tokens; "
                 f"{blocks([e['block'] for e in hits])})" if hits else "its lookup found no cached block")
        wait = next((e for e in events if e["kind"] == "wait"), None)
        if wait is not None:
            computing = [e["req"] for e in self.snap["events"]
                         if e["kind"] == "save" and e["hash"] == wait["hash"] and e["req"] != rid]
            who = f"request {computing[0]} is computing it and saves it this step" if computing \
                else "another request is computing it"
            return (f"request {rid} waits: {found}, but block {wait['index']} ({wait['hash']}) is in "
                    f"flight ({who}); it is looked up again next step")
        if self._is(rid, "running") and not self._was_running(rid):
            again = "re-admitted after its preemption" if rid in self.preempted_earlier else "admitted"
            return f"request {rid} {again}: {found}" + self._first_miss(events)
        if self._is(rid, "waiting"):
            return f"request {rid} stays waiting, no room: {found}" + self._first_miss(events) + self._no_room(rid)
        return f"request {rid}: {found}" + self._first_miss(events)

    def _no_room(self, rid: str) -> str:
        """The admission's own numbers (``can_take`` as the scheduler called it)."""
        check = next((c for c in self.snap["room"] if c["req"] == rid and not c["admitted"]), None)
        if check is None:
            return ""
        cached = (f" and its {check['cached_free']} cached blocks, which have ref count 0 and so come out "
                  f"of the same free list" if check["cached_free"] else "")
        return (f", but it needs {plural(check['new'], 'new block')}{cached}: "
                f"{check['new'] + check['cached_free']} blocks, and only {check['free']} had ref count 0 "
                f"(hits of a request not admitted are not counted)")

    @staticmethod
    def _first_miss(events: list[dict]) -> str:
        """Why the lookup stopped where it did: the "miss" event's reason (prefix_cache.CacheMiss)."""
        miss = next((e for e in events if e["kind"] == "miss"), None)
        if miss is None:
            return ""
        return f"; it stops at {miss['reason']}"

    def _progress(self, rid: str) -> str | None:
        if not self._is(rid, "running"):
            return None
        seq = self.after[rid]
        start = self.before[rid]["computed"] if self._was_running(rid) else None
        if start is not None and seq["computed"] - start == 1 and start >= seq["prompt"]:
            return f"request {rid} decodes one token"
        if start is None:
            return f"request {rid} prefills: K/V for {seq['computed']} of its {seq['tokens']} tokens now in the pool"
        return f"request {rid} prefills tokens {start}-{seq['computed'] - 1} ({seq['computed']} of {seq['tokens']})"

    def _saves(self, rid: str, events: list[dict]) -> list[str]:
        lines = []
        saved = [e for e in events if e["kind"] == "save"]
        if saved:
            indices = [e["index"] for e in saved]
            lines.append(f"request {rid} saves {'block' if len(saved) == 1 else 'blocks'} {span(indices)} "
                         f"in the cache ({blocks([e['block'] for e in saved])})")
        for e in events:
            if e["kind"] == "twin":
                lines.append(f"request {rid}'s block {e['index']} ({e['hash']}) is already cached in pool "
                             f"block {e['block']}: it shares that block and frees its own copy")
        return lines

    def _preempted(self, rid: str) -> str:
        held = len(self.before[rid]["table"])
        return (f"request {rid} is preempted: a decode token found no free block, so the most recently "
                f"admitted running request gives back its {plural(held, 'block')} (full ones stay cached) "
                f"and waits, first in line, to be prefilled again (a re-prefill)")

    def _request_lines(self, rid: str) -> list[str]:
        events = self.events.get(rid, [])
        if self._was_running(rid) and self._is(rid, "waiting"):  # then looked up in the same step
            return [line for line in (self._preempted(rid), self._lookup(rid, events)) if line]
        lines = [self._lookup(rid, events), self._progress(rid)] + self._saves(rid, events)
        if rid in self.snap["finished"]:
            lines.append(f"request {rid} finishes: its blocks are released (full ones stay cached)")
        if rid not in self.before and self._is(rid, "waiting") and not events:
            lines.append(f"request {rid} arrives and waits in the queue (not looked up this step: "
                         f"{self._why_not_looked_up(rid)})")
        return [line for line in lines if line]

    def _why_not_looked_up(self, rid: str) -> str:
        running = [s for s in self.after.values() if s["status"] == "running"]
        if len(running) >= self.max_num_seqs:
            return f"{len(running)} requests running, the most allowed"
        return "admission stops at the first waiting request that cannot be admitted"

    # ------------------------------------------------------------------ the step

    def _hash_line(self) -> str | None:
        counts = Counter(e["kind"] for e in self.snap["events"])
        sources = Counter(e["source"] for e in self.snap["events"] if e["kind"] == "hash")
        parts = []
        if counts["hash"]:
            parts.append(f"{plural(counts['hash'], 'hash call')} ("
                         + ", ".join(f"{n} {s}" for s, n in sources.items()) + ")")
        if counts["reuse"]:
            parts.append(f"{counts['reuse']} {'hash' if counts['reuse'] == 1 else 'hashes'} read off the "
                         f"Sequence, no call")
        return "Hashing: " + "; ".join(parts) if parts else None

    def _pool_line(self) -> str | None:
        evicted = [e for e in self.events.get(None, []) if e["kind"] == "evict"]
        if not evicted:
            return None
        return (f"the pool evicts {plural(len(evicted), 'cached-and-free block')} "
                f"({blocks([e['block'] for e in evicted])}), reused for new tokens: out of the cache")

    def _tell(self) -> None:
        per_request = [line for rid in self._requests() for line in self._request_lines(rid)]
        decodes = [line for line in per_request if line.endswith("decodes one token")]
        self.decode_only = not self.snap["events"] and len(decodes) == len(per_request) > 0
        self.lines = per_request + [line for line in (self._pool_line(), self._hash_line()) if line]


def tell(snapshots: list[dict], block_size: int, max_num_seqs: int) -> list[dict]:
    """One engine's run, step by step: {"lines", "decode_only", "state"} per step."""
    stories, preempted, before = [], set(), None
    for snap in snapshots:
        story = StepStory(before, snap, block_size, max_num_seqs, set(preempted))
        preempted |= {rid for rid in story.before if story._was_running(rid) and story._is(rid, "waiting")}
        stories.append(dict(lines=story.lines, decode_only=story.decode_only, state=state_line(snap)))
        before = snap
    return stories


def decode_stretches(stories: list[dict]) -> list[list[int]]:
    """Runs of decode-only steps, as [first, last] step numbers (1-based), to fold into one line."""
    stretches: list[list[int]] = []
    for n, story in enumerate(stories, 1):
        if not story["decode_only"]:
            continue
        if stretches and stretches[-1][1] == n - 1:
            stretches[-1][1] = n
        else:
            stretches.append([n, n])
    return stretches
