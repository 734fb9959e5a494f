"""Automatic eager breaks on the CPU: which operations become breaks, what they record, how a break's
host results are checked, module breaks, and the capture's dispatch mode routing ops to breaks (with a
stand-in for the capture; the real captures are in ``test_auto_breaks_cuda.py``)."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch

from bcg_diffusion.core import graphs
from bcg_diffusion.core.auto_breaks import (
    LEARNED,
    AutoBreaker,
    OpBreak,
    module_breaks,
    modules_to_break,
    refused_by_capture,
)
from bcg_diffusion.core.hostile import HostileOp, classify
from bcg_diffusion.core.python_data import KIND, PythonDataConstants
from bcg_diffusion.core.runner import GraphRunner

aten = torch.ops.aten


class FakeCapture:
    """Stands in for graphs._BreakableCapture: runs each break at once and notes it."""

    def __init__(self):
        self.breaks = []

    def run_break(self, fn, args, kwargs):
        self.breaks.append(fn)
        return fn(*args, **kwargs)


def test_copies_are_judged_by_their_arguments_before_they_run():
    pageable = torch.ones(4)
    to_gpu = classify(aten._to_copy.default, (pageable,), {"device": torch.device("cuda")}, ran=False)
    assert to_gpu == "copy from host memory"
    assert classify(aten._to_copy.default, (pageable,), {"dtype": torch.float16}, ran=False) is None  # stays on CPU


def test_the_breaker_wants_host_syncs_dynamic_shapes_and_learned_ops_only():
    breaker = AutoBreaker(None, learned={"aten.mm.default"}, device_type="cpu")  # CPU tensors stand for GPU ones
    x = torch.ones(3)
    assert breaker.wants(aten._local_scalar_dense.default, (x,), {}) == "host sync"
    assert breaker.wants(aten.nonzero.default, (x,), {}) == "data-dependent shape"
    assert breaker.wants(aten.index.Tensor, (x, [x > 0]), {}) == "data-dependent shape"
    assert breaker.wants(aten.mm.default, (x, x), {}) == LEARNED
    assert breaker.wants(aten.add.Tensor, (x, x), {}) is None
    assert breaker.wants(aten.lift_fresh.default, (x,), {}) is None  # a CPU op: its copy is what breaks
    assert AutoBreaker(None).wants(aten._local_scalar_dense.default, (x,), {}) is None  # host work, in a GPU capture


def test_a_host_result_joins_the_break_spec_and_in_place_ops_return_their_target():
    step = OpBreak(aten._to_copy.default)
    source = torch.tensor([1.0, 2.0])
    out, host = step(source, dtype=torch.float16)
    assert torch.equal(out, source.half()) and host == (source.half().view(torch.uint8).numpy().tobytes(),)
    assert step(torch.tensor([1.0, 3.0]), dtype=torch.float16)[1] != host  # another value: another spec
    in_place = OpBreak(aten.copy_.default)
    target = torch.zeros(2)
    result, written = in_place(target, source)  # a copy into host memory: its contents are checked too
    assert in_place.mutates and result is None and torch.equal(target, source)
    assert written == (source.view(torch.uint8).numpy().tobytes(),)


class Inner(torch.nn.Module):
    def forward(self, x, breaker, capture):
        return breaker.run(capture, aten._local_scalar_dense.default, (x.sum(),), {}, "host sync")


class Outer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Inner()

    def forward(self, x, breaker, capture):
        return self.inner(x, breaker, capture)


def test_a_break_records_its_op_module_and_line_once():
    model = Outer()
    breaker, capture = AutoBreaker(model), FakeCapture()
    values = [model(torch.full((2,), 3.0), breaker, capture) for _ in range(2)]
    assert values == [6.0, 6.0] and len(capture.breaks) == 2
    [site] = breaker.made
    assert (site.op, site.kind, site.module) == ("aten._local_scalar_dense.default", "host sync", "inner")
    assert site.where.startswith("test_auto_breaks.py:") and site.where.endswith("in forward")


def test_the_capture_mode_sends_hostile_ops_to_breaks_and_notes_a_failing_op():
    breaker, capture = AutoBreaker(None, device_type="cpu"), FakeCapture()
    tracker = graphs._ExternalTensorTracker(capture_stream=None, breaker=breaker)
    token = graphs._ACTIVE.set(capture)
    try:
        with tracker:
            tracker.recording = True
            x = torch.arange(6.0)
            total = x.sum().item()
            where = torch.nonzero(x > 2)
            shifted = x + 1
            with pytest.raises(RuntimeError):
                torch.mm(x, x)  # 1-D: refused; noted as the op that failed while recorded
    finally:
        graphs._ACTIVE.reset(token)
    assert total == 15.0 and where.shape == (3, 1) and torch.equal(shifted, torch.arange(1.0, 7.0))
    assert [step.func for step in capture.breaks] == [aten._local_scalar_dense.default, aten.nonzero.default]
    assert breaker.failed_op == "aten.mm.default"


def test_module_breaks_wrap_forward_for_their_duration_and_put_it_back():
    model = Outer()
    own = model.inner.forward
    model.inner.forward = own  # an instance attribute set by someone else: kept
    with module_breaks(model, ["inner"]):
        assert getattr(model.inner.forward, "__bcg_eager_break__", False)
        assert model.inner.forward.__wrapped__ == own
    assert model.inner.forward is own
    del model.inner.forward
    with module_breaks(model, ["inner"]):
        pass
    assert "forward" not in model.inner.__dict__


def test_only_modules_that_build_gpu_tensors_from_python_data_become_breaks():
    found = [
        HostileOp("aten.lift_fresh.default", "tensor from Python data", "embed", "m.py:1 in f", on_gpu=True),
        HostileOp("aten.lift_fresh.default", "tensor from Python data", "rope", "m.py:2 in f", on_gpu=False),
        HostileOp("aten.lift_fresh.default", "tensor from Python data", "", "m.py:3 in forward", on_gpu=True),
    ]
    assert modules_to_break(found) == ["embed"]  # not the CPU one, not the root


def test_only_cuda_refusals_teach_a_break():
    assert refused_by_capture(RuntimeError("CUDA error: operation not permitted when stream is capturing"))
    assert not refused_by_capture(torch.OutOfMemoryError("CUDA out of memory during capture"))
    assert not refused_by_capture(ValueError("a bug of the model"))


class HostRead(torch.nn.Module):
    def forward(self, x):
        return x * float(x.sum().item())


@pytest.mark.parametrize("auto_breaks", [True, False])
def test_debug_mode_lists_the_breaks_a_capture_would_make(auto_breaks):
    # Debug mode records the forward as a capture would: with automatic breaks the host read becomes one; without
    # them the recording refuses it, as CUDA refuses it inside a capture, and the signature runs eagerly.
    model = HostRead()
    runner = GraphRunner(
        model.forward, name="toy", pool=None, lock=threading.RLock(), debug=True, module=model, auto_breaks=auto_breaks
    )
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        x = torch.tensor([1.0, 2.0, 3.0, 4.0])
        for inputs in (x, x.flip(0)):  # the capture, then a replay whose host read gives the same sum
            assert torch.equal(runner(inputs), inputs * float(inputs.sum()))
    [record] = runner.records()
    if auto_breaks:
        assert record.hostile_ops and record.hostile_ops[0].startswith("aten._local_scalar_dense.default (host sync)")
        assert record.auto_breaks == record.hostile_ops and record.breaks == 1
        assert runner.counters.replays == 1 and not caught
    else:
        assert record.status == "failed" and "aten._local_scalar_dense.default (host sync)" in record.reason
        assert runner.counters.eager_fallbacks == 2
        assert any("runs eagerly" in str(w.message) for w in caught)


class BuildsFromPython(torch.nn.Module):
    """Builds a tensor from a Python list on its input's device, as Qwen-Image Edit Plus's forward does
    with ``img_shapes``; ``counter`` makes the list change every call (no constant)."""

    def __init__(self, counter: bool = False):
        super().__init__()
        self.counter, self.calls = counter, 0

    def forward(self, x):
        self.calls += 1
        data = [self.calls] * 3 if self.counter else [[0] * 2 + [1] * 1 for _ in range(x.shape[0])]
        return x + torch.tensor(data, device=x.device, dtype=x.dtype) + x.new_tensor(2.0)


def test_tensors_from_python_data_are_recorded_then_served_as_copies_of_the_warm_up():
    model = BuildsFromPython()
    constants = PythonDataConstants({id(model): ""}, device_type="cpu")  # CPU tensors stand for GPU ones
    x = torch.randn(2, 3)
    for _ in range(2):
        with constants.recording():
            expected = model(x)
    with constants.serving():
        served = model(x)
    assert torch.equal(served, expected) and not constants.unstable
    assert [site.op for site in constants.served] == ["torch.tensor", "Tensor.new_tensor"]
    assert all(site.kind == KIND and "test_auto_breaks.py:" in site.where for site in constants.served)
    assert len(constants.kept) == 2  # the first warm-up's tensors, which the graph copies from


def test_a_served_tensor_is_a_copy_so_changes_in_place_stay_in_one_call():
    constants = PythonDataConstants(device_type="cpu")
    with constants.recording():
        torch.tensor([1.0, 2.0], device="cpu")
    with constants.serving():
        served = torch.tensor([1.0, 2.0], device="cpu")
    served.add_(1)
    [kept] = constants.kept
    assert torch.equal(kept, torch.tensor([1.0, 2.0])) and served.data_ptr() != kept.data_ptr()


class ChangesItsConstantInPlace(torch.nn.Module):
    """Builds a tensor from Python data and then changes it in place before using it."""

    def forward(self, x):
        ids = torch.tensor([0.0, 1.0, 2.0], device=x.device, dtype=x.dtype)
        ids += 10
        return x + ids


def test_a_constant_changed_in_place_by_the_forward_is_served_as_it_was_built():
    # The graph copies the constant from a tensor the warm-up built; the forward then changed that
    # very tensor in place, so the capture served [20, 21, 22] where eager builds [10, 11, 12].
    model = ChangesItsConstantInPlace()
    constants = PythonDataConstants(device_type="cpu")
    x = torch.zeros(3)
    for _ in range(2):
        with constants.recording():
            expected = model(x)
    with constants.serving():
        served = model(x)
    assert torch.equal(expected, torch.tensor([10.0, 11.0, 12.0]))
    assert torch.equal(served, expected) and not constants.unstable
    with constants.serving():  # a second capture attempt (the runner retries once) is served the same
        assert torch.equal(model(x), expected)


def test_a_value_that_changes_between_warm_ups_is_no_constant():
    model = BuildsFromPython(counter=True)
    constants = PythonDataConstants(device_type="cpu")
    x = torch.randn(3)
    for _ in range(2):
        with constants.recording():
            model(x)
    with constants.serving():
        out = model(x)  # built as written (on a GPU the capture refuses it; the runner breaks its module)
    assert torch.equal(out, x + 3 + 2) and [site.op for site in constants.unstable] == ["torch.tensor"]
    assert [site.op for site in constants.served] == ["Tensor.new_tensor"]  # 2.0 is the same every call


def test_only_python_data_built_on_the_capture_device_is_held():
    constants = PythonDataConstants(device_type="cuda")
    with constants.recording():
        torch.tensor([1, 2])  # built on the CPU: a later copy to the GPU is a one-operation break
        torch.as_tensor(torch.ones(2))  # from a tensor: a dispatched copy
    assert constants._runs == [[]]


def test_compiled_regions_run_without_the_constants_mode():
    from torch._dynamo.utils import counters
    from torch.overrides import _get_current_function_mode

    constants = PythonDataConstants(device_type="cpu")
    seen = []
    with constants.recording():
        graphs.call_untracked(lambda: seen.append(_get_current_function_mode()))
        seen.append(_get_current_function_mode())
    assert seen == [None, constants]
    # torch.compile guards on the mode stack: with the mode paused, warm-ups and captures reuse the
    # blocks compiled for plain calls instead of compiling them again
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(lambda x: torch.sin(x) * 2, backend="eager")
    x = torch.randn(4)
    compiled(x)
    with constants.recording():
        graphs.call_untracked(compiled, x)
    assert counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()
