"""`python -m services.encoder`: a stage worker with the encode role only."""

from services.worker.main import main

main(roles="encode")
