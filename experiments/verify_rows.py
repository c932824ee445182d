"""Whether a speculative verification's rows are bit for bit the decodes they stand for, and if
not, where they first part: the layer, then the op (session 20 found XLA's reduce in the norms
this way, and session 19 the attention kernel's key split).

On the bundled SmolLM2 (`cpu` preset), a spec_bench edit prompt is prefilled, then its next K + 1
greedy tokens are decoded one step at a time (each writing its K/V), and the same tokens are run
again as one (K + 1)-row step at the same positions over that cache. Each row's hidden state
after the last layer is compared with its decode's; where some differ, the first layer count at
which they do, and the outputs of that layer's ops (norms, projections, attention, MLP: the
model's functions wrapped to hand their outputs back from the jitted forward).

    PYTHONPATH=. python -P experiments/verify_rows.py [--prompt 3] [--k 7] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

# A probe run from a source tree: its sibling probes and scripts/ (spec_bench) import however
# it is started (`python -P` leaves the script's own folder off sys.path).
sys.path[:0] = [str(Path(__file__).resolve().parent),
                str(Path(__file__).resolve().parents[1] / "scripts")]

from spec_bench import EDITS, render  # noqa: E402

from jengine import Engine  # noqa: E402
from jengine.models import llama  # noqa: E402
from jengine.runtime.step_io import SamplingRows  # noqa: E402
from jengine.scheduling.batch import ScheduledBatch  # noqa: E402

OPS = ("rms_norm", "project", "attend", "_mlp")  # llama's, wrapped by `Probe`


class Probe:
    """Hidden states [T, E] (f32) of one batch after the first `n` layers, and each wrapped op's
    output on the way, from a jitted forward over a copy of the runner's cache."""

    def __init__(self, engine: Engine, prompt_len: int):
        self.runner = engine.core.runner
        self.prompt_len = prompt_len
        self.taps: list[tuple[str, jax.Array]] = []
        for name in OPS:
            setattr(llama, name, self._wrapped(name, getattr(llama, name)))

    def _wrapped(self, name, fn):
        @functools.wraps(fn)
        def tapped(*args, **kwargs):
            out = fn(*args, **kwargs)
            self.taps.append((name, out[0] if isinstance(out, tuple) else out))
            return out
        return tapped

    def batch(self, tokens: list[int], start: int) -> ScheduledBatch:
        """One sequence's `tokens` at positions start.., on pages 1, 2, ..."""
        page = self.runner.page_size
        end = start + len(tokens)
        table = 1 + np.arange(-(-(self.prompt_len + 64) // page), dtype=np.int32)[None]
        pos = np.arange(start, end, dtype=np.int32)
        return ScheduledBatch(
            seq_ids=[0], token_ids=np.asarray(tokens, np.int32), positions=pos,
            slot_mapping=(table[0, pos // page] * page + pos % page).astype(np.int32),
            q_lens=np.array([len(tokens)], np.int32), kv_lens=np.array([end], np.int32),
            page_table=table, sample=np.ones((1,), bool))

    def run(self, batch: ScheduledBatch, layers: int) -> tuple[np.ndarray, list]:
        host, _ = self.runner.host_inputs(batch, SamplingRows.empty(1))
        md = self.runner._to_device(host).attention_metadata()
        params = dict(self.runner.params, layers=self.runner.params["layers"][:layers])
        hidden, taps = self._forward(params, self.runner.kv, md)
        return np.asarray(hidden), [(n, np.asarray(t)) for (n, _), t in zip(self.names, taps)]

    @functools.cached_property
    def _forward(self):
        cfg = self.runner.cfg

        def forward(params, kv, md):
            self.taps.clear()
            hidden = llama.forward(params, cfg, kv, md, all_logits=True, head=False)[0]
            self.names = [(name, None) for name, _ in self.taps]  # set while tracing
            return hidden.astype(jnp.float32), [t.astype(jnp.float32) for _, t in self.taps]

        return jax.jit(forward)


def differing(a: np.ndarray, b: np.ndarray) -> int:
    return int((a != b).sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", type=int, default=3, help="which spec_bench edit prompt")
    ap.add_argument("--k", type=int, default=7, help="proposals: the verification has k + 1 rows")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    engine = Engine(config="cpu", dtype=args.dtype, kv_cache_memory="256MiB", progress=False,
                    enable_prefix_caching=False)
    ids = engine.tokenizer(render(engine, EDITS[args.prompt])).input_ids
    probe = Probe(engine, len(ids))
    runner, rows = probe.runner, SamplingRows.empty(1)
    layers = runner.cfg.num_layers
    chain = [int(np.asarray(runner.execute(probe.batch(ids, 0), rows).tokens)[0])]
    for j in range(args.k + 1):  # the decodes, each writing its K/V
        step = probe.batch([chain[j]], len(ids) + j)
        chain.append(int(np.asarray(runner.execute(step, rows).tokens)[0]))
    # A decode reads no key after its own position, so it can be rerun over the final cache.
    steps = [probe.batch([chain[j]], len(ids) + j) for j in range(args.k + 1)]
    verify = probe.batch(chain[:args.k + 1], len(ids))
    hidden, _ = probe.run(verify, layers)
    counts = [differing(probe.run(steps[j], layers)[0][0], hidden[j])
              for j in range(args.k + 1)]
    print(f"{args.k + 1}-row verification vs its decodes, values differing per row after "
          f"{layers} layers: {counts}")
    if not any(counts):
        return
    for n in range(1, layers + 1):
        hidden, taps = probe.run(verify, n)
        alone = [probe.run(step, n) for step in steps]
        rows_differing = [j for j in range(args.k + 1) if differing(alone[j][0][0], hidden[j])]
        if rows_differing:
            break
    j = rows_differing[0]
    print(f"first after {n} layer(s), in rows {rows_differing}; row {j}, op by op (values that "
          "differ):")
    print([(name, differing(one[0], many[j]))
           for (name, one), (_, many) in zip(alone[j][1], taps)])


if __name__ == "__main__":
    main()
