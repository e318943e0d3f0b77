"""The default model (SmolLM2-135M-Instruct, Q4_1/Q8_0 GGUF) with packed weights against the
same file dequantized to bf16: teacher-forced top-1 agreement on held-out text, and the
resident bytes the packed weights really take."""
from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from pagedgen import LLM, SamplingParams
from pagedgen.model.layers import quantized_linear as ql
from pagedgen.model.loading import default_model

pytestmark = pytest.mark.slow
WINDOW = 512
# Python's own sources: text the model never saw in this form, present on every machine.
HELD_OUT = ("difflib.py", "fractions.py", "heapq.py", "bisect.py", "shlex.py")


def default_path() -> Path:
    try:
        return Path(default_model.default_model_path())
    except Exception as error:  # noqa: BLE001 - the message says how to install it
        pytest.fail(f"the default model is required here: {error}")


def windows(tokenizer, count: int) -> list[list[int]]:
    folder = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for name in HELD_OUT:
        ids = tokenizer((folder / name).read_text())["input_ids"]
        out += [ids[i:i + WINDOW] for i in range(0, len(ids) - WINDOW, WINDOW)][:2]
    return out[:count]


def top1_per_position(llm: LLM, prompts: list[list[int]]) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    tops = []
    for output in llm.generate(prompts, params, use_tqdm=False):
        for position in output.prompt_logprobs[1:]:
            tops.append(next(t for t, lp in position.items() if lp.rank == 1))
    return tops


def test_teacher_forced_top1_agreement_with_dequantized_weights(monkeypatch):
    """float32 both ways, so that the only difference is the int8 activations. In bf16 the
    oracle itself is noisier than that: on 1,022 positions the dequantized bf16 path agrees
    with the dequantized float32 one on 96.6%, the packed bf16 path on 97.3%, and the two bf16
    paths with each other on 97.5% (docs/gguf_weights.md): a 98% bar between bf16 paths would
    measure bf16's rounding, not the kernels."""
    # Every projection through the int8 kernels (none through the dequantize-and-GEMM route).
    monkeypatch.setattr(ql, "DEQUANTIZE_MIN_ROWS", 1 << 30)
    common = dict(dtype="float32", threads=2, kv_memory=64 << 20, max_num_batched_tokens=256)
    packed = LLM(str(default_path()), weights="packed", **common)
    prompts = windows(packed.get_tokenizer(), 5)
    got = top1_per_position(packed, prompts)
    del packed
    want = top1_per_position(LLM(str(default_path()), weights="dequantized", **common), prompts)
    assert len(got) == len(want) >= 2000
    agreement = sum(a == b for a, b in zip(got, want)) / len(want)
    print(f"top-1 agreement packed vs dequantized, float32: {agreement:.4f} over {len(want)} "
          "positions")
    assert agreement >= 0.98


MEASURE_RESIDENT_WEIGHTS = """
import gc, json, sys
from pathlib import Path
from pagedgen import LLM, SamplingParams
from pagedgen.model.loading.gguf_file import read_gguf

def pss_bytes():
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    raise SystemExit("no Pss line in /proc/self/smaps_rollup")

path = Path(sys.argv[1])
settings = dict(weights="packed", dtype="bfloat16", threads=1, kv_memory=4 << 20)
warm = LLM(str(path), **settings)
warm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
del warm
gc.collect()
file_tensor_bytes = sum(t.data.nbytes for t in read_gguf(path).tensors)
gc.collect()
# Nothing of the file may stay mapped from the warm-up, or its pages would count as "before".
assert str(path.resolve()) not in Path("/proc/self/maps").read_text()
before = pss_bytes()
llm = LLM(str(path), **settings)
llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=2), use_tqdm=False)
kv = llm.runner.kv_cache.numel() * llm.runner.kv_cache.element_size()
print(json.dumps({"resident": pss_bytes() - before - kv, "file_tensor_bytes": file_tensor_bytes}))
"""


def test_resident_weight_bytes_stay_near_the_file_size():
    """PSS change from before the load to after a generate that touches every weight (the LM
    head is the tied embedding table: one step reads all of it), the KV pool subtracted.
    Imports, kernel libraries and the tokenizer are warmed first: they are not weights. It runs
    in a fresh process, as a user's run would: inside a test worker, the heap that other tests
    left behind decides whether a step's activations reuse freed memory or touch new pages."""
    done = subprocess.run([sys.executable, "-c", MEASURE_RESIDENT_WEIGHTS, str(default_path())],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    resident, file_tensor_bytes = figures["resident"], figures["file_tensor_bytes"]
    print(f"resident weights {resident / 2**20:.1f} MiB, file tensors "
          f"{file_tensor_bytes / 2**20:.1f} MiB ({resident / file_tensor_bytes:.3f}x)")
    assert resident <= 1.15 * file_tensor_bytes
