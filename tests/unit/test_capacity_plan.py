"""The batch capacity estimate: what one engine delivers on paper, the pool a deadline
needs, and how the job's command line shows it. Pure arithmetic over shipped calibrations
and injected step costs: nothing here is timed."""

import json
import subprocess
import sys
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from configs import ConfigError, load_config
from actors.engine import Engine
from control.live import startup_schedule
from control.plan import resolve, resource_plan, run_engine_tokens_per_s
from jobs.cli import dry_run_report
from control.capacity import batch_pool_size, full_engine_throughput, steady_state_vs_paper
from control.model import StepCostModel
from pipelines.storage import ROW_SAMPLE_BYTES, FsSpec, count_rows, list_shards, read_shard

from calibrations import DRAFTER_PASS

pytestmark = pytest.mark.unit

# Verification cost grows with K x batch: drafting pays for one request, not for a full batch.
COST = StepCostModel(fixed_s=0.010, per_token_s=0.001, spec_overhead_s=0.001, draft_pass_s=0.002)
ACCEPTANCE = (0.8, 0.6, 0.4, 0.2)


def engine(k_choices, *, start_k=4, max_num_seqs=64, kv=0, plain=False):
    return full_engine_throughput(COST, ACCEPTANCE, k_choices, start_k=start_k, max_num_seqs=max_num_seqs,
                                  kv_capacity_tokens=kv, num_context_tokens_per_req=100, plain_engine=plain)


def test_a_full_engine_runs_the_k_that_pays_at_its_batch_and_a_static_preset_its_own_k():
    static = engine([4])
    chosen = engine(range(5))
    assert static.num_speculative_tokens == 4 and static.batch_size == 64
    assert chosen.tokens_per_s > static.tokens_per_s and chosen.num_speculative_tokens < 4
    one = engine(range(5), max_num_seqs=1)
    assert one.num_speculative_tokens > 0  # one request at a time: drafting pays
    # tokens/s is tokens per step over the step: checked against the model by hand
    k = chosen.num_speculative_tokens
    step = COST.step_time_s(64, k, 64 * 100)
    assert chosen.tokens_per_s == pytest.approx(64 * (1 + sum(ACCEPTANCE[:k])) / step)


def test_the_kv_cache_bounds_the_batch_and_draft_slots_take_their_share():
    # 10_000 KV tokens, 100 context + 4 draft slots + 1 per request -> 95 requests; max_num_seqs 128
    assert engine([4], max_num_seqs=128, kv=10_000).batch_size == 95
    assert engine([0], start_k=0, max_num_seqs=128, kv=10_000).batch_size == 99
    with pytest.raises(ValueError, match=r"0..start_k=4, got \[5\]"):
        engine([5])


def test_a_deadline_sizes_the_pool_to_the_engines_it_needs_and_no_more():
    # 3.6M tokens at 100 tok/s per engine = 10 engine-hours
    size = batch_pool_size(3.6e6, 100.0, min_actors=2, max_actors=8, deadline_s=4 * 3600)
    assert (size.engines_needed, size.min_actors, size.max_actors) == (3, 2, 3)
    assert size.hours_at_max == pytest.approx(10 / 3) and "within the 4 h deadline" in size.reason
    small = batch_pool_size(1000, 100.0, min_actors=2, max_actors=8, deadline_s=3600)
    assert (small.min_actors, small.max_actors) == (1, 1)  # min never above the sized max
    capped = batch_pool_size(3.6e6, 100.0, min_actors=1, max_actors=2, deadline_s=3600)
    assert (capped.engines_needed, capped.max_actors) == (10, 2)
    assert "the 1 h deadline needs 10 engines but pool.max_actors is 2: expect 5 h" in capped.reason
    assert "(20 min)" in batch_pool_size(1.2e5, 100.0, min_actors=1, max_actors=1, deadline_s=3600).reason
    unsized = batch_pool_size(3.6e6, 100.0, min_actors=2, max_actors=8)
    assert (unsized.min_actors, unsized.max_actors, unsized.engines_needed) == (2, 8, None)
    assert unsized.hours_at_min == pytest.approx(5.0)
    with pytest.raises(ValueError, match=r"deadline_s must be > 0, got -1"):
        batch_pool_size(1, 1.0, min_actors=1, max_actors=1, deadline_s=-1)


def test_a_run_is_compared_with_the_paper_in_steady_state_with_its_prefill_added():
    # 1000 output tokens at 100 tok/s on paper is 10 s of decode; 2000 prompt tokens at
    # 2.5 ms each add 5 s of prefill: 1000 / 15 s on paper for this run's work.
    got = steady_state_vs_paper(1000, 2000, generation_s=20.0, engine_tokens_per_s=100.0,
                                prefill_s_per_token=0.0025)
    assert got["paper_tokens_per_s_with_prefill"] == pytest.approx(1000 / 15)
    assert got["measured_steady_engine_tokens_per_s"] == pytest.approx(50.0)
    assert got["steady_vs_paper"] == pytest.approx(50.0 / (1000 / 15))
    # nothing generated: no measured rate, no ratio
    none = steady_state_vs_paper(0, 0, 0.0, 100.0, 0.001)
    assert none["measured_steady_engine_tokens_per_s"] is None and none["steady_vs_paper"] is None
    with pytest.raises(ValueError, match="-1"):
        steady_state_vs_paper(1, 1, 1.0, 100.0, -1)


def test_the_paper_for_a_finished_run_holds_its_prompts_kv_in_every_step():
    cfg = load_config("tiny", ["sampling.max_tokens=128"])
    before = resource_plan(cfg, 164).capacity["engine_tokens_per_s"]  # context: half of max_tokens
    # no prompt and the output the estimate assumed: the estimate's own rate
    assert run_engine_tokens_per_s(cfg, 0, 128) == pytest.approx(before, abs=0.05)  # the estimate is rounded
    short, long = run_engine_tokens_per_s(cfg, 40, 128), run_engine_tokens_per_s(cfg, 400, 128)
    assert before > short > long  # every decode step reads the prompts' KV
    with pytest.raises(ValueError, match="-1"):
        run_engine_tokens_per_s(cfg, -1, 128)
    assert run_engine_tokens_per_s(load_config("tiny", ["engine.spec.controller=off", "pool.calibration=null"]),
                                   40, 128) is None


def test_the_plan_for_a_gpu_preset_comes_from_its_calibration_and_sizes_nodes():
    cfg = load_config("qwen3-coder-30b-a3b-b200", ["pool.deadline_hours=2"])
    unsized = resource_plan(cfg)
    assert unsized.capacity is None and (unsized.min_actors, unsized.max_actors) == (8, 16)
    few = resource_plan(cfg, 10_000)
    many = resource_plan(cfg, 10_000_000)
    assert few.capacity["calibration"] == "b200-qwen3-coder-30b-a3b"
    assert few.capacity["output_tokens"] == 10_000 * 1024  # sampling.max_tokens: an upper bound
    assert few.max_actors == few.capacity["engines_needed"] == 1 and few.min_actors == 1
    assert many.max_actors == 16 and many.capacity["engines_needed"] > 16 and "pool.max_actors is 16" in many.capacity["reason"]
    assert many.nodes_for_max_actors == 2 and few.nodes_for_max_actors == 1
    tokens = resource_plan(cfg.model_copy(update={"pool": cfg.pool.model_copy(update={"output_tokens_per_row": 256})}),
                           10_000_000)
    assert tokens.capacity["output_tokens"] == 10_000_000 * 256 and tokens.capacity["engines_needed"] < many.capacity["engines_needed"]


def test_a_deadline_without_a_calibration_is_refused_naming_it():
    with pytest.raises(ConfigError, match=r"pool.deadline_hours \(3.0\) needs a calibration"):
        load_config("gpt-oss-20b-b200", ["engine.spec.controller=off", "pool.deadline_hours=3"])
    with pytest.raises(ValueError, match=r"pool.calibration='no-such' is neither a .json file nor one of \["):
        resource_plan(load_config("tiny", ["pool.calibration=no-such"]), 10)


def run_codegen_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jobs.codegen", *args], capture_output=True, text=True, timeout=120)


def test_dry_run_with_rows_prints_the_estimate_and_without_a_calibration_says_what_to_set():
    proc = run_codegen_cli("--config", "qwen3-coder-30b-a3b-b200", "--dry-run", "--rows", "1000000",
                           "pool.deadline_hours=2")
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)["resource_plan"]
    assert plan["capacity"]["rows"] == 1_000_000 and plan["max_actors"] == plan["capacity"]["engines_needed"]
    assert "deadline" in plan["summary"] and plan["capacity"]["shards_to_keep_engines_busy"] == 4 * plan["max_actors"]
    proc = run_codegen_cli("--config", "qwen3-coder-30b-a3b-b200", "--dry-run", "--rows", "1000", "--nodes", "16")
    plan = json.loads(proc.stdout)["resource_plan"]
    assert (plan["min_actors"], plan["max_actors"], plan["nodes_for_max_actors"]) == (128, 128, 16)
    assert run_codegen_cli("--config", "tiny", "--dry-run", "--nodes", "2").returncode == 2  # a CPU pool has no nodes to fill
    proc = run_codegen_cli("--config", "gpt-oss-20b-b200", "--dry-run", "--rows", "10", "engine.spec.controller=off")
    assert proc.returncode == 2 and "--rows 10 needs" in proc.stderr and "pool.calibration" in proc.stderr


def test_rows_are_counted_as_the_reader_reads_them(tmp_path):
    (tmp_path / "in").mkdir()
    pq.write_table(pa.table({"prompt": [f"def f{i}():" for i in range(7)]}), tmp_path / "in" / "a.parquet")
    (tmp_path / "in" / "b.jsonl").write_text('{"prompt": "x"}\n\n   \n{oops\n{"prompt": "y"}')  # no final newline
    for shard in list_shards(FsSpec(), str(tmp_path / "in")):
        assert count_rows(FsSpec(), shard) == sum(1 for _ in read_shard(FsSpec(), shard))
    assert [count_rows(FsSpec(), s) for s in list_shards(FsSpec(), str(tmp_path / "in"))] == [7, 3]


def test_a_large_jsonl_shard_is_counted_from_its_head_not_read_whole(tmp_path):
    (tmp_path / "in").mkdir()
    lines = [json.dumps({"prompt": "x" * (i % 97)}) if i % 10 else "" for i in range(60_000)]
    (tmp_path / "in" / "big.jsonl").write_text("\n".join(lines) + "\n")
    [shard] = list_shards(FsSpec(), str(tmp_path / "in"))
    assert shard.size > 3 * ROW_SAMPLE_BYTES
    fs_spec = _CountingFs()
    rows = count_rows(fs_spec, shard)
    assert sum(fs_spec.reads) <= ROW_SAMPLE_BYTES, fs_spec.reads
    assert abs(rows - 54_000) <= 0.02 * 54_000, rows  # 54,000 non-empty lines


@dataclass(frozen=True)
class _CountingFs(FsSpec):
    """The local filesystem, keeping the bytes of each read (whole-file opens refused)."""

    reads: list[int] = field(default_factory=list)

    def open_fs(self, uri):
        reads, fs = self.reads, super().open_fs(uri)

        class Counting:
            def __getattr__(self, name):
                return getattr(fs, name)

            def cat_file(self, path, start=None, end=None, **kwargs):
                data = fs.cat_file(path, start=start, end=end, **kwargs)
                reads.append(len(data))
                return data

            def open(self, *args, **kwargs):
                raise AssertionError(f"opened whole: {args}")

        return Counting()


def test_the_estimate_runs_the_k_the_preset_runs_at_a_full_batch():
    # The preset's controller would choose K itself; an engine whose K=0 step pays the drafter.
    fixed = ["engine.spec.controller=off", f"pool.calibration={DRAFTER_PASS}"]
    assert resource_plan(load_config("tiny", fixed), 100).capacity["engine_num_speculative_tokens"] == 4
    scheduled = load_config("tiny", [*fixed, "engine.spec.schedule=[[1,8,4],[9,32,0]]"])  # drafting off past 8
    off = resource_plan(scheduled, 100).capacity
    assert off["engine_num_speculative_tokens"] == 0 and off["engine_batch_size"] == 32
    plain = resource_plan(load_config("tiny", ["engine.spec.method=none", f"pool.calibration={DRAFTER_PASS}"]),
                          100).capacity
    assert plain["engine_num_speculative_tokens"] is None  # no drafter at all
    assert plain["engine_tokens_per_s"] > off["engine_tokens_per_s"]  # the drafter's K=0 pass costs


def test_a_batch_job_starts_its_engines_without_the_drafter_where_that_is_faster_kept_full():
    # DRAFTER_PASS: the tiny head's drafter costs half a step, so at a full batch of 32 the
    # engine is faster plain; the controller may restart it back, so the plan starts it plain.
    cfg = load_config("tiny", [f"engine.spec.controller.calibration={DRAFTER_PASS}",
                               "engine.spec.controller.replacement.enabled=true"])
    plan = resource_plan(cfg, 100)
    assert plan.capacity["engine_drafter"] is False and plan.engines_start_plain
    assert "engines start without the drafter" in plan.describe()
    started = plan.engine_config(cfg)
    assert started.engine.spec.controller.replacement.start_speculating is False
    assert started.engine.spec.method == "peagle"  # kept for the way back
    assert cfg.engine.spec.controller.replacement.start_speculating is True  # the job's config untouched
    # No way back (replacement off), no controller, or no work given: the engines keep the drafter.
    for other in (resource_plan(load_config("tiny", [f"engine.spec.controller.calibration={DRAFTER_PASS}",
                                                      "engine.spec.controller.replacement.enabled=false"]), 100),
                  resource_plan(load_config("tiny"), 100), resource_plan(cfg)):
        assert not other.engines_start_plain and other.engine_config(cfg) is cfg
    # Where drafting pays at a full batch (the B200 calibration of the Qwen3-Coder preset):
    # the engines start speculating.
    gpu = resource_plan(load_config("qwen3-coder-30b-a3b-b200",
                                    ["engine.spec.controller.calibration=b200-qwen3-coder-30b-a3b"]), 1000)
    assert gpu.capacity["engine_drafter"] is True and not gpu.engines_start_plain


def test_starting_without_the_drafter_needs_a_way_back():
    with pytest.raises(ValueError, match="start_speculating=false needs replacement.enabled=true"):
        load_config("tiny", [f"engine.spec.controller.calibration={DRAFTER_PASS}",
                             "engine.spec.controller.replacement={enabled: false, start_speculating: false}"])


def test_the_door_resolves_each_hosts_engine_once_and_the_dry_run_shows_what_runs():
    cfg = load_config("tiny", ["serve.max_num_batched_tokens=256"])
    run = resolve(cfg)
    table = [list(r) for r in startup_schedule(cfg.engine)]  # what the controller would choose first
    assert [list(r) for r in run.batch.engine.spec.schedule] == table
    assert [list(r) for r in run.serve_engine.spec.schedule] == table
    assert run.serve_engine.max_num_batched_tokens == 256 and run.batch.engine.max_num_batched_tokens is None
    assert cfg.engine.spec.schedule is None  # the loaded config is left as loaded
    shown = dry_run_report(cfg)["vllm_kwargs"]["speculative_config"]
    assert shown["num_speculative_tokens_per_batch_size"] == table  # the dry run shows the table the engines start with
    # A configured table is kept as it is, and an engine without a controller gets none.
    fixed = resolve(load_config("tiny", ["engine.spec.schedule=[[1,32,4]]"]))
    assert [list(r) for r in fixed.batch.engine.spec.schedule] == [[1, 32, 4]]
    off = resolve(load_config("tiny", ["engine.spec.controller=off"]))
    assert off.batch.engine.spec.schedule is None and off.serve_engine.spec.schedule is None


def test_an_engine_config_that_skipped_the_door_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"no start-up table .* resolve it first \(control.plan.resolve"):
        Engine(load_config("tiny").engine)  # refused before any engine starts
