"""`trident up` / `trident down`: run compose.yaml's services as local processes where there is no Docker.

- compose_file.py: read compose.yaml (interpolation, x-trident-up) and plan the processes of a method
- processes.py: start, restart and stop the service processes, each with its log file
- deployment.py: one running `trident up`: servers, processes, readiness, supervision, shutdown
- state.py: .trident/up.json, which `trident down` reads
- compose_follow.py: `trident follow-plan`, a Docker Compose deployment following the planner
- commands.py: the typer commands
"""

from common.launcher.commands import down, follow_plan, up

__all__ = ["down", "follow_plan", "up"]
