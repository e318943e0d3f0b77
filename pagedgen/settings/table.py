"""The settings table: every setting of a run, once — name, kind, default, bounds, help, its
flag and YAML key, its help panel, and whether it changes what a run returns.

Everything else is derived from it: `LLM(**settings)` and EngineConfig (config.py), the YAML
keys of a run config and configs/default.yaml (pagedgen/jobs/config.py, checked equal by a
test), the flags of `pagedgen run / profile / inspect-memory` (pagedgen/cli/setting_flags.py),
the Ray stage's engine_kwargs and the run manifest that `--resume` compares. Adding a setting is
one entry here plus the code that uses it.

changes_outputs: whether two runs that differ only in this setting may return different text
from a float32-greedy or batch-invariant run. Threads, batch limits and the pool's size do not
(they change speed and scheduling, not answers), so a resumed run may change them.
"""
from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pagedgen.settings import kinds

# Help panels of the CLI (the other panels, for sampling, output and resume, are the CLI's own).
MODEL, ENGINE, INPUT_OUTPUT = "Model", "Engine", "Input/output"
ALL_COMMANDS = ("run", "profile", "inspect-memory")  # inspect-memory: the settings that size a pool
RUN_COMMANDS = ("run", "profile")

# kind -> (check, Python type of its CLI flag)
_KINDS: dict[str, tuple[Callable[..., Any], type]] = {
    "int": (lambda s, v: kinds.integer(v, s.minimum), int),
    "size": (lambda s, v: kinds.size(v), str),
    "bool": (lambda s, v: kinds.boolean(v), bool),
    "choice": (lambda s, v: kinds.choice(v, s.choices), str),
    "device": (lambda s, v: kinds.device(v), str),
    "path": (lambda s, v: kinds.path(v), str),
}


@dataclass(frozen=True, slots=True)
class Setting:
    name: str                   # LLM keyword, YAML key, EngineConfig field
    kind: str                   # a key of _KINDS
    default: Any
    group: str                  # help panel
    changes_outputs: bool
    help: str
    minimum: int = 1            # "int"
    choices: tuple[str, ...] = ()  # "choice"
    nullable: bool = False      # None is a value of its own ("the model's length", "the default")
    default_text: str = ""      # how --help shows a None default
    flag: str = ""              # "" = --name-with-dashes; a "bool" flag is --x/--no-x
    commands: tuple[str, ...] = RUN_COMMANDS
    llm: bool = True            # an LLM() keyword; False: the batch job's own setting
    aliases: tuple[str, ...] = ()  # other LLM() names for it (vLLM's)
    excludes: str | None = None    # giving this one clears that one, so a flag overrides a file

    def check(self, value: Any) -> Any:
        """The normalised value, or ValueError(requirement). A null choice means its default
        (YAML `dtype: null` reads as auto)."""
        if value is None and self.nullable:
            return None
        if value is None and self.kind in ("choice", "device"):
            return self.default
        if self.name == "model" and value == "default":  # reads better in YAML than null
            return None
        return _KINDS[self.kind][0](self, value)

    @property
    def flag_name(self) -> str:
        return self.flag or "--" + self.name.replace("_", "-")

    @property
    def flag_type(self) -> type:
        return _KINDS[self.kind][1]

    @property
    def shown_default(self) -> str:
        """The default as --help shows it."""
        if self.kind == "bool":
            return self.flag_name if self.default else "--no-" + self.flag_name[2:]
        return self.default_text or str(self.default)


_KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3", "fp8_e5m2")  # kernels/kv_quant.py's formats

TABLE: tuple[Setting, ...] = (
    # --- model (load time) ---
    Setting("model", "path", None, MODEL, True,
            "HF folder, .gguf file, or 'default' (the built-in SmolLM2-135M-Instruct).",
            nullable=True, default_text="default", commands=ALL_COMMANDS),
    Setting("tokenizer", "path", None, MODEL, True,
            "A folder whose tokenizer replaces the model's own (for a GGUF file it must have "
            "the file's vocabulary).", nullable=True, default_text="the model's own"),
    Setting("dtype", "choice", "auto", MODEL, True,
            "Compute dtype; auto = bfloat16 on CPUs that multiply bf16 in hardware (AMX, "
            "AVX-512 BF16, Arm BF16) and for GGUF weights kept packed, float32 on other CPUs, "
            "float16 on GPUs without bf16. float32 for exact comparisons.",
            choices=("auto", "float32", "bfloat16", "float16"), commands=ALL_COMMANDS),
    Setting("device", "device", "auto", MODEL, True,
            "auto (CUDA when available, else CPU), cpu, cuda or cuda:N.", commands=ALL_COMMANDS),
    Setting("weights", "choice", "auto", MODEL, True,
            "How a GGUF file's weights are held: packed (quantized blocks, multiplied as they "
            "are), dequantized (expanded to the compute dtype at load) or auto (packed on CPU in "
            "bfloat16 where the packed kernels have AVX2 or AVX-512; otherwise only when the "
            "dequantized copy would take over a quarter of the available memory).",
            choices=("auto", "packed", "dequantized")),
    Setting("threads", "int", None, MODEL, False,
            "CPU threads for torch; on small shared machines 1-2 is often fastest.",
            nullable=True, default_text="torch's choice"),
    # --- engine ---
    Setting("block_size", "int", 16, ENGINE, True,
            "Tokens per KV block (the pool's page).", commands=ALL_COMMANDS),
    Setting("num_blocks", "int", None, ENGINE, False,
            "KV pool size in blocks (instead of kv_memory).", nullable=True,
            default_text="sized by kv_memory", commands=ALL_COMMANDS, aliases=("num_gpu_blocks",),
            excludes="kv_memory"),
    Setting("kv_memory", "size", None, ENGINE, False,
            "KV pool size in bytes, e.g. 2GiB (instead of num_blocks).", nullable=True,
            default_text="1GiB on CPU, 90% of free memory on CUDA", commands=ALL_COMMANDS,
            excludes="num_blocks"),
    Setting("kv_cache_dtype", "choice", "auto", ENGINE, True,
            "The pool's element format: auto (the compute dtype) or 8-bit codes with a float32 "
            "scale per block and KV head (about half the bytes per token of bf16).",
            choices=_KV_CACHE_DTYPES, commands=ALL_COMMANDS),
    Setting("max_num_seqs", "int", 256, ENGINE, False,
            "Sequences decoded together (vLLM's default; lower it on small machines)."),
    Setting("max_num_batched_tokens", "int", 2048, ENGINE, False,
            "Tokens computed per engine step."),
    Setting("max_model_len", "int", None, ENGINE, True,
            "Longest prompt + completion; longer prompts are rejected, completions stop here.",
            minimum=2, nullable=True, default_text="the model's, capped by the pool",
            commands=ALL_COMMANDS),
    Setting("enable_prefix_caching", "bool", True, ENGINE, False,
            "Reuse the KV blocks of identical prompt prefixes.", flag="--prefix-caching"),
    Setting("seed", "int", 0, ENGINE, True,
            "Base seed of requests without their own (and of profile's synthetic workload).",
            minimum=0),
    Setting("batch_invariant", "bool", False, ENGINE, True,
            "Same output bits for a request whatever shares its batches, however its prompt is "
            "chunked (slower)."),
    Setting("prefix_store", "path", None, ENGINE, False,
            "Folder keeping full KV blocks on disk across runs, so a prompt's prefill is paid "
            "once (docs/prefix_store.md).", nullable=True, default_text="off"),
    Setting("prefix_store_max_size", "size", 16 * 2**30, ENGINE, False,
            "Largest size of the prefix store, e.g. 64GiB; past it the least recently used "
            "blocks are deleted.", default_text="16GiB"),
    Setting("prefix_store_min_free", "size", 2**30, ENGINE, False,
            "Free disk space the prefix store leaves, e.g. 5GiB; below it the store stops "
            "writing, so the run's own outputs always find room.", default_text="1GiB"),
    # --- the batch job's own ---
    Setting("max_line_bytes", "size", None, INPUT_OUTPUT, False,
            "Longest input line read, e.g. 4MiB.", nullable=True,
            default_text="32 bytes per token of max_model_len, at least 64KiB",
            commands=("run",), llm=False),
)

SETTINGS: dict[str, Setting] = {s.name: s for s in TABLE}
LLM_SETTINGS: tuple[Setting, ...] = tuple(s for s in TABLE if s.llm)
ALIASES: dict[str, str] = {alias: s.name for s in TABLE for alias in s.aliases}


def default(name: str) -> Any:
    """The table's default of `name` (for dataclass fields that hold a setting)."""
    return SETTINGS[name].default


def for_command(command: str) -> tuple[Setting, ...]:
    return tuple(s for s in TABLE if command in s.commands)


def outputs_identity() -> tuple[str, ...]:
    """The settings a resumed run must share with the run that began its output."""
    return tuple(s.name for s in TABLE if s.changes_outputs)


def did_you_mean(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(str(name), known, n=1)
    return f" (did you mean '{close[0]}'?)" if close else f" (known: {', '.join(sorted(known))})"
