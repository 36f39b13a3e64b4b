"""What test modules share: deployments, requests, probes of a running service, oracles, checkpoint
checks. A test module imports these from here, never from another test module or a conftest
(tests/test_layout.py checks it), so that a module can be moved or deleted on its own."""
