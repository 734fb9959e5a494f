"""Timing one pipeline call (end to end and per stage), comparing images, describing the machine."""

from __future__ import annotations

import gc
import hashlib
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from .cases import Case


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work (nothing to wait for on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release_memory(device: torch.device) -> None:
    """Collect what Python no longer holds, then give the CUDA caching allocator's free blocks back, so that
    what comes next (another mode's weights and graphs) finds that memory."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_allocated(device: torch.device) -> int:
    """Peak allocated bytes since the last :func:`reset_peak` (0 on a CPU)."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


@dataclass
class CallTiming:
    total_s: float
    encode_s: float  # text encoding (encode_prompt calls)
    denoise_s: float  # from the end of text encoding to the end of the last denoising step
    decode_s: float  # VAE decode and post-processing
    images: torch.Tensor


class _Clock:
    """Marks at a call's stage boundaries. On a GPU, CUDA events on the current stream, read once the call has
    synchronised at its end: the call runs as a user's would, with no synchronisation inside it. With
    ``stage_syncs`` (and on a CPU), host clock readings, each after a synchronisation on a GPU: the stage
    split is then host time, and the GPU idles at each boundary while the host catches up (bench's measure
    before run 140)."""

    def __init__(self, device: torch.device, stage_syncs: bool) -> None:
        self.device = device
        self.events = device.type == "cuda" and not stage_syncs

    def mark(self) -> Any:
        if self.events:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        synchronize(self.device)
        return time.perf_counter()

    def seconds(self, start: Any, end: Any) -> float:
        """Seconds from mark ``start`` to mark ``end`` (events: once the device has synchronised)."""
        return start.elapsed_time(end) / 1e3 if self.events else end - start


def timed_call(pipe: Any, case: Case, device: torch.device, seed: int = 0, stage_syncs: bool = False) -> CallTiming:
    """One call, timed end to end from a synchronised start to a synchronised end, and split into stages.

    Stages: ``encode_prompt`` is marked by wrapping it on the pipeline instance; the end of denoising by a
    ``callback_on_step_end`` that marks the last step; decode is the rest. On a GPU the marks are CUDA events,
    so nothing inside the call waits for the device (:class:`_Clock`; ``stage_syncs=True`` synchronises at
    each mark instead, as bench did before run 140). The instance's own ``encode_prompt``, if it had one
    (``text_buckets`` installs its padding there), is what the timing wrapper calls and what is put back
    afterwards.
    """
    clock = _Clock(device, stage_syncs)
    encodes: list[tuple[Any, Any]] = []
    marks: dict[str, Any] = {}
    original_encode = pipe.encode_prompt
    missing = object()
    previous = pipe.__dict__.get("encode_prompt", missing)

    def encode_prompt(*args: Any, **kwargs: Any) -> Any:
        started = clock.mark()
        result = original_encode(*args, **kwargs)
        marks["encoded"] = clock.mark()
        encodes.append((started, marks["encoded"]))
        return result

    def on_step_end(pipeline: Any, step: int, timestep: Any, callback_kwargs: dict) -> dict:
        if step == case.steps - 1:
            marks["denoised"] = clock.mark()
        return {}

    pipe.encode_prompt = encode_prompt
    try:
        synchronize(device)
        start = time.perf_counter()
        first = clock.mark()
        output = pipe(**case.kwargs(seed=seed, device=device), callback_on_step_end=on_step_end)
        images = output.frames if case.frames else output.images
        last = clock.mark()
        synchronize(device)
        end = time.perf_counter()
    finally:
        if previous is missing:
            del pipe.encode_prompt
        else:
            pipe.encode_prompt = previous
    denoised = marks.get("denoised", last)
    encoded = marks.get("encoded", first)
    return CallTiming(
        end - start,
        sum(clock.seconds(a, b) for a, b in encodes),
        clock.seconds(encoded, denoised),
        clock.seconds(denoised, last),
        images.detach().cpu(),
    )


def image_md5(images: torch.Tensor) -> str:
    return hashlib.md5(images.float().contiguous().numpy().tobytes()).hexdigest()


def psnr(images: torch.Tensor, reference: torch.Tensor) -> float:
    """Peak signal-to-noise ratio in dB of images in [0, 1] against a reference (inf when equal)."""
    mse = torch.mean((images.float() - reference.float()) ** 2).item()
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _loop_inputs(pipe: Any, case: Case) -> dict[str, Any]:
    """Call arguments with the prompt embeddings computed once, so a call is the denoising loop."""
    kwargs = case.kwargs("latent", device=pipe.device)
    if case.published is not None:  # called with embeddings already
        return kwargs
    prompts = kwargs.pop("prompt")
    negative = kwargs.pop("negative_prompt", None)
    if case.pipeline == "qwen-image":
        embeds, mask = pipe.encode_prompt(prompts, device=pipe.device)
        kwargs.update(prompt_embeds=embeds, prompt_embeds_mask=mask)
        if negative is not None:
            neg, neg_mask = pipe.encode_prompt(negative, device=pipe.device)
            kwargs.update(negative_prompt_embeds=neg, negative_prompt_embeds_mask=neg_mask)
    else:
        pos, neg = pipe.encode_prompt(
            prompts, device=pipe.device, do_classifier_free_guidance=case.uses_cfg, negative_prompt=negative
        )
        kwargs.update(prompt_embeds=pos, negative_prompt_embeds=neg if case.uses_cfg else None)
    return kwargs


# Kernel-name fragments by what the kernel does, to tell a compute floor from overhead that fusion
# or graphs could still remove. Checked in order; anything else is "other" (elementwise, norms, copies).
KERNEL_KINDS = (
    ("attention", ("flash", "fmha", "attention", "attn", "sdpa")),
    ("convolution", ("conv", "fprop", "dgrad", "wgrad", "winograd")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "matmul")),
)


def kernel_kind(name: str) -> str:
    """``"attention"``, ``"matmul"``, ``"convolution"`` or ``"other"`` for a GPU kernel's name.

    >>> kernel_kind("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT"), kernel_kind("triton_poi_fused_add_0")
    ('matmul', 'other')
    >>> kernel_kind("triton_poi_fused__scaled_dot_product_cudnn_attention__to_copy_cat_5")
    'other'
    """
    lowered = name.lower()
    if lowered.startswith(("triton_poi_", "triton_red_", "triton_per_")):
        # inductor's fused elementwise and reduction kernels, named after every op they fused: a copy
        # into attention's layout is still a copy ("triton_poi_fused__scaled_dot_product_cudnn_...")
        return "other"
    for kind, fragments in KERNEL_KINDS:
        if any(fragment in lowered for fragment in fragments):
            return kind
    return "other"


def _loop_wall_and_kernel(
    pipe: Any, kwargs: dict[str, Any], device: torch.device
) -> tuple[float, float, dict[str, float]]:
    """(median wall seconds of 3 runs after one warm-up, GPU kernel seconds from one profiled run, those
    kernel seconds by :func:`kernel_kind`) of one call. The median matters: the per-step figure is a
    difference of two such walls."""
    from torch.profiler import ProfilerActivity, profile

    walls = []
    for _ in range(4):
        kwargs["generator"] = torch.Generator("cpu").manual_seed(0)
        synchronize(device)
        start = time.perf_counter()
        pipe(**kwargs)
        synchronize(device)
        walls.append(time.perf_counter() - start)
    kwargs["generator"] = torch.Generator("cpu").manual_seed(0)
    activities = [ProfilerActivity.CUDA] if device.type == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        pipe(**kwargs)
        synchronize(device)
    by_kind: dict[str, float] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kind = kernel_kind(event.name)
            by_kind[kind] = by_kind.get(kind, 0.0) + event.device_time / 1e6
    return statistics.median(walls[1:]), sum(by_kind.values()), by_kind


def denoise_profile(pipe: Any, case: Case, device: torch.device) -> dict[str, float]:
    """How close the denoising loop runs to pure GPU kernel time.

    Runs the loop (prompt embeddings precomputed, latent output) at ``case.steps`` and at half as many
    steps. ``wall_over_kernel`` is the whole call's wall time over its GPU kernel time (it includes the
    pipeline's fixed set-up: timesteps, latents); ``step_wall_over_kernel`` uses the differences between
    the two runs, so fixed costs cancel and what is left is the per-step loop. ``kernel_share``: the
    fractions of kernel time by :func:`kernel_kind` (a loop that is mostly matmul and attention is near
    its compute floor). Kernel time is 0 on CPU.
    """
    kwargs = _loop_inputs(pipe, case)
    few = max(2, case.steps // 2)
    wall, kernel, by_kind = _loop_wall_and_kernel(pipe, dict(kwargs, num_inference_steps=case.steps), device)
    wall_few, kernel_few, _ = _loop_wall_and_kernel(pipe, dict(kwargs, num_inference_steps=few), device)
    step_kernel = (kernel - kernel_few) / (case.steps - few) if case.steps > few else math.nan
    step_wall = (wall - wall_few) / (case.steps - few) if case.steps > few else math.nan
    return {
        "wall_s": wall,
        "kernel_s": kernel,
        "wall_over_kernel": wall / kernel if kernel else math.nan,
        "step_wall_s": step_wall,
        "step_kernel_s": step_kernel,
        "step_wall_over_kernel": step_wall / step_kernel if step_kernel else math.nan,
        "kernel_share": {kind: seconds / kernel for kind, seconds in sorted(by_kind.items())} if kernel else {},
    }


def environment(device: torch.device) -> dict[str, Any]:
    import diffusers
    import transformers

    import bcg_diffusion

    env: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "transformers": transformers.__version__,
        "bcg_diffusion": bcg_diffusion.__version__,
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "device": str(device),
    }
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
        try:
            env["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                check=False,
            ).stdout.strip()
        except OSError:
            env["driver"] = "unknown"
    return env
