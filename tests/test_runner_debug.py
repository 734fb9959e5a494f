"""The runner path in debug mode (no graphs): signatures, static buffers, clones and counters, on CPU."""

from __future__ import annotations

import threading

import pytest
import torch

from bcg_diffusion import BCGWarning, eager_break
from bcg_diffusion.core.runner import GraphRunner


def make_runner(fn, **kwargs):
    return GraphRunner(fn, name="toy", pool=None, lock=threading.RLock(), debug=True, **kwargs)


def test_capture_then_replay_per_signature():
    calls = []

    def fn(x, scale, mask=None):
        calls.append(x.shape)
        out = x * scale
        return out if mask is None else out * mask

    runner = make_runner(fn)
    with torch.no_grad():
        x = torch.randn(3, 4)
        assert torch.equal(runner(x, 2.0), x * 2.0)
        y = torch.randn(3, 4)
        assert torch.equal(runner(y, 2.0), y * 2.0)
        assert torch.equal(runner(y, 3.0), y * 3.0)  # a new Python constant: a new signature
        mask = torch.rand(3, 4)
        assert torch.equal(runner(y, 2.0, mask=mask), y * 2.0 * mask)
    assert runner.counters.captures == 3 and runner.counters.replays == 1
    assert [r.status for r in runner.records()] == ["debug"] * 3


def test_outputs_never_alias_the_static_buffers():
    runner = make_runner(lambda x: (x + 1, [x * 2]))
    with torch.no_grad():
        a, b = torch.zeros(4), torch.ones(4)
        first = runner(a)
        second = runner(b)
    assert torch.equal(first[0], a + 1) and torch.equal(first[1][0], a * 2)
    assert torch.equal(second[0], b + 1)
    assert first[0].data_ptr() != second[0].data_ptr()


def test_inputs_are_copied_not_held():
    runner = make_runner(lambda x: x * 2)
    with torch.no_grad():
        x = torch.ones(4)
        runner(x)
        x.fill_(5)  # the caller reuses its tensor; the runner works on its own buffer
        assert torch.equal(runner(torch.full((4,), 3.0)), torch.full((4,), 6.0))


def test_expanded_inputs_get_a_dense_buffer():
    runner = make_runner(lambda t: t * 2)
    with torch.no_grad():
        t = torch.tensor(0.5).expand(4)
        assert torch.equal(runner(t), torch.ones(4))
        assert torch.equal(runner(torch.tensor(1.5).expand(4)), torch.full((4,), 3.0))


def test_breaks_are_plain_calls_outside_capture():
    @eager_break
    def host_value(x):
        return x * float(x.sum().item())

    runner = make_runner(lambda x: host_value(x) + 1)
    with torch.no_grad():
        x = torch.randn(5)
        assert torch.equal(runner(x), host_value(x) + 1)
        assert torch.equal(runner(x * 2), host_value(x * 2) + 1)
    assert host_value.__wrapped__.__name__ == "host_value"


def test_unsupported_input_runs_eagerly_with_one_warning():
    runner = make_runner(lambda x, gen: x + torch.rand(x.shape, generator=gen))
    with torch.no_grad(), pytest.warns(BCGWarning, match="runs eagerly"):
        runner(torch.zeros(2), torch.Generator().manual_seed(0))
        runner(torch.zeros(2), torch.Generator().manual_seed(0))
    assert runner.counters.eager_fallbacks == 2 and runner.counters.captures == 0


def test_grad_mode_runs_eagerly():
    runner = make_runner(lambda x: x * 2)
    with pytest.warns(BCGWarning, match="autograd"):
        assert torch.equal(runner(torch.ones(2)), torch.full((2,), 2.0))
    assert runner.counters.captures == 0


def test_errors_of_the_callable_propagate_and_are_not_cached():
    def fn(x):
        if x.shape[0] == 3:
            raise ValueError("bad shape from the model")
        return x

    runner = make_runner(fn)
    with torch.no_grad():
        with pytest.raises(ValueError, match="bad shape"):
            runner(torch.zeros(3))
        assert runner.records() == []
        runner(torch.zeros(2))
    assert runner.counters.captures == 1


def test_state_key_splits_signatures():
    state = {"tiling": False}
    runner = make_runner(lambda x: x + 1, state_key=lambda: state["tiling"])
    with torch.no_grad():
        runner(torch.zeros(2))
        state["tiling"] = True
        runner(torch.zeros(2))
    assert runner.counters.captures == 2


def test_closed_runner_is_a_plain_call():
    runner = make_runner(lambda x: x + 1)
    with torch.no_grad():
        runner(torch.zeros(2))
        runner.close()
        assert torch.equal(runner(torch.zeros(2)), torch.ones(2))
    assert runner.counters.replays == 0 and runner.records() == []


def test_output_dataclasses_with_none_fields_are_rebuilt():
    from diffusers.models.autoencoders.vae import DecoderOutput

    runner = make_runner(lambda x: DecoderOutput(sample=x * 2, commit_loss=None))
    with torch.no_grad():
        runner(torch.zeros(2))
        out = runner(torch.ones(2))
    assert (
        isinstance(out, DecoderOutput) and out.commit_loss is None and torch.equal(out.sample, torch.full((2,), 2.0))
    )


def test_zero_dim_and_empty_tensors():
    runner = make_runner(lambda t, e: (t * 2, e + 1))
    with torch.no_grad():
        runner(torch.tensor(1.0), torch.empty(0, 3))
        scalar, empty = runner(torch.tensor(4.0), torch.empty(0, 3))
    assert scalar.item() == 8.0 and empty.shape == (0, 3)
    assert runner.counters.replays == 1


def test_a_new_signature_is_explained(caplog):
    runner = make_runner(lambda x, mask=None: x if mask is None else x * mask)
    with torch.no_grad(), caplog.at_level("INFO", logger="bcg_diffusion.core.runner"):
        runner(torch.zeros(1, 11))
        runner(torch.zeros(1, 20), mask=torch.ones(1, 20))
    lines = [r.getMessage() for r in caplog.records if "new signature" in r.getMessage()]
    assert len(lines) == 1
    assert "arg 0: float32[1x11] on cpu -> float32[1x20] on cpu" in lines[0]
    assert "keyword arguments: {} -> {mask: float32[1x20]}" in lines[0]


def test_debug_mode_logs_a_debug_run_not_an_empty_capture(caplog):
    runner = make_runner(lambda x: x * 2)
    with torch.no_grad(), caplog.at_level("INFO", logger="bcg_diffusion.core.runner"):
        runner(torch.zeros(3))
    lines = [r.getMessage() for r in caplog.records if r.name == "bcg_diffusion.core.runner"]
    assert any("toy: debug mode recorded" in line and "(no graph; replayed as: record)" in line for line in lines), (
        lines
    )
    assert not any("segments" in line or "MiB" in line for line in lines), lines
