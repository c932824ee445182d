"""`dtype: auto` on a CPU: bfloat16 where this CPU runs bf16 dots natively (AMX-BF16 tiles,
or AVX-512-BF16) *and* the model's bf16 projections were measured faster than its f32 ones
here; float32 otherwise. Accelerators (GPU, TPU) take bfloat16 without measuring
(`jengine.core.build.resolve_dtype`), and a named dtype is never replaced.

Why measure instead of a rule per instruction set: which dtype serves faster depends on the
kernels a CPU gets for each (the AMX kernel, the native small-row kernel, XLA's dots) and on
the model's shapes; on the AMD EPYC (AVX-512-BF16, no AMX) `--dtype bfloat16` served 1.00-1.04x
vLLM where the f32 that the old AMX-only rule picked served 0.76-0.92x (issue 46), and the
kernels keep changing. CPUs with neither feature keep float32 unmeasured: XLA:CPU and the native
kernels widen every bf16 operand to f32 there, so bf16 only saves weight bytes while losing
precision. What is timed, and why, is `jengine.runtime.dtype_probe`'s docstring.

The decision is stored beside the compiled step programs (`default_store_dir()`, one JSON file
per key) and keyed by the model's config, the matmul backend and the environment that keys
those programs (CPU model and flags, the flags `cpu_info.hiding` hides, jax/jaxlib, XLA flags,
the traced sources and native kernels), plus the threads this process may use: a second start
on the same machine and model reads it and measures nothing; a changed kernel measures again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import jax

from jengine import cpu_info
from jengine.models.config import ModelConfig
from jengine.runtime import executables
from jengine.runtime.dtype_probe import Timings, time_projections

log = logging.getLogger("jengine")

FORMAT = 1  # bump when what is measured or stored changes
# bf16 must take at most this fraction of f32's time: it costs precision, so a tie (or a
# difference within the probe's run-to-run noise, a few percent) keeps float32.
MARGIN = 0.95

NO_FEATURE = ("this CPU has neither AVX-512-BF16 nor AMX-BF16 (bf16 dots would run widened to "
              "f32); not measured")

Timer = Callable[[ModelConfig, str, str], Timings]  # (config, dtype, matmul backend) -> Timings


@dataclasses.dataclass(frozen=True)
class DtypeChoice:
    """What `auto` resolved to on this CPU, and why."""

    dtype: str  # float32 | bfloat16
    reason: str
    float32_ms: float | None = None  # the probe's per-token ms (None: not measured)
    bfloat16_ms: float | None = None
    probe_seconds: float = 0.0  # wall time of the measurement, when it ran
    stored: bool = False  # read from the store: this start measured nothing

    def summary(self) -> str:
        """One line: the dtype, why, and the two timings."""
        text = f"{self.dtype}: {self.reason}"
        if self.float32_ms is not None:
            text += (f" (projections per token: float32 {self.float32_ms:.2f} ms, bfloat16 "
                     f"{self.bfloat16_ms:.2f} ms; measured in {self.probe_seconds:.1f} s"
                     + (", stored decision" if self.stored else "") + ")")
        return text


def bf16_feature() -> str | None:
    """The feature that runs bf16 dots natively on this CPU (of `cpu_info.flags()`, so
    `cpu_info.hiding` steers it), or None."""
    have = cpu_info.flags()
    if "amx_bf16" in have:
        return "AMX-BF16"
    return "AVX-512-BF16" if "avx512_bf16" in have else None


def choose(config: ModelConfig, matmul_backend: str, store_dir: Path, *,
           timer: Timer = time_projections) -> DtypeChoice:
    """`auto`'s dtype for `config` on this CPU under `matmul_backend` (resolved): stored, or
    measured with `timer` and stored. Logs one INFO line."""
    feature = bf16_feature()
    if feature is None:
        choice = DtypeChoice("float32", NO_FEATURE)
    else:
        file = Path(store_dir) / f"auto-dtype-{decision_key(config, matmul_backend)}.json"
        choice = _read(file) or _measure(config, matmul_backend, feature, timer, file)
    log.info("dtype auto -> %s", choice.summary())
    return choice


def stored(config: ModelConfig, matmul_backend: str, store_dir: Path) -> DtypeChoice | None:
    """The decision a start with `auto` would read, or None if none is stored yet."""
    return _read(Path(store_dir) / f"auto-dtype-{decision_key(config, matmul_backend)}.json")


def describe(config: ModelConfig, matmul_backend: str, store_dir: Path) -> str:
    """What `auto` means for `config` here, without measuring (`jengine info`)."""
    if jax.default_backend() != "cpu":
        return f"bfloat16 (on {jax.default_backend()}: not measured)"
    if bf16_feature() is None:
        return DtypeChoice("float32", NO_FEATURE).summary()
    found = stored(config, matmul_backend, store_dir)
    if found is not None:
        return found.summary()
    return (f"measured at the first start on this CPU ({bf16_feature()}): bfloat16 if its "
            "projections run faster than float32's")


def decision_key(config: ModelConfig, matmul_backend: str) -> str:
    """A hex digest of what decides the measurement: the model's shapes, the kernels (backend,
    sources, CPU and its hidden flags, XLA's version and flags) and the threads."""
    env = executables.environment(jax.devices()[:1])
    for per_device in ("devices", "num_devices"):  # the probe runs on one device
        env.pop(per_device)
    text = json.dumps({"format": FORMAT, "model": repr(config), "matmul_backend": matmul_backend,
                       "threads": len(os.sched_getaffinity(0)), "environment": env},
                      sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _measure(config: ModelConfig, backend: str, feature: str, timer: Timer,
             file: Path) -> DtypeChoice:
    start = time.perf_counter()
    f32 = timer(config, "float32", backend).per_token * 1e3
    bf16 = timer(config, "bfloat16", backend).per_token * 1e3
    seconds = time.perf_counter() - start
    ratio = bf16 / f32
    if ratio <= MARGIN:
        dtype, why = "bfloat16", f"bf16 projections took {ratio:.2f}x f32's time here ({feature})"
    else:
        dtype, why = "float32", (f"bf16 projections took {ratio:.2f}x f32's time here "
                                 f"({feature}; bf16 needs <= {MARGIN}x)")
    choice = DtypeChoice(dtype, why, round(f32, 3), round(bf16, 3), round(seconds, 2))
    _write(file, choice)
    return choice


def _read(file: Path) -> DtypeChoice | None:
    try:
        fields = json.loads(file.read_text())
        return dataclasses.replace(DtypeChoice(**fields), stored=True)
    except FileNotFoundError:
        return None
    except (ValueError, TypeError) as e:  # a damaged file: measured again, then replaced
        log.warning("ignoring unreadable dtype decision %s: %s", file.name, e)
        return None


def _write(file: Path, choice: DtypeChoice) -> None:
    """Atomically (a reader never sees half a file); a full or read-only disk only costs a
    measurement at the next start."""
    tmp = file.with_name(f".{file.name}.{os.getpid()}.tmp")
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        fields = dataclasses.asdict(choice)
        fields.pop("stored")
        tmp.write_text(json.dumps(fields, indent=1))
        os.replace(tmp, file)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        log.warning("the dtype decision is not stored (measured again next start): %s", e)
