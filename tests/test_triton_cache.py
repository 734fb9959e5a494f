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
from pathlib import Path

import pytest
import torch
from _sm90 import compile_kernel_sm90, launches, ptxas

from bcg_diffusion.kernels import triton_cache, vae_glue

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(
    ptxas() is None, reason='needs Triton with the ptxas its wheel bundles: pip install "triton==3.6.0"'
)


def _compiled_kernel(cache: str, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype = torch.bfloat16):
    """Our VAE residual kernel's launch for ``dtype`` inputs, with the Triton cache ``cache`` set (compile it
    with ``compile_kernel_sm90(*launch)``)."""
    from bcg_diffusion.kernels import _vae_glue_triton as kernels

    monkeypatch.setenv("TRITON_CACHE_DIR", cache)
    x = torch.randn(1, 16, 4, 4, dtype=dtype)
    with launches(kernels, "residual_sum") as recorded:
        vae_glue._launch_residual(x, x, None, 1.0, torch.empty_like(x))
    return recorded[0]


def _as_launched(monkeypatch: pytest.MonkeyPatch, launch, *kernels) -> None:
    """Make ``kernels`` what Triton's JIT holds for ``launch``'s function in this process, as if launched:
    per device, (kernels by launch key, ...)."""
    cache = {f"launch {i}": kernel for i, kernel in enumerate(kernels)}
    monkeypatch.setitem(launch[0].device_caches, "sm90-on-a-cpu", (cache, None, None, None, None))


def _folders(file) -> set[str]:
    with zipfile.ZipFile(file) as archive:
        return {name.partition("/")[0] for name in archive.namelist()}


def test_our_kernels_saved_then_loaded_into_an_empty_cache_are_cache_hits(tmp_path, monkeypatch):
    launch = _compiled_kernel(str(tmp_path / "first"), monkeypatch)
    kernel = compile_kernel_sm90(*launch)
    _as_launched(monkeypatch, launch, kernel)
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


def test_save_takes_the_folders_the_kernels_were_compiled_into_not_the_current_cache(tmp_path, monkeypatch):
    # Inductor sets TRITON_CACHE_DIR at its first kernel: a kernel of ours compiled before that lies in the
    # previous cache. save() looked its hash up in the current one, created an empty folder there and wrote
    # a zip without files.
    launch = _compiled_kernel(str(tmp_path / "before"), monkeypatch)
    kernel = compile_kernel_sm90(*launch)
    _as_launched(monkeypatch, launch, kernel)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "inductors"))
    file = tmp_path / "kernels.zip"
    assert triton_cache.save(file) == 1
    with zipfile.ZipFile(file) as archive:
        assert any(name.endswith("/residual_sum.cubin") for name in archive.namelist())
    assert not (tmp_path / "inductors").exists()


def test_save_keeps_the_kernels_an_earlier_file_held(tmp_path, monkeypatch):
    # A process that ran fewer shapes than the one before it must not drop the others' kernels.
    launch = _compiled_kernel(str(tmp_path / "cache"), monkeypatch)
    bf16 = compile_kernel_sm90(*launch)
    fp16_launch = _compiled_kernel(str(tmp_path / "cache"), monkeypatch, torch.float16)
    fp16 = compile_kernel_sm90(*fp16_launch)
    file = tmp_path / "kernels.zip"
    _as_launched(monkeypatch, launch, bf16)
    assert triton_cache.save(file) == 1
    first = _folders(file)
    _as_launched(monkeypatch, launch, fp16)  # the next process launched the other kernel only
    assert triton_cache.save(file) == 2
    assert first < _folders(file) and len(_folders(file)) == 2
    assert not list(tmp_path.glob("*.tmp"))


def test_load_never_replaces_a_folder_the_cache_has(tmp_path, monkeypatch):
    # Another process may be writing that folder (a compile in progress, a rank unpacking the same file):
    # load() once deleted a folder without a group file and put its own in place.
    launch = _compiled_kernel(str(tmp_path / "first"), monkeypatch)
    _as_launched(monkeypatch, launch, compile_kernel_sm90(*launch))
    file = tmp_path / "kernels.zip"
    assert triton_cache.save(file) == 1
    (folder,) = _folders(file)
    cache = tmp_path / "second"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    (cache / folder).mkdir(parents=True)
    (cache / folder / "residual_sum.cubin.tmp.pid_1_2").write_bytes(b"another process's")
    assert triton_cache.load(file) == 0
    assert [p.name for p in (cache / folder).iterdir()] == ["residual_sum.cubin.tmp.pid_1_2"]
    with zipfile.ZipFile(file) as archive:  # the folder appearing between the check and the move
        assert triton_cache._unpack(archive, folder, triton_cache._members(archive)[folder], cache) == 0
    assert [p.name for p in (cache / folder).iterdir()] == ["residual_sum.cubin.tmp.pid_1_2"]
    assert [p.name for p in cache.iterdir()] == [folder]  # no staging folder left behind


def test_compile_cache_dir_points_tritons_cache_where_it_unpacks_our_kernels(tmp_path, monkeypatch):
    # With TRITON_CACHE_DIR unset, the kernels went to Triton's default folder, and inductor then set the
    # variable to a folder of its own cache at its first kernel: ours were never looked for there.
    from bcg_diffusion.features.compiled_blocks import TRITON_KERNELS_FILE, use_compile_cache_dir

    launch = _compiled_kernel(str(tmp_path / "first"), monkeypatch)
    _as_launched(monkeypatch, launch, compile_kernel_sm90(*launch))
    directory = tmp_path / "compile-cache"
    directory.mkdir()
    assert triton_cache.save(directory / TRITON_KERNELS_FILE) == 1
    (folder,) = _folders(directory / TRITON_KERNELS_FILE)
    monkeypatch.delenv("TRITON_CACHE_DIR")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(directory))
    use_compile_cache_dir(str(directory))
    assert triton.knobs.cache.dir == str(directory / "triton")  # what Triton reads, and inductor keeps
    assert any(p.name.startswith("__grp__") for p in (directory / "triton" / folder).iterdir())
    mine = tmp_path / "mine"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(mine))  # one the user set is kept, and the kernels go there
    use_compile_cache_dir(str(directory))
    assert triton.knobs.cache.dir == str(mine) and (mine / folder).is_dir()


def _sentinel_launcher_source(kernel, monkeypatch: pytest.MonkeyPatch) -> str:
    """The C source Triton's NVIDIA driver writes for ``kernel``'s launcher, caught before it compiles it
    (which needs the machine's libcuda)."""
    from triton.backends.nvidia import driver

    class Caught(Exception):
        pass

    sources = []

    def compile_module_from_src(src, name, **kwargs):
        sources.append((name, src))
        raise Caught

    monkeypatch.setattr(driver, "compile_module_from_src", compile_module_from_src)
    monkeypatch.setattr(driver, "library_dirs", lambda: [])
    with pytest.raises(Caught):
        driver.CudaLauncher(kernel.src, kernel.metadata)
    [(name, source)] = sources
    assert name == "__triton_launcher"
    return source


def test_the_launcher_source_is_the_one_tritons_driver_writes(tmp_path, monkeypatch):
    from triton.backends.nvidia import driver

    if not hasattr(driver, "make_launcher"):
        pytest.skip("Triton 3.8+ builds no launcher per kernel (one generic launcher in cuda_utils)")

    launch = _compiled_kernel(str(tmp_path / "cache"), monkeypatch)
    kernel = compile_kernel_sm90(*launch)
    assert triton_cache._launcher_source(driver, kernel) == _sentinel_launcher_source(kernel, monkeypatch)


def test_save_keeps_the_c_modules_triton_built_to_launch_our_kernels(tmp_path, monkeypatch):
    # A portable start found our kernels in the file but still compiled each launcher, and the driver's
    # utilities, with the machine's C compiler.
    import hashlib
    import sysconfig

    from triton.backends.nvidia import driver
    from triton.runtime.build import platform_key

    cache = tmp_path / "cache"
    launch = _compiled_kernel(str(cache), monkeypatch)
    kernel = compile_kernel_sm90(*launch)
    _as_launched(monkeypatch, launch, kernel)
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    modules = {"cuda_utils": (Path(driver.__file__).parent / "driver.c").read_text()}
    if hasattr(driver, "make_launcher"):  # Triton up to 3.6: a launcher per kernel too (3.8: one generic launcher)
        modules["__triton_launcher"] = triton_cache._launcher_source(driver, kernel)
    folders = {}
    for name, source in modules.items():  # as Triton's compile_module_from_src caches what it built
        key = hashlib.sha256((source + platform_key()).encode("utf-8")).hexdigest()
        (cache / key).mkdir(parents=True)
        (cache / key / f"{name}{suffix}").write_bytes(b"a shared object")
        folders[name] = key
    (cache / ("0" * 64)).mkdir()  # another module's: not ours to keep
    file = tmp_path / "kernels.zip"
    assert triton_cache.save(file) == 1 + len(modules)  # the kernel's folder and the C modules'
    assert set(folders.values()) < _folders(file) and "0" * 64 not in _folders(file)
    other = tmp_path / "other"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(other))
    assert triton_cache.load(file) == 1 + len(modules)
    for name, key in folders.items():
        assert (other / key / f"{name}{suffix}").read_bytes() == b"a shared object"
