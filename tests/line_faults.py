"""A Ctrl-C at any line of the engine's bookkeeping: ``LineFault`` counts the lines executed in
the engine's own files (``sys.settrace``) and sends the process SIGINT at the k-th, as a
Ctrl-C could arrive between any two lines (Python raises ``KeyboardInterrupt`` there, or, in
a section that holds interrupts, when the section ends); ``fingerprint`` is everything the
bookkeeping holds, as plain data, to check what a failed operation changed.

The model's forward (model.py, fast/) is not traced: an interrupt inside it changes no state
(test_faults.py injects those).
"""
from __future__ import annotations

import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRACED = ({str(ROOT / f) for f in ("scheduler.py", "block_manager.py", "prefix_cache.py", "engine.py")}
          | {str(p) for folder in ("core", "vllm_api") for p in (ROOT / folder).glob("*.py")})


class LineFault:
    """``with LineFault(k):`` raises KeyboardInterrupt at the k-th traced line (never, if k is
    None: then it only counts). ``lines`` records (file, line number) of every traced line."""

    def __init__(self, k: int | None = None) -> None:
        self.k, self.count, self.lines = k, 0, []

    def __enter__(self) -> LineFault:
        sys.settrace(self._call)
        return self

    def __exit__(self, *exc) -> None:
        sys.settrace(None)

    @property
    def fired(self) -> bool:
        return self.k is not None and self.count >= self.k

    def _call(self, frame, event, arg):
        return self._line if frame.f_code.co_filename in TRACED else None

    def _line(self, frame, event, arg):
        if event == "line" and not self.fired:
            self.count += 1
            self.lines.append((Path(frame.f_code.co_filename).name, frame.f_lineno))
            if self.fired:
                signal.raise_signal(signal.SIGINT)  # as a Ctrl-C: the handler decides when it lands
        return self._line


def first_occurrences(lines: list[tuple[str, int]]) -> list[int]:
    """1-based positions of the first time each distinct line ran."""
    seen, points = set(), []
    for k, line in enumerate(lines, 1):
        if line not in seen:
            seen.add(line)
            points.append(k)
    return points


def fingerprint(core, times: bool = True) -> dict:
    """The engine core's bookkeeping as plain data: queues, sequences, blocks and the free
    queue's order, the prefix cache's maps and counters, the request table and its records,
    the outputs waiting in sinks. ``times=False`` leaves out the clock readings (to compare
    two engines that ran the same operations)."""
    sched, bm, pc, op = core.scheduler, core.block_manager, core.prefix_cache, core.output_processor
    seqs = list(sched.running) + list(sched.waiting)
    return dict(
        running=[s.request_id for s in sched.running], waiting=[s.request_id for s in sched.waiting],
        seqs={s.request_id: _seq(s) for s in seqs}, stats=vars(sched.stats).copy(),
        blocks=[(b.ref_count, b.generation, b.block_hash, b.token_bytes, b.parent, b.salt,
                 b.in_free_queue) for b in bm.blocks],
        free_order=_free_order(bm), free_size=len(bm.free_queue),
        cache=None if pc is None else dict(
            entries={h: b.block_id for h, b in pc.entries.items()},
            in_flight={h: s.request_id for h, s in pc._in_flight.items()},
            computing={s.request_id: list(hs) for s, hs in pc._computing.items()},
            counters=(pc.hash_computations, pc.num_evictions)),
        requests={rid: _request(state, times) for rid, state in op.requests.items()},
        generation_tokens=op.generation_tokens, steps=core.steps,
        stream=[o.request_id for o in core.stream.outputs])


def _seq(s) -> tuple:
    return (s.num_tokens, s.tokens[:s.num_tokens].tolist(), s.num_computed_tokens,
            list(s.block_table), s.status, s.finish_reason, list(s._block_hashes))


def _request(state, times: bool) -> tuple:
    clock = (lambda t: t) if times else (lambda t: t is not None)
    per_seq = [(s.seq.num_tokens, clock(s.first_token_time), clock(s.finished_time), s.sent_tokens,
                s.sent_chars,
                None if s.detokenizer is None else (s.detokenizer.text, len(s.detokenizer.token_ids)),
                None if s.logprobs is None else len(s.logprobs), s.stop_reason, s.num_cached_tokens)
               for s in state.sequences]
    return (clock(state.arrival_time), per_seq, len(state.sink.outputs), state.sink.num_finished,
            None if state.prompt_logprobs is None else len(state.prompt_logprobs))


def _free_order(bm) -> list[int]:
    order, block = [], bm.free_queue.head
    while block is not None and len(order) <= len(bm.blocks):
        order.append(block.block_id)
        block = block.next
    return order
