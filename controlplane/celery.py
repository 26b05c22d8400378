"""The Celery application: broker and settings come from Django settings (``CELERY_*``)."""

import os
import signal
import subprocess
import sys

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

app = Celery("controlplane")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


def worker_argv(python: str = sys.executable, loglevel: str = "WARNING") -> list[str]:
    """``celery -A controlplane worker`` as one process that runs one task at a time (solo
    pool), without gossip, mingle or heartbeats: what the tests and the brute-force bench
    start (N of them for N tasks at once), each process stopped by its id."""
    return [
        *(python, "-m", "celery", "-A", "controlplane", "worker", "--pool=solo"),
        *("--without-gossip", "--without-mingle", "--without-heartbeat", "-l", loglevel),
    ]


def worker_stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> None:
    """Send ``sig`` to a worker started in its own session (it and nothing else: SIGKILL to
    crash it), SIGKILL after 20 s."""
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
