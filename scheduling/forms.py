"""Page forms of the scheduling app: the what-if knobs and the KV calculator."""

from __future__ import annotations

import math
from typing import Any

from django import forms

from clusters.models import Accelerator, Link, ModelProfile, PerformanceProfile
from scheduling import whatif

MAX_TOKENS = 10_000_000


class FiniteFloatField(forms.FloatField):
    """A float that must be a real number (Django's FloatField already refuses inf/nan text)."""

    def clean(self, value: Any) -> float | None:
        result: float | None = super().clean(value)
        if result is not None and not math.isfinite(result):
            raise forms.ValidationError("must be a finite number")
        return result


class WhatIfForm(forms.Form):
    """A what-if run: the deployment, its workload, and the knobs to turn."""

    source = forms.ChoiceField(help_text="a scenario file, or the current inventory")
    workload = forms.ChoiceField(help_text="whose traffic drives an inventory run")
    rate_per_s = FiniteFloatField(
        required=False,
        min_value=0.001,
        label="Arrival rate (req/s)",
        help_text="empty: the scenario's (inventory: the last 15 min observed)",
    )
    requests = forms.IntegerField(min_value=1, max_value=whatif.MAX_REQUESTS, initial=2000)
    link_gbps = FiniteFloatField(
        required=False,
        min_value=0,
        label="Link capacity (Gbps)",
        help_text="every link; empty: as is",
    )
    prfaas_instances = forms.IntegerField(
        required=False, min_value=0, max_value=1000, label="PrfaaS instances"
    )
    pd_prefill_instances = forms.IntegerField(
        required=False, min_value=0, max_value=1000, label="PD prefill instances"
    )
    pd_decode_instances = forms.IntegerField(
        required=False, min_value=1, max_value=1000, label="PD decode instances"
    )
    threshold = FiniteFloatField(
        required=False, min_value=0, label="Threshold t (tokens)", help_text="empty: the planner's"
    )
    seed = forms.IntegerField(min_value=0, max_value=2**31 - 1, initial=0)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        files = [(name, name) for name in whatif.scenario_choices()]
        source, workload = self.fields["source"], self.fields["workload"]
        assert isinstance(source, forms.ChoiceField) and isinstance(workload, forms.ChoiceField)
        source.choices = [(whatif.INVENTORY, "current inventory"), *files]
        workload.choices = files
        default = "paper-case-study.yaml"
        if default in dict(files):
            self.fields["source"].initial = default
            self.fields["workload"].initial = default

    def params(self) -> whatif.WhatIfParams:
        return whatif.WhatIfParams(**self.cleaned_data)


class KvCalculatorForm(forms.Form):
    """Model x accelerator x length, N instances, against a link or a capacity."""

    model = forms.ModelChoiceField(queryset=ModelProfile.objects.order_by("name"))
    accelerator = forms.ModelChoiceField(queryset=Accelerator.objects.order_by("name"))
    tokens = forms.IntegerField(
        min_value=1, max_value=MAX_TOKENS, initial=32768, label="Length (tokens)"
    )
    instances = forms.IntegerField(
        min_value=1, max_value=10_000, initial=4, label="Prefill instances N"
    )
    link = forms.ModelChoiceField(
        queryset=Link.objects.select_related("source", "target"),
        required=False,
        help_text="compare with an inventory link…",
    )
    link_gbps = FiniteFloatField(required=False, min_value=0.001, label="…or a capacity (Gbps)")

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        model, accelerator = data.get("model"), data.get("accelerator")
        if model is not None and accelerator is not None:
            profile = PerformanceProfile.objects.filter(
                model=model, accelerator=accelerator
            ).first()
            if profile is None:
                self.add_error(
                    "accelerator", f"no performance profile for {model} on {accelerator}"
                )
            data["profile"] = profile
        if data.get("link") is not None and data.get("link_gbps") is not None:
            self.add_error("link_gbps", "give a link or a capacity, not both")
        return data
