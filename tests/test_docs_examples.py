"""The examples of README.md and docs/ run as written, in order, in a fresh copy of the
repository, and print what the documents show (exactly on the CPU kind they were captured on,
the same shape elsewhere): tools/docs_examples.py does the work, this test runs it."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "docs_examples.py"


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("docs_examples", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules["docs_examples"] = module   # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_every_code_block_is_run_or_says_why_not(tool):
    for path in tool.documents():
        lines = path.read_text().splitlines()
        run = {e.line for e in tool.parse(path)}
        for lang, start, _ in tool._blocks(lines):
            if lang not in ("python", "bash") or start + 1 in run:
                continue
            mark = tool._mark_before(lines, start)
            assert mark and mark[0] == "not run" and mark[1], \
                f"{path.name}:{start + 1}: a {lang} block that is neither run nor says why not"


def test_readme_is_short_and_starts_with_the_two_commands(tool):
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    blocks = [b for b in tool._blocks(text.splitlines()) if b[0] == "bash"]
    first = [text.splitlines()[b[1] + 1] for b in blocks[:2]]
    assert first == [
        "python3 -m venv .venv && . .venv/bin/activate && bash .ci/setup && pagedgen run samples/prompts.jsonl",
        "python3 -m venv .venv && . .venv/bin/activate && bash .ci/setup test && python -m pytest -q -n 2 tests"]
    assert tool.FIRST_COMMAND in first[0]


def test_parse_trim_and_compare(tool, tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("<!-- run: exit=2 -->\n```bash\nfalse\n```\n\n<!-- output: head=1 tail=1 -->\n"
                   "```text\nold\n```\n\n<!-- not run: a sketch -->\n```python\nx\n```\n")
    [example] = tool.parse(doc, tmp_path)
    assert (example.lang, example.options, example.output_options) == \
        ("bash", {"exit": "2"}, {"head": "1", "tail": "1"})
    assert tool.trim("a\nb\ngenerating 1/2\nc\nd\n", example.output_options) == "a\n...\nd"
    assert tool.compare("done in 1.2 s, 30 tok/s", "done in 9.9 s, 31 tok/s", True) is None
    assert tool.compare("a\nb", "a\nc", True) is not None
    assert tool.compare("a\nb", "x\ny", False) is None and tool.compare("a", "x\ny", False)


def test_the_examples_run_and_print_what_the_documents_show():
    """CI time: one fresh copy, one interpreter per document (about 2-3 minutes on 2 cores)."""
    proc = subprocess.run([sys.executable, str(TOOL), "--check"], cwd=ROOT, capture_output=True,
                          text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    recorded = json.loads((ROOT / "docs" / "examples.json").read_text())
    assert "README.md" in " ".join(recorded["examples"])
