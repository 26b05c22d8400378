"""Reusable bench pieces: the load generator, fake PD workers, sglang-router in its own venv."""
