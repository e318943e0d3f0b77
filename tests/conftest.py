import os
import sys
from pathlib import Path

# Triton kernels run on CPU tensors through the interpreter; it must be set before any
# kernel is decorated, i.e. before pagedgen.kernels.triton.ops is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import settings as hypothesis_settings  # noqa: E402

# The suite is a specification: every run draws the same Hypothesis examples, so a red run is
# the code's doing and repeats. PAGEDGEN_FUZZ=1 draws new ones (their failures are saved in
# .hypothesis/ and replayed first next time).
hypothesis_settings.register_profile("spec", derandomize=True)
hypothesis_settings.register_profile("fuzz", derandomize=False)
hypothesis_settings.load_profile("fuzz" if os.environ.get("PAGEDGEN_FUZZ") else "spec")

# Helpers are imported as `from tiny_models import ...` whatever pytest's import mode; one module
# name matters: `tests.tiny_models` next to `tiny_models` loads it twice, with separate caches.
_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

# Two cores and pytest-xdist workers: one thread per worker is fastest and deterministic.
torch.set_num_threads(1)


@pytest.fixture(params=[0, 1], ids=["vdpbf16ps", "float32-fma"])
def each_prefill_form(request):
    """Runs a test with each form of the AVX-512 BF16 prefill attention kernel (VDPBF16PS, and
    float32 FMAs on widened K/V), whichever one this CPU's timing would pick."""
    from pagedgen.kernels.cpu import native

    taken = native.prefill_attention_form()
    native.prefill_attention_form(request.param)
    yield request.param
    native.prefill_attention_form(taken)


@pytest.fixture(params=[0, 1], ids=["vector-units", "tile-units"])
def each_unit_form(request):
    """Runs a test with each way the bf16 decode attention runs units of sequences that share
    blocks: vector passes, and (on AMX CPUs; elsewhere the same vector passes) tile products."""
    from pagedgen.kernels.cpu import native

    taken = native.decode_unit_form()
    native.decode_unit_form(request.param)
    yield request.param
    native.decode_unit_form(taken)


@pytest.fixture(params=[0, 1], ids=["vdpbf16ps", "float32-fma"])
def each_gemm_form(request):
    """Runs a test with each form of the AVX-512 BF16 GEMM (VDPBF16PS only, and float32 FMAs
    on widened inputs for calls of many rows), whichever one this CPU's timing would pick."""
    from pagedgen.kernels.cpu import native

    taken = native.avx512_linear_form()
    native.avx512_linear_form(request.param)
    yield request.param
    native.avx512_linear_form(taken)


@pytest.fixture(params=["fastest", "avx2", "portable"])
def each_decode_kernel(request):
    """Runs a test with each bf16 decode-attention kernel: the one this CPU picks first, the AVX2
    one (AVX-512 skipped; without AVX2 the portable loop), and the portable loop."""
    from pagedgen.kernels.cpu import native

    taken = native.decode_kernel()
    native.decode_kernel(request.param)
    yield request.param
    native.decode_kernel(taken)
