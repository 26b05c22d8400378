"""Celery tasks of the clusters app: thin wrappers over services."""

from __future__ import annotations

from celery import shared_task

from clusters.live.scrape import instances_scrape


@shared_task(name="clusters.engines_scrape", ignore_result=True)
def engines_scrape() -> int:
    """Scrape every active instance's Prometheus endpoint into live state (beat: every few s)."""
    return instances_scrape().stored
