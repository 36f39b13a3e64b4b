"""`python -m services.worker`: a stage worker whose roles come from TRIDENT_ROLES, with every stage's
handler (composed in services/stages.py, outside this package)."""

from services.stages import main

main()
