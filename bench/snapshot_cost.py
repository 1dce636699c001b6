"""What the hybrid prefix-state cache's rolling decode snapshot costs at the real Qwen3.6-35B-A3B
state size (30 Gated DeltaNet layers: 8192-channel conv x 3 and 32 heads x 128 x 128, fp32: 66 MB
per request), against a decode step, interleaved rounds.

    python bench/snapshot_cost.py [--rounds 5] [--threads 2] [--page-size 16] [--layers 4]
                                  [--experts 32] [--precision int4] [--no-model]

While a hybrid request decodes, every page boundary it crosses copies its recurrent state into
its rolling snapshot (kvcache/snapshots.py, scheduler/prefix_state.py), so a decoded token pays
1/page_size of one copy. Before, each copy was also checksummed (the sum of the state's 32-bit
words into a 64-bit total); now the copy is left unsealed and checksummed once, when the request
publishes it, with the 64-bit word sum. Per round, interleaved: the copy + old checksum (the old
per-page work), the copy alone (the new per-page work), the old and new checksums, the GDN part
of a decode step at this state size (kernels/cpu_gdn.gdn_core over the 30 layers' states: one
token, one request: it reads and writes the whole state, a floor for the real model's step), and
(unless --no-model) a decode token of bench/hybrid_decode.py's real-width checkpoint (--layers in
the 3:1 pattern, --precision experts) scaled to the real model's 40 layers (a floor too: the real
model's 248K-token vocabulary and 256 experts only add to it). Prints one JSON line: per-page and
per-token milliseconds (medians), the shares of the decode step before and now, and the counted
work per page (bytes copied / checksummed, from the store's counters).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

GDN_LAYERS, CONV_DIM, CONV_WIDTH, HV, HK, DK, DV = 30, 8192, 3, 32, 16, 128, 128  # Qwen3.6-35B-A3B
REAL_LAYERS = 40


def _old_checksum(pool, slot: int) -> int:
    """The checksum the store computed before (32-bit words summed into a 64-bit total)."""
    import numpy as np

    return sum(int(np.sum(t[slot].numpy().view(np.uint32), dtype=np.uint64))
               for t in pool.conv + pool.rec if t is not None)


def _ms(fn, reps: int = 3) -> float:
    best = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best.append(time.perf_counter() - t)
    return common.median(best) * 1e3


def _gdn_step(pool, slot: int):
    """A closure running the GDN core of one decode token over every layer's state of `slot`."""
    import numpy as np

    from freetoken_py.kernels.cpu_gdn import gdn_core

    rng = np.random.default_rng(0)
    C = 2 * HK * DK + HV * DV
    qkv = rng.standard_normal((1, 1, C), dtype=np.float32)
    z = rng.standard_normal((1, 1, HV * DV), dtype=np.float32)
    b, a = (rng.standard_normal((1, 1, HV), dtype=np.float32) for _ in range(2))
    conv_w = rng.standard_normal((C, CONV_WIDTH + 1), dtype=np.float32) * 0.1
    A_log, dt_bias = np.zeros(HV, np.float32), np.zeros(HV, np.float32)
    norm = np.ones(DV, np.float32)
    out = np.empty((1, 1, HV * DV), np.float32)
    slots = np.array([slot], np.int64)
    layers = [(c.numpy(), r.numpy()) for c, r in zip(pool.conv, pool.rec) if c is not None]

    def step():
        for cs, rs in layers:
            gdn_core(qkv, z, b, a, conv_w, cs, rs, slots, A_log, dt_bias, norm, 1e-6, HK, DK, out)
    return step


def _model_decode(args):
    """ms per decoded token of the real-width checkpoint (None when --no-model) as a timer."""
    if args.no_model:
        return None, None
    import hybrid_decode
    from cpu_decode import PAIRS

    from freetoken_py.core import SamplingParams
    from freetoken_py.llm import LLM

    name = f"qwen35moe-real-l{args.layers}-e{args.experts}"
    model_dir = hybrid_decode.build(common.WORK / name, hybrid_decode.REAL, args.layers, args.experts)
    expert, dense, _ = PAIRS[args.precision]
    llm = LLM(model_dir, dtype="bfloat16", backend="cpu", expert_dtype=expert, dense_dtype=dense, max_num_seqs=1,
              max_model_len=1024, show_progress=False, enable_prefix_cache=False)
    prompt = common.random_prompt(hybrid_decode.REAL["vocab_size"], 64)
    n = 16

    def decode_ms():
        out = llm.generate([prompt], SamplingParams(max_tokens=n + 1, temperature=0, ignore_eos=True))[0]
        return (out.total_s - out.ttft_s) / n * 1e3
    decode_ms()  # warm-up (compile, page-in)
    return name, decode_ms


def main() -> None:
    ap = common.bench_args(__doc__)
    ap.set_defaults(rounds=5)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--precision", default="int4", help="the checkpoint's expert/dense precision (bf16, int8, int4)")
    ap.add_argument("--no-model", action="store_true", help="skip the model decode step (the GDN step only)")
    args = ap.parse_args()
    from freetoken_py.kernels import configure_threads
    from freetoken_py.kvcache.snapshots import SnapshotStore
    from freetoken_py.kvcache.spec import Recurrent
    from freetoken_py.kvcache.state import StatePool

    configure_threads(args.threads)
    pool = StatePool([Recurrent(CONV_DIM, CONV_WIDTH, HV, DK, DV)] * GDN_LAYERS, 3)
    store = SnapshotStore(pool, 1)
    req = pool.allocate()
    for t in pool.conv + pool.rec:
        t[req].normal_()
    ref = store.take(req, "ns", args.page_size, seal=False)
    step = _gdn_step(pool, req)
    step()  # compile
    model, decode_ms = _model_decode(args)
    copied, summed = store.bytes_copied, store.bytes_checksummed
    ref = store.retake(ref, req, 2 * args.page_size)            # the per-page work now, counted once
    per_page_bytes = {"copied": store.bytes_copied - copied, "checksummed": store.bytes_checksummed - summed}
    rows = {k: [] for k in ("copy_and_old_checksum", "copy", "old_checksum", "new_checksum", "gdn_step", "model_token")}
    for r in range(args.rounds):
        rows["copy_and_old_checksum"].append(_ms(lambda: (pool.copy(req, ref.slot), _old_checksum(pool, ref.slot))))
        rows["copy"].append(_ms(lambda: store.retake(ref, req, 2 * args.page_size)))
        rows["old_checksum"].append(_ms(lambda: _old_checksum(pool, ref.slot)))
        rows["new_checksum"].append(_ms(lambda: store.checksum(ref.slot)))
        rows["gdn_step"].append(_ms(step))
        if decode_ms is not None:
            rows["model_token"].append(decode_ms())
        common.log(f"round {r}: " + ", ".join(f"{k} {v[-1]:.2f} ms" for k, v in rows.items() if v))
    med = {k: round(common.median(v), 3) for k, v in rows.items() if v}
    P = args.page_size
    before, now = med["copy_and_old_checksum"] / P, med["copy"] / P   # per decoded token
    result = {"bench": "snapshot_cost", "threads": args.threads, "rounds": args.rounds, "page_size": P,
              "gdn_layers": GDN_LAYERS, "state_bytes": pool.bytes_per_slot,
              "per_page_ms": {"before_copy_and_checksum": med["copy_and_old_checksum"], "now_copy": med["copy"],
                              "old_checksum": med["old_checksum"], "new_checksum": med["new_checksum"]},
              "per_page_bytes_now": per_page_bytes,
              "publish_checksum_ms_per_request": med["new_checksum"],
              "per_token_ms": {"before": round(before, 3), "now": round(now, 3)},
              "gdn_decode_step_ms": med["gdn_step"],
              "share_of_gdn_step": {"before": round(before / med["gdn_step"], 4),
                                    "now": round(now / med["gdn_step"], 4)},
              "samples": {k: [round(x, 2) for x in v] for k, v in rows.items() if v}}
    if decode_ms is not None:
        real = med["model_token"] * REAL_LAYERS / args.layers
        result |= {"model": f"{model} ({args.precision})", "model_decode_token_ms": med["model_token"],
                   "est_real_decode_token_ms": round(real, 2),
                   "share_of_est_real_decode_step": {"before": round(before / real, 4), "now": round(now / real, 4)}}
    common.emit(result)


if __name__ == "__main__":
    main()
