"""bench.py: this engine side by side with Hugging Face transformers and vLLM's CPU build.

A thin entry point; the benchmark's parts live in ``benchmarks/`` (``benchmarks/cli.py`` reads
the command line). ``python bench.py --help`` lists the options.
"""
from benchmarks.cli import main, parse_args  # noqa: F401  (tests call both)

if __name__ == "__main__":
    main()
