"""The pure core of the control plane: routing, planning, queueing and simulation code that
imports no Django, no Redis and no other side of the project, and works on frozen dataclasses.
The planner, the router, the simulator and the Django services all call into it."""
