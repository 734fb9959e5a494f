"""What an adapter tells the core about one family of diffusers pipelines."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

from diffusers.models.attention_dispatch import _AttentionBackendRegistry

from ..patches import FunctionPatch
from ..patches.scoped import ProcessorGlobalsPatch

__all__ = ["PipelineAdapter", "attention_backend_key", "vae_layout_key"]


def attention_backend_key() -> Hashable:
    """The globally active diffusers attention backend: changing it changes the kernels a forward runs.

    Called on every transformer call (it is part of the signature), so it returns the backend enum as is.
    """
    return _AttentionBackendRegistry.get_active_backend()[0]


def vae_layout_key(vae: Any) -> Callable[[], Hashable]:
    """Tiling and slicing switch the VAE's decode between code paths, so they key its graphs."""

    def key() -> Hashable:
        return (getattr(vae, "use_tiling", False), getattr(vae, "use_slicing", False))

    return key


class PipelineAdapter:
    """Base adapter: which components become graphs, which patches they need, what else keys them.

    Subclasses set ``name``, ``class_prefixes`` (pipeline class names they serve, matched as prefixes
    along the MRO) and ``tested_classes``, and add ``patches`` where a graph-hostile op has an exact
    device-side equivalent. Scheduler steps, CFG arithmetic and pipeline Python stay eager: only the
    methods named in ``targets`` are replaced. ``fast_patches`` apply in fast mode only.
    """

    name: str = "generic"
    class_prefixes: tuple[str, ...] = ()
    tested_classes: tuple[str, ...] = ()
    targets: dict[str, str] = {"transformer": "forward", "vae": "decode"}
    patches: tuple[FunctionPatch, ...] = ()
    # Fast mode only: patches that compile better but round differently, scoped to the accelerated model.
    fast_patches: tuple[ProcessorGlobalsPatch, ...] = ()

    def matches(self, pipe: Any) -> bool:
        return (
            any(cls.__name__.startswith(self.class_prefixes) for cls in type(pipe).__mro__)
            if self.class_prefixes
            else False
        )

    def is_tested(self, pipe: Any) -> bool:
        return type(pipe).__name__ in self.tested_classes

    def state_key(self, component: str, module: Any) -> Callable[[], Hashable] | None:
        """Extra signature state for ``component`` (None: its arguments say everything)."""
        if component == "transformer":
            return attention_backend_key
        if component == "vae":
            return vae_layout_key(module)
        return None
