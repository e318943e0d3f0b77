"""Output files: streamed lines, resume after a cut-off line, ordered file, record shapes."""

import json
import os

import pytest

from pagedgen.jobs import openai_batch
from pagedgen.jobs.output_files import (JsonlAppender, OutputFileError, RequestResult, SampleResult,
                                    TokenLogprob, completed_keys, error_record, result_record,
                                    truncate_partial_line, write_atomically, write_ordered)
from pagedgen.jobs.input_records import Request, RequestError


def result(request, text="hi", token_ids=(5, 6), logprobs=None):
    sample = SampleResult(0, text, list(token_ids), "length", None, logprobs)
    return RequestResult(request, prompt_tokens=3, samples=[sample], model="tiny", cached_prompt_tokens=2)


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_appender_writes_one_flushed_line_per_record(tmp_path):
    path = tmp_path / "out" / "o.jsonl"
    with JsonlAppender(path, fsync_every=2) as out:
        out.write({"id": 1, "text": "a\nb"})
        # Visible to another reader before close: flushed per record.
        assert json.loads(path.read_text()) == {"id": 1, "text": "a\nb"}
        out.write({"id": "é"})
    assert lines(path) == [{"id": 1, "text": "a\nb"}, {"id": "é"}]
    with JsonlAppender(path) as out:  # appends, never truncates
        out.write({"id": 3})
    assert len(lines(path)) == 3


def test_a_record_is_one_line_for_every_line_splitter(tmp_path):
    # U+0085, U+2028 and U+2029 are legal raw in JSON but end a line for str.splitlines.
    text = "a\x85b\u2028c\u2029d\x0be\x1cf é"
    path = tmp_path / "o.jsonl"
    with JsonlAppender(path) as out:
        out.write({"text": text})
    assert len(path.read_text(encoding="utf-8").splitlines()) == 1
    assert lines(path) == [{"text": text}]


def test_truncate_partial_line(tmp_path):
    path = tmp_path / "o.jsonl"
    path.write_bytes(b'{"id": 1}\n{"id": 2}\n{"id": 3, "te')
    assert truncate_partial_line(path) == len(b'{"id": 3, "te')
    assert path.read_bytes() == b'{"id": 1}\n{"id": 2}\n'
    assert truncate_partial_line(path) == 0
    path.write_bytes(b'{"id": 1')  # no complete line at all
    truncate_partial_line(path)
    assert path.read_bytes() == b""


def test_truncate_partial_line_across_read_chunks(tmp_path):
    path = tmp_path / "o.jsonl"
    path.write_bytes(b'{"id": 1}\n' + b"x" * 200_000)
    truncate_partial_line(path)
    assert path.read_bytes() == b'{"id": 1}\n'


def test_completed_keys_reads_plain_and_openai_records(tmp_path):
    path = tmp_path / "o.jsonl"
    plain = result_record(result(Request(1, 7, prompt="p")))
    batch = result_record(result(Request(2, "c9", messages=[], openai_url=openai_batch.CHAT_URL)))
    path.write_bytes((json.dumps(plain) + "\n" + json.dumps(batch) + "\n" + '{"id": "cut').encode())
    assert completed_keys(path) == {"7", "c9"}
    assert completed_keys(tmp_path / "absent.jsonl") == set()


def test_damaged_middle_line_refuses_resume(tmp_path):
    path = tmp_path / "o.jsonl"
    path.write_text('{"id": 1}\nnot json\n{"id": 2}\n')
    with pytest.raises(OutputFileError, match="line 2 is not a result record"):
        completed_keys(path)


def test_plain_result_record():
    token = TokenLogprob(6, "b", -0.5, [TokenLogprob(6, "b", -0.5), TokenLogprob(9, "z", -1.5)])
    record = result_record(result(Request(4, "q", prompt="p"), logprobs=[token]))
    assert record == {"id": "q", "line": 4, "usage": {"prompt_tokens": 3, "completion_tokens": 2,
                                                      "total_tokens": 5, "cached_prompt_tokens": 2},
                      "outputs": [{"index": 0, "text": "hi", "token_ids": [5, 6],
                                   "finish_reason": "length", "stop_reason": None,
                                   "logprobs": [{"token_id": 6, "token": "b", "logprob": -0.5,
                                                 "top": [{"token_id": 6, "token": "b", "logprob": -0.5},
                                                         {"token_id": 9, "token": "z", "logprob": -1.5}]}]}]}


def test_openai_chat_record_shape():
    request = Request(1, "c1", messages=[], openai_url=openai_batch.CHAT_URL)
    token = TokenLogprob(6, "hi", -0.25, [TokenLogprob(6, "hi", -0.25)])
    record = result_record(result(request, token_ids=[6], logprobs=[token]))
    assert record["custom_id"] == "c1" and record["error"] is None
    assert record["id"].startswith("batch_req_")
    response = record["response"]
    assert response["status_code"] == 200 and response["request_id"]
    body = response["body"]
    assert body["object"] == "chat.completion" and body["model"] == "tiny"
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                                "finish_reason": "length", "logprobs": {"refusal": None, "content": [
                                    {"token": "hi", "logprob": -0.25, "bytes": [104, 105],
                                     "top_logprobs": [{"token": "hi", "logprob": -0.25, "bytes": [104, 105]}]}]}}]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4,
                             "prompt_tokens_details": {"cached_tokens": 2}}


def test_openai_completion_record_shape():
    request = Request(1, "c2", prompt="p", openai_url=openai_batch.COMPLETIONS_URL)
    tokens = [TokenLogprob(5, "ab", -1.0, [TokenLogprob(5, "ab", -1.0)]), TokenLogprob(6, "c", -2.0)]
    body = result_record(result(request, text="abc", logprobs=tokens))["response"]["body"]
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == "abc"
    assert body["choices"][0]["logprobs"] == {"tokens": ["ab", "c"], "token_logprobs": [-1.0, -2.0],
                                              "top_logprobs": [{"ab": -1.0}, {}], "text_offset": [0, 2]}


def test_error_records():
    plain = error_record(RequestError(3, "bad", "x"))
    assert plain == {"id": "x", "line": 3, "error": {"code": "invalid_request", "message": "line 3: bad"}}
    batch = error_record(RequestError(5, "worse", "c5", openai=True))
    assert batch["custom_id"] == "c5" and batch["response"] is None
    assert batch["error"] == {"code": "invalid_request", "message": "line 5: worse", "line": 5}


def test_write_atomically_replaces_whole_file(tmp_path):
    path = tmp_path / "ordered.jsonl"
    path.write_text("old\n")

    def failing():
        yield b"new\n"
        raise RuntimeError("interrupted while writing")
    with pytest.raises(RuntimeError):
        write_atomically(path, failing())
    assert path.read_text() == "old\n"  # the half-written temp file never took its place
    write_atomically(path, [b"a\n", b"b\n"])
    assert path.read_text() == "a\nb\n" and os.listdir(tmp_path) == ["ordered.jsonl"]


def test_write_ordered_interleaves_results_and_errors_in_input_order(tmp_path):
    a, b = Request(1, "a", prompt="x"), Request(3, "b", prompt="y")
    bad = RequestError(2, "broken")
    output, ordered = tmp_path / "o.jsonl", tmp_path / "o.ordered.jsonl"
    with JsonlAppender(output) as out:
        out.write(result_record(result(b)))
        out.write(result_record(result(a)))
    write_ordered(output, ordered, [a, bad, b])
    assert [r.get("id") for r in lines(ordered)] == ["a", None, "b"]
    assert "error" in lines(ordered)[1]
    with pytest.raises(OutputFileError, match="no result for id 'c'"):
        write_ordered(output, tmp_path / "x.jsonl", [a, Request(4, "c", prompt="z")])
    assert not (tmp_path / "x.jsonl").exists()
