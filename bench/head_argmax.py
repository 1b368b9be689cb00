"""``python bench/head_argmax.py``: a greedy step's head, logits + numpy's argmax against
``PackedWeight.argmax`` (``native/head_argmax.c``, the logits never written) and, where the build
has one for the mode, against the same head screened (``model/head_screen.py``; for fp32's, where the
default is the int8 screen and the bf16 one applies too, both), in one process.

They take turns on the same rows (thread CPU time, medians after two warm-up turns; 1 thread),
at 1, 8 and 32 rows, for bf16 mode's packing (where the CPU has AVX512-BF16) and fp32's, on
SmolLM2-135M's tied head (49,152 x 576, from ``--model``) or, without that folder, random weights
of its shape. The rows are random, two of their channels 12x and 15x the others (a trained model's
final hidden states carry a few such channels). Prints one line per case with the medians, the
ratios to logits + argmax and whether the tokens agree.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # NOTE: run as a script; the repo root is not on sys.path
    sys.path.insert(0, str(ROOT))

from services.model_runner.model.head_screen import (  # noqa: E402
    HeadScreen,
    HeadScreenInt8,
    make_screen,
    screen_applies,
    screens,
)
from services.model_runner.model.packed import PackedWeight  # noqa: E402
from services.model_runner.native import load_kernels  # noqa: E402
from services.model_runner.sampler import greedy_tokens  # noqa: E402


def _head(model: Path) -> torch.Tensor:
    files = sorted(model.glob("*.safetensors"))
    if not files:
        print(f"no checkpoint in {model}: random weights of SmolLM2-135M's head", flush=True)
        return torch.randn(49152, 576, generator=torch.Generator().manual_seed(0)) * 0.05
    from safetensors.torch import load_file

    return load_file(str(files[0]))["model.embed_tokens.weight"].float()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(Path.home() / ".cache/kvmesh/SmolLM2-135M-Instruct"))
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--repeats", type=int, default=13)
    args = p.parse_args()
    torch.set_num_threads(1)
    kernels = load_kernels()
    if kernels is None or kernels.linear_argmax is None:
        raise SystemExit("no AVX-512 build of the native kernels here: nothing to compare")
    weight = _head(Path(args.model))
    modes = (["native_bf16"] if kernels.linear_bf16 is not None else []) + ["native"]
    for mode in modes:
        head = PackedWeight(weight, None, mode, kernels)
        screened: dict[str, PackedWeight] = {}
        if screens(weight, kernels, mode):
            screened["screened"] = PackedWeight(weight, None, mode, kernels)
            screened["screened"].screen = make_screen(weight, kernels, mode, dense=weight.contiguous())
            if isinstance(screened["screened"].screen, HeadScreenInt8) and mode == "native" and screen_applies(kernels):
                screened["screened-bf16"] = PackedWeight(weight, None, mode, kernels)
                screened["screened-bf16"].screen = HeadScreen(weight, kernels, dense=weight.contiguous())
        for m in args.rows:
            x = torch.randn(m, weight.shape[1], generator=torch.Generator().manual_seed(m)) * 3
            x[:, 17] *= 12.0
            x[:, 199] *= 15.0
            calls = {"logits": lambda x=x, head=head: greedy_tokens(head(x)),
                     "argmax": lambda x=x, head=head: head.argmax(x)}  # fmt: skip
            for name, packed in screened.items():
                calls[name] = lambda x=x, head=packed: head.argmax(x)
            times: dict[str, list[float]] = {name: [] for name in calls}
            for turn in range(args.repeats + 2):
                for name in calls if turn % 2 else reversed(list(calls)):
                    start = time.thread_time()
                    calls[name]()
                    if turn >= 2:
                        times[name].append(time.thread_time() - start)
            med = {name: statistics.median(t) for name, t in times.items()}
            tokens = [calls[name]() for name in calls]
            same = all(torch.equal(tokens[0], t) for t in tokens[1:])
            print(f"{mode} {m} rows: " + ", ".join(f"{name} {med[name] * 1e3:.2f} ms" for name in calls)
                  + "; ratios " + ", ".join(f"{name} {med[name] / med['logits']:.3f}" for name in list(calls)[1:])
                  + f"; same tokens {same}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
