from django.apps import AppConfig


class SchedulingConfig(AppConfig):
    """Decisions: the pure core (model, planner, router, simulator) and its Django side."""

    name = "scheduling"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # Inventory writes must reach every web process's routing snapshot.
        from scheduling.snapshot import inventory_signals_connect

        inventory_signals_connect()
