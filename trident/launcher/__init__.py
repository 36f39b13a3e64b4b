"""compose.yaml's services as local processes where there is no Docker: `trident up`, and the same
parts for the benchmarks and the tests.

- specs.py: the local process of each compose service replica (command, environment, threads)
- processes.py: start, restart and stop one service process, with its log file
- cluster.py: servers and service processes started and stopped under a caller's control
- deployment.py: one running `trident up`: a cluster under supervision, its state file, plan following
- local_up.py: `trident up` run as a child process and read through its state file (benchmarks, tests)
- child_server.py: a server run as a child (`trident up`, a peer): started, waited on, stopped in order
- state.py: .trident/up.json, which `trident down` reads
- follow.py, compose_follow.py: following the planner's plans (locally, and under Docker Compose)
"""
