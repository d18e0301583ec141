"""The stress battery (issue 9): scenarios shared by tests/stress (CI size) and benchmarks/stress.py (full size)."""
