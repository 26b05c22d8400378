"""A real Redis Cluster for tests: three masters and three replicas from the machine's
``redis-server`` (``cluster-enabled yes``), joined by ``redis-cli --cluster create``, each node
in its own directory under a temporary root, stopped by process id afterwards."""

from __future__ import annotations

import random
import signal
import socket
import subprocess
import time
from pathlib import Path

import redis

from tests.support.processes import redis_executable, redis_ping

START_TIMEOUT_S = 60.0


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def cluster_port(taken: set[int]) -> int:
    """A free port whose cluster bus port (+10,000) is free too: a node's port must be at most
    55,535, below the kernel's ephemeral range that :func:`free_port` draws from."""
    rng = random.SystemRandom()
    while True:
        port = rng.randrange(20_000, 45_000)
        if port not in taken and _bindable(port) and _bindable(port + 10_000):
            return port


class ThrowawayRedisCluster:
    """``masters`` masters with ``replicas`` replicas each, on 127.0.0.1, no persistence."""

    def __init__(self, root: Path, masters: int = 3, replicas: int = 1) -> None:
        self.root = root
        self.masters = masters
        self.replicas = replicas
        self.ports: list[int] = []
        for _ in range(masters * (1 + replicas)):
            self.ports.append(cluster_port(set(self.ports)))
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    @property
    def url(self) -> str:
        """Seed nodes for ``REDIS_CLUSTER_URL``: every node (any one answering is enough)."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    @property
    def pids(self) -> set[int]:
        return {p.pid for p in self.procs.values()}

    def node_start(self, port: int) -> None:
        workdir = self.root / f"node-{port}"
        workdir.mkdir(parents=True, exist_ok=True)
        self.procs[port] = subprocess.Popen(
            [
                redis_executable(),
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                str(workdir / "nodes.conf"),
                # A killed master's replica takes over within a few seconds.
                "--cluster-node-timeout",
                "2000",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(workdir),
            ],
            stdout=subprocess.DEVNULL,
            start_new_session=True,
        )

    def start(self) -> None:
        for port in self.ports:
            self.node_start(port)
        deadline = time.monotonic() + START_TIMEOUT_S
        for k, port in enumerate(list(self.ports)):
            while not redis_ping(port):
                if self.procs[port].poll() is not None:
                    # Its port (or bus port) was taken between the check and the bind by
                    # another program: another port.
                    del self.procs[port]
                    port = cluster_port(set(self.ports))
                    self.ports[k] = port
                    self.node_start(port)
                if time.monotonic() > deadline:
                    raise RuntimeError(f"cluster node {port} did not answer")
                time.sleep(0.05)
        subprocess.run(
            [
                str(Path(redis_executable()).with_name("redis-cli")),
                "--cluster",
                "create",
                *(f"127.0.0.1:{p}" for p in self.ports),
                "--cluster-replicas",
                str(self.replicas),
                "--cluster-yes",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            timeout=START_TIMEOUT_S,
        )
        self.wait_ok(deadline)

    def wait_ok(self, deadline: float) -> None:
        """Until every live node says ``cluster_state:ok`` and knows ``masters`` masters with
        their slots."""
        while True:
            if all(self._ok(port) for port, p in self.procs.items() if p.poll() is None):
                return
            if time.monotonic() > deadline:
                raise RuntimeError("the Redis Cluster did not reach cluster_state:ok")
            time.sleep(0.1)

    def _ok(self, port: int) -> bool:
        client = redis.Redis(port=port, socket_timeout=1)
        try:
            info = client.cluster("INFO")  # parsed by redis-py into a dict
            return bool(
                info.get("cluster_state") == "ok"
                and str(info.get("cluster_slots_ok")) == "16384"
                and int(info.get("cluster_size", 0)) == self.masters
            )
        except (redis.RedisError, OSError):
            return False
        finally:
            client.close()

    def master_ports(self) -> list[int]:
        """The ports of the nodes that are masters now."""
        out = []
        for port, proc in self.procs.items():
            if proc.poll() is not None:
                continue
            client = redis.Redis(port=port, socket_timeout=1)
            try:
                if client.info("replication").get("role") == "master":
                    out.append(port)
            except (redis.RedisError, OSError):
                pass
            finally:
                client.close()
        return out

    def kill(self, port: int) -> None:
        """kill -9 one node (a crash, no goodbye)."""
        proc = self.procs[port]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
