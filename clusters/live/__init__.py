"""Live cluster state kept in Redis: telemetry, the global prefix index.

Each store is one module with its key layout documented at its top. Stores expose two kinds of
functions: whole operations (sync and async) for the telemetry path, and ``*_queue`` /
``*_parse`` pairs that add commands to a caller's pipeline, so the request path can read
several stores in one round trip.
"""
