"""Constrained decoding on llguidance: compiled grammars, per-sample matchers, logits masks.

Why llguidance rather than xgrammar (both measured in docs/structured-outputs.md): its JSON
strings follow the JSON grammar (xgrammar 0.2.9 lets raw control characters into strings,
which json.loads rejects), it has no dependencies (xgrammar pulls torch, transformers, triton,
pydantic and tvm-ffi pins into the resolver), and it compiles lazily: a new schema costs well
under a millisecond. vLLM's `grammar=` strings (GBNF-style EBNF) are converted to Lark by
llguidance's own converter; Lark grammars are taken as they are.

One `GrammarBackend` per tokenizer (shared by every engine using that tokenizer object) holds
the llguidance tokenizer and a cache of compiled grammars keyed by the constraint's canonical
text: a batch of a million lines with one schema compiles it once. Each sample owns a matcher
(its position in the grammar); the engine advances it once per sampled token, and never while
re-prefilling after a preemption, since recomputed tokens are not sampled again.

Per step, `mask_logits` fills the bitmasks of all constrained rows in one call into the
library and applies them with one vectorized masked fill; unconstrained rows are not touched.
llguidance is imported on first use only: requests without a constraint never load it.
"""

from __future__ import annotations

import json
import threading
import time
import weakref
from typing import Any

import torch

from pagedgen.engine.structured_params import StructuredOutputsParams

INSTALL_HINT = "structured outputs need llguidance: pip install 'pagedgen[structured]'"

# Bit j of byte b allows token 8*b + j (the int32 mask words, little-endian, seen as bytes):
# row b of this table is True where a token of that byte is forbidden.
_BYTE_BANS = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1) == 0
_NEG_INF_BITS = -8388608   # 0xFF800000 as an int32: the bits of float32 -inf

_backends: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_backends_lock = threading.Lock()


class InvalidConstraintError(ValueError):
    """A schema, regex or grammar that cannot be compiled; fails its request only."""


def _llguidance() -> Any:
    try:
        import llguidance
        import llguidance.gbnf_to_lark
        import llguidance.hf
    except ImportError as exc:
        raise InvalidConstraintError(INSTALL_HINT) from exc
    return llguidance


def backend_for(tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> GrammarBackend:
    """The backend of this tokenizer (compiled grammars are cached per schema and tokenizer)."""
    key = (vocab_size, tuple(sorted(stop_token_ids)))
    with _backends_lock:
        per_tokenizer = _backends.setdefault(tokenizer, {})
        if key not in per_tokenizer:
            per_tokenizer[key] = GrammarBackend(tokenizer, vocab_size, stop_token_ids)
        return per_tokenizer[key]


class GrammarBackend:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        llg = _llguidance()
        self.vocab_size = vocab_size
        # EOS (any of the model's stop tokens) is allowed exactly where the grammar may end.
        self._tokenizer = llg.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                                eos_token=sorted(stop_token_ids))
        self._compiled: dict[tuple[str, str, bool], Any] = {}
        # One thread: the engine's step already uses the cores, and a mask is small work.
        self._executor = llg.LLExecutor(num_threads=1)
        self.compile_seconds = 0.0          # total spent compiling (reported by the benchmark)

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """A matcher at the start of `spec`'s grammar, from the cache when an equal one was
        compiled; new samples start from copies of it."""
        key = spec.cache_key()
        compiled = self._compiled.get(key)
        if compiled is None:
            start = time.perf_counter()
            compiled = self._compiled[key] = self._compile(spec)
            self.compile_seconds += time.perf_counter() - start
        return compiled

    def _compile(self, spec: StructuredOutputsParams) -> Any:
        llg = _llguidance()
        grammar = _grammar_text(llg, spec)
        try:
            matcher = llg.LLMatcher(self._tokenizer, grammar, log_level=0)
        except Exception as exc:  # a bad regex / grammar raises at construction
            raise _invalid(spec, str(exc)) from None
        if matcher.is_error():   # a bad schema shows here
            raise _invalid(spec, matcher.get_error())
        _check_can_start(spec, matcher)
        return matcher

    @staticmethod
    def new_matcher(compiled: Any) -> Any:
        return compiled.deep_copy()

    @torch.inference_mode()  # the runner's logits are inference tensors
    def mask_logits(self, logits: torch.Tensor, rows: list[int], matchers: list[Any]) -> None:
        """Sets the logits of every token the matchers forbid to -inf, in place, for `rows`."""
        words = (logits.shape[-1] + 31) // 32
        bitmask = torch.full((len(rows), words), -1, dtype=torch.int32)
        self._executor.unsafe_compute_mask_ptr(list(zip(matchers, range(len(rows)))),
                                               bitmask.data_ptr(), words * 4, len(rows))
        penalty = additive_mask(forbidden_tokens(bitmask, logits.shape[-1])).to(logits.device)
        if len(rows) == logits.shape[0]:    # every row constrained
            logits.add_(penalty)
        else:
            logits.index_add_(0, torch.tensor(rows, device=logits.device), penalty)


def _grammar_text(llg: Any, spec: StructuredOutputsParams) -> str:
    kind, matcher = spec.kind, llg.LLMatcher
    try:
        if kind in ("json", "json_object"):
            # json_object means an object (OpenAI's meaning), not any JSON value.
            schema = _schema_text(spec.json) if kind == "json" else '{"type": "object"}'
            options = {"whitespace_flexible": not spec.disable_any_whitespace}
            return matcher.grammar_from_json_schema(schema, defaults=options)
        if kind == "regex":
            return matcher.grammar_from_regex(spec.regex)
        if kind == "choice":
            return matcher.grammar_from_lark(choice_grammar(spec.choice))
        # GBNF-style EBNF (vLLM's grammar=) is converted; Lark is taken as it is.
        return matcher.grammar_from_lark(llg.gbnf_to_lark.any_to_lark(spec.grammar))
    except InvalidConstraintError:
        raise
    except Exception as exc:
        raise _invalid(spec, str(exc)) from None


def _check_can_start(spec: StructuredOutputsParams, matcher: Any) -> None:
    """A grammar with no first token (a schema that is only a reference to itself,
    {"$ref": "#"}) is refused here, as an invalid request, rather than run: run, its first mask
    allows nothing, the sample ends at once, and an empty text would be reported as a finished
    success. An error record says what is wrong before any compute is spent, where a
    "length" finish would blame the token limit. (A grammar that can start but never end,
    such as a required property that nests the schema in itself, is not decidable this cheaply:
    it runs to max_tokens and finishes with "length", which is then true.)"""
    probe = matcher.deep_copy()
    probe.compute_bitmask()
    if probe.is_error():
        raise InvalidConstraintError(
            f"invalid structured_outputs.{spec.kind}: no output can ever satisfy it (the "
            "grammar has no first token, e.g. a schema that is only a reference to itself, "
            f'{{"$ref": "#"}}); library says: {_first_lines(probe.get_error(), 80)}')


def _invalid(spec: StructuredOutputsParams, message: str) -> InvalidConstraintError:
    return InvalidConstraintError(f"invalid structured_outputs.{spec.kind}: {_first_lines(message)}")


def additive_mask(forbidden: torch.Tensor) -> torch.Tensor:
    """float32 -inf where forbidden, +0.0 elsewhere, built from the int32 bit pattern of -inf.

    Adding it is branch-free; masked_fill_ / where branch per element and measured several
    times slower on CPU when allowed and forbidden tokens interleave."""
    return forbidden.to(torch.int32).mul_(_NEG_INF_BITS).view(torch.float32)


def forbidden_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [rows, words] bitmask (bit set = allowed) -> bool [rows, vocab_size], True where
    forbidden; one lookup in a 256-entry byte table instead of 32 shifts per word."""
    as_bytes = bitmask.contiguous().view(torch.uint8).reshape(-1).to(torch.int32)
    return _BYTE_BANS.index_select(0, as_bytes).reshape(bitmask.shape[0], -1)[:, :vocab_size]


def choice_grammar(choices: tuple[str, ...]) -> str:
    """Lark accepting exactly one of the strings (JSON string escapes are Lark's as well)."""
    return "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _schema_text(schema: dict | str) -> str:
    if isinstance(schema, dict):
        return json.dumps(schema)
    try:
        json.loads(schema)
    except json.JSONDecodeError as exc:
        raise InvalidConstraintError(f"invalid structured_outputs.json: not JSON ({exc.msg} at "
                                     f"column {exc.colno})") from None
    return schema


def _first_lines(message: str, limit: int = 300) -> str:
    """The head of the library's message (it may append a state dump), on one line."""
    text = " ".join(line.strip() for line in message.strip().splitlines()[:3])
    return text if len(text) <= limit else text[:limit] + "..."
