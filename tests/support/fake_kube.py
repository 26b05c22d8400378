"""A stateful fake of the Kubernetes API server, for the ``kubernetes`` actuator's tests (no
cluster can run here). Real HTTP on a free local port (uvicorn in a thread), and just the API
the actuator uses, with the server's rules that matter to it:

* objects with a ``/scale`` subresource (any group/version/plural), ``resourceVersion`` on every
  write, and a merge PATCH whose ``metadata.resourceVersion`` is not the current one refused
  with 409 Conflict (``conflict_next`` makes another writer win the next PATCH);
* pods: get, list by label selector, merge PATCH (annotations);
* RBAC: ``deny(verb, resource)`` answers 403 Forbidden worded like the real server;
* a controller thread: it creates pods up to ``spec.replicas`` (ordinal names for
  StatefulSet-like workloads, random suffixes otherwise), makes each ready ``ready_delay_s``
  (as it was when the pod was created) after its creation, and removes surplus pods as the real controllers do: the highest ordinal,
  or (ReplicaSet rules) not-ready before ready, then the lowest
  ``controller.kubernetes.io/pod-deletion-cost``, then the newest; a removed pod terminates for
  ``terminate_delay_s`` before it is gone. Workload status (``replicas``, ``readyReplicas``)
  follows, bumping ``resourceVersion`` as status writes do.

Every request is logged (``requests``) so tests can count PATCHes and the versions they sent.
"""

from __future__ import annotations

import json
import re
import secrets
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import uvicorn

from tests.support.servers import free_port

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
WORKLOAD_LABEL = "fake.prfaas.test/workload"
SERVICE_ACCOUNT = "system:serviceaccount:prfaas:prfaas-controlplane"


@dataclass
class Workload:
    api_version: str
    kind: str
    plural: str
    namespace: str
    name: str
    replicas: int
    ordinal: bool  # StatefulSet-like: pods <name>-<i>, the highest removed first
    ready_in_status: bool  # whether status carries readyReplicas (some adapters do not)
    resource_version: int = 0
    status: dict[str, Any] = field(default_factory=dict)

    @property
    def group(self) -> str:
        return self.api_version.rpartition("/")[0]

    @property
    def resource(self) -> str:
        return f"{self.plural}.{self.group}" if self.group else self.plural

    @property
    def selector(self) -> str:
        return f"{WORKLOAD_LABEL}={self.name}"


@dataclass
class FakePod:
    namespace: str
    name: str
    owner: str
    labels: dict[str, str]
    annotations: dict[str, str] = field(default_factory=dict)
    created: float = 0.0
    ready_at: float = 0.0
    deleting_since: float | None = None
    resource_version: int = 0

    def ready(self, now: float) -> bool:
        return self.deleting_since is None and now >= self.ready_at

    def to_json(self, now: float) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "name": self.name,
            "namespace": self.namespace,
            "labels": dict(self.labels),
            "annotations": dict(self.annotations),
            "resourceVersion": str(self.resource_version),
        }
        if self.deleting_since is not None:
            meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
        ready = self.ready(now)
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": meta,
            "spec": {"containers": [{"name": "engine", "image": "engine:test"}]},
            "status": {
                "phase": "Running",
                "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            },
        }


@dataclass
class Logged:
    method: str
    path: str
    body: Any
    status: int


class FakeKube:
    def __init__(self, *, ready_delay_s: float = 0.3, terminate_delay_s: float = 0.2) -> None:
        self.ready_delay_s = ready_delay_s
        self.terminate_delay_s = terminate_delay_s
        self.honour_deletion_cost = True
        self.lock = threading.RLock()
        self._rv = 1000
        self.workloads: dict[tuple[str, str, str, str], Workload] = {}
        self.pods: dict[tuple[str, str], FakePod] = {}
        self.denied: set[tuple[str, str]] = set()
        self.conflicts: dict[str, int] = {}
        self.requests: list[Logged] = []
        self.port = free_port()
        self._stop = threading.Event()

    # set-up ----------------------------------------------------------------------------------

    def _next_rv(self) -> int:
        self._rv += 1
        return self._rv

    def add_workload(
        self,
        kind: str,
        name: str,
        replicas: int,
        *,
        api_version: str = "apps/v1",
        plural: str = "",
        namespace: str = "inference",
        ordinal: bool | None = None,
        ready_in_status: bool = True,
    ) -> Workload:
        with self.lock:
            w = Workload(
                api_version=api_version,
                kind=kind,
                plural=plural or kind.lower() + "s",
                namespace=namespace,
                name=name,
                replicas=replicas,
                ordinal=kind != "Deployment" if ordinal is None else ordinal,
                ready_in_status=ready_in_status,
                resource_version=self._next_rv(),
            )
            self.workloads[(w.group, w.plural, namespace, name)] = w
            now = time.monotonic()
            for _ in range(replicas):
                self._pod_create(w, now).ready_at = now  # the initial pods are ready at once
            self._status_update(w, time.monotonic())
            return w

    def deny(self, verb: str, resource: str) -> None:
        """Answer ``verb`` on ``resource`` (e.g. ``patch``, ``deployments.apps/scale``) with 403."""
        self.denied.add((verb, resource))

    def conflict_next(self, name: str, times: int = 1) -> None:
        """Another writer changes ``name`` just before the next ``times`` scale PATCHes."""
        self.conflicts[name] = times

    def kubeconfig(self, path: Path, context: str = "fake") -> Path:
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": context, "cluster": {"server": self.url}}],
            "users": [{"name": context, "user": {"token": "test-token"}}],
            "contexts": [{"name": context, "context": {"cluster": context, "user": context}}],
            "current-context": context,
        }
        path.write_text(json.dumps(config))
        return path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # what tests read -------------------------------------------------------------------------

    def scale_patches(self, name: str) -> list[Logged]:
        return [
            r for r in self.requests if r.method == "PATCH" and r.path.endswith(f"/{name}/scale")
        ]

    def pod_names(self, owner: str, *, live: bool = True) -> list[str]:
        with self.lock:
            return sorted(
                p.name
                for p in self.pods.values()
                if p.owner == owner and (p.deleting_since is None or not live)
            )

    def ready_count(self, owner: str) -> int:
        now = time.monotonic()
        with self.lock:
            return sum(p.owner == owner and p.ready(now) for p in self.pods.values())

    # the controller --------------------------------------------------------------------------

    def _pod_create(self, w: Workload, now: float) -> FakePod:
        taken = {p.name for p in self.pods.values() if p.owner == w.name}
        labels = {WORKLOAD_LABEL: w.name}
        if w.ordinal:
            index = next(i for i in range(len(taken) + 1) if f"{w.name}-{i}" not in taken)
            name = f"{w.name}-{index}"
            labels["apps.kubernetes.io/pod-index"] = str(index)
        else:
            name = f"{w.name}-{secrets.token_hex(3)}"
        pod = FakePod(
            w.namespace,
            name,
            w.name,
            labels,
            created=now,
            ready_at=now + self.ready_delay_s,
            resource_version=self._next_rv(),
        )
        self.pods[(w.namespace, name)] = pod
        return pod

    def _victim(self, w: Workload, live: list[FakePod], now: float) -> FakePod:
        if w.ordinal:
            return max(live, key=lambda p: int(p.labels["apps.kubernetes.io/pod-index"]))

        def rank(p: FakePod) -> tuple[bool, int, float]:
            cost = int(p.annotations.get(DELETION_COST, "0")) if self.honour_deletion_cost else 0
            return (p.ready(now), cost, -p.created)

        return min(live, key=rank)

    def _status_update(self, w: Workload, now: float) -> None:
        mine = [p for p in self.pods.values() if p.owner == w.name and p.deleting_since is None]
        status: dict[str, Any] = {"replicas": len(mine), "selector": w.selector}
        if w.ready_in_status:
            status["readyReplicas"] = sum(p.ready(now) for p in mine)
        if status != w.status:
            w.status = status
            w.resource_version = self._next_rv()

    def _reconcile(self) -> None:
        now = time.monotonic()
        with self.lock:
            for key, pod in list(self.pods.items()):
                if pod.deleting_since is not None and now - pod.deleting_since >= (
                    self.terminate_delay_s
                ):
                    del self.pods[key]
            for w in self.workloads.values():
                live = [p for p in self.pods.values() if p.owner == w.name]
                live = [p for p in live if p.deleting_since is None]
                while len(live) < w.replicas:
                    live.append(self._pod_create(w, now))
                while len(live) > w.replicas:
                    victim = self._victim(w, live, now)
                    victim.deleting_since = now
                    victim.resource_version = self._next_rv()
                    live.remove(victim)
                self._status_update(w, now)

    def _control(self) -> None:
        while not self._stop.wait(0.05):
            self._reconcile()

    # the API ---------------------------------------------------------------------------------

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        raw = b""
        while True:
            message = await receive()
            raw += message.get("body", b"")
            if not message.get("more_body"):
                break
        body = json.loads(raw) if raw else None
        query = {k: v[0] for k, v in parse_qs(scope.get("query_string", b"").decode()).items()}
        with self.lock:
            status, answer = self._handle(scope["method"], scope["path"], query, body)
            self.requests.append(Logged(scope["method"], scope["path"], body, status))
        payload = json.dumps(answer).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": payload})

    @staticmethod
    def _status(code: int, reason: str, message: str) -> tuple[int, dict[str, Any]]:
        return code, {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": message,
            "reason": reason,
            "code": code,
        }

    def _forbidden(
        self, verb: str, resource: str, name: str, namespace: str
    ) -> tuple[int, dict[str, Any]] | None:
        if (verb, resource) not in self.denied:
            return None
        plural_sub, _, group = resource.partition(".")
        if "/" in group:  # scale: deployments.apps/scale
            group, _, sub = group.partition("/")
            plural_sub = f"{plural_sub}/{sub}"
        return self._status(
            403,
            "Forbidden",
            f'{resource.split("/")[0]} "{name}" is forbidden: User "{SERVICE_ACCOUNT}" cannot '
            f'{verb} resource "{plural_sub}" in API group "{group}" in the namespace '
            f'"{namespace}"',
        )

    def _handle(
        self, method: str, path: str, query: dict[str, str], body: Any
    ) -> tuple[int, dict[str, Any]]:
        now = time.monotonic()
        m = re.fullmatch(r"/api/v1/namespaces/([^/]+)/pods(?:/([^/]+))?", path)
        if m:
            return self._pods(method, m.group(1), m.group(2), query, body, now)
        m = re.fullmatch(r"/apis/([^/]+)/([^/]+)/namespaces/([^/]+)/([^/]+)/([^/]+)(/scale)?", path)
        if not m:
            return self._status(404, "NotFound", f"the server could not find {path}")
        group, version, namespace, plural, name, scale = m.groups()
        w = self.workloads.get((group, plural, namespace, name))
        resource = f"{plural}.{group}" + ("/scale" if scale else "")
        verb = {"GET": "get", "PATCH": "patch"}.get(method, method.lower())
        denied = self._forbidden(verb, resource, name, namespace)
        if denied:
            return denied
        if w is None or w.api_version != f"{group}/{version}":
            return self._status(404, "NotFound", f'{plural}.{group} "{name}" not found')
        if not scale:
            if method != "GET":
                return self._status(405, "MethodNotAllowed", method)
            return 200, self._object(w)
        if method == "PATCH":
            sent = ((body or {}).get("metadata") or {}).get("resourceVersion")
            if self.conflicts.get(name, 0) > 0:
                self.conflicts[name] -= 1
                w.resource_version = self._next_rv()  # another writer got there first
            if sent is not None and sent != str(w.resource_version):
                return self._status(
                    409,
                    "Conflict",
                    f'Operation cannot be fulfilled on {plural}.{group} "{name}": the object has '
                    "been modified; please apply your changes to the latest version and try again",
                )
            replicas = ((body or {}).get("spec") or {}).get("replicas")
            if not isinstance(replicas, int) or replicas < 0:
                return self._status(422, "Invalid", "spec.replicas: must be a whole number >= 0")
            w.replicas = replicas
            w.resource_version = self._next_rv()
        elif method != "GET":
            return self._status(405, "MethodNotAllowed", method)
        return 200, {
            "apiVersion": "autoscaling/v1",
            "kind": "Scale",
            "metadata": {
                "name": name,
                "namespace": namespace,
                "resourceVersion": str(w.resource_version),
            },
            "spec": {"replicas": w.replicas},
            "status": {"replicas": w.status.get("replicas", 0), "selector": w.selector},
        }

    @staticmethod
    def _object(w: Workload) -> dict[str, Any]:
        return {
            "apiVersion": w.api_version,
            "kind": w.kind,
            "metadata": {
                "name": w.name,
                "namespace": w.namespace,
                "resourceVersion": str(w.resource_version),
            },
            "spec": {
                "replicas": w.replicas,
                "selector": {"matchLabels": {WORKLOAD_LABEL: w.name}},
                "template": {
                    "metadata": {"labels": {WORKLOAD_LABEL: w.name}},
                    "spec": {"containers": [{"name": "engine", "image": "engine:test"}]},
                },
            },
            "status": dict(w.status),
        }

    def _pods(
        self,
        method: str,
        namespace: str,
        name: str | None,
        query: dict[str, str],
        body: Any,
        now: float,
    ) -> tuple[int, dict[str, Any]]:
        verb = {"GET": "get" if name else "list", "PATCH": "patch"}.get(method, method.lower())
        denied = self._forbidden(verb, "pods", name or "", namespace)
        if denied:
            return denied
        if name is None:
            wanted = _selector(query.get("labelSelector", ""))
            items = [
                p.to_json(now)
                for p in self.pods.values()
                if p.namespace == namespace and wanted(p.labels)
            ]
            return 200, {
                "apiVersion": "v1",
                "kind": "PodList",
                "metadata": {"resourceVersion": str(self._rv)},
                "items": items,
            }
        pod = self.pods.get((namespace, name))
        if pod is None:
            return self._status(404, "NotFound", f'pods "{name}" not found')
        if method == "PATCH":
            annotations = ((body or {}).get("metadata") or {}).get("annotations") or {}
            for key, value in annotations.items():
                if value is None:
                    pod.annotations.pop(key, None)
                else:
                    pod.annotations[key] = str(value)
            pod.resource_version = self._next_rv()
        return 200, pod.to_json(now)

    # lifecycle -------------------------------------------------------------------------------

    @contextmanager
    def running(self) -> Iterator[FakeKube]:
        config = uvicorn.Config(self, host="127.0.0.1", port=self.port, log_level="warning")
        server = uvicorn.Server(config)
        serving = threading.Thread(target=server.run, daemon=True)
        controller = threading.Thread(target=self._control, daemon=True)
        serving.start()
        controller.start()
        try:
            deadline = time.monotonic() + 10
            while not server.started:
                if time.monotonic() > deadline:
                    raise RuntimeError("the fake Kubernetes API did not start")
                time.sleep(0.02)
            yield self
        finally:
            self._stop.set()
            server.should_exit = True
            serving.join(10)
            controller.join(10)


def _selector(text: str) -> Any:
    """Equality (``k=v``, ``k==v``, ``k!=v``) and set (``k in (a,b)``) label selectors."""
    terms = [t.strip() for t in re.split(r",(?![^(]*\))", text) if t.strip()]

    def match(labels: dict[str, str]) -> bool:
        for term in terms:
            if m := re.fullmatch(r"(\S+)\s+in\s+\((.*)\)", term):
                if labels.get(m.group(1)) not in {v.strip() for v in m.group(2).split(",")}:
                    return False
            elif "!=" in term:
                key, value = term.split("!=", 1)
                if labels.get(key) == value:
                    return False
            elif "=" in term:
                key, value = re.split(r"==?", term, maxsplit=1)
                if labels.get(key) != value:
                    return False
            elif labels.get(term) is None:
                return False
        return True

    return match
