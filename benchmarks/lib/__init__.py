"""Helpers shared by the benchmark suites (timing, cases, results, programs)."""
