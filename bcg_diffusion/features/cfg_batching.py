"""Fast mode: true CFG's cond and uncond transformer calls of one step run as one batch.

With true CFG, Qwen-Image's pipeline calls the transformer twice per step: with the prompt ("cond"),
then with the negative prompt ("uncond"), on the same latents and timestep. Each call reads every
weight once, and at 512² a good part of a forward is bound by that traffic (the text stream and the
per-block modulation multiply only a few rows), so the second call costs nearly what the first does.
Batched, both halves share one read of the weights.

The pipeline returns from the cond call before it makes the uncond call, so the pair cannot be formed
by waiting. Instead, the cond call of a step *speculates*: it batches its own inputs with the negative
prompt the previous step's uncond call used, returns the cond half and keeps the uncond half. The
uncond call that follows gets that half only if its inputs are verifiably the ones speculated on:

- the same latents tensor, unchanged since (identity and version counter);
- the same negative embeddings and mask tensors, unchanged;
- equal timestep and guidance values (compared on the device: one small host sync per step);
- equal values of every other argument (``img_shapes``, ``attention_kwargs``, ``return_dict``...).

Anything else runs as called, and the speculated half is dropped (counted in ``stats()``). Calls
under ``torch.inference_mode()`` run one by one: inference tensors keep no version counter, so a
change in place could not be seen (diffusers' own ``torch.no_grad()`` is fine).

The first step has no previous step to learn the negative prompt from. The pipeline encodes both
prompts before it denoises (``encode_prompt`` for the prompt, then for the negative prompt), and
:class:`CfgBatchHints` hands the batcher what that method returned (:meth:`CfgBatcher.hint`): when the
first transformer call after two encodings carries the first one's text, its cond call batches with
the second. A hint is only a guess, verified like any other speculation, so a wrong one costs a
dropped half, never a wrong image. Without hints (another pipeline, a warm-up) the first step runs
cond and uncond one by one, which teaches the batcher the negative prompt. With hints the first call
also compiles and captures the batch alone, not the single calls besides it.

When the two prompts have different token lengths, the shorter one is padded with zeros and both get
a text mask: the model's masked path, as with ``text_buckets``. Batching and masking change rounding
(other GEMM shapes and attention kernels), which is why this belongs to ``mode="fast"`` only.

Under a step cache, each of the two calls runs in a cache context of its own (``cache_context("cond")``,
``("uncond")``). A cache whose decisions read host values alone (MagCache with its ratios, TaylorSeer) runs
the batch in one joint context whose state is both contexts' states side by side, split back whenever a
call runs alone (:mod:`bcg_diffusion.features.step_caching.cfg_join`): the decisions are the unbatched
run's. Under any other cache (FirstBlockCache, which decides on the whole batch's data; Cache-DiT) the
calls run one by one, and the reason is logged once at INFO. Under a cache the first step of every call
runs one by one, hints or not: a joint context needs the uncond context's name, learned from an uncond
call that ran alone, so with hints a process's first call would run its first step one by one and later
calls would batch it: the same call would round differently depending on what ran before it.

The :class:`CfgBatching` feature decides where it applies: asked for (or left at None), supported by
the adapter for this very pipeline class (``PipelineAdapter.batches_cfg``: Qwen-Image's Edit variants
batch too, their image latents riding along in the shared latents), and not under context
parallelism. :class:`CfgBatchHints`, a feature of each pipeline, passes the encoded prompts to the
batcher of the transformer it calls; a warm-up runs without them, so it captures the first step's
single calls too, which a call whose hint fails needs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..core.hooks import MethodPatches
from ..core.runner import BCGWarning
from ..core.tree import UnsupportedValue, flatten, unflatten
from ..patches.attention import TEXT_LENGTHS_KWARG
from .base import Feature, Setup, Target
from .step_caching import CfgJoin
from .text_buckets import pad_to_bucket

__all__ = ["CfgBatchHints", "CfgBatchSpec", "CfgBatcher", "CfgBatching", "batcher_of"]

logger = logging.getLogger(__name__)

# A transformer module -> the batcher its calls go through (while CfgBatching is installed on it).
_BATCHERS: weakref.WeakKeyDictionary[torch.nn.Module, CfgBatcher] = weakref.WeakKeyDictionary()


def batcher_of(module: torch.nn.Module | None) -> CfgBatcher | None:
    """The :class:`CfgBatcher` that ``module``'s calls go through, or None (not batched, or restored)."""
    return None if module is None else _BATCHERS.get(module)


@dataclasses.dataclass(frozen=True)
class CfgBatchSpec:
    """The roles of a transformer forward's arguments in a CFG pair (names of its parameters).

    Attributes:
        latents: the per-sample tensor both calls of a step share (the very same tensor).
        text, text_mask: the prompt embeddings ``[B, L, D]`` and their mask ``[B, L]`` (or None), the
            only inputs that differ between cond and uncond.
        values: per-sample tensors (or None) whose values the two calls share, e.g. the timestep.
        lists: per-sample Python lists the two calls share (concatenated for the batch).
        absent: arguments that must be None for a call to be batched (e.g. ControlNet residuals).
        attention_kwargs: the dict argument whose entries reach the attention processors, through
            which a batch of texts that differ in length can tell them each text's length.
        encoder: the pipeline's method that returns ``(embeddings, mask)`` as the transformer receives
            them, called for the prompt and then for the negative prompt before denoising (None: the
            first step runs one by one). See :class:`CfgBatchHints`.
    """

    latents: str
    text: str
    text_mask: str
    values: tuple[str, ...] = ()
    lists: tuple[str, ...] = ()
    absent: tuple[str, ...] = ()
    attention_kwargs: str | None = None
    encoder: str | None = None


class _Ref:
    """A weak reference to a tensor (or None) with its version counter when taken: ``same(x)`` says
    whether ``x`` is that tensor, still holding what it held."""

    __slots__ = ("_ref", "_version")

    def __init__(self, tensor: torch.Tensor | None) -> None:
        self._ref = None if tensor is None else weakref.ref(tensor)
        self._version = None if tensor is None else tensor._version

    def get(self) -> torch.Tensor | None:
        return None if self._ref is None else self._ref()

    def alive(self) -> bool:
        return self._ref is None or self._ref() is not None

    def same(self, tensor: torch.Tensor | None) -> bool:
        if self._ref is None or tensor is None:
            return self._ref is None and tensor is None
        return self._ref() is tensor and tensor._version == self._version


@dataclasses.dataclass
class _Text:
    """Prompt embeddings and their mask (or None), as weak references."""

    text: _Ref
    mask: _Ref

    def same(self, text: torch.Tensor, mask: torch.Tensor | None) -> bool:
        return self.text.same(text) and self.mask.same(mask)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The embeddings and mask, or None once either is gone or was changed in place."""
        text, mask = self.text.get(), self.mask.get()
        if text is None or not self.mask.alive():
            return None
        if not self.same(text, mask):
            return None
        return text, mask


@dataclasses.dataclass(frozen=True)
class _TextBatch:
    """Cond and uncond texts as one batch: embeddings, mask (None: every token valid), and each
    text's token length when its tokens are all valid (None: a mask says which are)."""

    text: torch.Tensor
    mask: torch.Tensor | None
    lengths: tuple[int, int] | None


@dataclasses.dataclass
class _Pending:
    """A speculated uncond half and the inputs it was computed for."""

    latents: _Ref
    negative: _Text
    values: dict[str, torch.Tensor | None]
    lists: dict[str, Any]
    others: tuple[Any, list[torch.Tensor]]
    output: Any


def _split_others(spec: CfgBatchSpec, arguments: dict[str, Any]) -> tuple[Any, list[torch.Tensor]] | None:
    """The arguments with no role in ``spec``, as a comparable (structure, tensor leaves) pair; None
    when one of them is an object we cannot compare."""
    roles = {spec.latents, spec.text, spec.text_mask, *spec.values, *spec.lists}
    try:
        leaves, structure = flatten({k: v for k, v in arguments.items() if k not in roles})
    except UnsupportedValue:
        return None
    return structure, leaves


class _NoCache:
    """The :class:`~bcg_diffusion.features.step_caching.CfgJoin` of a model without a step cache."""

    def stateful(self) -> bool:
        return False

    def note_uncond(self) -> None: ...

    def in_uncond(self) -> bool:
        return True

    def join(self, sizes: tuple[int, int], padded: bool) -> str | None:
        return None

    def batch(self) -> Any:
        return contextlib.nullcontext()

    def kept_cond(self) -> None: ...

    def served(self) -> None: ...

    def separate(self) -> None: ...


class CfgBatcher:
    """Calls ``call`` (a transformer forward, usually its graph runner) with CFG pairs batched.

    Needs the forward's ``signature`` (to read arguments by name) and the model's
    :class:`CfgBatchSpec`. ``cache``: the model's
    :class:`~bcg_diffusion.features.step_caching.CfgJoin`, which runs each batch in one cache context and
    puts the cond and uncond contexts back before a call that runs alone (None: no cache to follow). With
    ``text_lengths_key`` (the model's attention takes it, see
    :mod:`bcg_diffusion.patches.attention`), a batch of two unmasked texts of different lengths passes
    ``{text_lengths_key: (cond length, uncond length)}`` in ``spec.attention_kwargs`` besides the
    padding mask. Returns, for every call, what ``call`` would return for it; only rounding
    differs for batched calls. ``batched`` counts uncond calls served from a batch, ``dropped``
    speculated halves that were not used (each a wasted half forward). :meth:`hint` tells it the texts
    the pipeline encoded, so the first step of a call can batch too.

    Not thread-safe on its own: the caller holds the pipeline's lock.
    """

    def __init__(
        self,
        call: Callable[..., Any],
        signature: inspect.Signature,
        spec: CfgBatchSpec,
        text_lengths_key: str | None = None,
        cache: CfgJoin | None = None,
    ) -> None:
        self._call = call
        self._cache = cache if cache is not None else _NoCache()
        self._signature = signature
        self._spec = spec
        self._text_lengths_key = text_lengths_key if spec.attention_kwargs is not None else None
        self._last_latents: _Ref | None = None  # the previous call's latents and text: a pair shares the latents
        self._last_text: _Ref | None = None
        self._negative: _Text | None = None  # the uncond text of the last pair: what cond calls batch with
        self._pending: _Pending | None = None
        self._hints: list[_Text] = []  # the last two texts encoded since the last call, oldest first
        # The padded text batch of the last pair: prompt and negative prompt stay the same for every
        # step of a call, so the padding is done once per call (key: the cond text, the negative).
        self._text_batch: tuple[_Text, _Text, _TextBatch] | None = None
        self._logged: set[str] = set()
        self._disabled: str | None = None  # why this model's calls can never be batched
        self.batched = 0
        self.dropped = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            bound = self._signature.bind(*args, **kwargs)
        except TypeError:
            return self._call(*args, **kwargs)  # the model raises its own error for a bad call
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        hints, self._hints = self._hints, []  # hints are for the first call after the encodings only
        pending, self._pending = self._pending, None
        if pending is not None:
            reason = self._mismatch(pending, arguments)
            if reason is None and not self._cache.in_uncond():
                reason = "the next call ran in another cache context"
            if reason is None:
                self.batched += 1
                self._cache.served()
                return pending.output
            self._drop(reason)
        reason = self._disabled or self._unbatchable(arguments)
        if reason is not None:
            self._log(f"not batched: {reason}")
            self._forget()
            return self._alone(*args, **kwargs)
        latents, text = arguments[self._spec.latents], arguments[self._spec.text]
        if self._last_latents is not None and self._last_latents.same(latents) and not self._last_text.same(text):
            # The uncond call after a cond call that ran alone: its text is what later steps batch with.
            self._negative = _Text(_Ref(text), _Ref(arguments[self._spec.text_mask]))
            self._forget()
            self._cache.note_uncond()
            return self._alone(*args, **kwargs)
        # Under a cache the first step stays one by one in every call (see the module docstring).
        hinted = None
        if hints and not self._cache.stateful():  # hints come once per pipeline call: no walk on other steps
            hinted = self._hinted_negative(hints, text, arguments[self._spec.text_mask])
        if hinted is not None:
            self._negative = hinted
        negative = self._negative.tensors() if self._negative is not None else None
        if negative is not None and self._compatible(arguments, *negative):
            return self._batch(arguments, *negative)
        self._last_latents, self._last_text = _Ref(latents), _Ref(text)
        return self._alone(*args, **kwargs)

    def hint(self, text: torch.Tensor, mask: torch.Tensor | None) -> None:
        """The pipeline encoded a prompt: ``text`` ``[B, L, D]`` and ``mask`` (or None) are what it will
        pass the transformer. When the next call carries the text hinted before this one, its cond call
        batches with this one (verified as every speculation is). Other values are ignored."""
        if isinstance(text, torch.Tensor) and (mask is None or isinstance(mask, torch.Tensor)):
            self._hints = [*self._hints[-1:], _Text(_Ref(text), _Ref(mask))]

    def _hinted_negative(self, hints: list[_Text], text: torch.Tensor, mask: Any) -> _Text | None:
        """The negative prompt ``hints`` stand for when this call carries the first of two hinted texts,
        both alive and unchanged (None otherwise)."""
        if len(hints) != 2 or not hints[0].same(text, mask) or hints[1].tensors() is None:
            return None
        return hints[1]

    def pass_through(self, reason: str | None = None) -> None:
        """The caller runs this call unbatched (``reason``: why, logged once at INFO): drop what was
        speculated and learned, so no later call is served a half computed for other inputs, and put the
        cache contexts back as they would be had every call run alone."""
        if reason is not None:
            self._log(f"not batched: {reason}")
        if self._pending is not None:
            self._pending = None
            self._drop("the next call ran unbatched")
        self._negative = None
        self._hints = []
        self._forget()
        self._cache.separate()

    def _alone(self, *args: Any, **kwargs: Any) -> Any:
        """A call run unbatched, its cache context holding its own state."""
        self._cache.separate()
        return self._call(*args, **kwargs)

    def _unbatchable(self, arguments: dict[str, Any]) -> str | None:
        spec = self._spec
        for name in (spec.latents, spec.text):
            if not isinstance(arguments.get(name), torch.Tensor):
                return f"{name} is not a tensor"
        mask = arguments.get(spec.text_mask)
        if mask is not None and not isinstance(mask, torch.Tensor):
            return f"{spec.text_mask} is not a tensor"
        if any(t is not None and t.is_inference() for t in (arguments[spec.latents], arguments[spec.text], mask)):
            return "inference-mode tensors keep no version counter, so a change in place could not be seen"
        for name in spec.absent:
            if arguments.get(name) is not None:
                return f"{name} is given"
        if torch.is_grad_enabled():
            return "autograd is on"
        return None

    def _compatible(self, arguments: dict[str, Any], text: torch.Tensor, mask: torch.Tensor | None) -> bool:
        cond = arguments[self._spec.text]
        batch = arguments[self._spec.latents].shape[0]
        return (
            cond.dim() == 3
            and text.dim() == 3
            and cond.shape[0] == text.shape[0] == batch
            and cond.shape[2] == text.shape[2]
            and cond.dtype == text.dtype
            and cond.device == text.device
            and (mask is None or mask.shape == text.shape[:2])
        )

    def _batch(
        self, arguments: dict[str, Any], negative_text: torch.Tensor, negative_mask: torch.Tensor | None
    ) -> Any:
        spec = self._spec
        batch = arguments[spec.latents].shape[0]
        others = _split_others(spec, arguments)
        if others is None:
            self._log("not batched: an argument cannot be compared between calls")
            return self._alone(**arguments)
        batched = dict(arguments)
        batched[spec.latents] = torch.cat([arguments[spec.latents]] * 2)
        texts = self._texts(arguments, negative_text, negative_mask)
        batched[spec.text], batched[spec.text_mask] = texts.text, texts.mask
        if texts.lengths is not None and self._text_lengths_key is not None:
            given = arguments.get(spec.attention_kwargs)
            if given is None or isinstance(given, dict):
                batched[spec.attention_kwargs] = {**(given or {}), self._text_lengths_key: texts.lengths}
        for name in spec.values:
            value = arguments.get(name)
            batched[name] = None if value is None else torch.cat([value] * 2)
        for name in spec.lists:
            value = arguments.get(name)
            batched[name] = None if value is None else list(value) * 2
        padded = arguments[spec.text].shape[1] != negative_text.shape[1]  # the shorter text padded in the batch
        refused = self._cache.join((batch, batch), padded=padded)
        if refused is not None:
            self._log(f"not batched under the cache: {refused}")
            self._last_latents, self._last_text = _Ref(arguments[spec.latents]), _Ref(arguments[spec.text])
            return self._alone(**arguments)
        with self._cache.batch():
            output = self._call(**batched)
        halves = self._halves(output, batch)
        if halves is None:
            return self._alone(**arguments)  # neither half used: both contexts go back to before the batch
        self._cache.kept_cond()
        self._pending = _Pending(
            latents=_Ref(arguments[spec.latents]),
            negative=self._negative,
            values={name: arguments.get(name) for name in spec.values},
            lists={name: arguments.get(name) for name in spec.lists},
            others=others,
            output=halves[1],
        )
        self._forget()
        return halves[0]

    def _texts(
        self, arguments: dict[str, Any], negative_text: torch.Tensor, negative_mask: torch.Tensor | None
    ) -> _TextBatch:
        """The cond and negative texts as one batch: padded to one length and masked when their
        lengths differ or either has a mask. Reused while the cond text and the negative are the same
        tensors, unchanged."""
        cond_text, cond_mask = arguments[self._spec.text], arguments[self._spec.text_mask]
        cached = self._text_batch
        if cached is not None and cached[0].same(cond_text, cond_mask) and cached[1] is self._negative:
            return cached[2]
        lengths = (cond_text.shape[1], negative_text.shape[1])
        if cond_mask is None and negative_mask is None and lengths[0] == lengths[1]:
            batch = _TextBatch(torch.cat([cond_text, negative_text]), None, None)
        else:
            length = (max(lengths),)
            padded_cond, padded_cond_mask = pad_to_bucket(cond_text, cond_mask, length)
            padded_negative, padded_negative_mask = pad_to_bucket(negative_text, negative_mask, length)
            batch = _TextBatch(
                torch.cat([padded_cond, padded_negative]),
                torch.cat([padded_cond_mask, padded_negative_mask]),
                # Every token of an unmasked text is valid: the mask then says no more than the lengths.
                lengths if cond_mask is None and negative_mask is None else None,
            )
        cond = _Text(_Ref(cond_text), _Ref(cond_mask))
        self._text_batch = (cond, self._negative, batch)
        return batch

    def _halves(self, output: Any, batch: int) -> tuple[Any, Any] | None:
        """``output`` of a batch of ``2 * batch`` split into the cond and uncond halves. None when some
        output is not per-sample: batching is then off for good (the batch was wasted once)."""
        try:
            leaves, structure = flatten(output)
        except UnsupportedValue as exc:
            self._disabled = f"the model's output cannot be split ({exc})"
            return None
        if not leaves or any(leaf.dim() == 0 or leaf.shape[0] != 2 * batch for leaf in leaves):
            self._disabled = "the model's output is not one row per sample"
            return None
        return unflatten(structure, [leaf[:batch] for leaf in leaves]), unflatten(
            structure, [leaf[batch:] for leaf in leaves]
        )

    def _mismatch(self, pending: _Pending, arguments: dict[str, Any]) -> str | None:
        """Why this call is not the uncond call ``pending`` was computed for (None: it is)."""
        spec = self._spec
        if not pending.latents.same(arguments.get(spec.latents)):
            return "the next call had other latents"
        if not pending.negative.same(arguments.get(spec.text), arguments.get(spec.text_mask)):
            return "the next call had another text"
        for name, expected in pending.lists.items():
            if arguments.get(name) != expected:
                return f"the next call had another {name}"
        others = _split_others(spec, arguments)
        if (
            others is None
            or others[0] != pending.others[0]
            or any(a is not b for a, b in zip(others[1], pending.others[1], strict=True))
        ):
            return "the next call had other arguments"
        for name, expected in pending.values.items():
            value = arguments.get(name)
            if value is expected:
                continue
            if value is None or expected is None or value.shape != expected.shape or not torch.equal(value, expected):
                return f"the next call had another {name}"
        return None

    def _drop(self, reason: str) -> None:
        self.dropped += 1
        self._negative = None
        self._log(f"a speculated uncond half was not used: {reason}")

    def _forget(self) -> None:
        self._last_latents = self._last_text = None

    def _log(self, message: str) -> None:
        if message not in self._logged:
            self._logged.add(message)
            logger.info("CFG batching: %s", message)


class CfgBatching(Feature):
    name = "CFG batching"
    component = "transformer"
    defaults = {"cfg_batched": 0, "cfg_batch_dropped": 0}

    def __init__(self, setup: Setup) -> None:
        self.spec = setup.adapter.cfg_batch
        self.lock = setup.group.lock
        self.attention_kwargs = setup.attention_kwargs  # filled by the processor patches' prepare
        self.batcher: CfgBatcher | None = None

    @classmethod
    def create(cls, setup: Setup) -> CfgBatching | None:
        config = setup.config
        if config.mode != "fast" or config.batch_cfg is False or "transformer" not in setup.accelerated:
            return None
        if config.cfg_parallel is not False:  # the two calls of a step run on two GPUs instead
            if config.batch_cfg:
                warnings.warn("bcg-diffusion: batch_cfg=True is ignored with cfg_parallel", BCGWarning, stacklevel=4)
            return None
        if setup.adapter.cfg_batch is not None and setup.adapter.batches_cfg(setup.pipe) and setup.layout is None:
            return cls(setup)
        if config.batch_cfg:
            where = "with context parallelism" if setup.layout is not None else f"for {type(setup.pipe).__name__}"
            warnings.warn(
                f"bcg-diffusion: batch_cfg is not supported {where}; its CFG calls run one by one",
                BCGWarning,
                stacklevel=4,
            )
        return None

    def wrap_call(self, target: Target, call: Callable[..., Any]) -> Callable[..., Any]:
        if target.component != "transformer":
            return call
        lengths_key = TEXT_LENGTHS_KWARG if TEXT_LENGTHS_KWARG in self.attention_kwargs else None
        join = CfgJoin(target.module)
        batcher = self.batcher = CfgBatcher(
            call, target.signature, self.spec, text_lengths_key=lengths_key, cache=join
        )
        _BATCHERS[target.module] = batcher

        def batched(*args: Any, **kwargs: Any) -> Any:
            with self.lock:  # the batcher keeps state between calls
                refusal = join.refusal()
                if refusal is not None:
                    # A cache whose cond and uncond contexts cannot run as one (step_caching.cfg_join): one by one.
                    batcher.pass_through(refusal)
                    return call(*args, **kwargs)
                return batcher(*args, **kwargs)

        return batched

    def stats(self) -> dict[str, Any]:
        if self.batcher is None:
            return {}
        return {"cfg_batched": self.batcher.batched, "cfg_batch_dropped": self.batcher.dropped}

    def close(self) -> None:
        for module, batcher in list(_BATCHERS.items()):
            if batcher is self.batcher:
                del _BATCHERS[module]


class CfgBatchHints(Feature):
    """Each encoded prompt of a pipeline call, passed to its transformer's batcher (:meth:`CfgBatcher.hint`).

    Wraps the adapter's ``CfgBatchSpec.encoder`` method on the pipeline, outermost (after every
    feature's ``prepare``, so after text buckets pad its results): the hints are what the transformer
    receives. Applies where :class:`CfgBatching` batches the pipeline's transformer. A warm-up runs
    without hints, so it captures the first step's single calls as well as the batch.
    """

    name = "CFG batch hints"
    component = None

    def __init__(self, encoder: str) -> None:
        self.encoder = encoder
        self.enabled = True

    @classmethod
    def create(cls, setup: Setup) -> CfgBatchHints | None:
        spec = setup.adapter.cfg_batch
        if (
            setup.config.mode != "fast"
            or spec is None
            or spec.encoder is None
            or not setup.adapter.batches_cfg(setup.pipe)
        ):
            return None
        return cls(spec.encoder) if callable(getattr(setup.pipe, spec.encoder, None)) else None

    def finish(self, setup: Setup, patches: MethodPatches) -> None:
        # The batcher of the transformer this pipeline calls: installed by CfgBatching (now, or by the
        # pipeline that took a shared transformer first); none where CFG is not batched.
        batcher = batcher_of(getattr(setup.pipe, "transformer", None))
        if batcher is None:
            return
        encode = getattr(setup.pipe, self.encoder)

        def encode_and_hint(*args: Any, **kwargs: Any) -> Any:
            result = encode(*args, **kwargs)
            if self.enabled and isinstance(result, tuple) and len(result) == 2:
                batcher.hint(*result)
            return result

        encode_and_hint.__wrapped__ = encode  # type: ignore[attr-defined]
        encode_and_hint.__doc__ = encode.__doc__
        patches.replace(setup.pipe, self.encoder, encode_and_hint)

    @contextlib.contextmanager
    def warming_up(self) -> Iterator[None]:
        self.enabled = False
        try:
            yield
        finally:
            self.enabled = True
