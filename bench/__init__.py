"""Benchmarks that measure, never gate (run each as a script: .venv/bin/python bench/NAME.py)."""
