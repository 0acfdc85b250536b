"""The Serve settings the app ships with (serving.serve_env)."""

import pytest

from serving.serve_env import DIRECT_PORT_RANGE_VARS, GRPC_PORT_RANGE_VARS, SERVE_ENV, serve_env

pytestmark = pytest.mark.unit


def test_port_ranges_are_set_only_when_asked_and_hold_the_asked_count():
    assert serve_env() == SERVE_ENV
    env = serve_env(first_http_port=8001, first_grpc_port=9001, ports=4)
    assert [env[v] for v in DIRECT_PORT_RANGE_VARS] == ["8001", "8004"]
    assert [env[v] for v in GRPC_PORT_RANGE_VARS] == ["9001", "9004"]
    assert env["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1"


@pytest.mark.parametrize("first", [80, 65530])
def test_a_port_range_off_the_usable_ports_is_refused_naming_it(first):
    with pytest.raises(ValueError, match=str(first)):
        serve_env(first_http_port=first)


def test_make_serve_runs_with_the_shipped_settings(repo_root):
    serve_line = next(line for line in (repo_root / "Makefile").read_text().splitlines()
                      if "serve run" in line and line.startswith("\t"))
    assert "-m serving.serve_env" in serve_line
