"""The fleet edge: programs that run beside engines and routers, outside the control plane.

No Django here (import-linter keeps it so): the router client, the agent that feeds real
engines' KV events and metrics in, the fleet emulator, and helpers such as vLLM's block hashing.
"""
