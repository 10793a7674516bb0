#!/usr/bin/env bash
# 1 prefill + 1 decode vLLM server on this machine, connected by kvxfer, behind a small proxy.
#   bash examples/vllm_pd/run.sh [MODEL_DIR] [tcp|ucx]
# Without MODEL_DIR it writes a tiny random-weight Llama to ./build/tiny (nothing downloaded).
# Then: curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \
#         -d '{"model": "tiny", "prompt": "Hello", "max_tokens": 16}'
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
model="${1:-$here/build/tiny}"
plane="${2:-tcp}"
python="${PYTHON:-python3}"
[ -d "$model" ] || "$python" "$here/tiny_model.py" "$model"
export HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
common=(--served-model-name tiny --enforce-eager --max-model-len 2048 --host 127.0.0.1)
extra="{\"connector\": {\"name\": \"$plane\", \"side_channel\": {\"port\": 5700}}}"
VLLM_CPU_OMP_THREADS_BIND=0 "$python" -m vllm.entrypoints.openai.api_server --model "$model" --port 8100 "${common[@]}" \
  --kv-transfer-config "{\"kv_connector\": \"KvxferConnector\", \"kv_role\": \"kv_producer\", \"kv_connector_extra_config\": $extra}" &
prefill=$!
VLLM_CPU_OMP_THREADS_BIND=1 "$python" -m vllm.entrypoints.openai.api_server --model "$model" --port 8200 "${common[@]}" \
  --kv-transfer-config "{\"kv_connector\": \"KvxferConnector\", \"kv_role\": \"kv_consumer\", \"kv_load_failure_policy\": \"recompute\", \"kv_connector_extra_config\": {\"connector\": {\"name\": \"$plane\", \"side_channel\": {\"port\": 5800}}}}" &
decode=$!
trap 'kill $prefill $decode 2>/dev/null; wait' EXIT
for port in 8100 8200; do
  until curl -sf "localhost:$port/health" >/dev/null; do sleep 1; kill -0 $prefill $decode || exit 1; done
done
"$python" "$here/proxy.py" --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000
