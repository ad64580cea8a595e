"""The suites of `benchmarks/bench.py`, one module each (``run()`` entry)."""
