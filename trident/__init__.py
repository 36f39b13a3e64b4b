"""Trident as its users drive it, beside the services it runs (services/) and the code they share (common/).

- cli/: the `trident` command (make-model, up/down, generate, plan, top, bench)
- launcher/: compose.yaml's services as local processes, for `trident up`, the benchmarks and the tests
- bench/: the benchmark harness: workloads, clients, metrics, peers and the HF oracle (scripts in bench/)
"""
