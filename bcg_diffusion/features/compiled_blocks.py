"""Fast mode: the transformer's repeated blocks compiled by inductor, then captured as breakable graphs.

Graphs remove launch gaps but replay the eager kernels; ``torch.compile`` fuses kernels but, in its
``reduce-overhead`` mode, records its own CUDA graphs per shape after a long warm-up. Fast mode takes
the fused kernels from inductor's default mode (no CUDA graphs of its own) for each block listed in the
model's ``_repeated_blocks`` (one compiled graph serves every block of a class, as in diffusers'
``compile_repeated_blocks``), and our runner captures the whole forward around them.

What makes the two fit:

* compiled code will not run under the capture's dispatch mode, so every block goes through
  :func:`~bcg_diffusion.core.graphs.call_untracked`;
* the runner's warm-up calls compile (and re-compile for a new shape) before any capture, so no
  compilation, autotuning or module loading happens while a stream is capturing;
* blocks compile with dynamic shapes (and no duck sizing), so new resolutions and text lengths reuse
  one compiled graph instead of recompiling each time, and each call has exactly one compiled entry:
  the kernels it runs do not depend on what was compiled before. Every dynamo compile inside
  the blocks is counted (``stats(pipe)["compiles"]``); should compiling fail (a graph break, too many
  variants), the blocks go back to their eager forwards with a warning, never to an error.

Warm starts come from PyTorch's own caches (FX graph, AOT autograd and Triton, on disk), optionally in
a directory the user chooses, plus a portable copy (``torch.compiler.save_cache_artifacts``) written
there after each compile, which a process on another machine loads at start. Beside it goes a zip of
the Triton kernels of ours the process compiled (:mod:`bcg_diffusion.kernels.triton_cache`), which
PyTorch's artifacts do not hold, written after any accelerated call that compiled one (the VAE's kernels
first run after the transformer's last call) and unpacked into Triton's cache at start.

The :class:`CompiledBlocks` feature decides when it applies (``mode="fast"`` with the transformer
accelerated; under context parallelism the blocks compile as regions between the collectives, which
stay eager breaks), applies the adapter's fast-mode processor patches first (scoped to this model),
keeps a portable copy of the compile caches after each call that compiled, and reports the compiles.
Without blocks to compile, the pipeline keeps exact-mode graphs and says so.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import time
import types
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..core.graphs import call_untracked
from ..core.hooks import MethodPatches, private_copy
from ..core.python_state import through_compiled
from ..core.runner import BCGWarning
from ..kernels import triton_cache
from . import persistent_reductions
from .base import Feature, Setup, Target

__all__ = [
    "ARTIFACTS_FILE",
    "TRITON_KERNELS_FILE",
    "BlockCompiles",
    "CompiledBlocks",
    "compile_forward",
    "compile_modules",
    "compile_repeated_blocks",
    "inductor_options",
    "load_compile_cache",
    "private_copy",
    "save_compile_cache",
]

logger = logging.getLogger(__name__)

ARTIFACTS_FILE = "bcg-compile-artifacts.bin"
TRITON_KERNELS_FILE = "bcg-triton-kernels.zip"  # our Triton kernels' cache folders (kernels/triton_cache.py)
TRITON_CACHE_FOLDER = "triton"  # Triton's cache (TRITON_CACHE_DIR) in the compile cache directory, unless set


def _compiles_so_far() -> int:
    """Graphs dynamo has compiled in this process. Sampled around each block call: compilation runs
    synchronously in the calling thread, so the difference is what that call compiled (a compile in
    another thread at the same moment would be counted too; the count is for information only).
    Dynamo's counter rather than its compile callbacks, whose signature changed between releases."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


# Compiled variants allowed per block class and pipeline. Each structural variant of a block call
# (modulated or not, with or without an attention mask, batch 1 or more) is one dynamo compile: tiny
# Z-Image needs 8 over CFG, masks and three resolutions, which is dynamo's whole default limit.
RECOMPILE_LIMIT = 32


def _compile_errors() -> tuple[type[BaseException], ...]:
    """Dynamo's errors for a block it cannot compile (looked up when one is raised: importing dynamo
    costs seconds, which ``import bcg_diffusion`` should not pay)."""
    from torch._dynamo import exc

    names = ("TorchDynamoException", "FailOnRecompileLimitHit")
    return tuple(getattr(exc, name) for name in names if hasattr(exc, name))


@dataclass
class BlockCompiles:
    """What :func:`compile_repeated_blocks` compiled: block names, dynamo compiles seen inside them
    (the first compile of each block class and variant, plus every recompile), the wall time of the
    block calls that compiled (compiling, or loading from the caches, and that one call), why the
    blocks went back to their eager forwards for good, if they did, and how many block calls ran
    eagerly because hooks sat inside the block (sequential offload...)."""

    names: list[str] = field(default_factory=list)
    compiles: int = 0
    compile_seconds: float = 0.0
    failure: str | None = None
    eager_calls: int = 0  # block calls that ran eagerly because submodules carried hooks
    hook_warned: bool = False

    def report(self, prefix: str = "") -> dict[str, Any]:
        """The ``stats()`` entries of these compiles, their keys after ``prefix``: ``{prefix}compiles``,
        ``{prefix}compile_seconds`` and ``{prefix}compile_failure``."""
        return {
            f"{prefix}compiles": self.compiles,
            f"{prefix}compile_seconds": self.compile_seconds,
            f"{prefix}compile_failure": self.failure,
        }


# Functions ``torch.nn.attention.sdpa_kernel`` leaves in a dynamo graph. AOT autograd's cache refuses
# graphs that call private torch functions, so a block whose attention picks its SDPA backend that
# way (diffusers' ``_native_cudnn``: fast mode's Z-Image attention on Hopper) was traced again by
# every new process: 6 of the 10 s that a warm start spent compiling (H200, Z-Image 512² in FP8,
# run 70), and the same in bf16. Both only set which SDPA backends are enabled, from constants the
# graph holds. Likewise torchao's ``Float8MMConfig`` (a named tuple of constants) and ``Float8Tensor``
# (its FP8 tensor, built from the graph's tensors and those constants), which fast mode's FP8
# feed-forward (``patches/fp8_feed_forward.py``) builds inside the blocks: the first kept every FP8
# block out of the cache (a warm start of 12.4 s against 5.2 s before that patch, H200, Z-Image 512²,
# run 118), then, once marked, the second (13.4 s, run 119); with both marked, 5.5 s (run 122). Each
# mark keys the cache by its package's version, so marking them cacheable is safe.
_CACHEABLE_FUNCTIONS = {
    "torch.nn.attention._backend_from_string": "torch",
    "torch.nn.attention._sdpa_kernel": "torch",
    "torchao.float8.inference.Float8MMConfig": "torchao",
    "torchao.quantization.Float8Tensor": "torchao",
}


def _compile_settings(floats_as_constants: bool) -> contextlib.AbstractContextManager[Any]:
    """Dynamo settings for our blocks' compiles: a higher recompile limit, no duck sizing, Python
    floats traced as constants or not (:func:`_floats_as_constants` decides), and inductor's persistent
    reductions widened to the models' widths (:mod:`~bcg_diffusion.features.persistent_reductions`).

    Duck sizing makes two sizes that happen to be equal at the first compile equal by guard, so a later
    call where they differ compiles a second, more general entry; which entry then serves a call would
    depend on what was compiled before, and so could the kernels and the image. Without it (and with
    ``dynamic=True``) entries differ only by mutually exclusive structure (a mask or none, batch 1 or
    more): each call has exactly one entry, whatever came before.
    """
    dynamo = torch._dynamo.config
    settings: dict[str, Any] = {"recompile_limit": RECOMPILE_LIMIT}
    if hasattr(dynamo, "specialize_float"):
        settings["specialize_float"] = floats_as_constants
    stack = contextlib.ExitStack()
    stack.enter_context(dynamo.patch(**settings))
    from torch.fx.experimental import _config as shape_config

    if hasattr(shape_config, "use_duck_shape"):
        stack.enter_context(shape_config.patch(use_duck_shape=False))
    stack.enter_context(persistent_reductions.widened())
    return stack


def _holds_python_float(value: Any) -> bool:
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return any(isinstance(item, float) for item in value)
    return isinstance(value, float)


def _floats_as_constants(holds_lora: bool, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a block call compiles its Python floats as constants (dynamo's ``specialize_float``):
    yes, unless the block holds LoRA layers (``holds_lora``, from :func:`_scan_block`) or the call
    passes floats.

    Why: with ``dynamic=True`` dynamo traces every float as a symbol. Floats that aten takes as
    arguments (a layer norm's ``eps``, a dropout's ``p``) cannot stay symbols, so dynamo threw its
    whole first trace of a block away and traced it again, in every new process: a warm start took
    10.1 s with that, 5.2 s without (H200, Z-Image 512² in FP8, runs 71 and 73). Such floats are
    hyperparameters, fixed for a model's life. A LoRA scale is not: ``set_adapters`` changes it, and
    as a symbol it stays an input of the compiled graph, where as a constant each new scale would
    compile again. Floats passed to a block call (with its arguments one level deep) stay symbols for
    the same reason. The choice depends only on the model and the call, never on what was compiled
    before.
    """
    return not holds_lora and not any(_holds_python_float(value) for value in (*args, *kwargs.values()))


def inductor_options() -> dict[str, Any]:
    """Inductor settings for our blocks' compiles, passed to ``torch.compile`` so that they apply
    while it compiles and cost nothing per call: the SDPA backend choice and torchao's FP8 tensor and
    settings marked cacheable (:data:`_CACHEABLE_FUNCTIONS`; torchao's once it is imported), beside any
    functions the user marked, and the widened persistent reductions named for the caches' key
    (:func:`persistent_reductions.inductor_options`)."""
    import torch._inductor.config as inductor

    options = persistent_reductions.inductor_options()
    marked = getattr(inductor, "unsafe_marked_cacheable_functions", None)
    if marked is None:  # a torch without the setting: its cache is left as it is
        return options
    versions = {package: getattr(sys.modules.get(package), "__version__", None) for package in ("torch", "torchao")}
    ours = {name: versions[package] for name, package in _CACHEABLE_FUNCTIONS.items() if versions[package]}
    marks = dict(marked) | ours
    return options | {"unsafe_marked_cacheable_functions": marks}


def _unviewed(value: Any) -> Any:
    """``value``, or for a tensor that is a view, the same tensor with no view relation (``detach``
    shares the storage, copies nothing). Dynamo guards on a view input's base: Z-Image calls the same
    block class with a slice of a padded RoPE table (noise refiner) and with a whole one (main layers),
    which compiled the block twice. Tensors that require grad keep their autograd history."""
    if isinstance(value, torch.Tensor) and value._base is not None and not value.requires_grad:
        return value.detach()
    return value


def hooked_submodules(block: torch.nn.Module) -> list[str]:
    """Names of ``block``'s submodules (not the block itself) that carry hooks compiled code would have
    to trace: accelerate's (sequential CPU offload) or diffusers' (group offloading, layerwise
    casting...). Hooks on the block itself wrap its compiled forward from outside and are harmless."""
    return _scan_block(block)[0]


def _scan_block(block: torch.nn.Module) -> tuple[list[str], bool]:
    """One walk over ``block``'s submodules for what each compiled-block call needs to know: the
    :func:`hooked_submodules` names, and whether it holds peft's LoRA layers."""
    tuners = sys.modules.get("peft.tuners.tuners_utils")  # not imported: no LoRA layer can exist
    lora_layer = getattr(tuners, "BaseTunerLayer", None)
    names, holds_lora = [], False
    for name, module in block.named_modules():
        if lora_layer is not None and isinstance(module, lora_layer):
            holds_lora = True
        if not name:
            continue
        registry = module.__dict__.get("_diffusers_hook")
        if "_hf_hook" in module.__dict__ or (registry is not None and getattr(registry, "hooks", None)):
            names.append(name)
    return names, holds_lora


def _compiled_forward(
    compiled: Callable[..., Any], original: Callable[..., Any], block: torch.nn.Module, record: BlockCompiles
) -> Callable[..., Any]:
    def forward(*args: Any, **kwargs: Any) -> Any:
        if record.failure is not None or through_compiled():
            # through_compiled: a runner's recorder wants to see what the block reads (python_state)
            return original(*args, **kwargs)
        hooked, holds_lora = _scan_block(block)
        if hooked:
            # Compiling through the hooks would fail or compile another variant (other kernels), and a
            # failure would retire the compiled blocks for good: run this call eagerly and keep the
            # compiled entries for when the hooks are gone.
            record.eager_calls += 1
            if not record.hook_warned:
                record.hook_warned = True
                warnings.warn(
                    f"bcg-diffusion: fast mode's compiled blocks run their eager forwards while submodules "
                    f"carry hooks (offload, layerwise casting...: {hooked[:3]}): those calls round like "
                    "eager, not like fast mode; once the hooks are removed the same compiled blocks run again",
                    BCGWarning,
                    stacklevel=2,
                )
            return original(*args, **kwargs)
        args = tuple(_unviewed(a) for a in args)
        kwargs = {k: _unviewed(v) for k, v in kwargs.items()}
        before, started = _compiles_so_far(), time.perf_counter()
        try:
            with _compile_settings(_floats_as_constants(holds_lora, args, kwargs)):
                return call_untracked(compiled, *args, **kwargs)
        except _compile_errors() as exc:
            record.failure = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            warnings.warn(
                f"bcg-diffusion: fast mode could not compile a block ({record.failure}); every block of this "
                "model runs its eager forward from now on (graphs still capture them), so its images round like "
                "eager's, not like fast mode's; restore and accelerate again to retry",
                BCGWarning,
                stacklevel=2,
            )
            return original(*args, **kwargs)
        finally:
            compiled_now = _compiles_so_far() - before
            if compiled_now:
                record.compiles += compiled_now
                record.compile_seconds += time.perf_counter() - started

    return forward


def compile_forward(
    module: torch.nn.Module,
    target: Callable[..., Any],
    patches: MethodPatches,
    record: BlockCompiles,
    *,
    dynamic: bool,
    fullgraph: bool,
    wrap: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None,
) -> None:
    """Replace ``module.forward`` (recorded in ``patches``) by ``target`` (a forward of ``module``, e.g.
    a :func:`private_copy` of its class's) compiled by inductor with our settings, ``wrap``ped if given:
    each call counted in ``record``, run eagerly where hooks sit inside or a recorder reads the Python
    state, and the eager forward for good after a compile that fails (with a warning)."""
    original = module.forward
    compiled = torch.compile(target, fullgraph=fullgraph, dynamic=dynamic, options=inductor_options())
    forward = _compiled_forward(compiled if wrap is None else wrap(compiled), original, module, record)
    patches.replace(module, "forward", functools.wraps(original)(forward))


def compile_modules(
    modules: Iterable[tuple[str, torch.nn.Module]], patches: MethodPatches, *, fullgraph: bool = True
) -> BlockCompiles:
    """Replace the ``forward`` of every ``(name, module)`` in ``modules`` by an inductor-compiled one, with
    our settings (:func:`compile_forward`, dynamic shapes). Modules of one class share one compiled
    function (a :func:`private_copy` of their class's forward), so the first of them compiles and the
    others reuse it. Returns the record of their compiles; the patches are recorded in ``patches``."""
    record = BlockCompiles()
    private_forwards: dict[type, types.FunctionType] = {}
    for name, block in modules:
        original = block.forward
        function = getattr(original, "__func__", None)
        if isinstance(function, types.FunctionType) and "forward" not in block.__dict__:
            if type(block) not in private_forwards:
                private_forwards[type(block)] = private_copy(function)
            target = types.MethodType(private_forwards[type(block)], block)
        else:  # an instance-level forward someone else installed: compile it as it is
            target = original
        compile_forward(block, target, patches, record, dynamic=True, fullgraph=fullgraph)
        record.names.append(name)
    return record


def compile_repeated_blocks(
    module: torch.nn.Module, patches: MethodPatches, *, fullgraph: bool = True
) -> BlockCompiles:
    """Replace the ``forward`` of every block of ``module._repeated_blocks`` by an inductor-compiled one
    (:func:`compile_modules`).

    Compiles with ``fullgraph=True`` (a graph break inside a block is an error at the first call, not a
    silent slowdown) and inductor's default mode, which adds no CUDA graphs of its own. ``fullgraph=False``
    is for blocks that must break on purpose: context parallelism's collectives, which stay eager
    breaks between compiled regions (:mod:`bcg_diffusion.patches.collectives`). The patches are
    recorded in ``patches`` (``patches.undo()`` gives the original forwards back).

    Raises:
        ValueError: ``module`` declares no ``_repeated_blocks``, or none of its submodules is one.
    """
    classes = tuple(getattr(module, "_repeated_blocks", None) or ())
    if not classes:
        raise ValueError(
            f"{type(module).__name__} declares no _repeated_blocks: fast mode compiles those; use mode='exact'"
        )
    blocks = [(name, block) for name, block in module.named_modules() if type(block).__name__ in classes]
    if not blocks:
        raise ValueError(f"{type(module).__name__} has no submodule of its _repeated_blocks classes {classes}")
    return compile_modules(blocks, patches, fullgraph=fullgraph)


def use_compile_cache_dir(directory: str) -> None:
    """Point PyTorch's compile caches at ``directory`` and load the portable copy kept there, if any,
    with our Triton kernels kept there (:data:`TRITON_KERNELS_FILE`, unpacked into Triton's cache).

    Sets ``TORCHINDUCTOR_CACHE_DIR`` for the whole process (PyTorch reads it at each compile); warns
    when it was already set to another directory, which is then replaced. Where ``TRITON_CACHE_DIR`` is
    not set, sets it to ``directory/triton`` for the whole process too: inductor would set it at its first
    kernel (to a folder of its cache), after our kernels were unpacked into Triton's default folder, where
    they would never be looked for again. One set by the user is kept, and the kernels go there.
    """
    path = Path(directory).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    previous = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if previous is not None and Path(previous).resolve() != path:
        warnings.warn(
            f"bcg-diffusion: compile_cache_dir={str(path)!r} replaces TORCHINDUCTOR_CACHE_DIR={previous!r} "
            "for this process",
            stacklevel=3,
        )
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    os.environ.setdefault("TRITON_CACHE_DIR", str(path / TRITON_CACHE_FOLDER))
    load_compile_cache(path / ARTIFACTS_FILE)
    triton_cache.load(path / TRITON_KERNELS_FILE)


def load_compile_cache(file: str | os.PathLike[str]) -> bool:
    """Load portable compile artifacts saved by :func:`save_compile_cache`; False when there are none.

    A file this torch cannot read (another version) is reported with a warning and ignored: the next
    compile then starts cold.
    """
    file = Path(file)
    load = getattr(torch.compiler, "load_cache_artifacts", None)
    if load is None or not file.is_file():
        return False
    try:
        info = load(file.read_bytes())
    except Exception as exc:  # a stale or foreign cache must not stop the pipeline; it only costs time
        warnings.warn(f"bcg-diffusion: ignoring compile cache {file}: {type(exc).__name__}: {exc}", stacklevel=2)
        return False
    if info is None:  # torch logs why (a corrupted file, another version) and loads nothing
        warnings.warn(f"bcg-diffusion: ignoring compile cache {file}: torch could not read it", stacklevel=2)
        return False
    logger.info("loaded compile cache artifacts from %s (%s)", file, info)
    return True


def save_compile_cache(file: str | os.PathLike[str]) -> bool:
    """Write every compile artifact of this process to ``file`` (atomically); False when torch has
    no portable cache API or nothing was compiled."""
    save = getattr(torch.compiler, "save_cache_artifacts", None)
    if save is None:
        return False
    artifacts = save()
    if artifacts is None:
        return False
    file = Path(file)
    partial = file.with_suffix(file.suffix + f".{os.getpid()}.tmp")
    partial.write_bytes(artifacts[0])
    partial.replace(file)
    logger.info("saved compile cache artifacts to %s (%d bytes)", file, len(artifacts[0]))
    return True


logger = logging.getLogger(__name__)


class CompiledBlocks(Feature):
    name = "compiled blocks"
    component = "transformer"
    experts = True  # Wan 2.2's second expert too
    defaults = {
        "compiled_blocks": 0,
        "compiles": 0,
        "compile_seconds": 0.0,
        "compile_failure": None,
        "eager_block_calls": 0,
    }

    def __init__(self, cache_dir: str | None, breaks_inside: bool = False) -> None:
        self.cache_dir = cache_dir
        # Under context parallelism the collectives stay eager breaks inside the blocks: compiled
        # regions between them (dynamo breaks its graph there), not one graph per block.
        self.breaks_inside = breaks_inside
        self.compiled: BlockCompiles | None = None
        self.scoped_patches: list[str] = []
        # dynamo's compiles in this process (ours and any other: the text encoder's layers, a VAE decoder)
        # when the portable compile cache was last written
        self.compiles_saved = 0
        self.kernels_saved = 0  # our Triton kernels compiled in this process when their zip was last written

    @classmethod
    def create(cls, setup: Setup) -> CompiledBlocks | None:
        if setup.config.mode != "fast":
            return None
        if "transformer" not in setup.accelerated:
            _fall_back("fast mode compiles the transformer, which is not among the accelerated components")
            return None
        return cls(setup.config.compile_cache_dir, breaks_inside=setup.layout is not None)

    def prepare(self, setup: Setup, patches: MethodPatches) -> None:
        transformer = setup.modules["transformer"]
        if self.cache_dir is not None:
            use_compile_cache_dir(self.cache_dir)
        for patch in setup.adapter.fast_patches:
            try:
                if patch.apply(transformer, patches):
                    self.scoped_patches.append(patch.name)
                    setup.attention_kwargs.update(patch.accepts)
            except ValueError as exc:
                warnings.warn(f"bcg-diffusion: fast-mode patch {patch.name} skipped: {exc}", BCGWarning, stacklevel=4)
        try:
            self.compiled = compile_repeated_blocks(transformer, patches, fullgraph=not self.breaks_inside)
        except ValueError as exc:
            _fall_back(str(exc))
            return
        logger.info("fast mode: compiling %d blocks of %s", len(self.compiled.names), type(transformer).__name__)

    def wrap_call(self, target: Target, call: Callable[..., Any]) -> Callable[..., Any]:
        if self.compiled is None or (target.component != "transformer" and self.cache_dir is None):
            return call

        def saving_compile_cache(*args: Any, **kwargs: Any) -> Any:
            result = call(*args, **kwargs)
            if target.component == "transformer" and _compiles_so_far() != self.compiles_saved:
                self._save_compile_cache()
            # Our kernels compile at their first launch, in any component (the VAE's after the
            # transformer's last call): a walk over a dozen kernels' caches on a replayed call.
            if self.cache_dir is not None and (count := triton_cache.compiled_count()) != self.kernels_saved:
                self._save_triton_kernels(count)
            return result

        return saving_compile_cache

    def _save_compile_cache(self) -> None:
        """After a call that compiled something, keep a portable copy of the compile caches."""
        self.compiles_saved = _compiles_so_far()
        if self.cache_dir is None:
            return
        self._saving(save_compile_cache, ARTIFACTS_FILE)

    def _save_triton_kernels(self, count: int) -> None:
        """After a call that compiled a kernel of ours (``count`` of them so far), keep their Triton cache
        folders."""
        self.kernels_saved = count
        self._saving(triton_cache.save, TRITON_KERNELS_FILE)

    def _saving(self, save: Callable[[str], Any], name: str) -> None:
        try:
            save(f"{self.cache_dir}/{name}")
        except OSError as exc:
            warnings.warn(f"bcg-diffusion: could not save {name} in {self.cache_dir}: {exc}", BCGWarning, stacklevel=5)

    def stats(self) -> dict[str, Any]:
        if self.compiled is None:
            return {}
        return {
            "compiled_blocks": len(self.compiled.names),
            **self.compiled.report(),
            "eager_block_calls": self.compiled.eager_calls,
        }

    def patch_names(self) -> list[str]:
        return list(self.scoped_patches)


def _fall_back(reason: str) -> None:
    warnings.warn(
        f"bcg-diffusion: mode='fast' falls back to graphs of the eager blocks (not compiled): {reason}",
        BCGWarning,
        stacklevel=5,
    )
