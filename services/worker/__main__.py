"""`python -m services.worker`: a stage worker whose roles come from TRIDENT_ROLES."""

from services.worker.main import main

main()
