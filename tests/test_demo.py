"""The demo's handlers (``bcg_diffusion.demo``) on the tiny pipelines, on CPU: no browser, no server."""

from __future__ import annotations

import logging
import threading

import numpy as np
import pytest
import torch

from bcg_diffusion import demo
from bcg_diffusion.demo import (
    ACCELERATED_ONLY,
    SIDE_BY_SIDE,
    DemoBackend,
    DemoError,
    GenerationRequest,
    parse_resolution,
)
from bcg_diffusion.loading import build_pipeline

gr = pytest.importorskip("gradio")


def request(pipeline: str = "z-image", **changes) -> GenerationRequest:
    values = {
        "prompt": "a red fox in the snow",
        "pipeline": pipeline,
        "width": 64,
        "height": 64,
        "steps": 2,
        "guidance": 4.0 if pipeline == "qwen-image" else 0.0,
        "seed": 0,
        "mode": SIDE_BY_SIDE,
    }
    values.update(changes)
    return GenerationRequest(**values)


def pixels(image) -> np.ndarray:
    return np.asarray(image)


@pytest.fixture(scope="module")
def backend():
    backend = DemoBackend("tiny", "cpu")
    yield backend
    backend.close()  # accelerate's function patches are process-wide: later test modules expect none


@pytest.fixture
def make_backend():
    """``DemoBackend(...)``, closed at the end of the test."""
    made: list[DemoBackend] = []

    def make(*args, **kwargs) -> DemoBackend:
        made.append(DemoBackend(*args, **kwargs))
        return made[-1]

    yield make
    for backend in made:
        backend.close()


@pytest.mark.parametrize("pipeline", ["z-image", "qwen-image"])
def test_side_by_side_gives_two_identical_images_labelled_not_meaningful_on_cpu(backend, pipeline):
    steps_seen = []
    result = backend.generate(request(pipeline, width=96, height=64), lambda *args: steps_seen.append(args))

    eager_image, accelerated_image, report = result.outputs()
    assert eager_image.size == accelerated_image.size == (96, 64)
    assert np.array_equal(pixels(eager_image), pixels(accelerated_image))
    assert result.identical is True
    assert result.eager_digest == result.accelerated_digest
    assert result.graphs == "debug" and not result.speed_meaningful
    assert result.eager_seconds > 0 and result.accelerated_seconds > 0 and result.speedup is not None
    assert result.cost.captures > 0 and result.cost.replays > 0 and result.cost.eager_fallbacks == 0
    assert result.cost.graph_memory_bytes == 0  # debug mode: no graph pool
    assert "not meaningful" in report and "byte-identical: yes" in report and "latency" in report
    # one report per denoising step of each call, plus each call's start (after "loading" on first use)
    assert [done for done, _, text in steps_seen if "step" in text] == [0, 1, 2, 2, 3, 4]
    assert {total for _, total, _ in steps_seen} == {4}
    assert steps_seen[-1][2] == "accelerated: step 2/2"
    assert [text for _, _, text in steps_seen if "step 0" in text] == ["eager: step 0/2", "accelerated: step 0/2"]


def test_same_settings_again_replays_without_new_captures(backend):
    first = backend.generate(request(width=80, height=80, seed=3))
    again = backend.generate(request(width=80, height=80, seed=3))
    assert first.cost.captures > 0 and again.cost.captures == 0 and again.cost.replays > 0
    assert np.array_equal(pixels(first.accelerated_image), pixels(again.accelerated_image))


def test_accelerated_only_runs_one_call(backend):
    steps_seen = []
    result = backend.generate(request(mode=ACCELERATED_ONLY, steps=3), lambda *args: steps_seen.append(args))
    eager_image, accelerated_image, report = result.outputs()
    assert eager_image is None and result.eager_seconds is None and result.identical is None
    assert accelerated_image.size == (64, 64)
    assert "not run" in report and "not meaningful" in report and "byte-identical" not in report
    assert [done for done, total, _ in steps_seen] == [0, 1, 2, 3] and steps_seen[-1][1] == 3


def test_accelerated_image_equals_a_plain_eager_pipeline(make_backend):
    reference = build_pipeline("z-image", "tiny")
    reference.set_progress_bar_config(disable=True)
    expected = reference(**request().pipeline_kwargs()).images
    result = make_backend("tiny", "cpu", pipelines=["z-image"]).generate(request(mode=ACCELERATED_ONLY))
    assert np.array_equal(pixels(result.accelerated_image), pixels(demo._to_pil(expected)))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("500x512", "multiple of 16"),
        ("512x8", "too small"),
        ("0x512", "too small"),
        ("4096x512", "too large"),
        ("big", "not WIDTHxHEIGHT"),
        ("", "not WIDTHxHEIGHT"),
    ],
)
def test_bad_resolution_is_a_clear_error(text, message):
    with pytest.raises(DemoError, match=message):
        parse_resolution(text, max_side=2048)


def test_resolution_forms():
    assert parse_resolution("512x768", 2048) == (512, 768)
    assert parse_resolution(" 768 × 512 ", 2048) == (768, 512)
    assert parse_resolution("256", 2048) == (256, 256)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"width": 100}, "multiple of 16"),
        ({"height": 4096}, "too large"),
        ({"pipeline": "flux"}, "not served here"),
        ({"prompt": "  "}, "type a prompt"),
        ({"steps": 0}, "steps must be between"),
        ({"pipeline": "qwen-image", "steps": 1}, "steps must be between 2"),
        ({"guidance": -1.0}, "guidance must be between"),
        ({"seed": -5}, "seed must be between"),
        ({"mode": "both"}, "mode"),
    ],
)
def test_bad_requests_are_refused_before_running(backend, changes, message):
    with pytest.raises(DemoError, match=message):
        backend.generate(request(**changes))


def test_gradio_handler_turns_errors_into_gradio_errors(backend):
    handler = demo.gradio_handler(backend)
    args = ["a red fox", "", "z-image", "64x64", 2, 0.0, 0, SIDE_BY_SIDE]
    eager_image, accelerated_image, report = handler(*args, progress=lambda *a, **k: None)
    assert eager_image is not None and accelerated_image is not None and "byte-identical: yes" in report

    for index, value, message in [(3, "1000x1000", "multiple of 16"), (0, "", "prompt"), (4, None, "steps")]:
        bad = list(args)
        bad[index] = value
        with pytest.raises(gr.Error, match=message):
            handler(*bad, progress=lambda *a, **k: None)


def test_unloadable_model_is_a_clear_error(make_backend):
    backend = make_backend("./no-such-checkpoint", "cpu", pipelines=["z-image"])
    with pytest.raises(DemoError, match="failed loading z-image from './no-such-checkpoint': FileNotFoundError"):
        backend.generate(request())


def test_unsupported_model_is_a_clear_error(make_backend):
    backend = make_backend("tiny", "cpu", pipelines=["z-image"], builder=lambda *args, **kwargs: object())
    with pytest.raises(DemoError, match="unsupported model"):
        backend.generate(request())


def test_close_restores_the_pipelines(make_backend):
    backend = make_backend("tiny", "cpu", pipelines=["qwen-image"])
    pipe = backend.pipeline("qwen-image")
    assert "forward" in pipe.transformer.__dict__  # accelerated
    backend.close()
    assert "forward" not in pipe.transformer.__dict__ and "decode" not in pipe.vae.__dict__
    assert backend.generate(request("qwen-image", mode=ACCELERATED_ONLY)).accelerated_image.size == (64, 64)


def test_checkpoint_needs_one_pipeline():
    with pytest.raises(ValueError, match="one pipeline"):
        DemoBackend("Tongyi-MAI/Z-Image-Turbo", "cpu")


def _failing_builder(error: BaseException):
    def build(*args, **kwargs):
        pipe = build_pipeline(*args, **kwargs)

        def encode_prompt(*_, **__):
            raise error

        pipe.encode_prompt = encode_prompt
        return pipe

    return build


def test_out_of_memory_is_a_clear_error_and_the_backend_survives(make_backend, caplog):
    error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
    backend = make_backend("tiny", "cpu", pipelines=["z-image"], builder=_failing_builder(error))
    expected = "out of memory generating with z-image at 64x64"
    with caplog.at_level(logging.ERROR, logger="bcg_diffusion.demo"), pytest.raises(DemoError, match=expected) as info:
        backend.generate(request())
    assert "Traceback" not in str(info.value)
    assert any(record.exc_info for record in caplog.records)  # the traceback goes to the log
    with pytest.raises(DemoError, match="out of memory"):  # the lock was released: a second request runs
        backend.generate(request())


def test_unexpected_failure_is_a_short_message_and_logged(make_backend, caplog):
    backend = make_backend("tiny", "cpu", pipelines=["z-image"], builder=_failing_builder(RuntimeError("boom")))
    expected = r"RuntimeError: boom \(details in the server log\)"
    with caplog.at_level(logging.ERROR, logger="bcg_diffusion.demo"), pytest.raises(DemoError, match=expected):
        backend.generate(request())
    assert any(record.exc_info for record in caplog.records)


def test_concurrent_requests_give_the_same_images_as_serial_ones(make_backend):
    backend = make_backend("tiny", "cpu")
    requests = [
        request("z-image", seed=1),
        request("z-image", seed=1),
        request("qwen-image", seed=2),
        request("z-image", seed=3, mode=ACCELERATED_ONLY),
    ]
    serial = [backend.generate(r) for r in requests]

    barrier = threading.Barrier(len(requests))
    results: list = [None] * len(requests)
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            barrier.wait()
            results[index] = backend.generate(requests[index])
        except BaseException as exc:  # reported below: an exception in a thread would otherwise vanish
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(requests))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    for got, expected in zip(results, serial):
        assert np.array_equal(pixels(got.accelerated_image), pixels(expected.accelerated_image))
        if expected.eager_image is not None:
            assert got.identical is True
            assert np.array_equal(pixels(got.eager_image), pixels(expected.eager_image))


def test_warm_up_reports_progress_and_pre_captures(make_backend):
    backend = make_backend("tiny", "cpu")
    seen = []
    outcomes = backend.warm_up([(64, 64), (32, 48)], on_progress=lambda *args: seen.append(args))
    assert [(done, total) for done, total, _ in seen] == [(i, 6) for i in range(1, 7)]
    assert all(step.ok for step in outcomes) and len(outcomes) == 6
    assert "32x48" in seen[-1][2]
    # the page's default prompt at a warmed-up resolution replays at once
    for pipeline in backend.pipelines:
        result = backend.generate(request(pipeline, prompt=demo.DEFAULT_PROMPT, mode=ACCELERATED_ONLY))
        assert result.cost.captures == 0 and result.cost.replays > 0


def test_warm_up_goes_on_after_a_failure(make_backend):
    backend = make_backend("./no-such-checkpoint", "cpu", pipelines=["z-image"])
    seen = []
    outcomes = backend.warm_up([(64, 64)], on_progress=lambda *args: seen.append(args))
    assert [step.ok for step in outcomes] == [False, False]
    assert [(done, total) for done, total, _ in seen] == [(1, 2), (2, 2)]
    assert "FileNotFoundError" in seen[0][2]


def test_warm_up_in_background_updates_its_status(make_backend):
    backend = make_backend("tiny", "cpu", pipelines=["z-image"])
    seen = []
    status, thread = demo.warm_up_in_background(backend, [(64, 64)], on_progress=lambda *args: seen.append(args))
    assert status.total == 2
    thread.join(timeout=120)
    assert status.finished and status.done == 2 and len(seen) == 2
    assert status.markdown().startswith("Warm-up done (2/2 steps)")


def test_warm_up_status_tells_failures(make_backend):
    backend = make_backend("./no-such-checkpoint", "cpu", pipelines=["z-image"])
    status, thread = demo.warm_up_in_background(backend, [(64, 64)])
    thread.join(timeout=120)
    assert status.finished and status.failures
    assert "2 of 2 steps failed" in status.markdown() and "FileNotFoundError" in status.markdown()
