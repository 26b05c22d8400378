"""The pure core of PrfaaS: no Django, no Redis, no I/O beyond reading files it is given.

The routing decision (routing/), the throughput and queueing models, the planner and its
search, the rebalancer decision, the scenario reader and the simulator: frozen dataclasses in
and out, called alike by the server, the Celery tasks, the simulator and the fleet programs.
"""
