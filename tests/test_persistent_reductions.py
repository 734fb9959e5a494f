"""Fast mode's widened persistent reductions: the heuristic, and that our blocks compile under it.

The kernels it changes are Triton ones (a GPU's); here the heuristic is called as inductor calls it, and
a toy block compiled on the CPU shows the setting is in place while it compiles and gone after.
"""

from __future__ import annotations

import contextlib
import pickle
import types

import pytest
import sympy
import torch
from _checks import needs_compiler

from bcg_diffusion.features import compiled_blocks, persistent_reductions

inductor_choices = pytest.importorskip("torch._inductor.choices")
if not persistent_reductions.available():
    pytest.skip("this torch's inductor has no persistent-reduction heuristic to widen", allow_module_level=True)

from torch._inductor.runtime.hints import ReductionHint  # noqa: E402
from torch._inductor.virtualized import V  # noqa: E402


class _Features:
    """What the heuristic reads of a kernel: its reduction hint and row length."""

    def __init__(self, hint: ReductionHint, elements: int) -> None:
        self.hint, self.reduction_numel, self.numel = hint, sympy.Integer(elements), sympy.Integer(8192)

    def get_reduction_hint(self) -> ReductionHint:
        return self.hint

    def strict_reduction_rblock(self) -> None:  # torch 2.15 (2.14: strict_sum_rblock): no strict block asked for
        return None

    strict_sum_rblock = strict_reduction_rblock

    def has_strict_multirow_reduction(self) -> bool:
        return False

    has_strict_sum_multirow_reduction = has_strict_multirow_reduction


class _Sizes:
    def statically_known_leq(self, left: sympy.Expr, right: int) -> bool:
        return bool(left <= right)

    def statically_known_geq(self, left: sympy.Expr, right: int) -> bool:
        return bool(left >= right)

    def optimization_hint(self, expr: sympy.Expr) -> int:
        return int(expr)


@pytest.mark.parametrize(
    ("hint", "elements", "persistent"),
    [
        (ReductionHint.INNER, 512, True),  # inductor's own choice, kept
        (ReductionHint.INNER, 3072, True),  # Qwen-Image's width: looped by default
        (ReductionHint.INNER, 3840, True),  # Z-Image's
        (ReductionHint.INNER, 4097, False),
        (ReductionHint.INNER, 12288, False),  # the feed-forward's rows stay looped (slower persistent)
        (ReductionHint.DEFAULT, 3072, False),  # only rows along the inner dimension
    ],
)
def test_rows_up_to_the_limit_reduce_in_one_program(hint, elements, persistent):
    ours = persistent_reductions.choices_class()()
    with V.set_graph_handler(types.SimpleNamespace(sizevars=_Sizes())):
        assert ours.should_use_persistent_reduction(_Features(hint, elements), False) is persistent
        if elements == 3072 and hint == ReductionHint.INNER:  # what we change
            default = inductor_choices.InductorChoices()
            assert default.should_use_persistent_reduction(_Features(hint, elements), False) is False


def test_widened_is_ours_inside_and_the_previous_handler_after():
    before = V.choices
    with persistent_reductions.widened():
        assert isinstance(V.choices, persistent_reductions.choices_class())
        assert V.choices.uuid().endswith(str(persistent_reductions.ROW_LIMIT))
    assert V.choices is before


def test_compile_options_name_the_heuristics_for_the_caches_key():
    from torch._inductor import config

    options = compiled_blocks.inductor_options()
    if hasattr(config, "inductor_choices_class"):
        assert options["inductor_choices_class"] is persistent_reductions.choices_class()
    else:
        assert "inductor_choices_class" not in options


class _NormBlock(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.layer_norm(x, x.shape[-1:])


@needs_compiler
def test_blocks_compile_with_the_widened_heuristics_and_leave_them_after(monkeypatch):
    from bcg_diffusion.core.hooks import MethodPatches

    entered = []
    widened = persistent_reductions.widened

    @contextlib.contextmanager
    def recording():
        with widened():
            entered.append(type(V.choices))
            yield

    monkeypatch.setattr(persistent_reductions, "widened", recording)
    holder = torch.nn.Module()
    holder.block = _NormBlock()
    holder._repeated_blocks = ["_NormBlock"]
    torch._dynamo.reset()
    patches = MethodPatches()
    record = compiled_blocks.compile_repeated_blocks(holder, patches)
    before = V.choices
    try:
        x = torch.randn(2, 8, 16)
        torch.testing.assert_close(holder.block(x), torch.nn.functional.layer_norm(x, (16,)))
        assert record.compiles == 1 and record.failure is None
        assert entered == [persistent_reductions.choices_class()]  # the call that compiled ran under ours
        assert V.choices is before
    finally:
        patches.undo()


@needs_compiler
def test_blocks_compiled_under_the_setting_keep_inductors_graph_cache(monkeypatch, tmp_path):
    """The compile caches' key pickles inductor's settings, the choices class with them: a class that does
    not pickle makes inductor bypass its graph cache, and every later process compile again."""
    from torch._dynamo.utils import counters
    from torch._inductor import config

    if not hasattr(config, "inductor_choices_class"):
        pytest.skip("this torch's compile caches do not key on a choices class")
    # torch 2.11 pickles the class itself into the key (2.13 asks an instance's uuid()): by reference, so
    # a class defined inside a function made the H200's runs bypass the cache (run 94's log)
    assert pickle.loads(pickle.dumps(persistent_reductions.choices_class())) is persistent_reductions.choices_class()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    counters.clear()
    torch._dynamo.reset()
    with config.patch(fx_graph_cache=True), persistent_reductions.widened():
        compiled = torch.compile(_NormBlock(), options=compiled_blocks.inductor_options())
        x = torch.randn(2, 8, 16)
        torch.testing.assert_close(compiled(x), torch.nn.functional.layer_norm(x, (16,)))
    assert counters["inductor"]["fxgraph_cache_bypass"] == 0
    assert counters["inductor"]["fxgraph_cache_miss"] == 1
