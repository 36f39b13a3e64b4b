#!/usr/bin/env bash
# A GPU session's one prepared entry (issue 45): install the offline bundle (`trident bundle`, made
# where there is network and carried as .bundle/), then run bench/gpu_check.py (the engine alone) and
# bench/gpu_serve.py (the whole deployment) within the time given. Their JSON files, this session's
# log and the tails of the services' logs go to $OUT where it is set (at most 8 files, none in a
# folder), else stay in .trident/.
#
#   bench/gpu_session.sh [all|check|serve] [SECONDS]
#
# all (default): both in one run of SECONDS (default 570: under a device run's 10 minutes), gpu_check
# without its contract tests and at most 200 s of it, gpu_serve the rest (its deadline; what does not
# fit is skipped, each skip recorded). check, serve: one alone (gpu_check with its contract tests,
# gpu_serve with up to 480 s), for a session that makes two runs. GPU_SESSION_FLAGS go to both
# scripts (`--cpu` rehearses the whole session on a machine without a GPU).
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-all}
BUDGET=${2:-570}
START=$(date +%s)
RESULTS=${OUT:-.trident}
mkdir -p "$RESULTS" .trident
LOG="$RESULTS/gpu_session.log"
exec > >(tee -a "$LOG") 2>&1
export PYTHONUNBUFFERED=1
EXTRA=${GPU_SESSION_FLAGS:-}

left() { echo $((BUDGET - ($(date +%s) - START))); }

echo "gpu_session: $MODE within ${BUDGET} s, $(date -u +%FT%TZ)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
BUNDLE=${TRIDENT_BUNDLE:-.bundle}  # elsewhere only in its rehearsal (tests/bench/test_gpu_session.py)
SITE=${TRIDENT_BUNDLE_SITE:-/tmp/trident-site}
if ! SHELL_LINES=$(python3 -m trident.bundle install --dir "$BUNDLE" --target "$SITE"); then
    echo "gpu_session: the bundle did not install (make it with \`trident bundle\` and carry .bundle)"
    exit 2
fi
eval "$SHELL_LINES"
export PYTHONPATH="$PWD:$PYTHONPATH"

status=0
if [[ $MODE == all || $MODE == check ]]; then
    if [[ $MODE == all ]]; then limit=200; flags=(--skip-tests); else limit=$(($(left) - 10)); flags=(); fi
    # Its contract tests run last, in what is left of the deadline; the timeout only catches a hang.
    timeout -k 10 "$limit" python3 bench/gpu_check.py --out "$RESULTS/gpu_check.json" "${flags[@]}" \
        --deadline $((limit - 15)) $EXTRA \
        | tail -n 40 || status=1
fi
if [[ $MODE == all || $MODE == serve ]]; then
    deadline=$(($(left) - 30))
    if ((deadline > 480)); then deadline=480; fi
    # The check keeps to its deadline; the timeout only catches a check that does not.
    timeout -k 10 $((deadline + 20)) python3 bench/gpu_serve.py --deadline "$deadline" $EXTRA \
        --out "$RESULTS/gpu_serve.json" --logs .trident/gpu_serve_logs | tail -n 40 || status=1
    # The last lines of every service's log, failed runs' first: what a reader needs to say why.
    for log in .trident/gpu_serve_logs/*/.trident/logs/*.log .trident/gpu_serve_logs/*/*.log; do
        [[ -f $log ]] && { echo "=== $log"; tail -n 30 "$log"; }
    done 2>/dev/null | tail -c 4000000 > "$RESULTS/gpu_serve_logs.txt"
fi
echo "gpu_session: done in $(($(date +%s) - START)) s, status $status; results in $RESULTS"
exit $status
