"""Our Triton kernels' compiled binaries kept with fast mode's portable compile cache
(``bcg_diffusion/kernels/triton_cache.py``), on a CPU.

A real kernel of ours is compiled for sm_90 into one Triton cache (``_sm90.py``; Triton's compiler needs
no GPU), saved, and loaded into an empty cache, where compiling it again is a cache hit: what a process
on another machine with the same GPU and Triton gets at its first launch. Then the refusals: a file that
is not a zip, one whose entries would land outside Triton's cache; and fast mode writing the file when a
call compiled a kernel of ours.
"""

from __future__ import annotations

import json
import warnings
import zipfile

import pytest
import torch
from _sm90 import compile_kernel_sm90, launches, ptxas

from bcg_diffusion.kernels import triton_cache, vae_glue

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(ptxas() is None, reason="needs Triton with the ptxas its wheel bundles")


def _compiled_kernel(cache: str, monkeypatch: pytest.MonkeyPatch):
    """Our VAE residual kernel compiled for sm_90 into the Triton cache ``cache``."""
    from bcg_diffusion.kernels import _vae_glue_triton as kernels

    monkeypatch.setenv("TRITON_CACHE_DIR", cache)
    x = torch.randn(1, 16, 4, 4, dtype=torch.bfloat16)
    with launches(kernels, "residual_sum") as recorded:
        vae_glue._launch_residual(x, x, None, 1.0, torch.empty_like(x))
    return recorded[0]


def test_our_kernels_saved_then_loaded_into_an_empty_cache_are_cache_hits(tmp_path, monkeypatch):
    launch = _compiled_kernel(str(tmp_path / "first"), monkeypatch)
    kernel = compile_kernel_sm90(*launch)
    # Where Triton's JIT keeps what a launch compiled: per device, (kernels by launch key, ...).
    fn = launch[0]
    monkeypatch.setitem(fn.device_caches, "sm90-on-a-cpu", ({"a launch": kernel}, None, None, None, None))
    file = tmp_path / "kernels.zip"
    assert triton_cache.compiled_count() == 1
    assert triton_cache.save(file) == 1
    with zipfile.ZipFile(file) as archive:
        names = archive.namelist()
    assert any(name.endswith("/residual_sum.cubin") for name in names)
    assert any("/__grp__residual_sum.json" in name for name in names)

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "second"))  # another machine's empty cache
    assert triton_cache.load(file) == 1
    (group_file,) = (tmp_path / "second").glob("*/__grp__residual_sum.json")
    children = json.loads(group_file.read_text())["child_paths"]
    assert all(path.startswith(str(group_file.parent)) for path in children.values())  # rewritten paths
    hits = []

    def listener(**event):
        hits.append(event["cache_hit"])

    monkeypatch.setattr(triton.knobs.compilation, "listener", listener)
    again = compile_kernel_sm90(*launch)
    assert hits == [True] and again.hash == kernel.hash
    assert triton_cache.load(file) == 0  # the cache has it already


def test_unreadable_or_unsafe_files_are_ignored_with_a_warning(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    assert triton_cache.load(tmp_path / "missing.zip") == 0
    garbage = tmp_path / "garbage.zip"
    garbage.write_bytes(b"not a zip")
    escaping = tmp_path / "escaping.zip"
    with zipfile.ZipFile(escaping, "w") as archive:
        archive.writestr("../../outside.txt", "x")
    for file in (garbage, escaping):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert triton_cache.load(file) == 0
        assert any("ignoring Triton kernels file" in str(w.message) for w in caught), file
    assert not (tmp_path / "outside.txt").exists()
    assert triton_cache.compiled_count() == 0  # nothing launched in this process (no GPU)
    assert triton_cache.save(tmp_path / "none.zip") == 0 and not (tmp_path / "none.zip").exists()


def test_fast_mode_saves_our_kernels_after_a_call_that_compiled_one(tmp_path, monkeypatch):
    """The compiled-blocks feature writes the file beside the portable artifacts after any accelerated
    call in which the count of our compiled kernels moved, and not on the calls after."""
    from bcg_diffusion.features.compiled_blocks import TRITON_KERNELS_FILE, CompiledBlocks

    saved, counts = [], iter([0, 2, 2, 3])
    monkeypatch.setattr(triton_cache, "compiled_count", lambda: next(counts))
    monkeypatch.setattr(triton_cache, "save", lambda file: saved.append(file))
    feature = CompiledBlocks(str(tmp_path))
    feature.compiled = object()  # blocks were compiled (the wrapper only checks that)
    vae = type("Target", (), {"component": "vae"})()
    call = feature.wrap_call(vae, lambda: "image")
    assert [call() for _ in range(4)] == ["image"] * 4
    assert saved == [f"{tmp_path}/{TRITON_KERNELS_FILE}"] * 2  # after the 2nd and 4th calls
    without_cache_dir = CompiledBlocks(None)
    without_cache_dir.compiled = object()
    plain = lambda: "image"  # noqa: E731
    assert without_cache_dir.wrap_call(vae, plain) is plain  # nothing to keep: the VAE's call as it is
