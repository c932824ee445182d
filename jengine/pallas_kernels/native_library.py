"""Loads one of the package's native kernel libraries and registers its XLA FFI targets."""

from __future__ import annotations

import ctypes
import importlib.machinery
from pathlib import Path

import jax


def load_native(stem: str, targets: dict[str, str]) -> tuple[ctypes.CDLL | None, str | None]:
    """`stem*.so` beside this file, with each FFI target name -> exported handler symbol
    registered for CPU; (library, None), or (None, why not) when it is missing or broken."""
    here = Path(__file__).parent
    found = [p for suffix in importlib.machinery.EXTENSION_SUFFIXES
             if (p := here / f"{stem}{suffix}").exists()]
    if not found:
        return None, f"no {stem} library in {here}"
    try:
        lib = ctypes.CDLL(str(found[0]))
        for target, symbol in targets.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)),
                                        platform="cpu")
    except (OSError, AttributeError) as e:
        return None, f"{found[0].name} failed to load: {e}"
    return lib, None


def missing(feature: str, why: str | None, alternative: str) -> RuntimeError:
    """The error of a `feature` whose native library did not load (`why`), naming the fix."""
    return RuntimeError(
        f"{feature} needs jengine's native kernel ({why}). Reinstall jengine with a C++ "
        "compiler present (`pip install -e .` builds it; in a source tree `python setup.py "
        f"build_ext --inplace`), or use {alternative}.")
