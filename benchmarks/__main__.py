"""``python -m benchmarks``: the same as ``python bench.py``."""
from benchmarks.cli import main

main()
