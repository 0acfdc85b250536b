"""S3 faults, through a fault-injecting proxy of our own on loopback (s3_faults.py) in
front of the local S3 server: transient ones (503 SlowDown, 500, reset connections,
stalls) at 10% of requests leave the codegen and scoring jobs complete, every row exactly
once and reconciled; persistent ones (no such bucket, access denied) stop a job at once
with a message naming the path."""

import json

import pytest

from configs import load_config
from jobs.codegen import main as codegen_main
from jobs.codegen import run_codegen
from jobs.score_code import run_score_code
from humaneval_inputs import write_codegen_input
from configs.schema import CodeScoringConfig
from pipelines.storage import FsSpec
from s3_faults import FaultyS3

pytestmark = pytest.mark.integration

BUCKET = "s3-fault-tests"


@pytest.fixture(scope="module")
def bucket(s3):
    s3.create_bucket(BUCKET)
    return BUCKET


@pytest.fixture()
def proxy(s3):
    p = FaultyS3(s3.endpoint_url, fault_rate=0.1, stall_s=1.5)
    yield p
    p.stop()


def _ids(s3, prefix: str, kind: str) -> list[str]:
    fs = s3.filesystem()  # read back directly, not through the proxy
    return [json.loads(line)["custom_id"] for path in sorted(fs.find(f"{prefix}/{kind}"))
            for line in fs.cat_file(path).decode().splitlines()]


def test_codegen_and_scoring_finish_every_row_once_through_ten_percent_faults(s3, bucket, proxy, ray_local,
                                                                               tiny_models):
    rows = write_codegen_input(FsSpec(s3.endpoint_url), f"s3://{bucket}/in", n=2, num_shards=3, limit=6,
                               max_tokens=8, temperature=0.8, seed=1)
    gen = run_codegen(load_config("tiny", [f"input=s3://{bucket}/in", f"output=s3://{bucket}/gen",
                                           f"s3_endpoint_url={proxy.endpoint_url}", "sampling.max_tokens=8"]))
    assert gen["reconciled"] and gen["rows_in"] == gen["rows_ok"] == rows == 12
    generated = _ids(s3, f"{bucket}/gen", "results")
    assert sorted(generated) == sorted(set(generated)) and len(generated) == rows  # exactly once
    assert gen["engines"]["num_engines"] >= 1 and gen["engines"]["num_engine_deaths"] == 0

    cfg = load_config("tiny", [f"input=s3://{bucket}/gen", f"output=s3://{bucket}/score",
                               f"s3_endpoint_url={proxy.endpoint_url}"])
    scored = run_score_code(cfg, CodeScoringConfig(k=[1, 2]))
    assert scored["reconciled"] and scored["rows_in"] == rows
    assert sorted(_ids(s3, f"{bucket}/score", "results") + _ids(s3, f"{bucket}/score", "errors")) == sorted(generated)
    # They happened: one request in ten failed, each kind in turn (dozens of requests here).
    assert proxy.num_requests >= 40 and all(proxy.counts[k] >= 1 for k in FaultyS3.KINDS), proxy.counts


def test_a_missing_output_bucket_stops_the_job_at_once_naming_the_path(s3, bucket, ray_local, capsys):
    s3.filesystem().pipe_file(f"{bucket}/ok-in/a.jsonl", b'{"id": "a", "prompt": "def f():"}\n')
    code = codegen_main([f"input=s3://{bucket}/ok-in", "output=s3://no-such-bucket-here/out",
                         f"s3_endpoint_url={s3.endpoint_url}"])
    err = capsys.readouterr().err
    assert code == 2 and "s3://no-such-bucket-here/out/_config.yaml" in err and "bucket does not exist" in err


def test_denied_input_stops_the_job_naming_the_path(s3, bucket, ray_local, tiny_models, capsys):
    s3.filesystem().pipe_file(f"{bucket}/denied/a.jsonl", b'{"id": "a", "prompt": "def f():"}\n')
    proxy = FaultyS3(s3.endpoint_url, fault_rate=0.0, denied_prefixes=(f"{bucket}/denied/",))
    try:  # listing the prefix is allowed, reading the shard (inside a Ray task) is not
        code = codegen_main([f"input=s3://{bucket}/denied", f"output=s3://{bucket}/denied-out",
                             f"s3_endpoint_url={proxy.endpoint_url}"])
    finally:
        proxy.stop()
    err = capsys.readouterr().err
    assert code == 2 and f"reading shard s3://{bucket}/denied/a.jsonl" in err and "PermissionError" in err
    assert proxy.counts["denied"] >= 1
