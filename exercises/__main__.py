"""``python -m exercises [N] [--answer ...] [--run] [--hint]``: see exercises/__init__.py."""
from __future__ import annotations

import argparse
import sys
import textwrap

from exercises import MODULES, exercise, text_of
from exercises.checker import check


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m exercises",
                                description="Predict, then check: exercises on the chapter step14_5.")
    p.add_argument("number", type=int, nargs="?", choices=sorted(MODULES), help="the exercise")
    p.add_argument("--answer", nargs="+", metavar="VALUE", help="your prediction, values in order")
    p.add_argument("--hint", action="store_true", help="a nudge that does not give the answer")
    p.add_argument("--run", action="store_true", help="run the experiment (prints the answer)")
    args = p.parse_args(argv)
    if args.number is None:
        for number in sorted(MODULES):
            print(f"  {number}. {text_of(number).TITLE}")
        print("\npython -m exercises N               the setup and what to predict\n"
              "python -m exercises N --answer ...  check your prediction\n"
              "python -m exercises N --hint        a nudge\n"
              "python -m exercises N --run         run it (shows the answer)")
        return 0
    ex = text_of(args.number)  # the engine (and torch) is imported for --run only
    if args.answer:
        right, message = check(args.number, args.answer, ex.ASKS)
        print(textwrap.fill(message, 96))
        return 0 if right else 1
    if args.hint:
        print(textwrap.fill("Hint: " + ex.HINT, 96))
        return 0
    if args.run:
        import torch
        torch.set_num_threads(1)  # a small model: one thread is fastest on a shared CPU
        ex = exercise(args.number)
        print("\n".join(ex.report(ex.measure())))
        return 0
    print(ex.__doc__.strip())
    values = " ".join(f"V{i}" for i in range(1, len(ex.ASKS) + 1))
    print(f"\nCheck your prediction (one value per numbered item, in order):\n"
          f"  python -m exercises {args.number} --answer {values}")
    print(f"A hint: python -m exercises {args.number} --hint")
    return 0


if __name__ == "__main__":
    sys.exit(main())
