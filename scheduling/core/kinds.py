"""The fleet's vocabulary, defined once: cluster kinds, instance roles and states, and how an
engine hands KV over. The Django models take their choices from these enums, the API schemas
and the agent their types, the core its checks; a new value is added here and nowhere else
(the labels the pages show live with the models)."""

from __future__ import annotations

from enum import StrEnum


class ClusterKind(StrEnum):
    PRFAAS = "prfaas"
    PD = "pd"


class InstanceRole(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"


class InstanceState(StrEnum):
    """``unreachable``: its heartbeats stopped for longer than the grace period; routing
    leaves it alone until it heartbeats again."""

    ACTIVE = "active"
    DRAINING = "draining"
    DOWN = "down"
    UNREACHABLE = "unreachable"


class KvConnector(StrEnum):
    """How a gateway hands a prefill's KVCache to decode on a cluster's engines (vLLM's
    disaggregated protocols): ``nixl`` returns ``kv_transfer_params`` from prefill that go on
    the decode request (NixlConnector, pull); ``shared_storage`` sends decode the same request
    and it finds the KV by prompt tokens (ExampleConnector, LMCache)."""

    NIXL = "nixl"
    SHARED_STORAGE = "shared_storage"
