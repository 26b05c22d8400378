from django.apps import AppConfig


class ControlplaneConfig(AppConfig):
    """Project-wide concerns: API tokens, access groups and the audit log."""

    name = "controlplane"
    default_auto_field = "django.db.models.BigAutoField"
