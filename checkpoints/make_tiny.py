"""Regenerates the embedded tiny checkpoints.

V4.1, from the NeMo oracle (needs tests/oracle/setup_venv.sh):

1. the oracle exports its seeded `tiny-dspark` weights under released names (FP32): the `tiny-sparse` backbone
   and three DSpark stages (``mtp.*``, the port's seeded drafter);
2. `checkpoints/tiny-v41-released/`: those weights in the release's layout and formats (FP8 32×32-block
   dense weights, FP4 routed experts, FP8 Engram rows, e8m0 scales, BF16 / FP32 rest; 3 shards + index);
3. `checkpoints/tiny-v41/`: that released checkpoint converted to orbax (FP32), the CLI's default.

DeepSeek-V4, from v41cp's own seeded initialisation (no oracle needed; ``--v4``):

4. `checkpoints/tiny-v4/`: the `tiny-v4-mtp` model (SWA | HCA ratio 8 | CSA | CSA, two hash-routed MoE layers, the
   MTP layer ``mtp.0``) in the release's V4 layout and formats (FP8 128×128-block dense weights, FP4 routed
   experts, int32 ``tid2eid`` tables, FP32 ``hc_*`` / compressors), with the tiny V4.1's 256-word tokenizer and
   synthetic chat format.

    python checkpoints/make_tiny.py          # V4.1 and V4
    python checkpoints/make_tiny.py --v4     # V4 only
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


def make_tiny_v4():
    import jax

    from v41cp import model
    from v41cp.checkpoint import write_released
    from v41cp.checkpoint.writer import released_tensors
    from v41cp.config import preset
    from v41cp.mtp import init_mtp_params

    cfg = preset("tiny-v4-mtp")
    tensors = released_tensors(cfg, model.init_params(cfg, jax.random.key(0)), init_mtp_params(cfg, jax.random.key(1)))
    out, released = REPO / "checkpoints" / "tiny-v4", REPO / "checkpoints" / "tiny-v41-released"
    shutil.rmtree(out, ignore_errors=True)
    info = write_released(out, cfg, tensors, tokenizer=released / "tokenizer.json", max_shard_bytes=512 * 1024)
    (out / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, indent=1) + "\n")
    print(f"wrote {out}: {info}")


def main():
    if "--v4" in sys.argv[1:]:
        return make_tiny_v4()
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
    make_tiny_v4()


if __name__ == "__main__":
    sys.exit(main())
