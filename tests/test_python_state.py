"""Python state a capture read is checked once per pipeline call (bcg_diffusion.core.python_state), on CPU.

Debug mode re-runs the forward at every "replay", so its images follow any change; what these tests
check is that the runner notices the change, names it and captures again (on a GPU the replay would
otherwise be stale: tests/test_python_state_cuda.py shows the bytes).
"""

from __future__ import annotations

import logging
import threading

import pytest
import torch
from _checks import assert_graphs_ran

from bcg_diffusion import accelerate, invalidate, restore, stats
from bcg_diffusion.core.graphs import call_untracked
from bcg_diffusion.core.python_state import ReadRecorder, StateWatch, call_scope, paused, recording
from bcg_diffusion.core.runner import GraphRunner
from bcg_diffusion.models import build_pipeline


class Shifted(torch.nn.Module):
    """Reads a float attribute, an optional attribute and its parameter; writes a scratch attribute
    before reading it (the forward's own state, not to be watched)."""

    untouched_class_value = 3.0

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.drop = torch.nn.Dropout(0.5)  # reads self.training: train() changes what it computes
        self.shift = 1.0

    def forward(self, x):
        self.scratch = x.shape[0]
        extra = getattr(self, "extra", None)
        out = self.drop(self.proj(x)) + self.shift * self.scratch * self.untouched_class_value
        return out if extra is None else out * extra


def _recorded(model, x):
    recorder = ReadRecorder({id(m): (name, m) for name, m in model.named_modules()})
    with recorder.recording():
        model(x)
    return recorder


def test_the_recorder_notes_attributes_parameters_and_absent_names_a_forward_reads():
    model = Shifted()
    reads = {w.where: w.kind for w in _recorded(model, torch.randn(2, 4)).reads.values()}
    assert reads["shift"] == "attribute" and reads["extra"] == "absent" and reads["proj"] == "module"
    assert reads["proj.weight"] == "tensor" and reads["proj.bias"] == "tensor"
    assert reads["drop.training"] == "attribute" and reads["drop.p"] == "attribute"
    assert "scratch" not in reads, "written before it was read: the forward's own state"
    assert "untouched_class_value" not in reads, "a class attribute is not instance state"
    assert not recording(), "the hook leaves torch.nn.Module with the recording"
    assert "__getattribute__" not in torch.nn.Module.__dict__


CHANGES = {
    "shift": lambda m: setattr(m, "shift", 5.0),
    "extra": lambda m: setattr(m, "extra", 2.0),
    "proj.weight": lambda m: setattr(m.proj, "weight", torch.nn.Parameter(torch.randn(4, 4))),
    "proj": lambda m: setattr(m, "proj", torch.nn.Linear(4, 4)),
    "drop.training": lambda m: m.train(),
}


@pytest.mark.parametrize("where", CHANGES)
def test_the_watch_sees_each_kind_of_change(where):
    model = Shifted().eval()
    watch = StateWatch()
    watch.add("sig", _recorded(model, torch.randn(2, 4)).reads)
    model.shift = 1.0  # the same value again: no change
    assert watch.changes() == []
    CHANGES[where](model)
    found = {w.where: w for w in watch.changes()}
    assert where in found, list(found)
    assert watch.readers(found[where]) == {"sig"}


def test_a_value_read_as_none_is_watched_like_any_other():
    model = Shifted().eval()
    model.extra = None  # read as None (set, unlike an absent name)
    watch = StateWatch()
    watch.add("sig", _recorded(model, torch.randn(2, 4)).reads)
    assert watch.changes() == []
    model.extra = 2.0
    assert [w.describe_change() for w in watch.changes()] == ["extra: None -> 2.0"]
    model.extra = None
    assert watch.changes() == []
    del model.extra
    assert [w.describe_change() for w in watch.changes()] == ["extra: None -> deleted"]


def _float8_weight(seed: int) -> torch.nn.Parameter:
    float8 = pytest.importorskip("torchao.quantization.quantize_.workflows")
    from torchao.quantization import PerRow

    weight = torch.randn(4, 4, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    tensor = float8.Float8Tensor.from_hp(weight, float8_dtype=torch.float8_e4m3fn, granularity=PerRow())
    return torch.nn.Parameter(tensor, requires_grad=False)


def test_a_quantized_weights_inner_tensors_are_watched():
    # A torchao Float8Tensor has no storage of its own (its data_ptr() is 0): a graph reads its inner
    # qdata and scale, so assigning one is a change, which a check of data_ptr() alone never saw.
    model = Shifted().eval().to(torch.bfloat16)
    model.proj.weight = _float8_weight(0)
    watch = StateWatch()
    watch.add("sig", _recorded(model, torch.randn(2, 4, dtype=torch.bfloat16)).reads)
    assert watch.changes() == []
    with torch.no_grad():
        model.proj.weight.qdata.copy_(_float8_weight(1).qdata)  # in place: the graph reads the new values
    assert watch.changes() == []
    model.proj.weight.qdata = _float8_weight(2).qdata
    assert [w.describe_change() for w in watch.changes()] == ["proj.weight: replaced"]


def test_weights_written_in_place_are_no_change():
    model = Shifted()
    watch = StateWatch()
    watch.add("sig", _recorded(model, torch.randn(2, 4)).reads)
    with torch.no_grad():
        model.proj.weight.mul_(2)
    assert watch.changes() == []


def test_a_mutable_list_a_constant_was_built_from_is_watched():
    data = [0.0, 1.0]
    recorder = ReadRecorder({})
    recorder.add_data("the data of torch.tensor", data)
    watch = StateWatch()
    watch.add("sig", recorder.reads)
    assert watch.changes() == []
    data[1] = 5.0
    assert [w.describe_change() for w in watch.changes()] == [
        "the data of torch.tensor: [0.0, 1.0] -> [0.0, 5.0] (changed in place)"
    ]


def test_compiled_regions_run_with_the_hook_off_and_are_counted():
    model = Shifted()
    recorder = ReadRecorder({id(m): (name, m) for name, m in model.named_modules()})
    seen = []
    with recorder.recording():
        call_untracked(lambda: seen.append("__getattribute__" in torch.nn.Module.__dict__))
        seen.append("__getattribute__" in torch.nn.Module.__dict__)
    assert seen == [False, True] and recorder.paused == 1
    with paused() as active:
        assert active is False  # no recorder: nothing to pause


@pytest.fixture
def zimage():
    pipe = build_pipeline("z-image", "tiny", device="cpu")
    pipe.set_progress_bar_config(disable=True)
    layer = pipe.transformer.layers[0]
    layer.shift = 0.0

    def hook(module, args, output):
        return output + 0.05 * module.shift

    handle = layer.register_forward_hook(hook)
    yield pipe
    handle.remove()


def _call(pipe, prompt="a red fox", size=32):
    return pipe(
        prompt,
        height=size,
        width=size,
        num_inference_steps=3,
        guidance_scale=0.0,
        generator=torch.Generator("cpu").manual_seed(0),
        output_type="latent",
    ).images


def test_a_changed_module_attribute_drops_the_graphs_that_read_it_once_per_call(zimage, caplog):
    pipe = zimage
    accelerate(pipe, debug=True)
    try:
        _call(pipe)
        before = assert_graphs_ran(pipe, captures=True)
        # step 1 captured; step 2 found the watch filled, checked it, and step 3 did not check again
        assert before["components"]["transformer"]["state_checks"] == 1
        _call(pipe)
        after = assert_graphs_ran(pipe, before, captures=False)
        assert after["components"]["transformer"]["state_checks"] == 2  # three transformer calls, one check
        assert after["components"]["transformer"]["state_changes"] == 0
        [record] = [s for s in after["signatures"] if s["component"] == "transformer"]
        assert record["watched"] > 0

        pipe.transformer.layers[0].shift = 5.0
        with caplog.at_level(logging.INFO, logger="bcg_diffusion"):
            changed = _call(pipe)
        final = assert_graphs_ran(pipe, after, captures=True)
        assert final["components"]["transformer"]["state_changes"] == 1
        assert final["components"]["vae"]["state_changes"] == 0, "the VAE read nothing that changed"
        assert "layers.0.shift: 0.0 -> 5.0 since its capture" in caplog.text
    finally:
        restore(pipe)
    assert torch.equal(changed, _call(pipe)), "equal to eager with the new value"


def test_invalidate_drops_every_graph_and_the_next_call_captures(zimage):
    pipe = zimage
    accelerate(pipe, debug=True)
    try:
        _call(pipe)
        before = stats(pipe)
        invalidate(pipe)
        assert not stats(pipe)["signatures"]
        _call(pipe)
        assert_graphs_ran(pipe, before, captures=True)
    finally:
        restore(pipe)
    with pytest.raises(ValueError, match="not accelerated"):
        invalidate(pipe)


def test_a_component_called_outside_a_pipeline_call_checks_at_every_call():
    model = Shifted().eval()
    runner = GraphRunner(model.forward, name="model", pool=None, lock=threading.RLock(), debug=True, module=model)
    x = torch.randn(2, 4)
    with torch.no_grad():
        runner(x)
        runner(x)
        runner(x)
        assert runner.counters.state_checks == 2
        with call_scope():
            runner(x)
            runner(x)
        assert runner.counters.state_checks == 3
        model.shift = 2.0
        out = runner(x)
        assert runner.counters.state_changes == 1 and runner.counters.captures == 2
        assert torch.equal(out, model(x))
