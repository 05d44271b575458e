"""``python -m track [start | reset | check N [--only] [--impl ...] | diff]``: see track/README.md."""
from __future__ import annotations

import argparse
import sys
import time

from track import IMPLS, STEPS, TrackError, implementation, load_class, start, step

USAGE = """\
python -m track start            copy the skeleton to track/my_prefix_cache.py (yours to write)
python -m track check N          check step N: your methods of steps 1..N, the engine's after
python -m track check N --only   check step N alone: the engine's code for every other step
python -m track reset            start over (your file is kept as track/my_prefix_cache.py.bak)
python -m pytest track           every step at once, one test per scenario (-k step3: step 3)
python -m track diff             the chapter's change as a diff against the "before" (an answer:
                                 run it after the track)"""


def print_steps() -> None:
    print("The build-it-yourself track: write the chapter's methods (track/README.md).\n")
    for s in STEPS:
        print(f"  step {s.number}: {s.title:28s} {', '.join(s.methods)}")
    print("\n" + USAGE)


def check(number: int, impl: str, only: bool) -> int:
    """Run step ``number``'s scenarios; print one line per scenario; 0 if all passed."""
    from track.runner import run_step  # the engine's modules: only when checking

    s = step(number)
    cls = implementation(load_class(impl), number, only)
    mine = f"step {number} alone" if only else ("step 1" if number == 1 else f"steps 1 to {number}")
    print(f"step {number}: {s.title} ({', '.join(s.methods)}); {impl}: {mine}, the engine's code "
          f"for the rest")
    begin = time.perf_counter()

    def show(r) -> None:
        print(f"  {'ok  ' if r.ok else 'FAIL'} {r.scenario}")
        for line in r.message().splitlines():
            print(f"         {line}")
        sys.stdout.flush()
    results = run_step(number, cls, on_result=show, on_slow=lambda what: print(f"  ... next: {what}", flush=True))
    failed = sum(not r.ok for r in results)
    verdict = "passed" if not failed else f"{failed} of {len(results)} scenarios failed"
    print(f"step {number} {verdict} ({time.perf_counter() - begin:.1f} s)")
    if not failed and number < len(STEPS):
        print(f"next: step {number + 1}, {step(number + 1).title}: python -m track check {number + 1}")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m track", description="Write the chapter step14_5 yourself.",
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=USAGE)
    sub = p.add_subparsers(dest="command")
    sub.add_parser("start", help="copy the skeleton to track/my_prefix_cache.py")
    sub.add_parser("reset", help="copy the skeleton again (your file kept as .bak)")
    sub.add_parser("diff", help="the chapter's change: the \"before\" against the chapter, as a diff")
    c = sub.add_parser("check", help="check one step")
    c.add_argument("number", type=int, help="the step, 1 to %d" % len(STEPS))
    c.add_argument("--only", action="store_true", help="your methods of this step alone")
    c.add_argument("--impl", choices=IMPLS, default="mine",
                   help="whose code: yours (default), the engine's own, the untouched skeleton")
    args = p.parse_args(argv)
    try:
        if args.command in ("start", "reset"):
            print(start(force=args.command == "reset"))
            return 0
        if args.command == "diff":
            from track.diff import chapter_diff
            print(chapter_diff())
            return 0
        if args.command == "check":
            import torch
            torch.set_num_threads(1)  # a small model on a shared CPU: one thread is fastest
            return check(args.number, args.impl, args.only)
    except TrackError as exc:
        print(exc)
        return 2
    print_steps()
    return 0


if __name__ == "__main__":
    sys.exit(main())
