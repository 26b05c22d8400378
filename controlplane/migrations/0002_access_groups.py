"""The three operator groups. Their API scopes live in controlplane.auth.GROUP_SCOPES; here they
also get the matching Django admin permissions (view / change instances / everything)."""

from typing import Any

from django.contrib.auth.management import create_permissions
from django.db import migrations

GROUPS = ("viewer", "operator", "admin")
INVENTORY_APPS = ("clusters", "controlplane")


def groups_create(apps: Any, schema_editor: Any) -> None:
    # Permissions are normally created after all migrations; make sure they exist now.
    for app_config in apps.get_app_configs():
        app_config.models_module = True
        create_permissions(app_config, verbosity=0, apps=apps)
        app_config.models_module = None
    group_model = apps.get_model("auth", "Group")
    permission_model = apps.get_model("auth", "Permission")
    perms = permission_model.objects.filter(content_type__app_label__in=INVENTORY_APPS)
    viewer, _ = group_model.objects.get_or_create(name="viewer")
    viewer.permissions.set(perms.filter(codename__startswith="view_"))
    operator, _ = group_model.objects.get_or_create(name="operator")
    operator.permissions.set(
        perms.filter(codename__startswith="view_") | perms.filter(codename="change_instance")
    )
    admin, _ = group_model.objects.get_or_create(name="admin")
    admin.permissions.set(
        perms.exclude(codename__in=["change_changerecord", "delete_changerecord"])
    )


def groups_delete(apps: Any, schema_editor: Any) -> None:
    apps.get_model("auth", "Group").objects.filter(name__in=GROUPS).delete()


class Migration(migrations.Migration):
    dependencies = [
        ("controlplane", "0001_initial"),
        ("clusters", "0001_initial"),
        ("auth", "0012_alter_user_first_name_max_length"),
        ("contenttypes", "0002_remove_content_type_name"),
    ]

    operations = [migrations.RunPython(groups_create, groups_delete)]
