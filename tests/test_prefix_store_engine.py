"""The prefix store on disk inside the engine: a warm store changes no output bit.

Oracle: the same LLM settings with the store off. Workload: greedy float32 on a tiny model,
prompts sharing a long prefix (memory hits), prompts longer than the step budget (chunked
prefill), n > 1, and a pool small enough to preempt; then the same again against the store
written by the first run (store hits), also with an 8-bit KV pool.
"""

from __future__ import annotations

import errno
import os
import random
import shutil
import warnings

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from pagedgen import LLM, SamplingParams
from pagedgen.engine.prefix_store import BlockStore, block_keys
from pagedgen.engine.prefix_store import block_file
from pagedgen.engine.prefix_store.store import StoreWarning
from tiny_models import tiny_model_dir

BLOCK = 16


def prompts(seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 500) for _ in range(70)]
    items = [shared + [rng.randrange(3, 500) for _ in range(rng.randrange(5, 60))] for _ in range(4)]
    items += [[rng.randrange(3, 500) for _ in range(rng.randrange(100, 180))] for _ in range(3)]
    return [{"prompt_token_ids": p} for p in items]


def params(logprobs: int | None = None) -> list[SamplingParams]:
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=logprobs)
    sampled = SamplingParams(temperature=0.8, n=3, seed=7, max_tokens=5, ignore_eos=True,
                             logprobs=logprobs)
    return [greedy, sampled] * 3 + [greedy]


def make_llm(store, kv_cache_dtype: str = "auto", dtype: str = "float32",
             batch_invariant: bool = False, num_blocks: int = 18, model_seed: int = 0) -> LLM:
    return LLM(str(tiny_model_dir(seed=model_seed)), dtype=dtype, num_blocks=num_blocks,
               block_size=BLOCK, threads=1, max_num_seqs=4, max_num_batched_tokens=48,
               kv_cache_dtype=kv_cache_dtype, batch_invariant=batch_invariant,
               prefix_store=store)


def run(llm: LLM, logprobs: int | None = None, **kw) -> list:
    outputs = llm.generate(prompts(), params(logprobs), use_tqdm=False, **kw)
    return [[(c.token_ids, _logprobs(c)) for c in o.outputs] for o in outputs]


def _logprobs(completion) -> list | None:
    if completion.logprobs is None:
        return None
    return [{t: lp.logprob for t, lp in pos.items()} for pos in completion.logprobs]


def store_report(llm: LLM) -> dict:
    return llm.memory_report()["prefix_store"]


@pytest.fixture(scope="module")
def reference() -> dict:
    """Outputs with the store off, per KV format."""
    return {kv: run(make_llm(None, kv)) for kv in ("auto", "int8")}


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_cold_and_warm_store_runs_give_the_same_tokens(tmp_path, reference, kv_cache_dtype):
    folder = tmp_path / "store"
    cold_llm = make_llm(folder, kv_cache_dtype)
    cold = run(cold_llm)
    assert cold_llm.engine.scheduler.stats.preemptions > 0  # the pool is small enough to preempt
    assert cold_llm.engine.kv.counters.prefix_hit_tokens > 0  # memory hits on the shared prefix
    written = store_report(cold_llm)["blocks_written"]
    assert written > 0 and BlockStore(folder).stats().files == written

    warm_llm = make_llm(folder, kv_cache_dtype)
    warm = run(warm_llm)
    assert cold == warm == reference[kv_cache_dtype]
    report = store_report(warm_llm)
    assert report["hit_blocks"] > 0 and report["bytes_read"] > 0
    assert report["damaged_removed"] == 0
    # Store hits were not computed again.
    computed_cold = cold_llm.engine.scheduler.stats.prompt_tokens_computed
    computed_warm = warm_llm.engine.scheduler.stats.prompt_tokens_computed
    assert computed_warm <= computed_cold - report["hit_tokens"] // 2


def test_stored_bytes_are_what_the_warm_run_attends_to(tmp_path, reference):
    """A block rewritten with other values (checksum made valid) changes the output: the warm
    run really reads the pool from the store, so the equality above is not vacuous."""
    folder = tmp_path / "store"
    run(make_llm(folder))
    store = BlockStore(folder)
    for path, _ in store.block_files():
        data = path.read_bytes()
        key, size = block_file.read_header(memoryview(data))
        path.write_bytes(b"".join(block_file.encode(key, bytes(size))))  # all-zero K/V
    assert run(make_llm(folder)) != reference["auto"]


def test_batch_invariant_bf16_is_bit_identical_with_a_warm_store(tmp_path):
    off = run(make_llm(None, dtype="bfloat16", batch_invariant=True), logprobs=2)
    cold = run(make_llm(tmp_path / "s", dtype="bfloat16", batch_invariant=True), logprobs=2)
    warm_llm = make_llm(tmp_path / "s", dtype="bfloat16", batch_invariant=True)
    warm = run(warm_llm, logprobs=2)
    assert store_report(warm_llm)["hit_blocks"] > 0
    assert off == cold == warm  # tokens and logprobs, bit for bit


def test_another_model_does_not_read_the_blocks(tmp_path, reference):
    folder = tmp_path / "store"
    run(make_llm(folder, model_seed=1))
    llm = make_llm(folder, num_blocks=64)  # no preemption: no hits on its own blocks either
    assert run(llm) == reference["auto"]
    assert store_report(llm)["hit_blocks"] == 0


def test_a_foreign_block_under_the_right_name_is_a_miss(tmp_path, reference):
    """Blocks of another model renamed to the keys this model asks for: the key inside each
    file does not match, so every one is a miss, removed, with a warning."""
    theirs, ours = tmp_path / "theirs", tmp_path / "ours"
    run(make_llm(theirs, model_seed=1))
    run(make_llm(ours))
    foreign = [p for p, _ in BlockStore(theirs).block_files()]
    targets = [p for p, _ in BlockStore(ours).block_files()]
    for source, target in zip(foreign * len(targets), targets):
        shutil.copyfile(source, target)
    llm = make_llm(ours, num_blocks=64)
    with pytest.warns(StoreWarning, match="another key"):
        assert run(llm) == reference["auto"]
    assert store_report(llm)["hit_blocks"] == 0 and store_report(llm)["damaged_removed"] > 0


def test_another_kv_format_does_not_read_the_blocks(tmp_path, reference):
    folder = tmp_path / "store"
    run(make_llm(folder, "int8"))
    llm = make_llm(folder, num_blocks=64)
    assert run(llm) == reference["auto"] and store_report(llm)["hit_blocks"] == 0


def test_a_killed_run_leaves_its_computed_blocks_for_the_rerun(tmp_path, reference):
    """Stopped after its first finished request (as Ctrl-C would), the run has flushed the
    blocks it computed, so the rerun of the whole batch (--resume reruns the rest) reads them."""
    folder = tmp_path / "store"

    def stop(_output):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run(make_llm(folder), on_output=stop)
    stored = BlockStore(folder).stats().files
    assert stored > 0
    llm = make_llm(folder)
    assert run(llm) == reference["auto"]
    assert store_report(llm)["hit_blocks"] > 0


def test_store_deleted_mid_run(tmp_path, reference):
    folder = tmp_path / "store"
    run(make_llm(folder))
    llm = make_llm(folder)

    def delete(_output):
        shutil.rmtree(folder, ignore_errors=True)

    with pytest.warns(StoreWarning):
        assert run(llm, on_output=delete) == reference["auto"]


def test_read_only_store_reads_and_warns_once(tmp_path, reference, monkeypatch):
    folder = tmp_path / "store"
    run(make_llm(folder))
    if os.geteuid() == 0:  # root writes through a 0500 folder: make the writes fail as they would
        def read_only(self, key, payload):
            raise OSError(errno.EROFS, "Read-only file system")
        monkeypatch.setattr(BlockStore, "write", read_only)
    modes = _chmod_tree(folder, 0o500)
    try:
        llm = make_llm(folder)
        with pytest.warns(StoreWarning, match="stopped writing"):  # flushed by generate
            llm.generate([{"prompt_token_ids": list(range(3, 60))}],
                         SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
                         use_tqdm=False)
        assert run(llm) == reference["auto"]
        assert store_report(llm)["hit_blocks"] > 0
        assert store_report(llm)["write_stopped"]
    finally:
        _chmod_tree(folder, 0o700, modes)


def test_full_disk_is_a_warning(tmp_path, reference, monkeypatch):
    def full(self, key, payload):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(BlockStore, "write", full)
    llm = make_llm(tmp_path / "store")
    with pytest.warns(StoreWarning, match="No space left"):
        assert run(llm) == reference["auto"]
    assert store_report(llm)["write_stopped"] == "No space left on device"


def test_a_store_others_can_write_to_is_refused(tmp_path):
    from pagedgen.engine.prefix_store.store import UnsafeStoreError

    folder = tmp_path / "shared"
    folder.mkdir()
    folder.chmod(0o777)
    with pytest.raises(UnsafeStoreError, match="writable by others"):
        make_llm(folder)


def test_prefix_store_needs_prefix_caching(tmp_path):
    with pytest.raises(ValueError, match="prefix caching"):
        LLM(str(tiny_model_dir()), dtype="float32", num_blocks=16, threads=1,
            enable_prefix_caching=False, prefix_store=tmp_path / "s")


def test_keys_are_the_same_in_another_process(tmp_path):
    """Keys must not depend on the process (Python's string hash does): a subprocess with
    another hash seed computes the same keys."""
    import subprocess
    import sys

    code = ("from pagedgen.engine.prefix_store import block_keys;"
            "print(*[k.hex() for k in block_keys(b'r' * 32, list(range(40)), 16, 2)])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123", "PATH": ""}).stdout.split()
    assert out == [k.hex() for k in block_keys(b"r" * 32, list(range(40)), 16, 2)]


def _chmod_tree(folder, mode, restore: dict | None = None) -> dict:
    old = {}
    paths = sorted((p for p in folder.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts))
    for path in [*paths, folder] if restore is None else [folder, *reversed(paths)]:
        old[path] = path.stat().st_mode & 0o777
        path.chmod(restore.get(path, mode) if restore is not None else mode)
    return old


# --- a property test over random store damage ---


_DAMAGE = st.lists(st.tuples(
    st.sampled_from(["truncate", "flip", "swap", "delete", "garbage", "zero_payload"]),
    st.integers(0, 10_000), st.integers(0, 10_000)), min_size=1, max_size=6)


@pytest.fixture(scope="module")
def cold_files(tmp_path_factory) -> dict:
    """The files a cold run wrote, by name relative to the store folder."""
    folder = tmp_path_factory.mktemp("cold") / "store"
    run(make_llm(folder, num_blocks=64))
    return {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@settings(max_examples=10, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(damage=_DAMAGE)
def test_random_store_damage_never_changes_the_output(tmp_path_factory, cold_files, reference,
                                                       damage):
    folder = tmp_path_factory.mktemp("damaged") / "store"
    for name, data in cold_files.items():
        (folder / name).parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    blocks = sorted(p for p in folder.rglob("*.kvb"))
    for op, a, b in damage:
        _damage(blocks[a % len(blocks)], blocks[b % len(blocks)], op, b)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", StoreWarning)  # damage is expected to warn
        assert run(make_llm(folder, num_blocks=64)) == reference["auto"]


def _damage(path, other, op: str, at: int) -> None:
    if not path.exists():
        return
    data = bytearray(path.read_bytes())
    if op == "truncate":
        data = data[:at % max(1, len(data))]
    elif op == "flip" and data:
        data[at % len(data)] ^= 1 << (at % 8)
    elif op == "swap" and other.exists():
        other_data = other.read_bytes()
        other.write_bytes(bytes(data))
        data = bytearray(other_data)
    elif op == "delete":
        path.unlink()
        return
    elif op == "garbage":
        data = bytearray(os.urandom(len(data)))
    elif op == "zero_payload":  # a well-formed file of the right key whose K/V are wrong and
        # whose checksum therefore fails: only the checksum stops it
        data[block_file.HEADER_SIZE:] = bytes(len(data) - block_file.HEADER_SIZE)
    path.write_bytes(bytes(data))


def test_cli_run_with_a_prefix_store_reports_its_hits(tmp_path):
    """--prefix-store through `pagedgen run`: the second run of the same file reads the
    blocks the first wrote, with the same completions; the memory report counts the hits."""
    import json

    from typer.testing import CliRunner

    from pagedgen.cli.app import app

    inputs = tmp_path / "in.jsonl"
    inputs.write_text("".join(json.dumps({"id": str(i), "prompt_token_ids": p["prompt_token_ids"]})
                              + "\n" for i, p in enumerate(prompts())))
    args = ["run", str(inputs), "--model", str(tiny_model_dir()), "--dtype", "float32",
            "--num-blocks", "64", "--threads", "1", "--max-tokens", "4", "--temperature", "0",
            "--prefix-store", str(tmp_path / "store"), "--overwrite", "-q"]
    results = []
    for _ in range(2):
        result = CliRunner().invoke(app, args, catch_exceptions=False)
        assert result.exit_code == 0, result.output
        report = json.loads((tmp_path / "in.completions.report" /
                             "memory_report.json").read_text())
        lines = [json.loads(line) for line in
                 (tmp_path / "in.completions.jsonl").read_text().splitlines()]
        tokens = sorted((r["id"], r["outputs"][0]["token_ids"]) for r in lines)
        results.append((tokens, report["prefix_store"]))
    assert results[0][0] == results[1][0]
    assert results[0][1]["blocks_written"] > 0 and results[1][1]["hit_blocks"] > 0


# --- sliding-window models: hybrid pools (Gemma 3) and every layer sliding (Mistral) ---

WINDOW_BLOCK = 8
WINDOW_NEW_TOKENS = 24
WINDOW_ARCHITECTURES = ["gemma3", "mistral_window"]  # windows 16 and 24 (tiny_models.WINDOWS)


def window_prompts(arch: str) -> list[list[int]]:
    """A prefix five windows long shared by three prompts (memory and store hits), tails
    shorter and longer than the window, and a prompt of its own four windows long."""
    from test_model_parity import random_prompts
    from tiny_models import WINDOWS

    window = WINDOWS[arch]
    shared = random_prompts([5 * window], 500, seed=5)[0]
    tails = random_prompts([3, window + 5, 2 * window + 1], 500, seed=6)
    return [shared + tail for tail in tails] + random_prompts([4 * window + 3], 500, seed=7)


def tight_window_pool(arch: str) -> int:
    """The longest sequence fits alone with two pages to spare; the four together do not."""
    from pagedgen.model.runtime.kv_groups import layout_for, pages_for_tokens
    from tiny_models import tiny_loaded_model

    longest = max(map(len, window_prompts(arch))) + WINDOW_NEW_TOKENS
    windows = layout_for(tiny_loaded_model(arch).config).group_windows
    return pages_for_tokens(windows, longest, WINDOW_BLOCK, 16) + 2


def window_llm(arch: str, store, num_blocks: int | None = None,
               kv_cache_dtype: str = "auto") -> LLM:
    return LLM(str(tiny_model_dir(arch)), dtype="float32", threads=1, block_size=WINDOW_BLOCK,
               num_blocks=num_blocks or tight_window_pool(arch), max_num_batched_tokens=16,
               max_num_seqs=4, kv_cache_dtype=kv_cache_dtype, prefix_store=store)


def window_run(llm: LLM, arch: str) -> list[list[int]]:
    greedy = SamplingParams(temperature=0, max_tokens=WINDOW_NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in window_prompts(arch)], greedy,
                           use_tqdm=False)
    kv = llm.engine.kv
    kv.check_integrity()
    assert kv.snapshot().blocks_used == 0
    return [o.outputs[0].token_ids for o in outputs]


def stored_keys(llm: LLM, arch: str) -> list[bytes]:
    """The keys of every full block of every prompt, in this run's identity."""
    root = llm.engine.store.link.root
    return [key for p in window_prompts(arch)
            for key in block_keys(root, p, WINDOW_BLOCK, len(p) // WINDOW_BLOCK)]


@pytest.fixture(scope="module")
def window_reference() -> dict:
    return {arch: window_run(window_llm(arch, None), arch) for arch in WINDOW_ARCHITECTURES}


@pytest.mark.parametrize("arch", WINDOW_ARCHITECTURES)
def test_sliding_window_models_cold_and_warm_give_the_same_tokens(tmp_path, window_reference,
                                                                  arch):
    """Preempting pools, windows releasing blocks: the cold run stores every full block (the
    sliding groups' pages before any window too, each file all groups' pages), and the warm
    run reads them back without changing a token."""
    folder = tmp_path / "store"
    cold_llm = window_llm(arch, folder)
    cold = window_run(cold_llm, arch)
    stats = cold_llm.engine.scheduler.stats
    assert stats.preemptions > 0 and cold_llm.engine.kv.counters.window_released > 0
    store = BlockStore(folder)
    assert all(store.contains(key) for key in stored_keys(cold_llm, arch))
    payload = cold_llm.engine.runner.block_payload_size
    assert store.stats().logical_bytes == store.stats().files * (block_file.HEADER_SIZE + payload)

    warm_llm = window_llm(arch, folder)
    warm = window_run(warm_llm, arch)
    assert cold == warm == window_reference[arch]
    report = store_report(warm_llm)
    assert report["hit_blocks"] > 0 and report["damaged_removed"] == 0
    assert warm_llm.engine.kv.counters.window_released > 0
    assert warm_llm.engine.scheduler.stats.prompt_tokens_computed \
        <= stats.prompt_tokens_computed - report["hit_tokens"] // 2
    if arch == "mistral_window":  # every layer slides: only the windows' blocks are read
        assert report["bytes_read"] < report["hit_blocks"] * (block_file.HEADER_SIZE + payload)


def test_every_layer_sliding_serves_prompts_whose_early_blocks_the_store_lost(
        tmp_path, window_reference):
    """Mistral reads only the blocks of the window in front of its hit's end: with the first
    three windows of every prompt gone from the store, the warm run still hits."""
    arch = "mistral_window"
    folder = tmp_path / "store"
    cold_llm = window_llm(arch, folder)
    window_run(cold_llm, arch)
    store, root = BlockStore(folder), cold_llm.engine.store.link.root
    lost = 3 * 24 // WINDOW_BLOCK
    for prompt in window_prompts(arch):
        for key in block_keys(root, prompt, WINDOW_BLOCK, lost):
            store.discard(store.path_of(key))
    warm_llm = window_llm(arch, folder, num_blocks=256)  # roomy: hits come from the store only
    assert window_run(warm_llm, arch) == window_reference[arch]
    assert store_report(warm_llm)["hit_blocks"] > 0


def test_hybrid_pool_with_an_8_bit_kv_reads_the_store_without_changing_a_token(tmp_path):
    """int8 codes and scales of every group's page travel with the block. A roomy pool: no
    preemption, so each run writes each block's codes the same way."""
    arch = "gemma3"
    off = window_run(window_llm(arch, None, 256, "int8"), arch)
    cold = window_run(window_llm(arch, tmp_path / "s", 256, "int8"), arch)
    warm_llm = window_llm(arch, tmp_path / "s", 256, "int8")
    assert window_run(warm_llm, arch) == cold == off
    assert store_report(warm_llm)["hit_blocks"] > 0


def test_a_hybrid_pool_attends_to_the_stored_bytes(tmp_path, window_reference):
    """Every stored block rewritten as zeros (checksum valid): the warm Gemma 3 run answers
    otherwise, so it really copies each group's page in from the store."""
    arch = "gemma3"
    folder = tmp_path / "store"
    window_run(window_llm(arch, folder), arch)
    store = BlockStore(folder)
    for path, _ in store.block_files():
        key, size = block_file.read_header(memoryview(path.read_bytes()))
        path.write_bytes(b"".join(block_file.encode(key, bytes(size))))
    assert window_run(window_llm(arch, folder), arch) != window_reference[arch]


def test_block_bytes_of_a_hybrid_pool_are_each_groups_page_in_group_order():
    """Payload = every group's page K/V in group order, then their scales in group order; a
    negative page (not loaded) is skipped on the way in, the other pages land whole."""
    import numpy as np
    import torch

    from pagedgen.model.runtime import kv_block_bytes

    kv = torch.randn(3, 2, 10, 4, 2, 8)       # G = 3 layers per group, 10 pages
    scales = torch.rand(3, 2, 10, 2)
    rows = kv_block_bytes.read_blocks(kv, scales, [(3, 4), (7, 8)])
    def page(pool, p):
        return pool[:, :, p].contiguous().view(torch.uint8).reshape(-1).numpy()

    expected = np.concatenate([page(kv, 7), page(kv, 8), page(scales, 7), page(scales, 8)])
    assert rows.shape[1] == kv_block_bytes.block_payload_size(kv, scales, num_groups=2)
    assert np.array_equal(rows[1], expected)
    # One group: the page's K/V then its scales, as a pool without groups always stored it.
    assert np.array_equal(kv_block_bytes.read_blocks(kv, scales, [7])[0],
                          np.concatenate([page(kv, 7), page(scales, 7)]))

    into, into_scales = torch.zeros_like(kv), torch.zeros_like(scales)
    kv_block_bytes.write_blocks(into, into_scales, [(0, 1), (2, -1)],
                                [memoryview(row) for row in rows])
    for target, source in [(0, 3), (1, 4), (2, 7)]:
        assert torch.equal(into[:, :, target], kv[:, :, source])
        assert torch.equal(into_scales[:, :, target], scales[:, :, source])
    assert not into[:, :, 3:].any() and not into_scales[:, :, 3:].any()  # page 8 not loaded


def test_the_store_identity_names_the_layer_grouping():
    """Several groups: the grouping is part of the identity, so another grouping (another
    payload layout of the same K/V) never reads the files. One group holds every layer in
    order whatever its window: the text (and every key) of a full-attention pool."""
    from pagedgen.engine.store_identity import group_layout
    from pagedgen.model.runtime.kv_groups import group_layers_by_window

    assert group_layout(group_layers_by_window([0] * 4)) == "attention=full"
    assert group_layout(group_layers_by_window([24] * 4)) == "attention=full"
    layouts = [group_layout(group_layers_by_window(w))
               for w in ([16, 16, 0, 16], [16, 0, 16, 16], [16, 16, 0, 0], [32, 32, 0, 32])]
    assert len(set(layouts)) == len(layouts) and "attention=full" not in layouts


@pytest.mark.parametrize("writer_delay", [0.0, 0.02])
def test_an_8bit_run_does_not_read_back_its_own_blocks(tmp_path, reference, monkeypatch,
                                                       writer_delay):
    """8-bit blocks depend on how they were filled, so a run that read back the blocks it
    wrote (once preemption took them from memory) would give outputs that depend on whether
    the writer had reached them yet: the same with a writer that keeps up and one that lags."""
    import time

    from pagedgen.engine.prefix_store import store as store_module

    write = store_module.BlockStore.write

    def slow_write(self, key, payload):
        time.sleep(writer_delay)
        return write(self, key, payload)

    monkeypatch.setattr(store_module.BlockStore, "write", slow_write)
    cold_llm = make_llm(tmp_path / "store", "int8")
    assert run(cold_llm) == reference["int8"]
    assert cold_llm.engine.scheduler.stats.preemptions > 0
    assert store_report(cold_llm)["hit_blocks"] == 0  # nothing of its own read back
