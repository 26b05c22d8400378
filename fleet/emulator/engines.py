"""The emulated engines: the simulator's fleet model built from the control plane's topology,
and what one engine's agent would read from it (its load sample, its prefix cache).

The engines are the simulator's (:class:`scheduling.core.simulator.engine.Simulation`: FCFS
prefill queues, the fluid cross-datacenter link, batched decode, hybrid prefix caches). Every
instance has a prefill and, in a PD cluster, a decode personality; the one not in its role is
``OFF``, so a role flip drains one and wakes the other.
"""

from __future__ import annotations

from typing import Any, cast

from fleet.agent.register import RegistrationConfig
from fleet.emulator.journal import ReportingPrefixCache
from fleet.emulator.workload import RequestStream
from scheduling.core import routing
from scheduling.core.kinds import InstanceRole, KvConnector
from scheduling.core.prefix_cache import HybridPrefixCache
from scheduling.core.scenario import Scenario
from scheduling.core.simulator.engine import OFF, Simulation
from scheduling.core.simulator.fleet import ACTIVE, DOWN, DecodeInstance, PrefillInstance
from scheduling.core.simulator.link import FluidLink
from scheduling.core.simulator.workload import Workload

GIB = float(1 << 30)
ENGINE = "emulated"


def engines_to_register(
    scenario: Scenario, topology: routing.Topology
) -> list[tuple[str, RegistrationConfig]]:
    """The engines the emulator runs, as its agents register them: the scenario's instances
    (named as topology as code names them) of every cluster the control plane knows, and the
    inventory's other instances. An engine the inventory already holds comes up in the role
    the control plane last gave it (a restarted emulator keeps the rebalancer's flips)."""
    clusters = {c.name: c for c in topology.clusters}
    known = {i.name: i for i in topology.instances}
    wanted: dict[str, tuple[str, str]] = {}
    for spec in scenario.clusters:
        if spec.name in clusters:
            for name, role in spec.instance_roles().items():
                wanted[name] = (spec.name, role)
    for member in topology.instances:
        wanted[member.name] = (member.cluster, member.role)
    out = []
    for name, (cluster, role) in sorted(wanted.items()):
        spec_of = clusters.get(cluster)
        if spec_of is None:
            continue
        inst = known.get(name)
        out.append(
            (
                name,
                RegistrationConfig(
                    cluster=cluster,
                    role=InstanceRole(inst.role if inst is not None else role),
                    accelerator=spec_of.accelerator,
                    kv_connector=cast(KvConnector, spec_of.kv_connector),
                    engine=ENGINE,
                ),
            )
        )
    return out


def fleet_build(
    topology: routing.Topology,
    scenario: Scenario,
    workload: Workload,
    stream: RequestStream,
    dispatcher: Any,
) -> Simulation:
    """The simulated fleet of ``topology``'s instances, caches sized by the scenario's
    ``caches`` (journaling ones when the workload carries block hashes)."""
    topo = topology
    block = topo.model.block_tokens
    has_blocks = any(r.hash_ids is not None for r in workload.requests)
    longest = max((r.input_tokens for r in workload.requests), default=0)
    max_blocks = longest // block + 1
    block_bytes = [
        float(topo.prefix_bytes((i + 1) * block) - topo.prefix_bytes(i * block))
        for i in range(max_blocks)
    ]
    prefill: list[PrefillInstance] = []
    decode: list[DecodeInstance] = []
    for cluster in topo.clusters:
        spec = scenario.caches.get(cluster.name)
        gib = spec.gib_per_instance if spec is not None else 0.0

        def seconds(tokens: float, name: str = cluster.name) -> float:
            return topo.prefill_seconds(name, tokens)

        members = sorted(
            (i for i in topo.instances if i.cluster == cluster.name), key=lambda i: i.name
        )
        for inst in members:
            cache = (
                ReportingPrefixCache(gib * GIB, block_bytes, topo.linear_state_bytes)
                if has_blocks and gib > 0
                else None
            )
            state = DOWN if inst.state == DOWN else ACTIVE
            is_prefill = inst.role == "prefill"
            prefill.append(
                PrefillInstance(
                    inst.name,
                    cluster.name,
                    cluster.kind,
                    seconds,
                    cache,
                    state=state if is_prefill else OFF,
                )
            )
            if cluster.kind == "pd" and cluster.decode is not None:
                decode.append(
                    DecodeInstance(
                        inst.name,
                        cluster.name,
                        cluster.decode.max_batch,
                        cluster.decode.step_seconds,
                        cache,
                        state=OFF if is_prefill else state,
                    )
                )
    links = {link.key: _fluid_link(link) for link in topo.links}
    return Simulation(
        requests=stream,
        prefill_instances=prefill,
        decode_instances=decode,
        links=links,
        dispatcher=dispatcher,
        block_tokens=block,
        sample_s=0.0,
    )


def sim_role(sim: Simulation, name: str) -> str:
    """The role an instance serves in the simulation now."""
    prefill = sim.prefill_by_name.get(name)
    if prefill is not None and prefill.state != OFF:
        return "prefill"
    return "decode"


def sim_state(sim: Simulation, name: str) -> str:
    """The state of the personality an instance serves with (``OFF`` when neither)."""
    prefill = sim.prefill_by_name.get(name)
    decode = sim.decode_by_name.get(name)
    for personality in (prefill, decode):
        if personality is not None and personality.state != OFF:
            return personality.state
    return OFF


def prefill_peer(sim: Simulation, cluster: str, origin: str) -> PrefillInstance | None:
    """The least backlogged active prefill instance of ``cluster``, else of ``origin``."""
    for wanted in (cluster, origin):
        peers = [p for p in sim.prefill_instances if p.cluster == wanted and p.state == ACTIVE]
        if peers:
            return min(peers, key=lambda p: (p.backlog_s(sim.now), p.name))
    return None


def decode_peer(sim: Simulation, cluster: str) -> DecodeInstance | None:
    """The least loaded active decode instance of ``cluster``."""
    peers = [d for d in sim.decode_instances if d.cluster == cluster and d.state == ACTIVE]
    return min(peers, key=lambda d: (d.load(), d.name)) if peers else None


def instance_sample(sim: Simulation, name: str, wall: float) -> dict[str, Any] | None:
    """The telemetry row an engine's agent would post for ``name`` now (None when down: its
    agent is silent)."""
    prefill = sim.prefill_by_name.get(name)
    decode = sim.decode_by_name.get(name)
    if prefill is not None and prefill.state not in (OFF, DOWN):
        tokens = sum(r.incremental_tokens for r in prefill.queue)
        current = prefill.current
        if current is not None and current.service_s > 0:
            left = max(0.0, prefill.busy_until - sim.now) / current.service_s
            tokens += round(current.incremental_tokens * left)
        cache = prefill.cache
        return {
            "instance": name,
            "ts": wall,
            "queue_depth": prefill.depth(),
            "running": 0,
            "waiting": 0,
            "kv_usage": _usage(cache),
            "queued_prefill_tokens": tokens,
        }
    if decode is not None and decode.state not in (OFF, DOWN):
        return {
            "instance": name,
            "ts": wall,
            "queue_depth": 0,
            "running": decode.running,
            "waiting": len(decode.waiting),
            "kv_usage": min(1.0, decode.running / decode.max_batch) if decode.max_batch else 0,
        }
    return None


def caches(sim: Simulation) -> dict[str, ReportingPrefixCache]:
    """The journaling prefix caches by instance name."""
    out: dict[str, ReportingPrefixCache] = {}
    instances: list[PrefillInstance | DecodeInstance] = [
        *sim.prefill_instances,
        *sim.decode_instances,
    ]
    for instance in instances:
        if isinstance(instance.cache, ReportingPrefixCache):
            out[instance.name] = instance.cache
    return out


def _fluid_link(link: routing.Link) -> FluidLink:
    return FluidLink(link.source, link.target, link.gbps * 1e9 / 8, link.rtt_ms / 1000.0)


def _usage(cache: HybridPrefixCache | None) -> float:
    if cache is None or cache.capacity_bytes <= 0:
        return 0.0
    return min(1.0, cache.used_bytes / cache.capacity_bytes)
