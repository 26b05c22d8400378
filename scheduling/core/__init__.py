"""The pure core of PrfaaS: no Django, no Redis, no I/O beyond reading files it is given."""
