"""Our Triton kernels' compiled binaries, kept with fast mode's portable compile cache.

PyTorch's portable compile artifacts (``torch.compiler.save_cache_artifacts``) hold what inductor
compiled, not the kernels a library launches through Triton's own JIT, as ours are: a process that starts
from the portable file alone builds ours again (Z-Image's portable start took 19.2 s in H200 run 141,
12.7 s in run 134, before the block glue's kernels). Triton keeps each kernel it compiled in a folder of its cache (``TRITON_CACHE_DIR``, by default
``~/.triton/cache``) named after a hash of the source, the argument types, the launch options, the GPU
target and Triton's version; a process that computes the same hash loads that folder instead of
compiling. So :func:`save` writes the folders of the kernels of ours this process compiled into one zip
file, and :func:`load` unpacks such a file into this process's Triton cache. Another machine with the
same GPU architecture and Triton version then finds them; any other computes other hashes and compiles
as before. Nothing here changes what a kernel computes.

>>> save("cache/bcg-triton-kernels.zip")  # doctest: +SKIP
9
>>> load("cache/bcg-triton-kernels.zip")  # in a new process, before the first launch  # doctest: +SKIP
9

Both do nothing (0) without Triton, or where Triton's cache is not its file cache (a
``TRITON_CACHE_MANAGER`` of the user's).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import types
import warnings
import zipfile
from pathlib import Path

__all__ = ["compiled_count", "load", "save"]

logger = logging.getLogger(__name__)

# Triton names a kernel's folder by the base32 form of its hash; the files in it by the kernel's name.
_FOLDER = re.compile(r"^[A-Z2-7]+$")
_FILE = re.compile(r"^[\w.-]+$")
_GROUP_PREFIX = "__grp__"


@functools.cache
def _module_names() -> tuple[str, ...]:
    """The modules of our kernels: ``bcg_diffusion.kernels._*_triton``."""
    return tuple(f"{__package__}.{path.stem}" for path in sorted(Path(__file__).parent.glob("_*_triton.py")))


@functools.cache
def _jit_functions(module: types.ModuleType) -> tuple[object, ...]:
    from triton.runtime.jit import JITFunction

    return tuple(fn for fn in vars(module).values() if isinstance(fn, JITFunction))


def _launched_kernels() -> list[object]:
    """The kernels (Triton's ``CompiledKernel``) our JIT functions compiled in this process, on every
    device. A few dictionary lookups: it runs after every accelerated call where a compile cache
    directory is set."""
    kernels = []
    for name in _module_names():
        module = sys.modules.get(name)  # not imported: none of its kernels ran
        if module is None:
            continue
        for fn in _jit_functions(module):
            for device_cache in getattr(fn, "device_caches", {}).values():
                # (kernel cache, ...): compiled kernels, or futures of ones still compiling (skipped)
                kernels += [k for k in device_cache[0].values() if getattr(k, "hash", None) is not None]
    return kernels


def compiled_count() -> int:
    """How many kernels of ours this process has compiled (or loaded from Triton's cache): a cheap
    check of whether :func:`save` has something new to write."""
    return len(_launched_kernels())


def _cache_root() -> Path | None:
    """Triton's file cache folder, or None where Triton is missing or its cache is not files."""
    try:
        import triton.knobs as knobs
        from triton.runtime.cache import FileCacheManager
    except ImportError:
        return None
    manager = knobs.cache.manager_class
    if manager is not None and not issubclass(manager, FileCacheManager):
        return None
    return Path(knobs.cache.dir)


def _folder(kernel_hash: str) -> Path:
    from triton.runtime.cache import get_cache_manager

    return Path(get_cache_manager(kernel_hash).cache_dir)


def save(file: str | os.PathLike[str]) -> int:
    """Write the cache folders of the kernels of ours this process compiled into the zip ``file``
    (atomically: a reader sees the old file or the new one). Returns how many kernels it holds; with
    none (no Triton, nothing compiled, a cache of another kind), writes nothing and returns 0."""
    kernels = _launched_kernels()  # first: without a kernel launched, Triton is not even imported
    if not kernels or _cache_root() is None:
        return 0
    folders = sorted({_folder(kernel.hash) for kernel in kernels})
    folders = [folder for folder in folders if folder.is_dir()]
    if not folders:
        return 0
    file = Path(file)
    partial = file.with_suffix(file.suffix + f".{os.getpid()}.tmp")
    with zipfile.ZipFile(partial, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for folder in folders:
            for path in sorted(folder.iterdir()):
                if path.is_file() and _FILE.match(path.name) and ".tmp." not in path.name and path.name != "lock":
                    archive.write(path, f"{folder.name}/{path.name}")
    partial.replace(file)
    logger.info("saved %d Triton kernels of bcg_diffusion to %s", len(folders), file)
    return len(folders)


def load(file: str | os.PathLike[str]) -> int:
    """Unpack a zip :func:`save` wrote into this process's Triton cache, so that a launch of the same kernel
    (same source, argument types, options, GPU and Triton) loads it instead of compiling. Folders the cache
    holds already are left as they are. Returns how many folders it added; 0 where there is no file, no
    Triton, or a cache of another kind. A file it cannot read is reported with a warning and ignored (the
    kernels then compile, as without it)."""
    file = Path(file)
    if not file.is_file():
        return 0
    root = _cache_root()  # imports Triton (about a second), so only with a file to unpack
    if root is None:
        return 0
    try:
        with zipfile.ZipFile(file) as archive:
            members = _members(archive)
            added = 0
            for folder, names in members.items():
                if (root / folder).is_dir() and any(n.startswith(_GROUP_PREFIX) for n in os.listdir(root / folder)):
                    continue  # this cache has the kernel already
                _unpack(archive, folder, names, root)
                added += 1
    except (OSError, ValueError, zipfile.BadZipFile, json.JSONDecodeError) as exc:
        warnings.warn(f"bcg-diffusion: ignoring Triton kernels file {file}: {type(exc).__name__}: {exc}", stacklevel=2)
        return 0
    logger.info("loaded %d Triton kernels of bcg_diffusion from %s into %s", added, file, root)
    return added


def _members(archive: zipfile.ZipFile) -> dict[str, list[str]]:
    """The archive's files by folder; raises ValueError on a name that is not ``<folder>/<file>`` as
    :func:`save` writes them (nothing is unpacked outside Triton's cache)."""
    members: dict[str, list[str]] = {}
    for name in archive.namelist():
        folder, _, base = name.partition("/")
        if not (_FOLDER.match(folder) and _FILE.match(base)) or base in (".", ".."):
            raise ValueError(f"unexpected entry {name!r}")
        members.setdefault(folder, []).append(base)
    return members


def _unpack(archive: zipfile.ZipFile, folder: str, names: list[str], root: Path) -> None:
    """Unpack one kernel's folder into ``root``, its group files pointing at the new place (Triton's group
    files list their members by absolute path), then move it in place whole."""
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder}.", dir=root))
    target = root / folder
    try:
        for name in names:
            data = archive.read(f"{folder}/{name}")
            if name.startswith(_GROUP_PREFIX):
                group = json.loads(data)
                group["child_paths"] = {
                    child: str(target / Path(path).name) for child, path in group["child_paths"].items()
                }
                data = json.dumps(group).encode()
            (staging / name).write_bytes(data)
        if target.is_dir():  # an empty or partial folder (a compile cut short): replaced
            shutil.rmtree(target)
        staging.replace(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
