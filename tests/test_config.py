"""Options are validated when made, with messages that say what to change."""

from __future__ import annotations

import pytest

from bcg_diffusion import AccelerateConfig


def test_defaults():
    config = AccelerateConfig()
    assert config.mode == "exact" and not config.debug and config.components is None  # the adapter's


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"mode": "turbo"}, ValueError, "mode must be one of"),
        ({"debug": "yes"}, ValueError, 'debug must be True, False or "verify"'),
        ({"debug": 1}, TypeError, "debug must be a bool"),
        ({"components": ("unet",)}, ValueError, "unknown components"),
        ({"components": ()}, ValueError, "empty"),
        ({"components": [1]}, TypeError, "tuple of strings"),
        ({"warmup_runs": 0}, ValueError, "between 1 and 10"),
        ({"warmup_runs": 2.0}, TypeError, "must be an int"),
        ({"warmup_runs": True}, TypeError, "must be an int"),
        ({"capture_error_mode": "loose"}, ValueError, "capture_error_mode"),
        ({"warmup": [(0, 64)]}, ValueError, "must be positive"),
        ({"warmup": [(512, 512), (63, 64)]}, ValueError, r"warmup resolution \(63, 64\).*multiples of 16.*\(64, 64\)"),
        ({"warmup": [(64, 40)]}, ValueError, r"warmup resolution \(64, 40\).*multiples of 16"),
        ({"warmup": [512]}, TypeError, "pairs of ints"),
    ],
)
def test_bad_values_are_refused(options, error, match):
    with pytest.raises(error, match=match):
        AccelerateConfig(**options)


def test_from_options_overrides_and_rejects_unknown_names():
    base = AccelerateConfig(warmup_runs=3)
    assert AccelerateConfig.from_options(base, {"debug": True}) == AccelerateConfig(warmup_runs=3, debug=True)
    assert AccelerateConfig(components="vae").components == ("vae",)
    with pytest.raises(TypeError, match="unknown option"):
        AccelerateConfig.from_options(None, {"max_graphs": 3})
    with pytest.raises(TypeError, match="must be an AccelerateConfig"):
        AccelerateConfig.from_options({"debug": True}, {})


def test_describe_changes_names_only_the_fields_that_differ():
    from bcg_diffusion.config import describe_changes

    old, new = AccelerateConfig(debug=True), AccelerateConfig(debug=True, mode="fast", max_signatures=4)
    assert describe_changes(old, new) == "mode: 'exact' → 'fast', max_signatures: None → 4"
    assert describe_changes(old, old) == "no option differs"
