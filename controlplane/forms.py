"""Page forms of the control plane app, and how service errors land next to their field."""

from __future__ import annotations

from django import forms

from controlplane.errors import ApiError
from controlplane.models import Scope


def service_error_add(form: forms.Form, exc: ApiError) -> None:
    """Show a service's error next to the field it names (``"field: message"``), else on top."""
    field, sep, message = exc.detail.partition(":")
    field = field.strip()
    if sep and field in form.fields:
        form.add_error(field, message.strip())
    else:
        form.add_error(None, exc.detail)


class TokenForm(forms.Form):
    """A new API token: its name, scopes and optional lifetime."""

    name = forms.CharField(max_length=100, help_text="e.g. router-eu-1; unique")
    scopes = forms.MultipleChoiceField(
        choices=Scope.choices, widget=forms.CheckboxSelectMultiple, help_text="at least one"
    )
    expires_in_days = forms.FloatField(
        required=False, min_value=0.01, label="Expires in (days)", help_text="empty: never"
    )

    def clean_name(self) -> str:
        name: str = self.cleaned_data["name"].strip()
        if not name:
            raise forms.ValidationError("must not be empty")
        return name


class AuditFilterForm(forms.Form):
    """Filters of the audit log; every one given narrows the list."""

    object_type = forms.CharField(required=False, max_length=100, label="Object type")
    action = forms.CharField(required=False, max_length=20)
    actor = forms.CharField(required=False, max_length=200)
    request_id = forms.CharField(required=False, max_length=64, label="Request id")
