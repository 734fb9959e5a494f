"""The fingerprint two ranks splitting true CFG exchange at the first step of every pipeline call.

What a pipeline call's arguments and scheduler say (:class:`CallFacts`), the transformer call's input
shapes and exact checksums, packed in one int64 tensor of the same layout on every rank
(:func:`fingerprint`), and what two of them disagree on (:func:`disagreements`), for
:class:`~bcg_diffusion.features.cfg_parallel.split.CfgSplit`.
"""

from __future__ import annotations

import hashlib
import inspect
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ...core.hooks import PipelineCall

__all__ = [
    "ADVICE",
    "CallFacts",
    "CfgMismatchError",
    "call_facts",
    "disagreements",
    "fingerprint",
    "tensors_of",
    "true_cfg",
]

ADVICE = (
    "Every rank must make the same pipeline call: the same seed (generator), prompts and negative prompts, "
    "guidance, steps and size (docs/parallel.md#true-cfg-across-two-gpus)"
)


class CfgMismatchError(RuntimeError):
    """The ranks splitting CFG were given different pipeline calls; raised on every rank alike."""


@dataclass(frozen=True)
class CallFacts:
    """What a pipeline call's arguments and scheduler say, for the fingerprint (None: not known).

    ``cfg``: whether the call does true CFG; ``steps``: the denoising steps its scheduler is set up for;
    ``negative_text``: a hash of its negative prompt (None without one, or with negative embeddings);
    ``negative_embeddings``: its negative embeddings and their mask, compared by checksum."""

    cfg: bool | None = None
    true_cfg_scale: float | None = None
    guidance_scale: float | None = None
    steps: int | None = None
    negative_text: int | None = None
    negative_embeddings: tuple[torch.Tensor, ...] = ()


_DIMS = 6  # the dimensions a fingerprint keeps of a tensor's shape (latents and embeddings have 3)

# (label, kind) in slot order; every kind but "sum" is known on the host, and the "sum" fields come last.
_FIELDS: tuple[tuple[str, str], ...] = (
    ("true CFG", "flag"),
    ("true_cfg_scale", "float"),
    ("guidance_scale", "float"),
    ("steps", "int"),
    ("latents shape", "shape"),
    ("prompt embeddings shape", "shape"),
    ("prompt mask shape", "shape"),
    ("negative prompt", "hash"),
    ("latents checksum", "sum"),
    ("prompt embeddings checksum", "sum"),
    ("prompt mask checksum", "sum"),
    ("negative prompt embeddings checksum", "sum"),
    ("timestep and other inputs checksum", "sum"),
)
_SIZES = {"flag": 1, "float": 2, "int": 1, "shape": 1 + _DIMS, "hash": 2, "sum": 1}
# Ignored by the pipeline unless the call does true CFG: compared only when some rank's call does.
_CFG_ONLY = {"true_cfg_scale", "negative prompt", "negative prompt embeddings checksum"}
# The transformer inputs with fields of their own, by keyword (hidden_states may also come first positionally).
_NAMED_INPUTS = {
    "hidden_states": "latents",
    "encoder_hidden_states": "prompt embeddings",
    "encoder_hidden_states_mask": "prompt mask",
}
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def call_facts(call: PipelineCall | None, scheduler: Any) -> CallFacts:
    """The facts of ``call`` (None: the transformer was called outside an accelerated pipeline call, whose
    arguments are unknown) run with ``scheduler``."""
    steps = _steps(scheduler)
    arguments = call_arguments(call) if call is not None else None
    if arguments is None:
        return CallFacts(steps=steps)
    cfg = true_cfg(arguments)
    negative_embeddings = tuple(
        value
        for name in ("negative_prompt_embeds", "negative_prompt_embeds_mask")
        if isinstance(value := arguments.get(name), torch.Tensor)
    )
    negative = arguments.get("negative_prompt")
    return CallFacts(
        cfg=cfg,
        true_cfg_scale=_number(arguments.get("true_cfg_scale")),
        guidance_scale=_number(arguments.get("guidance_scale")),
        steps=steps,
        negative_text=None if negative is None or negative_embeddings else _text_hash(negative),
        negative_embeddings=negative_embeddings,
    )


def call_arguments(call: PipelineCall) -> dict[str, Any] | None:
    """``call``'s arguments by name, defaults filled in, keyword extras merged (None: they do not bind
    to the pipeline's ``__call__``)."""
    try:
        signature = inspect.signature(type(call.pipe).__call__)
        bound = signature.bind(call.pipe, *call.args, **call.kwargs)
    except (TypeError, ValueError):
        return None
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    for name, parameter in signature.parameters.items():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            arguments.update(arguments.pop(name, None) or {})
    return arguments


def true_cfg(arguments: Mapping[str, Any]) -> bool | None:
    """Whether a call with ``arguments`` does true CFG by Qwen-Image's rule: ``true_cfg_scale > 1`` and a
    negative prompt or negative embeddings (None: the pipeline takes no ``true_cfg_scale``)."""
    scale = _number(arguments.get("true_cfg_scale"))
    if scale is None:
        return None
    return scale > 1 and (
        arguments.get("negative_prompt") is not None or arguments.get("negative_prompt_embeds") is not None
    )


def fingerprint(facts: CallFacts, args: tuple, kwargs: dict, device: torch.device) -> torch.Tensor:
    """One rank's fingerprint of a transformer call and its pipeline call: a 1-D int64 tensor on ``device``
    whose layout (``_FIELDS``) is the same on every rank. Reads no tensor value on the host."""
    inputs = dict(kwargs)
    if args and "hidden_states" not in inputs:
        inputs["hidden_states"], args = args[0], args[1:]
    named = {label: inputs.pop(name, None) for name, label in _NAMED_INPUTS.items()}
    others = tensors_of((args, inputs))
    values: dict[str, Any] = {
        "true CFG": facts.cfg,
        "true_cfg_scale": facts.true_cfg_scale,
        "guidance_scale": facts.guidance_scale,
        "steps": facts.steps,
        "negative prompt": facts.negative_text,
        "negative prompt embeddings checksum": _combined(facts.negative_embeddings, device),
        "timestep and other inputs checksum": _combined(others, device),
    }
    for label, tensor in named.items():
        tensor = tensor if isinstance(tensor, torch.Tensor) else None
        values[f"{label} shape"] = None if tensor is None else tuple(tensor.shape)
        values[f"{label} checksum"] = _checksum(tensor, device)
    host = [slot for label, kind in _FIELDS if kind != "sum" for slot in _encode(kind, values[label])]
    sums = [values[label].to(device) for label, kind in _FIELDS if kind == "sum"]
    return torch.cat([torch.tensor(host, dtype=torch.int64, device=device), torch.stack(sums)])


def disagreements(rows: list[list[int]]) -> list[str]:
    """What the ranks' fingerprints (``rows``, in rank order) disagree on, one entry per field that
    differs, with every rank's value: ``"steps (rank 0: 4, rank 1: 3)"``. Empty when they agree."""
    fields = [_decode(row) for row in rows]
    does_cfg = any(values["true CFG"] != "no" for values in fields)
    differ = []
    for label, _ in _FIELDS:
        shown = [values[label] for values in fields]
        if len(set(shown)) > 1 and (does_cfg or label not in _CFG_ONLY):
            differ.append(f"{label} (" + ", ".join(f"rank {r}: {value}" for r, value in enumerate(shown)) + ")")
    return differ


def _steps(scheduler: Any) -> int | None:
    """The denoising steps the scheduler is set up for: its timesteps from its begin index on."""
    timesteps = getattr(scheduler, "timesteps", None)
    if timesteps is None:
        return None
    begin = getattr(scheduler, "begin_index", None)
    return len(timesteps) - (begin if isinstance(begin, int) else 0)


def _number(value: Any) -> float | None:
    """``value`` as a float when it is a real number (a Python number or a one-element tensor), else None."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.item())
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def _text_hash(value: Any) -> int:
    """A hash of a prompt (a string or a list of them) equal in every process (``hash`` is salted per process)."""
    digest = hashlib.blake2b(repr(value).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def tensors_of(value: Any) -> list[torch.Tensor]:
    """The tensors in ``value`` (nested dicts, lists and tuples), in a fixed order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for key in value for t in tensors_of(value[key])]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in tensors_of(item)]
    return []


def _checksum(tensor: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """An exact int64 checksum of ``tensor``'s bits on ``device`` (0 for None): its elements' bits as
    integers, weighted by odd numbers by position and summed modulo 2**64, so any one changed bit changes
    it (and almost any other difference). Integer sums are exact in any order: equal on every rank."""
    if tensor is None or tensor.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=device)
    flat = tensor.detach().reshape(-1)
    try:
        bits = flat.view(_INT_OF_SIZE.get(flat.element_size(), torch.int64))
    except RuntimeError:  # a dtype whose bits cannot be viewed as integers: compare its float64 values
        bits = flat.to(torch.float64).view(torch.int64)
    weights = torch.arange(1, 2 * bits.numel(), 2, dtype=torch.int64, device=bits.device)
    return (bits.to(torch.int64) * weights).sum().to(device)


def _combined(tensors: tuple[torch.Tensor, ...] | list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """One checksum of several tensors, in order: their checksums and element counts, folded (wrapping int64)."""
    total = torch.zeros((), dtype=torch.int64, device=device)
    for tensor in tensors:
        total = total * 1_000_003 + _checksum(tensor, device) + tensor.numel()
    return total


def _encode(kind: str, value: Any) -> list[int]:
    """The int64 slots of one host-known field (``_SIZES[kind]`` of them)."""
    if kind == "flag":
        return [-1 if value is None else int(value)]
    if kind == "int":
        return [-1 if value is None else int(value)]
    if kind == "float":
        return [0, 0] if value is None else [1, struct.unpack("<q", struct.pack("<d", value))[0]]
    if kind == "hash":
        return [0, 0] if value is None else [1, value]
    # shape: the rank, then the dimensions (any beyond _DIMS folded into the last)
    if value is None:
        return [-1] + [0] * _DIMS
    dims = list(value[: _DIMS - 1]) + ([math.prod(value[_DIMS - 1 :])] if len(value) >= _DIMS else [])
    return [len(value)] + dims + [0] * (_DIMS - len(dims))


def _decode(row: list[int]) -> dict[str, str]:
    """Each field of a fingerprint ``row`` as it is shown in an error."""
    host = [(label, kind) for label, kind in _FIELDS if kind != "sum"]
    sums = [(label, kind) for label, kind in _FIELDS if kind == "sum"]
    shown, at = {}, 0
    for label, kind in host + sums:
        slots = row[at : at + _SIZES[kind]]
        at += _SIZES[kind]
        shown[label] = _show(kind, slots)
    return shown


def _show(kind: str, slots: list[int]) -> str:
    """One field's slots as text."""
    if kind == "flag":
        return {-1: "unknown", 0: "no", 1: "yes"}[slots[0]]
    if kind == "int":
        return "unknown" if slots[0] < 0 else str(slots[0])
    if kind == "float":
        return "none" if not slots[0] else repr(struct.unpack("<d", struct.pack("<q", slots[1]))[0])
    if kind == "hash":
        return "none" if not slots[0] else f"{slots[1] & (2**64 - 1):016x}"
    if kind == "sum":
        return f"{slots[0] & (2**64 - 1):016x}"
    if slots[0] < 0:
        return "none"
    dims = slots[1 : 1 + min(slots[0], _DIMS)]
    return str(tuple(dims)) if slots[0] <= _DIMS else f"{tuple(dims)} (the last {slots[0] - _DIMS + 1} folded)"
