"""Fake vLLM engines for tests, benches and the demo (see :mod:`fleet.fake_engine.app`)."""
