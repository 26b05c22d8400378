"""Link egress from interface counters and connector metrics, as rates over the interval, with
counter resets restarting the baseline; engine scrapes through a real HTTP server."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator

import pytest

from fleet.agent.config import EngineConfig, LinkConfig
from fleet.agent.metrics import AgentMetrics
from fleet.agent.telemetry import (
    InterfaceError,
    TelemetrySampler,
    interface_tx_bytes,
    tcp_retransmits,
)

DEV = """Inter-|   Receive                                                |  Transmit
 face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier compressed
    lo: 100 2 0 0 0 0 0 0 100 2 0 0 0 0 0 0
  eth1: 5000 40 0 0 0 0 0 0 987654321 700 0 0 0 0 0 0
"""
SNMP = """Tcp: RtoAlgorithm RtoMin RtoMax MaxConn ActiveOpens PassiveOpens AttemptFails EstabResets CurrEstab InSegs OutSegs RetransSegs InErrs OutRsts InCsumErrors
Tcp: 1 200 120000 -1 10 10 0 0 5 1000 2000 17 0 0 0
"""


def test_proc_counters_are_read() -> None:
    assert interface_tx_bytes("eth1", DEV) == 987654321
    assert tcp_retransmits(SNMP) == 17
    with pytest.raises(InterfaceError, match="eth9"):
        interface_tx_bytes("eth9", DEV)


def test_this_hosts_loopback_counter_is_readable() -> None:
    assert interface_tx_bytes("lo") >= 0 and tcp_retransmits() >= 0


def test_interface_egress_is_a_rate_over_the_interval_and_a_reset_restarts_it() -> None:
    tx = iter([1_000, 5_001_000, 9_001_000, 100, 2_100])
    retx = iter([10, 13, 13, 13, 20])
    now = iter([100.0, 102.0, 104.0, 106.0, 108.0])
    link = LinkConfig(source="prfaas-x", target="pd-a", measure="interface", interface="eth1")
    sampler = TelemetrySampler(
        [],
        [link],
        AgentMetrics(),
        clock=lambda: next(now),
        read_tx=lambda _: next(tx),
        read_retransmits=lambda: next(retx),
    )
    assert sampler.sample() == ([], [])  # the first reading only sets the baseline
    _, links = sampler.sample()
    assert links == [
        {
            "source": "prfaas-x",
            "target": "pd-a",
            "ts": 102.0,
            "bytes_sent": 5_000_000,
            "interval_s": 2.0,
            "retransmits": 3,
        }
    ]
    assert sampler.sample()[1][0]["bytes_sent"] == 4_000_000
    assert sampler.sample()[1] == []  # the counter went back: no negative rate
    assert sampler.sample()[1][0]["bytes_sent"] == 2_000


class _Engine(http.server.BaseHTTPRequestHandler):
    page = ""

    def do_GET(self) -> None:
        body = self.page.encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def engine_url() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Engine)
    thread = threading.Thread(target=server.serve_forever)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    server.shutdown()
    server.server_close()
    thread.join()


def test_engines_are_scraped_and_connector_bytes_become_link_egress(engine_url: str) -> None:
    _Engine.page = (
        'vllm:num_requests_running{engine="0"} 2\nvllm:num_requests_waiting{engine="0"} 1\n'
        'vllm:nixl_bytes_transferred_sum{engine="0"} 1000\n'
    )
    now = iter([10.0, 11.0])
    metrics = AgentMetrics()
    sampler = TelemetrySampler(
        [
            EngineConfig(instance="pd-a-p0", metrics_url=engine_url),
            EngineConfig(instance="pd-a-p1", metrics_url="http://127.0.0.1:1/m"),
        ],
        [LinkConfig(source="prfaas-x", target="pd-a", measure="connector", engines=("pd-a-p0",))],
        metrics,
        clock=lambda: next(now),
    )
    instances, links = sampler.sample()
    assert [(i["instance"], i["running"], i["waiting"]) for i in instances] == [("pd-a-p0", 2, 1)]
    assert links == []
    _Engine.page = _Engine.page.replace("1000", "251000")
    _, links = sampler.sample()
    assert links[0]["bytes_sent"] == 250_000 and links[0]["interval_s"] == 1.0
    assert metrics.scrape_errors.labels("pd-a-p1")._value.get() == 2
