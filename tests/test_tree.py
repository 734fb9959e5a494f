"""Signatures: what makes two calls share a graph, and what rebuilds their values."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch
from diffusers.models.modeling_outputs import Transformer2DModelOutput

from bcg_diffusion.core.tree import UnsupportedValue, describe, differences, flatten, unflatten


def test_roundtrip_nested_containers():
    a, b = torch.randn(2, 3), torch.randn(4)
    Pair = namedtuple("Pair", "left right")
    value = ([a, (b, None)], {"k": 1, "mask": None, "shapes": [[(1, 32, 32)]]}, Pair(a, 2.5))
    leaves, spec = flatten(value)
    assert len(leaves) == 3
    rebuilt = unflatten(spec, leaves)
    assert rebuilt[0][0] is a and rebuilt[0][1][0] is b and rebuilt[0][1][1] is None
    assert rebuilt[1] == {"k": 1, "mask": None, "shapes": [[(1, 32, 32)]]}
    assert isinstance(rebuilt[2], Pair) and rebuilt[2].right == 2.5


def test_output_dataclass_roundtrip():
    out = Transformer2DModelOutput(sample=torch.randn(1, 4))
    leaves, spec = flatten(out)
    rebuilt = unflatten(spec, [leaves[0].clone()])
    assert isinstance(rebuilt, Transformer2DModelOutput) and torch.equal(rebuilt.sample, out.sample)


def spec_of(*args, **kwargs):
    return flatten((args, kwargs))[1]


def test_signature_keys_everything_but_tensor_contents():
    x = torch.randn(2, 8)
    assert spec_of(x, None) == spec_of(torch.randn(2, 8), None)
    assert spec_of(x) != spec_of(torch.randn(2, 9))  # shape
    assert spec_of(x) != spec_of(x.half())  # dtype
    assert spec_of(x) != spec_of(x.t().contiguous().t())  # strides
    assert spec_of(x, mask=None) != spec_of(x, mask=torch.ones(2))  # None vs tensor
    # 1, 1.0 and True hash equal but take different code paths: each pair compared (a chained != skips 1 vs True)
    assert spec_of(x, 1) != spec_of(x, 1.0)
    assert spec_of(x, 1.0) != spec_of(x, True)
    assert spec_of(x, 1) != spec_of(x, True)
    assert spec_of([x, x]) != spec_of((x, x))  # container type
    assert spec_of([[(1, 32, 32)]]) != spec_of([[(1, 32, 48)]])  # Python constants
    hash(spec_of(x, {"a": [1, (2, None)]}))


def test_unsupported_objects_are_refused():
    with pytest.raises(UnsupportedValue, match="Generator"):
        flatten((torch.Generator(),))
    with pytest.raises(UnsupportedValue):
        flatten({"fn": lambda: 0})


def test_describe_is_short_and_readable():
    text = describe(spec_of(torch.zeros(1, 4096, 64), None, [[(1, 64, 64)]]))
    assert "float32[1x4096x64]" in text and "None" in text
    assert len(describe(spec_of(*[torch.zeros(3)] * 200), limit=80)) <= 80


def test_differences_name_what_changed():
    base = spec_of(torch.zeros(1, 11, 8), mask=None, img_shapes=[[(1, 32, 32)]], scale=1.0)
    assert differences(base, base) == []
    other = spec_of(torch.zeros(1, 20, 8), mask=torch.ones(1, 20), img_shapes=[[(1, 32, 48)]], scale=1.0)
    lines = differences(base, other)
    assert any(line.startswith("0.0: float32[1x11x8]") for line in lines)
    assert any(line.startswith("1.mask: None -> float32[1x20]") for line in lines)
    assert any("img_shapes.0.0.2: 32 -> 48" in line for line in lines)
    assert len(lines) == 3
