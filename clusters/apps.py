from django.apps import AppConfig


class ClustersConfig(AppConfig):
    """Inventory: sites, clusters, instances, links, profiles, and their live state."""

    name = "clusters"
    default_auto_field = "django.db.models.BigAutoField"
