"""The block store on its own: file format, damage, eviction, limits, concurrency, the CLI."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pagedgen.cli.app import app
from pagedgen.engine.prefix_store import BlockStore, BlockWriter, block_file, file_content_digest
from pagedgen.engine.prefix_store.store import StoreWarning, UnsafeStoreError


def key(i: int) -> bytes:
    return i.to_bytes(32, "little")


def payload(i: int, size: int = 3000) -> bytes:
    return bytes((i * 7 + j) % 251 for j in range(size))


def filled(folder: Path, count: int = 4, **kw) -> BlockStore:
    store = BlockStore(folder, min_free_bytes=0, **kw)
    for i in range(count):
        store.write(key(i), payload(i))
    return store


def test_round_trip_and_a_miss(tmp_path):
    store = filled(tmp_path / "s")
    assert bytes(store.read(key(1), 3000)) == payload(1)
    assert store.read(key(99)) is None
    assert store.stats().files == 4
    assert stat_mode(tmp_path / "s") == 0o700


@pytest.mark.parametrize("damage", ["truncate", "flip_payload", "flip_header", "empty", "garbage",
                                    "extend"])
def test_damaged_block_is_a_miss_and_removed(tmp_path, damage):
    store = filled(tmp_path / "s")
    path = store.path_of(key(2))
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[:len(data) // 2]
    elif damage == "flip_payload":
        data[-5] ^= 0x10
    elif damage == "flip_header":
        data[20] ^= 0x01
    elif damage == "empty":
        data = bytearray()
    elif damage == "garbage":
        data = bytearray(os.urandom(len(data)))
    else:
        data += b"x"
    path.write_bytes(bytes(data))
    with pytest.warns(StoreWarning, match="unusable"):
        assert store.read(key(2), 3000) is None
    assert not path.exists() and store.counters.bad_removed == 1
    assert bytes(store.read(key(1), 3000)) == payload(1)  # the others are untouched


def test_blocks_swapped_between_keys_are_misses(tmp_path):
    store = filled(tmp_path / "s")
    a, b = store.path_of(key(0)), store.path_of(key(1))
    data_a, data_b = a.read_bytes(), b.read_bytes()
    a.write_bytes(data_b)
    b.write_bytes(data_a)
    with pytest.warns(StoreWarning, match="another key"):
        assert store.read(key(0)) is None
    assert store.read(key(1)) is None


def test_payload_of_another_size_is_a_miss(tmp_path):
    store = filled(tmp_path / "s")
    with pytest.warns(StoreWarning, match="expected 4000"):
        assert store.read(key(0), 4000) is None


def test_folder_others_can_write_is_refused(tmp_path):
    for mode, who in ((0o777, "others"), (0o770, "its group")):
        folder = tmp_path / f"m{mode:o}"
        folder.mkdir()
        folder.chmod(mode)
        with pytest.raises(UnsafeStoreError, match=who):
            BlockStore(folder)
    inner = tmp_path / "inner"
    BlockStore(inner)
    (inner / "blocks-v1").chmod(0o757)
    with pytest.raises(UnsafeStoreError, match="blocks-v1"):
        BlockStore(inner)


def test_lru_eviction_keeps_the_recently_read(tmp_path):
    store = filled(tmp_path / "s", count=6)
    per_file = store.stats().bytes // 6
    old = time.time() - 1000
    for i in range(6):
        os.utime(store.path_of(key(i)), (old + i, old + i))
    store.read(key(0))  # read now: the most recently used
    store.max_bytes = per_file * 5
    writer = BlockWriter(store)
    writer.submit(key(6), payload(6))
    writer.close()
    present = {i for i in range(7) if store.contains(key(i))}
    assert store.stats().bytes <= store.max_bytes
    assert 0 in present and 6 in present and 1 not in present
    assert writer.counters.evicted >= 2


def test_writer_stops_below_the_free_space_floor(tmp_path):
    store = BlockStore(tmp_path / "s", min_free_bytes=1 << 62)
    writer = BlockWriter(store)
    with pytest.warns(StoreWarning, match="free space below the floor"):
        writer.submit(key(1), payload(1))
        writer.flush()
    assert not store.contains(key(1)) and writer.stopped_reason
    assert writer.submit(key(2), payload(2)) is False  # dropped at once from now on


def test_writer_drops_rather_than_waits(tmp_path, monkeypatch):
    store = BlockStore(tmp_path / "s", min_free_bytes=0)
    slow_write = store.write

    def slow(k, data):
        time.sleep(0.5)
        return slow_write(k, data)

    monkeypatch.setattr(store, "write", slow)
    writer = BlockWriter(store, max_queue=2)
    started = time.perf_counter()
    results = [writer.submit(key(i), payload(i)) for i in range(20)]
    # Waiting for the disk would take >= 0.5 s per block past the queue's 2 (+1 in hand).
    assert time.perf_counter() - started < 2.0
    assert results.count(False) >= 15 and writer.counters.dropped_queue_full >= 15
    writer.close()


def test_full_disk_stops_the_writer_with_one_warning(tmp_path, monkeypatch):
    store = BlockStore(tmp_path / "s", min_free_bytes=0)

    def full(k, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store, "write", full)
    writer = BlockWriter(store)
    with pytest.warns(StoreWarning) as caught:
        for i in range(5):
            writer.submit(key(i), payload(i))
        writer.flush()
    assert len(caught) == 1 and writer.stopped_reason == "No space left on device"


def test_two_processes_writing_the_same_blocks(tmp_path):
    """Atomic renames: two processes writing the same and different keys at once leave only
    whole blocks."""
    folder = tmp_path / "s"
    BlockStore(folder)
    code = (
        "import sys; from pagedgen.engine.prefix_store import BlockStore, BlockWriter\n"
        "s = BlockStore(sys.argv[1], min_free_bytes=0); w = BlockWriter(s, max_queue=10000)\n"
        "base = int(sys.argv[2])\n"
        "for i in list(range(60)) + list(range(base, base + 60)):\n"
        "    w.submit(i.to_bytes(32, 'little'), bytes([i % 256]) * 50000)\n"
        "w.close()\n")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(folder), str(base)])
             for base in (1000, 2000)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    store = BlockStore(folder)
    result = store.verify(remove_bad=False)
    assert result.good == 180 and result.bad == []
    assert bytes(store.read(key(5), 50000)) == bytes([5]) * 50000
    assert not [p for p, _ in store.block_files() if p.suffix != ".kvb"]  # no temporary left


def test_model_digest_is_cached_by_stat_and_follows_changes(tmp_path):
    model = tmp_path / "model.gguf"
    model.write_bytes(b"a" * 1000)
    cache = tmp_path / "cache"
    cache.mkdir()
    first = file_content_digest([model], cache)
    assert len(list(cache.iterdir())) == 1
    assert file_content_digest([model], cache) == first
    model.write_bytes(b"a" * 999 + b"b")  # same size, new content and mtime
    os.utime(model, ns=(1, 1))
    assert file_content_digest([model], cache) != first


def test_cli_stats_verify_clear(tmp_path):
    store = filled(tmp_path / "s", count=3)
    path = store.path_of(key(1))
    path.write_bytes(path.read_bytes()[:-1])
    runner = CliRunner()
    stats = runner.invoke(app, ["store", "stats", str(tmp_path / "s"), "--json"])
    assert stats.exit_code == 0 and '"blocks": 3' in stats.output
    verify = runner.invoke(app, ["store", "verify", str(tmp_path / "s")])
    assert verify.exit_code == 1 and "2 good blocks, 1 bad (1 removed)" in verify.output
    cleared = runner.invoke(app, ["store", "clear", str(tmp_path / "s")])
    assert cleared.exit_code == 0 and store.stats().files == 0
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    refused = runner.invoke(app, ["store", "stats", str(shared)])
    assert refused.exit_code == 2 and "writable by others" in refused.output


def test_header_round_trip_names_the_key():
    data = b"".join(bytes(p) for p in block_file.encode(key(3), b"xyz"))
    assert len(data) == block_file.HEADER_SIZE + 3
    assert block_file.verify(data) == key(3)
    assert bytes(block_file.decode(data, key(3), 3)) == b"xyz"


def stat_mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def test_kv_manager_hook_queues_full_blocks_and_admits_stored_ones(tmp_path):
    """Plain KV manager + StoreLink: full blocks are queued once with chained keys; a second
    manager over the same store admits them as hits (the last prompt token still computed),
    keeps its books straight, and hands the runner the payloads to copy in."""
    from pagedgen.engine.kv_manager import KVCacheManager
    from pagedgen.engine.prefix_store import block_keys
    from pagedgen.engine.store_link import StoreLink

    store = BlockStore(tmp_path / "s", min_free_bytes=0)
    root, tokens = b"r" * 32, list(range(100, 150))  # 3 full blocks of 16 + 2 tokens
    first = KVCacheManager(16, 16, hash_extra_key="m")
    first.attach_store(StoreLink(store, root, 16, 16, payload_size=8))
    first.admit(0, tokens)
    first.append_slots(0, tokens)
    saves = first.store.take_saves()
    keys = list(block_keys(root, tokens, 16, 3))
    assert [k for _, k in saves] == keys
    for block, k in saves:
        store.write(k, block.to_bytes(8, "little"))

    second = KVCacheManager(16, 16, hash_extra_key="m")
    second.attach_store(StoreLink(store, root, 16, 16, payload_size=8))
    assert second.num_cached_prefix_tokens(tokens) == 48
    assert second.can_admit(tokens, 2)
    assert second.admit(1, tokens) == 48
    loads = second.store.take_loads()
    assert [int.from_bytes(p, "little") for _, p in loads] == [b for b, _ in saves]
    assert [b for b, _ in loads] == second.block_table(1)
    second.append_slots(1, tokens[48:])
    second.check_integrity()
    assert second.store.take_saves() == []  # the loaded blocks are not written again
    # A prompt ending on a block boundary still computes its last token: 2 blocks, not 3.
    assert second.num_cached_prefix_tokens(tokens[:48]) == 32


def test_the_size_settings_bound_a_run_s_store(tmp_path):
    """prefix_store_max_size reaches the writer (the store never ends larger), and a free-space
    floor above the disk's free space stops writing with the reason in the report."""
    from pagedgen import LLM, SamplingParams
    from tiny_models import tiny_model_dir

    prompts = [{"prompt_token_ids": [3 + (7 * i + j) % 400 for j in range(120)]} for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    common = dict(dtype="float32", block_size=16, num_blocks=64, threads=1)
    bounded = LLM(str(tiny_model_dir()), prefix_store=tmp_path / "small",
                  prefix_store_max_size="200KiB", **common)
    bounded.generate(prompts, params, use_tqdm=False)
    report = bounded.memory_report()["prefix_store"]
    stats = BlockStore(tmp_path / "small").stats()
    assert report["blocks_written"] > stats.files > 0        # some were evicted on the way
    assert stats.bytes <= 200 * 1024

    floored = LLM(str(tiny_model_dir()), prefix_store=tmp_path / "floor",
                  prefix_store_min_free=f"{1 << 50}", **common)
    floored.generate(prompts, params, use_tqdm=False)
    report = floored.memory_report()["prefix_store"]
    assert report["blocks_written"] == 0 and "free space below the floor" in report["write_stopped"]
