"""`python -m services.decode`: a stage worker with the decode role only."""

from services.worker.main import main

main(roles="decode")
