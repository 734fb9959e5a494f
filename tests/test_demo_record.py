"""Recording a demo generation and replaying it on the page (how the H200 screenshot is taken)."""

from __future__ import annotations

import dataclasses

import pytest

from bcg_diffusion.demo import DemoBackend, DemoError
from bcg_diffusion.demo_record import RecordedBackend, load_result, record


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    folder = tmp_path_factory.mktemp("recorded")
    backend = DemoBackend("tiny", "cpu", pipelines=["z-image"])
    try:
        result = record(backend, "z-image", folder)
    finally:
        backend.close()
    return folder, result


def test_record_saves_the_replayed_result(recorded):
    folder, result = recorded
    assert {p.name for p in folder.iterdir()} == {"result.json", "eager.png", "accelerated.png"}
    assert result.identical and result.cost.captures == 0 and result.cost.replays > 0  # the second request
    loaded, environment = load_result(folder)
    assert loaded.request == result.request and loaded.cost == result.cost
    assert loaded.accelerated_digest == result.accelerated_digest and loaded.identical
    assert loaded.accelerated_image.size == result.accelerated_image.size
    assert {"weights", "date", "torch", "diffusers"} <= set(environment) and environment["weights"] == "tiny"


def test_recorded_backend_returns_the_recording_and_refuses_other_settings(recorded):
    folder, result = recorded
    backend = RecordedBackend(folder)
    assert backend.pipelines == ("z-image",) and backend.default_prompt == result.request.prompt
    assert backend.defaults("z-image").resolution == (result.request.width, result.request.height)
    calls = []
    replayed = backend.generate(result.request, lambda *args: calls.append(args))
    assert replayed.report_markdown() == load_result(folder)[0].report_markdown() and calls
    with pytest.raises(DemoError, match="settings are fixed"):
        backend.generate(dataclasses.replace(result.request, seed=1))


def test_missing_or_bad_recordings_say_so(tmp_path):
    with pytest.raises(FileNotFoundError, match="--record"):
        load_result(tmp_path)
    (tmp_path / "result.json").write_text("{}")
    with pytest.raises(ValueError, match="not a recorded demo result"):
        load_result(tmp_path)


def test_replay_page_builds(recorded):
    import app
    from bcg_diffusion import demo

    backend = RecordedBackend(recorded[0])
    page = app.build_ui(backend, demo.WarmupStatus(), "z-image", banner="**Replay**")
    assert page is not None
