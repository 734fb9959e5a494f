"""Logic of the Gradio demo (``app.py``): one pipeline, its reference and its accelerated image side by side.

:class:`DemoBackend` builds each pipeline once (lazily, per ``(pipeline, weights, device)``) with
:func:`bcg_diffusion.models.build_pipeline`, keeps one accelerated copy of it per acceleration mode (an entry
of :data:`ACCELERATIONS`: exact or fast; ``debug=True`` off CUDA, where no graph can run) and answers requests
with :meth:`DemoBackend.generate`: the reference runs inside :func:`bcg_diffusion.eager` on the same pipeline
object (eager in exact mode; in fast mode its compiled blocks without graphs, fast mode's reference), then the
accelerated call runs normally; both are timed, compared byte for byte and reported with what the graphs cost
during the request. A speed-up is reported only when neither call did one-off work (a capture, a compile);
otherwise the report says what that first call cost instead.

Concurrency: a request holds its pipeline's lock from start to end. Diffusers pipelines keep per-call
state on the object (scheduler timesteps, guidance settings), and the eager/accelerated comparison and the
per-request ``stats`` deltas are only exact if nothing else runs on that pipeline meanwhile. Requests on
different pipelines may overlap. Building is serialised across all pipelines because the random-weight
builder patches ``nn.Module.register_parameter`` while it runs.

Failures reach the user as :class:`DemoError`, whose message is meant to be shown as it is; tracebacks go to
the log. Gradio is imported only by :func:`gradio_handler`, so the backend runs without it.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import logging
import math
import re
import threading
import time
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import PIL.Image
import torch

from ..api import accelerate, eager, restore, stats
from ..models import DEFAULT_PROMPTS, PIPELINE_NAMES, RANDOM_WEIGHTS, build_pipeline

__all__ = [
    "ACCELERATED_ONLY",
    "ACCELERATIONS",
    "DEFAULT_ACCELERATION",
    "DEFAULT_PROMPT",
    "MAX_GUIDANCE",
    "MAX_STEPS",
    "MODES",
    "SIDE_BY_SIDE",
    "Acceleration",
    "DemoBackend",
    "DemoDefaults",
    "DemoError",
    "GenerationRequest",
    "GenerationResult",
    "GraphCost",
    "WarmupStatus",
    "WarmupStep",
    "defaults_for",
    "format_resolution",
    "gradio_handler",
    "parse_resolution",
    "request_from_ui",
    "warm_up_in_background",
]

logger = logging.getLogger(__name__)

SIDE_BY_SIDE = "side by side"
ACCELERATED_ONLY = "accelerated only"
MODES: tuple[str, ...] = (SIDE_BY_SIDE, ACCELERATED_ONLY)
"""What a request runs: the reference and the accelerated call, or the accelerated call alone."""
DEFAULT_PROMPT = DEFAULT_PROMPTS[1]
RESOLUTION_MULTIPLE = 16  # Qwen-Image and Z-Image: 8x VAE down-sampling, then 2x2 patches
MAX_STEPS = 100
MAX_GUIDANCE = 30.0
_MAX_MESSAGE = 400

ProgressCallback = Callable[[int, int, str], None]
"""``(done, total, description)``: generation steps or warm-up steps finished so far."""


class DemoError(Exception):
    """A failure explained for the person using the demo: the message is shown to them as it is."""


@dataclass(frozen=True)
class Acceleration:
    """One way the demo accelerates a pipeline: an entry of :data:`ACCELERATIONS`.

    Everything that differs between modes lives here, so a new mode (caching, FP8) is one more entry, not
    another branch in the backend or the report.

    Attributes:
        name: what the page and ``app.py --mode`` call it.
        options: ``accelerate(pipe, **options)`` (``debug=True`` is added off CUDA).
        summary: one line on what the mode does, for the page.
        reference: what the left image is: what the pipeline runs inside ``bcg_diffusion.eager(pipe)`` in this
            mode, which the accelerated image is compared with.
        identical: whether the accelerated image must equal that reference byte for byte (a mode that rounds
            differently from every reference it has says False; the report then gives the largest difference
            and no verdict).
        note: what the report adds about the comparison ("" for none).
    """

    name: str
    options: Mapping[str, Any]
    summary: str
    reference: str = "eager"
    identical: bool = True
    note: str = ""


ACCELERATIONS: Mapping[str, Acceleration] = types.MappingProxyType(
    {
        entry.name: entry
        for entry in (
            Acceleration(
                "exact",
                types.MappingProxyType({"mode": "exact"}),
                "graphs of the eager kernels, byte-identical to eager",
            ),
            Acceleration(
                "fast",
                types.MappingProxyType({"mode": "fast"}),
                "blocks compiled by inductor inside the graphs, compared with their compiled reference",
                reference="fast mode's reference",
                note=(
                    "**Fast mode is compared with its own reference, not with eager:** the left image is the same "
                    "pipeline inside `bcg_diffusion.eager(pipe)`, which in fast mode runs its compiled blocks "
                    "without graphs. Compiled kernels round differently from eager ones, so fast mode promises "
                    "byte-equality with that reference, not with eager."
                ),
            ),
        )
    }
)
"""The acceleration modes the demo offers, by name (``GenerationRequest.acceleration``)."""
DEFAULT_ACCELERATION = "exact"


@dataclass(frozen=True)
class DemoDefaults:
    """What the page offers first for one pipeline and kind of weights."""

    resolution: tuple[int, int]  # (width, height)
    steps: int
    guidance: float
    resolutions: tuple[tuple[int, int], ...]
    max_side: int


def defaults_for(pipeline: str, weights: str) -> DemoDefaults:
    """Defaults for ``pipeline`` with ``weights``: small sizes for the tiny CPU models, the real ones otherwise.

    Guidance is Qwen-Image's ``true_cfg_scale`` (true CFG when > 1) or Z-Image's ``guidance_scale`` (CFG when
    > 0); Z-Image defaults to Z-Image-Turbo's 8 steps without CFG.
    """
    steps, guidance = (50, 4.0) if pipeline == "qwen-image" else (8, 0.0)
    if weights == "tiny":
        squares = ((64, 64), (128, 128), (256, 256), (512, 512))
        return DemoDefaults((256, 256), 8, guidance, (*squares, (384, 256), (256, 384)), max_side=1024)
    squares = ((512, 512), (768, 768), (1024, 1024), (1328, 1328))
    return DemoDefaults((512, 512), steps, guidance, (*squares, (1024, 768), (768, 1024)), max_side=2048)


def format_resolution(size: tuple[int, int]) -> str:
    """``(width, height)`` as the page writes it: ``"512x768"``."""
    return f"{size[0]}x{size[1]}"


def parse_resolution(text: str | None, max_side: int) -> tuple[int, int]:
    """``"WIDTHxHEIGHT"`` (``x``, ``×``, ``*`` or ``,`` between; a single number means a square) as ``(w, h)``.

    Raises:
        DemoError: unparsable text, a side not a positive multiple of 16, or a side above ``max_side``.
    """
    match = re.fullmatch(r"\s*(\d+)\s*(?:[x×X*,]\s*(\d+))?\s*", text or "")
    if match is None:
        raise DemoError(f"resolution {text!r} is not WIDTHxHEIGHT, e.g. 512x512")
    width = int(match.group(1))
    height = int(match.group(2) or width)
    for name, side in (("width", width), ("height", height)):
        if side < RESOLUTION_MULTIPLE:
            raise DemoError(f"{name} {side} is too small: at least {RESOLUTION_MULTIPLE}")
        if side % RESOLUTION_MULTIPLE:
            nearest = round(side / RESOLUTION_MULTIPLE) * RESOLUTION_MULTIPLE
            raise DemoError(
                f"{name} {side} is not a multiple of {RESOLUTION_MULTIPLE} (the VAE's 8x down-sampling times the "
                f"transformer's 2x2 patches): try {nearest}"
            )
        if side > max_side:
            raise DemoError(f"{name} {side} is too large: at most {max_side} here")
    return width, height


@dataclass(frozen=True)
class GenerationRequest:
    """One click of Generate. ``guidance`` is Qwen-Image's ``true_cfg_scale`` or Z-Image's ``guidance_scale``."""

    prompt: str
    pipeline: str
    width: int
    height: int
    steps: int
    guidance: float
    seed: int
    mode: str = SIDE_BY_SIDE
    negative_prompt: str = ""
    acceleration: str = DEFAULT_ACCELERATION  # a key of ACCELERATIONS

    @property
    def uses_cfg(self) -> bool:
        return self.guidance > 1 if self.pipeline == "qwen-image" else self.guidance > 0

    def pipeline_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of the pipeline call (without ``callback_on_step_end``), fresh generator included."""
        kwargs: dict[str, Any] = {
            "prompt": self.prompt,
            "height": self.height,
            "width": self.width,
            "num_inference_steps": self.steps,
            "generator": torch.Generator("cpu").manual_seed(self.seed),
            "output_type": "pt",
        }
        # A negative prompt without CFG only earns a warning from Qwen-Image, and true CFG needs one.
        negative = (self.negative_prompt or " ") if self.uses_cfg else None
        if self.pipeline == "qwen-image":
            kwargs.update(true_cfg_scale=self.guidance, negative_prompt=negative)
        else:
            kwargs.update(guidance_scale=self.guidance, negative_prompt=negative)
        return kwargs


def request_from_ui(
    prompt: Any,
    negative_prompt: Any,
    pipeline: Any,
    resolution: Any,
    steps: Any,
    guidance: Any,
    seed: Any,
    mode: Any,
    acceleration: Any = None,
    *,
    max_side: int,
) -> GenerationRequest:
    """Check and convert the page's raw values (strings, floats, None) into a :class:`GenerationRequest`.

    Raises:
        DemoError: a missing or out-of-range value, named in the message.
    """
    if not isinstance(prompt, str) or not prompt.strip():
        raise DemoError("type a prompt first")
    width, height = parse_resolution(resolution, max_side)
    return GenerationRequest(
        prompt=prompt.strip(),
        pipeline=str(pipeline),
        width=width,
        height=height,
        steps=_whole_number(steps, "steps"),
        guidance=_finite(guidance, "guidance"),
        seed=_whole_number(seed, "seed"),
        mode=str(mode) if mode else SIDE_BY_SIDE,
        negative_prompt=negative_prompt.strip() if isinstance(negative_prompt, str) else "",
        acceleration=str(acceleration) if acceleration else DEFAULT_ACCELERATION,
    )


def _whole_number(value: Any, name: str) -> int:
    number = _finite(value, name)
    if number != int(number):
        raise DemoError(f"{name} must be a whole number, got {value!r}")
    return int(number)


def _finite(value: Any, name: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise DemoError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(number):
        raise DemoError(f"{name} must be a finite number, got {value!r}")
    return number


@dataclass(frozen=True)
class GraphCost:
    """What the graphs cost during one request (``stats`` after minus before), and the pool's size after it.

    ``compiles`` and ``compile_seconds`` are fast mode's block compiles (0 in exact mode). Side by side the
    first compile at new settings happens in the reference call, which runs the compiled blocks first
    (:attr:`GenerationResult.reference_compiles` counts those); captures happen in the accelerated call only.
    """

    captures: int
    replays: int
    eager_fallbacks: int
    capture_seconds: float
    graph_memory_bytes: int
    graph_memory_delta_bytes: int
    compiles: int = 0
    compile_seconds: float = 0.0

    @classmethod
    def between(cls, before: dict[str, Any], after: dict[str, Any]) -> GraphCost:
        return cls(
            captures=after["captures"] - before["captures"],
            replays=after["replays"] - before["replays"],
            eager_fallbacks=after["eager_fallbacks"] - before["eager_fallbacks"],
            capture_seconds=after["capture_seconds"] - before["capture_seconds"],
            graph_memory_bytes=after["graph_memory_bytes"],
            graph_memory_delta_bytes=after["graph_memory_bytes"] - before["graph_memory_bytes"],
            compiles=after.get("compiles", 0) - before.get("compiles", 0),
            compile_seconds=after.get("compile_seconds", 0.0) - before.get("compile_seconds", 0.0),
        )


@dataclass(frozen=True)
class GenerationResult:
    """The images, latencies and graph costs of one request.

    ``eager_*`` are the reference call's: the pipeline inside ``bcg_diffusion.eager(pipe)``, which is eager in
    exact mode and the compiled blocks without graphs in fast mode (the request's :class:`Acceleration` names
    it). They, ``identical`` and ``max_difference`` are None in accelerated-only mode. ``identical`` is
    ``torch.equal`` of the two output tensors (before conversion to 8-bit images), ``max_difference`` their
    largest absolute difference (images in [0, 1]). ``graphs`` says what the accelerated call ran:
    ``"cuda graphs"``, ``"debug"`` (the runner path without graphs, off CUDA) or ``"inactive: <why>"``.
    ``reference_compiles`` and ``reference_compile_seconds`` are the part of ``cost``'s compiles that ran in the
    reference call (0 in accelerated-only mode); the rest of ``cost`` ran in the accelerated call.

    A request is :attr:`warm` when neither call did one-off work (no capture, no compile): only then do the
    two latencies compare like with like, and only then does the report show a speed-up. Otherwise its
    headline is what the first call cost (:attr:`one_off_seconds`).
    """

    request: GenerationRequest
    device: str
    graphs: str
    accelerated_image: PIL.Image.Image
    accelerated_seconds: float
    accelerated_digest: str
    cost: GraphCost
    eager_image: PIL.Image.Image | None = None
    eager_seconds: float | None = None
    eager_digest: str | None = None
    identical: bool | None = None
    max_difference: float | None = None
    reference_compiles: int = 0
    reference_compile_seconds: float = 0.0

    @property
    def acceleration(self) -> Acceleration:
        """The request's entry of :data:`ACCELERATIONS` (a bare one for a mode this version does not know)."""
        name = self.request.acceleration
        return ACCELERATIONS.get(name) or Acceleration(name, types.MappingProxyType({}), "", reference="reference")

    @property
    def speed_meaningful(self) -> bool:
        """False when no CUDA graph ran (CPU debug mode, inactive graphs): the latencies compare nothing."""
        return self.graphs == "cuda graphs"

    @property
    def warm(self) -> bool:
        """Whether neither call captured or compiled, so the latencies compare like with like."""
        return not (self.cost.captures or self.cost.compiles)

    @property
    def one_off_seconds(self) -> float:
        """Time of the request's one-off work: its captures and block compiles (0.0 when :attr:`warm`)."""
        return self.cost.capture_seconds + self.cost.compile_seconds

    @property
    def speedup(self) -> float | None:
        """Reference latency over accelerated latency, as measured (None without a reference). The report shows
        it only when :attr:`warm`: otherwise one-off work is in one latency or the other."""
        if self.eager_seconds is None or self.accelerated_seconds <= 0:
            return None
        return self.eager_seconds / self.accelerated_seconds

    def outputs(self) -> tuple[PIL.Image.Image | None, PIL.Image.Image, str]:
        """``(eager image or None, accelerated image, Markdown report)``: what the page shows."""
        return self.eager_image, self.accelerated_image, self.report_markdown()

    def report_markdown(self) -> str:
        """Latencies, speed-up (when :attr:`warm`) or what the first call cost, identity and graph costs as
        Markdown, with the caveats that apply."""
        r, c, a = self.request, self.cost, self.acceleration
        headline = self._headline()
        settings = (
            f"{r.pipeline}, {r.width}x{r.height}, {r.steps} steps, guidance {r.guidance:g}, seed {r.seed}; "
            f"{a.name} mode; `{self.device}`, {self.graphs}"
        )
        eager_latency = "not run"
        if self.eager_seconds is not None:
            eager_latency = _seconds(self.eager_seconds) + _including(self._reference_work())
        accelerated_latency = _seconds(self.accelerated_seconds) + _including(self._accelerated_work())
        eager_digest = f"`{self.eager_digest}`" if self.eager_digest else "–"
        memory = _bytes(c.graph_memory_bytes)
        if c.graph_memory_delta_bytes:
            memory += f" (+{_bytes(c.graph_memory_delta_bytes)})"
        lines = [
            headline,
            settings,
            "",
            f"| | {a.reference} | accelerated ({a.name}) |",
            "|---|---:|---:|",
            f"| latency | {eager_latency} | {accelerated_latency} |",
            f"| image digest (sha256) | {eager_digest} | `{self.accelerated_digest}` |",
            "",
        ]
        if self.identical is not None:
            if a.identical:
                verdict = "**yes**" if self.identical else "**NO**"
                lines += [f"Byte-identical images: {verdict} (`torch.equal` of the two output tensors).", ""]
            else:
                lines += [
                    f"Largest difference from {a.reference}: {_difference(self.max_difference)} (images in [0, 1]; "
                    f"{a.name} mode is not byte-identical to it, nor meant to be).",
                    "",
                ]
        lines += [
            "Graphs, this request:",
            "",
            "| captures | capture time | replays | eager fallbacks | graph memory (pool) |",
            "|---:|---:|---:|---:|---:|",
            f"| {c.captures} | {_seconds(c.capture_seconds)} | {c.replays} | {c.eager_fallbacks} | {memory} |",
            "",
        ]
        lines += [f"> {note}\n" for note in self._notes()]
        return "\n".join(lines).rstrip() + "\n"

    def _headline(self) -> str:
        """The report's first line: the speed-up of two warm calls, or what the first call cost."""
        a = self.acceleration
        one_off = ", ".join(self._reference_work() + self._accelerated_work())
        if self.eager_seconds is None:
            first = "" if self.warm else f" (first call: {one_off})"
            return f"### Accelerated: {_seconds(self.accelerated_seconds)}{first}"
        if a.identical:
            comparison = f"byte-identical: {'yes' if self.identical else 'NO'}"
        else:
            comparison = f"largest difference from {a.reference}: {_difference(self.max_difference)}"
        if not self.warm:
            return (
                f"### First call at these settings: {_seconds(self.one_off_seconds)} of one-off work ({one_off}) · "
                f"{comparison}"
            )
        over = "" if a.reference == "eager" else f" over {a.reference}"
        caveat = "" if self.speed_meaningful else " (not meaningful)"
        return f"### Speed-up {self.speedup:.2f}x{over}{caveat} · {comparison}"

    def _reference_work(self) -> list[str]:
        """The one-off work of the reference call, as ``["compile 3.500 s"]`` (empty when it did none)."""
        return [f"compile {_seconds(self.reference_compile_seconds)}"] if self.reference_compiles else []

    def _accelerated_work(self) -> list[str]:
        """The one-off work of the accelerated call: the compiles the reference left to it, then its captures."""
        c, work = self.cost, []
        if c.compiles > self.reference_compiles:
            work.append(f"compile {_seconds(c.compile_seconds - self.reference_compile_seconds)}")
        if c.captures:
            work.append(f"capture {_seconds(c.capture_seconds)}")
        return work

    def _notes(self) -> list[str]:
        notes = []
        if self.identical is not None and self.acceleration.note:
            notes.append(self.acceleration.note)
        if self.graphs == "debug":
            notes.append(
                "**Speed numbers are not meaningful here:** off CUDA the accelerated pipeline runs "
                "`accelerate(pipe, debug=True)`, the graph runner's path without CUDA graphs. Run on an NVIDIA "
                "GPU for real speed-ups."
            )
        elif not self.speed_meaningful:
            notes.append(f"**Speed numbers are not meaningful:** graphs are {self.graphs}; both calls ran eagerly.")
        if not self.warm:
            notes.append(self._one_off_note())
        return notes

    def _one_off_note(self) -> str:
        """What one-off work this request did, in which call, and why it shows no speed-up."""
        c, a = self.cost, self.acceleration
        done = []
        if c.compiles:
            where = (
                f"{a.reference}, the first call that ran them" if self.reference_compiles else "the accelerated call"
            )
            if 0 < self.reference_compiles < c.compiles:
                where = f"{a.reference} and the accelerated call"
            compiled = f"{c.compiles} compile(s), {_seconds(c.compile_seconds)}"
            done.append(f"compiled the transformer's blocks ({compiled}, in {where})")
        if c.captures:
            what = "graph(s)" if self.graphs == "cuda graphs" else "signature(s) (debug mode: no graph)"
            done.append(f"captured {c.captures} new {what} ({_seconds(c.capture_seconds)}, in the accelerated call)")
        if self.eager_seconds is None:
            outcome = "The latency above includes it. Generate again with the same settings for the warm latency."
        else:
            outcome = (
                "The latencies above include it, so they compare nothing and no speed-up is shown. Generate again "
                "with the same settings for the speed-up of two warm calls."
            )
        return f"This request did one-off work: it {' and '.join(done)}. {outcome}"


def _including(work: list[str]) -> str:
    return f" (incl. {', '.join(work)})" if work else ""


def _difference(value: float | None) -> str:
    return "–" if value is None else f"{value:.3g}"


def _seconds(value: float) -> str:
    return f"{value:.3f} s" if value < 10 else f"{value:.1f} s"


def _bytes(value: int) -> str:
    size = float(value)
    for unit in ("B", "KiB", "MiB"):
        if abs(size) < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.2f} GiB"


def _digest(images: torch.Tensor) -> str:
    return hashlib.sha256(images.contiguous().numpy().tobytes()).hexdigest()[:12]


def _to_pil(images: torch.Tensor) -> PIL.Image.Image:
    from diffusers.image_processor import VaeImageProcessor

    # The same conversion as the pipeline's own output_type="pil".
    return VaeImageProcessor.numpy_to_pil(VaeImageProcessor.pt_to_numpy(images))[0]


@dataclass
class _Entry:
    """One accelerated pipeline of the backend (a pipeline in one acceleration mode); ``lock`` is held for a
    whole request on it (see the module docstring)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    pipe: Any = None


class _StepReporter:
    """``callback_on_step_end`` that advances a progress callback by one step per denoising step."""

    def __init__(self, on_progress: ProgressCallback | None, offset: int, total: int, phase: str, steps: int):
        self.on_progress = on_progress
        self.offset, self.total, self.phase, self.steps = offset, total, phase, steps

    def start(self) -> None:
        self._report(0)

    def __call__(self, pipe: Any, step: int, timestep: Any, callback_kwargs: dict[str, Any]) -> dict[str, Any]:
        self._report(step + 1)
        return {}

    def _report(self, step: int) -> None:
        if self.on_progress is not None:
            self.on_progress(self.offset + step, self.total, f"{self.phase}: step {step}/{self.steps}")


def _weight_sharing_copy(pipe: Any) -> Any:
    """A deep copy of ``pipe`` (never accelerated) whose parameters and buffers are ``pipe``'s own tensors:
    new module objects to accelerate, no second copy of the weights."""
    memo: dict[int, Any] = {}
    for component in getattr(pipe, "components", {}).values():
        if isinstance(component, torch.nn.Module):
            for tensor in itertools.chain(component.parameters(), component.buffers()):
                memo[id(tensor)] = tensor
    return copy.deepcopy(pipe, memo)


class DemoBackend:
    """Builds, accelerates and runs the demo's pipelines; safe to call from many threads at once.

    Acceleration modes: each pipeline is built once, as a template that is never called or accelerated, and
    each mode (an entry of :data:`ACCELERATIONS`) gets its own copy of it, sharing every weight, accelerated
    once in that mode on first use and kept. ``accelerate`` refuses other options on a pipeline it accelerated
    (``restore`` first), and restoring and re-accelerating on every change of mode would throw away the graphs
    and, in fast mode, the compiled blocks each time; with one copy per ``(pipeline, mode)``, going back to a
    mode replays at once, the weights are in memory once, and each mode adds only its module objects, graph
    pool and compiled code.

    Args:
        weights: ``"tiny"``, ``"random-full"`` or a checkpoint (hub id or local directory) of the one pipeline in
            ``pipelines``.
        device: where the pipelines run; default ``"cuda"`` when available, else ``"cpu"``. Off CUDA the
            accelerated pipeline is ``accelerate(pipe, debug=True)``.
        pipelines: the pipeline names this backend serves (a subset of ``PIPELINE_NAMES``). Every pipeline is
            served in every mode of :data:`ACCELERATIONS`.
        dtype: passed to ``build_pipeline`` (None: its default for ``weights``).
        builder: ``build_pipeline`` or a stand-in with its signature (tests).

    Raises:
        ValueError: an unknown or empty ``pipelines``, or a checkpoint with more than one pipeline.
    """

    def __init__(
        self,
        weights: str = "tiny",
        device: str | torch.device | None = None,
        *,
        pipelines: Sequence[str] = PIPELINE_NAMES,
        dtype: torch.dtype | None = None,
        builder: Callable[..., Any] = build_pipeline,
    ) -> None:
        pipelines = tuple(dict.fromkeys(pipelines))
        unknown = [p for p in pipelines if p not in PIPELINE_NAMES]
        if unknown or not pipelines:
            raise ValueError(f"pipelines must be a non-empty subset of {PIPELINE_NAMES}, got {pipelines}")
        if weights not in RANDOM_WEIGHTS and len(pipelines) > 1:
            raise ValueError(f"the checkpoint {weights!r} is for one pipeline: choose one of {pipelines}")
        self.weights = weights
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.pipelines = pipelines
        self.dtype = dtype
        self._builder = builder
        self._templates: dict[tuple[str, str, str], Any] = {}  # built, never accelerated; guarded by _build_lock
        self._entries: dict[tuple[str, str, str, str], _Entry] = {}
        self._entries_lock = threading.Lock()
        self._build_lock = threading.Lock()

    @property
    def uses_cuda_graphs(self) -> bool:
        """Whether the accelerated pipelines can use CUDA graphs at all (False: ``debug=True`` off CUDA)."""
        return self.device.type == "cuda"

    def defaults(self, pipeline: str) -> DemoDefaults:
        return defaults_for(pipeline, self.weights)

    @property
    def accelerations(self) -> tuple[str, ...]:
        """The acceleration modes served (the page's choices): every entry of :data:`ACCELERATIONS`."""
        return tuple(ACCELERATIONS)

    def pipeline(self, name: str, acceleration: str = DEFAULT_ACCELERATION) -> Any:
        """The pipeline ``name`` accelerated in mode ``acceleration`` (built now if needed). Raises DemoError if
        it cannot be."""
        if acceleration not in ACCELERATIONS:
            raise DemoError(f"mode {acceleration!r} is not one of {', '.join(ACCELERATIONS)}")
        entry = self._entry(name, acceleration)
        with entry.lock:
            return self._ensure_built(entry, name, acceleration)

    def generate(self, request: GenerationRequest, on_progress: ProgressCallback | None = None) -> GenerationResult:
        """Run ``request``: eager then accelerated (side by side) or accelerated only, on one pipeline object.

        ``on_progress(done, total, description)`` is called from this thread once per denoising step and when a
        phase starts; ``total`` is ``steps`` (accelerated only) or ``2 * steps``.

        Raises:
            DemoError: an invalid request, a pipeline that cannot be built or accelerated, out of memory, or
                any other failure of the call (its traceback is logged, its message kept short).
        """
        self._validate(request)
        try:
            return self._generate(request, on_progress)
        except DemoError:
            raise
        except Exception as exc:
            raise self._failure(
                exc, f"generating with {request.pipeline} at {request.width}x{request.height}"
            ) from None

    def warm_up(
        self,
        resolutions: Sequence[tuple[int, int]],
        pipelines: Sequence[str] | None = None,
        on_progress: ProgressCallback | None = None,
        *,
        prompt: str = DEFAULT_PROMPT,
        steps: int = 2,
        acceleration: str = DEFAULT_ACCELERATION,
    ) -> list[WarmupStep]:
        """Build each pipeline and capture its graphs at each resolution: one accelerated call per resolution,
        in mode ``acceleration`` (the other modes warm up on their first request).

        Calls use ``prompt`` (graphs are keyed by the prompt's token length, so the page's default prompt then
        replays at once) and each pipeline's default guidance (so the CFG signatures are captured too); the
        number of steps does not change the signatures. A failure is logged and reported as a failed step, and
        the warm-up goes on. ``on_progress(done, total, message)`` is called after each build and each call.
        """
        pipelines = tuple(pipelines or self.pipelines)
        total = len(pipelines) * (1 + len(resolutions))
        done = 0
        outcomes: list[WarmupStep] = []

        def record(step: WarmupStep) -> None:
            nonlocal done
            done += 1
            outcomes.append(step)
            (logger.info if step.ok else logger.warning)("warm-up %d/%d: %s", done, total, step.message)
            if on_progress is not None:
                on_progress(done, total, step.message)

        for name in pipelines:
            start = time.perf_counter()
            try:
                self.pipeline(name, acceleration)
            except DemoError as exc:
                record(WarmupStep(name, None, False, str(exc), time.perf_counter() - start))
                for size in resolutions:
                    record(WarmupStep(name, size, False, f"{name} {format_resolution(size)}: skipped", 0.0))
                continue
            seconds = time.perf_counter() - start
            ready = f"{name} ({acceleration} mode) ready on {self.device} ({seconds:.1f} s)"
            record(WarmupStep(name, None, True, ready, seconds))
            defaults = self.defaults(name)
            for width, height in resolutions:
                request = GenerationRequest(
                    prompt=prompt,
                    pipeline=name,
                    width=width,
                    height=height,
                    steps=max(steps, 2),
                    guidance=defaults.guidance,
                    seed=0,
                    mode=ACCELERATED_ONLY,
                    acceleration=acceleration,
                )
                start = time.perf_counter()
                try:
                    result = self.generate(request)
                except DemoError as exc:
                    record(WarmupStep(name, (width, height), False, str(exc), time.perf_counter() - start))
                    continue
                seconds = time.perf_counter() - start
                message = (
                    f"{name} {width}x{height}: {result.cost.captures} capture(s) in {seconds:.1f} s"
                    f" ({_bytes(result.cost.graph_memory_bytes)} graph memory)"
                )
                record(WarmupStep(name, (width, height), True, message, seconds))
        return outcomes

    def close(self) -> None:
        """Restore every pipeline accelerated so far, in every mode (``bcg_diffusion.restore``: graphs freed,
        patches reverted) and forget them and the built pipelines. Waits for the requests in flight on each; a
        later request builds its pipeline again."""
        with self._entries_lock:
            entries = list(self._entries.values())
            self._entries.clear()
        with self._build_lock:
            self._templates.clear()
        for entry in entries:
            with entry.lock:
                if entry.pipe is not None:
                    restore(entry.pipe)
                    entry.pipe = None

    def _validate(self, request: GenerationRequest) -> None:
        if request.pipeline not in self.pipelines:
            raise DemoError(
                f"pipeline {request.pipeline!r} is not served here: choose one of {', '.join(self.pipelines)}"
            )
        if request.mode not in MODES:
            raise DemoError(f"mode {request.mode!r} is not one of {', '.join(MODES)}")
        if request.acceleration not in ACCELERATIONS:
            raise DemoError(f"mode {request.acceleration!r} is not one of {', '.join(ACCELERATIONS)}")
        if not request.prompt.strip():
            raise DemoError("type a prompt first")
        parse_resolution(f"{request.width}x{request.height}", self.defaults(request.pipeline).max_side)
        minimum = 2 if request.pipeline == "qwen-image" else 1  # Qwen-Image's scheduler gives NaN sigmas at 1 step
        if not minimum <= request.steps <= MAX_STEPS:
            raise DemoError(
                f"steps must be between {minimum} and {MAX_STEPS} for {request.pipeline}, got {request.steps}"
            )
        if not 0 <= request.guidance <= MAX_GUIDANCE:
            raise DemoError(f"guidance must be between 0 and {MAX_GUIDANCE:g}, got {request.guidance:g}")
        if not 0 <= request.seed < 2**63:
            raise DemoError(f"seed must be between 0 and 2^63 - 1, got {request.seed}")

    def _entry(self, name: str, acceleration: str) -> _Entry:
        with self._entries_lock:
            return self._entries.setdefault((name, acceleration, self.weights, str(self.device)), _Entry())

    def _ensure_built(self, entry: _Entry, name: str, acceleration: str) -> Any:
        """Build ``name`` if not done yet, and accelerate a weight-sharing copy of it in mode ``acceleration``
        into ``entry`` (see the class docstring); the caller holds ``entry.lock``."""
        if entry.pipe is not None:
            return entry.pipe
        chosen = ACCELERATIONS[acceleration]
        with self._build_lock:
            key = (name, self.weights, str(self.device))
            template = self._templates.get(key)
            if template is None:
                try:
                    template = self._builder(name, self.weights, device=self.device, dtype=self.dtype)
                except Exception as exc:
                    raise self._failure(exc, f"loading {name} from {self.weights!r}") from None
                self._templates[key] = template
            try:
                pipe = _weight_sharing_copy(template)
                pipe.set_progress_bar_config(disable=True)
                accelerate(pipe, debug=not self.uses_cuda_graphs, **chosen.options)
            except Exception as exc:
                raise self._failure(
                    exc,
                    f"accelerating {name} ({type(template).__name__}) in {chosen.name} mode, an unsupported model?",
                ) from None
        entry.pipe = pipe
        return pipe

    def _generate(self, request: GenerationRequest, on_progress: ProgressCallback | None) -> GenerationResult:
        side_by_side = request.mode == SIDE_BY_SIDE
        total = request.steps * (2 if side_by_side else 1)
        chosen = ACCELERATIONS[request.acceleration]
        entry = self._entry(request.pipeline, request.acceleration)
        if not entry.lock.acquire(blocking=False):
            if on_progress is not None:
                on_progress(0, total, f"waiting: {request.pipeline} is busy (warm-up or another request)")
            entry.lock.acquire()
        try:
            if entry.pipe is None and on_progress is not None:
                on_progress(0, total, f"loading {request.pipeline} ({self.weights}, {chosen.name} mode)")
            pipe = self._ensure_built(entry, request.pipeline, request.acceleration)
            eager_images = eager_seconds = None
            before = middle = stats(pipe)
            if side_by_side:
                with eager(pipe):  # exact mode: eager; fast mode: its compiled blocks without graphs
                    reporter = _StepReporter(on_progress, 0, total, chosen.reference, request.steps)
                    eager_seconds, eager_images = self._timed_call(pipe, request, reporter)
                middle = stats(pipe)  # what the reference did (fast mode: the first compile) stays apart
            offset = request.steps if side_by_side else 0
            reporter = _StepReporter(on_progress, offset, total, "accelerated", request.steps)
            accelerated_seconds, accelerated_images = self._timed_call(pipe, request, reporter)
            after = stats(pipe)
        finally:
            entry.lock.release()
        reference = GraphCost.between(before, middle)
        if not after["active"]:
            graphs = f"inactive: {after['reason']}"
        else:
            graphs = "debug" if after["debug"] else "cuda graphs"
        return GenerationResult(
            request=request,
            device=str(self.device),
            graphs=graphs,
            accelerated_image=_to_pil(accelerated_images),
            accelerated_seconds=accelerated_seconds,
            accelerated_digest=_digest(accelerated_images),
            cost=GraphCost.between(before, after),
            eager_image=_to_pil(eager_images) if eager_images is not None else None,
            eager_seconds=eager_seconds,
            eager_digest=_digest(eager_images) if eager_images is not None else None,
            identical=torch.equal(eager_images, accelerated_images) if eager_images is not None else None,
            max_difference=(
                (eager_images - accelerated_images).abs().max().item() if eager_images is not None else None
            ),
            reference_compiles=reference.compiles,
            reference_compile_seconds=reference.compile_seconds,
        )

    def _timed_call(
        self, pipe: Any, request: GenerationRequest, reporter: _StepReporter
    ) -> tuple[float, torch.Tensor]:
        """Latency of one full pipeline call (prompt encoding to decoded image) and its images, on the CPU."""
        kwargs = request.pipeline_kwargs()
        reporter.start()
        self._synchronize()
        start = time.perf_counter()
        images = pipe(**kwargs, callback_on_step_end=reporter).images
        self._synchronize()
        seconds = time.perf_counter() - start
        return seconds, images.detach().to("cpu", torch.float32)

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _failure(self, exc: BaseException, doing: str) -> DemoError:
        """Log ``exc`` with its traceback; return the DemoError that tells the user what happened."""
        logger.error("demo: failed %s", doing, exc_info=exc)
        if _is_out_of_memory(exc):
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.empty_cache()
            return DemoError(f"out of memory {doing}: try a smaller resolution, fewer pipelines or a bigger GPU")
        detail = " ".join(str(exc).split()) or "no message"
        if len(detail) > _MAX_MESSAGE:
            detail = detail[:_MAX_MESSAGE] + "..."
        return DemoError(f"failed {doing}: {type(exc).__name__}: {detail} (details in the server log)")


def _is_out_of_memory(exc: BaseException) -> bool:
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(exc, RuntimeError) and (
        "out of memory" in str(exc).lower() or "can't allocate memory" in str(exc).lower()
    )


@dataclass(frozen=True)
class WarmupStep:
    """One finished warm-up step: a build (``resolution`` None) or one accelerated call."""

    pipeline: str
    resolution: tuple[int, int] | None
    ok: bool
    message: str
    seconds: float


class WarmupStatus:
    """Thread-safe progress of a warm-up, to show on the page; usable as the ``on_progress`` callback."""

    def __init__(self, total: int = 0) -> None:
        self._lock = threading.Lock()
        self.done, self.total = 0, total
        self.messages: list[str] = []
        self.failures: list[str] = []
        self.finished = total == 0

    def __call__(self, done: int, total: int, message: str) -> None:
        with self._lock:
            self.done, self.total = done, total
            self.messages.append(message)

    def finish(self, steps: Sequence[WarmupStep] = ()) -> None:
        """Mark the warm-up ended; ``steps`` (what ``warm_up`` returned) tell which steps failed."""
        with self._lock:
            self.failures = [step.message for step in steps if not step.ok]
            self.finished = True

    def markdown(self) -> str:
        """One line: what is warming up, or that it is done (with the first failure, if any)."""
        with self._lock:
            last = self.messages[-1] if self.messages else "starting"
            if not self.finished:
                return f"Warming up ({self.done}/{self.total}): {last}. Requests wait until their pipeline is ready."
            if not self.total:
                return "No warm-up."
            if self.failures:
                return f"**Warm-up: {len(self.failures)} of {self.total} steps failed**; first: {self.failures[0]}"
            return f"Warm-up done ({self.done}/{self.total} steps); last: {last}."


def warm_up_in_background(
    backend: DemoBackend,
    resolutions: Sequence[tuple[int, int]],
    pipelines: Sequence[str] | None = None,
    on_progress: ProgressCallback | None = None,
    acceleration: str = DEFAULT_ACCELERATION,
) -> tuple[WarmupStatus, threading.Thread]:
    """Start :meth:`DemoBackend.warm_up` (in mode ``acceleration``) in a daemon thread; returns its status and
    the thread."""
    pipelines = tuple(pipelines or backend.pipelines)
    status = WarmupStatus(len(pipelines) * (1 + len(resolutions)))

    def progress(done: int, total: int, message: str) -> None:
        status(done, total, message)
        if on_progress is not None:
            on_progress(done, total, message)

    def run() -> None:
        steps: list[WarmupStep] = []
        try:
            steps = backend.warm_up(resolutions, pipelines, progress, acceleration=acceleration)
        except Exception:  # the warm-up is a convenience: a bug in it must not take the server down
            logger.exception("demo: warm-up failed")
        finally:
            status.finish(steps)

    thread = threading.Thread(target=run, name="bcg-demo-warmup", daemon=True)
    thread.start()
    return status, thread


def gradio_handler(backend: DemoBackend) -> Callable[..., tuple[PIL.Image.Image | None, PIL.Image.Image, str]]:
    """The Generate button's function: page values in, ``(eager image, accelerated image, report)`` out.

    Its inputs are ``(prompt, negative_prompt, pipeline, resolution, steps, guidance, seed, mode,
    acceleration)``, the last optional (default exact). Every failure becomes a ``gradio.Error`` with a short
    message (no traceback reaches the page; it is logged).
    """
    import gradio as gr

    def generate(
        prompt: str,
        negative_prompt: str,
        pipeline: str,
        resolution: str,
        steps: float,
        guidance: float,
        seed: float,
        mode: str,
        acceleration: str = DEFAULT_ACCELERATION,
        progress: Any = gr.Progress(),  # noqa: B008 - Gradio injects the request's tracker through this default
    ) -> tuple[PIL.Image.Image | None, PIL.Image.Image, str]:
        def advance(done: int, total: int, description: str) -> None:
            progress((done, total), desc=description, unit="steps")

        try:
            max_side = backend.defaults(str(pipeline)).max_side
            request = request_from_ui(
                prompt,
                negative_prompt,
                pipeline,
                resolution,
                steps,
                guidance,
                seed,
                mode,
                acceleration,
                max_side=max_side,
            )
            return backend.generate(request, advance).outputs()
        except DemoError as exc:
            raise gr.Error(str(exc), print_exception=False) from None
        except Exception:
            logger.exception("demo: unexpected error in the Generate handler")
            raise gr.Error("internal error (details in the server log)", print_exception=False) from None

    return generate
