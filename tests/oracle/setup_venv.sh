#!/usr/bin/env bash
# Builds the oracle's own virtual environment (NeMo AutoModel 0.7.0's DeepSeek-V4.1 port on a CPU
# torch). Idempotent. Location: $V41CP_ORACLE_VENV, default <repo>/.oracle-venv.
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
venv="${V41CP_ORACLE_VENV:-$repo/.oracle-venv}"
py="${PYTHON:-python3}"
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import nemo_automodel, torch, transformers" 2>/dev/null; then
  echo "oracle venv ready: $venv"; exit 0
fi
"$py" -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip
"$venv/bin/pip" install -q "torch==2.13.0"
"$venv/bin/pip" install -q "transformers==5.18.0" safetensors pyyaml sympy numpy pillow tokenizers
"$venv/bin/pip" install -q --no-deps "nemo-automodel==0.7.0"
"$venv/bin/python" -c "import nemo_automodel.components.models.deepseek_v41.model"
"$venv/bin/python" -c "from transformers import DeepseekV4ForCausalLM"      # the V4 oracle
echo "oracle venv ready: $venv"
