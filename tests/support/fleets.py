"""Small real fleets in the database, built with the factories, for tests that route against
them: one PD cluster of H20s beside one PrfaaS cluster of H200s, linked."""

from __future__ import annotations

from clusters.models import Cluster, InstanceRole
from tests.factories import (
    AcceleratorFactory,
    ClusterFactory,
    InstanceFactory,
    LinkFactory,
    ModelProfileFactory,
    PerformanceProfileFactory,
    PrfaasClusterFactory,
)

BLOCK_TOKENS = 512
LINK_GBPS = 100.0


def pd_prfaas_fleet(
    pd_name: str,
    prfaas_name: str,
    h20_prefill_seconds: list[list[float]],
    kv_budget_bytes: int | None = None,
    block_tokens: int = BLOCK_TOKENS,
    h200_prefill_seconds: list[list[float]] | None = None,
    instances: bool = True,
) -> tuple[Cluster, Cluster]:
    """``pd_name`` (H20: 2 prefill, 2 decode) <- 100 Gbps, 10 ms <- ``prfaas_name`` (H200:
    2 prefill, no decode profile), blocks of ``block_tokens`` (512); returns (PD cluster,
    PrfaaS cluster).

    Instances are named ``<cluster>-p<i>`` (prefill) and ``<cluster>-d<i>`` (decode);
    ``instances=False`` declares none (their agents register them).
    """
    model = ModelProfileFactory(block_tokens=block_tokens)
    h20 = AcceleratorFactory(name="H20")
    h200 = AcceleratorFactory(name="H200")
    PerformanceProfileFactory(accelerator=h20, model=model, prefill_seconds=h20_prefill_seconds)
    h200_profile: dict[str, object] = {}
    if h200_prefill_seconds is not None:
        h200_profile["prefill_seconds"] = h200_prefill_seconds
    PerformanceProfileFactory(
        accelerator=h200,
        model=model,
        decode_max_batch=None,
        decode_step_seconds=None,
        **h200_profile,
    )
    pd = ClusterFactory(name=pd_name, accelerator=h20, model=model)
    pf = PrfaasClusterFactory(name=prfaas_name, accelerator=h200, model=model)
    for i in range(2 if instances else 0):
        InstanceFactory(cluster=pd, name=f"{pd_name}-p{i}", role=InstanceRole.PREFILL)
        InstanceFactory(cluster=pd, name=f"{pd_name}-d{i}", role=InstanceRole.DECODE)
        InstanceFactory(cluster=pf, name=f"{prfaas_name}-p{i}", role=InstanceRole.PREFILL)
    link: dict[str, object] = {"gbps": LINK_GBPS, "rtt_ms": 10.0}
    if kv_budget_bytes is not None:
        link["kv_budget_bytes"] = kv_budget_bytes
    LinkFactory(source=pf, target=pd, **link)
    return pd, pf
