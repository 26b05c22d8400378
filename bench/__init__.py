"""Benchmarks that measure, never gate (run each as a script in the activated venv: python bench/NAME.py)."""
