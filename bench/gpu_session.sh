#!/usr/bin/env bash
# Issue #5's GPU check in one command, for a session that is lent a GPU (the device tool runs it
# in the repository root with $OUT set):
#
#     run(command="bash bench/gpu_session.sh", timeout_s=590)
#
# Steps, each with its own time limit, each writing its result under $OUT as soon as it ends (a
# step that runs long costs only itself): the environment, `freetoken probe` (cached, so the
# bench does not measure again inside its timing), the `cuda` variants of the placement test
# (logits within 1e-4 of transformers with dense weights and KV in VRAM), and
# bench/residency_gpu.py (measured decode tok/s next to the simulator's). The package is used
# from this checkout (PYTHONPATH); torch with CUDA, numba, safetensors, transformers, typer and
# rich must be installed (the device image has them). Seven files come back; the profile cache
# stays on the machine. Exit status: 0 when every step passed, 1 when one failed or ran out of
# time (steps.txt says which), 3 at once without a CUDA GPU, 4 when torch does not import.
set -u
: "${OUT:?set OUT to the folder the results go to}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export FREETOKEN_CACHE_DIR="${FREETOKEN_CACHE_DIR:-/tmp/freetoken-cache}"
PY="${PYTHON:-python3}"
log() { echo "$(date -u +%H:%M:%S) $*" | tee -a "$OUT/steps.txt"; }

"$PY" - > "$OUT/env.txt" 2>&1 <<'PYEOF'
import sys
try:
    import torch
except Exception as exc:
    print("torch does not import:", exc)
    sys.exit(4)
print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)
if not torch.cuda.is_available():
    print("no CUDA GPU visible to torch")
    sys.exit(3)
print(torch.cuda.get_device_name(0), torch.cuda.mem_get_info())
PYEOF
rc=$?
if [ $rc -eq 4 ]; then log "environment: torch does not import, stopping"; exit 4; fi
if [ $rc -ne 0 ]; then log "environment: no CUDA GPU (rc=$rc), stopping"; exit 3; fi
log "environment ok: $(tail -1 "$OUT/env.txt")"

fail=0
step() {   # step NAME SECONDS OUTPUT COMMAND...: run it under its limit, log its status
    local name=$1 limit=$2 out=$3; shift 3
    log "$name"
    timeout -k 10 "$limit" "$@" > "$out" 2>> "$OUT/steps.err"
    local r=$?
    log "$name rc=$r$([ $r -eq 124 ] && echo ' (time limit)')"
    [ $r -eq 0 ] || fail=1
}
step probe 200 "$OUT/probe.json" "$PY" -m freetoken_py probe --json
step "placement test (cuda)" 120 "$OUT/placement.txt" \
    "$PY" -m pytest -q -p no:cacheprovider tests/test_residency_executor.py -k "placement and cuda"
step residency_gpu 240 "$OUT/residency_gpu.txt" "$PY" bench/residency_gpu.py --out "$OUT/residency_gpu.json"
exit $fail
