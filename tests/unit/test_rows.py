import json

import pytest

from pipelines.rows import RowError, error_line, parse_line, response_line, sample_requests

pytestmark = pytest.mark.unit


def test_openai_batch_chat_line_becomes_chat_request():
    line = json.dumps({
        "custom_id": "c1", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                 "max_completion_tokens": 9, "temperature": 0.2},
    })
    cid, request, kind = parse_line(line)
    assert (cid, kind) == ("c1", "chat")
    assert request == {"id": "c1", "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": 9, "temperature": 0.2}


def test_plain_and_humaneval_rows():
    assert parse_line('{"id": 7, "prompt": "def f():"}')[:2] == ("7", {"id": "7", "prompt": "def f():"})
    he = {"task_id": "HumanEval/0", "prompt": "def f():", "entry_point": "f", "test": "...",
          "canonical_solution": "pass"}
    cid, request, kind = parse_line(json.dumps(he))
    assert (cid, request, kind) == ("HumanEval/0", {"id": "HumanEval/0", "prompt": "def f():"}, "completion")


@pytest.mark.parametrize(
    "line, reason, named",
    [
        ('{"custom_id": "a", "body": ', "bad_json", "Expecting value"),
        ('{"prompt": "x"}', "missing_field", "custom_id/task_id/id"),
        ('{"custom_id": "a", "url": "/v1/completions", "body": {"max_tokens": 3}}', "missing_field", "body.prompt"),
        ('{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x", "max_tokens": -1}}',
         "invalid_request", "-1"),
        ('{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x", "min_p": 0.1}}',
         "invalid_request", "body.min_p"),
        ('{"custom_id": "a", "url": "/v1/embeddings", "body": {"input": "x"}}', "invalid_request", "/v1/embeddings"),
        ('[1, 2]', "invalid_request", "list"),
        ('{"id": "a", "prompt": "x", "temperature": "hot"}', "invalid_request", "hot"),
    ],
)
def test_bad_rows_get_a_reason_naming_the_value(line, reason, named):
    with pytest.raises(RowError) as err:
        parse_line(line)
    assert err.value.reason == reason
    assert named in err.value.message


def test_output_lines_follow_openai_batch_shape():
    result = {"text": "return 1", "finish_reason": "stop", "num_prompt_tokens": 5, "num_output_tokens": 3}
    ok = response_line("c1", "completion", result, "tiny")
    assert ok["custom_id"] == "c1" and ok["error"] is None
    body = ok["response"]["body"]
    assert body["choices"][0]["text"] == "return 1"
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    chat = response_line("c2", "chat", result, "tiny")["response"]["body"]
    assert chat["object"] == "chat.completion" and chat["choices"][0]["message"]["content"] == "return 1"
    err = error_line("c3", "bad_json", "oops", 4)
    assert err["response"] is None and err["error"] == {"code": "bad_json", "message": "oops", "line": 4}


def test_n_samples_of_one_row_get_stable_ids_and_distinct_seeds():
    line = json.dumps({"custom_id": "t1", "url": "/v1/completions",
                       "body": {"prompt": "def f():", "n": 3, "temperature": 0.7, "seed": 5}})
    cid, request, _ = parse_line(line)
    samples = sample_requests(cid, request)
    assert [s for s, _ in samples] == ["t1#0", "t1#1", "t1#2"]
    assert [r["seed"] for _, r in samples] == [5, 6, 7] and all(r["id"] == s for s, r in samples)
    assert all("n" not in r for _, r in samples)  # the engine gets one plain request per sample
    plain = parse_line('{"id": "p", "prompt": "x"}')
    assert [s for s, _ in sample_requests(plain[0], plain[1], default_n=2, default_temperature=0.8)] == ["p#0", "p#1"]
    assert sample_requests(plain[0], plain[1]) == [("p", plain[1])]


@pytest.mark.parametrize("n, named", [(0, "got 0"), (1.5, "got 1.5"), ("2", "got '2'"), (129, "got 129")])
def test_bad_n_is_refused_naming_the_value(n, named):
    with pytest.raises(RowError) as err:
        parse_line(json.dumps({"id": "a", "prompt": "x", "temperature": 0.5, "n": n}))
    assert err.value.reason == "invalid_request" and named in err.value.message


def test_greedy_n_samples_are_refused_rather_than_copied():
    cid, request, _ = parse_line(json.dumps({"id": "a", "prompt": "x", "n": 2}))
    with pytest.raises(RowError, match="temperature > 0"):
        sample_requests(cid, request)
