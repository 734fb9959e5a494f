#!/usr/bin/env bash
# Runs the GPU checks of bcg-diffusion on the device machine, one phase per call (each fits in 10 min).
#
# Prepare here first (the device cannot download anything; .whl/ is git-ignored and must be carried):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 -d .whl diffusers==0.42.1 importlib_metadata torchao==0.17.0 gguf \
#     cache-dit==1.5.3 nvidia-cudnn-frontend==1.23.0   (without cache-dit, the Cache-DiT tests skip and the
#     +cachedit modes fail; without the cuDNN frontend, attention="fp8" runs our Triton kernel instead of cuDNN's)
# Then, with the device tool (carry [".whl"]):  bash scripts/gpu_session.sh PHASE [PHASE ...]
# FlashAttention-4 (attention="fa4") needs flash-attn-4 and the CuTe DSL's libraries, whose CUDA 13 wheel (92 MB) is
# over one call's limit: it travels xz-compressed in two parts, one per call, on one warm machine:
#   pip download --no-deps (as above) flash-attn-4==4.0.0b40 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1
#     nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 apache-tvm-ffi==0.1.15.post2
#     torch-c-dlpack-ext==0.1.5 quack-kernels==0.6.5; unzip the cu13 wheel into a folder, tar it, xz -9e it, split the
#     .tar.xz in two (head -c 26000000 > .fa4a/cu13.tar.xz.part1, the rest > .fa4b/cu13.tar.xz.part2), the other
#     wheels in .fa4a/ (/.fa4a/ and /.fa4b/ in .git/info/exclude);
#   first call (carry [".whl", ".fa4a"]): bash scripts/gpu_session.sh fa4-stage [PHASE ...]
#   next call  (carry [".whl", ".fa4b"]): bash scripts/gpu_session.sh fa4-install tests-fa4 [PHASE ...]
#   later calls on the same machine find it installed (/tmp/fa4site).
#
# Phases:
#   probe-attention  attention kernels alone (SDPA backends, ours in bf16 and FP8, launch settings) and one
#                    Qwen-Image / Z-Image block per attention kernel, with kernel time by class
#                    (bench/probes/probe_attention_kernels.py)
#   tests-kernels    our attention kernels against float32, the GELU epilogue, attention="fp8" on full-size Z-Image
#   bench-kernels-qwen  Qwen-Image 1024², 50 steps, true CFG 4: eager, fast, fast-fp8, fast-fp8-attn, fast-fp8+cache
#   probe-cudnn-fp8  cuDNN's FP8 attention alone against SDPA's cuDNN bf16 kernel and our Triton FP8 kernel, what its
#                    scales cost, its error (bench/probes/probe_cudnn_fp8_attention.py; needs the cudnn-frontend wheel)
#   tests-cudnn-fp8  cuDNN's FP8 attention against its reference; attention="fp8" on full-size Z-Image with each kernel
#   bench-cudnn-fp8-z  Z-Image-Turbo 512² and 1024², 8 steps: eager, fast-fp8, fast-fp8-attn (cuDNN), fast-fp8-attn-triton
#   bench-fused-qkv-z  Z-Image-Turbo 512² and 1024², 8 steps: eager, fast-fp8 (query, key and value in one FP8 product),
#                    fast-fp8-unfused-qkv (three products), fast-fp8-attn
#   tests-fused-qkv  a projection replaced after capture under fast mode with FP8 reaches the images (tiny Z-Image)
#   bench-cudnn-fp8-qwen  Qwen-Image 1024², 50 steps, true CFG 4: eager, fast-fp8, fast-fp8-attn (cuDNN), fast-fp8+cache,
#                    fast-fp8-attn+cache
#   bench-kernels-z  Z-Image-Turbo 512² and 1024², 8 steps: eager, fast, eager-fp8, fast-fp8, fast-fp8-torchao-ff,
#                    fast-fp8-attn, with the loop profile (kernel time by class)
#   bench-cachedit-qwen Qwen-Image 1024², 50 steps, true CFG 4: eager, bcg, fast, eager+cachedit, bcg+cachedit,
#                    fast+cachedit (Cache-DiT with a static mask computing about half of the steps)
#   probe-outside    Z-Image outside the blocks: VAE decode variants (channels-last, compiled blocks, compiled decoder),
#                    the text encoder's layers eager / compiled / FP8, encode_prompt's host share, an FP8 block at 512²
#                    (bench/probes/probe_outside_blocks.py; OUTSIDE_SECTIONS=vae,text-encoder,encode,z-block-512;
#                    VAE_VARIANTS=eager,patched,fused,... picks the decoder variants)
#   probe-block-glue the block-glue kernels (kernels/block_glue.py) against their references on the GPU, then one
#                    Z-Image FP8 block with inductor's glue and with ours, each kernel alone with its launch settings
#   tests-block-glue the block-glue kernels against their references, a Z-Image FP8 block with them (near inductor's
#                    glue, its graph replaying its compiled bytes), tiny Z-Image fast FP8 equal to its compiled blocks,
#                    and an FP8 weight's data assigned after capture reaching the images, exact and fast
#   bench-block-glue-z Z-Image-Turbo 512² and 1024², 8 steps: eager, fast-fp8, fast-fp8-inductor-glue, timed as bench
#                    times by default and again with --stage-syncs (BLOCK_GLUE_MODES picks the modes)
#   qwen-block-glue  the Qwen-Image block-glue kernels against their references, a Qwen-Image FP8 block with them (near
#                    inductor's glue, its graph replaying its compiled bytes), then one full-width Qwen-Image FP8 block
#                    at 1024² CFG with inductor's glue and with ours, each kernel alone with its launch settings
#   fp8-prologue     attention's prologue writing cuDNN's FP8 attention's query and key (qk_prologue.joint_qkv_fp8)
#                    against its bf16 outputs quantized, the Qwen-Image processor with it compiled and replayed, the
#                    stacked output projection (tests/test_stacked_output_cuda.py), then the probes: the prologue's
#                    launch settings (section prologue), its FP8 inputs alone and one Qwen-Image FP8 block, quantized
#                    after the prologue and in it
#   probe-stacked    one Qwen-Image block, bf16 and FP8, with its output projection stacked and joined (probe section
#                    stacked-output), one bf16 Z-Image block with w1 and w3 stacked and apart (w13-bf16)
#   bench-fp8-prologue-qwen Qwen-Image 1024², 50 steps, true CFG 4: eager, fast-fp8, fast-fp8-joined-output (the output
#                    projection on joined rows), fast-fp8-attn (the query and key quantized in the prologue),
#                    fast-fp8-attn+cache (FP8_PROLOGUE_QWEN_MODES picks the modes)
#   bench-stacked-qwen Qwen-Image 1024², 50 steps, true CFG 4: eager, fast, fast-joined-output
#   bench-stacked-qwen-512 the same at 512² (run 149's probe saw the bf16 block 1.7% slower stacked there)
#   tests-fp8-output the attention output projection taking cuDNN's FP8 output as it is
#                    (tests/test_fp8_output_projection_cuda.py), then the FP8-prologue tests again (their bounds)
#   bench-fp8-output-qwen Qwen-Image 1024², 50 steps, true CFG 4: eager, fast-fp8-attn, fast-fp8-all-linears,
#                    fast-fp8-all-linears-attn, fast-fp8-all-linears-attn-scaled-output (FP8_OUTPUT_QWEN_MODES)
#   bench-fp8-output-z Z-Image-Turbo 512² and 1024², 8 steps: eager, fast-fp8-attn, fast-fp8-all-linears,
#                    fast-fp8-all-linears-attn, fast-fp8-all-linears-attn-scaled-output (FP8_OUTPUT_Z_MODES)
#   bench-fp8-prologue-z Z-Image-Turbo 512² and 1024², 8 steps: eager, fast-fp8, fast-fp8-attn-bf16-prologue, fast-fp8-attn
#   bench-block-glue-qwen Qwen-Image 1024², 50 steps, true CFG 4: eager, fast-fp8, fast-fp8-inductor-glue,
#                    fast-fp8-attn, fast-fp8-attn+cache (QWEN_GLUE_MODES picks the modes)
#   tests-vae-fused  the fused channels-last VAE decoders' kernels, the full-size FLUX.1 and Wan 2.1 decoders (tests/test_vae_fused_cuda.py)
#   probe-fp8-ff     the FP8 feed-forward kernels (kernels/activation_fp8.py) against their references on the GPU, then
#                    one Qwen-Image and one Z-Image FP8 block with inductor's kernel and with ours, each kernel alone
#                    with its launch settings; then the bf16 blocks (probe section prologue-blocks)
#   bench-fp8-ff-qwen  Qwen-Image 1024², 50 steps, true CFG 4: eager, fast-fp8, fast-fp8-torchao-ff (our kernel off)
#   tests-published  FP8 attention through diffusers' dispatcher on tiny FLUX.1, FLUX.2 klein, Wan, Qwen-Image-Edit
#                    (128-wide heads), graphs equal to their compiled blocks; Wan 2.2 with only transformer_2; FLUX.1's
#                    single blocks with their output projection split, FLUX.1's FP8 block glue (PUBLISHED_TESTS_K="split or glue")
#   bench-flux       FLUX.1-dev 1024², 28 steps: eager, fast, fast-inductor-glue (the single blocks' output projection
#                    joined), fast-fp8, fast-fp8-inductor-glue (the blocks' glue compiled by inductor), fast-fp8-attn
#                    (PUBLISHED_MODES, PUBLISHED_RUNS)
#   bench-flux-controlnet  FLUX.1-dev with a ControlNet (Union Pro 2.0's six double blocks) 1024², 28 steps: eager,
#                    bcg, bcg-no-controlnet, fast, fast-no-controlnet (the ControlNet's forward as graphs, the
#                    default, or eager; PUBLISHED_RESOLUTIONS=512x512,1024x1024 for the launch-bound size too)
#   bench-klein      FLUX.2 klein 4B 1024², 4 steps: eager, bcg, fast, fast-fp8, fast-fp8-attn
#   bench-wan        Wan 2.1 T2V 14B 832x480x81, 3 steps, CFG 5: eager, fast-fp8-attn, one timed run (per-step time)
#   bench-qwen-edit  Qwen-Image-Edit-2511 1024², 8 steps, true CFG 4: eager, fast, fast-fp8, fast-fp8-attn
#   bench-hunyuan-image  HunyuanImage 2.1 2048², 8 steps, its guider's CFG 3.5: eager, fast, fast-fp8, fast-fp8-attn
#                    (each mode beside its own eager: the pipeline's --modes-apart)
#   tests-key-padding  cuDNN's FP8 attention and FlashAttention-4 with key lengths (masks that hide keys only) against
#                    masked attention, replayed from graphs; tiny HunyuanImage in fast mode with each
#   bench-text-encoders  FLUX.2 klein (eager, bcg, bcg-no-te, fast, fast-no-te, fast-fp8-attn; TE_KLEIN_MODES) and FLUX.1-dev
#                    (eager, bcg, bcg-te, fast, fast-te; TE_FLUX_MODES) at 1024² with --text-encoders: their
#                    text encoders built with random weights, a prompt encoded in every call
#   flux-prologue    FLUX's attention prologue kernel against its reference at FLUX.1's shapes, then FLUX.1-dev 1024²,
#                    28 steps, each fast mode with our prologue and with inductor's (FLUX_PROLOGUE_MODES, PUBLISHED_RUNS)
#   probe-flux       FLUX.1-dev 1024²: each product of a step (bf16, FP8, fused), and a fast / fast-fp8 / fast-fp8-attn
#                    call's kernels per step (bench/probes/probe_flux.py; FLUX_SECTIONS=gemms or call)
#   probe-wan-vae    Wan's VAE decode of 81 frames at 832x480: eager, channels-last, fast mode's fused decoder (with and
#                    without cuDNN's benchmark), bf16 and fp32, the longest kernels of each (bench/probes/probe_wan_vae.py)
#   probe-vae-coders the VAEs' encode and decode (Qwen-Image 1024² and 512², FLUX.1's 1024², Wan 81 frames at 832x480):
#                    eager, fused with a single frame in 3-D, fused as fast mode runs it (bench/probes/probe_vae_coders.py)
#   probe-cfg-batch-gain  what one batch of FLUX.1's true-CFG pair saves against two calls (512², 1024²; transformer
#                    replayed from a CUDA graph, bench/probes/probe_cfg_batch_gain.py); CFG_BATCH_ARGS="--model wan
#                    --replays 3": Wan 2.1 14B's CFG pair at 832x480x81
#   probe-attention-load  cuDNN's bf16 attention at Edit-2511's and FLUX.1's shapes in two layouts, in bursts, sustained
#                    and between a block's products, with nvidia-smi's SM clock and power (about a minute;
#                    bench/probes/probe_attention_under_load.py, ATTENTION_LOAD_ARGS)
#   readme-rows      Z-Image-Turbo 512² and 1024², 8 steps (eager, bcg, fast, fast-fp8, fast-fp8-attn; 3 runs) and
#                    Qwen-Image 1024², 50 steps, true CFG 4 (eager, fast, fast-fp8, fast-fp8-attn; 2 runs): the README's rows
#   tests-state Python state read by captures and object arguments, exact and fast (tiny)
#   bench-state the per-call check of the Python state: Z-Image-Turbo 512² and Qwen-Image 512² 10 steps CFG 4
#   tests       core + reliability + tiny-pipeline GPU tests (incl. LoRA re-capture, warm-up, buckets, eviction)
#   tests-full  full-size (random-weight) Qwen-Image and Z-Image equality with eager
#   tests-fast  fast mode (compiled blocks in graphs) against its compiled reference, tiny pipelines
#   tests-coexist    our graphs beside reduce-overhead in one process, then the same without the cuBLAS fix (must fail)
#   tests-shared     pipelines sharing components, img2img/inpaint relatives, LoRA hot swap, fast mode after offload
#   tests-cache      step caching inside graphs: every diffusers cache, both pipelines, exact and fast (tiny)
#   bench-cache-qwen-1024  Qwen-Image 1024², 50 steps, true CFG 4: eager, eager+cache, bcg+cache, fast+cache (MagCache)
#   bench-cache-qwen-512   Qwen-Image 512², 50 steps, true CFG 4: eager, bcg, eager+cache, bcg+cache (MagCache)
#   bench-cache-z          Z-Image-Turbo 512² and 1024², 8 steps: eager, fast, eager+cache, fast+cache, compile+cache
#   bench-cfg-cache-qwen   Qwen-Image 1024² then 512², 50 steps, true CFG 4, MagCache: eager+cache, fast-unbatched+cache,
#                    fast+cache (CFG batched in one joint cache context); two runs of up to 570 s each, so alone in a
#                    device call, or one size per call: bench-cfg-cache-qwen-1024, bench-cfg-cache-qwen-512
#   tests-quant      quantize="fp8" and models quantized before accelerate (int8, FP8), exact and fast (tiny)
#   tests-auto       automatic breaks (toy model, every kind; every coverage pipeline, tiny) and GGUF / bitsandbytes
#                    transformers (tiny; bitsandbytes
#                    skips unless its wheel is carried: too big for the carry limit)
#   probe-hand-patches  Qwen-Image 512², 10 steps, CFG 4: exact mode with its hand patch against the capture without it
#   bench-auto       Z-Image-Turbo 512² and 1024² (8 steps) and Qwen-Image 512² (10 steps, CFG 4): our modes with and
#                    without automatic breaks, same run (issue 23: the existing pipelines keep their speed)
#   coverage         every pipeline of bench.coverage at its published size (COVERAGE_PIPELINES to choose;
#                    COVERAGE_MODES=exact or fast and COVERAGE_RUNS=2 to fit a call: all 14 in exact mode took 480 s):
#                    captured, segments and breaks, identical, eager / exact / fast at two sizes. Only 8 files
#                    come back from a call: run it without phases that write many (bench phases write 3 each)
#   bench-fp8-z      Z-Image-Turbo 512² and 1024², 8 steps: eager, fast, eager-fp8, bcg-fp8, fast-fp8
#   bench-fp8-qwen   Qwen-Image 1024², 20 steps, true CFG 4: eager, fast, eager-fp8, fast-fp8
#   warm-start-fp8-z fast mode with quantize="fp8": cold / warm / portable first call, Z-Image 512²
#   probe-fp8-groups FP8 per layer group (each kept in bf16 in turn): PSNR against bf16 eager and latency, Z-Image 1024², exact
#   probe-fp8-block  FP8 GEMMs (row-wise against per-tensor scaling) and one compiled Z-Image block in bf16 and FP8,
#                    with and without max-autotune, and one Qwen-Image block at 1024² CFG (bench/probes/probe_fp8_block.py;
#                    BLOCK_PROBE_SECTIONS=qwen-image for that one only)
#                    (probe-fp8-groups: PROBE_COMPARE=scaling compares the two scalings end to end instead)
#   hotswap-z        LoRA hot swap with graphs kept against drop-and-recapture, full-size Z-Image (bench.hotswap)
#   bench-z          Z-Image-Turbo 512² and 1024², 8 steps, no CFG: every mode, with the loop profile
#   te-z             Z-Image-Turbo 512², 8 steps: eager and our modes with and without the text encoder captured
#   warm-start-z     fast mode's cold / warm / portable-cache start in fresh processes, Z-Image 512²
#   first-call-qwen-none, first-call-qwen-magcache, first-call-qwen-cachedit  the same for Qwen-Image 1024², 50 steps,
#                    true CFG 4, without a cache and with each (about 4 min each: two per device call)
#   first-call-qwen-fp8  the same, fast mode with quantize="fp8" and no cache (the block glue and feed-forward
#                    kernels of ours among what compiles; WARM_TIMEOUT, default 540 s)
#   bench-qwen       Qwen-Image 512² and 1024², 10 steps, true CFG 4: every mode
#   bench-qwen-512   Qwen-Image 512², 50 steps, true CFG 4: every mode
#   bench-qwen-1024  Qwen-Image 1024², 20 steps, true CFG 4: every mode
#   issue2           python -m bench --preset cfg-steps-batch --modes eager,bcg --profile
#   tests-z          Z-Image caption buckets on the GPU (tiny): serving with random prompts, pipeline equality
#   profile-qwen     Qwen-Image 512², 10 steps, true CFG: eager, bcg and fast with the per-step loop profile
#   profile-z        Z-Image-Turbo 512², 8 steps: eager, bcg and fast with the loop profile (kernel time by kind)
#   fast-qwen-50     Qwen-Image 512², 50 steps, true CFG 4: eager, fast, fast-unbatched (issue 6's Qwen-Image figure)
#   ab-attention     fast mode with and without its attention patches (patches/attention.py), Qwen-Image 512²
#                    10 steps CFG 4 and Z-Image-Turbo 512² 8 steps, back-to-back processes (bench/probes/ab_attention.sh)
#   compile-max-qwen Qwen-Image 512² (QWEN_MAX_RESOLUTIONS=1024x1024 for the other size), 10 steps, true CFG 4:
#                    torch.compile(mode="reduce-overhead") alone, a whole call (its first call compiles for 4+ min)
#   probe-floor      where fast mode's time goes outside the matrix products (bench/probes/probe_fast_floor.py)
#   probe-norms      fast mode's VAE group norm and per-slice RoPE against the code they replace
#                    (bench/probes/probe_norm_kernels.py)
#   probe-blocks     one full-width Z-Image block: its matrix products (cuBLAS, fused, Triton, FP8) and
#                    RoPE complex against real arithmetic (bench/probes/probe_block_kernels.py)
#   memory-z         graph memory of 4 resolutions x 2 CFG modes against one, peak replay vs eager (Z-Image)
#   parallel         (two GPUs) context parallelism: tests/test_parallel_cuda.py (tiny: ulysses and ring;
#                    full size: ulysses at 512² and 1024²), then torchrun -m bench.parallel (one GPU against two)
#   parallel-cfg     (two GPUs) true CFG across the GPUs: torchrun -m bench.parallel --parallel cfg, Qwen-Image 1024²
#   serving          warm-up then 50 requests with random prompts (Qwen-Image with text buckets, then Z-Image's exact caption buckets):
#                    captures, misses, latency, equality with eager (bench.serving)
#   demo             app.py --record: one side-by-side demo generation with full-size random Z-Image, saved
#                    for `python scripts/screenshot_replay.py DIR OUT.png` here (the GPU machine has no browser)
# Everything it writes is under $OUT (logs, results.json/.md/.png); copy it to bench/results/<date>-h200/.
set -uo pipefail
[ $# -gt 0 ] || { echo "usage: scripts/gpu_session.sh fa4-stage|fa4-install|tests-fa4|probe-fa4|probe-attention-load|readme-rows|probe-cfg-batch-gain|probe-vae-coders|bench-text-encoders|tests-published|probe-flux|bench-flux|bench-flux-controlnet|bench-klein|bench-wan|bench-qwen-edit|bench-hunyuan-image|tests-key-padding|probe-wan-vae|bench-stacked-qwen-512|tests-fp8-output|bench-fp8-output-qwen|bench-fp8-output-z|fp8-prologue|probe-stacked|bench-fp8-prologue-qwen|bench-stacked-qwen|bench-fp8-prologue-z|qwen-block-glue|bench-block-glue-qwen|probe-attention|probe-cudnn-fp8|tests-vae-fused|bench-fused-qkv-z|tests-fused-qkv|tests-cudnn-fp8|bench-cudnn-fp8-z|bench-cudnn-fp8-qwen|tests-kernels|probe-fp8-ff|bench-fp8-ff-qwen|bench-kernels-qwen|bench-kernels-z|bench-cachedit-qwen|tests-state|bench-state|tests|tests-full|tests-fast|tests-coexist|tests-shared|tests-cache|bench-cache-qwen-1024|bench-cache-qwen-512|bench-cache-z|bench-cfg-cache-qwen|bench-cfg-cache-qwen-1024|bench-cfg-cache-qwen-512|tests-quant|tests-auto|probe-hand-patches|bench-auto|coverage|bench-fp8-z|bench-fp8-qwen|warm-start-fp8-z|probe-fp8-groups|probe-fp8-block|hotswap-z|tests-z|te-z|fast-check|profile-qwen|profile-z|fast-qwen-50|ab-attention|probe-floor|probe-outside|probe-norms|probe-blocks|compile-max-qwen|memory-z|bench-z|warm-start-z|first-call-qwen-none|first-call-qwen-magcache|first-call-qwen-cachedit|first-call-qwen-fp8|bench-qwen|bench-qwen-512|bench-qwen-1024|issue2|parallel|parallel-cfg|serving|demo ..." >&2; exit 2; }
out=${OUT:-/tmp/bcg-out}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
fa4_path() {  # FlashAttention-4 installed by fa4-install: its package and the CuTe DSL's (what its .pth would add)
  export PYTHONPATH=/tmp/site:/tmp/fa4site:/tmp/fa4site/nvidia_cutlass_dsl/dsl_packages:$PWD
}
[ -d /tmp/fa4site/flash_attn ] && fa4_path
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/env.txt"
python3 -c "import torch, diffusers, transformers; print('torch', torch.__version__, 'diffusers', diffusers.__version__, 'transformers', transformers.__version__)" | tee -a "$out/env.txt"

for phase in "$@"; do
case "$phase" in
  tests)
    timeout 200 python3 -m pytest -m cuda -q -rs -p no:cacheprovider --tb=short \
      tests/test_graphs_cuda.py tests/test_reliability_cuda.py tests/test_pipelines_cuda.py tests/test_serving_cuda.py \
      2>&1 | tee "$out/pytest-cuda-tiny.log" | tail -15
    ;;
  fa4-stage)
    mkdir -p /tmp/fa4 && cp .fa4a/* /tmp/fa4/ && ls /tmp/fa4
    ;;
  fa4-install)
    # The cu13 libraries unpacked after the wheels: pip --target skips a folder that exists already
    cat /tmp/fa4/cu13.tar.xz.part1 .fa4b/cu13.tar.xz.part2 > /tmp/fa4/cu13.tar.xz && rm -rf /tmp/fa4site \
      && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fa4site /tmp/fa4/*.whl \
      && tar xJf /tmp/fa4/cu13.tar.xz -C /tmp/fa4site && fa4_path \
      && python3 -c "import flash_attn.cute.interface; print('flash-attn-4 importable')" || exit 1
    ;;
  tests-fa4)
    timeout "${FA4_TESTS_TIMEOUT:-300}" python3 -m pytest -m cuda -q -rs -p no:cacheprovider --tb=short \
      tests/test_fa4_attention_cuda.py 2>&1 | grep -v "Warning\|warnings.warn" | tee "$out/pytest-fa4.log" | tail -12
    ;;
  probe-fa4)
    timeout 300 python3 -m bench.probes.probe_fa4_attention ${FA4_PROBE_ARGS:-} 2>&1 | grep -v "Warning\|warn(" \
      | tee "$out/probe-fa4.log" | tail -40
    ;;
  probe-attention-load)
    timeout 150 python3 -m bench.probes.probe_attention_under_load ${ATTENTION_LOAD_ARGS:-} 2>&1 \
      | grep -v "Warning\|warn(" | tee "$out/probe-attention-load.log" | tail -40
    ;;
  tests-published)
    timeout "${PUBLISHED_TESTS_TIMEOUT:-300}" python3 -m pytest -m cuda -q -rs -p no:cacheprovider --tb=short \
      -k "${PUBLISHED_TESTS_K:-}" tests/test_published_cuda.py 2>&1 | grep -v "Warning\|warnings.warn" | tee "$out/pytest-published.log" | tail -30
    ;;
  tests-key-padding)
    timeout "${KEY_PADDING_TESTS_TIMEOUT:-300}" python3 -m pytest -m cuda -q -rs -p no:cacheprovider --tb=short \
      tests/test_key_padding_cuda.py 2>&1 | grep -v "Warning\|warnings.warn" | tee "$out/pytest-key-padding.log" | tail -15
    ;;
  bench-flux|bench-flux-controlnet|bench-klein|bench-wan|bench-qwen-edit|bench-hunyuan-image)
    case "$phase" in
      bench-flux) pipeline=flux; modes=eager,fast,fast-inductor-glue,fast-fp8,fast-fp8-inductor-glue,fast-fp8-attn; runs=2 ;;
      bench-flux-controlnet) pipeline=flux-controlnet; modes=eager,bcg,bcg-no-controlnet,fast,fast-uncompiled-controlnet,fast-no-controlnet; runs=2 ;;
      bench-klein) pipeline=flux2-klein; modes=eager,bcg,fast,fast-fp8,fast-fp8-attn; runs=5 ;;
      bench-wan) pipeline=wan; modes=eager,fast-fp8-attn; runs=1 ;;
      bench-qwen-edit) pipeline=qwen-image-edit; modes=eager,fast,fast-fp8,fast-fp8-attn; runs=2 ;;
      bench-hunyuan-image) pipeline=hunyuan-image; modes=eager,fast,fast-fp8,fast-fp8-attn; runs=2 ;;
    esac
    timeout "${PUBLISHED_TIMEOUT:-560}" python3 -m bench --pipeline "$pipeline" --weights random-full \
      --modes "${PUBLISHED_MODES:-$modes}" --runs "${PUBLISHED_RUNS:-$runs}" --warmup 0 --no-progress \
      ${PUBLISHED_RESOLUTIONS:+--resolutions "$PUBLISHED_RESOLUTIONS"} --out "$out/$phase" 2>&1 | grep -v "Warning\|warnings.warn" | tee "$out/$phase.log" | tail -25
    ;;
  bench-text-encoders)
    # The published pipelines with their text encoders built (random weights) and a prompt encoded each call:
    # klein's Qwen3-4B (captured by default; -no-te: without its graphs), then FLUX.1's CLIP and T5-XXL (eager by
    # default; -te: named, captured)
    timeout "${TE_KLEIN_TIMEOUT:-240}" python3 -m bench --pipeline flux2-klein --weights random-full --text-encoders \
      --modes "${TE_KLEIN_MODES:-eager,bcg,bcg-no-te,fast,fast-no-te,fast-fp8-attn}" --runs 3 --warmup 0 --no-progress \
      --out "$out/klein-te" 2>&1 | grep -v "Warning\|warnings.warn\|^DEBUG" | tee "$out/bench-klein-te.log" | tail -16
    timeout "${TE_FLUX_TIMEOUT:-300}" python3 -m bench --pipeline flux --weights random-full --text-encoders \
      --modes "${TE_FLUX_MODES:-eager,bcg,bcg-te,fast,fast-te}" --runs 2 --warmup 0 --no-progress \
      --out "$out/flux-te" 2>&1 | grep -v "Warning\|warnings.warn\|^DEBUG" | tee "$out/bench-flux-te.log" | tail -16
    ;;
  flux-prologue)
    timeout 120 python3 -m pytest -m cuda -q -rs -p no:cacheprovider --tb=short -k "flux or qk_prologue" \
      tests/test_attention_kernels_cuda.py 2>&1 | grep -v "Warning\|warnings.warn" | tee "$out/pytest-flux-prologue.log" | tail -8
    modes=eager,fast,fast-inductor-prologue,fast-fp8,fast-fp8-inductor-prologue,fast-fp8-attn,fast-fp8-attn-inductor-prologue
    timeout "${PUBLISHED_TIMEOUT:-560}" python3 -m bench --pipeline flux --weights random-full \
      --modes "${FLUX_PROLOGUE_MODES:-$modes}" --runs "${PUBLISHED_RUNS:-2}" --warmup 0 --no-progress \
      --out "$out/flux-prologue" 2>&1 | grep -v "Warning\|warnings.warn" | tee "$out/bench-flux-prologue.log" | tail -25
    ;;
  probe-flux)
    # FLUX_SECTIONS: gemms, call; FLUX_ARGS: e.g. "--pipeline qwen-image-edit --modes eager,fast-fp8" (bench/probes/probe_flux.py)
    timeout "${FLUX_PROBE_TIMEOUT:-420}" python3 -m bench.probes.probe_flux --sections "${FLUX_SECTIONS:-gemms,call}" ${FLUX_ARGS:-} 2>&1 \
      | grep -v "Warning\|warnings.warn\|_warn_once\|^DEBUG" | tee "$out/probe-flux.log" | tail -120
    ;;
  probe-wan-vae)
    # WAN_VAE_ARGS: the probe's arguments (e.g. --variants eager,fused --dtypes bf16)
    timeout "${WAN_VAE_TIMEOUT:-300}" python3 -m bench.probes.probe_wan_vae ${WAN_VAE_ARGS:-} 2>&1 \
      | grep -v "Warning\|warnings.warn\|_warn_once" | tee "$out/probe-wan-vae.log" | tail -32
    ;;
  probe-vae-coders)
    # VAE_CODERS_ARGS: the probe's arguments (e.g. --cases qwen-1024 --runs 5)
    timeout "${VAE_CODERS_TIMEOUT:-300}" python3 -m bench.probes.probe_vae_coders ${VAE_CODERS_ARGS:-} 2>&1 \
      | grep -v "Warning\|warnings.warn\|_warn_once" | tee "$out/probe-vae-coders.log" | tail -20
    ;;
  probe-cfg-batch-gain)
    # CFG_BATCH_ARGS: the probe's arguments (e.g. --model wan --replays 3)
    timeout 300 python3 -m bench.probes.probe_cfg_batch_gain ${CFG_BATCH_ARGS:-} 2>&1 | grep -v "Warning\|warnings.warn\|_warn_once" \
      | tee "$out/probe-cfg-batch-gain.log" | tail -8
    ;;
  tests-state)
    # Python state read by captures (module attributes, globals, in-place constants; processors, non-plain
    # attributes, global settings, hooks, replaced components, inputs written) and object arguments
    # (Flux2KleinKVPipeline's KV cache, arguments used through eager breaks), exact and fast (tiny)
    timeout "${STATE_TESTS_TIMEOUT:-420}" python3 -m pytest -m cuda -q -rs -s -p no:cacheprovider --tb=short \
      tests/test_python_state_cuda.py tests/test_stale_state_cuda.py tests/test_object_arguments_cuda.py 2>&1 \
      | grep -v "Warning\|warnings.warn" | tee "$out/pytest-state.log" | tail -30
    ;;
  bench-state)
    # what the per-call check of the Python state costs: Z-Image-Turbo 512² (8 steps) and Qwen-Image 512²
    # (10 steps, true CFG 4), eager and our modes in one run each; the report prints the check's time per call
    timeout 280 python3 -m bench --pipeline z-image --weights random-full --modes eager,bcg,fast --runs 5 \
      --warmup 0 --no-progress --out "$out/state-z" 2>&1 | tail -12
    timeout 300 python3 -m bench --pipeline qwen-image --weights random-full --resolutions 512x512 --steps 10 \
      --guidance 4 --modes eager,bcg,fast --runs 3 --warmup 0 --no-progress --out "$out/state-qwen" 2>&1 | tail -12
    ;;
  tests-coexist)
    # our graphs beside torch.compile(mode="reduce-overhead"), both orders (issue 19); then the same test
    # with the cuBLAS-workspace fix taken out, which must fail (its own process: it may crash)
    timeout 110 python3 -m pytest -m cuda -q -rs -p no:cacheprovider --tb=short tests/test_coexistence_cuda.py 2>&1 \
      | tee "$out/pytest-coexistence.log" | tail -8
    BCG_TEST_WITHOUT_FIX=blas-workspaces timeout 60 python3 -m pytest -m cuda -q -p no:cacheprovider --tb=line \
      -k ours-first tests/test_coexistence_cuda.py 2>&1 | grep -v "^ *warnings.warn\|Warning" \
      | tee "$out/pytest-coexistence-without-fix.log" | tail -6
    ;;
  tests-shared)
    # pipelines sharing components, the img2img/inpaint relatives, LoRA hot swap, fast mode after offload
    timeout 230 python3 -m pytest -m cuda -q -rs -p no:cacheprovider --tb=short tests/test_shared_components.py \
      tests/test_relatives_cuda.py tests/test_lora_hotswap.py tests/test_fast_hooks.py 2>&1 \
      | tee "$out/pytest-shared.log" | tail -15
    ;;
  tests-cache)
    timeout 420 python3 -m pytest -m cuda -q -rs -s -p no:cacheprovider --tb=short tests/test_step_cache_cuda.py 2>&1 \
      | grep -v "Warning\|warnings.warn" | tee "$out/pytest-step-cache.log" | tail -40
    ;;
  probe-attention)
    timeout 420 python3 -m bench.probes.probe_attention_kernels 2>&1 | grep -v "Warning\|warnings.warn" \
      | tee "$out/probe-attention.log" | grep -v "^ *[0-9.]* ms  x" | tail -60
    ;;
  tests-kernels)
    timeout 300 python3 -m pytest -m cuda -q -rs -s -p no:cacheprovider --tb=short tests/test_attention_kernels_cuda.py 2>&1 \
      | grep -v "Warning\|warnings.warn" | tee "$out/pytest-attention-kernels.log" | tail -20
    ;;
  probe-fp8-ff)
    timeout 120 python3 -m pytest -m cuda -q -rs -p no:cacheprovider --tb=short -k activation_fp8 \
      tests/test_attention_kernels_cuda.py 2>&1 | grep -v "Warning\|warnings.warn" | tee "$out/pytest-activation-fp8.log" | tail -6
    timeout 300 python3 -m bench.probes.probe_attention_kernels --sections fp8-ff,prologue-blocks 2>&1 \
      | grep -v "Warning\|warnings.warn\|_warn_once\|^W[0-9]" | tee "$out/probe-fp8-ff.log" | grep -v "^ *[0-9.]* ms  x" | tail -40
    ;;
  probe-block-glue)
    timeout 120 python3 -m pytest -m cuda -q -rs -s -p no:cacheprovider --tb=short -k block_glue \
      tests/test_attention_kernels_cuda.py 2>&1 | grep -v "Warning\|warnings.warn" | tee "$out/pytest-block-glue.log" | tail -12
    timeout 360 python3 -m bench.probes.probe_attention_kernels --sections block-glue 2>&1 \
      | grep -v "Warning\|warnings.warn\|_warn_once\|^W[0-9]" | tee "$out/probe-block-glue.log" | grep -v "^ *[0-9.]* ms  x" | tail -60
    ;;
  tests-block-glue)
    timeout 560 python3 -m pytest -m cuda -q -rs -s -p no:cacheprovider --tb=short tests/test_zimage_block_cuda.py \
      -k "block_glue or (fp8_option_equals and z-image and fast) or fp8_weights_data" tests/test_quantize_cuda.py \
      tests/test_attention_kernels_cuda.py 2>&1 | grep -v "Warning\|warnings.warn" \
      | tee "$out/pytest-block-glue-tiny.log" | tail -30
    ;;
  bench-block-glue-z)
    # The default measure (no synchronisation inside a call), then the same with --stage-syncs (bench's measure
    # before run 140), each mode with eager in its run.
    for syncs in "" "--stage-syncs"; do
      name="block-glue-z${syncs:+-stage-syncs}"
      timeout 280 python3 -m bench --pipeline z-image --weights random-full --resolutions 512x512,1024x1024 --steps 8 \
        --modes ${BLOCK_GLUE_MODES:-eager,fast-fp8,fast-fp8-inductor-glue} --runs 5 --warmup 0 --no-progress $syncs \
        --out "$out/$name" 2>&1 | grep -v "Warning\|warnings.warn" > "$out/$name.log"
      grep "^| \|Checking" "$out/$name.log" | grep -v "^|---"
    done
    ;;
  qwen-block-glue)
    timeout 200 python3 -m pytest -m cuda -q -rs -s -p no:cacheprovider --tb=short -k "qwen_block_glue or qwenimage_block" \
      tests/test_attention_kernels_cuda.py tests/test_qwenimage_block_cuda.py 2>&1 | grep -v "warnings.warn" \
      | tee "$out/pytest-qwen-block-glue.log" | tail -16
    timeout 360 python3 -m bench.probes.probe_attention_kernels --sections qwen-block-glue 2>&1 \
      | grep -v "Warning\|warnings.warn\|_warn_once\|^W[0-9]" | tee "$out/probe-qwen-block-glue.log" \
      | grep -v "^ *[0-9.]* ms  x" | tail -70
    ;;
  fp8-prologue)
    timeout 260 python3 -m pytest -m cuda -q -rs -s -p no:cacheprovider --tb=short -k "prologue or cudnn_fp8_attention_matches or (fast_mode_fp8_attention and cudnn) or stacked" \
      tests/test_attention_kernels_cuda.py tests/test_stacked_output_cuda.py 2>&1 | grep -v "warnings.warn" \
      | tee "$out/pytest-fp8-prologue.log" | tail -16
    timeout 300 python3 -m bench.probes.probe_attention_kernels --sections prologue,fp8-prologue 2>&1 \
      | grep -v "Warning\|warnings.warn\|_warn_once\|^W[0-9]" | tee "$out/probe-fp8-prologue.log" \
      | grep -v "^ *[0-9.]* ms  x" | tail -60
    ;;
  probe-stacked)
    timeout 540 python3 -m bench.probes.probe_attention_kernels --sections stacked-output,w13-bf16 2>&1 \
      | grep -v "Warning\|warnings.warn\|_warn_once\|^W[0-9]" | tee "$out/probe-stacked.log" \
      | grep -v "^ *[0-9.]* ms  x" | tail -60
    ;;
  bench-fp8-prologue-qwen)
    timeout 590 python3 -m bench --pipeline qwen-image --weights random-full --resolutions 1024x1024 --steps 50 \
      --guidance 4 --modes ${FP8_PROLOGUE_QWEN_MODES:-eager,fast-fp8,fast-fp8-joined-output,fast-fp8-attn,fast-fp8-attn+cache} \
      --runs 3 --warmup 0 --no-progress --out "$out/fp8-prologue-qwen-1024" 2>&1 | grep -v "Warning\|warnings.warn" \
      | tee "$out/fp8-prologue-qwen-1024.log" | tail -14
    ;;
  bench-stacked-qwen-512)
    timeout 590 python3 -m bench --pipeline qwen-image --weights random-full --resolutions 512x512 --steps 50 \
      --guidance 4 --modes eager,fast,fast-joined-output,fast-fp8,fast-fp8-joined-output --runs 5 --warmup 0 \
      --no-progress --out "$out/stacked-qwen-512" 2>&1 | grep -v "Warning\|warnings.warn" \
      | tee "$out/stacked-qwen-512.log" | tail -14
    ;;
  tests-fp8-output)
    timeout 300 python3 -m pytest -m cuda -q -rs -s -p no:cacheprovider --tb=short tests/test_fp8_output_projection_cuda.py \
      tests/test_attention_kernels_cuda.py -k "fp8_output or direct_path or qk_prologue_fp8" 2>&1 \
      | grep -v "warnings.warn" | tee "$out/pytest-fp8-output.log" | tail -16
    ;;
  bench-fp8-output-qwen)
    timeout 590 python3 -m bench --pipeline qwen-image --weights random-full --resolutions 1024x1024 --steps 50 \
      --guidance 4 --modes ${FP8_OUTPUT_QWEN_MODES:-eager,fast-fp8-attn,fast-fp8-all-linears,fast-fp8-all-linears-attn,fast-fp8-all-linears-attn-scaled-output} \
      --runs 3 --warmup 0 --no-progress --out "$out/fp8-output-qwen-1024" 2>&1 | grep -v "Warning\|warnings.warn" \
      | tee "$out/fp8-output-qwen-1024.log" | tail -14
    ;;
  bench-fp8-output-z)
    timeout 400 python3 -m bench --pipeline z-image --weights random-full --resolutions 512x512,1024x1024 --steps 8 \
      --modes ${FP8_OUTPUT_Z_MODES:-eager,fast-fp8-attn,fast-fp8-all-linears,fast-fp8-all-linears-attn,fast-fp8-all-linears-attn-scaled-output} \
      --runs 5 --warmup 0 --no-progress --out "$out/fp8-output-z" 2>&1 | grep -v "Warning\|warnings.warn" \
      | tee "$out/fp8-output-z.log" | tail -14
    ;;
  bench-stacked-qwen)
    timeout 590 python3 -m bench --pipeline qwen-image --weights random-full --resolutions 1024x1024 --steps 50 \
      --guidance 4 --modes eager,fast,fast-joined-output --runs 3 --warmup 0 --no-progress \
      --out "$out/stacked-qwen-1024" 2>&1 | grep -v "Warning\|warnings.warn" | tee "$out/stacked-qwen-1024.log" | tail -14
    ;;
  bench-fp8-prologue-z)
    timeout 400 python3 -m bench --pipeline z-image --weights random-full --resolutions 512x512,1024x1024 --steps 8 \
      --modes eager,fast-fp8,fast-fp8-attn-bf16-prologue,fast-fp8-attn --runs 5 --warmup 0 --no-progress \
      --out "$out/fp8-prologue-z" 2>&1 | grep -v "Warning\|warnings.warn" | tee "$out/fp8-prologue-z.log" | tail -14
    ;;
  bench-block-glue-qwen)
    timeout 590 python3 -m bench --pipeline qwen-image --weights random-full --resolutions 1024x1024 --steps 50 \
      --guidance 4 --modes ${QWEN_GLUE_MODES:-eager,fast-fp8,fast-fp8-inductor-glue,fast-fp8-attn,fast-fp8-attn+cache} \
      --runs 3 --warmup 0 --no-progress --out "$out/block-glue-qwen-1024" 2>&1 | grep -v "Warning\|warnings.warn" \
      | tee "$out/block-glue-qwen-1024.log" | tail -14
    ;;
  bench-fp8-ff-qwen)
    timeout 480 python3 -m bench --pipeline qwen-image --weights random-full --resolutions 1024x1024 --steps 50 \
      --guidance 4 --modes eager,fast-fp8,fast-fp8-torchao-ff --runs 3 --warmup 0 --no-progress \
      --out "$out/fp8-ff-qwen-1024" 2>&1 | grep -v "Warning\|warnings.warn" | tee "$out/fp8-ff-qwen-1024.log" | tail -12
    ;;
  bench-kernels-qwen)
    timeout 570 python3 -m bench --pipeline qwen-image --weights random-full --resolutions 1024x1024 --steps 50 \
      --guidance 4 --modes eager,fast,fast-fp8,fast-fp8-attn,fast-fp8+cache --runs 3 --warmup 0 --no-progress \
      --out "$out/kernels-qwen-1024" 2>&1 | grep -v "Warning\|warnings.warn" | tee "$out/kernels-qwen-1024.log" | tail -14
    ;;
  probe-cudnn-fp8)
    timeout 240 python3 -m bench.probes.probe_cudnn_fp8_attention 2>&1 | grep -v "Warning\|warnings.warn" \
      | tee "$out/probe-cudnn-fp8.log" | tail -40
    ;;
  tests-cudnn-fp8)
    timeout 300 python3 -m pytest -q -p no:cacheprovider -s -k "cudnn or fast_mode_fp8" \
      tests/test_attention_kernels_cuda.py 2>&1 | tee "$out/pytest-cudnn-fp8.log" | grep -v "warnings.warn" | tail -20
    ;;
  bench-cudnn-fp8-z)
    timeout 330 python3 -m bench --pipeline z-image --weights random-full --resolutions 512x512,1024x1024 --steps 8 \
      --modes eager,fast-fp8,fast-fp8-attn,fast-fp8-attn-triton --runs 5 --warmup 0 --no-progress \
      --out "$out/cudnn-fp8-z" 2>&1 | grep -v "Warning\|warnings.warn" | tee "$out/cudnn-fp8-z.log" | tail -14
    ;;
  bench-fused-qkv-z)
    timeout 420 python3 -m bench --pipeline z-image --weights random-full --resolutions 512x512,1024x1024 --steps 8 \
      --modes ${FUSED_QKV_MODES:-eager,fast-fp8,fast-fp8-unfused-qkv,fast-fp8-attn} --runs 5 --warmup 0 --no-progress \
      --out "$out/fused-qkv-z" 2>&1 | grep -v "Warning\|warnings.warn" | tee "$out/fused-qkv-z.log" | tail -14
    ;;
  tests-fused-qkv)
    # Tiny Z-Image in fast mode with FP8 compiles four block variants: over 3 min.
    timeout 400 python3 -m pytest -m cuda -q -rs -s -p no:cacheprovider --tb=short \
      tests/test_quantize_cuda.py::test_fast_fp8_replays_a_replaced_projection_not_the_fused_product 2>&1 \
      | grep -v "Warning\|warnings.warn" | tee "$out/pytest-fused-qkv.log" | tail -30
    ;;
  bench-cudnn-fp8-qwen)
    timeout 590 python3 -m bench --pipeline qwen-image --weights random-full --resolutions 1024x1024 --steps 50 \
      --guidance 4 --modes eager,fast-fp8,fast-fp8-attn,fast-fp8+cache,fast-fp8-attn+cache --runs 3 --warmup 0 \
      --no-progress --out "$out/cudnn-fp8-qwen-1024" 2>&1 | grep -v "Warning\|warnings.warn" \
      | tee "$out/cudnn-fp8-qwen-1024.log" | tail -14
    ;;
  bench-kernels-z)
    timeout 420 python3 -m bench --pipeline z-image --weights random-full --resolutions 512x512,1024x1024 --steps 8 \
      --modes eager,fast,eager-fp8,fast-fp8,fast-fp8-torchao-ff,fast-fp8-attn --runs 5 --warmup 0 --profile --no-progress \
      --out "$out/kernels-z" 2>&1 | grep -v "Warning\|warnings.warn" | tee "$out/kernels-z.log" | tail -20
    ;;
  bench-cachedit-qwen)
    timeout 570 python3 -m bench --pipeline qwen-image --weights random-full --resolutions 1024x1024 --steps 50 \
      --guidance 4 --modes eager,bcg,fast,eager+cachedit,bcg+cachedit,fast+cachedit --runs 3 --warmup 0 --no-progress \
      --out "$out/cachedit-qwen-1024" 2>&1 | grep -v "Warning\|warnings.warn" | tee "$out/cachedit-qwen-1024.log" | tail -16
    ;;
  bench-cache-qwen-1024)
    timeout 480 python3 -m bench --pipeline qwen-image --weights random-full --resolutions 1024x1024 --steps 50 \
      --guidance 4 --modes eager,eager+cache,bcg+cache,fast+cache --runs 3 --warmup 0 --no-progress \
      --out "$out/cache-qwen-1024" 2>&1 | grep -v "Warning\|warnings.warn" | tee "$out/cache-qwen-1024.log" | tail -14
    ;;
  bench-cache-qwen-512)
    timeout 300 python3 -m bench --pipeline qwen-image --weights random-full --resolutions 512x512 --steps 50 \
      --guidance 4 --modes eager,bcg,eager+cache,bcg+cache --runs 3 --warmup 0 --no-progress \
      --out "$out/cache-qwen-512" 2>&1 | grep -v "Warning\|warnings.warn" | tee "$out/cache-qwen-512.log" | tail -12
    ;;
  bench-cache-z)
    timeout 330 python3 -m bench --pipeline z-image --weights random-full --resolutions 512x512,1024x1024 --steps 8 \
      --modes eager,fast,eager+cache,fast+cache,compile+cache --runs 5 --no-progress \
      --out "$out/cache-z" 2>&1 | grep -v "Warning\|warnings.warn" | tee "$out/cache-z.log" | tail -24
    ;;
  bench-cfg-cache-qwen|bench-cfg-cache-qwen-1024|bench-cfg-cache-qwen-512)
    # Fast mode's CFG batching under MagCache (batched in one joint cache context) against the same one by one.
    case "$phase" in *-1024) sizes="1024" ;; *-512) sizes="512" ;; *) sizes="1024 512" ;; esac
    for size in $sizes; do
      timeout 560 python3 -m bench --pipeline qwen-image --weights random-full --resolutions "${size}x${size}" \
        --steps 50 --guidance 4 --modes eager+cache,fast-unbatched+cache,fast+cache --runs 3 --warmup 0 --no-progress \
        --out "$out/cfg-cache-qwen-$size" 2>&1 | grep -v "Warning\|warnings.warn" | tee "$out/cfg-cache-qwen-$size.log" \
        | tail -14
    done
    ;;
  tests-quant)
    # Z-Image fast with FP8 compiles four block variants of the tiny model (over 3 min): the full-size
    # bench-fp8-z checks fast-fp8 against its compiled blocks instead (QUANT_TESTS_ALL=1 runs it too)
    deselect=()
    [ -n "${QUANT_TESTS_ALL:-}" ] || deselect=(--deselect "tests/test_quantize_cuda.py::test_fp8_option_equals_the_same_fp8_model_and_restores_bf16[z-image-fast]")
    timeout "${QUANT_TESTS_TIMEOUT:-240}" python3 -m pytest -m cuda -q -rs -s -p no:cacheprovider --tb=short "${deselect[@]}" tests/test_quantize_cuda.py 2>&1 \
      | grep -v "Warning\|warnings.warn" | tee "$out/pytest-quantize.log" | tail -30
    ;;
  tests-auto)
    timeout "${AUTO_TESTS_TIMEOUT:-240}" python3 -m pytest -m cuda -q -rs -s -p no:cacheprovider --tb=short \
      tests/test_auto_breaks_cuda.py tests/test_coverage_cuda.py tests/test_quantize_loaders_cuda.py 2>&1 \
      | grep -v "Warning\|warnings.warn" \
      | tee "$out/pytest-auto-breaks.log" | tail -30
    ;;
  probe-hand-patches)
    timeout "${PATCH_PROBE_TIMEOUT:-150}" python3 -m bench.probes.probe_hand_patches --weights random-full \
      --out "$out/hand-patches" 2>&1 | grep -v "Warning\|warnings.warn" | tee "$out/hand-patches.log" | tail -8
    ;;
  bench-auto)
    timeout "${AUTO_Z_TIMEOUT:-240}" python3 -m bench --pipeline z-image --weights random-full --resolutions 512x512,1024x1024 \
      --steps 8 --modes "${AUTO_Z_MODES:-eager,bcg,bcg-no-auto,fast,fast-no-auto}" --runs 5 --warmup 0 --no-progress \
      --out "$out/auto-z" 2>&1 | grep -v "Warning\|warnings.warn" | tee "$out/auto-z.log" | tail -16
    timeout "${AUTO_QWEN_TIMEOUT:-150}" python3 -m bench --pipeline qwen-image --weights random-full --resolutions 512x512 \
      --steps 10 --guidance 4 --modes eager,bcg,bcg-no-auto --runs 5 --warmup 0 --no-progress \
      --out "$out/auto-qwen" 2>&1 | grep -v "Warning\|warnings.warn" | tee "$out/auto-qwen.log" | tail -10
    ;;
  coverage)
    timeout "${COVERAGE_TIMEOUT:-580}" python3 -m bench.coverage --size full --device cuda \
      ${COVERAGE_PIPELINES:+--pipelines "$COVERAGE_PIPELINES"} ${COVERAGE_MODES:+--modes "$COVERAGE_MODES"} \
      ${COVERAGE_RUNS:+--runs "$COVERAGE_RUNS"} --out "$out/coverage" 2>&1 \
      | grep -v "Warning\|warnings.warn" | tee "$out/coverage.log" | tail -30
    ;;
  bench-fp8-z)
    timeout "${FP8_Z_TIMEOUT:-420}" python3 -m bench --pipeline z-image --weights random-full --resolutions 512x512,1024x1024 --steps 8 \
      --modes "${FP8_Z_MODES:-eager,fast,eager-fp8,bcg-fp8,fast-fp8}" --runs 3 --warmup 0 --no-progress \
      --out "$out/fp8-z" 2>&1 | grep -v "Warning\|warnings.warn" | tee "$out/fp8-z.log" | tail -14
    ;;
  bench-fp8-qwen)
    timeout "${FP8_QWEN_TIMEOUT:-540}" python3 -m bench --pipeline qwen-image --weights random-full --resolutions 1024x1024 \
      --steps 20 --guidance 4 --modes "${FP8_QWEN_MODES:-eager,fast,eager-fp8,fast-fp8}" --runs 3 --warmup 0 --no-progress \
      --out "$out/fp8-qwen" 2>&1 | grep -v "Warning\|warnings.warn" | tee "$out/fp8-qwen.log" | tail -14
    ;;
  warm-start-fp8-z)
    timeout "${WARM_TIMEOUT:-540}" python3 -m bench.warm_start --pipeline z-image --weights random-full --quantize fp8 \
      --out "$out/warm-start-fp8-z" 2>&1 | tee "$out/warm-start-fp8-z.log" | tail -30
    ;;
  probe-fp8-groups)
    timeout "${PROBE_TIMEOUT:-540}" python3 -m bench.probes.probe_fp8_groups --pipeline z-image --weights random-full \
      --mode "${PROBE_MODE:-exact}" --size "${PROBE_SIZE:-1024}" --compare "${PROBE_COMPARE:-groups}" \
      --out "$out/probe-fp8-groups" 2>&1 | grep -v "Warning\|warnings.warn" | tee "$out/probe-fp8-groups.log" | tail -12
    ;;
  probe-fp8-block)
    timeout "${BLOCK_PROBE_TIMEOUT:-400}" python3 -m bench.probes.probe_fp8_block \
      ${BLOCK_PROBE_SECTIONS:+--sections "$BLOCK_PROBE_SECTIONS"} 2>&1 \
      | grep -v "Warning\|warnings.warn" | tee "$out/probe-fp8-block.log" | tail -40
    ;;
  hotswap-z)
    timeout 80 python3 -m bench.hotswap --pipeline z-image --weights random-full --steps 4 --swaps 2 --modes exact \
      --out "$out/hotswap-z-image" 2>&1 | tee "$out/hotswap-z-image.log" | tail -5
    ;;
  tests-fast)
    timeout 300 python3 -m pytest -q -rs -p no:cacheprovider --tb=short tests/test_fast_cuda.py 2>&1 \
      | tee "$out/pytest-fast-tiny.log" | tail -15
    ;;
  warm-start-z)
    timeout 150 python3 -m bench.warm_start --pipeline z-image --weights random-full --out "$out/warm-start-z-image" \
      2>&1 | tee "$out/warm-start-z-image.log" | tail -40
    ;;
  first-call-qwen-none|first-call-qwen-magcache|first-call-qwen-cachedit)
    # Issue 36's first-call target: fresh processes (cold, warm and portable compile caches), Qwen-Image 1024²,
    # 50 steps, true CFG 4, without a cache or with the benchmark's static MagCache / Cache-DiT schedule.
    cache=${phase#first-call-qwen-}
    flag=(); [ "$cache" = none ] || flag=(--cache "$cache")
    timeout 280 python3 -m bench.warm_start --pipeline qwen-image --weights random-full --size 1024 --steps 50 \
      --guidance 4 "${flag[@]}" --out "$out/first-call-qwen-$cache" 2>&1 | tail -3 | tee "$out/first-call-qwen-$cache.log"
    ;;
  first-call-qwen-fp8)
    timeout "${WARM_TIMEOUT:-540}" python3 -m bench.warm_start --pipeline qwen-image --weights random-full --size 1024 \
      --steps 50 --guidance 4 --quantize fp8 --out "$out/first-call-qwen-fp8" 2>&1 | tail -30 \
      | tee "$out/first-call-qwen-fp8.log"
    ;;
  bench-qwen)
    # Ours and regional compile at both sizes first; reduce-overhead (minutes of compile for the 20B
    # transformer) afterwards with what time is left, 512² first.
    timeout 300 python3 -m bench --pipeline qwen-image --weights random-full --resolutions 512x512,1024x1024 \
      --steps 10 --guidance 4 --warmup 0 --modes eager,bcg,fast,compile --no-progress \
      --out "$out/bench-qwen-image" 2>&1 | tee "$out/bench-qwen-image.log" | grep -v "^DEBUG" | tail -40
    timeout "${QWEN_MAX_TIMEOUT:-260}" python3 -m bench --pipeline qwen-image --weights random-full \
      --resolutions 512x512,1024x1024 --steps 10 --guidance 4 --warmup 0 --modes compile-max --no-progress \
      --out "$out/bench-qwen-image-compile-max" 2>&1 | tee "$out/bench-qwen-image-compile-max.log" \
      | grep -v "^DEBUG" | tail -40
    ;;
  te-z)
    timeout 200 python3 -m bench --pipeline z-image --weights random-full --resolutions 512x512 --steps 8 \
      --guidance 0 --modes eager,bcg-no-te,bcg,fast-no-te,fast --no-progress --out "$out/bench-z-image-te" 2>&1 \
      | tee "$out/bench-z-image-te.log" | grep -v "^DEBUG" | tail -16
    ;;
  fast-check)
    # Fast mode only, next to eager, full size: timing and byte-equality with its compiled reference.
    for pipeline in ${FAST_CHECK_PIPELINES:-qwen-image z-image}; do
      guidance=$([ "$pipeline" = qwen-image ] && echo 4 || echo 0)
      steps=$([ "$pipeline" = qwen-image ] && echo 10 || echo 8)
      timeout 110 python3 -m bench --pipeline "$pipeline" --weights random-full --resolutions 512x512 \
        --steps "$steps" --guidance "$guidance" --warmup 0 --modes eager,fast --no-progress \
        --out "$out/fast-check-$pipeline" 2>&1 | tee "$out/fast-check-$pipeline.log" | grep -v "^DEBUG" | tail -14
    done
    ;;
  tests-z)
    timeout 200 python3 -m pytest -m cuda -q -rs -p no:cacheprovider --tb=short tests/test_serving_cuda.py \
      tests/test_pipelines_cuda.py 2>&1 | tee "$out/pytest-cuda-z-captions.log" | tail -8
    ;;
  profile-qwen)
    # Issue 2's remaining figure: Qwen-Image 512² denoising loop, wall over GPU kernel time per step (the
    # per-step figure is the difference of a 10- and a 5-step run; 50 steps profiled did not fit a call).
    timeout 300 python3 -m bench --pipeline qwen-image --weights random-full --resolutions 512x512 --steps 10 \
      --guidance 4 --warmup 0 --modes "${PROFILE_QWEN_MODES:-eager,bcg,fast}" --runs 3 --profile --no-progress \
      --out "$out/profile-qwen-image-512" 2>&1 | tee "$out/profile-qwen-image-512.log" | grep -v "^DEBUG" | tail -14
    ;;
  profile-z)
    timeout 200 python3 -m bench --pipeline z-image --weights random-full --resolutions 512x512 --steps 8 \
      --guidance 0 --warmup 0 --modes eager,bcg,fast --runs 3 --profile --no-progress \
      --out "$out/profile-z-image-512" 2>&1 | tee "$out/profile-z-image-512.log" | grep -v "^DEBUG" | tail -14
    ;;
  fast-qwen-50)
    # Issue 6's Qwen-Image target, with fast's CFG batching against the same without it (fast-unbatched).
    timeout 450 python3 -m bench --pipeline qwen-image --weights random-full --resolutions 512x512 --steps 50 \
      --guidance 4 --warmup 0 --modes eager,fast,fast-unbatched --runs 5 --no-progress --out "$out/fast-qwen-image-50" 2>&1 \
      | tee "$out/fast-qwen-image-50.log" | grep -v "^DEBUG" | tail -14
    ;;
  ab-attention)
    bash bench/probes/ab_attention.sh "$out" qwen-image z-image
    ;;
  probe-floor)
    timeout 540 python3 -m bench.probes.probe_fast_floor --pipeline z-image --pipeline qwen-image 2>&1 \
      | grep -v "^DEBUG" | tee "$out/probe-fast-floor.log" | tail -40
    ;;
  probe-outside)
    timeout 540 python3 -m bench.probes.probe_outside_blocks ${OUTSIDE_SECTIONS:+--sections $OUTSIDE_SECTIONS} \
      ${VAE_VARIANTS:+--vae-variants "$VAE_VARIANTS"} 2>&1 \
      | grep -v "^DEBUG" | tee "$out/probe-outside-blocks.log" | tail -150
    ;;
  tests-vae-fused)
    timeout 300 python3 -m pytest -q -s -m cuda tests/test_vae_fused_cuda.py 2>&1 | grep -v "Warning\|warnings.warn" \
      | tee "$out/pytest-vae-fused.log" | tail -30
    ;;
  probe-blocks)
    timeout 400 python3 -m bench.probes.probe_block_kernels 2>&1 | grep -v "^DEBUG" | tee "$out/probe-block-kernels.log" | tail -80
    ;;
  probe-norms)
    timeout 300 python3 -m bench.probes.probe_norm_kernels 2>&1 | grep -v "^DEBUG" | tee "$out/probe-norm-kernels.log" | tail -40
    ;;
  compile-max-qwen)
    timeout "${QWEN_MAX_TIMEOUT:-560}" python3 -m bench --pipeline qwen-image --weights random-full \
      --resolutions "${QWEN_MAX_RESOLUTIONS:-512x512}" --steps 10 --guidance 4 --warmup 0 --runs 3 --modes compile-max --no-progress \
      --out "$out/bench-qwen-image-compile-max" 2>&1 | tee "$out/bench-qwen-image-compile-max.log" \
      | grep -v "^DEBUG" | tail -20
    ;;
  memory-z)
    timeout 300 python3 -m bench.memory --pipeline z-image --weights random-full \
      --resolutions 512x512,768x768,1024x1024,768x1344 --out "$out/memory-z-image" 2>&1 \
      | tee "$out/memory-z-image.log" | grep -v "^DEBUG" | tail -30
    ;;
  tests-full)
    BCG_TEST_WEIGHTS=random-full timeout 330 python3 -m pytest -q -s -p no:cacheprovider --tb=short \
      tests/test_pipelines_cuda.py 2>&1 | tee "$out/pytest-cuda-random-full.log" | grep -v "^INFO" | tail -15
    ;;
  readme-rows)
    # Issue 56's check that Qwen-Image and Z-Image keep the README's figures (within 2%): the README's bf16 and
    # FP8 rows at 1024² and Z-Image's at 512², our modes only (the rows' eager is timed again in the same run)
    timeout "${README_Z_TIMEOUT:-200}" python3 -m bench --pipeline z-image --weights random-full \
      --resolutions 512x512,1024x1024 --steps 8 --guidance 0 --modes "${README_Z_MODES:-eager,bcg,fast,fast-fp8,fast-fp8-attn}" \
      --runs 3 --warmup 0 --no-progress --out "$out/readme-z" 2>&1 | grep -v "Warning\|warnings.warn" \
      | tee "$out/readme-z.log" | tail -16
    timeout "${README_QWEN_TIMEOUT:-380}" python3 -m bench --pipeline qwen-image --weights random-full \
      --resolutions 1024x1024 --steps 50 --guidance 4 --modes "${README_QWEN_MODES:-eager,fast,fast-fp8,fast-fp8-attn}" \
      --runs 2 --warmup 0 --no-progress --out "$out/readme-qwen-1024" 2>&1 | grep -v "Warning\|warnings.warn" \
      | tee "$out/readme-qwen-1024.log" | tail -14
    ;;
  bench-z)
    timeout "${BENCH_Z_TIMEOUT:-560}" python3 -m bench --pipeline z-image --weights random-full --resolutions 512x512,1024x1024 \
      --steps 8 --guidance 0 --warmup 0 --profile --no-progress --out "$out/bench-z-image" 2>&1 | tee "$out/bench-z-image.log" | tail -40
    ;;
  bench-qwen-512|bench-qwen-1024)
    size=${phase#bench-qwen-}
    steps=$([ "$size" = 512 ] && echo 50 || echo 20)
    timeout 570 python3 -m bench --pipeline qwen-image --weights random-full --resolutions "${size}x${size}" \
      --steps "$steps" --guidance 4 --no-progress --out "$out/bench-qwen-image-$size" 2>&1 \
      | tee "$out/bench-qwen-image-$size.log" | tail -40
    ;;
  issue2)
    timeout 570 python3 -m bench --preset cfg-steps-batch --weights random-full --modes eager,bcg --runs 3 --profile \
      --no-progress --out "$out/bench-issue2" 2>&1 | tee "$out/bench-issue2.log" | tail -40
    ;;
  parallel)
    timeout 100 python3 -m pytest -q -rs -p no:cacheprovider --tb=short tests/test_parallel_cuda.py 2>&1 \
      | tee "$out/pytest-parallel-tiny.log" | tail -8
    [ -n "${PARALLEL_SKIP_FULL_TESTS:-}" ] || BCG_TEST_WEIGHTS=random-full BCG_PARALLEL_KINDS=ulysses timeout 200 python3 -m pytest -q -rs -p no:cacheprovider \
      --tb=short tests/test_parallel_cuda.py 2>&1 | tee "$out/pytest-parallel-random-full.log" | tail -8
    [ -n "${PARALLEL_SKIP_BENCH:-}" ] || timeout "${PARALLEL_BENCH_TIMEOUT:-330}" python3 -m torch.distributed.run --nproc_per_node=2 -m bench.parallel --weights random-full \
      --resolutions "${PARALLEL_RESOLUTIONS:-512x512,1024x1024}" --single-modes "${PARALLEL_SINGLE_MODES-eager,bcg}" \
      --steps 50 --guidance 4 --runs 2 --out "$out/parallel-qwen-image" 2>&1 \
      | tee "$out/parallel-qwen-image.log" | grep -v "Warning\|warn(" | tail -20
    ;;
  parallel-cfg)
    # true CFG across the two GPUs (cfg_parallel=True), bcg and fast, against one GPU in the same mode
    timeout "${PARALLEL_BENCH_TIMEOUT:-540}" python3 -m torch.distributed.run --nproc_per_node=2 -m bench.parallel \
      --weights random-full --parallel cfg --resolutions "${PARALLEL_RESOLUTIONS:-1024x1024}" --single-modes bcg,fast \
      --cfg-modes bcg,fast --steps 50 --guidance 4 --runs 2 --out "$out/parallel-cfg-qwen-image" 2>&1 \
      | tee "$out/parallel-cfg-qwen-image.log" | grep -v "Warning\|warn(" | tail -20
    ;;
  serving)
    for pipeline in qwen-image z-image; do
      timeout 280 python3 -m bench.serving --pipeline "$pipeline" --weights random-full --resolutions 512x512,1024x1024 \
        --requests 50 --steps 8 --out "$out/serving-$pipeline" 2>&1 | tee "$out/serving-$pipeline.log" | tail -10
    done
    ;;
  demo)
    timeout 300 python3 app.py --pipeline z-image --weights random-full --record "$out/demo-z-image" 2>&1 \
      | tee "$out/demo-record.log" | tail -25
    ;;
  *)
    echo "unknown phase $phase" >&2
    exit 2
    ;;
esac
done
