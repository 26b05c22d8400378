"""The fleet agent: runs beside engines, feeds their KV events, load and link egress in.

``python -m fleet.agent --config agent.yaml``; see docs/agent.md and :mod:`fleet.agent.agent`.
"""
