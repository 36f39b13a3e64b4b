"""`trident bench`: open-loop load against any OpenAI-compatible server, SLO attainment and goodput."""
