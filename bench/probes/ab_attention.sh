#!/usr/bin/env bash
# A/B of fast mode's attention patches (patches/attention.py) in back-to-back processes on one GPU:
# "on" is fast mode as shipped, "off" the same with the adapter's attention patch removed (Qwen-Image:
# the CFG batch's masked attention; Z-Image: diffusers' default SDPA choice, flash). Answered (run 32,
# bench/results/2026-11-30-h200/RUNS.md): per-prompt attention helps Qwen-Image, cuDNN helps Z-Image only.
#   PYTHONPATH=... bash bench/probes/ab_attention.sh OUT_DIR qwen-image z-image
set -uo pipefail
out=$1; shift
[ $# -gt 0 ] || { echo "usage: bench/probes/ab_attention.sh OUT_DIR qwen-image|z-image ..." >&2; exit 2; }
for pipeline in "$@"; do
  for state in on off; do
    if [ "$pipeline" = qwen-image ]; then
      adapter=QwenImageAdapter; module=qwenimage; args=(--steps 10 --guidance 4 --modes fast,fast-unbatched)
    else
      adapter=ZImageAdapter; module=zimage; args=(--steps 8 --guidance 0 --modes fast)
    fi
    timeout 280 python3 - "$pipeline" "$state" "$out" "${args[@]}" > "$out/ab-$pipeline-$state.log" 2>&1 <<PY
import runpy, sys
pipeline, state, out, *args = sys.argv[1:]
if state == "off":
    from bcg_diffusion.patches.attention import QWEN_ATTENTION_PATCH, ZIMAGE_ATTENTION_PATCH
    from bcg_diffusion.pipelines.$module import $adapter as adapter
    adapter.fast_patches = tuple(p for p in adapter.fast_patches if p not in (QWEN_ATTENTION_PATCH, ZIMAGE_ATTENTION_PATCH))
sys.argv = ["bench", "--pipeline", pipeline, "--weights", "random-full", "--resolutions", "512x512", "--warmup", "0",
            "--runs", "5", "--profile", "--no-progress", "--out", f"{out}/ab-{pipeline}-{state}", *args]
runpy.run_module("bench", run_name="__main__")
PY
    echo "== $pipeline attention patch $state"
    grep -v "^DEBUG" "$out/ab-$pipeline-$state.log" | grep -E "^\| fast|kind|wall time"
  done
done
