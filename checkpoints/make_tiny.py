"""Regenerates the embedded tiny checkpoints from the NeMo oracle (needs tests/oracle/setup_venv.sh):

1. the oracle exports its seeded `tiny-dspark` weights under released names (FP32): the `tiny-sparse` backbone
   and three DSpark stages (``mtp.*``, the port's seeded drafter);
2. `checkpoints/tiny-v41-released/`: those weights in the release's layout and formats (FP8 32×32-block
   dense weights, FP4 routed experts, FP8 Engram rows, e8m0 scales, BF16 / FP32 rest; 3 shards + index);
3. `checkpoints/tiny-v41/`: that released checkpoint converted to orbax (FP32), the CLI's default.

    python checkpoints/make_tiny.py
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# the synthetic chat format of the tiny model (`v41cp.serving.api.text`): its 256-word vocabulary has no chat tokens
TOKENIZER_CONFIG = {
    "v41cp_note": "synthetic chat format of the tiny test model (its 256-word vocabulary has no special chat tokens): "
                  "W0 opens a system turn, W1 a user turn, W2 an assistant turn",
    "bos_token": "<bos>",
    "eos_token": "<eos>",
    "chat_template": "{% for m in messages %}{% if m['role'] == 'system' %}W0 {% elif m['role'] == 'user' %}W1 "
                     "{% else %}W2 {% endif %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}W2{% endif %}",
}


def main():
    from v41cp.checkpoint import convert, write_released
    from v41cp.checkpoint.safetensors_io import SafetensorsFile

    py = os.environ.get("V41CP_ORACLE_PYTHON") or str(REPO / ".oracle-venv" / "bin" / "python")
    released, converted = REPO / "checkpoints" / "tiny-v41-released", REPO / "checkpoints" / "tiny-v41"
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([py, str(REPO / "tests/oracle/nemo_oracle.py"), "dspark", "--preset", "tiny-dspark", "--out",
                        tmp], check=True)
        files = SafetensorsFile(Path(tmp) / "weights.safetensors")
        cfg = json.loads((Path(tmp) / "config.json").read_text())
        shutil.rmtree(released, ignore_errors=True)
        info = write_released(released, cfg, ((k, files.read(k)) for k in sorted(files.tensors)),
                              tokenizer=Path(tmp) / "tokenizer.json", max_shard_bytes=512 * 1024)
    (released / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, indent=1) + "\n")
    print(f"wrote {released}: {info}")
    summary = convert(released, converted, dtype="fp32", progress=False, overwrite=True, keep_quantized=False)
    print(f"wrote {converted}: {summary['tensors']} tensors, {summary['bytes_written']} bytes")


if __name__ == "__main__":
    sys.exit(main())
