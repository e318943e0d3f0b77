"""`pagedgen inspect-memory`: sizing arithmetic (checked by hand), config-only model reading,
the pool map of a report and the address of a token."""

from __future__ import annotations

import json
import random

import pytest
from typer.testing import CliRunner

from pagedgen.cli.app import app
from pagedgen.engine.kv_manager import KVCacheManager
from pagedgen.memory.block_map import BlockState, build_pool_map, token_address
from pagedgen.memory.inspect_report import inspect_report
from pagedgen.memory.render_map import map_layout, pool_map_text
from pagedgen.memory.report import build_report
from kv_simulation import SimRequest, Simulation
from pagedgen.cli.inspect_memory import KVShape, pool_sizing, read_model_shape, sequence_fit
from pagedgen.memory.tracker import MemoryTracker

SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, max_position_embeddings=8192, vocab_size=49152)


def cli(*args: str):
    result = CliRunner().invoke(app, list(args))
    return result


@pytest.fixture(scope="module")
def smollm2_config_dir(tmp_path_factory):
    """SmolLM2-135M's config.json alone: sizing must not need any weights."""
    from transformers import LlamaConfig

    folder = tmp_path_factory.mktemp("smollm2")
    LlamaConfig(**SMOLLM2).save_pretrained(folder)
    return folder


def test_smollm2_sizing_by_hand(smollm2_config_dir):
    shape = read_model_shape(smollm2_config_dir)
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim) == (30, 3, 64)
    sizing = pool_sizing(KVShape(30, 3, 64, "bfloat16"), 16, 2048, kv_memory_bytes=4 * 2**30)
    assert sizing.bytes_per_token == 30 * 3 * 64 * 2 * 2 == 23_040
    assert sizing.bytes_per_block == 368_640
    assert sizing.num_blocks == 11_650            # 4 GiB // 368,640 (11,651 would be 4,295,024,640 B)
    assert sizing.pool_tokens == 186_400
    fit = sequence_fit(sizing, 512)
    assert (fit.blocks_per_sequence, fit.paged_sequences, fit.static_sequences) == (32, 364, 91)
    assert sequence_fit(sizing, 500).paged_slack_tokens == 12


def test_tiny_config_sizing_through_the_cli():
    from tiny_models import tiny_model_dir

    # 2 layers x 2 KV heads x head dim 16 (64 / 4 heads) x 2 x 4 bytes = 512 B per token.
    result = cli("inspect-memory", "--model", str(tiny_model_dir("llama")), "--dtype", "float32",
                 "--kv-memory", "1MiB", "--block-size", "16", "--seq-len", "100", "--seq-len", "512",
                 "--max-model-len", "512", "--json", "-")
    assert result.exit_code == 0, result.output
    d = json.loads(result.stdout)
    assert (d["bytes_per_token"], d["bytes_per_block"], d["num_blocks"], d["pool_tokens"]) == \
        (512, 8192, 128, 2048)
    assert [(f["seq_len"], f["paged_sequences"], f["static_sequences"]) for f in d["fits"]] == \
        [(100, 128 // 7, 4), (512, 4, 4)]


def test_cli_tables_and_errors(smollm2_config_dir):
    ok = cli("inspect-memory", "--model", str(smollm2_config_dir), "--dtype", "bfloat16",
             "--num-blocks", "1000", "--block-size", "16", "--max-model-len", "2048")
    assert ok.exit_code == 0, ok.output
    assert "23,040" in ok.stdout and "368,640" in ok.stdout and "16,000" in ok.stdout
    too_long = cli("inspect-memory", "--model", str(smollm2_config_dir), "--num-blocks", "10",
                   "--max-model-len", "100", "--seq-len", "101")
    assert too_long.exit_code == 2 and "seq_len 101" in too_long.output
    bad_dtype = cli("inspect-memory", "--model", str(smollm2_config_dir), "--dtype", "int3")
    assert bad_dtype.exit_code == 2 and "dtype" in bad_dtype.output


def write_header_only_gguf(path, sliding_window: int | None = None) -> None:
    """SmolLM2-135M's metadata and a 4-token embedding: all that sizing may read."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(30)
    writer.add_context_length(8192)
    writer.add_embedding_length(576)
    writer.add_feed_forward_length(1536)
    writer.add_head_count(9)
    writer.add_head_count_kv(3)
    if sliding_window is not None:
        writer.add_sliding_window(sliding_window)
    writer.add_token_list(["a", "bb", "ccc"])        # a string array, skipped by the reader
    writer.add_tensor("token_embd.weight", np.zeros((4, 576), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_shape_comes_from_the_loaders_config(tmp_path):
    from pagedgen.model.loading.gguf_loader import gguf_model_config, open_gguf

    path = tmp_path / "m.gguf"
    write_header_only_gguf(path)
    shape = read_model_shape(path)
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.max_position_embeddings) == \
        (30, 3, 64, 8192)
    assert shape.name == "m.gguf"
    config = gguf_model_config(open_gguf(path))
    assert (config.num_layers, config.num_kv_heads, config.head_dim) == (30, 3, 64)
    (tmp_path / "bad.gguf").write_bytes(b"nope, not a model")
    with pytest.raises(ValueError, match="not a GGUF"):
        read_model_shape(tmp_path / "bad.gguf")


def test_a_sliding_window_no_longer_caps_the_length_but_shapes_the_pool(tmp_path,
                                                                      smollm2_config_dir):
    path = tmp_path / "windowed.gguf"
    write_header_only_gguf(path, sliding_window=4096)
    shape = read_model_shape(path)
    assert shape.max_position_embeddings == 8192
    from transformers import MistralConfig

    folder = tmp_path / "mistral"
    MistralConfig(**SMOLLM2, sliding_window=1024).save_pretrained(folder)
    shape = read_model_shape(folder)
    assert shape.max_position_embeddings == SMOLLM2["max_position_embeddings"]
    assert set(shape.layer_windows) == {1024}  # every layer slides: one group with a window
    assert read_model_shape(smollm2_config_dir).layer_windows == ()  # Llama: no window


def test_sizing_of_a_hybrid_pool_shows_groups_and_the_full_attention_row():
    """Gemma 3 270M's KV shape at 1 GiB: pages of 3 layers; an 8,192-token sequence holds its
    512 blocks in the full group and 33 in each sliding group."""
    windows = tuple(0 if (i + 1) % 6 == 0 else 512 for i in range(18))
    sizing = pool_sizing(KVShape(18, 1, 256, "bfloat16", "auto", windows), 16, 32768,
                         kv_memory_bytes=2**30)
    assert sizing.bytes_per_token == 2 * 3 * 256 * 2 and sizing.page_layers == 3
    assert [g["window"] for g in sizing.groups] == [0] + [512] * 5
    assert sizing.full_attention_bytes_per_token == 2 * 18 * 256 * 2
    fit = sequence_fit(sizing, 8192)
    assert fit.blocks_per_sequence == 512 + 5 * 33
    assert fit.paged_sequences == sizing.num_blocks // 677
    assert fit.full_attention_sequences == 2**30 // (8192 * 18432)
    assert fit.blocks_freed_by_window == 5 * (512 - 33)


def test_without_a_size_inspect_memory_and_llm_pick_the_same_pool():
    from pagedgen import LLM
    from pagedgen.jobs.config import RunConfig
    from pagedgen.settings import EngineConfig
    from pagedgen.cli.inspect_memory import sizing_for_config
    from pagedgen.model.runtime.kv_cache import DEFAULT_KV_MEMORY_BYTES
    from tiny_models import tiny_model_dir

    folder = str(tiny_model_dir("llama"))
    sized = sizing_for_config(RunConfig(EngineConfig(model=folder, dtype="float32", device="cpu")))
    llm = LLM(folder, dtype="float32", device="cpu")
    # 512 B per token (see above) x 16 tokens a block: 1 GiB, not a share of free memory.
    assert llm.runner.num_blocks == sized["num_blocks"] == DEFAULT_KV_MEMORY_BYTES // (512 * 16)
    assert llm.max_model_len == sized["max_model_len"] == 512


@pytest.fixture(scope="module")
def sim_report():
    rng = random.Random(5)
    requests = [SimRequest(f"r{i}", [rng.randrange(5, 9000) for _ in range(rng.randint(10, 120))],
                           rng.randint(5, 60), n=rng.choice((1, 3))) for i in range(30)]
    kv = KVCacheManager(160, 8)
    tracker = MemoryTracker(8, 160, 2 * 2 * 4 * 8 * 4, "float32", 512, num_layers=2, num_kv_heads=4, head_dim=8)
    Simulation(kv, tracker, max_num_seqs=16).run(requests)
    return json.loads(json.dumps(build_report(tracker, kv.counters)))


def test_map_counts_agree_with_the_report(sim_report):
    pool_map = build_pool_map(sim_report)
    peak = sim_report["peak_block_tables"]["sample"]
    assert pool_map.counts() == {
        "num_blocks": 160, "blocks_used": peak["blocks_used"], "blocks_shared": peak["blocks_shared"],
        "blocks_cached_free": peak["blocks_cached_free"],
        "blocks_free": 160 - peak["blocks_used"] - peak["blocks_cached_free"]}
    assert pool_map.count(BlockState.SHARED) > 0
    for snap in sim_report["block_table_snapshots"]:
        counts = build_pool_map(sim_report, snap["step"]).counts()
        assert counts["blocks_used"] == snap["sample"]["blocks_used"]
        assert counts["blocks_cached_free"] == snap["sample"]["blocks_cached_free"]


def test_token_address_by_hand(sim_report):
    seq = max(sim_report["peak_block_tables"]["sequences"], key=lambda s: s["num_tokens"])
    token = seq["num_tokens"] - 1
    a = token_address(sim_report, seq["request_id"], token, seq["sample_index"])
    logical, offset = token // 8, token % 8
    block = seq["block_table"][logical]
    token_bytes = 4 * 8 * 4                        # H_kv x D x float32
    assert (a.logical_block, a.offset, a.physical_block, a.slot) == (logical, offset, block, block * 8 + offset)
    # [L=2, 2, N=160, B=8, H=4, D=8]: K of layer 1 starts at (1*2+0)*160 blocks.
    assert a.layer_offsets[1] == (1, ((2 * 160 + block) * 8 + offset) * token_bytes,
                                  ((3 * 160 + block) * 8 + offset) * token_bytes)
    with pytest.raises(ValueError, match="outside"):
        token_address(sim_report, seq["request_id"], seq["num_tokens"], seq["sample_index"])


def test_report_map_through_the_cli(sim_report, tmp_path):
    path = tmp_path / "memory_report.json"
    path.write_text(json.dumps(sim_report))
    seq = sim_report["peak_block_tables"]["sequences"][0]
    shown = cli("inspect-memory", "--report", str(path), "--request", seq["request_id"],
                "--sample", str(seq["sample_index"]), "--token", "3")
    assert shown.exit_code == 0, shown.output
    assert f"Pool at step {sim_report['summary']['peak_step']}" in shown.stdout
    assert f"physical block {seq['block_table'][0]}" in shown.stdout
    machine = cli("inspect-memory", "--report", str(path), "--json", "-", "--request", seq["request_id"],
                  "--sample", str(seq["sample_index"]), "--token", "3")
    d = json.loads(machine.stdout)
    assert d["map"]["blocks_used"] == sim_report["summary"]["peak_blocks_used"]
    assert d["address"]["slot"] == seq["block_table"][0] * 8 + 3
    missing_step = cli("inspect-memory", "--report", str(path), "--step", "999999")
    assert missing_step.exit_code == 2 and "recorded steps" in missing_step.output
    no_request = cli("inspect-memory", "--report", str(path), "--token", "3")
    assert no_request.exit_code == 2 and "--request" in no_request.output


def test_huge_pools_are_aggregated_to_fit_the_screen(sim_report):
    pool_map = build_pool_map(sim_report)
    layout = map_layout(len(pool_map.states), width=27, max_rows=3)   # 20 cells a row
    assert layout.blocks_per_cell == 3 and layout.cells_per_row == 20
    rows = pool_map_text(pool_map, width=27, max_rows=3).plain.splitlines()
    assert len(rows) <= 3 and all(len(r) <= 27 for r in rows)
    data, _ = inspect_report(sim_report, width=40)
    assert len(data["map"]["states"]) == 160


@pytest.mark.parametrize("arch", ["gemma3", "mistral_window"])
def test_a_hybrid_pool_gets_the_max_model_len_llm_runs_with(arch):
    """A pool with sliding groups holds one sequence longer than its page count x block size
    would say for full groups, and shorter than its token count: inspect-memory must show the
    length LLM really runs with."""
    from pagedgen import LLM
    from pagedgen.jobs.config import RunConfig
    from pagedgen.settings import EngineConfig
    from pagedgen.cli.inspect_memory import sizing_for_config
    from tiny_models import tiny_model_dir

    folder = str(tiny_model_dir(arch))
    settings = dict(model=folder, dtype="float32", device="cpu", num_blocks=48, block_size=8)
    sized = sizing_for_config(RunConfig(EngineConfig(**settings)))
    llm = LLM(**settings)
    assert llm.max_model_len == sized["max_model_len"]
    if arch == "gemma3":   # a full group: the pool's token count would mislead here
        assert sized["max_model_len"] != min(sized["pool_tokens"], 512)


def test_the_weights_row_matches_the_file_and_the_loaded_model():
    """From the headers only: the bytes as stored equal the file's tensors, and the parameter
    count the loaded model's (its plain tensors hold that many, and buffers such as the RoPE
    table); the memory left for KV is what is free less each way of holding them."""
    from pagedgen import LLM
    from pagedgen.jobs.config import RunConfig
    from pagedgen.settings import EngineConfig
    from pagedgen.cli.inspect_memory import sizing_for_config, sizing_renderable
    from pagedgen.model.loading.default_model import default_model_path
    from pagedgen.model.loading.gguf_file import read_gguf
    from tiny_models import tiny_model_dir, unpacked_tiny_model

    weights = sizing_for_config(RunConfig(EngineConfig(device="cpu")))["weights"]
    assert weights["stored_bytes"] == sum(t.data.nbytes for t in read_gguf(default_model_path()).tensors)
    left = weights["left_for_kv"]
    assert left["packed"] - left["dequantized"] == weights["dequantized_bytes"] - weights["stored_bytes"] > 0

    folder = str(tiny_model_dir("llama"))
    sized = sizing_for_config(RunConfig(EngineConfig(model=folder, dtype="float32", device="cpu")))
    loaded = unpacked_tiny_model("llama")
    assert sized["weights"]["parameters"] == sum(p.numel() for p in loaded.model.parameters())
    llm = LLM(folder, dtype="float32", device="cpu", num_blocks=8)
    held = llm.memory_report()["weights"]["total_bytes"]
    assert sized["weights"]["dequantized_bytes"] == 4 * sized["weights"]["parameters"] <= held
    assert set(sized["weights"]["left_for_kv"]) == {"dequantized"}    # a folder is never packed
    from rich.console import Console

    console = Console(width=100, record=True)
    console.print(sizing_renderable(sized))
    assert "left for KV" in console.export_text()
