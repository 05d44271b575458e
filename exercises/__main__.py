"""``python -m exercises [N] [--answer ...] [--run] [--hint] [--lang en|zh]``: see exercises/__init__.py."""
from __future__ import annotations

import argparse
import os
import sys
import textwrap

from exercises import MODULES, exercise, text_of
from exercises.checker import check


def language(chosen: str | None) -> str:
    """--lang if given; else "zh" when LC_ALL (or, if it is unset, LANG) starts with zh; else "en"."""
    if chosen:
        return chosen
    locale = os.environ.get("LC_ALL") or os.environ.get("LANG") or ""
    return "zh" if locale.lower().startswith("zh") else "en"


ENGLISH_USAGE = ("\npython -m exercises N               the setup and what to predict\n"
                 "python -m exercises N --answer ...  check your prediction\n"
                 "python -m exercises N --hint        a nudge\n"
                 "python -m exercises N --run         run it (shows the answer)\n"
                 "python -m exercises N --lang zh     in Chinese (中文)")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m exercises",
                                description="Predict, then check: exercises on the chapter step14_5.")
    p.add_argument("number", type=int, nargs="?", choices=sorted(MODULES), help="the exercise")
    p.add_argument("--answer", nargs="+", metavar="VALUE", help="your prediction, values in order")
    p.add_argument("--hint", action="store_true", help="a nudge that does not give the answer")
    p.add_argument("--run", action="store_true", help="run the experiment (prints the answer)")
    p.add_argument("--lang", choices=("en", "zh"),
                   help="en or zh (中文): the list, question, hint and feedback; default zh when "
                        "LC_ALL or LANG starts with zh, else en. --run's report stays English")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    lang = language(args.lang)
    if lang == "zh":
        from exercises import zh
        fill, messages = zh.fill, zh.MESSAGES
    else:
        fill, messages = (lambda text: textwrap.fill(text, 96)), None
    if args.number is None:
        for number in sorted(MODULES):
            print(f"  {number}. {text_of(number, lang).TITLE}")
        print(messages["usage"] if messages else ENGLISH_USAGE)
        return 0
    ex = text_of(args.number, lang)  # the engine (and torch) is imported for --run only
    if args.answer:
        right, message = check(args.number, args.answer, ex.ASKS, lang)
        print(fill(message))
        return 0 if right else 1
    if args.hint:
        print(fill(messages["hint"].format(hint=ex.HINT) if messages else "Hint: " + ex.HINT))
        return 0
    if args.run:
        return run_experiment(args.number, messages)
    print_question(args.number, ex, messages)
    return 0


def run_experiment(number: int, messages: dict | None) -> int:
    if messages:
        print(messages["run"])
    import torch
    torch.set_num_threads(1)  # a small model: one thread is fastest on a shared CPU
    ex = exercise(number)
    print("\n".join(ex.report(ex.measure())))
    return 0


def print_question(number: int, ex, messages: dict | None) -> None:
    print(ex.__doc__.strip())
    values = " ".join(f"V{i}" for i in range(1, len(ex.ASKS) + 1))
    if messages:
        print(messages["check"].format(number=number, values=values))
        return
    print(f"\nCheck your prediction (one value per numbered item, in order):\n"
          f"  python -m exercises {number} --answer {values}")
    print(f"A hint: python -m exercises {number} --hint")


if __name__ == "__main__":
    sys.exit(main())
