"""What `LLM.generate` returns, in vLLM's shape (RequestOutput holding CompletionOutputs)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(slots=True)
class Logprob:
    """Log-probability of one token at one position, under the raw model distribution."""

    logprob: float
    rank: int                          # 1 = the most likely token at that position
    decoded_token: str | None = None


@dataclass(slots=True)
class CompletionOutput:
    index: int                         # sample index within the request (0 .. n-1)
    text: str
    token_ids: list[int]
    # Sum of the sampled tokens' raw logprobs; like vLLM, only when logprobs were asked for
    # (logprobs=0 gives it without alternatives): it costs a log-softmax over the vocabulary.
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None  # per generated position, when asked for
    finish_reason: str | None          # "stop" or "length"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int             # over all n samples
    cached_prompt_tokens: int          # prompt tokens served from the prefix cache

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class RequestFailedError(IndexError):
    """Raised by `outputs[i]` of a request that could not be served: the reason, not a bare
    IndexError. An IndexError still, so code that caught the old one keeps working."""


class FailedOutputs(list):
    """The `outputs` of a failed request: empty to iterate and len(), but indexing raises the
    request's error, so `out.outputs[0].text` can never pass for an empty success."""

    def __init__(self, items: Any = (), error: str = "the request failed") -> None:
        super().__init__(items)
        self.error = error

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return super().__getitem__(index)
        raise RequestFailedError(f"{self.error} (RequestOutput.error; this request has no outputs)")


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    usage: Usage
    error: str | None = None           # set when the request could not be served at all
    metrics: dict[str, float] = field(default_factory=dict)
    # SamplingParams.prompt_logprobs: None for the first prompt token, then {token: Logprob}.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    def __post_init__(self) -> None:
        if self.error and not self.outputs:
            self.outputs = FailedOutputs(error=self.error)

    def to_dict(self) -> dict:
        """Plain JSON-ready data (Logprob entries keyed by str(token id), as JSON requires)."""
        data = asdict(self)
        for output in data["outputs"]:
            if output["logprobs"] is not None:
                output["logprobs"] = [{str(t): lp for t, lp in pos.items()} for pos in output["logprobs"]]
        if data["prompt_logprobs"] is not None:
            data["prompt_logprobs"] = [None if pos is None else {str(t): lp for t, lp in pos.items()}
                                       for pos in data["prompt_logprobs"]]
        return data


@dataclass(slots=True)
class BeamCompletionOutput(CompletionOutput):
    """One finished beam of a beam search request (outputs are best first)."""

    score: float = 0.0                 # cumulative_logprob / len(token_ids) ** length_penalty


@dataclass(slots=True)
class BeamSearchSequence:
    """One beam of `LLM.beam_search`, in vLLM's shape (tokens include the prompt)."""

    tokens: list[int]
    output_token_ids: list[int]
    text: str
    cum_logprob: float
    score: float                       # cum_logprob / len(output_token_ids) ** length_penalty
    finish_reason: str                 # "stop" (EOS) or "length"


@dataclass(slots=True)
class BeamSearchOutput:
    """All beams of one prompt, best first."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[BeamSearchSequence]
    error: str | None = None

    @classmethod
    def from_request_output(cls, output: RequestOutput) -> BeamSearchOutput:
        prompt = output.prompt_token_ids
        beams = [BeamSearchSequence(prompt + c.token_ids, c.token_ids, c.text,
                                    c.cumulative_logprob, c.score, c.finish_reason)
                 for c in output.outputs]
        return cls(output.request_id, output.prompt, prompt, beams, output.error)
