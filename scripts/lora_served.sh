#!/usr/bin/env bash
# Multi-LoRA served benchmark (docs/lora.md): `jengine bench serve` (streaming chat, 32 streams,
# 32 prompts x 128 tokens, EOS ignored) with the prompts spread over 0 / 1 / 4 / 8 distinct
# adapters (rank 16 on every q/k/v/o/gate/up/down projection, random non-zero B; written once
# as PEFT directories and served by both engines), one server at a time on 127.0.0.1:
# jengine with the 8 adapters, then vLLM CPU (bf16) with the same adapters; 0 adapters is the
# base model on the same server (a jengine step without adapters runs the program without
# LoRA work). BASE_ALONE=1 (environment) also serves each without LoRA first. Writes one JSON
# per (server, adapters) and a table to OUT.
#
#   scripts/lora_served.sh OUT HF_DIR [VLLM_PYTHON]
#
# HF_DIR: the model as an HF directory (vLLM cannot read the GGUF; its config sizes the
# adapters). jengine serves its default model (the same SmolLM2 weights, default dtype) with
# the buckets this load needs (32 rows; decode and 512-token prefill chunks), so that warm-up
# builds 2 shapes x 15 programs, not the default buckets' 10 x 15.
set -euo pipefail
out=$(realpath -m "$1"); hf_dir=$2; vllm_python=${3:-}
mkdir -p "$out/adapters"
port=8123
here=$(dirname "$(realpath "$0")")
export PYTHONPATH="$(dirname "$here")${PYTHONPATH:+:$PYTHONPATH}"  # serve this tree
jengine=(python -P -m jengine.cli)
python - "$hf_dir" "$out/adapters" "$here" <<'PY'
import json, sys, types
from pathlib import Path
sys.path.insert(0, sys.argv[3])
from lora_bench import write_adapter
hf = json.loads((Path(sys.argv[1]) / "config.json").read_text())
cfg = types.SimpleNamespace(
    hidden_size=hf["hidden_size"], intermediate_size=hf["intermediate_size"],
    num_heads=hf["num_attention_heads"], num_kv_heads=hf["num_key_value_heads"],
    head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
    num_layers=hf["num_hidden_layers"])
for i in range(8):
    write_adapter(Path(sys.argv[2]) / f"a{i}", cfg, rank=16, seed=i)
PY
modules=()
for i in 0 1 2 3 4 5 6 7; do modules+=("a$i=$out/adapters/a$i"); done

wait_ready() {  # $1 pid; prints seconds to ready
  local start=$SECONDS
  until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do
    kill -0 "$1" 2>/dev/null || { echo "server died" >&2; return 1; }
    sleep 1
  done
  echo $((SECONDS - start))
}

bench() {  # $1 result name, then the model names
  local name=$1; shift
  "${jengine[@]}" bench serve --url "http://127.0.0.1:$port" --concurrency 32 --num-prompts 32 \
    --output-len 128 --served-model "$@" --output-json "$out/$name.json" \
    >/dev/null 2>>"$out/bench.log"
}

serve() {  # $1 name, $2 "lora" or "base", then the command
  local name=$1 kind=$2; shift 2
  "$@" >"$out/$name.server.log" 2>&1 &
  local pid=$!
  wait_ready $pid >"$out/$name.start_s"
  local base
  base=$(curl -sf "http://127.0.0.1:$port/v1/models" | python -c \
    "import json,sys; print(json.load(sys.stdin)['data'][0]['id'])")
  echo "$name up after $(cat "$out/$name.start_s") s, $(date +%T), load $(cut -d' ' -f1-3 /proc/loadavg)"
  if [[ $kind == lora ]]; then
    # warm: every adapter once (vLLM reads an adapter on first use; jengine fills its slots)
    "${jengine[@]}" bench serve --url "http://127.0.0.1:$port" --concurrency 8 --num-prompts 8 \
      --output-len 4 --served-model a0 a1 a2 a3 a4 a5 a6 a7 >/dev/null 2>>"$out/bench.log"
    bench "$name-0" "$base"
    bench "$name-1" a0
    bench "$name-4" a0 a1 a2 a3
    bench "$name-8" a0 a1 a2 a3 a4 a5 a6 a7
  else
    "${jengine[@]}" bench serve --url "http://127.0.0.1:$port" --concurrency 8 --num-prompts 8 \
      --output-len 4 >/dev/null 2>>"$out/bench.log"
    bench "$name-base" "$base"
  fi
  kill "$pid"; wait "$pid" 2>/dev/null || true
}

cat >"$out/buckets.yaml" <<'YAML'
model:
  max_model_len: 256  # 16 pages: the prompts' 46 tokens + 128
scheduler:
  max_num_seqs: 32
  max_num_batched_tokens: 512
  token_buckets: [32, 512]
  seq_buckets: [32]
  page_buckets: [16]
YAML
lora_flags=(--enable-lora --lora-modules "${modules[@]}" --max-loras 8 --max-lora-rank 16)
jserve=("${jengine[@]}" serve --port $port --config "$out/buckets.yaml")
[[ -z ${BASE_ALONE:-} ]] || serve jengine base "${jserve[@]}"
serve jengine-lora lora "${jserve[@]}" "${lora_flags[@]}"
if [[ -n $vllm_python ]]; then
  vllm=(env -u PYTHONPATH VLLM_CPU_KVCACHE_SPACE=2 "$vllm_python" -m vllm.entrypoints.openai.api_server
        --model "$hf_dir" --dtype bfloat16 --host 127.0.0.1 --port $port)
  [[ -z ${BASE_ALONE:-} ]] || serve vllm base "${vllm[@]}"
  serve vllm-lora lora "${vllm[@]}" "${lora_flags[@]}" --max-cpu-loras 8
fi

python - "$out" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
rate = {p.stem: json.loads(p.read_text())["output_tok_per_s"] for p in out.glob("*.json")}
print("| server | base alone | 0 adapters (base model) | 1 | 4 | 8 |")
print("|---|---|---|---|---|---|")
for name in ("jengine", "vllm"):
    alone = rate.get(f"{name}-base")
    base = rate.get(f"{name}-lora-0")
    cells = [f"{alone:.0f}" if alone else "-"]
    for k in (0, 1, 4, 8):
        r = rate.get(f"{name}-lora-{k}")
        cells.append(f"{r:.0f} ({r / base:.2f}x)" if r and base else (f"{r:.0f}" if r else "-"))
    print(f"| {name} | " + " | ".join(cells) + " |")
for k in (0, 1, 4, 8):
    j, v = rate.get(f"jengine-lora-{k}"), rate.get(f"vllm-lora-{k}")
    if j and v:
        print(f"{k} adapters: jengine / vLLM = {j / v:.2f}x")
PY
