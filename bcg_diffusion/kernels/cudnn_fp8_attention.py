"""FP8 attention through cuDNN's fused kernel, on diffusers' ``[batch, tokens, heads, dim]`` layout.

cuDNN has an FP8 attention forward for Hopper (query, key, value and the softmax probabilities in
float8 e4m3, one scale each, both products on FP8 tensor cores), reachable from Python through NVIDIA's
``nvidia-cudnn-frontend`` package (an optional extra: ``pip install bcg-diffusion[cudnn]``). On an H200
it runs at 780–800 TFLOP/s on Qwen-Image's 1024² shapes, against 565–600 for cuDNN's bf16 kernel and
650–690 for our Triton FP8 kernel (run 109, ``bench.probes.probe_cudnn_fp8_attention``). At 1,088
tokens (Z-Image 512²) ours is the faster one, and FP8 attention gains nothing end to end.

What it needs, and how this module feeds it:

* **One scale per tensor.** The query and key come out of RMS norms, so their magnitudes have a bound
  that needs no reduction: an RMS-normed row of ``D`` elements has norm at most ``sqrt(D)``, its
  weight scales each element by at most ``max|w|``, and RoPE rotates pairs without changing their
  norm, so no element exceeds ``max|w| * sqrt(D)``. Callers that know the norm pass that bound
  (:func:`rms_norm_bound`); otherwise the tensor's largest magnitude is taken. The value has no such
  bound: its largest magnitude is reduced. e4m3 is a floating-point format, so a scale from a bound
  rather than the largest value loses range at the small end only, not precision.
* **An FP8 output on Hopper** (bf16 outputs are Blackwell's only). Attention's output is a convex
  combination of the values, so the value's scale bounds it; a margin of 1/16 covers the rounding of
  the probabilities to e4m3 (at most 2**-4 relative each). The output is scaled back in plain PyTorch,
  which inductor fuses into the kernel that reads it next, or handed on in float8 with its descale
  (:func:`attention_fp8_output`) to an FP8 product that takes it as it is.

The quantization is plain PyTorch, traced into fast mode's compiled blocks, or comes done already: the
query and key scaled by their bounds straight out of attention's prologue kernel, with the value's largest
magnitude reduced there too (:func:`attention_quantized`, fed by
:func:`bcg_diffusion.kernels.qk_prologue.joint_qkv_fp8`). The kernel is a PyTorch
custom operator (``bcg_diffusion::cudnn_fp8_attention``) that inductor calls as it is, with every scale
it reads computed beforehand in the compiled code (:func:`pack_scales`). cuDNN builds one graph per
shape, on the first call with that shape (an eager warm-up before any capture), and the same engine
each time for the same shape, GPU and cuDNN version, so two runs compute the same bytes.
A call whose mask hides keys only (a prompt's padding, :mod:`bcg_diffusion.kernels.key_padding`) passes how
many keys each batch row sees, the first ones (``key_lengths``): cuDNN's padding mask, which skips the hidden
keys' work; its graph is another one for the same shape.
Without a GPU the operator computes its float32 reference (:func:`reference`), which tests use.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import warnings

import torch

from .attention import layout_unsupported, shapes_unsupported
from .key_padding import check_lengths, reference_mask

__all__ = [
    "FP8_MAX",
    "attention",
    "attention_fp8_output",
    "attention_quantized",
    "dequantize",
    "descale",
    "pack_scales",
    "quantize",
    "reference",
    "refusals",
    "rms_norm_bound",
    "unavailable",
    "unsupported",
    "unsupported_quantized",
]

FP8_MAX = 448.0  # largest float8 e4m3 value
# The probabilities (at most 1 before normalisation) are scaled to e4m3's whole range.
PROBABILITY_SCALE = FP8_MAX
# The output's bound over the value's: e4m3 rounds each probability by up to 2**-4 relative.
OUTPUT_MARGIN = 1.0625
MIN_CUDNN = 91400  # cuDNN 9.14: what cuDNN's own frontend tests ask of its FP8 attention
_HEAD_DIMS = (128,)  # what was measured
_UIDS = dict(query=1, key=2, value=3, out=4, descale_q=5, descale_k=6, descale_v=7, descale_s=8, scale_s=9)
_UIDS.update(scale_o=10, amax_s=11, amax_o=12, seq_len_q=13, seq_len_kv=14)


@functools.cache
def _frontend_version() -> int | None:
    """cuDNN's library version as the frontend loads it (e.g. 91900), or None without the frontend."""
    if importlib.util.find_spec("cudnn") is None:
        return None
    import cudnn

    return int(cudnn.backend_version())


def unavailable(device: torch.device) -> str | None:
    """Why cuDNN's FP8 attention cannot run on ``device`` (None: it can): it needs a CUDA GPU of compute
    capability 9.0 or newer, NVIDIA's ``nvidia-cudnn-frontend`` package and cuDNN 9.14 or newer.
    Checked once, when fast mode sets a model up."""
    if device.type != "cuda":
        return f"the model is on {device.type}, not a CUDA GPU"
    if torch.cuda.get_device_capability(device) < (9, 0):
        return "cuDNN's FP8 attention needs compute capability 9.0 or newer"
    version = _frontend_version()
    if version is None:
        return "the nvidia-cudnn-frontend package is not installed (pip install bcg-diffusion[cudnn])"
    if version < MIN_CUDNN:
        return f"cuDNN {version} is older than {MIN_CUDNN} (9.14), the first with a tested FP8 attention"
    return None


def unsupported(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> str | None:
    """Why these ``[B, S, H, D]`` tensors cannot go to the kernel (None: they can): they need bfloat16
    or float16, one batch and head count, and head size 128. Only tensor properties, so that a compiled
    block decides it when it is traced (a shape cuDNN then refuses gets the float32 reference, with a
    warning: see :func:`refusals`)."""
    return layout_unsupported(query, key, value, _HEAD_DIMS)


def unsupported_quantized(query8: torch.Tensor, key8: torch.Tensor, value: torch.Tensor) -> str | None:
    """Why a query and key quantized already and a value in half precision (all ``[B, S, H, D]``) cannot
    go to the kernel (None: they can): :func:`unsupported`'s conditions, the query and key in float8 e4m3."""
    if query8.dtype != torch.float8_e4m3fn or key8.dtype != torch.float8_e4m3fn:
        return f"a query and key quantized already must be float8_e4m3fn, not {query8.dtype} and {key8.dtype}"
    if value.dtype not in (torch.bfloat16, torch.float16):
        return f"value dtype {value.dtype} (needs bfloat16 or float16)"
    return shapes_unsupported(query8, key8, value, _HEAD_DIMS)


def rms_norm_bound(weights: list[torch.Tensor], head_dim: int) -> torch.Tensor:
    """The largest magnitude an element of a row of ``head_dim`` elements can have after an RMS norm
    with any of these weights, then RoPE: ``max|w| * sqrt(head_dim)``, as a float32 scalar tensor
    computed on the weights' device (so it follows the weights when they change, e.g. a LoRA).

    >>> rms_norm_bound([torch.full((128,), 2.0)], 128)  # 2 * sqrt(128)
    tensor(22.6274)
    """
    if not weights:
        raise ValueError("rms_norm_bound needs at least one norm weight")
    return torch.stack([w.detach().abs().amax().float() for w in weights]).amax() * math.sqrt(head_dim)


def descale(bound: torch.Tensor) -> torch.Tensor:
    """The descale (a float32 scalar) by which :func:`quantize` maps ``bound``, a magnitude no element
    exceeds, to e4m3's largest value, 448 (a bound of zero counts as 1e-12).

    >>> descale(torch.tensor(896.0))
    tensor(2.)
    """
    return bound.float().clamp(min=1e-12) / FP8_MAX


def quantize(x: torch.Tensor, descale: torch.Tensor) -> torch.Tensor:
    """``x`` in float8 e4m3 at ``descale`` (a float32 scalar): ``x`` times ``descale``'s reciprocal in
    float32 (both correctly rounded), rounded to the nearest e4m3 value, saturated at ±448 (a value past
    the bound, bf16 rounding of a bounded one, must not become NaN). The arithmetic attention's prologue
    kernel repeats for the query and key: one division per tensor there, not one per element, which the
    kernel paid for in time (run 148)."""
    return (x.float() * descale.float().reciprocal()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def dequantize(x8: torch.Tensor, descale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x8`` (float8 e4m3) scaled back by ``descale`` (a float32 scalar) in float32, rounded to ``dtype``:
    how this module scales attention's float8 output back, so that a caller that scales part of it back
    itself gets the same bytes."""
    return (x8.float() * descale).to(dtype)


def _quantize(x: torch.Tensor, bound: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` in e4m3 with its descale: ``bound`` (else ``x``'s largest magnitude) maps to 448."""
    largest = x.abs().amax() if bound is None else bound.to(device=x.device)
    scale = descale(largest)
    return quantize(x, scale), scale


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_bound: torch.Tensor | None = None,
    key_bound: torch.Tensor | None = None,
    scale: float | None = None,
    key_lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention in FP8: ``[B, S, H, D]`` in, ``[B, S, H, D]`` out in the inputs'
    dtype. ``query_bound`` / ``key_bound``: a float32 scalar no element exceeds (:func:`rms_norm_bound`),
    else each tensor's largest magnitude is reduced. ``scale`` defaults to ``1 / sqrt(D)``. ``key_lengths``
    (int32 ``[B]``): each batch row attends to its first ``key_lengths[b]`` keys only; None: to all of them.
    A key's scale is reduced over every key, hidden ones too.

    Refuses (ValueError) what :func:`unsupported` names, and key lengths of another shape or dtype.
    """
    reason = unsupported(query, key, value)
    if reason is not None:
        raise ValueError(f"cuDNN's FP8 attention cannot take these tensors: {reason}")
    query8, descale_q = _quantize(query, query_bound)
    key8, descale_k = _quantize(key, key_bound)
    return attention_quantized(query8, key8, descale_q, descale_k, value, scale=scale, key_lengths=key_lengths)


def attention_quantized(
    query8: torch.Tensor,
    key8: torch.Tensor,
    query_descale: torch.Tensor,
    key_descale: torch.Tensor,
    value: torch.Tensor,
    value_largest: torch.Tensor | None = None,
    scale: float | None = None,
    key_lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`attention` on a query and key quantized already: ``[B, S, H, D]`` float8 e4m3 with their
    descales (float32 scalars, :func:`quantize`), ``value`` ``[B, S, H, D]`` in bf16 or fp16, scaled by
    ``value_largest`` (a float32 scalar: its largest magnitude, e.g. reduced by attention's prologue
    kernel; None: reduced here). Returns ``[B, S, H, D]`` in the value's dtype; the bytes of
    :func:`attention` where the query and key were quantized as it quantizes them.

    Refuses (ValueError) what :func:`unsupported_quantized` names.
    """
    out8, descale_o = attention_fp8_output(
        query8, key8, query_descale, key_descale, value, value_largest, scale, key_lengths
    )
    return dequantize(out8, descale_o, value.dtype)


def attention_fp8_output(
    query8: torch.Tensor,
    key8: torch.Tensor,
    query_descale: torch.Tensor,
    key_descale: torch.Tensor,
    value: torch.Tensor,
    value_largest: torch.Tensor | None = None,
    scale: float | None = None,
    key_lengths: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attention_quantized` without scaling its output back: the kernel's ``[B, S, H, D]`` float8
    e4m3 output and its descale (a float32 scalar: the output's real values are ``out8.float() *
    descale``), for an FP8 product that takes them as they are
    (:mod:`bcg_diffusion.patches.fp8_output_projection`). Takes and refuses what
    :func:`attention_quantized` does.

    >>> out8, descale = attention_fp8_output(q8, k8, dq, dk, v)  # doctest: +SKIP
    >>> torch.equal(dequantize(out8, descale, v.dtype), attention_quantized(q8, k8, dq, dk, v))  # doctest: +SKIP
    True
    """
    reason = unsupported_quantized(query8, key8, value)
    if reason is not None:
        raise ValueError(f"cuDNN's FP8 attention cannot take these tensors: {reason}")
    check_lengths(key_lengths, query8.shape[0])
    scale = 1.0 / math.sqrt(query8.shape[-1]) if scale is None else float(scale)
    value8, descale_v = _quantize(value, value_largest)
    scales = pack_scales(query_descale, key_descale, descale_v)
    out8 = torch.ops.bcg_diffusion.cudnn_fp8_attention(query8, key8, value8, scales, scale, key_lengths)
    return out8, scales[3]


def pack_scales(descale_q: torch.Tensor, descale_k: torch.Tensor, descale_v: torch.Tensor) -> torch.Tensor:
    """Every scale the kernel reads, as one float32 ``[7]`` tensor: the descales of the query, key, value
    and output (the value's with :data:`OUTPUT_MARGIN`), the output's scale, the probabilities' scale and
    its descale. Computed by the caller's (compiled) code, so that replaying the kernel launches
    nothing else."""
    descale_o = descale_v.float() * OUTPUT_MARGIN
    probability = torch.full_like(descale_o, PROBABILITY_SCALE)
    parts = (descale_q, descale_k, descale_v, descale_o, 1.0 / descale_o, probability, 1.0 / probability)
    return torch.stack([part.float().reshape(()) for part in parts])


def reference(
    query8: torch.Tensor,
    key8: torch.Tensor,
    value8: torch.Tensor,
    descales: torch.Tensor,
    scale: float,
    key_lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """What the kernel computes, in float32: ``[B, S, H, D]`` e4m3 inputs with ``descales`` (query, key,
    value, output: the first four of :func:`pack_scales`), the exponentials (at most 1) rounded to e4m3
    at :data:`PROBABILITY_SCALE` before they meet the values, the output in e4m3 at the output's scale; each
    batch row's keys past ``key_lengths`` hidden. The kernel's own rounding and order of
    sums differ; tests compare the two with tolerances."""
    q, k, v = (t.float().transpose(1, 2) * d for t, d in zip((query8, key8, value8), descales[:3]))
    scores = q @ k.transpose(-1, -2) * scale
    if key_lengths is not None:
        scores = scores.masked_fill(~reference_mask(key_lengths, key8.shape[1]), float("-inf"))
    exponentials = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    rounded = (exponentials * PROBABILITY_SCALE).to(torch.float8_e4m3fn).float() / PROBABILITY_SCALE
    out = (rounded @ v) / exponentials.sum(dim=-1, keepdim=True)
    out = (out / descales[3]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return out.transpose(1, 2).contiguous()


@torch.library.custom_op("bcg_diffusion::cudnn_fp8_attention", mutates_args=())
def _attention_op(
    query8: torch.Tensor,
    key8: torch.Tensor,
    value8: torch.Tensor,
    scales: torch.Tensor,
    scale: float,
    key_lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    if not query8.is_cuda:
        return reference(query8, key8, value8, scales, scale, key_lengths)
    query8, key8, value8 = (t.contiguous() for t in (query8, key8, value8))
    out = torch.empty_like(query8)
    _run(query8, key8, value8, scales, out, scale, key_lengths)
    return out


@_attention_op.register_fake
def _(query8, key8, value8, scales, scale, key_lengths=None):  # noqa: ANN001, ANN202
    return torch.empty_like(query8, memory_format=torch.contiguous_format)


# -- cuDNN's graphs ------------------------------------------------------------------------------------


@functools.cache
def _handle(device_index: int) -> object:
    import cudnn

    with torch.cuda.device(device_index):
        return cudnn.create_handle()


def _graph(shape: tuple[int, int, int, int, int], scale: float, device_index: int, padded: bool) -> object:
    """cuDNN's graph for contiguous ``[B, S, H, D]`` e4m3 inputs and output, ``shape`` ``(B, S_q, H,
    S_k, D)``, with ``padded``: a padding mask (int32 ``[B, 1, 1, 1]`` query and key lengths), built once
    per shape (:func:`_graph_or_reason` keeps it). Raises cudnn's error when cuDNN refuses it."""
    import cudnn

    batch, tokens_q, heads, tokens_k, head_dim = shape
    fp8, fp32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
    with torch.cuda.device(device_index):
        graph = cudnn.pygraph(io_data_type=fp8, intermediate_data_type=fp32, compute_data_type=fp32)

    def bshd(tokens: int) -> dict[str, tuple[int, ...]]:  # cuDNN's [B, H, S, D] order over [B, S, H, D] memory
        return dict(
            dim=(batch, heads, tokens, head_dim), stride=(tokens * heads * head_dim, head_dim, heads * head_dim, 1)
        )

    query, key, value = (
        graph.tensor(uid=_UIDS[name], data_type=fp8, **bshd(tokens))
        for name, tokens in (("query", tokens_q), ("key", tokens_k), ("value", tokens_k))
    )
    scalar = dict(dim=(1, 1, 1, 1), stride=(1, 1, 1, 1), data_type=fp32)
    scalars = {
        name: graph.tensor(uid=_UIDS[name], **scalar)
        for name in ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")
    }
    padding = {}
    if padded:
        lengths = dict(dim=(batch, 1, 1, 1), stride=(1, 1, 1, 1), data_type=cudnn.data_type.INT32)
        padding = dict(
            use_padding_mask=True,
            seq_len_q=graph.tensor(uid=_UIDS["seq_len_q"], **lengths),
            seq_len_kv=graph.tensor(uid=_UIDS["seq_len_kv"], **lengths),
        )
    out, _, amax_s, amax_o = graph.sdpa_fp8(
        q=query, k=key, v=value, **scalars, generate_stats=False, attn_scale=scale, use_causal_mask=False, **padding
    )
    out.set_uid(_UIDS["out"]).set_output(True).set_data_type(fp8)
    out.set_dim(bshd(tokens_q)["dim"]).set_stride(bshd(tokens_q)["stride"])
    for name, tensor in (("amax_s", amax_s), ("amax_o", amax_o)):
        tensor.set_uid(_UIDS[name]).set_output(True).set_dim((1, 1, 1, 1)).set_stride((1, 1, 1, 1))
        tensor.set_data_type(fp32)
    with torch.cuda.device(device_index):
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()
    return graph


# (B, S_q, H, S_k, D), softmax scale, device index, padded -> why cuDNN refused to build that graph
_REFUSED: dict[tuple[tuple[int, int, int, int, int], float, int, bool], str] = {}


def refusals() -> dict[tuple[tuple[int, int, int, int, int], float, int, bool], str]:
    """The shapes cuDNN refused in this process, each with cuDNN's reason (their calls computed the
    float32 reference): ``{((B, S_q, H, S_k, D), scale, device index, with key lengths): reason}``. Empty
    when every call ran the kernel."""
    return dict(_REFUSED)


@functools.cache
def _graph_or_reason(
    shape: tuple[int, int, int, int, int], scale: float, device_index: int, padded: bool = False
) -> object | str:
    """:func:`_graph`, or why cuDNN refused it (warned once per shape, kept in :func:`refusals`)."""
    try:
        return _graph(shape, scale, device_index, padded)
    except Exception as error:  # cuDNN's refusal, whatever its type, is reported, then the reference runs
        reason = f"{type(error).__name__}: {error}"
        _REFUSED[(shape, scale, device_index, padded)] = reason
        masked = " with key lengths" if padded else ""
        warnings.warn(
            f"bcg-diffusion: cuDNN refuses FP8 attention{masked} of shape (B, S_q, H, S_k, D) = {shape} ({reason}); "
            "these calls compute the float32 reference instead (correct, slower)",
            stacklevel=2,
        )
        return reason


def _run(
    query8: torch.Tensor,
    key8: torch.Tensor,
    value8: torch.Tensor,
    scales: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    key_lengths: torch.Tensor | None,
) -> None:
    import cudnn

    device = query8.device.index
    batch, tokens_q, heads, head_dim = query8.shape
    padded = key_lengths is not None
    graph = _graph_or_reason((batch, tokens_q, heads, key8.shape[1], head_dim), scale, device, padded)
    if isinstance(graph, str):
        out.copy_(reference(query8, key8, value8, scales, scale, key_lengths))
        return
    amax = torch.empty(2, dtype=torch.float32, device=query8.device)
    scales = scales.contiguous()  # pack_scales' [7]; the softmax scale is the graph's attention scale
    pack = {
        _UIDS["query"]: query8, _UIDS["key"]: key8, _UIDS["value"]: value8, _UIDS["out"]: out,
        _UIDS["descale_q"]: scales[0:1], _UIDS["descale_k"]: scales[1:2], _UIDS["descale_v"]: scales[2:3],
        _UIDS["scale_o"]: scales[4:5], _UIDS["scale_s"]: scales[5:6], _UIDS["descale_s"]: scales[6:7],
        _UIDS["amax_s"]: amax[0:1], _UIDS["amax_o"]: amax[1:2],
    }  # fmt: skip
    if padded:  # every query row computed; the keys past each row's length hidden
        pack[_UIDS["seq_len_q"]] = torch.full((batch, 1, 1, 1), tokens_q, dtype=torch.int32, device=query8.device)
        pack[_UIDS["seq_len_kv"]] = key_lengths.reshape(batch, 1, 1, 1).contiguous()
    workspace = torch.empty(graph.get_workspace_size(), dtype=torch.uint8, device=query8.device)
    handle = _handle(device)
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(query8.device).cuda_stream)
    graph.execute(pack, workspace, handle=handle)
