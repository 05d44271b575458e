"""Exercise 6: why did the lookup stop there?

Every lookup stops somewhere, and the engine says why: on the trace's "miss" event and in the
request's output, beside ``num_cached_tokens``, as ``cache_miss_reason`` (its ``.reason``). The
reasons, with the code to answer with:

    never-saved  no entry for the block's hash, and none ever left the map
    evicted      no entry for the block's hash: it left the map when its pool block was reused
    collision    an entry under the hash holds other tokens
    salt         no entry under the request's own cache_salt (blocks are shared per salt)
    partial      the tail after the served blocks is a partial block (never cached)
    last-token   the next block holds the last token, which is never served from cache
    in-flight    another running request is computing the next block (the request waits)

The demo prompt P has {prompt_len} tokens; block_size 16; a pool of {pool} blocks; each request
asks for one new token and finishes before the next is sent. In order:

(a) P's first 10 tokens;
(b) P;
(c) P again, as a new request;
(d) P's first 512 tokens;
(e) P with ``cache_salt="alice"``;
(f) {other} tokens of another text (it needs more blocks than are free), then P once more.

Predict:

1. why (a)'s lookup stops (a code);
2. why (c)'s lookup stops;
3. why (d)'s lookup stops;
4. why (e)'s lookup stops;
5. the block at which P's last lookup, in (f), stops (its index);
6. why it stops there.

See every reason of a run with ``python run.py --chain``, or on the step page.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine import LLM, SamplingParams
from exercises.common import DEMO_MODEL, GREEDY, demo_prompt
from prefix_cache import MissReason

TITLE = "Why did the lookup stop there?"
PROMPT_LEN = 527
POOL = 100
OTHER = 760
__doc__ = __doc__.format(prompt_len=PROMPT_LEN, pool=POOL, other=OTHER)
ASKS = ("(a) reason", "(c) reason", "(d) reason", "(e) reason", "(f) block", "(f) reason")
HINT = ("A block is cached only when full, and the block holding the last token is never served. "
        "When a request needs blocks and none is free, cached-and-free blocks are reused least "
        "recently used first; a finished request frees its blocks from its last one to its first.")
CODES = {MissReason.NEVER_SAVED: "never-saved", MissReason.EVICTED: "evicted", MissReason.COLLISION: "collision",
         MissReason.OTHER_PARENT: "other-parent", MissReason.OTHER_SALT: "salt",
         MissReason.PARTIAL_BLOCK: "partial", MissReason.LAST_TOKEN: "last-token",
         MissReason.IN_FLIGHT: "in-flight", MissReason.NOT_READ: "not-read", MissReason.CACHING_OFF: "off"}


@dataclass
class Stop:
    label: str
    cached_tokens: int
    reason: str  # the output's cache_miss_reason, as printed

    @property
    def code(self) -> str:
        return CODES[self.reason.reason]

    def line(self) -> str:
        return f"({self.label}) {self.cached_tokens:>3d} tokens from cache; the lookup stopped at {self.reason}"


def measure(model: str = str(DEMO_MODEL)) -> list[Stop]:
    llm = LLM(model, block_size=16, num_kv_blocks=POOL, max_num_seqs=1, device="cpu", dtype="float32",
              enforce_eager=True)
    params = SamplingParams(max_tokens=1, **GREEDY)
    p = demo_prompt(0)
    other = [3 + (7 * i) % 1900 for i in range(OTHER)]
    sent = [("a", p[:10], None), ("b", p, None), ("c", p, None), ("d", p[:512], None),
            ("e", p, "alice"), ("f: the other text", other, None), ("f", p, None)]
    stops = []
    for label, tokens, salt in sent:
        (out,) = llm.generate([dict(prompt_token_ids=tokens, cache_salt=salt) if salt else
                               dict(prompt_token_ids=tokens)], params, use_tqdm=False)
        stops.append(Stop(label, out.num_cached_tokens, out.cache_miss_reason))
    return stops


def answer(result: list[Stop]) -> list[str]:
    by = {s.label: s for s in result}
    return [by["a"].code, by["c"].code, by["d"].code, by["e"].code, str(by["f"].reason.block), by["f"].code]


def report(result: list[Stop]) -> list[str]:
    return [s.line() for s in result]


if __name__ == "__main__":
    print("\n".join(report(measure())))
