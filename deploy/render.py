"""Kubernetes manifests for KubeRay, from the config the job runs: `python -m deploy.render`.

    python -m deploy.render --preset qwen3-coder-30b-a3b-b200 \
        --input s3://bucket/prompts/ --output s3://bucket/runs/1/ [a.b=value ...] > rayjob.yaml
    python -m deploy.render --preset qwen3-coder-30b-a3b-b200 --kind rayservice > rayservice.yaml

Loads the config as the job does (a preset or a file, then the overrides), sizes the
cluster from its resource plan (`deploy.kuberay`) and prints a RayJob (batch code generation,
`python -m jobs.codegen` with the same config and overrides) or a RayService (the online
app, its Serve config: `--serve-config`, else configs/serve/PRESET.yaml, else one app on
the preset). The first line of the output records the command, so a committed manifest can
be checked against what the command renders today (deploy/*.yaml are, by a test). The
CPU preset is refused: its model lives in artifacts/, which the image does not carry, and
a GPU-less manifest is not what a B200 cluster wants. Exit 2 naming the value where the
config or the layout cannot be deployed.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tomllib
from pathlib import Path
from typing import Any

import yaml

from configs import AppConfig, ConfigError, load_config, preset_names
from configs.load import PRESETS_DIR, resolve_config_path
from deploy.kuberay import APP_DIR, DeployError, GpuNodes, PodSettings, codegen_entrypoint, gpu_nodes, rayjob, rayservice

REPO_ROOT = Path(__file__).resolve().parent.parent
SERVE_CONFIGS_DIR = REPO_ROOT / "configs" / "serve"
SERVE_IMPORT_PATH = "serving.app:build_app"
COMMAND = "python -m deploy.render"


def parser() -> argparse.ArgumentParser:
    defaults = PodSettings(image="")
    p = argparse.ArgumentParser(prog=COMMAND, description=__doc__.strip().splitlines()[0])
    which = p.add_mutually_exclusive_group()
    which.add_argument("--preset", help=f"a preset of configs/presets: {', '.join(preset_names())}")
    which.add_argument("--config", help="a config YAML file inside the repository (it travels in the image)")
    p.add_argument("--kind", choices=("rayjob", "rayservice"), default="rayjob",
                   help="rayjob: batch code generation (default); rayservice: the online app")
    p.add_argument("--serve-config", help="rayservice: the Serve config (default configs/serve/PRESET.yaml "
                   "where there is one, else one app on the preset)")
    p.add_argument("--input", help="rayjob: prompt shards, s3://...")
    p.add_argument("--output", help="rayjob: output prefix, s3://...")
    p.add_argument("--name", help="metadata.name (default codegen-NAME for a RayJob, NAME for a RayService)")
    p.add_argument("--image", default=f"peagle-batch:{project()['version']}",
                   help="the image built from deploy/Dockerfile (default %(default)s)")
    p.add_argument("--service-account", default=defaults.service_account,
                   help="the pods' service account; S3 access comes from its role (default %(default)s)")
    p.add_argument("--node-selector", action="append", metavar="KEY=VALUE",
                   help="GPU nodes' label, repeatable (default " +
                   ", ".join(f"{k}={v}" for k, v in defaults.node_selector.items()) + ")")
    p.add_argument("--worker-cpus", type=int, default=defaults.worker_cpus,
                   help="CPUs of a GPU node's pod (default %(default)s)")
    p.add_argument("--worker-memory", default=defaults.worker_memory,
                   help="memory of a GPU node's pod (default %(default)s)")
    p.add_argument("--head-cpus", type=int, default=defaults.head_cpus, help="head pod CPUs (default %(default)s)")
    p.add_argument("--head-memory", default=defaults.head_memory, help="head pod memory (default %(default)s)")
    p.add_argument("--hf-token-secret", default=defaults.hf_token_secret,
                   help="Secret with key `token` for gated models, optional in the pods; '' for none "
                   "(default %(default)s)")
    p.add_argument("overrides", nargs="*", metavar="a.b=value", help="typed config overrides, as for the job")
    return p


def project() -> dict[str, Any]:
    """From pyproject.toml: the version, the Ray pin and the packages the image installs."""
    data = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    ray_pin = next(d for d in data["project"]["dependencies"] if d.startswith("ray[") or d.startswith("ray=="))
    return {"version": data["project"]["version"], "ray_version": ray_pin.split("==")[1],
            "packages": list(data["tool"]["setuptools"]["packages"])}


def config_ref(name_or_path: str) -> str:
    """The `--config` the pods are given: a preset by name, another file by its path in
    the image (which carries the repository's packages only)."""
    path = resolve_config_path(name_or_path).resolve()
    if path.parent == PRESETS_DIR:
        return path.stem
    packages = project()["packages"]
    inside = path.is_relative_to(REPO_ROOT) and path.relative_to(REPO_ROOT).parts[0] in packages
    if not inside:
        raise DeployError(f"config file {name_or_path!r} is not in the image, which carries {packages} from this "
                          "repository: put it under configs/ and rebuild the image")
    return f"{APP_DIR}/{path.relative_to(REPO_ROOT).as_posix()}"


def render(argv: list[str]) -> str:
    """The manifest for a command line (without the program name), as YAML text."""
    args = parser().parse_args(argv)
    pods = pod_settings(args)
    if args.kind == "rayjob":
        manifest = _rayjob(args, pods)
    else:
        manifest = _rayservice(args, pods)
    header = f"# Rendered by: {COMMAND} {shlex.join(argv)}\n# Render again rather than edit.\n"
    return header + yaml.dump(manifest, Dumper=_Dumper, sort_keys=False, width=1 << 16)


def pod_settings(args: argparse.Namespace) -> PodSettings:
    selector = PodSettings(image=args.image).node_selector
    if args.node_selector:
        pairs = [item.partition("=") for item in args.node_selector]
        bad = [item for item, (key, sep, _) in zip(args.node_selector, pairs) if not key or not sep]
        if bad:
            raise DeployError(f"--node-selector must look like KEY=VALUE, got {bad[0]!r}")
        selector = {key: value for key, _, value in pairs}
    return PodSettings(image=args.image, service_account=args.service_account, node_selector=selector,
                       worker_cpus=args.worker_cpus, worker_memory=args.worker_memory, head_cpus=args.head_cpus,
                       head_memory=args.head_memory, hf_token_secret=args.hf_token_secret or None)


def _chosen_config(args: argparse.Namespace) -> str | None:
    """The config to load: a preset's file (never a same-named file here), or --config."""
    if args.preset is None:
        return args.config
    if args.preset not in preset_names():
        raise DeployError(f"preset {args.preset!r} is not one of {preset_names()}")
    return str(PRESETS_DIR / f"{args.preset}.yaml")


def _rayjob(args: argparse.Namespace, pods: PodSettings) -> dict[str, Any]:
    chosen = _chosen_config(args)
    if chosen is None:
        raise DeployError("a RayJob needs --preset NAME or --config PATH")
    if args.serve_config:
        raise DeployError(f"--serve-config ({args.serve_config!r}) is for --kind rayservice")
    overrides = list(args.overrides)
    overrides += [f"input={args.input}"] if args.input else []
    overrides += [f"output={args.output}"] if args.output else []
    cfg = load_config(chosen, overrides)
    nodes = _gpu_nodes(cfg, pods)
    for key, uri in (("input", cfg.input), ("output", cfg.output)):
        if not (uri or "").startswith("s3://"):
            raise DeployError(f"a RayJob reads and writes S3: give --{key} s3://..., got {key}={uri!r}")
    return rayjob(args.name or f"codegen-{cfg.name}", codegen_entrypoint(config_ref(chosen), overrides),
                  nodes, pods, project()["ray_version"])


def _rayservice(args: argparse.Namespace, pods: PodSettings) -> dict[str, Any]:
    if args.input or args.output:
        raise DeployError(f"--input/--output are for --kind rayjob, got input={args.input!r} output={args.output!r}")
    chosen = _chosen_config(args)
    serve_path = args.serve_config
    if serve_path is None and chosen is not None and (SERVE_CONFIGS_DIR / f"{config_ref(chosen)}.yaml").is_file():
        serve_path = str(SERVE_CONFIGS_DIR / f"{config_ref(chosen)}.yaml")
    if serve_path is not None:
        serve_config = _read_serve_config(serve_path)
        app = serve_application(serve_config, serve_path)
    elif chosen is not None:  # one app on the config (its name and route once loaded)
        app = {"import_path": SERVE_IMPORT_PATH, "args": {"config": chosen}}
    else:
        raise DeployError("a RayService needs --preset NAME, --config PATH or --serve-config PATH")
    app_config = app["args"].get("config", "tiny")  # serving.app.build_app's default
    if chosen is not None and config_ref(chosen) != config_ref(app_config):
        raise DeployError(f"serve config {serve_path!r} runs config {app_config!r}, "
                          f"not {args.preset or args.config!r}")
    overrides = [*app["args"].get("overrides", []), *args.overrides]
    cfg = load_config(app_config, overrides)
    nodes = _gpu_nodes(cfg, pods)
    app["args"] = {**app["args"], "config": config_ref(app_config), "overrides": overrides}
    if serve_path is None:
        serve_config = {"applications": [{"name": cfg.serve.app_name, "route_prefix": cfg.serve.route_prefix, **app}]}
    return rayservice(args.name or cfg.name, serve_config, nodes, pods, project()["ray_version"])


def _gpu_nodes(cfg: AppConfig, pods: PodSettings) -> GpuNodes:
    """The GPU worker group; a CPU config is refused here, naming the presets that fit (a
    manifest without GPUs would also lack the CPU model, which lives in artifacts/)."""
    if cfg.pool.device != "gpu":
        fitting = [name for name in preset_names() if load_config(name).pool.device == "gpu"]
        raise DeployError(f"config {cfg.name!r} runs on pool.device={cfg.pool.device!r}; these manifests are for "
                          f"GPU nodes: use a GPU preset ({', '.join(fitting)})")
    return gpu_nodes(cfg, pods)


def _read_serve_config(path: str) -> dict[str, Any]:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise DeployError(f"serve config {path!r} cannot be read: {exc}") from None
    if not isinstance(data, dict):
        raise DeployError(f"serve config {path!r} must be a mapping, got {type(data).__name__}")
    return data


def serve_application(serve_config: dict[str, Any], source: str) -> dict[str, Any]:
    """The one application of a Serve config that runs this project's app."""
    apps = [a for a in serve_config.get("applications") or [] if a.get("import_path") == SERVE_IMPORT_PATH]
    if len(apps) != 1:
        raise DeployError(f"serve config {source!r} must have exactly one application importing "
                          f"{SERVE_IMPORT_PATH}, got {len(apps)}")
    if not isinstance(apps[0].get("args") or {}, dict):
        raise DeployError(f"serve config {source!r}: args must be a mapping, got {apps[0]['args']!r}")
    apps[0]["args"] = dict(apps[0].get("args") or {})
    return apps[0]


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the Serve config inside a RayService) as literal blocks; shared
    lists written out at each place (no YAML anchors: a reader sees each pod whole)."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


_Dumper.add_representer(str, lambda dumper, text: dumper.represent_scalar(
    "tag:yaml.org,2002:str", text, style="|" if "\n" in text else None))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        text = render(argv)
    except (ConfigError, DeployError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
