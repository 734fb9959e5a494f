"""The demo's handlers (``bcg_diffusion.demo``) on the tiny pipelines, on CPU: no browser, no server."""

from __future__ import annotations

import logging
import threading
import types

import numpy as np
import pytest
import torch
from _checks import needs_compiler

from bcg_diffusion import stats
from bcg_diffusion.demo import (
    ACCELERATED_ONLY,
    ACCELERATIONS,
    SIDE_BY_SIDE,
    Acceleration,
    DemoBackend,
    DemoError,
    GenerationRequest,
    parse_resolution,
)
from bcg_diffusion.demo import session as demo
from bcg_diffusion.models import build_pipeline

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
    assert result.max_difference == 0.0 and result.request.acceleration == "exact"
    assert "; exact mode; " in report and "| | eager | accelerated (exact) |" in report  # which mode ran
    assert "own reference" not in report  # exact mode: compared with eager itself
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


def test_a_first_request_says_what_it_cost_and_shows_a_speed_up_only_when_warm(backend):
    first = backend.generate(request(width=112, height=48, seed=5))  # a new signature: it captures
    again = backend.generate(request(width=112, height=48, seed=5))
    assert first.cost.captures > 0 and not first.warm and again.cost.captures == 0 and again.warm
    report = first.report_markdown()
    assert report.startswith("### First call at these settings: ") and "of one-off work (capture " in report
    assert "Speed-up" not in report and "byte-identical: yes" in report.splitlines()[0]
    assert "Generate again with the same settings for the speed-up" in report
    assert again.report_markdown().startswith("### Speed-up ")
    only = backend.generate(request(width=112, height=64, mode=ACCELERATED_ONLY))
    assert only.report_markdown().startswith("### Accelerated: ") and "first call: capture " in only.report_markdown()


def _fast_result(**changes) -> demo.GenerationResult:
    """Fast mode's first request as issue 35 saw it on the GPU: the compile fell in the reference call."""
    image = demo._to_pil(torch.zeros(1, 3, 16, 16))
    values = {
        "request": request(acceleration="fast"),
        "device": "cuda:0",
        "graphs": "cuda graphs",
        "accelerated_image": image,
        "accelerated_seconds": 0.116,
        "accelerated_digest": "abc",
        "cost": demo.GraphCost(4, 10, 0, 0.05, 2**20, 2**20, compiles=2, compile_seconds=3.5),
        "eager_image": image,
        "eager_seconds": 3.686,
        "eager_digest": "abc",
        "identical": True,
        "max_difference": 0.0,
        "reference_compiles": 2,
        "reference_compile_seconds": 3.5,
    }
    return demo.GenerationResult(**{**values, **changes})


def test_fast_mode_first_request_puts_the_compile_in_the_first_call_not_in_a_speed_up():
    cold = _fast_result()
    report = cold.report_markdown()
    assert report.startswith(
        "### First call at these settings: 3.550 s of one-off work (compile 3.500 s, capture 0.050 s) · "
    ), report
    assert "Speed-up" not in report and "31.7" not in report
    assert "| latency | 3.686 s (incl. compile 3.500 s) | 0.116 s (incl. capture 0.050 s) |" in report
    assert "compiled the transformer's blocks (2 compile(s), 3.500 s, in fast mode's reference" in report
    warm = _fast_result(
        cost=demo.GraphCost(0, 10, 0, 0.0, 2**20, 0),
        eager_seconds=0.2,
        reference_compiles=0,
        reference_compile_seconds=0.0,
    )
    report = warm.report_markdown()
    assert report.startswith("### Speed-up 1.72x over fast mode's reference · byte-identical: yes"), report
    assert "| latency | 0.200 s | 0.116 s |" in report and "one-off" not in report


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
        ({"acceleration": "turbo"}, "mode 'turbo' is not one of exact, fast"),
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
    assert "exact mode" in handler(*args, "exact", progress=lambda *a, **k: None)[2]  # the page's mode selector
    with pytest.raises(gr.Error, match="mode 'turbo'"):
        handler(*args, "turbo", progress=lambda *a, **k: None)

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


def test_a_new_mode_is_one_more_entry_in_the_table(make_backend, monkeypatch):
    """A mode is an entry of ``ACCELERATIONS``: here Qwen-Image's text buckets (not byte-identical to eager:
    padded tokens round differently), served next to exact mode by one backend, each mode on its own
    accelerated copy of one built pipeline, sharing its weights; the report gives the difference, no verdict."""
    buckets = Acceleration(
        "buckets", types.MappingProxyType({"text_buckets": (64,)}), "prompts padded to 64 tokens", identical=False
    )
    monkeypatch.setattr(demo, "ACCELERATIONS", types.MappingProxyType({**ACCELERATIONS, "buckets": buckets}))
    backend = make_backend("tiny", "cpu", pipelines=["qwen-image"])
    assert backend.accelerations == ("exact", "fast", "buckets")
    exact = backend.generate(request("qwen-image"))
    padded = backend.generate(request("qwen-image", acceleration="buckets"))
    report = padded.report_markdown()
    assert padded.identical is not None and padded.max_difference is not None and padded.max_difference < 1e-3
    assert "largest difference from eager" in report and "nor meant to be" in report
    assert "byte-identical:" not in report  # no verdict where none is promised
    assert "; buckets mode; " in report and "| | eager | accelerated (buckets) |" in report
    assert np.array_equal(pixels(exact.eager_image), pixels(padded.eager_image))  # one eager reference
    plain, bucketed = backend.pipeline("qwen-image"), backend.pipeline("qwen-image", "buckets")
    assert plain.transformer is not bucketed.transformer and plain.vae is not bucketed.vae
    assert all(a is b for a, b in zip(plain.transformer.parameters(), bucketed.transformer.parameters(), strict=True))
    assert (stats(plain)["mode"], stats(bucketed)["mode"]) == ("exact", "exact")
    again = backend.generate(request("qwen-image"))  # back to exact: its graphs were kept, nothing rebuilt
    assert again.identical and again.cost.captures == 0 and again.cost.replays > 0
    assert backend.pipeline("qwen-image") is plain


def test_app_offers_each_mode_next_to_the_pipeline(backend):
    import app

    assert tuple(ACCELERATIONS) == app.ACCELERATIONS  # app.py names them before importing bcg_diffusion
    assert app.parse_args([]).mode == "exact" and app.parse_args(["--mode", "fast"]).mode == "fast"
    with pytest.raises(SystemExit):
        app.parse_args(["--mode", "turbo"])
    page = app.build_ui(backend, demo.WarmupStatus(), "z-image", default_acceleration="fast")
    components = {getattr(block, "elem_id", None): block for block in page.blocks.values()}
    selector = components["acceleration"]
    assert [value for _, value in selector.choices] == ["exact", "fast"] and selector.value == "fast"
    assert selector.parent is components["pipeline"].parent  # one row: pipeline, then mode
    assert components["eager-image"].label == "Fast mode's reference"
    generate = [fn for fn in page.fns.values() if components["report"] in fn.outputs]
    assert len(generate) == 1 and selector in generate[0].inputs


@pytest.mark.heavy  # compiles with inductor on CPU
@pytest.mark.filterwarnings("ignore:Torchinductor does not support code generation for complex operators")
@needs_compiler
def test_fast_mode_is_compared_with_its_compiled_reference(make_backend):
    """Fast mode's image equals fast mode's reference (its compiled blocks without graphs, inside
    ``bcg_diffusion.eager``), which the report names instead of eager; exact mode on the same backend keeps
    comparing with eager, on a pipeline of its own."""
    backend = make_backend("tiny", "cpu", pipelines=["z-image"])
    steps_seen = []
    fast = backend.generate(request(acceleration="fast"), lambda *args: steps_seen.append(args))
    report = fast.report_markdown()
    assert fast.identical is True and fast.max_difference == 0.0 and fast.eager_digest == fast.accelerated_digest
    assert fast.cost.compiles > 0 and fast.cost.captures > 0 and fast.cost.eager_fallbacks == 0
    assert "byte-identical: yes" in report and fast.reference_compiles > 0  # the reference ran the blocks first
    assert "; fast mode; " in report and "| | fast mode's reference | accelerated (fast) |" in report
    assert (
        "compared with its own reference, not with eager" in report and "compiled the transformer's blocks" in report
    )
    assert [text for _, _, text in steps_seen if "step 0" in text][0] == "fast mode's reference: step 0/2"
    again = backend.generate(request(acceleration="fast"))
    assert again.identical and again.cost.compiles == 0 and again.cost.captures == 0 and again.cost.replays > 0
    assert "over fast mode's reference" in again.report_markdown()  # both sides warm: a speed-up
    assert np.array_equal(pixels(again.accelerated_image), pixels(fast.accelerated_image))
    report = stats(backend.pipeline("z-image", "fast"))
    assert report["mode"] == "fast" and report["compiled_blocks"] > 0 and report["compile_failure"] is None
    exact = backend.generate(request())
    assert exact.identical and "| | eager | accelerated (exact) |" in exact.report_markdown()
    assert stats(backend.pipeline("z-image"))["mode"] == "exact"
    # fast mode rounds differently from eager: close, not necessarily equal (8-bit images)
    difference = np.abs(pixels(fast.accelerated_image).astype(int) - pixels(exact.accelerated_image).astype(int))
    assert difference.max() <= 2
