"""bench.py: this engine side by side with Hugging Face transformers and vLLM's CPU build.

A thin entry point; the benchmark's parts live in ``benchmarks/`` (``benchmarks/cli.py`` reads
the command line). ``python bench.py --help`` lists the options.
"""
from benchmarks.cli import main, parse_args  # noqa: F401  (tests call both)


def cli() -> int:
    """The ``step14-bench`` command (pyproject.toml): ``main`` returns the findings, not a code."""
    main()
    return 0


if __name__ == "__main__":
    cli()
