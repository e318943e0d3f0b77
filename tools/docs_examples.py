"""Runs every example of README.md and docs/*.md, in order, in a fresh copy of the repository,
and checks (or rewrites) the output shown under each.

    python tools/docs_examples.py --check      # fail when an example breaks or its output moved
    python tools/docs_examples.py --write      # regenerate the shown outputs (and the CPU kind)

How a document marks its examples (HTML comments, invisible on GitHub):

- every ```python and ```bash block is run, unless the line before it is
  `<!-- not run: why -->` (a cluster command, an interface sketch);
- `<!-- run: exit=2 extra=ray -->` before a block: the exit status it must give, an extra it
  needs (run only with --extras ray: CI does not install Ray's cluster pieces for this);
- a ```text block right after a run block is its output. Python blocks show stdout; bash
  blocks show what the terminal shows (stdout and stderr). `<!-- output: head=N tail=M
  grep=REGEX -->` before the text block trims it ("..." marks a cut).

A "fresh clone" is a copy of the tracked files in a temporary folder where the README's first
command (`pagedgen run samples/prompts.jsonl`) has run; the examples then run there in order,
README first, then docs/ by name. All python blocks of one document share one interpreter, as
they would in a notebook (the API examples reuse one `llm`).

Text generated in bfloat16 depends on the CPU kind (AMX, AVX-512 BF16, other: the kernels
round differently), so outputs are compared exactly only on the CPU kind they were captured on
(docs/examples.json); elsewhere only their shape (the number of lines). Timings are masked.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "docs" / "examples.json"
FIRST_COMMAND = "pagedgen run samples/prompts.jsonl"
FENCE = re.compile(r"^```(\w*)\s*$")
MARK = re.compile(r"^<!--\s*(run|not run|output):?\s*(.*?)\s*-->\s*$")
# Figures that change from run to run: seconds, rates, ETAs.
VOLATILE = re.compile(r"\d[\d,]*(\.\d+)?(?=\s*(s\b|ms\b|tok/s|gen tok/s|generated tok/s|prompt tok/s|GFLOP))")
FREE_MEMORY = re.compile(r"free now .*")  # inspect-memory: the machine's, at that moment
DOC_TIMEOUT_S = 900
# Pictures the documents show, made by their examples: copied back by --write.
IMAGES = {"out/prompts.report/memory_timeline.png": "docs/img/timeline_prompts_1gib.png",
          "out/shared.report/memory_timeline.png": "docs/img/timeline_shared_prefix_40_blocks.png"}


@dataclass(slots=True)
class Example:
    doc: str
    index: int                    # the nth run example of its document
    lang: str                     # python | bash
    code: str
    line: int                     # 1-based line of the opening fence
    options: dict[str, str] = field(default_factory=dict)
    output_span: tuple[int, int] | None = None   # lines of the text block's body (0-based, end excl.)
    output_options: dict[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.doc}:{self.line}"


def documents(root: Path = ROOT) -> list[Path]:
    return [root / "README.md"] + sorted((root / "docs").glob("*.md"))


def _options(text: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in text.split() if "=" in part)


def _blocks(lines: list[str]) -> list[tuple[str, int, int]]:
    """(lang, opening line, closing line) of every fenced block, 0-based."""
    found, open_at, lang = [], None, ""
    for i, line in enumerate(lines):
        match = FENCE.match(line)
        if not match:
            continue
        if open_at is None:
            open_at, lang = i, match.group(1)
        else:
            found.append((lang, open_at, i))
            open_at = None
    return found


def _mark_before(lines: list[str], at: int) -> tuple[str, str] | None:
    j = at - 1
    while j >= 0 and not lines[j].strip():
        j -= 1
    match = MARK.match(lines[j]) if j >= 0 else None
    return (match.group(1), match.group(2)) if match else None


def parse(path: Path, root: Path = ROOT) -> list[Example]:
    lines = path.read_text().splitlines()
    blocks = _blocks(lines)
    examples: list[Example] = []
    for k, (lang, start, end) in enumerate(blocks):
        if lang not in ("python", "bash"):
            continue
        mark = _mark_before(lines, start)
        if mark and mark[0] == "not run":
            continue
        example = Example(str(path.relative_to(root)), len(examples), lang,
                          "\n".join(lines[start + 1:end]), start + 1,
                          _options(mark[1]) if mark and mark[0] == "run" else {})
        nxt = blocks[k + 1] if k + 1 < len(blocks) else None
        if nxt and nxt[0] == "text" and _only_marks_between(lines, end, nxt[1]):
            example.output_span = (nxt[1] + 1, nxt[2])
            out_mark = _mark_before(lines, nxt[1])
            if out_mark and out_mark[0] == "output":
                example.output_options = _options(out_mark[1])
        examples.append(example)
    return examples


def _only_marks_between(lines: list[str], end: int, start: int) -> bool:
    between = [line for line in lines[end + 1:start] if line.strip()]
    return all(MARK.match(line) and MARK.match(line).group(1) == "output" for line in between)


def cpu_kind() -> str:
    """amx, avx512_bf16, avx512_bf16-intel or other, and "-fma" where the AVX-512 BF16 kernels
    take their float32 FMA form (as timed on this CPU): the kernels (and so bf16 rounding)
    differ between them (on Intel the packed-GGUF bf16 tiles also start at more rows)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    flags = next((line for line in lines if line.startswith("flags")), "").split()
    intel = any(line.startswith("vendor_id") and "GenuineIntel" in line for line in lines)
    if "amx_tile" in flags:
        return "amx"
    if "avx512_bf16" in flags:
        return ("avx512_bf16-intel" if intel else "avx512_bf16") + \
            ("-fma" if _float32_fma_form() else "")
    return "other"


def _float32_fma_form() -> bool:
    """Whether pagedgen's AVX-512 BF16 kernels run their float32 FMA form here."""
    try:
        from pagedgen.kernels.cpu import native
    except ImportError:
        return False
    return bool(native.avx512_linear_form())


# --- running ---

WORKER = r'''
import contextlib, io, json, os, subprocess, sys, traceback
examples = json.load(open(sys.argv[1]))
namespace = {"__name__": "__main__"}
results = []
for ex in examples:
    buffer = io.StringIO()
    status, error = 0, None
    if ex["lang"] == "python":
        try:
            with contextlib.redirect_stdout(buffer):
                exec(compile(ex["code"], ex["name"], "exec"), namespace)
        except SystemExit as stop:
            status = stop.code if isinstance(stop.code, int) else 1
        except BaseException:
            status, error = 1, traceback.format_exc()
        text = buffer.getvalue()
    else:
        proc = subprocess.run(["bash", "-c", ex["code"]], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
        status, text = proc.returncode, proc.stdout
    results.append({"name": ex["name"], "status": status, "output": text, "error": error})
    print(json.dumps(results[-1]), flush=True)
'''


def fresh_clone(workdir: Path) -> Path:
    """The tracked (and new, not ignored) files of the repository, and the first command run."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.splitlines()
    clone = workdir / "clone"
    for name in listed:
        source = ROOT / name
        if source.is_file():
            target = clone / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    subprocess.run(FIRST_COMMAND.split() + ["--threads", "1", "-q"], cwd=clone, env=example_env(),
                   check=True, stdout=subprocess.DEVNULL)
    return clone


def example_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(COLUMNS="100", TERM="dumb", NO_COLOR="1", PYTHONUNBUFFERED="1",
               PYTHONHASHSEED="0")
    env.pop("FORCE_COLOR", None)
    return env


def run_document(examples: list[Example], clone: Path, workdir: Path) -> list[dict]:
    todo = workdir / f"todo{examples[0].doc.replace('/', '_')}.json"
    todo.write_text(json.dumps([{"name": e.name, "lang": e.lang, "code": e.code} for e in examples]))
    worker = workdir / "worker.py"
    worker.write_text(WORKER)
    proc = subprocess.run([sys.executable, str(worker), str(todo)], cwd=clone, env=example_env(),
                          capture_output=True, text=True, timeout=DOC_TIMEOUT_S)
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if len(results) != len(examples):
        raise RuntimeError(f"{examples[0].doc}: the example worker died:\n{proc.stderr[-3000:]}")
    return results


# --- outputs ---

def trim(text: str, options: dict[str, str]) -> str:
    lines = [line.rstrip() for line in text.rstrip("\n").splitlines()]
    lines = [line for line in lines if not line.startswith("generating ")]  # timing-dependent
    if "grep" in options:
        pattern = re.compile(options["grep"])
        lines = [line for line in lines if pattern.search(line)]
    head, tail = int(options.get("head", 0)), int(options.get("tail", 0))
    if (head or tail) and head + tail < len(lines):
        lines = lines[:head] + ["..."] + (lines[-tail:] if tail else [])
    return "\n".join(lines)


def masked(text: str) -> str:
    return FREE_MEMORY.sub("free now #", VOLATILE.sub("#", text))


def shown_output(doc_lines: list[str], example: Example) -> str | None:
    if example.output_span is None:
        return None
    start, end = example.output_span
    return "\n".join(doc_lines[start:end])


def compare(shown: str, got: str, same_cpu: bool) -> str | None:
    """None when they agree; else what differs."""
    if same_cpu:
        if masked(shown) != masked(got):
            return f"output differs:\n--- shown\n{shown}\n--- got\n{got}"
        return None
    if len(shown.splitlines()) != len(got.splitlines()):
        return (f"output has {len(got.splitlines())} lines, the document shows "
                f"{len(shown.splitlines())} (another CPU kind: only the shape is compared)")
    return None


def write_outputs(path: Path, examples: list[Example], outputs: dict[str, str]) -> None:
    lines = path.read_text().splitlines()
    for example in sorted((e for e in examples if e.output_span), key=lambda e: -e.output_span[0]):
        start, end = example.output_span
        lines[start:end] = outputs[example.name].splitlines()
    path.write_text("\n".join(lines) + "\n")


def selected(examples: list[Example], extras: set[str]) -> list[Example]:
    return [e for e in examples if e.options.get("extra") is None or e.options["extra"] in extras]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true")
    mode.add_argument("--write", action="store_true")
    parser.add_argument("--extras", default="", help="comma-separated extras to run too (ray)")
    parser.add_argument("--only", default=None, help="run only this document (e.g. README.md)")
    args = parser.parse_args(argv)
    extras = set(filter(None, args.extras.split(",")))
    kind = cpu_kind()
    recorded = json.loads(RECORD.read_text()) if RECORD.exists() else {}
    same_cpu = args.write or recorded.get("cpu_kind") == kind
    print(f"CPU kind: {kind}; outputs captured on: {recorded.get('cpu_kind', 'nothing yet')} -> "
          f"{'exact text' if same_cpu else 'shape only'}", flush=True)
    failures: list[str] = []
    ran: list[str] = []
    with tempfile.TemporaryDirectory(prefix="pagedgen-docs-") as tmp:
        workdir = Path(tmp)
        clone = fresh_clone(workdir)
        for path in documents():
            if args.only and path.name != args.only and str(path.relative_to(ROOT)) != args.only:
                continue
            examples = selected(parse(path), extras)
            if not examples:
                continue
            doc_lines = path.read_text().splitlines()
            outputs = {}
            for example, result in zip(examples, run_document(examples, clone, workdir)):
                ran.append(example.name)
                want = int(example.options.get("exit", 0))
                if result["status"] != want:
                    failures.append(f"{example.name}: exit {result['status']}, expected {want}\n"
                                    f"{result['error'] or result['output'][-2000:]}")
                    continue
                got = trim(result["output"], example.output_options)
                outputs[example.name] = got
                shown = shown_output(doc_lines, example)
                if shown is not None and not args.write:
                    problem = compare(shown, got, same_cpu)
                    if problem:
                        failures.append(f"{example.name}: {problem}")
                print(f"ok   {example.name}", flush=True)
            if args.write:
                write_outputs(path, [e for e in examples if e.name in outputs], outputs)
        if args.write:
            for made, shown in IMAGES.items():
                if (clone / made).exists():
                    shutil.copy2(clone / made, ROOT / shown)
    if args.write and not failures:
        if args.only:  # the other documents' examples stay recorded as they were
            docs_run = {name.rsplit(":", 1)[0] for name in ran}
            ran = [n for n in recorded.get("examples", []) if n.rsplit(":", 1)[0] not in docs_run] + ran
        RECORD.write_text(json.dumps({"cpu_kind": kind, "examples": ran}, indent=2) + "\n")
    for failure in failures:
        print(f"FAIL {failure}", flush=True)
    print(f"{len(ran)} examples run, {len(failures)} failed", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
