"""Throughput with LoRA adapters against the base model alone, in one process and one run.

One engine (`enable_lora`, `--max-loras` = the most adapters asked for) serves `--streams`
concurrent greedy requests of `--output-len` tokens each, the requests spread round-robin
over 0, 1, 4 and 8 distinct random adapters (rank `--rank`, on every q/k/v/o/gate/up/down
projection, written as PEFT directories), each case `--rounds` times after one warm round
(the median is reported). 0 adapters runs the step programs without LoRA work: the base model's
own speed. Offline `Engine.generate`, not a served run: the server adds the same per-token
cost to every case.

    PYTHONPATH=. python -P experiments/lora_bench.py [--model M] [--streams 32] [--output-len 64] [--rank 16]
                                 [--adapters 0 1 4 8] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from jengine import Engine, LoRARequest, SamplingParams

_BLOCK = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
          "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def write_adapter(path: Path, cfg, rank: int, seed: int) -> None:
    """A random PEFT LoRA directory for a Llama-shaped model of `cfg` (`ModelConfig`)."""
    e, f = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {"q_proj": (e, q), "k_proj": (e, kv), "v_proj": (e, kv), "o_proj": (q, e),
              "gate_proj": (e, f), "up_proj": (e, f), "down_proj": (f, e)}
    rng = np.random.default_rng(seed)
    tensors = {}
    for i in range(cfg.num_layers):
        for module, (n_in, n_out) in shapes.items():
            key = f"base_model.model.model.layers.{i}.{_BLOCK[module]}.{module}"
            tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((rank, n_in)) / n_in ** 0.5
                                               ).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = (rng.standard_normal((n_out, rank)) * 0.01
                                               ).astype(np.float32)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": list(shapes)}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model")
    p.add_argument("--config", default="cpu")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--adapters", type=int, nargs="+", default=[0, 1, 4, 8])
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    engine = Engine(args.model, config=args.config, enable_lora=True,
                    max_loras=max(max(args.adapters), 1), max_lora_rank=args.rank,
                    max_num_seqs=max(args.streams, 1), progress=False)
    tmp = Path(tempfile.mkdtemp(prefix="lora_bench_"))
    requests = []
    for i in range(max(args.adapters)):
        write_adapter(tmp / f"a{i}", engine.core.model_config, args.rank, seed=i)
        requests.append(LoRARequest(f"a{i}", i + 1, str(tmp / f"a{i}")))
    prompts = [f"Request {i}: write a long, detailed essay about the history of science."
               for i in range(args.streams)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    base = None
    for k in args.adapters:
        loras = [requests[i % k] if k else None for i in range(args.streams)]
        engine.generate(prompts, params, lora_request=loras)  # warm: compiles, fills slots
        times = []
        for _ in range(args.rounds):
            start = time.perf_counter()
            engine.generate(prompts, params, lora_request=loras)
            times.append(time.perf_counter() - start)
        rate = args.streams * args.output_len / statistics.median(times)
        base = base or rate
        print(f"{k} adapters: {rate:7.1f} tok/s ({rate / base:.2f}x the base) at "
              f"{args.streams} streams, rank {args.rank}", flush=True)


if __name__ == "__main__":
    main()
