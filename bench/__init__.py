"""Benchmarks: how close collaborative training gets to the physical limit (figures, not pass/fail tests).

``make bench`` (``python -m bench``) measures every figure as a ratio of two sides timed back to back in one run,
writes docs/BENCHMARKS.md and prints one JSON object as its last line.
"""
