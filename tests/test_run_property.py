"""Property: whatever a JSONL file holds, `pagedgen run` answers or reports every line.

Random files of random JSON (any type and depth), random bytes, random unicode with lone
surrogates and random sampling fields, run on a tiny model: exit 0 or 1, exactly one record
(result or error) per non-blank line, no traceback, the input unchanged.
"""

import hashlib
import json
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from pagedgen.cli.app import app
from pagedgen.engine.sampling_params import SAMPLING_RULES
from tiny_models import tiny_model_dir

SURROGATES = st.sampled_from(["\ud800", "\udfff", "\udc00x"])
TEXT = st.one_of(st.text(max_size=30), st.builds(lambda a, s, b: a + s + b,
                                                 st.text(max_size=5), SURROGATES, st.text(max_size=5)))
# No subnormal floats: a native kernel library loaded earlier in the same worker may have set
# flush-to-zero, and hypothesis then refuses to generate them.
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
                    st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=False), TEXT)
JSON = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(TEXT, inner, max_size=4)), max_leaves=12)
SAMPLING = st.dictionaries(st.sampled_from(sorted(SAMPLING_RULES)), st.one_of(
    SCALARS, st.integers(min_value=-2, max_value=8), st.lists(st.integers(-1, 600), max_size=3)),
    max_size=4)
PROMPT = st.one_of(
    st.builds(lambda p: {"prompt": p}, TEXT),
    st.builds(lambda c: {"messages": [{"role": "user", "content": c}]}, TEXT),
    st.builds(lambda ids: {"prompt_token_ids": ids}, st.lists(st.integers(-1, 600), max_size=6)))
REQUEST = st.builds(lambda p, s, i: {**p, **s, **i}, PROMPT, SAMPLING,
                    st.one_of(st.just({}), st.builds(lambda v: {"id": v}, SCALARS)))


def _encode(value) -> bytes:
    return json.dumps(value).encode()   # ensure_ascii: lone surrogates become \ud800 escapes


LINE = st.one_of(
    REQUEST.map(_encode),
    JSON.map(_encode),
    st.binary(max_size=40).map(lambda b: b.replace(b"\n", b"")),
    TEXT.map(lambda t: t.encode("utf-8", "surrogatepass").replace(b"\n", b"")),
    st.just(b""), st.just(b"   "))

CONFIG = None


def config_path() -> Path:
    global CONFIG
    if CONFIG is None:
        folder = Path(tempfile.mkdtemp(prefix="pagedgen-prop-"))
        CONFIG = folder / "tiny.yaml"
        CONFIG.write_text(f"model: {tiny_model_dir('llama')}\ndtype: float32\ndevice: cpu\n"
                          "num_blocks: 64\nmax_num_seqs: 4\nmax_model_len: 32\nthreads: 1\n"
                          "sampling:\n  max_tokens: 2\n  temperature: 0\n")
    return CONFIG


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(LINE, min_size=1, max_size=8))
# A key U+0085 echoed raw in an error message once split the record for str.splitlines.
@example([b'{"\\u0085": {"\\ud800": null}}'])
def test_every_line_is_answered_or_reported(lines):
    with tempfile.TemporaryDirectory() as folder:
        inputs = Path(folder) / "in.jsonl"
        inputs.write_bytes(b"".join(line + b"\n" for line in lines))
        digest = hashlib.sha256(inputs.read_bytes()).hexdigest()
        result = CliRunner().invoke(app, ["run", str(inputs), "-c", str(config_path()), "-q",
                                          "--no-report"])
        assert result.exit_code in (0, 1), (result.exit_code, result.stderr)
        assert "Traceback" not in result.stderr
        non_blank = [n for n, line in enumerate(lines, 1) if line.rstrip(b"\r\n").strip()]
        records = []
        for name in ("in.completions.jsonl", "in.completions.errors.jsonl"):
            path = Path(folder) / name
            records += [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
        assert len(records) == len(non_blank)
        numbers = [r.get("line", (r.get("error") or {}).get("line")) for r in records]
        known = [n for n in numbers if n is not None]   # OpenAI results carry no line
        assert len(set(known)) == len(known) and set(known) <= set(non_blank)
        assert (result.exit_code == 1) == any("error" in r and r["error"] for r in records)
        assert hashlib.sha256(inputs.read_bytes()).hexdigest() == digest
