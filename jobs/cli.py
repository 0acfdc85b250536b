"""What every job's command line shares: `--config NAME|FILE`, typed `a.b=value`
overrides, and `--dry-run`, which prints the resolved vLLM kwargs and the resource plan
and starts nothing (no Ray, no vLLM import).
"""

from __future__ import annotations

import argparse
import json
import sys

from configs import AppConfig, ConfigError, load_config, resource_plan, to_vllm_kwargs


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument(
        "--config", default="tiny", help="preset name (configs/presets) or YAML path; default tiny"
    )
    p.add_argument(
        "--dry-run", action="store_true", help="print resolved engine kwargs + resource plan, start nothing"
    )
    p.add_argument("overrides", nargs="*", metavar="a.b=value", help="typed config overrides")
    return p


def dry_run_report(cfg: AppConfig) -> dict:
    plan = resource_plan(cfg)
    return {
        "name": cfg.name,
        "vllm_kwargs": to_vllm_kwargs(cfg.engine),
        "resource_plan": {**plan.as_dict(), "summary": plan.describe()},
        "sampling": cfg.sampling.model_dump(),
        "input": cfg.input,
        "output": cfg.output,
    }


def parse_config(args: argparse.Namespace) -> AppConfig:
    """Load the config or exit with status 2 and a message naming the bad key/value."""
    try:
        return load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def handle_dry_run(args: argparse.Namespace, cfg: AppConfig) -> bool:
    """Print the dry-run report if asked; True means the caller should stop."""
    if args.dry_run:
        print(json.dumps(dry_run_report(cfg), indent=2))
    return args.dry_run
