from django.apps import AppConfig
from django.conf import settings


class ControlplaneConfig(AppConfig):
    """Project-wide concerns: API tokens, access groups and the audit log."""

    name = "controlplane"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # Settings do no I/O at import; the local state folder (the SQLite database, the
        # embedded Redis's socket) and WhiteNoise's root (it warns on every request while it is
        # missing, even empty) are made here, once Django starts.
        settings.VAR_DIR.mkdir(parents=True, exist_ok=True)
        settings.STATIC_ROOT.mkdir(parents=True, exist_ok=True)
