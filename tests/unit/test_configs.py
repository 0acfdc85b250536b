import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from configs import ConfigError, load_config, preset_names, to_vllm_kwargs
from configs.sandbox_limits import SandboxLimits
from configs.schema import CodeScoringConfig
from configs.vllm_args import live_k_values
from control.plan import resolve, resource_plan

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]

GPU_PRESETS = {
    # preset: (expected head, expected tensor-parallel size per actor)
    "qwen3-coder-30b-a3b-b200": ("amazon/Qwen3-Coder-30B-A3B-Instruct-P-EAGLE", 1),
    "gpt-oss-20b-b200": ("amazon/GPT-OSS-20B-P-EAGLE", 1),
    "gpt-oss-120b-b200": ("amazon/gpt-oss-120b-p-eagle", 2),
    "gemma-4-31b-it-b200": ("amazon/Gemma-4-31B-IT-P-EAGLE", 1),
}


def run_job(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "jobs.codegen", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("preset", sorted(GPU_PRESETS))
def test_dry_run_shows_peagle_head_k_and_tp_for_gpu_presets(preset):
    proc = run_job("--config", preset, "--dry-run")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    spec = report["vllm_kwargs"]["speculative_config"]
    head, tp = GPU_PRESETS[preset]
    assert spec["method"] == "eagle3" and spec["parallel_drafting"] is True
    assert spec["model"] == head
    assert spec["num_speculative_tokens"] == 7
    assert report["vllm_kwargs"]["tensor_parallel_size"] == tp
    plan = report["resource_plan"]
    assert plan["gpus_per_actor"] == tp and plan["actors_per_node"] == 8 // tp
    assert report["vllm_kwargs"]["kv_cache_dtype"] == "fp8"


def test_dry_run_override_changes_k_and_head():
    proc = run_job(
        "--config", "gemma-4-31b-it-b200", "--dry-run",
        "engine.spec.num_speculative_tokens=5", "engine.spec.head=/heads/gemma4",
    )
    assert proc.returncode == 0, proc.stderr
    spec = json.loads(proc.stdout)["vllm_kwargs"]["speculative_config"]
    assert spec["num_speculative_tokens"] == 5 and spec["model"] == "/heads/gemma4"


def test_speculation_off_is_one_override_and_the_dry_run_says_what_was_dropped():
    proc = run_job("--config", "tiny", "--dry-run", "engine.spec.method=none")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert "speculative_config" not in report["vllm_kwargs"]
    assert any("num_speculative_tokens=4" in n and "dropped" in n for n in report["notes"])
    # Given together with the method, a field the method does not use is still refused.
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        load_config("tiny", ["engine.spec.method=none", "engine.spec.num_speculative_tokens=3"])


def test_switching_method_keeps_what_the_new_method_uses():
    cfg = load_config("tiny", ["engine.spec.method=ngram"])
    assert cfg.engine.spec.num_speculative_tokens == 4 and cfg.engine.spec.head is None
    assert [n for n in cfg.notes if "head" in n]
    assert load_config("tiny").notes == []  # nothing dropped, nothing said
    eagle3 = load_config("tiny", ["engine.spec.method=eagle3", "engine.spec.head=artifacts/tiny/eagle3-head"])
    assert eagle3.engine.spec.head == "artifacts/tiny/eagle3-head" and eagle3.notes == []


@pytest.mark.parametrize(
    "override, named",
    [
        ("engine.spec.num_speculative_tokens=0", "num_speculative_tokens"),
        ("engine.spec.num_speculative_tokens=-2", "-2"),
        ("engine.bogus_key=1", "engine.bogus_key"),
        ("pool.colour=red", "pool.colour"),
    ],
)
def test_bad_override_is_refused_naming_it(override, named):
    proc = run_job("--config", "tiny", "--dry-run", override)
    assert proc.returncode == 2
    assert named in proc.stderr
    assert proc.stdout == ""


def test_unknown_key_in_yaml_file_is_refused(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("name: x\nengine: {model: m, max_num_seq: 4, kv_cache_memory_bytes: 1}\n")
    with pytest.raises(ConfigError, match="engine.max_num_seq"):
        load_config(str(path))


def test_a_config_extends_a_preset_and_states_only_what_it_changes(tmp_path):
    mine = tmp_path / "mine.yaml"
    mine.write_text("extends: tiny\nname: mine\nengine: {spec: {num_speculative_tokens: 2}}\n"
                    "sampling: {max_tokens: 16}\n")
    cfg, tiny = load_config(str(mine)), load_config("tiny")
    assert cfg.name == "mine" and cfg.sampling.max_tokens == 16
    assert cfg.engine.spec.num_speculative_tokens == 2
    # everything else is the preset's, nested keys included
    assert cfg.engine.spec.head == tiny.engine.spec.head and cfg.engine.model == tiny.engine.model
    assert cfg.engine.spec.controller == tiny.engine.spec.controller and cfg.pool == tiny.pool
    # overrides apply on top of the merged file
    assert load_config(str(mine), ["sampling.max_tokens=8"]).sampling.max_tokens == 8
    loop = tmp_path / "loop.yaml"
    loop.write_text(f"extends: {loop}\n")
    with pytest.raises(ConfigError, match="extends"):
        load_config(str(loop))
    bad = tmp_path / "bad.yaml"
    bad.write_text("extends: no-such-preset\n")
    with pytest.raises(ConfigError, match="no-such-preset"):
        load_config(str(bad))


def test_every_preset_loads_and_plans():
    assert {"tiny", *GPU_PRESETS} <= set(preset_names())
    for name in preset_names():
        cfg = load_config(name)
        kwargs = to_vllm_kwargs(cfg.engine)
        assert kwargs["max_model_len"] == cfg.engine.max_model_len
        assert resource_plan(cfg).max_actors == cfg.pool.max_actors


def test_spec_methods_map_to_vllm_keys():
    peagle = to_vllm_kwargs(load_config("tiny").engine)["speculative_config"]
    assert peagle["method"] == "eagle3" and peagle["parallel_drafting"] is True
    eagle3 = to_vllm_kwargs(
        load_config("tiny", ["engine.spec.method=eagle3"]).engine
    )["speculative_config"]
    assert eagle3["method"] == "eagle3" and "parallel_drafting" not in eagle3
    ngram = to_vllm_kwargs(
        load_config("tiny", ["engine.spec.method=ngram", "engine.spec.head=null"]).engine
    )["speculative_config"]
    assert ngram["method"] == "ngram" and ngram["prompt_lookup_max"] == 4
    off = to_vllm_kwargs(
        load_config(
            "tiny", ["engine.spec={method: none}"]
        ).engine
    )
    assert "speculative_config" not in off


def test_schedule_is_validated_and_passed_through():
    eagle3 = ["engine.spec.method=eagle3", "engine.spec.head=artifacts/tiny/eagle3-head"]
    cfg = load_config("tiny", [*eagle3, "engine.spec.schedule=[[1, 4, 4], [5, 64, 2], [65, 1024, 0]]"])
    spec = to_vllm_kwargs(cfg.engine)["speculative_config"]
    assert spec["num_speculative_tokens_per_batch_size"] == [[1, 4, 4], [5, 64, 2], [65, 1024, 0]]
    # P-EAGLE runs every K in 0..K_max per step too (actors.any_k).
    peagle = load_config("tiny", ["engine.spec.schedule=[[1, 4, 4], [5, 64, 2], [65, 1024, 0]]"]).engine
    assert to_vllm_kwargs(peagle)["speculative_config"]["num_speculative_tokens_per_batch_size"][1] == [5, 64, 2]
    assert live_k_values(peagle) == [0, 1, 2, 3, 4]
    graphs = load_config("tiny", ["engine.enforce_eager=false", "engine.spec.schedule=[[1, 4, 4], [5, 1024, 2]]"])
    assert live_k_values(graphs.engine) == [0, 2, 4]  # CUDA graphs: the start-up table's K values only
    assert live_k_values(load_config("tiny", eagle3).engine) == [0, 1, 2, 3, 4]
    with pytest.raises(ConfigError, match="contiguous"):
        load_config("tiny", ["engine.spec.schedule=[[2, 4, 4]]"])
    with pytest.raises(ConfigError, match="got 9"):
        load_config("tiny", ["engine.spec.schedule=[[1, 4, 9]]"])


def test_extra_engine_kwargs_cannot_shadow_typed_fields():
    cfg = load_config("tiny", ["engine.extra_engine_kwargs={max_model_len: 99}"])
    with pytest.raises(ValueError, match="max_model_len"):
        to_vllm_kwargs(cfg.engine)


def test_cpu_pool_requires_kv_cache_size_and_tp1():
    with pytest.raises(ConfigError, match="kv_cache_memory_bytes"):
        load_config("tiny", ["engine.kv_cache_memory_bytes=null"])
    with pytest.raises(ConfigError, match="tensor_parallel_size must be 1 on CPU, got 2"):
        load_config("tiny", ["engine.tensor_parallel_size=2"])


def test_serve_step_budget_applies_to_the_replicas_engine_only_and_is_checked():
    cfg = load_config("tiny", ["serve.max_num_batched_tokens=256"])
    run = resolve(cfg)
    assert to_vllm_kwargs(run.serve_engine)["max_num_batched_tokens"] == 256
    assert "max_num_batched_tokens" not in to_vllm_kwargs(run.batch.engine)  # batch jobs' own engines keep vLLM's
    assert to_vllm_kwargs(cfg.engine)["block_size"] == 32
    with pytest.raises(ConfigError, match=r"serve.max_num_batched_tokens \(16\) must be >= engine.max_num_seqs \(32\)"):
        load_config("tiny", ["serve.max_num_batched_tokens=16"])


def test_importing_config_and_job_cli_does_not_import_vllm_or_torch():
    code = (
        "import sys, configs, jobs.cli, actors, actors.requests, actors.spec_stats, pipelines;"
        "configs.load_config('qwen3-coder-30b-a3b-b200');"
        "heavy = [m for m in ('vllm', 'torch', 'ray') if m in sys.modules];"
        "print(heavy); sys.exit(1 if heavy else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# Each package of the project and the project packages it may import: a layer uses only
# layers below it. configs (the typed settings and the rules on them) is at the bottom and
# imports nothing of the project; control (policy, plans and the live loop) reads configs;
# jobs, tools (calibration), deploy (manifests) and benchmarks are entry points at the top.
LAYERS = {
    "configs": set(),
    "models": set(),
    "devtools": set(),
    "control": {"configs"},
    "sandbox": {"configs"},
    "actors": {"configs", "control"},
    "serving": {"actors", "configs", "control"},
    "pipelines": {"actors", "configs", "control", "sandbox"},
    "jobs": {"actors", "configs", "control", "devtools", "models", "pipelines", "sandbox", "serving"},
    "tools": {"actors", "configs", "control", "jobs"},
    "deploy": {"configs", "control", "serving"},
    "benchmarks": {"actors", "configs", "control", "devtools", "jobs", "models", "pipelines", "sandbox", "serving",
                   "tools"},
}


def test_every_package_has_a_layer():
    assert {p.parent.name for p in REPO.glob("*/__init__.py")} - {"tests"} == set(LAYERS)


def _project_imports(path: Path) -> list[tuple[ast.AST, str]]:
    """(node, imported name) for every import in a module, inside functions too; relative
    imports resolved against the module's package; `from a import b` also as `a.b`."""
    module = ".".join(path.relative_to(REPO).with_suffix("").parts)
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = module.split(".")[: -node.level] if node.level else []
            target = ".".join([*base, *([node.module] if node.module else [])])
            found += [(node, target)] + [(node, f"{target}.{alias.name}") for alias in node.names]
    return found


@pytest.mark.parametrize("package", sorted(LAYERS))
def test_no_import_runs_up_the_layers(package):
    # Parsed, not imported, so the check has no side effects; imports inside functions count.
    offending = set()
    for path in sorted((REPO / package).rglob("*.py")):
        module = ".".join(path.relative_to(REPO).with_suffix("").parts)
        for node, target in _project_imports(path):
            top = target.split(".")[0]
            if top in set(LAYERS) - LAYERS[package] - {package} or not top:
                offending.add(f"{module} (line {node.lineno}): {ast.unparse(node)}")
    assert not offending, f"{package} must import only {sorted(LAYERS[package])}:\n" + "\n".join(sorted(offending))


def test_no_two_modules_import_each_other_even_through_others():
    modules = {".".join(p.relative_to(REPO).with_suffix("").parts): p
               for package in LAYERS for p in (REPO / package).rglob("*.py") if p.name != "__init__.py"}
    graph = {m: {t for _, t in _project_imports(p) if t in modules and t != m} for m, p in modules.items()}
    # Strongly connected components (Tarjan); any with two or more modules is a circle.
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not circles, f"modules that import each other (directly or around a circle): {circles}"


def test_code_scoring_defaults_are_the_sandbox_defaults():
    assert CodeScoringConfig().sandbox_limits() == SandboxLimits()
    limits = CodeScoringConfig(memory_mb=100, timeout_s=3).sandbox_limits()
    assert limits.memory_bytes == 100 << 20 and limits.timeout_s == 3
