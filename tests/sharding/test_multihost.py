"""Two processes on 127.0.0.1 (4 fake CPU devices each, gloo collectives) run one tp=8 engine
through `jax.distributed`: process 0 schedules and broadcasts each step's inputs, process 1 runs
the same programs. The greedy text must equal the single-process engine's. The model is the tiny
random Llama of test_sharding (8 kv heads, one per device), so each process compiles in seconds;
SmolLM2's replicated kv heads under tp are test_sharding's."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from tiny_models import llama_16x8

from jengine import Engine, SamplingParams

PROMPT = "t5 t17 t33 t60 t7"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# One step shape only: each process compiles a single program.
ONE_BUCKET = """
model: {dtype: float32, max_model_len: 512}
cache: {page_size: 16, kv_cache_memory: 128MiB}
scheduler: {max_num_seqs: 16, max_num_batched_tokens: 16, token_buckets: [16],
            seq_buckets: [16], page_buckets: [32]}
"""


def test_two_processes_tp8_match_one_process(tmp_path):
    """Two real processes joined by `jax.distributed` (tp=8 over 4 + 4 CPU devices) give the
    one-process text, and only the leader prints: the multi-host path has no cheaper check."""
    model = tmp_path / "tiny"
    llama_16x8(model)
    preset = tmp_path / "one_bucket.yaml"
    preset.write_text(ONE_BUCKET)
    [expected] = Engine(str(model), config=str(preset), progress=False).generate(
        [PROMPT], SamplingParams(max_tokens=8, temperature=0))
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # 4 devices each, not 8
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "jengine.cli", "generate", PROMPT, "--model", str(model),
             "--config", str(preset), "--max-tokens", "8", "--mesh", "tp=8", "--cpu-devices", "4",
             "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
             "--process-id", str(rank)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        )
        for rank in (0, 1)
    ]
    results = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, results):
        assert p.returncode == 0, err[-2000:]
    leader_out, follower_out = results[0][0], results[1][0]
    assert leader_out == expected.outputs[0].text + "\n"
    assert follower_out == ""  # only process 0 serves output
