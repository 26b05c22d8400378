"""Discrete-event simulator of a PrfaaS deployment (pure Python: no Django).

Replays a scenario's Poisson workload or a real trace through the project's own router
(:func:`scheduling.core.routing.route_decide`) and planner, over a simulated fleet: FCFS prefill
queues, continuous-batching decode, a fluid cross-datacenter link with layer-wise pipelining,
and hybrid prefix caches. Entry points: :func:`simulate`, :func:`capacity_search`.
"""

from scheduling.core.simulator.run import SimulationConfig, SimulationResult, simulate

__all__ = ["SimulationConfig", "SimulationResult", "simulate"]
