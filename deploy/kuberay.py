"""KubeRay manifests (RayJob, RayService) for a resolved config, as plain dicts.

Owns the Kubernetes side of a deployment: a head group without GPUs, one worker group of
whole GPU nodes sized from the resource plan (`control.plan`: engines x TP over the GPUs
of a node), and what the pods get besides the config: image, service account (S3 access
comes from it, never from keys in the manifest), node selector, tolerations. What runs in
the pods is what a person runs by hand, `python -m jobs.codegen --config ... a.b=value`
for a RayJob and a Serve config importing `serving.app:build_app` for a RayService, so the
engine, K and the node counts come from one config. Field names are KubeRay's ray.io/v1
API (tests/unit/kuberay_fields.py names the version they were checked against).

Knows nothing about presets, files or the command line (`deploy.render`).
"""

from __future__ import annotations

import math
import re
import shlex
from dataclasses import dataclass, field
from typing import Any

import yaml

from configs import AppConfig
from control.plan import resource_plan
from serving.serve_env import serve_env

API_VERSION = "ray.io/v1"
APP_DIR = "/app"  # where deploy/Dockerfile puts the repository in the image
GPU_RESOURCE = "nvidia.com/gpu"
SERVE_PORT = 8000
# Serve's replicas' own HTTP ports, as `python -m serving.serve_env` gives them off Kubernetes.
FIRST_DIRECT_PORT = 8001
# A retried RayJob starts a new cluster; the job then resumes from its committed shards.
JOB_RETRIES = 1
# KubeRay derives RayCluster and Service names from a RayJob's / RayService's name: it must
# be a DNS-1035 label of at most 47 characters (kuberay MaxRayJobNameLength).
MAX_NAME_LENGTH = 47
_DNS_1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_LABELS = {"app.kubernetes.io/name": "peagle-batch"}


class DeployError(ValueError):
    """A manifest that cannot be rendered; the message names the bad value."""


@dataclass(frozen=True)
class PodSettings:
    """What the pods get besides the config. The defaults fit an 8-GPU B200 node (AWS
    p6-b200.48xlarge: 192 vCPUs, 2 TiB; GCP a4-highgpu-8g: 224 vCPUs, 3.9 TB) with room
    left for the kubelet and the GPU operator's daemons."""

    image: str
    service_account: str = "peagle-batch"
    node_selector: dict[str, str] = field(default_factory=lambda: {"nvidia.com/gpu.product": "NVIDIA-B200"})
    worker_cpus: int = 160
    worker_memory: str = "1600Gi"
    # The head runs GCS, the dashboard, the autoscaler and the job's driver; no Ray work.
    head_cpus: int = 16
    head_memory: str = "64Gi"
    # Secret with key `token` for gated models (Gemma); optional: pods start without it.
    hf_token_secret: str | None = "hf-token"


@dataclass(frozen=True)
class GpuNodes:
    """The GPU worker group: whole nodes, each holding `engines_per_node` engines."""

    group_name: str
    gpus_per_node: int
    engines_per_node: int
    min_nodes: int
    max_nodes: int
    accelerator_type: str | None


def check_name(name: str) -> str:
    if len(name) > MAX_NAME_LENGTH or not _DNS_1035.fullmatch(name):
        raise DeployError(f"name must be a DNS-1035 label (lower-case letters, digits, '-', starting with a letter) "
                          f"of at most {MAX_NAME_LENGTH} characters, got {name!r}")
    return name


def gpu_nodes(cfg: AppConfig, pods: PodSettings) -> GpuNodes:
    """The worker group for `cfg`'s pool: nodes = ceil(engines x TP / GPUs per node), at
    the pool's min and max. Refuses a pool that is not on whole GPU nodes, naming the value."""
    pool, tp = cfg.pool, cfg.engine.tensor_parallel_size
    if pool.device != "gpu":
        raise DeployError(f"config {cfg.name!r} runs on pool.device={pool.device!r}: these manifests are for GPU "
                          "nodes; use a GPU preset, or set pool.device=gpu with a model the image can load")
    gpus = pool.gpus_per_node
    if gpus < 1 or tp > gpus or gpus % tp:
        raise DeployError(f"engine.tensor_parallel_size ({tp!r}) must divide pool.gpus_per_node ({gpus!r}): one "
                          "engine's GPUs are all on one node, and a node's GPUs go to whole engines")
    plan = resource_plan(cfg)
    cpus_needed = plan.actors_per_node * plan.cpus_per_actor
    if cpus_needed > pods.worker_cpus:
        raise DeployError(f"worker CPUs ({pods.worker_cpus!r}) are fewer than the {plan.actors_per_node} engines of a "
                          f"node reserve ({plan.actors_per_node} x pool.cpus_per_actor {plan.cpus_per_actor:g} = "
                          f"{cpus_needed:g})")
    kind = re.sub(r"[^a-z0-9]+", "-", (pool.accelerator_type or "").lower()).strip("-")
    return GpuNodes(
        group_name=f"gpu-{kind}" if kind else "gpu",
        gpus_per_node=gpus,
        engines_per_node=plan.actors_per_node,
        min_nodes=math.ceil(plan.min_actors * tp / gpus),
        max_nodes=math.ceil(plan.max_actors * tp / gpus),
        accelerator_type=pool.accelerator_type,
    )


def codegen_entrypoint(config_ref: str, overrides: list[str]) -> str:
    """The RayJob's command: the batch job with the config and overrides it was sized from."""
    return shlex.join(["python", "-m", "jobs.codegen", "--config", config_ref, *overrides])


def rayjob(name: str, entrypoint: str, nodes: GpuNodes, pods: PodSettings, ray_version: str) -> dict[str, Any]:
    """Batch code generation on a cluster of its own, deleted when the job ends."""
    return {
        "apiVersion": API_VERSION,
        "kind": "RayJob",
        "metadata": {"name": check_name(name), "labels": {**_LABELS, "app.kubernetes.io/component": "codegen"}},
        "spec": {
            "entrypoint": entrypoint,
            "submissionMode": "K8sJobMode",
            "shutdownAfterJobFinishes": True,
            "backoffLimit": JOB_RETRIES,
            "rayClusterSpec": ray_cluster_spec(nodes, pods, ray_version, serving=False),
        },
    }


def rayservice(name: str, serve_config: dict[str, Any], nodes: GpuNodes, pods: PodSettings,
               ray_version: str) -> dict[str, Any]:
    """The online app; `serve_config` is a Serve config (`applications: [...]`)."""
    return {
        "apiVersion": API_VERSION,
        "kind": "RayService",
        "metadata": {"name": check_name(name), "labels": {**_LABELS, "app.kubernetes.io/component": "online"}},
        "spec": {
            "serveConfigV2": yaml.safe_dump(serve_config, sort_keys=False),
            "rayClusterConfig": ray_cluster_spec(nodes, pods, ray_version, serving=True),
        },
    }


def ray_cluster_spec(nodes: GpuNodes, pods: PodSettings, ray_version: str, serving: bool) -> dict[str, Any]:
    """Head without GPUs (and without Ray CPUs: tasks and actors go to the GPU nodes) and
    one autoscaled group of GPU nodes. Serving pods get Serve's shipped settings and port."""
    env = []
    if serving:  # read by Serve's processes on every node when they start (serving.serve_env)
        env += [{"name": k, "value": v} for k, v in serve_env(first_http_port=FIRST_DIRECT_PORT).items()]
    if pods.hf_token_secret:
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
            "name": pods.hf_token_secret, "key": "token", "optional": True}}})
    serve_ports = [{"name": "serve", "containerPort": SERVE_PORT}] if serving else []
    head_ports = [{"name": "gcs-server", "containerPort": 6379}, {"name": "dashboard", "containerPort": 8265},
                  {"name": "client", "containerPort": 10001}, *serve_ports]
    head = {
        "rayStartParams": {"num-cpus": "0", "num-gpus": "0", "dashboard-host": "0.0.0.0"},
        "template": _pod(_container("ray-head", pods.image, pods.head_cpus, pods.head_memory, env, head_ports),
                         pods, gpu_node=False),
    }
    worker: dict[str, Any] = {
        "groupName": nodes.group_name,
        "replicas": nodes.min_nodes,
        "minReplicas": nodes.min_nodes,
        "maxReplicas": nodes.max_nodes,
    }
    if nodes.accelerator_type:
        # The engines ask for accelerator_type:<type>; a running node reports it itself, but
        # the autoscaler knows a group it has not started yet only from this.
        worker["resources"] = {f"accelerator_type:{nodes.accelerator_type}": "1"}
    worker["rayStartParams"] = {}  # CPUs, GPUs and memory from the container's limits
    worker["template"] = _pod(_container("ray-worker", pods.image, pods.worker_cpus, pods.worker_memory, env,
                                         serve_ports, gpus=nodes.gpus_per_node), pods, gpu_node=True)
    return {
        "rayVersion": ray_version,
        "enableInTreeAutoscaling": True,
        "headGroupSpec": head,
        "workerGroupSpecs": [worker],
    }


def _container(name: str, image: str, cpus: int, memory: str, env: list[dict[str, Any]],
               ports: list[dict[str, Any]], gpus: int = 0) -> dict[str, Any]:
    limits = {"cpu": str(cpus), "memory": memory}
    if gpus:
        limits[GPU_RESOURCE] = str(gpus)
    container: dict[str, Any] = {"name": name, "image": image}
    if env:
        container["env"] = env
    if ports:
        container["ports"] = ports
    container["resources"] = {"requests": {"cpu": str(cpus), "memory": memory}, "limits": limits}
    # Ray's object store and NCCL between an engine's GPUs live in shared memory.
    container["volumeMounts"] = [{"name": "dshm", "mountPath": "/dev/shm"}]
    return container


def _pod(container: dict[str, Any], pods: PodSettings, gpu_node: bool) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "serviceAccountName": pods.service_account,
        "containers": [container],  # KubeRay takes the first container as Ray's
        "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}}],
    }
    if gpu_node:
        spec["nodeSelector"] = dict(pods.node_selector)
        spec["tolerations"] = [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}]
    return {"spec": spec}
