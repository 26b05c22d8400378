"""``manage.py demo`` end to end: the whole stack as a new user starts it, driven by the fleet
emulator, then stopped with Ctrl-C (SIGINT).

The stack runs as a subprocess with its own VAR_DIR and port. When the suite runs against real
services (DATABASE_URL / REDIS_URL set), the demo gets its own PostgreSQL database and its own
Redis database number, so it never touches the suite's test database.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from django.conf import settings

from tests.demo_support import Demo, demo_running, wait_for
from tests.support.servers import free_port

ROOT = Path(settings.BASE_DIR)
pytestmark = pytest.mark.timeout(240)
# What the router does on a degraded link (in-flight budget full, offloads refused) raises
# these at once; egress over the scarce share (the old, slow signal) may follow.
CONGESTION_ALERTS = {"link_budget_exhausted", "offloads_refused", "link_congested"}


@pytest.fixture
def demo(tmp_path: Path) -> Iterator[Demo]:
    with demo_running(tmp_path) as handle:
        yield handle


def api(demo: Demo, path: str, **params: Any) -> Any:
    token = demo.credentials()["tokens"]["EMULATOR_ADMIN_TOKEN"]
    response = httpx.get(
        demo.base + path, params=params, headers={"Authorization": f"Bearer {token}"}, timeout=10
    )
    response.raise_for_status()
    return response.json()


def overview_alerts(demo: Demo) -> list[dict[str, Any]]:
    """The alerts on the overview page, logged in as the demo's operator."""
    creds = demo.credentials()
    with httpx.Client(base_url=demo.base, timeout=10) as browser:
        page = browser.get("/accounts/login/")
        csrf = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text)
        assert csrf is not None
        browser.post(
            "/accounts/login/",
            data={
                "username": creds["username"],
                "password": creds["password"],
                "csrfmiddlewaretoken": csrf.group(1),
            },
            headers={"Referer": demo.base + "/accounts/login/"},
        )
        overview = browser.get("/")
        assert overview.status_code == 200
        found = re.search(
            r'<script id="overview-snapshot" type="application/json">(.*?)</script>',
            overview.text,
            re.S,
        )
        assert found is not None, "the overview page has no snapshot (not logged in?)"
        return list(json.loads(found.group(1))["alerts"])


def test_demo_serves_decides_plans_reacts_to_a_degraded_link_and_stops_cleanly(
    demo: Demo,
) -> None:
    # The UI and the API answer, and the emulator's requests are decided.
    wait_for("web server", lambda: httpx.get(demo.base + "/api/v1/health").is_success, demo, 90)
    assert httpx.get(demo.base + "/accounts/login/").status_code == 200
    assert "login: operator / " in demo.output()
    # A second demo on the same VAR_DIR would share, then stop, this one's embedded Redis.
    second = subprocess.run(
        [sys.executable, "manage.py", "demo", "--port", str(free_port())],
        cwd=ROOT,
        env=demo.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert second.returncode == 2
    assert "a demo is already running with VAR_DIR=" in second.stderr
    decisions = wait_for(
        "routing decisions",
        lambda: len(api(demo, "/api/v1/decisions/recent", limit=50)) >= 20,
        demo,
        60,
    )
    assert decisions
    routes = {d["decision"]["route"] for d in api(demo, "/api/v1/decisions/recent", limit=200)}
    assert routes <= {"local", "prfaas"} and routes

    # The topology declared no instance: the emulated engines joined, registered by their
    # agents, and the change log says so.
    instances = api(demo, "/api/v1/instances", limit=100)["items"]
    assert len(instances) == 12
    assert {(i["origin"], i["engine"]) for i in instances} == {("registered", "emulated")}
    joined = api(demo, "/api/v1/audit", action="register", limit=100)["items"]
    assert {r["object_repr"] for r in joined} == {i["name"] for i in instances}
    assert all("registered by its agent" in r["cause"] for r in joined)

    # The emulated engines' KV events came through the fleet agent's stream and uplink (vLLM
    # msgpack frames, sequence-checked): the index holds their blocks, with no gap.
    index = wait_for(
        "prefix-index entries",
        lambda: [s for s in api(demo, "/api/v1/prefix-index") if s["blocks"] > 0],
        demo,
        60,
    )
    assert all(s["state"] == "exact" and s["gaps"] == 0 for s in index), index
    assert all(s["last_seq"] is not None and s["last_seq"] >= 1 for s in index), index

    # The rebalancer (20 s in this test) proposes a plan from the observed traffic.
    plans = wait_for("a plan", lambda: api(demo, "/api/v1/plans")["items"], demo, 150)
    assert plans[0]["cluster"]

    # A degraded link: the emulator carries it out, routers keep KV off it, operators see it.
    # The fault is the one the demo suggests, pasted into a shell as printed (in the venv).
    link = api(demo, "/api/v1/links")["items"][0]
    (hint,) = re.findall(r"inject a fault \(in the activated venv\): (.+)", demo.output())
    assert hint.startswith("python manage.py emulate_fault link "), hint
    venv = {"PATH": f"{Path(sys.executable).parent}:{demo.env.get('PATH', '')}"}
    fault = subprocess.run(
        ["bash", "-c", hint],
        cwd=ROOT,
        env={**demo.env, **venv},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert fault.returncode == 0, fault.stderr
    # Unquoted, `a->b` would have written the command's output into a file named `b`.
    assert not (ROOT / link["target"]).exists()

    def congested_decisions() -> bool:
        recent = api(demo, "/api/v1/decisions/recent", limit=200)
        return any(d["decision"]["reason"] == "link_congested" for d in recent)

    wait_for("link_congested decisions", congested_decisions, demo, 60)
    alerts = wait_for(
        "a congestion alert",
        lambda: [a for a in overview_alerts(demo) if a["code"] in CONGESTION_ALERTS],
        demo,
        45,
    )
    assert link["source"] in alerts[0]["subject"]
    assert api(demo, f"/api/v1/links/{link['id']}")["gbps"] == 2.0  # recorded by the emulator

    # Ctrl-C: every process the demo started is gone, the embedded Redis included.
    family = psutil.Process(demo.process.pid).children(recursive=True)
    names = {" ".join(p.cmdline()[1:4]) for p in family}
    assert any("uvicorn" in n for n in names) and any("emulate" in n for n in names), names
    redis_pid = demo.var_dir / "redis.pid"
    if redis_pid.exists():  # embedded Redis (REDIS_URL unset)
        family.append(psutil.Process(int(redis_pid.read_text().strip())))
    demo.process.send_signal(signal.SIGINT)
    assert demo.process.wait(timeout=45) == 0, demo.output()[-3000:]
    assert "stopped" in demo.output()
    _, alive = psutil.wait_procs(family, timeout=10)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], alive
