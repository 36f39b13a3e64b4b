"""`python -m services.prefill`: a stage worker with the prefill role only."""

from services.worker.main import main

main(roles="prefill")
