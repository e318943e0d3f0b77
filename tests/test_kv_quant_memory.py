"""Sizing, reports and address translation in the units of an 8-bit KV pool."""
from __future__ import annotations

import json

import torch
from typer.testing import CliRunner

from pagedgen import LLM, SamplingParams
from pagedgen.cli.app import app
from pagedgen.memory.block_map import token_address
from pagedgen.cli.inspect_memory import KVShape, pool_sizing, sequence_fit
from tiny_models import tiny_model_dir


def cli(*args: str):
    return CliRunner().invoke(app, list(args))


def test_smollm2_int8_sizing_by_hand():
    # codes: 2 x 30 layers x 3 KV heads x 64 x 1 B = 11,520 B; scales: 2 x 30 x 3 x 4 B = 720 B
    # per block, 720 / 16 = 45 B per token.
    sizing = pool_sizing(KVShape(30, 3, 64, "bfloat16", "int8"), 16, 2048, kv_memory_bytes=4 * 2**30)
    assert sizing.bytes_per_token == 11_565 and sizing.scale_bytes_per_block == 720
    assert sizing.bytes_per_block == 185_040 and sizing.dtype_bytes == 1
    assert sizing.num_blocks == 4 * 2**30 // 185_040 == 23_211
    bf16 = pool_sizing(KVShape(30, 3, 64, "bfloat16"), 16, 2048, kv_memory_bytes=4 * 2**30)
    assert sizing.num_blocks / bf16.num_blocks > 1.99
    # w64-like sequences (prompt + output ~ 300 tokens): twice the concurrent sequences.
    assert sequence_fit(sizing, 300).paged_sequences / sequence_fit(bf16, 300).paged_sequences > 1.99


def test_inspect_memory_cli_takes_the_kv_cache_dtype():
    folder = str(tiny_model_dir("llama"))
    # 2 layers x 2 KV heads x 16 x 2 (K, V) x 1 B = 128 B of codes + 2 x 2 x 2 x 4 / 16 = 2 B.
    result = cli("inspect-memory", "--model", folder, "--kv-cache-dtype", "fp8_e4m3",
                 "--kv-memory", "1MiB", "--block-size", "16", "--max-model-len", "512", "--json", "-")
    assert result.exit_code == 0, result.output
    d = json.loads(result.stdout)
    assert (d["bytes_per_token"], d["bytes_per_block"], d["num_blocks"]) == (130, 2080, 504)
    table = cli("inspect-memory", "--model", folder, "--kv-cache-dtype", "int8", "--num-blocks", "10")
    assert table.exit_code == 0 and "int8 codes" in table.stdout
    bad = cli("inspect-memory", "--model", folder, "--kv-cache-dtype", "fp4")
    assert bad.exit_code == 2 and "kv_cache_dtype" in bad.output and "fp8_e4m3" in bad.output


def test_token_and_scale_addresses_point_at_the_pool_bytes(tmp_path):
    llm = LLM(str(tiny_model_dir()), dtype="float32", block_size=8, num_blocks=16, threads=1,
              kv_cache_dtype="int8")
    llm.generate([list(range(40, 61))], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                 request_ids=["r"], use_tqdm=False)
    report = llm.memory_report()
    assert report["pool"]["kv_cache_dtype"] == "int8"
    assert report["pool"]["total_bytes"] >= llm.runner.kv_cache_bytes
    address = token_address(report, "r", 13)
    codes = llm.runner.kv_cache.view(torch.uint8).flatten()
    scales = llm.runner.kv_scales.view(torch.uint8).flatten()
    block, offset = address.physical_block, address.offset
    for (layer, k_at, v_at), (_, ks_at, vs_at) in zip(address.layer_offsets, address.scale_offsets):
        for kv, at, scale_at in ((0, k_at, ks_at), (1, v_at, vs_at)):
            expected = llm.runner.kv_cache[layer, kv, block, offset].view(torch.uint8).flatten()
            assert torch.equal(codes[at:at + address.token_bytes], expected)
            row = llm.runner.kv_scales[layer, kv, block].view(torch.uint8)
            assert torch.equal(scales[scale_at:scale_at + row.numel()], row)
    path = tmp_path / "memory_report.json"
    path.write_text(json.dumps(report))
    shown = cli("inspect-memory", "--report", str(path), "--request", "r", "--token", "13")
    assert shown.exit_code == 0, shown.output
    assert "K scales offset" in shown.stdout and "kv_scales[L, 2, N=16, H_kv]" in shown.stdout


def test_run_and_profile_take_the_flag_and_the_yaml_key(tmp_path):
    folder = str(tiny_model_dir("llama"))
    config = tmp_path / "tiny.yaml"
    config.write_text(f"model: {folder}\ndtype: float32\nnum_blocks: 32\nthreads: 1\n"
                      "kv_cache_dtype: int8\nsampling:\n  max_tokens: 4\n  temperature: 0\n")
    prompts = tmp_path / "in.jsonl"
    prompts.write_text(json.dumps({"prompt": "a = [", "n": 2}) + "\n")
    from_yaml = cli("run", str(prompts), "-c", str(config))
    assert from_yaml.exit_code == 0, from_yaml.output
    report = json.loads((tmp_path / "in.completions.report" / "memory_report.json").read_text())
    assert report["pool"]["kv_cache_dtype"] == "int8"
    assert "int8 + float32 scale" in from_yaml.stderr  # the pool table of the terminal summary
    out = tmp_path / "profile.json"
    profiled = cli("profile", "--model", folder, "--dtype", "float32", "--threads", "1",
                   "--kv-cache-dtype", "fp8_e5m2", "--num-blocks", "16", "--num-requests", "2",
                   "--prompt-len", "4..8", "--max-tokens", "2..3", "--json", str(out))
    assert profiled.exit_code == 0, profiled.output
    row = json.loads(out.read_text())["rows"][0]
    assert row["kv_cache_dtype"] == "fp8_e5m2" and row["bytes_per_token"] == 130
    bad = cli("run", str(prompts), "-c", str(config), "--kv-cache-dtype", "fp16")
    assert bad.exit_code == 2 and "--kv-cache-dtype" in bad.output
