from django.apps import AppConfig


class SchedulingConfig(AppConfig):
    """Decisions: the pure core (model, planner, router, simulator) and its Django side."""

    name = "scheduling"
    default_auto_field = "django.db.models.BigAutoField"
