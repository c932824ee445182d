"""`--mesh` specs: "tp=8", "dp=2,tp=4" -> data-parallel replicas of a tensor-parallel mesh.

`dp` counts independent engine replicas (each its own KV pages and scheduler); `tp` is the
number of devices one replica's parameters and KV heads are split over. Replica `r` runs on
devices `[r * tp, (r + 1) * tp)` of `jax.devices()`.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

TP = "tp"


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """A parsed `--mesh` value."""

    dp: int = 1
    tp: int = 1

    @classmethod
    def parse(cls, text: str) -> MeshSpec:
        """'tp=8' | 'dp=2,tp=4' | 'tp=4,dp=2' -> MeshSpec; ValueError naming the problem."""
        sizes: dict[str, int] = {}
        for part in text.replace(" ", "").split(","):
            name, sep, value = part.partition("=")
            if not sep or name not in ("dp", "tp") or not value.isdigit():
                raise ValueError(
                    f"mesh {text!r}: expected comma-separated dp=N / tp=N, e.g. tp=8 or dp=2,tp=4"
                )
            if name in sizes:
                raise ValueError(f"mesh {text!r}: {name} given twice")
            if int(value) < 1:
                raise ValueError(f"mesh {text!r}: {name} must be at least 1")
            sizes[name] = int(value)
        return cls(**sizes)

    @property
    def num_devices(self) -> int:
        return self.dp * self.tp

    def __str__(self) -> str:
        return f"dp={self.dp},tp={self.tp}" if self.dp > 1 else f"tp={self.tp}"

    def check_devices(self, devices: list | None = None) -> list:
        """The devices this mesh uses; ValueError if there are too few."""
        devices = list(jax.devices() if devices is None else devices)
        if self.num_devices > len(devices):
            platform = devices[0].platform if devices else "none"
            hint = (
                " (on CPU, fake devices: set jax_num_cpu_devices=N, or XLA_FLAGS="
                "--xla_force_host_platform_device_count=N, before JAX starts)"
                if platform == "cpu" else ""
            )
            raise ValueError(
                f"mesh {self} needs {self.num_devices} devices; {len(devices)} {platform} "
                f"device(s) available{hint}"
            )
        return devices[: self.num_devices]

    def replica_mesh(self, replica: int = 0, devices: list | None = None) -> Mesh:
        """The 1-D `tp` mesh of data-parallel replica `replica` (Auto axis type, so XLA's
        sharding propagation places the row-parallel matmul outputs by itself)."""
        devices = self.check_devices(devices)
        mine = devices[replica * self.tp:(replica + 1) * self.tp]
        return Mesh(np.asarray(mine), (TP,), axis_types=(AxisType.Auto,))
