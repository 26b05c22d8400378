"""The OpenAI-compatible PD gateway that carries PrfaaS decisions out on real engines
(``python -m fleet.gateway --config gateway.yaml``; see docs/gateway.md)."""
