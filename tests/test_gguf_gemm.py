"""The packed GGUF GEMM kernels (kernels/cpu/gguf) against an independent float64 reference.

Reference: gguf.quants.dequantize of the very same blocks (float64) times the activations as
given (float32, or bf16 -> float64), no quantization. Every kernel path this CPU can run is
tested as its own library; a path the CPU has but that cannot be built FAILS (no fallback).

The bound, derived from the one approximation the kernels make. Each activation span b is
coded twice in int8: q1 = round(x / d_b) with d_b = amax_b / 127, then the remainder,
q2 = round((x - d_b q1) / e_b) with e_b = d_b / 254; x is taken as e_b (254 q1 + q2), so
|x_j - x^_j| <= e_b / 2. A span is 32 values, but 256 (a super-block) for the K-quants in the
AVX-512 libraries, whose integer sums run over a whole super-block (span_of). Hence

    |y - y_ref| <= sum_j |w_j| e_b(j) / 2  +  (K/16 + 4) * 2^-23 * sum_j |w_j| |x_j|,

the second term covering float32 rounding of the remainder and of the K/16 scaled partial
sums (the integer dot products themselves are exact). The check is worst-case, yet the broken variants below land
outside it, which shows the check has the power to catch them.

The bf16 tile GEMM (libraries with AVX-512 BF16, bf16 activations) makes no approximation but
bf16 rounding of the weights, which it must do exactly as torch rounds gguf's float32 values:
against that rounded weight times the bf16 activations in float64, its only error is float32
summation, |y - y_ref| <= (K/16 + 4) * 2^-23 * sum_j |w_j| |x_j| (tile_bound).
"""
from __future__ import annotations

import platform
from contextlib import contextmanager, nullcontext

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from pagedgen.kernels.cpu import gguf as kernels
from pagedgen.kernels.cpu.gguf import build
from gguf_blocks import (HALF_FIELDS, drop_min, neighbour_scale, random_blocks,
                         scales_off_by_one, swap_nibble_halves)

TYPES = (T.Q8_0, T.Q4_1, T.Q5_0, T.Q4_K, T.Q6_K, T.Q4_0, T.Q5_K, T.Q5_1)
PATHS = ("portable", "avx2", "avx512_vnni", "avx512_bf16", "amx_bf16")
TILE_PATHS = ("avx512_bf16", "amx_bf16")  # the libraries with the bf16 tile GEMM
M_VALUES = (1, 2, 3, 8, 17, 64, 255, 2048)
# (N, K): the default model's and Gemma 3 270M's projections, and odd ones.
SHAPES_32 = ((576, 576), (192, 576), (3072, 576), (576, 1536), (1024, 640), (640, 2048),
             (1, 32), (7, 96), (13, 64))
SHAPES_256 = ((1024, 2048), (640, 1024), (2048, 512), (1, 256), (5, 768), (11, 256))


def runnable_paths() -> list[str]:
    return [path for path in PATHS if build.cpu_supports(path)]


def cases(kind: T, count: int = 4) -> list[tuple[int, int, int]]:
    """(M, N, K) sampled with a seed per type; the large M only with a small N."""
    rng = np.random.default_rng(int(kind))
    shapes = SHAPES_256 if kind in K_QUANTS else SHAPES_32
    out = []
    for i in range(count):
        m = M_VALUES[(int(kind) + 3 * i) % len(M_VALUES)]
        n, k = shapes[rng.integers(len(shapes))]
        if m * n > 300_000:
            n = 96
        out.append((m, n, k))
    return out


K_QUANTS = (T.Q4_K, T.Q5_K, T.Q6_K)
SUPER_SPAN_PATHS = ("avx512_vnni", "avx512_bf16", "amx_bf16")  # K-quant activations stepped per 256


def span_of(path: str, kind: T) -> int:
    return 256 if path in SUPER_SPAN_PATHS and kind in K_QUANTS else 32


def reference(blocks: np.ndarray, kind: T, x: torch.Tensor) -> np.ndarray:
    return x.double().numpy() @ dequantize(blocks, kind).astype(np.float64).T


def bound(blocks: np.ndarray, kind: T, x: torch.Tensor, span: int) -> np.ndarray:
    x64 = x.double().numpy()
    m, k = x64.shape
    step = np.abs(x64).reshape(m, k // span, span).max(-1) / 127.0 / 254.0
    weights = np.abs(dequantize(blocks, kind).astype(np.float64))
    per_value = np.repeat(step / 2, span, axis=1)
    return per_value @ weights.T + (k / 16 + 4) * 2.0 ** -23 * (np.abs(x64) @ weights.T)


def rounded_weights(blocks: np.ndarray, kind: T) -> np.ndarray:
    """gguf's float32 values rounded to bf16 by torch, as float64."""
    return torch.from_numpy(dequantize(blocks, kind)).to(torch.bfloat16).double().numpy()


def tile_reference(blocks: np.ndarray, kind: T, x: torch.Tensor) -> np.ndarray:
    return x.double().numpy() @ rounded_weights(blocks, kind).T


def tile_bound(blocks: np.ndarray, kind: T, x: torch.Tensor) -> np.ndarray:
    k = x.shape[1]
    return (k / 16 + 4) * 2.0 ** -23 * (np.abs(x.double().numpy()) @
                                        np.abs(rounded_weights(blocks, kind)).T)


def activations(m: int, k: int, rng: np.random.Generator, dtype: torch.dtype) -> torch.Tensor:
    x = rng.standard_normal((m, k)) * rng.uniform(0.5, 4.0, (m, 1))
    x[:, rng.integers(k)] *= 20  # an outlier channel, as hidden states have
    return torch.from_numpy(x.astype(np.float32)).to(dtype)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", TYPES, ids=lambda t: t.name)
def test_gemm_matches_float64_reference(path: str, kind: T) -> None:
    if not build.cpu_supports(path):
        pytest.skip(f"this CPU cannot run the {path} path")
    library = kernels.load_path(path)  # raises (fails) when the library cannot be built
    rng = np.random.default_rng(100 + int(kind))
    for index, (m, n, k) in enumerate(cases(kind)):
        blocks = random_blocks(kind, n, k, rng, from_bytes=index % 2 == 1)
        x = activations(m, k, rng, torch.bfloat16 if index % 2 else torch.float32)
        got = kernels.gemm(library, int(kind), blocks, k, x, threads=2).double().numpy()
        error = np.abs(got - reference(blocks, kind, x))
        excess = error - bound(blocks, kind, x, span_of(path, kind))
        assert excess.max() <= 0, (f"{kind.name} {path} M={m} N={n} K={k}: error "
                                   f"{error.max():.3g} beyond the bound by {excess.max():.3g}")


@contextmanager
def tiles_in_form(library, form: int):
    """The library's bf16 tiles in one form (VDPBF16PS 0, float32 FMA 1), whichever this CPU
    takes, then back."""
    taken = kernels.tiles_form(library)
    kernels.tiles_form(library, form)
    try:
        yield
    finally:
        kernels.tiles_form(library, taken)


FORMS = pytest.mark.parametrize("form", [0, 1], ids=["vdpbf16ps", "float32-fma"])


@FORMS
@pytest.mark.parametrize("path", TILE_PATHS)
@pytest.mark.parametrize("kind", TYPES, ids=lambda t: t.name)
def test_bf16_tiles_are_the_rounded_weights_product(path: str, kind: T, form: int) -> None:
    if not build.cpu_supports(path):
        pytest.skip(f"this CPU cannot run the {path} path")
    library = kernels.load_path(path)
    assert kernels.has_bf16_tiles(library)
    with tiles_in_form(library, form):
        check_tiles_against_the_rounded_weights(library, kind)


def check_tiles_against_the_rounded_weights(library, kind: T) -> None:
    rng = np.random.default_rng(200 + int(kind))
    for index, (m, n, k) in enumerate(cases(kind, count=5)):
        blocks = random_blocks(kind, n, k, rng, from_bytes=index % 2 == 1)
        x = activations(m, k, rng, torch.bfloat16)
        got = kernels.gemm(library, int(kind), blocks, k, x, threads=2,
                           bf16_from_rows=1).double().numpy()
        error = np.abs(got - tile_reference(blocks, kind, x))
        excess = error - tile_bound(blocks, kind, x)
        assert excess.max() <= 0, (f"{kind.name} tiles M={m} N={n} K={k}: error "
                                   f"{error.max():.3g} beyond the bound by {excess.max():.3g}")


@FORMS
@pytest.mark.parametrize("kind", (T.Q4_1, T.Q8_0, T.Q4_K, T.Q6_K), ids=lambda t: t.name)
def test_panel_tiles_are_the_dense_gemm_on_the_rounded_weights_bit_for_bit(kind: T,
                                                                           form: int) -> None:
    """From 16-24 rows on the tiles run the dense GEMM's own micro-tiles (VDPBF16PS or
    float32, as the tiles' form) on weight panels decoded per tile: the dense GEMM in the
    same form on the dequantized bf16 weight gives the same sums, so the same bits once
    rounded to bf16. Weights of 1, 2 and 3 whole panels and some more blocks; rows in and
    past micro-tiles, up to the row counts the dense GEMM took before the panels."""
    from pagedgen.kernels.cpu import native

    if not build.cpu_supports("avx512_bf16") or native.gemm_kind() != "avx512":
        pytest.skip("needs the AVX-512 BF16 tiles and the dense AVX-512 BF16 GEMM")
    library = kernels.load_path("avx512_bf16")
    rng = np.random.default_rng(300 + int(kind))
    taken = native.avx512_linear_form()
    native.avx512_linear_form(form)
    try:
        with tiles_in_form(library, form):
            check_tiles_are_the_dense_gemm(library, kind, native.avx512_linear, rng,
                                           ((48, 29), (96, 64), (160, 40), (208, 33), (64, 17), (48, 203)))
    finally:
        native.avx512_linear_form(taken)


@pytest.mark.parametrize("kind", (T.Q5_0, T.Q8_0, T.Q4_K, T.Q6_K), ids=lambda t: t.name)
def test_amx_tiles_are_the_dense_amx_gemm_on_the_rounded_weights_bit_for_bit(kind: T) -> None:
    """The AMX tiles run the dense AMX GEMM's own column pairs on weight panels decoded per
    call: the dense AMX GEMM on the dequantized bf16 weight gives the same float32 sums, so
    the same bits once rounded to bf16. Whole and partial 16-row blocks, weights of whole and
    partial 32-row panels (the dense GEMM takes widths of whole 16-column blocks); several
    panels per thread (each decoded while the one before it is multiplied), several chunks of
    activation rows, and rows long enough to be taken in runs of K (a short last run), the
    sums carried from run to run for every panel of the share."""
    from pagedgen.kernels.cpu import native

    if not build.cpu_supports("amx_bf16") or native.gemm_kind() != "amx":
        pytest.skip("needs the AMX tiles and the dense AMX GEMM")
    library = kernels.load_path("amx_bf16")
    rng = np.random.default_rng(400 + int(kind))
    check_tiles_are_the_dense_gemm(library, kind, native.amx_linear, rng,
                                   ((64, 32), (96, 17), (48, 64), (160, 5), (32, 1), (224, 40),
                                    (64, 1030)))
    check_tiles_are_the_dense_gemm(library, kind, native.amx_linear, rng,
                                   ((96, 20), (224, 40), (64, 300)), k=4608)


def check_tiles_are_the_dense_gemm(library, kind: T, dense_linear, rng, shapes,
                                   k: int = 512) -> None:
    """For each (N, M): the tiles' output rounded to bf16 is dense_linear's bf16 output on the
    dequantized bf16 weight, bit for bit."""
    from pagedgen.kernels.cpu import native

    for n, m in shapes:
        blocks = random_blocks(kind, n, k, rng)
        x = activations(m, k, rng, torch.bfloat16)
        tiles = kernels.gemm(library, int(kind), blocks, k, x, bf16_from_rows=1)
        weight = torch.from_numpy(dequantize(blocks, kind)).to(torch.bfloat16)
        dense = dense_linear(x, native.gemm_pack(weight), n)
        assert torch.equal(tiles.to(torch.bfloat16), dense), (kind.name, n, m)


def test_bf16_tiles_run_only_where_asked_and_for_bf16_rows() -> None:
    """From bf16_from_rows rows on (bf16 x only) the tiles answer; below, for float32 x, and in
    every library without them, the int8 kernel does, bit for bit the same as when not asked."""
    rng = np.random.default_rng(11)
    blocks = random_blocks(T.Q4_K, 40, 512, rng)
    x = activations(6, 512, rng, torch.bfloat16)
    for path in runnable_paths():
        library = kernels.load_path(path)
        int8 = kernels.gemm(library, int(T.Q4_K), blocks, 512, x)
        below = kernels.gemm(library, int(T.Q4_K), blocks, 512, x, bf16_from_rows=7)
        assert torch.equal(below, int8), path
        as_float = kernels.gemm(library, int(T.Q4_K), blocks, 512, x.float(), bf16_from_rows=1)
        assert torch.equal(as_float, kernels.gemm(library, int(T.Q4_K), blocks, 512, x.float()))
        asked = kernels.gemm(library, int(T.Q4_K), blocks, 512, x, bf16_from_rows=6)
        assert torch.equal(asked, int8) != kernels.has_bf16_tiles(library), path
        assert kernels.has_bf16_tiles(library) == (path in TILE_PATHS), path


@FORMS
@pytest.mark.parametrize("kind", (T.Q8_0, T.Q4_K), ids=lambda t: t.name)
def test_outputs_rounded_to_bf16_in_the_kernel_are_the_bf16_result_widened(kind: T,
                                                                          form: int) -> None:
    """The LM head asks for float32 logits that are the bf16 result widened (as the dense
    GEMM gives them); the kernels round while the outputs are in cache. Every route: the int8
    kernel, the tiles below and the panel tiles from a few dozen rows; a column slice of a
    wider output keeps its neighbours untouched."""
    rng = np.random.default_rng(40 + int(kind))
    n, k = 100, 512  # 100 columns: panels of 48 and a narrower last one
    blocks = random_blocks(kind, n, k, rng)
    for path in runnable_paths():
        library = kernels.load_path(path)
        forms = tiles_in_form(library, form) if kernels.has_bf16_tiles(library) else nullcontext()
        with forms:
            for m, tiles_from in ((3, 0), (5, 1), (17, 1), (40, 1)):
                x = activations(m, k, rng, torch.bfloat16)
                plain = kernels.gemm(library, int(kind), blocks, k, x, bf16_from_rows=tiles_from)
                wide = torch.full((m, n + 9), 7.25)
                rounded = kernels.gemm(library, int(kind), blocks, k, x, out=wide[:, 4:4 + n],
                                       bf16_from_rows=tiles_from, round_to_bf16=True)
                assert torch.equal(rounded, plain.to(torch.bfloat16).float()), (path, m)
                assert not torch.equal(plain, rounded), (path, m)  # it did round
                assert (wide[:, :4] == 7.25).all() and (wide[:, 4 + n:] == 7.25).all()


def test_the_vector_libraries_decode_in_registers() -> None:
    """The AVX-512 and AVX2 libraries' GEMM decodes blocks in registers for every row count
    (and is the kernel the reference check above runs there, M from 1 to 2048); portable
    unpacks tiles."""
    for path in runnable_paths():
        expected = int(path != "portable")
        assert kernels.load_path(path).library.gguf_decodes_in_registers() == expected, path


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", TYPES, ids=lambda t: t.name)
def test_row_and_column_remainders(path: str, kind: T) -> None:
    """Row counts around the register kernels' blocking (activation rows in fours, weight rows
    in fours, activation rows in L2-sized chunks: 128 rows at K = 1024) with N not a multiple
    of four."""
    if not build.cpu_supports(path):
        pytest.skip(f"this CPU cannot run the {path} path")
    library = kernels.load_path(path)
    rng = np.random.default_rng(200 + int(kind))
    k = 1024 if kind in K_QUANTS else 96
    blocks = random_blocks(kind, 7, k, rng)
    for index, m in enumerate((1, 2, 3, 4, 5, 6, 7, 131)):
        x = activations(m, k, rng, torch.bfloat16 if index % 2 else torch.float32)
        got = kernels.gemm(library, int(kind), blocks, k, x, threads=2).double().numpy()
        excess = (np.abs(got - reference(blocks, kind, x)) -
                  bound(blocks, kind, x, span_of(path, kind)))
        assert excess.max() <= 0, f"{kind.name} {path} M={m}: beyond the bound by {excess.max():.3g}"


BREAKAGES = [(swap_nibble_halves, T.Q4_0), (swap_nibble_halves, T.Q4_1),
             (swap_nibble_halves, T.Q4_K), (swap_nibble_halves, T.Q5_0),
             (neighbour_scale, T.Q8_0), (neighbour_scale, T.Q4_1), (neighbour_scale, T.Q6_K),
             (neighbour_scale, T.Q4_K), (drop_min, T.Q4_1), (drop_min, T.Q4_K),
             (drop_min, T.Q5_K), (scales_off_by_one, T.Q4_K), (scales_off_by_one, T.Q5_K)]


@pytest.mark.parametrize("breakage, kind", BREAKAGES,
                         ids=[f"{b.__name__}-{t.name}" for b, t in BREAKAGES])
def test_the_check_catches_broken_unpacking(breakage, kind: T) -> None:
    """A kernel computing from the broken blocks would fail the check: the right kernel's
    output lies outside the bound around the broken reference (at the model's shape)."""
    path = runnable_paths()[-1]
    library, span = kernels.load_path(path), span_of(path, kind)
    rng = np.random.default_rng(7)
    k = 2048 if kind in K_QUANTS else 576
    blocks = random_blocks(kind, 64, k, rng)
    x = activations(4, k, rng, torch.float32)
    got = kernels.gemm(library, int(kind), blocks, k, x).double().numpy()
    assert (np.abs(got - reference(blocks, kind, x)) <= bound(blocks, kind, x, span)).all()
    broken = breakage(blocks, kind)
    assert not np.array_equal(broken, blocks)
    assert (np.abs(got - reference(broken, kind, x)) > bound(broken, kind, x, span)).any()
    tiles = [path for path in runnable_paths() if path in TILE_PATHS]
    if tiles:  # the same for the tiles' (much tighter) check
        x = x.to(torch.bfloat16)
        got = kernels.gemm(kernels.load_path(tiles[-1]), int(kind), blocks, k, x,
                           bf16_from_rows=1).double().numpy()
        assert (np.abs(got - tile_reference(blocks, kind, x)) <= tile_bound(blocks, kind, x)).all()
        assert (np.abs(got - tile_reference(broken, kind, x)) > tile_bound(broken, kind, x)).any()


@pytest.mark.parametrize("kind", TYPES, ids=lambda t: t.name)
def test_row_lookup_is_exactly_the_dequantized_rows(kind: T) -> None:
    """Every path, bit for bit: the register libraries decode rows as their GEMMs do (and the
    bf16 tiles rely on that rounding), portable from its unpacked tiles."""
    rng = np.random.default_rng(3)
    k = 512
    blocks = random_blocks(kind, 40, k, rng)
    rows = torch.tensor([39, 0, 5, 5, 17], dtype=torch.int64)
    expected = dequantize(blocks, kind)[rows.numpy()]
    for path in runnable_paths():
        library = kernels.load_path(path)
        got = kernels.dequantize_rows(library, int(kind), blocks, k, rows)
        np.testing.assert_array_equal(got.numpy(), expected, err_msg=path)
        got_bf16 = kernels.dequantize_rows(library, int(kind), blocks, k, rows, torch.bfloat16)
        assert torch.equal(got_bf16, torch.from_numpy(expected).to(torch.bfloat16)), path


# fp16 scales of every finite kind: zeros of both signs, subnormals, the extremes of the normal
# range, negatives (random blocks have only small positive normal ones).
SPECIAL_HALVES = np.array([0.0, -0.0, 6e-8, -3e-6, 6.1035156e-05, -6.1035156e-05, 1.0, -2.5,
                           65504.0, -65504.0, 1e-3], dtype=np.float16)


@pytest.mark.parametrize("kind", TYPES, ids=lambda t: t.name)
def test_scales_of_every_fp16_kind_decode_exactly(kind: T) -> None:
    """Row look-ups with zero, subnormal, extreme and negative scales and mins are gguf's values
    bit for bit in float32 (and their bf16 rounding), on every path."""
    rng = np.random.default_rng(5)
    k = 512
    blocks = random_blocks(kind, 8, k, rng)
    view = blocks.reshape(8, k // (256 if kind in K_QUANTS else 32), -1)
    for field in HALF_FIELDS[kind]:
        halves = rng.choice(SPECIAL_HALVES, view.shape[:2])
        view[:, :, field:field + 2] = halves.view(np.uint8).reshape(*view.shape[:2], 2)
    expected = dequantize(blocks, kind)
    for path in runnable_paths():
        library = kernels.load_path(path)
        got = kernels.dequantize_rows(library, int(kind), blocks, k)
        np.testing.assert_array_equal(got.numpy(), expected, err_msg=path)
        got_bf16 = kernels.dequantize_rows(library, int(kind), blocks, k,
                                           value_dtype=torch.bfloat16)
        assert torch.equal(got_bf16, torch.from_numpy(expected).to(torch.bfloat16)), path


def test_row_map_and_strided_output() -> None:
    """Columns come from the mapped rows and land in a column slice of a wider output."""
    library = kernels.load_path(runnable_paths()[-1])
    rng = np.random.default_rng(4)
    blocks = random_blocks(T.Q4_1, 24, 64, rng)
    x = activations(3, 64, rng, torch.float32)
    rows = torch.tensor([23, 1, 7], dtype=torch.int64)
    wide = torch.zeros(3, 10)
    kernels.gemm(library, int(T.Q4_1), blocks, 64, x, row_map=rows, out=wide[:, 4:7])
    full = kernels.gemm(library, int(T.Q4_1), blocks, 64, x)
    assert torch.equal(wide[:, 4:7], full[:, rows])
    assert not wide[:, :4].any() and not wide[:, 7:].any()


def test_every_path_this_cpu_has_is_built_and_the_widest_is_chosen() -> None:
    """No silent fallback: on a CPU with VNNI the VNNI library must exist and be the one used."""
    paths = runnable_paths()
    assert "portable" in paths
    for path in paths:
        assert kernels.load_path(path).library.gguf_path_name().decode() == path
    chosen = build.best()
    assert chosen is not None and chosen.path == (build.forced_path() or paths[-1])


def test_the_amx_library_builds_where_the_cpu_cannot_run_it() -> None:
    """The AMX tiles are compiled and linked on every x86 machine with the compiler, so a
    build break shows on CPUs without AMX too (where only their tests can skip)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 only")
    library = kernels.load_path("amx_bf16")
    assert library.library.gguf_path_name().decode() == "amx_bf16" and library.bf16_tiles


def test_bad_shapes_are_refused_with_a_message() -> None:
    library = kernels.load_path("portable")
    blocks = random_blocks(T.Q8_0, 4, 64, np.random.default_rng(0))
    with pytest.raises(ValueError, match="not contiguous rows of 96"):
        kernels.gemm(library, int(T.Q8_0), blocks, 96, torch.zeros(1, 96))
    with pytest.raises(ValueError, match="x must be"):
        kernels.gemm(library, int(T.Q8_0), blocks, 64, torch.zeros(1, 32))
    with pytest.raises(ValueError, match="no packed kernel"):
        kernels.gemm(library, 0, blocks, 64, torch.zeros(1, 64))


@FORMS
@pytest.mark.parametrize("path", PATHS)
def test_the_team_projection_is_the_layer_path_bit_for_bit(path: str, form: int) -> None:
    """gguf_linear_team (what the fused decode step runs) against quantized_linear (the layer
    path) on a projection of three parts of different types, one read through a row map, with
    and without a bias: the same bf16 values, on the int8 kernel's row counts and the tiles'."""
    from pagedgen.kernels.cpu.gguf import team
    from pagedgen.model.layers import quantized_linear as ql

    if not build.cpu_supports(path):
        pytest.skip(f"this CPU cannot run the {path} path")
    library = build.load_path(path)
    rng = np.random.default_rng(7)
    k, parts = 512, []
    for kind, rows in ((T.Q4_K, 48), (T.Q6_K, 16), (T.Q8_0, 23)):
        blocks = random_blocks(kind, rows, k, rng)
        row_map = torch.from_numpy(rng.permutation(rows)) if kind == T.Q4_K else None
        parts.append(ql.QuantizedPart(int(kind), blocks, row_map, rows))
    weight = ql.QuantizedWeight(tuple(parts), k, library)
    tiles_from = ql.tiles_min_rows(library, (p.tensor_type for p in parts))
    described = team.projection([(p.tensor_type, p.blocks, p.row_map, p.out_features)
                                 for p in parts], k, tiles_from)
    bias = torch.randn(weight.out_features).to(torch.bfloat16)
    with tiles_in_form(library, form):
        for m in (1, 3, tiles_from, 17, ql.dequantize_min_rows(library) - 1):
            x = torch.randn(m, k).to(torch.bfloat16)
            for with_bias in (None, bias):
                want = ql.quantized_linear(x, weight, with_bias)
                assert torch.equal(team.linear(library, described, x, with_bias), want), \
                    (m, with_bias)


def test_the_team_projection_refuses_what_it_cannot_describe() -> None:
    from pagedgen.kernels.cpu.gguf import team

    blocks = random_blocks(T.Q8_0, 4, 64, np.random.default_rng(0))
    assert team.projection([(int(T.Q8_0), blocks, None, 4)] * (team.MAX_PARTS + 1), 64, 4) is None
    assert team.projection([(int(T.Q8_0), blocks[:, ::2], None, 4)], 64, 4) is None
    described = team.projection([(int(T.Q8_0), blocks, None, 4)], 64, 4)
    with pytest.raises(ValueError, match="bias"):
        team.linear(kernels.best(), described, torch.zeros(1, 64, dtype=torch.bfloat16),
                    torch.zeros(5, dtype=torch.bfloat16))
