"""Probe the installed torch's CUDA graph and memory-pool APIs (run on the GPU machine).

Answered (run 3, `bench/results/2026-11-29-h200/RUNS.md`): which graph and memory-pool calls the installed torch has; an empty segment releases its pool (hence the pool's anchor graph).
"""

import traceback
import warnings

import torch

print("torch", torch.__version__)
pool = torch.cuda.MemPool()
print("mempool id", pool.id)
stream = torch.cuda.Stream()
x = torch.randn(16, device="cuda")
with torch.cuda.stream(stream):
    for label, body in [("empty", lambda: None), ("one kernel", lambda: x * 2)]:
        g = torch.cuda.CUDAGraph()
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                g.capture_begin(pool=pool.id, capture_error_mode="thread_local")
                body()
                g.capture_end()
            print(label, "ok; warnings:", [str(w.message)[:80] for w in caught])
            g.replay()
            g.reset()
            print(label, "replay+reset ok")
        except Exception:
            traceback.print_exc()
    g = torch.cuda.CUDAGraph()
    g.capture_begin(pool=pool.id)
    y = x * 3
    g.capture_end()
segs = [s for s in torch.cuda.memory_snapshot() if tuple(s.get("segment_pool_id", ())) == tuple(pool.id)]
print("segments in pool:", len(segs), sum(s["total_size"] for s in segs), "keys:", sorted(segs[0]) if segs else None)
