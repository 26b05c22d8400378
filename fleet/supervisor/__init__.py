"""The fleet supervisor: the engines of one host, run from a config file, restarted in a new
role when a plan flips one (the control plane's ``process`` actuator,
:mod:`scheduling.actuators.process`). No Django; see ``docs/actuators.md``.

* :mod:`~fleet.supervisor.config`: the file (engines, their commands, ports, roles);
* :mod:`~fleet.supervisor.processes`: one engine process and its agent, started and stopped;
* :mod:`~fleet.supervisor.supervisor`: every engine kept running, and the flip;
* :mod:`~fleet.supervisor.api`: the signed ``POST /v1/steps`` the actuator calls.
"""
