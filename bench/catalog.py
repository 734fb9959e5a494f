"""What the benchmark compares, by name: its modes, what each runs, and what each must equal.

Names only, importable without torch or diffusers (``python -m bench --help`` lists them in a fraction of a
second); :mod:`bench.modes` prepares each mode on a pipeline.
"""

from __future__ import annotations

MODES: tuple[str, ...] = (
    "eager",
    "bcg",
    "bcg-no-te",
    "bcg-te",
    "bcg-no-auto",
    "fast",
    "fast-no-te",
    "fast-te",
    "fast-no-auto",
    "fast-unbatched",
    "compile",
    "compile-max",
    "eager+cache",
    "bcg+cache",
    "fast+cache",
    "fast-unbatched+cache",
    "compile+cache",
    "eager-fp8",
    "bcg-fp8",
    "fast-fp8",
    "fast-fp8-attn",
    "fast-fa4",
    "fast-fp8-fa4",
    "fast-fp8-attn-triton",
    "fast-fp8-attn-bf16-prologue",
    "fast-fp8-torchao-ff",
    "fast-fp8-unfused-qkv",
    "fast-fp8-uncompiled-te",
    "fast-fp8-compiled-vae",
    "fast-fp8-patched-vae",
    "fast-fp8-inductor-glue",
    "fast-inductor-glue",
    "fast-inductor-prologue",
    "fast-fp8-inductor-prologue",
    "fast-fp8-attn-inductor-prologue",
    "fast-joined-output",
    "fast-fp8-joined-output",
    "fast-fp8-all-linears",
    "fast-fp8-all-linears-attn",
    "fast-fp8-all-linears-attn-scaled-output",
    "bcg-no-controlnet",
    "fast-no-controlnet",
    "fast-uncompiled-controlnet",
    "eager-fp8+cache",
    "fast-fp8+cache",
    "fast-fp8-attn+cache",
    "eager+cachedit",
    "bcg+cachedit",
    "fast+cachedit",
)
# The modes with Cache-DiT's DBCache (``--cachedit-mask``, a static computation mask): they compare with
# eager+cachedit as the others with eager.
CACHEDIT: tuple[str, ...] = ("eager+cachedit", "bcg+cachedit", "fast+cachedit")
# The modes with a step cache (``--cache``): they compare with eager+cache as the others with eager.
CACHED: tuple[str, ...] = (
    "eager+cache",
    "bcg+cache",
    "fast+cache",
    "fast-unbatched+cache",
    "compile+cache",
    "eager-fp8+cache",
    "fast-fp8+cache",
    "fast-fp8-attn+cache",
)
# The modes with the transformer quantized to row-wise FP8 (bcg_diffusion.features.quantization): they compare with
# eager-fp8 (the same quantization by hand, eager) as the others with eager.
FP8_MODES: tuple[str, ...] = (
    "eager-fp8",
    "bcg-fp8",
    "fast-fp8",
    "fast-fp8-attn",
    "fast-fp8-fa4",
    "fast-fp8-attn-triton",
    "fast-fp8-attn-bf16-prologue",
    "fast-fp8-torchao-ff",
    "fast-fp8-unfused-qkv",
    "fast-fp8-uncompiled-te",
    "fast-fp8-compiled-vae",
    "fast-fp8-patched-vae",
    "fast-fp8-inductor-glue",
    "fast-fp8-inductor-prologue",
    "fast-fp8-attn-inductor-prologue",
    "fast-fp8-joined-output",
    "fast-fp8-all-linears",
    "fast-fp8-all-linears-attn",
    "fast-fp8-all-linears-attn-scaled-output",
    "eager-fp8+cache",
    "fast-fp8+cache",
    "fast-fp8-attn+cache",
)
# Ablations of what our defaults add: the text encoder's graphs, automatic breaks, fast mode's CFG batching,
# Qwen-Image's stacked output projection and attention's fused prologue.
ABLATIONS: tuple[str, ...] = ("bcg-no-te", "bcg-no-auto", "fast-no-te", "fast-no-auto", "fast-unbatched")
ABLATIONS += ("bcg-te", "fast-te")
ABLATIONS += ("fast-joined-output", "fast-inductor-prologue", "fast-inductor-glue")
ABLATIONS += ("bcg-no-controlnet", "fast-no-controlnet", "fast-uncompiled-controlnet")
# The modes that need an optional package (flash-attn-4): they run when named.
OPTIONAL_PACKAGE: tuple[str, ...] = ("fast-fa4", "fast-fp8-fa4")
# What a run without --modes compares on a GPU: ours as a user gets them, and the peers.
DEFAULT_MODES: tuple[str, ...] = tuple(
    m
    for m in MODES
    if m not in ABLATIONS
    and m not in CACHED
    and m not in FP8_MODES
    and m not in CACHEDIT
    and m not in OPTIONAL_PACKAGE
)
# What a run of bench.published's pipelines (flux, flux2-klein, wan, qwen-image-edit, hunyuan-image) without --modes
# compares on a GPU: each is minutes at its published size, so ours as a user gets them and diffusers' regional
# compile.
PUBLISHED_DEFAULT_MODES: tuple[str, ...] = (
    "eager",
    "bcg",
    "fast",
    "compile",
    "eager-fp8",
    "fast-fp8",
    "fast-fp8-attn",
)
# What a run without --modes compares on a CPU, where every mode of ours runs in debug mode (no graphs).
CPU_DEFAULT_MODES: tuple[str, ...] = ("eager", "bcg")
# The modes a user picks, each in one line of --help; the others (ablations, kernel and layout variants of the
# rounds that measured them) are listed by --list-modes.
SUMMARIES = {
    "eager": "diffusers as is",
    "bcg": "exact mode: the eager kernels replayed from graphs",
    "fast": 'mode="fast": compiled blocks inside the graphs',
    "compile": "peer: diffusers' compile_repeated_blocks",
    "compile-max": 'peer: torch.compile(mode="reduce-overhead")',
    "eager+cache": "diffusers with a step cache (--cache): baseline",
    "bcg+cache": "exact mode, the same step cache inside its graphs",
    "fast+cache": "fast mode, the same step cache inside its graphs",
    "eager-fp8": "diffusers, transformer in FP8 (torchao): baseline",
    "fast-fp8": 'fast mode with quantize="fp8"',
    "fast-fp8-attn": 'fast-fp8 with attention="fp8" too',
    "fast+cachedit": "fast mode with Cache-DiT (--cachedit-mask)",
}
USER_MODES: tuple[str, ...] = tuple(SUMMARIES)
DESCRIPTIONS = {
    "eager": "diffusers as is",
    "bcg": "bcg-diffusion accelerate(pipe), exact mode (debug mode on CPU: no graphs, timings not meaningful)",
    "bcg-no-te": "bcg without the text encoder's graphs (components transformer, vae; Z-Image has them by default)",
    "bcg-te": "bcg with every text encoder's graphs (each named in components: T5, UMT5, CLIP... too)",
    "bcg-no-auto": "bcg with auto_breaks=False: only the marked breaks and hand patches (what automatic breaks cost)",
    "fast": 'bcg-diffusion accelerate(pipe, mode="fast"): compiled repeated blocks inside breakable graphs',
    "fast-no-te": "fast without the text encoder's graphs (components transformer, vae)",
    "fast-te": "fast with every text encoder's graphs, their layers compiled (each named in components)",
    "fast-no-auto": "fast with auto_breaks=False",
    "fast-unbatched": "fast with batch_cfg=False: true CFG's cond and uncond calls one by one (what batching adds)",
    "compile": "diffusers regional compile: transformer.compile_repeated_blocks(fullgraph=True)",
    "compile-max": 'torch.compile(transformer, mode="reduce-overhead") (inductor with its own CUDA graphs)',
    "eager+cache": "diffusers as is with the step cache (transformer.enable_cache; --cache)",
    "bcg+cache": "bcg exact mode with the same step cache inside its graphs",
    "fast+cache": "fast mode with the same step cache inside its graphs (true CFG's two calls batched in one joint "
    "cache context where the cache allows it)",
    "fast-unbatched+cache": "fast+cache with batch_cfg=False: true CFG's calls one by one (what batching adds under "
    "the cache)",
    "eager-fp8": "diffusers with the transformer's block linears quantized to row-wise FP8 by hand (torchao, "
    "bcg_diffusion.features.quantization's default filter)",
    "bcg-fp8": 'accelerate(pipe, quantize="fp8"): the same FP8 model in exact graphs',
    "fast-fp8": 'accelerate(pipe, mode="fast", quantize="fp8"): the same FP8 model, compiled blocks in graphs',
    "fast-fp8-attn": 'fast-fp8 with attention="fp8": the attention in FP8 too (cuDNN\'s kernel where '
    "nvidia-cudnn-frontend is installed, else ours in Triton)",
    "fast-fa4": 'fast mode with attention="fa4": bf16 attention through FlashAttention-4 (pip install '
    "bcg-diffusion[fa4]; a GPU of compute capability 9.x or 10.x)",
    "fast-fp8-fa4": 'fast-fp8 with attention="fa4"',
    "fast-fp8-attn-triton": "fast-fp8-attn with our Triton FP8 attention kernel, cuDNN's or not "
    "(features.fp8_attention.choose)",
    "fast-fp8-attn-bf16-prologue": "fast-fp8-attn with cuDNN's FP8 query and key written in bf16 by attention's "
    "prologue and quantized after it, as before the prologue wrote them in FP8; Wan's at their largest magnitudes, "
    "not their norms' bounds (features.fp8_attention.choose_prologue)",
    "fast-fp8-torchao-ff": "fast-fp8 without our FP8 feed-forward kernel: the activation and the down projection's "
    "FP8 input scales as torchao writes them, compiled by inductor (patches.fp8_feed_forward)",
    "fast-fp8-unfused-qkv": "fast-fp8 with each attention's query, key and value projected by three FP8 products, "
    "not one (features.fused_qkv.choose)",
    "fast-fp8-uncompiled-te": "fast-fp8 with the text encoder's layers eager inside its graphs, not compiled "
    "(features.compiled_text_encoder.choose)",
    "fast-fp8-compiled-vae": "fast-fp8 with the VAE decoder compiled whole by inductor, the opt-in "
    '(features.vae_decoder.choose(pipe.vae, "compiled"))',
    "fast-fp8-patched-vae": "fast-fp8 with the VAE decoder as fast mode ran it before run 133: contiguous, only "
    'its group norms patched (features.vae_decoder.choose(pipe.vae, "patched"))',
    "fast-fp8-inductor-glue": "fast-fp8 with the Z-Image, Qwen-Image or FLUX block glue (norms, modulation, gated "
    "residuals, FP8 input scales) compiled by inductor, not in our kernels (patches.block_glue.choose)",
    "fast-inductor-glue": "fast with FLUX.1's single blocks as the class runs them: the MLP's GELU and the join of "
    "its output with attention's compiled by inductor, one output projection over the joined row, not two products "
    "(patches.block_glue.choose)",
    "fast-inductor-prologue": "fast with attention's prologue (query and key norms, RoPE, the joint text-and-image "
    'tensors) compiled by inductor, not in our kernel (patches.attention.choose_qk_prologue(..., "compiled"))',
    "fast-fp8-inductor-prologue": "fast-fp8 with attention's prologue compiled by inductor, as fast-inductor-prologue",
    "fast-fp8-attn-inductor-prologue": "fast-fp8-attn with attention's prologue compiled by inductor, cuDNN's FP8 "
    "query and key quantized after it, as fast-inductor-prologue",
    "fast-joined-output": "fast with Qwen-Image's image output projection run once on its CFG groups' rows joined, "
    'not per group into one output (patches.stacked_output.choose(pipe.transformer, "joined"))',
    "fast-fp8-joined-output": "fast-fp8 with Qwen-Image's image output projection on its CFG groups' rows joined, "
    "as fast-joined-output",
    "fast-fp8-all-linears": "fast-fp8 with every block linear in FP8, the attention output projections too "
    "(quantize_filter=block_linears(pipe.transformer); the default filter keeps those in bf16)",
    "fast-fp8-all-linears-attn": "fast-fp8-all-linears with FP8 attention: cuDNN's float8 output handed to the FP8 "
    "output projection as it is (patches.fp8_output_projection)",
    "fast-fp8-all-linears-attn-scaled-output": "fast-fp8-all-linears-attn with attention's output scaled back to bf16 "
    'and quantized again before the output projection (fp8_output_projection.choose(pipe.transformer, "scaled"))',
    "bcg-no-controlnet": "bcg with the ControlNet eager, not as graphs (components transformer, vae)",
    "fast-no-controlnet": "fast with the ControlNet eager, not as graphs (components transformer, vae)",
    "fast-uncompiled-controlnet": "fast with the ControlNet's blocks eager inside its graphs, not compiled "
    "(features.compiled_controlnet.choose)",
    "eager-fp8+cache": "eager-fp8 with the step cache (--cache)",
    "fast-fp8+cache": "fast-fp8 with the same step cache inside its graphs",
    "fast-fp8-attn+cache": "fast-fp8-attn with the same step cache inside its graphs",
    "compile+cache": "regional compile (compile_repeated_blocks, fullgraph=False: the cache's hooks break graphs) "
    "with the same step cache",
    "eager+cachedit": "diffusers with Cache-DiT's DBCache (cache_dit.enable_cache, a static computation mask: "
    "--cachedit-mask)",
    "bcg+cachedit": "bcg exact mode with the same Cache-DiT config, its cached blocks inside the graphs",
    "fast+cachedit": "fast mode with the same Cache-DiT config, its cached blocks inside the graphs",
}
EXACT = {"eager": True, "bcg": True, "bcg-no-te": True, "bcg-te": True, "bcg-no-auto": True}
EXACT.update({"fast": False, "fast-no-te": False, "fast-te": False, "fast-no-auto": False, "fast-unbatched": False})
EXACT.update({"compile": False, "compile-max": False})
EXACT.update({"eager+cache": True, "bcg+cache": True, "fast+cache": False, "compile+cache": False})
EXACT.update({"fast-unbatched+cache": False})
EXACT.update(
    {"eager-fp8": True, "bcg-fp8": True, "fast-fp8": False, "fast-fp8-attn": False, "fast-fp8-torchao-ff": False}
)
EXACT.update({"eager-fp8+cache": True, "fast-fp8+cache": False, "fast-fp8-attn+cache": False})
EXACT.update({"fast-fp8-attn-triton": False, "fast-fp8-unfused-qkv": False, "fast-fp8-uncompiled-te": False})
EXACT.update({"fast-fp8-attn-bf16-prologue": False, "fast-fa4": False, "fast-fp8-fa4": False})
EXACT.update({"fast-fp8-compiled-vae": False, "fast-fp8-patched-vae": False, "fast-fp8-inductor-glue": False})
EXACT.update({"fast-joined-output": False, "fast-fp8-joined-output": False, "fast-inductor-glue": False})
EXACT.update({name: False for name in MODES if name.endswith("-inductor-prologue")})
EXACT.update({name: False for name in MODES if "-all-linears" in name})
EXACT.update({"eager+cachedit": True, "bcg+cachedit": True, "fast+cachedit": False})
EXACT.update({"bcg-no-controlnet": True, "fast-no-controlnet": False, "fast-uncompiled-controlnet": False})
OURS = ("bcg", "bcg-no-te", "bcg-te", "bcg-no-auto", "fast", "fast-no-te", "fast-te", "fast-no-auto", "fast-unbatched")
OURS += ("bcg+cachedit", "fast+cachedit")
OURS += ("bcg+cache", "fast+cache", "fast-unbatched+cache", "bcg-fp8", "fast-fp8", "fast-fp8-attn", "fast-fp8+cache")
OURS += ("fast-fp8-torchao-ff", "fast-fp8-attn-triton", "fast-fp8-attn+cache", "fast-fp8-unfused-qkv")
OURS += ("fast-fp8-uncompiled-te", "fast-fp8-compiled-vae", "fast-fp8-patched-vae", "fast-fp8-inductor-glue")
OURS += ("fast-fp8-attn-bf16-prologue", "fast-joined-output", "fast-fp8-joined-output", "fast-inductor-glue")
OURS += tuple(name for name in MODES if "-all-linears" in name or name.endswith("-inductor-prologue"))
OURS += ("fast-fa4", "fast-fp8-fa4")
OURS += ("bcg-no-controlnet", "fast-no-controlnet", "fast-uncompiled-controlnet")
FAST = ("fast", "fast-no-te", "fast-te", "fast-no-auto", "fast-unbatched", "fast+cache", "fast-fp8", "fast-fp8-attn")
FAST += ("fast-fp8-torchao-ff", "fast-fp8-attn-triton", "fast-fp8-attn+cache", "fast-fp8-unfused-qkv")
FAST += ("fast-fp8-uncompiled-te", "fast-fp8-compiled-vae", "fast-fp8-patched-vae", "fast-fp8-inductor-glue")
FAST += ("fast-fp8+cache", "fast+cachedit", "fast-unbatched+cache", "fast-fp8-attn-bf16-prologue")
FAST += ("fast-joined-output", "fast-fp8-joined-output", "fast-inductor-glue")
FAST += tuple(name for name in MODES if "-all-linears" in name or name.endswith("-inductor-prologue"))
FAST += ("fast-fa4", "fast-fp8-fa4")
FAST += ("fast-no-controlnet", "fast-uncompiled-controlnet")


def baseline(name: str) -> str:
    """The mode whose first call an exact mode's images must equal: eager, with the cache if ``name`` has one."""
    if name in FP8_MODES:
        return "eager-fp8+cache" if name in CACHED else "eager-fp8"
    if name in CACHEDIT:
        return "eager+cachedit"
    return "eager+cache" if name in CACHED else "eager"


# Peers that record CUDA graphs of their own (inductor's cudagraph trees) run in a group of their own,
# after ours are freed. That began as the way around a crash (our replay used a cuBLAS workspace that
# reduce-overhead's recording had freed), fixed since in bcg_diffusion.core.graphs (runs 50 and 52); it stays
# so that each side's graph memory and first call are measured without the other's graphs alive, as in
# every record before.
SEPARATE = ("compile-max",)
