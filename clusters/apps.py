from django.apps import AppConfig


class ClustersConfig(AppConfig):
    """Inventory: sites, clusters, instances, links, profiles, and their live state."""

    name = "clusters"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # Token bindings name instances and links: the access layer asks the inventory.
        from clusters.selectors import inventory_names_missing
        from controlplane.services import binding_inventory_register

        binding_inventory_register(inventory_names_missing)
