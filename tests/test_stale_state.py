"""What a graph freezes that the runner must see, in the replaying debug mode on the CPU.

Debug mode replays each signature from a record of its operations (``bcg_diffusion.core.recording``), stale
exactly where a CUDA graph would be. Each test changes, between calls of a tiny Z-Image pipeline, something
a captured forward read: one block's attention processor or an attribute of it, module attributes that are
not plain values (a NumPy array, a dict holding a tensor, an object, a function), global torch settings,
hooks and instance forwards, the component itself, and the inputs a forward writes into. Every accelerated
call is compared byte for byte with the same call through ``eager(pipe)``, and the runner must have
noticed (a new capture, never a stale replay or an eager fallback). Before this round debug mode re-ran the
forward at every call, so its images followed any change and none of this could fail on the CPU.
"""

from __future__ import annotations

import logging
import threading

import numpy as np
import pytest
import torch
from _checks import assert_graphs_ran
from diffusers.models.transformers.transformer_z_image import ZSingleStreamAttnProcessor

from bcg_diffusion import BCGWarning, accelerate, eager, restore, stats
from bcg_diffusion.core.runner import GraphRunner
from bcg_diffusion.models import build_pipeline

SCALE = 1.0  # a module-level global a hook reads: no check can see it (docs/invalidation.md)


# What each scenario accelerates with, and how it builds a pipeline; tests/test_stale_state_cuda.py runs the same
# scenarios with graphs on a GPU, exact and fast.
DEBUG = {"debug": True}


def _pipe(seed: int = 0, device: str = "cpu", dtype: torch.dtype | None = None):
    pipe = build_pipeline("z-image", "tiny", seed=seed, device=device, dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _call(pipe):
    return pipe(
        "a red fox",
        height=32,
        width=32,
        num_inference_steps=2,
        guidance_scale=0.0,
        generator=torch.Generator().manual_seed(0),
        output_type="latent",
    ).images


def _check(pipe, before, captures):
    """One accelerated call: the graphs ran (with or without a new capture, as asked) and gave eager's bytes."""
    image = _call(pipe)
    report = assert_graphs_ran(pipe, before, captures=captures)
    with eager(pipe):
        reference = _call(pipe)
    assert torch.equal(image, reference), (image - reference).abs().max()
    return report


@pytest.fixture
def pipe():
    pipe = _pipe()
    yield pipe
    if stats(pipe)["active"]:
        restore(pipe)


class Scaled(ZSingleStreamAttnProcessor):
    """Z-Image's attention processor with its output scaled by an attribute of the processor."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = scale

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, freqs_cis=None):
        out = super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, freqs_cis)
        return out * self.scale


def test_one_blocks_processor_and_its_attributes_are_watched(pipe, options=DEBUG):
    from diffusers.models.attention_dispatch import AttentionBackendName

    accelerate(pipe, **options)
    report = _check(pipe, None, captures=True)
    report = _check(pipe, report, captures=False)
    attention = pipe.transformer.layers[0].attention
    attention.set_processor(Scaled(2.0))  # one block's processor, as regional prompting does
    report = _check(pipe, report, captures=True)
    report = _check(pipe, report, captures=False)
    attention.processor.scale = 3.0  # an attribute of that processor
    report = _check(pipe, report, captures=True)
    attention.processor._attention_backend = AttentionBackendName._NATIVE_MATH  # set on the instance: new
    report = _check(pipe, report, captures=True)
    _check(pipe, report, captures=False)


class Doubler:
    def __call__(self, x):
        return x * 2


def _reads_attributes(module, args, out):
    out = out + torch.as_tensor(module.table, dtype=out.dtype).sum() * 0.01
    out = out + module.extra["bias"]
    if module.helper is not None:
        out = module.helper(out)
    return module.act(out)


NON_PLAIN = {
    "an array changed in place": lambda layer: layer.table.__setitem__(0, 5.0),
    "a dict's tensor replaced": lambda layer: layer.extra.__setitem__(
        "bias", torch.full((), 0.5, device=layer.extra["bias"].device)
    ),
    "an object set to None": lambda layer: setattr(layer, "helper", None),
    "a function replaced": lambda layer: setattr(layer, "act", torch.sigmoid),
}


@pytest.mark.parametrize("change", NON_PLAIN)
def test_attributes_that_are_not_plain_values_are_watched(pipe, change, options=DEBUG):
    layer = pipe.transformer.layers[0]
    layer.table = np.array([0.5, 0.25], dtype=np.float32)
    layer.extra = {"bias": torch.zeros((), device=pipe.device)}
    layer.helper = Doubler()
    layer.act = torch.tanh
    layer.register_forward_hook(_reads_attributes)
    accelerate(pipe, **options)
    report = _check(pipe, None, captures=True)
    report = _check(pipe, report, captures=False)
    NON_PLAIN[change](layer)
    report = _check(pipe, report, captures=True)
    assert report["components"]["transformer"]["state_changes"] >= 1
    _check(pipe, report, captures=False)


SETTINGS = {
    "autocast": lambda: torch.autocast("cuda" if torch.cuda.is_available() else "cpu", dtype=torch.bfloat16),
    "deterministic algorithms": lambda: _switched(
        torch.use_deterministic_algorithms, torch.are_deterministic_algorithms_enabled
    ),
    "float32 matmul precision": lambda: _switched(
        torch.set_float32_matmul_precision, torch.get_float32_matmul_precision, "medium"
    ),
    "TF32 matmul": lambda: _attribute(torch.backends.cuda.matmul, "allow_tf32", True),
    "SDP backend": lambda: _sdpa_math(),
}


def _sdpa_math():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.MATH])


class _switched:
    """Set a global with ``setter(value)`` for the block, then put back what ``getter`` gave."""

    def __init__(self, setter, getter, value=True):
        self.setter, self.getter, self.value = setter, getter, value

    def __enter__(self):
        self.before = self.getter()
        self.setter(self.value)

    def __exit__(self, *exc):
        self.setter(self.before)


def _attribute(owner, name, value):
    return _switched(lambda v: setattr(owner, name, v), lambda: getattr(owner, name), value)


@pytest.mark.parametrize("setting", SETTINGS)
def test_a_call_under_other_global_settings_captures_graphs_of_its_own(pipe, setting, caplog, options=DEBUG):
    accelerate(pipe, **options)
    report = _check(pipe, None, captures=True)
    with SETTINGS[setting](), caplog.at_level(logging.INFO, logger="bcg_diffusion"):
        report = _check(pipe, report, captures=True)  # a capture, not a fallback nor a stale replay
        report = _check(pipe, report, captures=False)
    assert "global setting" in caplog.text
    # Back to the settings of the first graphs, they replay; except where torch cannot put a setting back as it
    # was (its old and new precision APIs, once both used, no longer read the same).
    _check(pipe, report, captures=None if setting == "float32 matmul precision" else False)


def _times_one_and_a_half(module, args, out):
    return out * 1.5


def test_hooks_and_instance_forwards_added_after_the_capture_are_seen(pipe, options=DEBUG):
    accelerate(pipe, **options)
    report = _check(pipe, None, captures=True)
    feed_forward = pipe.transformer.layers[1].feed_forward
    handle = feed_forward.register_forward_hook(_times_one_and_a_half)
    report = _check(pipe, report, captures=True)
    handle.remove()
    report = _check(pipe, report, captures=True)
    pre = feed_forward.register_forward_pre_hook(lambda module, args: (args[0] * 0.5,))
    report = _check(pipe, report, captures=True)
    pre.remove()
    original = feed_forward.forward
    feed_forward.forward = lambda x: original(x) * 2.0
    report = _check(pipe, report, captures=True)
    del feed_forward.forward
    _check(pipe, report, captures=True)


def test_a_component_replaced_on_the_pipeline_is_accelerated_at_its_next_call(pipe, options=DEBUG):
    accelerate(pipe, **options)
    report = _check(pipe, None, captures=True)
    old = pipe.transformer
    pipe.transformer = _pipe(seed=1, device=pipe.device.type, dtype=pipe.transformer.dtype).transformer
    report = _check(pipe, report, captures=True)
    assert report["components"]["transformer"]["replays"] > 0, "the new transformer runs through a runner"
    assert report["replaced_components"] == ["transformer"]
    assert "forward" not in vars(old), "the old transformer is given back as it was"
    _check(pipe, report, captures=False)
    restore(pipe)
    assert "forward" not in vars(pipe.transformer)


class WritesItsInput(torch.nn.Module):
    """A key/value-cache-like forward: it adds its input into a tensor it is given."""

    def forward(self, x, cache):
        cache.add_(x)
        return cache * 2


class WritesThroughAnAlias(torch.nn.Module):
    """Writes into one argument and reads another that is a view of it."""

    def forward(self, cache, head):
        cache.add_(1.0)
        return head * 2


def test_a_forward_that_writes_into_its_inputs_leaves_them_as_eager_does():
    model = WritesItsInput()
    runner = GraphRunner(model.forward, name="toy", pool=None, lock=threading.RLock(), debug=True, module=model)
    cache, expected_cache = torch.zeros(3), torch.zeros(3)
    x = torch.full((3,), 3.0)
    with torch.no_grad():
        for _ in range(3):  # the capture, then replays
            out, expected = runner(x, cache), model(x, expected_cache)
            assert torch.equal(cache, expected_cache) and torch.equal(out, expected), (cache, expected_cache)
    assert runner.counters.captures == 1 and runner.counters.replays == 2
    assert runner.records()[0].written_inputs == [1]


def test_an_input_written_through_an_alias_of_another_runs_eagerly_with_the_reason():
    # Static copies would part the two arguments the caller gave as one memory: no replay can be exact.
    model = WritesThroughAnAlias()
    runner = GraphRunner(model.forward, name="toy", pool=None, lock=threading.RLock(), debug=True, module=model)
    cache, expected = torch.zeros(4), torch.zeros(4)
    with torch.no_grad(), pytest.warns(BCGWarning, match="shares memory with argument tensor 1"):
        out = runner(cache, cache[:2])
    assert torch.equal(out, model(expected, expected[:2])) and torch.equal(cache, expected)
    assert runner.records()[0].status == "failed"


def _reads_a_global(module, args, out):
    return out * SCALE


def test_the_replaying_mode_is_stale_where_a_graph_is_and_the_verifying_mode_names_the_operation(pipe):
    global SCALE
    pipe.transformer.layers[0].register_forward_hook(_reads_a_global)
    accelerate(pipe, debug=True)
    try:
        first = _call(pipe)
        SCALE = 2.0  # a global: no check sees it, and a graph replays the old value
        stale = _call(pipe)
        with eager(pipe):
            fresh = _call(pipe)
        assert torch.equal(stale, first) and not torch.equal(stale, fresh), "a faithful replay is stale here"
        restore(pipe)
        SCALE = 1.0
        accelerate(pipe, debug="verify")
        _call(pipe)
        SCALE = 2.0
        with pytest.warns(BCGWarning) as caught:
            assert not torch.equal(_call(pipe), fresh)
        [message] = [str(w.message) for w in caught if "differs from the eager forward" in str(w.message)]
        assert "aten.mul.Tensor" in message and "test_stale_state.py" in message and "_reads_a_global" in message
        assert stats(pipe)["mismatches"] >= 1
        [transformer] = [s for s in stats(pipe)["signatures"] if s["component"] == "transformer"]
        assert transformer["mismatches"] and transformer["replayed_as"] == "record"
    finally:
        SCALE = 1.0


def test_changes_are_logged_once_each_old_to_new_as_they_were(pipe, caplog):
    layer = pipe.transformer.layers[0]
    layer.weights = {"a": 0.2}
    layer.register_forward_hook(lambda module, args, out: out * module.weights["a"])
    accelerate(pipe, debug=True)
    _call(pipe)
    layer.weights["a"] = 0.5  # edited in place: the log shows the dict as the capture read it
    with caplog.at_level(logging.INFO, logger="bcg_diffusion"):
        _call(pipe)
    assert "layers.0.weights: {'a': 0.2} -> {'a': 0.5} since its capture" in caplog.text
    caplog.clear()
    pipe.transformer.train()
    with caplog.at_level(logging.INFO, logger="bcg_diffusion.core.runner"), torch.no_grad():
        _call(pipe)
    lines = [r.getMessage() for r in caplog.records if "since" in r.getMessage()]
    assert len(lines) == 1 and "training: False -> True" in lines[0], lines
    assert "dropping 0" not in caplog.text


def test_accelerate_settles_torchs_lazy_settings_before_a_first_call_reads_them(pipe, monkeypatch):
    # On a Hopper GPU, PyTorch's first attention call reorders SDPA's priorities, a key of every graph: a
    # component called before any attention (Z-Image's text encoder) captured again at the next call (run 167).
    from bcg_diffusion.core import settings

    settled, real = [], settings.settle
    monkeypatch.setattr(settings, "settle", settled.append)
    accelerate(pipe, **DEBUG)
    assert settled == [pipe.transformer.device]
    before = settings.current()
    real(torch.device("cpu"))  # nothing to settle off a CUDA device
    assert settings.differences(before, settings.current()) == []
