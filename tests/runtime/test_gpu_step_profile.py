"""scripts/gpu_step_profile.py cannot rot before a GPU runs it: its trace reader on a real
jax.profiler trace of named scopes (default tier), and its whole dry run (slow: ~50 s; the
profile of gpu_bench's tiny engine with the Pallas GPU kernel interpreted, then every step
program lowered for CUDA)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))
import gpu_step_profile  # noqa: E402


def test_trace_split_puts_op_time_in_its_scope(tmp_path):
    def step(x, w):
        with jax.named_scope("proj"):
            y = x @ w
        with jax.named_scope("norm"):
            return y * jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + 1e-5)

    step.__name__ = "step"  # the profile reads modules named after the step
    program = jax.jit(step).lower(jnp.ones((64, 256)), jnp.ones((256, 256))).compile()
    args = (jnp.ones((64, 256)), jnp.ones((256, 256)))
    program(*args).block_until_ready()
    with jax.profiler.trace(str(tmp_path)):
        for _ in range(3):
            program(*args).block_until_ready()
    scopes = gpu_step_profile.op_scopes([program])
    assert {"proj", "norm"} <= {part for name in scopes.values() for part in name.split("/")}
    row = gpu_step_profile.trace_split(tmp_path, scopes)
    assert row["programs_traced"] == 3
    assert row["gemm_ms"] > 0 and row["norms_ms"] > 0
    assert row["host_gap_ms"] is not None and row["host_gap_ms"] >= 0
    assert row["device_ms"] == pytest.approx(
        sum(row[f"{c}_ms"] for c in gpu_step_profile.COLUMNS))


@pytest.mark.slow
def test_dry_run_profiles_and_dumps(tmp_path):
    subprocess.run([sys.executable, str(SCRIPTS / "gpu_step_profile.py"), "--out",
                    str(tmp_path), "--dry"], check=True, timeout=900)
    rows = [json.loads(line) for line in
            (tmp_path / "gpu_step_profile.jsonl").read_text().splitlines()]
    profiled = [r for r in rows if "step_ms" in r]
    assert [r["concurrency"] for r in profiled] == [1, 4]
    assert all(r["programs_traced"] >= 2 and r["device_ms"] > 0 for r in profiled)
    programs = sorted((tmp_path / "programs").glob("*.cuda.mlir"))
    assert len(programs) == 4  # plain, features, prompt logprobs, greedy
    assert all(r["control_flow"] == [] for r in rows if "program" in r)
    assert "| 4 |" in (tmp_path / "gpu_step_profile.md").read_text()


def test_runs_split_at_the_first_op_without_run_ids():
    events = [(0, 2, "gemm", "a"), (3, 5, "norms", "b"), (9, 11, "gemm", "a"),
              (12, 14, "norms", "b")]
    runs = gpu_step_profile._runs_by_first_op(events)
    assert [[e[3] for e in run] for run in runs.values()] == [["a", "b"], ["a", "b"]]
