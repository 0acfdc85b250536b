import pytest

from actors.requests import RequestError, parse_request, resolved_sampling
from configs.schema import SamplingDefaults

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "field, value",
    [("max_tokens", -3), ("max_tokens", 0), ("temperature", -0.5), ("top_p", 1.5), ("top_p", 0)],
)
def test_bad_sampling_value_is_named(field, value):
    with pytest.raises(RequestError) as err:
        parse_request({"id": "r1", "prompt": "x", field: value})
    assert field in str(err.value) and repr(value) in str(err.value)


def test_prompt_or_messages_exactly_one():
    with pytest.raises(RequestError, match="exactly one of prompt or messages"):
        parse_request({"id": "r1"})
    with pytest.raises(RequestError, match="exactly one of prompt or messages"):
        parse_request({"id": "r1", "prompt": "a", "messages": [{"role": "user", "content": "b"}]})


def test_unknown_option_is_refused_by_name():
    with pytest.raises(RequestError, match="logit_bias"):
        parse_request({"id": "r1", "prompt": "a", "logit_bias": {"1": 2}})


def test_defaults_fill_unset_options_only():
    req = parse_request({"id": "r1", "prompt": "a", "temperature": 0.7, "stop": "\n\n"})
    values = resolved_sampling(req, SamplingDefaults(max_tokens=64, temperature=0.0))
    assert values == {"max_tokens": 64, "temperature": 0.7, "top_p": 1.0, "stop": ["\n\n"], "seed": None,
                      "ignore_eos": False}


def test_ignore_eos_is_off_unless_asked_and_must_be_a_boolean():
    assert resolved_sampling(parse_request({"id": "r1", "prompt": "a"}), SamplingDefaults())["ignore_eos"] is False
    req = parse_request({"id": "r1", "prompt": "a", "ignore_eos": True})
    assert resolved_sampling(req, SamplingDefaults())["ignore_eos"] is True
    with pytest.raises(RequestError, match="ignore_eos"):
        parse_request({"id": "r1", "prompt": "a", "ignore_eos": "sometimes"})
