"""Recording a demo generation and replaying it on the page (how the H200 screenshot is taken)."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest

from bcg_diffusion.demo import DemoBackend, DemoError
from bcg_diffusion.demo.record import RecordedBackend, load_result, record


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    folder = tmp_path_factory.mktemp("recorded")
    backend = DemoBackend("tiny", "cpu", pipelines=["z-image"])
    try:
        result = record(backend, "z-image", folder, resolution=(64, 64), steps=2)  # small: the format is tested
    finally:
        backend.close()
    return folder, result


def test_record_saves_the_replayed_result(recorded):
    folder, result = recorded
    assert {p.name for p in folder.iterdir()} == {"result.json", "eager.png", "accelerated.png"}
    assert result.identical and result.cost.captures == 0 and result.cost.replays > 0  # the second request
    loaded, environment = load_result(folder)
    assert loaded.request == result.request and loaded.cost == result.cost
    assert loaded.request.acceleration == "exact" and loaded.max_difference == 0.0
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
    assert backend.accelerations == ("exact",)  # the page offers the recorded mode only
    with pytest.raises(DemoError, match="exact mode"):
        backend.generate(dataclasses.replace(result.request, acceleration="fast"))


def test_a_recording_made_before_modes_loads_as_exact_mode(recorded, tmp_path):
    folder, result = recorded
    data = json.loads((folder / "result.json").read_text())
    del data["request"]["acceleration"], data["max_difference"], data["cost"]["compiles"]
    del data["cost"]["compile_seconds"]
    (tmp_path / "result.json").write_text(json.dumps(data))
    for image in ("eager.png", "accelerated.png"):
        shutil.copy(folder / image, tmp_path / image)
    loaded, _ = load_result(tmp_path)
    assert loaded.request == result.request and loaded.request.acceleration == "exact"
    assert loaded.max_difference is None and loaded.cost.compiles == 0
    assert "exact mode" in loaded.report_markdown()


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
