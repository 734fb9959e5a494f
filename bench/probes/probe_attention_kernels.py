"""GPU probe: attention kernels and the glue of one fast-mode block at 1024² (issue 34).

* ``kernels``: attention alone on the shapes of Qwen-Image at 1024² (fast mode's CFG batch attends per
  prompt: batch 1, 24 heads of 128, 4,096 image and 64 text tokens; and batch 2, as one call) and Z-Image
  (30 heads of 128, 1,088 and 4,160 tokens), inputs ``[B, S, H, D]`` as the processors hold them: PyTorch
  SDPA with each backend on the transposed views (what diffusers' dispatch does), cuDNN on contiguous
  ``[B, H, S, D]`` (its kernel alone), our Triton kernel in bf16 and FP8 (with and without its
  quantization), each replayed from a CUDA graph: time, TFLOP/s (4·B·H·S²·D), relative error against
  float32 attention. Then each Triton launch configuration, to fix the one the library uses.
* ``qwen-block`` / ``z-block``: one block compiled as fast mode compiles it, with fast mode's processor
  patches, for each attention kernel of ``patches.attention.KERNELS`` (and, for Qwen-Image, GELU in the
  matrix product's epilogue): time per block and the kernel table by kind.
* ``prologue``: attention's prologue alone (query and key RMS norms, RoPE, the joint text-and-image
  query, key and value), compiled by inductor as fast mode's processors write it against our fused
  Triton kernel (``kernels.qk_prologue``), at Qwen-Image 1024² in the CFG batch (2 rows, 205 text tokens
  of which 160 and 205 valid, 4096 image tokens) and Z-Image 1024² (query and key only, 4160 tokens),
  replayed from a CUDA graph: µs, GB/s (bytes read and written once), difference between the two; then
  each launch configuration of the kernel.
* ``prologue-blocks``: one Qwen-Image block (1024² CFG, GELU epilogue, as fast mode runs it now) and one
  Z-Image block (cuDNN on the tensors as they are) with the switch ``patches.attention.QK_PROLOGUE_ATTRIBUTE``
  "compiled" against "fused": time per block replayed from a graph, the kernel table by kind.

* ``reductions``: the same blocks (fused prologue), in bf16 and in FP8 (``quantize="fp8"``'s config and
  filter), compiled with inductor's persistent reductions as it chooses them (rows up to 1,024 elements)
  and widened to rows of up to 16,384: the blocks' LayerNorms and FP8 row scales reduce over 3,072 to
  12,288 elements, which inductor otherwise loops over, reading each row twice.

* ``fp8-ff``: one Qwen-Image block (tanh GELU) and one Z-Image block (SwiGLU) in FP8 with the feed-forward's
  activation and its down projection's FP8 input as inductor compiles them, then with our kernel
  (``patches.fp8_feed_forward``); then each kernel alone at its block's shape (Qwen-Image: 2 x 4,160 rows of
  12,288; Z-Image: 4,160 rows of 10,240) against the same arithmetic compiled, and its launch settings.

* ``block-glue``: one Z-Image FP8 block with its glue compiled by inductor against ``kernels.block_glue``'s
  kernels, then each kernel alone (``patches.zimage_block``).
* ``qwen-block-glue``: the same for one Qwen-Image FP8 block at 1024² in the CFG batch
  (``patches.qwenimage_block``), with SDPA's attention and with cuDNN's FP8 attention; then each kernel
  alone on the image stream's 2 x 4,096 rows.
* ``fp8-prologue``: cuDNN's FP8 attention's inputs for Qwen-Image 1024² in the CFG batch, the query and key
  quantized after attention's prologue (inductor) against in it (``qk_prologue.joint_qkv_fp8``), alone and
  in one Qwen-Image FP8 block; then the bf16 and FP8 prologue kernels alone under each launch setting.
* ``stacked-output``: one Qwen-Image block in the CFG batch, bf16 and FP8, its image output projection run
  per group into one output (``patches.stacked_output``) against the groups' rows joined first, at 1024² and
  512².
* ``w13-bf16``: one Z-Image block in bf16 fast mode, its feed-forward's ``w1`` and ``w3`` as two products
  against one over their stacked weights (a copy made by the probe), at 1024² and 512².

    python -m bench.probes.probe_attention_kernels [--sections kernels,qwen-block,z-block,prologue,prologue-blocks,reductions,fp8-ff,block-glue,qwen-block-glue,fp8-prologue,stacked-output,w13-bf16]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from bcg_diffusion.core.hooks import MethodPatches
from bcg_diffusion.features import compiled_blocks as fast
from bcg_diffusion.kernels import attention as kernels
from bcg_diffusion.kernels import qk_prologue
from bcg_diffusion.patches import attention
from bcg_diffusion.patches.gelu import gelu_in_epilogue
from bench.probes.probe_fast_floor import graph_replay_ms, kernel_table, random_block, section
from bench.probes.probe_fp8_block import QWEN_DIM, QWEN_HEADS, Z_DIM, Z_HEADS, qwen_block_inputs

SHAPES = {  # label: (batch, tokens, heads)
    "qwen 1024² per prompt": (1, 4160, 24),
    "qwen 1024² CFG batch": (2, 4160, 24),
    "z 512²": (1, 1088, 30),
    "z 1024²": (1, 4160, 30),
}
TRITON_CONFIGS = [
    (reader, *tiles)
    for reader in ("tma", "pointers")
    for tiles in (
        (128, 64, 4, 3),
        (128, 64, 8, 3),
        (128, 128, 8, 2),
        (128, 128, 8, 3),
        (128, 128, 8, 4),
        (64, 64, 4, 4),
    )
]


def _sdpa(backend: Any) -> Callable[..., torch.Tensor]:
    from torch.nn.attention import sdpa_kernel

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with contextlib.nullcontext() if backend is None else sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return out.transpose(1, 2).flatten(2, 3)  # what the output projection reads

    return run


def _cudnn_contiguous(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v)


def candidates() -> dict[str, tuple[Callable[..., torch.Tensor], bool]]:
    """label: (function of q, k, v, whether it takes contiguous [B, H, S, D])."""
    from torch.nn.attention import SDPBackend

    found = {
        "sdpa default": (_sdpa(None), False),
        "sdpa flash": (_sdpa(SDPBackend.FLASH_ATTENTION), False),
        "sdpa cudnn": (_sdpa(SDPBackend.CUDNN_ATTENTION), False),
        "sdpa efficient": (_sdpa(SDPBackend.EFFICIENT_ATTENTION), False),
        "cudnn, [B,H,S,D] contiguous": (_cudnn_contiguous, True),
        "triton bf16": (lambda q, k, v: kernels.attention(q, k, v).flatten(2, 3), False),
        "triton fp8 (with quantization)": (lambda q, k, v: kernels.fp8_attention(q, k, v).flatten(2, 3), False),
    }  # fmt: skip
    return found


def attention_kernels() -> None:
    torch.manual_seed(0)
    for label, (batch, tokens, heads) in SHAPES.items():
        q, k, v = (torch.randn(batch, tokens, heads, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flops = 4 * batch * heads * tokens * tokens * 128
        reference = F.scaled_dot_product_attention(*(t.float().transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
        print(f"\n-- {label}: q {tuple(q.shape)}, {flops / 1e9:.0f} GFLOP", flush=True)
        for name, (fn, contiguous) in candidates().items():
            args = tuple(t.transpose(1, 2).contiguous() for t in (q, k, v)) if contiguous else (q, k, v)
            try:
                ms, out = graph_replay_ms(lambda fn=fn, args=args: [fn(*args) for _ in range(5)][-1])
            except Exception as error:  # a backend refusing the shape is a result here
                print(f"   {name:34s}: failed: {type(error).__name__}: {str(error)[:120]}")
                continue
            ms /= 5
            out = out.transpose(1, 2) if contiguous else out.unflatten(-1, (heads, 128))
            error = ((out.float() - reference).norm() / reference.norm()).item()
            print(f"   {name:34s}: {ms * 1e3:8.1f} us  {flops / ms / 1e9:6.0f} TFLOP/s  rel. error {error:.4f}")
        quantized = kernels.quantize_for_fp8_attention(q, k, v)
        torch.cuda.synchronize()
        ms, _ = graph_replay_ms(
            lambda quantized=quantized, q=q: [
                torch.ops.bcg_diffusion.fp8_attention(*quantized, 128**-0.5, q.dtype) for _ in range(5)
            ][-1]
        )
        print(f"   {'triton fp8 kernel alone':34s}: {ms / 5 * 1e3:8.1f} us  {flops / ms * 5 / 1e9:6.0f} TFLOP/s")
        if label in ("qwen 1024² per prompt", "z 1024²"):
            for kind in ("bf16", "fp8"):
                saved = kernels._CONFIGS[kind]
                for config in TRITON_CONFIGS:
                    kernels._CONFIGS[kind] = config
                    fn = kernels.attention if kind == "bf16" else kernels.fp8_attention
                    try:
                        if kind == "fp8":  # the kernel alone, as inside a compiled block (quantization fused)
                            ms, _ = graph_replay_ms(lambda quantized=quantized, q=q: [
                                torch.ops.bcg_diffusion.fp8_attention(*quantized, 128**-0.5, q.dtype) for _ in range(5)
                            ][-1])  # fmt: skip
                        else:
                            ms, _ = graph_replay_ms(lambda fn=fn, q=q, k=k, v=v: [fn(q, k, v) for _ in range(5)][-1])
                        print(
                            f"   config {kind} {config}: {ms / 5 * 1e3:8.1f} us  {flops / ms * 5 / 1e9:6.0f} TFLOP/s"
                        )
                    except Exception as error:
                        print(f"   config {kind} {config}: failed: {type(error).__name__}: {str(error)[:120]}")
                kernels._CONFIGS[kind] = saved


def time_block(
    base: torch.nn.Module,
    inputs: dict[str, tuple],
    patches_: tuple,
    variants: list[tuple],
    prepare: Callable[[torch.nn.Module], None] | None = None,
) -> None:
    """For each (label, attention kernel, GELU in the epilogue[, attention prologue]): compile a copy of
    ``base`` as fast mode does, time it per size, print its error against the first variant and the
    kernel table of the first size. The prologue ("compiled" or "fused"), where given, is set on every
    attention module (``patches.attention.QK_PROLOGUE_ATTRIBUTE``). ``prepare`` (optional) changes the
    copy's holder before anything else (quantization)."""
    references: dict[str, torch.Tensor] = {}
    for label, kernel, gelu_epilogue, *prologue in variants:
        holder = torch.nn.Module()
        holder.block = copy.deepcopy(base)
        holder._repeated_blocks = [type(base).__name__]
        if prepare is not None:
            prepare(holder)
        patches, compile_patches = MethodPatches(), MethodPatches()
        for patch in patches_:
            patch.apply(holder.block, patches)
        for module in holder.block.modules():
            if hasattr(module, "processor"):
                setattr(module, attention.KERNEL_ATTRIBUTE, kernel)
                if prologue:
                    setattr(module, attention.QK_PROLOGUE_ATTRIBUTE, prologue[0])
            if gelu_epilogue and type(module).__name__ == "GELU" and getattr(module, "approximate", "") == "tanh":
                module.forward = gelu_in_epilogue(module)
        torch._dynamo.reset()
        fast.compile_repeated_blocks(holder, compile_patches)
        try:
            with torch.no_grad():
                started = time.perf_counter()
                for args in inputs.values():
                    holder.block(*args)
                torch.cuda.synchronize()
                compile_s = time.perf_counter() - started
                for index, (size, args) in enumerate(inputs.items()):
                    ms, out = graph_replay_ms(
                        lambda args=args, block=holder.block: [block(*args) for _ in range(10)][-1]
                    )
                    out = torch.cat([o.flatten() for o in out]) if isinstance(out, tuple) else out.flatten()
                    out = out.float()
                    references.setdefault(size, out)
                    error = ((out - references[size]).norm() / references[size].norm()).item()
                    print(f"{label:36s} {size:14s}: {ms / 10 * 1e3:7.1f} us per block, rel. error vs first {error:.4f} "
                          f"(compile {compile_s:.1f} s)", flush=True)  # fmt: skip
                    if index == 0:
                        kernel_table(lambda args=args, block=holder.block: block(*args), f"{label}, {size}", top=16)
        except Exception as error:
            print(f"{label}: failed: {type(error).__name__}: {str(error)[:300]}")
        finally:
            compile_patches.undo()
            patches.undo()
        del holder
        torch.cuda.empty_cache()


def _qwen_block_case() -> tuple[torch.nn.Module, dict[str, tuple], tuple]:
    """A random full-width Qwen-Image block, its inputs at 1024² in fast mode's CFG batch (two prompts of 64 and
    40 valid text tokens, attended per prompt), and the processor patches fast mode applies to it."""
    from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformerBlock

    from bcg_diffusion.patches.rope import QWEN_REAL_ROPE_PATCH

    torch.manual_seed(0)
    with torch.device("cuda"):
        base = random_block(QwenImageTransformerBlock(QWEN_DIM, QWEN_HEADS, QWEN_DIM // QWEN_HEADS))
    inputs = {"1024² CFG": (*qwen_block_inputs(4096, 64, batch=2), {attention.TEXT_LENGTHS_KWARG: (64, 40)})}
    return base, inputs, (QWEN_REAL_ROPE_PATCH, attention.QWEN_ATTENTION_PATCH)


def _z_block_case() -> tuple[torch.nn.Module, dict[str, tuple], tuple]:
    """A random full-width Z-Image block, its inputs at 1024² and 512², and fast mode's processor patch."""
    from diffusers.models.transformers.transformer_z_image import ZImageTransformerBlock

    torch.manual_seed(0)
    with torch.device("cuda"):
        base = random_block(ZImageTransformerBlock(0, Z_DIM, Z_HEADS, Z_HEADS, 1e-5, qk_norm=True, modulation=True))
    inputs = {}
    for size, tokens in {"1024²": 4160, "512²": 1088}.items():
        angles = torch.rand(1, tokens, Z_DIM // Z_HEADS // 2, device="cuda") * 6.28
        inputs[size] = (
            torch.randn(1, tokens, Z_DIM, device="cuda", dtype=torch.bfloat16),
            None,
            torch.polar(torch.ones_like(angles), angles),
            torch.randn(1, 256, device="cuda", dtype=torch.bfloat16),
        )
    return base, inputs, (attention.ZIMAGE_ATTENTION_PATCH,)


def qwen_block() -> None:
    variants = [("dispatch", "dispatch", False), ("fp8", "fp8", False)]
    variants += [("dispatch + GELU epilogue", "dispatch", True), ("fp8 + GELU epilogue", "fp8", True)]
    time_block(*_qwen_block_case(), variants)


def z_block() -> None:
    # The Z-Image patch's dispatch takes diffusers' cuDNN backend on Hopper (copies into its layout);
    # "cudnn" is SDPA's cuDNN kernel on the tensors as they are.
    time_block(*_z_block_case(), [(kernel, kernel, False) for kernel in ("dispatch", "cudnn", "fp8")])


PROLOGUE_CONFIGS = [(16, 2), (32, 4), (32, 8), (64, 4), (64, 8), (128, 8)]  # (rows of D per program, warps)


def _prologue_report(label: str, fn: Callable[[], Any], nbytes: int, reps: int = 10) -> tuple[float, Any]:
    ms, out = graph_replay_ms(lambda: [fn() for _ in range(reps)][-1])
    us = ms / reps * 1e3
    print(f"   {label:44s}: {us:8.1f} us  {nbytes / us / 1e3:7.0f} GB/s", flush=True)
    return us, out


def _difference(got: list[torch.Tensor], expected: list[torch.Tensor]) -> str:
    worst = max((g.float() - e.float()).abs().max().item() for g, e in zip(got, expected))
    relative = max(((g.float() - e.float()).norm() / e.float().norm()).item() for g, e in zip(got, expected))
    moved = sum((g != e).sum().item() for g, e in zip(got, expected)) / sum(e.numel() for e in expected)
    return f"max abs difference {worst:.4g}, relative {relative:.2e}, elements that differ {moved:.2%}"


def _sweep_configs(fused: Callable[[], list[torch.Tensor]], nbytes: int) -> None:
    """``fused`` timed under each launch setting of :data:`PROLOGUE_CONFIGS`, the kernel's own put back after."""
    saved = qk_prologue._CONFIG
    try:
        for config in PROLOGUE_CONFIGS:
            qk_prologue._CONFIG = config
            _prologue_report(f"fused, config {config}", fused, nbytes)
    finally:
        qk_prologue._CONFIG = saved


def prologue() -> None:
    """Attention's prologue alone: inductor's code for fast mode's processors against the fused kernel."""
    from diffusers.models.normalization import RMSNorm

    torch.manual_seed(0)
    head_dim = 128
    norms = [random_block(RMSNorm(head_dim, eps=1e-6)).cuda() for _ in range(4)]
    weights, eps = [n.weight for n in norms], [n.eps for n in norms]

    # Qwen-Image 1024², CFG batch: what qwen_joint_attention_per_group computes before attention.
    batch, text_tokens, image_tokens, heads, lengths = 2, 205, 4096, QWEN_HEADS, (160, 205)
    image = [torch.randn(batch, image_tokens, heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    text = [torch.randn(batch, text_tokens, heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    angles = [torch.rand(n, head_dim // 2, device="cuda") * 6.28 for n in (image_tokens, text_tokens)]
    freqs = tuple(torch.view_as_real(torch.polar(torch.ones_like(a), a)) for a in angles)

    def compiled_joint() -> list[torch.Tensor]:
        img = [norms[0](image[0]), norms[1](image[1]), image[2]]
        txt = [norms[2](text[0]), norms[3](text[1]), text[2]]
        rows = batch // len(lengths)
        joints = []
        for g, length in enumerate(lengths):
            joints += attention._compiled_joint(img, txt, freqs, g * rows, (g + 1) * rows, length)
        return joints

    def fused_joint() -> list[torch.Tensor]:
        joints = qk_prologue.joint_qkv(image, text, weights, eps, freqs, lengths)
        slices = [qk_prologue.group_slices(j, lengths, text_tokens) for j in joints]
        return [tensor for group in zip(*slices) for tensor in group]  # group by group, q, k, v

    rows_moved = batch * image_tokens + sum(lengths) * (batch // len(lengths))
    nbytes = 3 * 2 * rows_moved * heads * head_dim * 2  # q, k, v read once and written once, bf16
    print(f"\n-- Qwen-Image 1024² CFG batch: {batch}x({text_tokens} text, valid {lengths}; {image_tokens} image)"
          f"x{heads}x{head_dim}, {nbytes / 1e6:.0f} MB moved")  # fmt: skip
    compiled = torch.compile(compiled_joint, fullgraph=True)
    _, expected = _prologue_report("inductor (fast mode's compiled path)", compiled, nbytes)
    _, got = _prologue_report(f"fused Triton kernel {qk_prologue._CONFIG}", fused_joint, nbytes)
    print(f"   fused against inductor: {_difference(got, expected)}")
    reference = qk_prologue.reference_joint_qkv(image, text, weights, eps, freqs, lengths)
    reference = [
        t for group in zip(*[qk_prologue.group_slices(j, lengths, text_tokens) for j in reference]) for t in group
    ]
    print(f"   fused against the eager reference: {_difference(got, reference)}")
    print(f"   inductor against the eager reference: {_difference(expected, reference)}")
    _sweep_configs(fused_joint, nbytes)

    # Z-Image 1024²: the query and key normed and rotated (complex RoPE in the compiled path).
    tokens, heads = 4160, Z_HEADS
    query, key = (torch.randn(1, tokens, heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    angles = torch.rand(1, tokens, head_dim // 2, device="cuda") * 6.28
    freqs_cis = torch.polar(torch.ones_like(angles), angles)
    nbytes = 2 * 2 * query.numel() * 2
    print(f"\n-- Z-Image 1024²: query and key {tuple(query.shape)}, {nbytes / 1e6:.0f} MB moved")

    def compiled_norm_rope() -> list[torch.Tensor]:
        return [
            attention._rotate_complex(norms[0](query), freqs_cis),
            attention._rotate_complex(norms[1](key), freqs_cis),
        ]

    def fused_norm_rope() -> list[torch.Tensor]:
        return list(qk_prologue.norm_rope(query, key, weights[:2], eps[:2], torch.view_as_real(freqs_cis)))

    torch._dynamo.reset()
    _, expected = _prologue_report("inductor (fast mode's compiled path)", torch.compile(compiled_norm_rope), nbytes)
    _, got = _prologue_report(f"fused Triton kernel {qk_prologue._CONFIG}", fused_norm_rope, nbytes)
    print(f"   fused against inductor: {_difference(got, expected)}")
    _sweep_configs(fused_norm_rope, nbytes)


def prologue_blocks() -> None:
    """One Qwen-Image and one Z-Image block as fast mode runs them, attention's prologue compiled or fused."""
    time_block(*_qwen_block_case(), [(f"qwen, prologue {p}", "dispatch", True, p) for p in attention.QK_PROLOGUES])
    torch.cuda.empty_cache()
    time_block(*_z_block_case(), [(f"z, prologue {p}", "cudnn", False, p) for p in attention.QK_PROLOGUES])


@contextlib.contextmanager
def persistent_reductions(limit: int | None) -> Any:
    """Inductor's choice of a persistent reduction (the whole row in one program, read once) for row
    reductions of up to ``limit`` elements, where its default stops at 1,024 and loops over the row
    (reading it twice for a norm); None: inductor's default. Fast mode's own widening
    (``features.persistent_reductions``) takes this limit meanwhile, and the caches are off, so no
    kernel compiled under another setting is loaded."""
    from torch._inductor import config as inductor

    from bcg_diffusion.features import persistent_reductions as ours

    widened, options = ours.widened, ours.inductor_options
    # The blocks compile inside fast mode's own widening: point it at this limit (or at nothing)
    ours.widened = contextlib.nullcontext if limit is None else functools.partial(widened, limit)
    ours.inductor_options = dict
    try:
        with inductor.patch(force_disable_caches=True):
            yield
    finally:
        ours.widened, ours.inductor_options = widened, options


def _fp8(holder: torch.nn.Module) -> None:
    from bcg_diffusion.features.quantization import FP8, default_filter, quantize_transformer, torchao_config

    quantize_transformer(holder, torchao_config(FP8), default_filter(holder))


def reductions() -> None:
    """One Qwen-Image and one Z-Image block as fast mode runs them (fused prologue), in bf16 and in FP8,
    with inductor's persistent reductions up to 1,024 elements (its default), 4,096 (fast mode's) and 16,384."""
    for limit in (None, 4096, 16384):
        label = "default" if limit is None else f"persistent <= {limit}"
        with persistent_reductions(limit):
            time_block(*_qwen_block_case(), [(f"qwen bf16, {label}", "dispatch", True, "fused")])
            time_block(*_qwen_block_case(), [(f"qwen fp8, {label}", "dispatch", False, "fused")], prepare=_fp8)
            torch.cuda.empty_cache()
            time_block(*_z_block_case(), [(f"z bf16, {label}", "cudnn", False, "fused")])
            time_block(*_z_block_case(), [(f"z fp8, {label}", "cudnn", False, "fused")], prepare=_fp8)
            torch.cuda.empty_cache()


def _fp8_feed_forward(choice: str) -> Callable[[torch.nn.Module], None]:
    """A ``prepare`` for :func:`time_block`: FP8 as fast mode quantizes, then every feed-forward set to ``choice``
    ("fused": our kernel, patched here as fast mode patches it; "torchao": inductor compiles torchao's steps)."""
    from bcg_diffusion.patches import fp8_feed_forward as patch  # this module's fp8_feed_forward is a section

    def prepare(holder: torch.nn.Module) -> None:
        _fp8(holder)
        patch.choose(holder, choice)
        if choice == "fused":
            assert patch.patch_fp8_feed_forwards(holder, MethodPatches()) > 0  # dropped with the copy

    return prepare


def fp8_feed_forward() -> None:
    """One Qwen-Image block (tanh GELU) and one Z-Image block (SwiGLU) in FP8 (fused prologue) with the
    feed-forward's activation and FP8 input scales as inductor compiles them, then with our kernel
    (``patches.fp8_feed_forward``); then each kernel alone at its block's shape, with launch settings."""
    from bcg_diffusion.kernels import activation_fp8

    for choice in ("torchao", "fused"):
        label = "compiled" if choice == "torchao" else "fused"
        time_block(*_qwen_block_case(), [(f"qwen fp8, FF {label}", "dispatch", False, "fused")],
                   prepare=_fp8_feed_forward(choice))  # fmt: skip
        time_block(
            *_z_block_case(), [(f"z fp8, FF {label}", "cudnn", False, "fused")], prepare=_fp8_feed_forward(choice)
        )
        torch.cuda.empty_cache()
    cases = {
        "GELU, Qwen-Image 1024² CFG": (
            [torch.randn(2 * 4160, 12288, device="cuda", dtype=torch.bfloat16)],
            activation_fp8.reference_gelu_fp8,
            activation_fp8.gelu_fp8,
        ),
        "SwiGLU, Z-Image 1024²": (
            [torch.randn(4160, 10240, device="cuda", dtype=torch.bfloat16) for _ in range(2)],
            activation_fp8.reference_swiglu_fp8,
            activation_fp8.swiglu_fp8,
        ),
    }
    for name, (tensors, reference, kernel) in cases.items():
        print(f"   {name}:")
        nbytes = sum(t.numel() * 2 for t in tensors) + tensors[0].numel() + tensors[0].shape[0] * 4  # read, written
        compiled = functools.partial(torch.compile(reference), *tensors)
        _, expected = _prologue_report("inductor (the reference compiled)", compiled, nbytes)
        _, got = _prologue_report(f"our kernel {activation_fp8._CONFIG}", functools.partial(kernel, *tensors), nbytes)
        equal = (got[0].view(torch.uint8) == expected[0].view(torch.uint8)).float().mean().item()
        print(f"   float8 bytes equal to inductor's: {equal:.4%}; scales equal: {torch.equal(got[1], expected[1])}")
        configs = [(4096, 8, True)] + [(16384, warps, True) for warps in (4, 8, 16)]  # one pass: the row in registers
        for config in configs:
            outputs = activation_fp8._empty(tensors[0], torch.float8_e4m3fn)
            up = tensors[1] if len(tensors) > 1 else None
            launch = functools.partial(activation_fp8._launch, tensors[0], *outputs, config, up=up)
            _prologue_report(f"   config {config}", launch, nbytes)


def _glue_kernels_alone(cases: dict[str, tuple], x: torch.Tensor, block: Any, label: str) -> None:
    """Each block-glue kernel of ``cases`` (name: reference's arguments, reference, kernel, bytes moved,
    ``_launch`` keywords) against inductor compiling its reference, then under each launch setting."""
    from bcg_diffusion.kernels import block_glue as glue

    fp8 = torch.float8_e4m3fn
    for name, (args, reference, kernel, nbytes, launch_kwargs) in cases.items():
        print(f"   {name}, {label}:")
        compiled = functools.partial(torch.compile(reference), *args)
        _prologue_report("inductor (the reference compiled)", compiled, nbytes)
        kernel_args = args[:-1] if args[-1] is fp8 else args
        _prologue_report("our kernel", functools.partial(kernel, *kernel_args), nbytes)
        for config in [(1, 4, True), (1, 8, True), (1, 16, True), (2, 8, True), (4, 8, True), (1, 8, False)]:
            outputs: dict[str, Any] = {}
            if "branch" in launch_kwargs:
                outputs["stream"] = torch.empty_like(x)
            if "scale" in launch_kwargs:
                outputs["data"], outputs["scales"] = glue._fp8_empty(x, fp8)
            launch = functools.partial(glue._launch, x, block, config=config, **launch_kwargs, **outputs)
            _prologue_report(f"   config {config}", launch, nbytes)


def _fp8_block_glue(fused: bool) -> Callable[[torch.nn.Module], None]:
    """A ``prepare`` for :func:`time_block`: a Z-Image block as fast mode prepares it under FP8 (one product
    for query, key and value, our feed-forward kernel), its glue compiled by inductor or, with ``fused``, in
    ``kernels.block_glue``'s kernels (``patches.zimage_block``)."""
    from bcg_diffusion.features.fused_qkv import fuse_qkv
    from bcg_diffusion.features.quantization import FP8, default_filter, quantize_transformer, torchao_config
    from bcg_diffusion.patches import fp8_feed_forward as patch
    from bcg_diffusion.patches import zimage_block

    def prepare(holder: torch.nn.Module) -> None:
        done = quantize_transformer(holder, torchao_config(FP8), default_filter(holder))
        assert fuse_qkv(holder, done), "no fused query, key and value product"
        assert patch.patch_fp8_feed_forwards(holder, MethodPatches()) > 0  # dropped with the copy
        if fused:
            assert zimage_block.patch_zimage_blocks(holder, MethodPatches()) == 1

    return prepare


def block_glue() -> None:
    """One Z-Image FP8 block as fast mode runs it (fused prologue, one product for query, key and value, our
    feed-forward kernel), 512² then 1024², its glue compiled by inductor against ``kernels.block_glue``; then
    each of the three kernels alone at both sizes against inductor compiling its reference, with launch
    settings."""
    from bcg_diffusion.kernels import block_glue as glue

    base, inputs, processor_patches = _z_block_case()
    inputs = dict(reversed(list(inputs.items())))  # 512² first: its kernel table is printed
    for fused in (False, True):
        label = f"z fp8, glue {'fused' if fused else 'compiled'}"
        time_block(base, inputs, processor_patches, [(label, "cudnn", False, "fused")], prepare=_fp8_block_glue(fused))
        torch.cuda.empty_cache()
    fp8 = torch.float8_e4m3fn
    for size, tokens in (("512²", 1088), ("1024²", 4160)):
        x, branch = (torch.randn(1, tokens, Z_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        weights = [1 + 0.1 * torch.randn(Z_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
        modulation = 0.5 * torch.randn(1, 4 * Z_DIM, device="cuda", dtype=torch.bfloat16)
        gate, scale = modulation[:, :Z_DIM], modulation[:, Z_DIM : 2 * Z_DIM]
        row = x.numel() * 2
        cases = {
            "norm + modulation + FP8 rows": (
                (x, weights[0], 1e-5, scale, fp8), glue.reference_modulated_norm_fp8, glue.modulated_norm_fp8,
                row + x.numel(), dict(weight=weights[0], eps=1e-5, scale=scale),
            ),
            "gated residual + norm + FP8 rows": (
                (x, branch, weights[1], 1e-5, gate, weights[0], 1e-5, scale, fp8), glue.reference_gated_residual_fp8,
                glue.gated_residual_fp8, 3 * row + x.numel(),
                dict(branch=branch, branch_weight=weights[1], branch_eps=1e-5, gate=gate, weight=weights[0], eps=1e-5,
                     scale=scale),
            ),
            "gated residual": (
                (x, branch, weights[1], 1e-5, gate), glue.reference_gated_residual, glue.gated_residual, 3 * row,
                dict(branch=branch, branch_weight=weights[1], branch_eps=1e-5, gate=gate),
            ),
        }  # fmt: skip
        _glue_kernels_alone(cases, x, glue._ZIMAGE, f"Z-Image {size}")


def _qwen_fp8_block_glue(fused: bool) -> Callable[[torch.nn.Module], None]:
    """A ``prepare`` for :func:`time_block`: a Qwen-Image block as fast mode prepares it under FP8 (our
    feed-forward kernel), its glue compiled by inductor or, with ``fused``, in ``kernels.block_glue``'s
    kernels (``patches.qwenimage_block``)."""
    from bcg_diffusion.patches import fp8_feed_forward as patch
    from bcg_diffusion.patches import qwenimage_block

    def prepare(holder: torch.nn.Module) -> None:
        _fp8(holder)
        assert patch.patch_fp8_feed_forwards(holder, MethodPatches()) == 1  # the image stream's; dropped with the copy
        if fused:
            assert qwenimage_block.patch_qwenimage_blocks(holder, MethodPatches()) == 1

    return prepare


def qwen_block_glue() -> None:
    """One Qwen-Image FP8 block as fast mode runs it (fused prologue, our feed-forward kernel) at 1024² in the
    CFG batch, its glue compiled by inductor against ``kernels.block_glue``, with SDPA's attention and with
    cuDNN's FP8 attention; then each of the three kernels alone on the image stream's rows, with launch
    settings."""
    from bcg_diffusion.kernels import block_glue as glue

    for kernel in ("dispatch", "cudnn-fp8"):
        for fused in (False, True):
            label = f"qwen fp8, {kernel} attention, glue {'fused' if fused else 'compiled'}"
            time_block(*_qwen_block_case(), [(label, kernel, False, "fused")], prepare=_qwen_fp8_block_glue(fused))
            torch.cuda.empty_cache()
    fp8 = torch.float8_e4m3fn
    x, branch = (torch.randn(2, 4096, QWEN_DIM, device="cuda", dtype=torch.bfloat16) + 0.5 for _ in range(2))
    modulation = 0.5 * torch.randn(2, 6 * QWEN_DIM, device="cuda", dtype=torch.bfloat16)
    shift, scale, gate = (modulation[:, i * QWEN_DIM : (i + 1) * QWEN_DIM] for i in range(3))
    row = x.numel() * 2
    cases = {
        "layer norm + modulation + FP8 rows": (
            (x, 1e-6, scale, shift, fp8), glue.reference_modulated_layer_norm_fp8, glue.modulated_layer_norm_fp8,
            row + x.numel(), dict(eps=1e-6, scale=scale, shift=shift),
        ),
        "gated add + layer norm + FP8 rows": (
            (x, branch, gate, 1e-6, scale, shift, fp8), glue.reference_gated_add_layer_norm_fp8,
            glue.gated_add_layer_norm_fp8, 3 * row + x.numel(),
            dict(branch=branch, gate=gate, eps=1e-6, scale=scale, shift=shift),
        ),
        "gated add": ((x, branch, gate), glue.reference_gated_add, glue.gated_add, 3 * row, dict(branch=branch, gate=gate)),
    }  # fmt: skip
    _glue_kernels_alone(cases, x, glue._QWEN, "Qwen-Image 1024² CFG, image rows")


def fp8_prologue() -> None:
    """cuDNN's FP8 attention fed by attention's prologue: the query and key quantized after the bf16
    prologue (inductor's passes over each group's slices, the value's largest magnitude reduced per group)
    against in the prologue (``qk_prologue.joint_qkv_fp8``, the value's largest magnitude reduced on the
    way). First the inputs of both groups' attention alone (Qwen-Image 1024² CFG batch), then one Qwen-Image
    FP8 block as fast mode runs it (our feed-forward and block-glue kernels), both ways."""
    from bcg_diffusion.kernels import cudnn_fp8_attention as cudnn_fp8
    from bcg_diffusion.kernels.cudnn_fp8_attention import _quantize

    torch.manual_seed(0)
    batch, text_tokens, image_tokens, heads, head_dim, lengths = 2, 205, 4096, QWEN_HEADS, 128, (160, 205)
    image = [torch.randn(batch, image_tokens, heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    text = [torch.randn(batch, text_tokens, heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    weights = [(1 + 0.1 * torch.randn(head_dim, device="cuda")).to(torch.bfloat16) for _ in range(4)]
    eps = [1e-6] * 4
    angles = [torch.rand(n, head_dim // 2, device="cuda") * 6.28 for n in (image_tokens, text_tokens)]
    freqs = tuple(torch.view_as_real(torch.polar(torch.ones_like(a), a)) for a in angles)
    bounds = [cudnn_fp8.rms_norm_bound(weights[i::2], head_dim) for i in (0, 1)]

    def after() -> list[torch.Tensor]:
        joints = qk_prologue.joint_qkv(image, text, weights, eps, freqs, lengths)
        slices = [qk_prologue.group_slices(j, lengths, text_tokens) for j in joints]
        return [
            _quantize(tensor, bound)[0] for q, k, v in zip(*slices) for tensor, bound in ((q, bounds[0]), (k, bounds[1]), (v, None))
        ]  # fmt: skip

    def inside() -> list[torch.Tensor]:
        joint = qk_prologue.joint_qkv_fp8(
            image, text, weights, eps, freqs, lengths, *(cudnn_fp8.descale(b) for b in bounds)
        )
        slices = [qk_prologue.group_slices(j, lengths, text_tokens) for j in joint[:3]]
        return [t for g, (q, k, v) in enumerate(zip(*slices)) for t in (q, k, _quantize(v, joint.value_largest[g])[0])]

    rows = batch * image_tokens + sum(lengths)
    nbytes = rows * heads * head_dim * (3 * 2 + 2 * 1 + 2 + 1)  # read q, k, v; write q8, k8, v; read v, write v8
    for label, fn in (("quantized after the prologue (inductor)", after), ("quantized in the prologue", inside)):
        _, out = _prologue_report(label, torch.compile(fn), nbytes)
    print(f"   in the prologue against after it: {_difference(out, torch.compile(after)())}", flush=True)

    # The two kernels alone, without the value's cast: the FP8 one moves less (float8 query and key) but
    # also reduces the value's largest magnitude (one atomic per program) and scales each element.
    descales = [cudnn_fp8.descale(b) for b in bounds]
    kernels_alone = {
        "bf16 prologue (joint_qkv)": (
            lambda: qk_prologue.joint_qkv(image, text, weights, eps, freqs, lengths),
            rows * heads * head_dim * (3 * 2 + 3 * 2),  # read q, k, v; write them
        ),
        "FP8 prologue (joint_qkv_fp8)": (
            lambda: qk_prologue.joint_qkv_fp8(image, text, weights, eps, freqs, lengths, *descales),
            rows * heads * head_dim * (3 * 2 + 2 * 1 + 2),  # read q, k, v; write q8, k8, v
        ),
    }
    for label, (fn, kernel_bytes) in kernels_alone.items():
        print(f"-- {label}, each launch setting", flush=True)
        _sweep_configs(fn, kernel_bytes)

    from bcg_diffusion.features.fp8_attention import choose_prologue

    glue = _qwen_fp8_block_glue(True)
    for in_prologue in (False, True):

        def prepare(holder: torch.nn.Module, in_prologue: bool = in_prologue) -> None:
            glue(holder)
            # False: the bf16 prologue, quantized by attend as before joint_qkv_fp8 existed
            assert choose_prologue(holder, in_prologue) == 1

        label = f"qwen fp8, cudnn-fp8 attention, quantized {'in' if in_prologue else 'after'} the prologue"
        time_block(*_qwen_block_case(), [(label, "cudnn-fp8", False, "fused")], prepare=prepare)
        torch.cuda.empty_cache()


def _stacked_output(choice: str, fp8: bool) -> Callable[[torch.nn.Module], None]:
    """A ``prepare`` for :func:`time_block`: a Qwen-Image block whose attention projects the image stream's
    output per CFG group into one output (``"stacked"``) or on the groups' rows joined first (``"joined"``);
    with ``fp8`` as fast mode prepares it under FP8 (our feed-forward and block-glue kernels)."""
    from bcg_diffusion.patches import stacked_output

    glue = _qwen_fp8_block_glue(True)

    def prepare(holder: torch.nn.Module) -> None:
        if fp8:
            glue(holder)
        assert stacked_output.choose(holder, choice) == 1

    return prepare


def stacked_output() -> None:
    """One Qwen-Image block in fast mode's CFG batch, bf16 and FP8, its image output projection run per group
    into one output (``patches.stacked_output``) against the groups' rows joined before one product; at
    1024² and 512² (two products of 1,024 rows may leave more of the GPU idle than one of 2,048)."""
    base, inputs, patches_ = _qwen_block_case()
    inputs["512² CFG"] = (*qwen_block_inputs(1024, 64, batch=2), {attention.TEXT_LENGTHS_KWARG: (64, 40)})
    for fp8 in (False, True):
        for choice in ("joined", "stacked"):
            label = f"qwen {'fp8' if fp8 else 'bf16'}, output {choice}"
            time_block(
                base, inputs, patches_, [(label, "dispatch", not fp8, "fused")], prepare=_stacked_output(choice, fp8)
            )
            torch.cuda.empty_cache()


def _stacked_w13(holder: torch.nn.Module) -> None:
    """A ``prepare`` for :func:`time_block`: every Z-Image feed-forward of the copy computes ``w1`` and ``w3``
    as one bf16 product over their stacked weights, the SwiGLU reading its two column halves (a probe
    only: the stacked weight is a copy, the library does not do this)."""
    for module in holder.modules():
        if type(module).__name__ == "FeedForward" and hasattr(module, "w3"):
            stacked = torch.cat([module.w1.weight, module.w3.weight]).detach()

            def forward(x: torch.Tensor, module: torch.nn.Module = module, stacked: torch.Tensor = stacked) -> Any:
                gate, up = F.linear(x, stacked).split(module.w1.out_features, dim=-1)
                return module.w2(F.silu(gate) * up)

            module.forward = forward


def w13_bf16() -> None:
    """One Z-Image block in bf16 fast mode (cuDNN on the tensors as they are, the fused prologue), its
    feed-forward's ``w1`` and ``w3`` as two products against one over their stacked weights, at 1024² and
    512²: whether the products-alone gain (1.076x and 1.092x, run 114) holds inside a block."""
    base, inputs, patches_ = _z_block_case()
    for label, prepare in (("z bf16, w1 and w3 apart", None), ("z bf16, w1 and w3 stacked", _stacked_w13)):
        time_block(base, inputs, patches_, [(label, "cudnn", False, "fused")], prepare=prepare)
        torch.cuda.empty_cache()


SECTIONS = {
    "kernels": ("attention kernels", attention_kernels),
    "qwen-block": ("Qwen-Image block at 1024² CFG, per attention kernel", qwen_block),
    "z-block": ("Z-Image block, per attention kernel", z_block),
    "prologue": ("attention's prologue alone: inductor against the fused kernel", prologue),
    "prologue-blocks": ("one block per model, attention's prologue compiled against fused", prologue_blocks),
    "reductions": ("one block per model, bf16 and FP8, inductor's persistent reductions widened", reductions),
    "fp8-ff": ("FP8 feed-forwards: the activation and input scales compiled against our kernel", fp8_feed_forward),
    "block-glue": ("Z-Image FP8 block: its glue compiled against our three kernels", block_glue),
    "qwen-block-glue": ("Qwen-Image FP8 block: its glue compiled against our three kernels", qwen_block_glue),
    "fp8-prologue": ("cuDNN's FP8 attention: query and key quantized after the prologue against in it", fp8_prologue),
    "stacked-output": ("Qwen-Image block: the image output projection per group against joined rows", stacked_output),
    "w13-bf16": ("Z-Image bf16 block: w1 and w3 apart against one product over stacked weights", w13_bf16),
}

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    print("torch", torch.__version__, "cuDNN", torch.backends.cudnn.version(), flush=True)
    for name in parser.parse_args().sections.split(","):
        section(*SECTIONS[name])
