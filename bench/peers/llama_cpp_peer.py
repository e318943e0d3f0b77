"""llama.cpp as a peer: a bench script runs itself under the interpreter that has
llama-cpp-python (a venv of its own: its libraries never meet torch's in one process), hands
the request over stdin and reads one RESULT line back. Stdlib only, like `common`."""

from __future__ import annotations

import json
import subprocess
import sys

CHILD_FLAG = "--llama-child"
_PREFIX = "RESULT "


def run_child(python: str, script: str, request: dict) -> dict:
    """Runs `script CHILD_FLAG` under `python` with the request; its result."""
    done = subprocess.run([python, script, CHILD_FLAG], input=json.dumps(request),
                          capture_output=True, text=True, check=False)
    line = next((l for l in done.stdout.splitlines() if l.startswith(_PREFIX)), None)
    if line is None:
        raise SystemExit(f"llama.cpp failed:\n{done.stderr[-3000:]}")
    return json.loads(line[len(_PREFIX):])


def read_request() -> dict:
    return json.loads(sys.stdin.read())


def reply(result: dict) -> None:
    """The child's answer, with the llama.cpp version and the CPU features it was built for."""
    import llama_cpp

    result |= {"version": llama_cpp.__version__,
               "system_info": llama_cpp.llama_print_system_info().decode()}
    print(_PREFIX + json.dumps(result), flush=True)


def main_or_child(main, child) -> None:
    """A bench script's entry point: its llama.cpp child when run with CHILD_FLAG, else main."""
    (child if sys.argv[1:] == [CHILD_FLAG] else main)()


def system_info_line(result: dict) -> str:
    """The CPU features the child's llama.cpp was built with, for the bench's output."""
    return f"llama.cpp system info: {result['system_info'].strip()}"
