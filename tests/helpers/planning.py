"""Stage curves the planner's tests simulate with: round numbers whose consequences can be worked out
by hand."""

from __future__ import annotations

from common.planner.profiles import StageCurves

# Encode 0.1 s an image, prefill 1 ms a token, decode 20 ms a step whatever the batch.
CURVES = StageCurves(
    encode=((1, 0.1), (2, 0.2)),
    prefill=((1, 0.001), (1000, 1.0)),
    decode=((1, 16, 0.02), (64, 16, 0.02), (1, 4096, 0.02), (64, 4096, 0.02)),
    num_kv_blocks=64,
)
