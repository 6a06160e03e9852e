#!/usr/bin/env bash
# Regenerates checkpoints/tiny-v41 from the NeMo oracle harness (released tensor names, FP32).
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
py="${V41CP_ORACLE_PYTHON:-$repo/.oracle-venv/bin/python}"
tmp="$(mktemp -d)"
"$py" "$repo/tests/oracle/nemo_oracle.py" model --preset tiny-sparse --out "$tmp"
dst="$repo/checkpoints/tiny-v41"
mkdir -p "$dst"
cp "$tmp/config.json" "$tmp/tokenizer.json" "$dst/"
cp "$tmp/weights.safetensors" "$dst/model.safetensors"
rm -rf "$tmp"
echo "wrote $dst"
