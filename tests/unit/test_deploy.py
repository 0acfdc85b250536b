"""KubeRay manifests from the presets (deploy.render): only fields KubeRay's v1 API defines,
engines whole on one node, the pods run the very config the cluster was sized from, the
image carries every package, and the committed manifests are what the command renders."""

import math
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import kuberay_fields as kr
import pytest
import yaml

from configs import load_config
from deploy.render import config_ref, main, render
from deploy.kuberay import APP_DIR, GPU_RESOURCE

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
GPU_PRESETS = ["gemma-4-31b-it-b200", "gpt-oss-120b-b200", "gpt-oss-20b-b200", "qwen3-coder-30b-a3b-b200"]
IO = ["--input", "s3://bucket/prompts/", "--output", "s3://bucket/out/"]
IO_OVERRIDES = ["input=s3://bucket/prompts/", "output=s3://bucket/out/"]
SERVE_FILE = "configs/serve/qwen3-coder-30b-a3b-b200.yaml"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def manifest(*argv: str) -> dict:
    return yaml.safe_load(render(list(argv)))


def rayjob(preset: str, *more: str) -> dict:
    return manifest("--preset", preset, *IO, *more)


def workers(cluster: dict) -> dict:
    (group,) = cluster["workerGroupSpecs"]
    return group


def ray_container(group: dict) -> dict:
    return group["template"]["spec"]["containers"][0]  # KubeRay's Ray container is the first


def assert_known_cluster_fields(cluster: dict) -> None:
    assert set(cluster) <= kr.RAYCLUSTER_SPEC and kr.RAYCLUSTER_REQUIRED <= set(cluster)
    head = cluster["headGroupSpec"]
    assert set(head) <= kr.HEAD_GROUP_SPEC and kr.HEAD_GROUP_REQUIRED <= set(head)
    for group in cluster["workerGroupSpecs"]:
        assert set(group) <= kr.WORKER_GROUP_SPEC and kr.WORKER_GROUP_REQUIRED <= set(group)
        assert 0 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    for group in [head, *cluster["workerGroupSpecs"]]:
        if group.get("resources"):  # KubeRay refuses resources given both ways
            assert not kr.RAY_START_RESOURCE_PARAMS & set(group["rayStartParams"])
        assert ray_container(group)["image"]


@pytest.mark.parametrize("preset", GPU_PRESETS)
def test_rayjob_of_every_gpu_preset_has_only_fields_kuberay_defines(preset):
    job = rayjob(preset)
    assert (job["apiVersion"], job["kind"]) == (kr.API_VERSION, "RayJob")
    assert set(job["spec"]) <= kr.RAYJOB_SPEC
    assert job["spec"]["submissionMode"] in kr.RAYJOB_SUBMISSION_MODES
    assert job["spec"]["shutdownAfterJobFinishes"] is True
    assert_known_cluster_fields(job["spec"]["rayClusterSpec"])
    name = job["metadata"]["name"]
    assert len(name) <= kr.MAX_NAME_LENGTH and re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name)


@pytest.mark.parametrize("argv", [["--preset", "qwen3-coder-30b-a3b-b200"], ["--preset", "gpt-oss-20b-b200"]],
                         ids=["shipped-serve-config", "one-app-on-the-preset"])
def test_rayservice_has_only_fields_kuberay_defines(argv):
    service = manifest("--kind", "rayservice", *argv)
    assert (service["apiVersion"], service["kind"]) == (kr.API_VERSION, "RayService")
    assert set(service["spec"]) <= kr.RAYSERVICE_SPEC and kr.RAYSERVICE_REQUIRED <= set(service["spec"])
    assert isinstance(service["spec"]["serveConfigV2"], str)  # the CRD holds it as a YAML string
    assert_known_cluster_fields(service["spec"]["rayClusterConfig"])


@pytest.mark.parametrize("preset", GPU_PRESETS)
def test_engines_fit_whole_on_a_node_and_the_node_counts_hold_the_pool(preset):
    cfg = load_config(preset)
    tp, gpus = cfg.engine.tensor_parallel_size, cfg.pool.gpus_per_node
    cluster = rayjob(preset)["spec"]["rayClusterSpec"]
    group = workers(cluster)
    limits = ray_container(group)["resources"]["limits"]
    assert int(limits[GPU_RESOURCE]) == gpus and gpus % tp == 0
    assert (gpus // tp) * cfg.pool.cpus_per_actor <= int(limits["cpu"])
    assert group["minReplicas"] == group["replicas"] == math.ceil(cfg.pool.min_actors * tp / gpus)
    assert group["maxReplicas"] == math.ceil(cfg.pool.max_actors * tp / gpus)
    assert cluster["enableInTreeAutoscaling"] is True
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0"
    assert GPU_RESOURCE not in str(head["template"])


def test_overrides_size_the_cluster_and_reach_the_job_alike():
    job = rayjob("gpt-oss-120b-b200", "pool.max_actors=20", "engine.spec.num_speculative_tokens=5")
    assert workers(job["spec"]["rayClusterSpec"])["maxReplicas"] == 5  # 20 engines x TP 2 over 8 GPUs
    ran = entrypoint_config(job)
    assert ran.pool.max_actors == 20 and ran.engine.spec.num_speculative_tokens == 5


def entrypoint_config(job: dict):
    """The config the RayJob's command loads, parsed back from the command."""
    words = shlex.split(job["spec"]["entrypoint"])
    assert words[:5] == ["python", "-m", "jobs.codegen", "--config", words[4]]
    return load_config(words[4], words[5:])


@pytest.mark.parametrize("preset", GPU_PRESETS)
def test_the_job_runs_the_preset_it_was_sized_from(preset):
    ran = entrypoint_config(rayjob(preset))
    expected = load_config(preset, IO_OVERRIDES)
    assert ran.model_dump() == expected.model_dump()
    assert ran.engine.spec.num_speculative_tokens == load_config(preset).engine.spec.num_speculative_tokens == 7
    assert ran.engine.model == load_config(preset).engine.model


def test_rayservice_runs_the_app_with_the_shipped_serve_config_and_settings():
    service = manifest("--kind", "rayservice", "--preset", "qwen3-coder-30b-a3b-b200", "serve.max_n=4")
    shipped = yaml.safe_load((REPO / SERVE_FILE).read_text())
    (app,) = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"]
    assert app["import_path"] == "serving.app:build_app" and app["name"] == shipped["applications"][0]["name"]
    assert app["args"]["overrides"] == [*shipped["applications"][0]["args"]["overrides"], "serve.max_n=4"]
    ran = load_config(app["args"]["config"], app["args"]["overrides"])
    assert ran.serve.max_ongoing_requests == 320 and ran.serve.max_n == 4
    assert ran.engine.spec.num_speculative_tokens == 7
    cluster = service["spec"]["rayClusterConfig"]
    tp = ran.engine.tensor_parallel_size
    assert workers(cluster)["maxReplicas"] == math.ceil(ran.pool.max_actors * tp / ran.pool.gpus_per_node)
    for group in [cluster["headGroupSpec"], workers(cluster)]:
        env = {e["name"]: e.get("value") for e in ray_container(group)["env"]}
        assert env["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1"  # Serve reads it on every node
        assert {"name": "serve", "containerPort": 8000} in ray_container(group)["ports"]


def test_s3_access_comes_from_the_service_account_not_from_keys():
    job = rayjob("qwen3-coder-30b-a3b-b200", "--service-account", "codegen-s3")
    cluster = job["spec"]["rayClusterSpec"]
    for group in [cluster["headGroupSpec"], workers(cluster)]:
        assert group["template"]["spec"]["serviceAccountName"] == "codegen-s3"
        assert not [e for e in ray_container(group).get("env", []) if e["name"].startswith("AWS_")]
    assert "AWS_" not in render(["--preset", "qwen3-coder-30b-a3b-b200", *IO])


def test_gpu_nodes_are_chosen_by_label_and_their_taint_is_tolerated():
    default = workers(rayjob("gpt-oss-20b-b200")["spec"]["rayClusterSpec"])["template"]["spec"]
    assert default["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-B200"}
    assert {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"} in default["tolerations"]
    chosen = rayjob("gpt-oss-20b-b200", "--node-selector", "pool=b200", "--node-selector", "zone=a")
    selector = workers(chosen["spec"]["rayClusterSpec"])["template"]["spec"]["nodeSelector"]
    assert selector == {"pool": "b200", "zone": "a"}


def test_dockerfile_copies_every_package_of_pyproject_into_the_app_dir():
    lines = (REPO / "deploy" / "Dockerfile").read_text().splitlines()
    copied = set()
    for line in lines:
        words = [w for w in line.split() if not w.startswith("--")]
        if words and words[0] == "COPY":
            copied |= {w.rstrip("/") for w in words[1:-1]}
    packages = set(PYPROJECT["tool"]["setuptools"]["packages"])
    assert packages | {"pyproject.toml", PYPROJECT["project"]["readme"]} <= copied
    assert f"WORKDIR {APP_DIR}" in lines
    assert '["optional-dependencies"]["gpu"]' in "\n".join(lines)  # the GPU extra, not the CPU one
    base = next(line.split("=", 1)[1] for line in lines if line.startswith("ARG BASE_IMAGE="))
    ray_pin = next(d for d in PYPROJECT["project"]["dependencies"] if d.startswith("ray["))
    assert f":{ray_pin.split('==')[1]}-py311-" in base  # the pinned Ray, the Python pyproject requires


def test_committed_manifests_are_what_the_command_renders_now():
    committed = sorted((REPO / "deploy").glob("*.yaml"))
    assert {p.name for p in committed} == {*(f"rayjob-{p}.yaml" for p in GPU_PRESETS),
                                           "rayservice-qwen3-coder-30b-a3b-b200.yaml"}
    prefix = "# Rendered by: python -m deploy.render "
    for path in committed:
        text = path.read_text()
        assert text.startswith(prefix), path.name
        argv = shlex.split(text.splitlines()[0][len(prefix):])
        assert render(argv) == text, (f"{path.name} is stale: python -m deploy.render {shlex.join(argv)} "
                                      f"> deploy/{path.name}")


@pytest.mark.parametrize("argv, named", [
    (["--preset", "gpt-oss-20b-b200", *IO, "engine.tensor_parallel_size=16"], r"tensor_parallel_size \(16\)"),
    (["--preset", "gpt-oss-20b-b200", *IO, "engine.tensor_parallel_size=3"],
     r"tensor_parallel_size \(3\) must divide pool.gpus_per_node \(8\)"),
    (["--preset", "gpt-oss-120b-b200", *IO, "pool.gpus_per_node=0"], r"pool.gpus_per_node \(0\)"),
    (["--preset", "no-such-model", *IO], r"'no-such-model'"),
    (["--preset", "tiny", *IO], r"'tiny' runs on pool.device='cpu'.*qwen3-coder-30b-a3b-b200"),
    (["--preset", "gpt-oss-20b-b200", "--input", "s3://bucket/prompts/"], r"--output.*output=None"),
    (["--preset", "gpt-oss-20b-b200", "--input", "s3://bucket/prompts/", "--output", "/tmp/out"], r"'/tmp/out'"),
    (["--preset", "gpt-oss-20b-b200", *IO, "--worker-cpus", "16"], r"worker CPUs \(16\).*8 x pool.cpus_per_actor 4"),
    (["--preset", "gpt-oss-20b-b200", *IO, "--name", "Codegen_1"], r"'Codegen_1'"),
    (["--preset", "gpt-oss-20b-b200", *IO, "--node-selector", "b200"], r"'b200'"),
    (["--preset", "gpt-oss-20b-b200", *IO, "pool.colour=red"], r"pool.colour"),
    (["--kind", "rayservice", "--preset", "gpt-oss-20b-b200", "--serve-config", SERVE_FILE],
     r"runs config 'qwen3-coder-30b-a3b-b200', not 'gpt-oss-20b-b200'"),
    (["--kind", "rayservice", "--preset", "gpt-oss-20b-b200", "--input", "s3://bucket/prompts/"],
     r"input='s3://bucket/prompts/'"),
])
def test_what_cannot_be_deployed_is_refused_naming_the_value(argv, named):
    with pytest.raises(ValueError, match=named):
        render(argv)


def test_a_config_file_outside_the_image_is_refused_naming_it(tmp_path):
    outside = tmp_path / "mine.yaml"
    outside.write_text((REPO / "configs" / "presets" / "gpt-oss-20b-b200.yaml").read_text())
    with pytest.raises(ValueError, match=re.escape(f"{str(outside)!r} is not in the image")):
        render(["--config", str(outside), *IO])


def test_config_files_are_given_to_the_pods_as_the_image_holds_them():
    assert config_ref(str(REPO / "configs" / "presets" / "gpt-oss-20b-b200.yaml")) == "gpt-oss-20b-b200"
    assert config_ref("gpt-oss-20b-b200") == "gpt-oss-20b-b200"
    assert config_ref(str(REPO / "configs" / "serve" / "tiny.yaml")) == f"{APP_DIR}/configs/serve/tiny.yaml"


def test_command_prints_the_manifest_or_exits_2_with_the_reason(capsys):
    assert main(["--preset", "gpt-oss-20b-b200", *IO]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["kind"] == "RayJob"
    assert main(["--preset", "gpt-oss-20b-b200", *IO, "engine.tensor_parallel_size=3"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("error: ") and "(3)" in err


def test_rendering_imports_neither_ray_nor_vllm_nor_torch():
    code = ("import sys, deploy.render;"
            "deploy.render.render(['--preset', 'qwen3-coder-30b-a3b-b200', '--kind', 'rayservice']);"
            "heavy = [m for m in ('vllm', 'torch', 'ray') if m in sys.modules];"
            "print(heavy); sys.exit(1 if heavy else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
