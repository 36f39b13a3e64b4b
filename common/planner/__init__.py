"""The planner: workloads, traces, a simulator of deployments, and Algorithm 2."""
