#!/usr/bin/env bash
# Issue #5's GPU check in one command, for a session that is lent a GPU (the device tool runs it
# in the repository root with $OUT set):
#
#     run(command="bash bench/gpu_session.sh", timeout_s=590)
#
# Steps, each with its own time limit, each appending its result under $OUT as soon as it ends (a
# step that runs long costs only itself): the environment, `freetoken probe` (cached, so the
# bench does not measure again inside its timing), the `cuda` variants of the placement tests
# (logits within 1e-4 of transformers, or of the cpu backend for int8 / int4 experts, with dense
# weights and KV in VRAM), the Triton experts' test and kernel bench on the GPU,
# bench/residency_gpu.py (measured decode tok/s next to the simulator's), and the bench again
# with the accelerator's experts through torch and with int4 experts. The package is used
# from this checkout (PYTHONPATH); torch with CUDA, numba, safetensors, transformers, typer and
# rich must be installed (the device image has them). Seven files come back (the device tool
# returns at most eight): steps.txt (each step's status), log.txt (the environment, then each
# step's output and the tail of its stderr), probe.json, gpu_moe_kernels.json, residency_gpu.json,
# residency_gpu_torch.json, residency_gpu_int4.json; the profile cache stays on the machine.
# Exit status: 0 when every step passed, 1 when one failed or ran out of time or the cuda
# placement tests did not all pass (steps.txt says which), 3 at once without a CUDA GPU, 4 when
# torch does not import, 2 when $OUT is not a folder.
set -u
: "${OUT:?set OUT to the folder the results go to}"
[ -d "$OUT" ] || { echo "OUT=$OUT is not a directory" >&2; exit 2; }
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export FREETOKEN_CACHE_DIR="${FREETOKEN_CACHE_DIR:-/tmp/freetoken-cache}"
PY="${PYTHON:-python3}"
SCRATCH=$(mktemp -d)     # each step's own output; what comes back is appended to $OUT/log.txt
log() { echo "$(date -u +%H:%M:%S) $*" | tee -a "$OUT/steps.txt"; }

"$PY" - > "$SCRATCH/env.txt" 2>&1 <<'PYEOF'
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
{ echo "=== environment (rc=$rc)"; cat "$SCRATCH/env.txt"; } >> "$OUT/log.txt"
case $rc in
    0) ;;
    3) log "environment: no CUDA GPU, stopping"; exit 3 ;;
    4) log "environment: torch does not import, stopping"; exit 4 ;;
    *) log "environment check failed (rc=$rc, see log.txt), stopping"; exit 1 ;;
esac
log "environment ok: $(tail -1 "$SCRATCH/env.txt")"

fail=0
step() {   # step NAME SECONDS OUTPUT COMMAND...: run it under its limit, log its status and output
    local name=$1 limit=$2 out=$3; shift 3
    log "$name"
    timeout -k 10 "$limit" "$@" > "$out" 2> "$SCRATCH/step.err"
    local r=$?
    log "$name rc=$r$( { [ $r -eq 124 ] || [ $r -eq 137 ]; } && echo ' (time limit)')"
    { echo "=== $name (rc=$r)"; [ "${out%.json}" = "$out" ] && cat "$out"
      echo "--- stderr, last 40 lines"; tail -40 "$SCRATCH/step.err"; } >> "$OUT/log.txt"
    [ $r -eq 0 ] || fail=1
}
# the limits and their 10 s kill grace stay under the 590 s the device call is given, with 30 s
# left for the environment check (measured on the H200, 2026-12-04: probe 87 s, placement 79 s,
# Triton test 24 s, kernel bench 8 s, residency_gpu 27 s with its checkpoint built, torch 12 s)
step probe 100 "$OUT/probe.json" "$PY" -m freetoken_py probe --json
# the float and the quantised (int8 / int4 experts) placement tests' cuda variants, and the
# page-locking of host memory in place (utils/host_memory) on the real driver
step "placement test (cuda)" 95 "$SCRATCH/placement.txt" \
    "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_residency_executor.py tests/test_expert_store.py \
    -k "(placement and cuda) or cuda_registration"
if ! grep -q "6 passed" "$SCRATCH/placement.txt"; then    # every cuda test ran (not skipped)
    log "placement test: the six cuda tests did not all pass"
    fail=1
fi
# the accelerator's Triton experts against torch on the GPU (skipped, and said so, without Triton)
step "triton experts test" 55 "$SCRATCH/gpu_moe.txt" \
    "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_gpu_moe.py -k "match_the_torch_reference"
# one decode layer-step of Qwen3-30B's experts: Triton against torch, GB/s against the VRAM roofline
step "triton experts bench" 45 "$SCRATCH/gpu_moe_kernels.txt" \
    "$PY" bench/gpu_moe_kernels.py --out "$OUT/gpu_moe_kernels.json"
step residency_gpu 60 "$SCRATCH/residency_gpu.txt" "$PY" bench/residency_gpu.py --out "$OUT/residency_gpu.json"
# the same with the accelerator's experts through torch: what the Triton kernels change
step "residency_gpu (torch experts)" 45 "$SCRATCH/residency_gpu_torch.txt" \
    "$PY" bench/residency_gpu.py --torch-experts --decode-tokens 16 --out "$OUT/residency_gpu_torch.json"
# the experts in int4 on every tier (28 % of bf16's bytes per slot and per copy at g = 32)
step "residency_gpu (int4 experts)" 90 "$SCRATCH/residency_gpu_int4.txt" \
    "$PY" bench/residency_gpu.py --expert-dtype int4 --decode-tokens 16 --out "$OUT/residency_gpu_int4.json"
exit $fail
