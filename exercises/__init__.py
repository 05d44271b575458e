"""Exercises for the chapter step14_5: run each with ``python -m exercises.<name>`` from the
repository root, predict its numbers first, then compare with the README's answers."""
