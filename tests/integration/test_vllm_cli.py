"""vLLM's own command line through `benchmarks.vllm_cli` (the CPU wheel's `vllm` script
fails), and the `vllm serve` flags `benchmarks.serve_overhead` derives from a preset: vLLM's
own parser must turn them back into the preset's engine, or the comparison with `vllm serve`
is not like for like."""

import subprocess
import sys

import pytest

from configs import load_config
from configs.vllm_args import to_vllm_kwargs
from control.plan import serve_engine

pytestmark = pytest.mark.integration


def test_vllm_cli_runs_on_the_installed_wheel(repo_root):
    import vllm

    done = subprocess.run([sys.executable, "-m", "benchmarks.vllm_cli", "--version"], cwd=repo_root,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == vllm.__version__


@pytest.mark.parametrize("overrides", [[], ["engine.spec.method=none"], ["engine.enable_prefix_caching=false"]])
def test_vllm_serve_flags_rebuild_the_presets_engine(overrides):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from benchmarks.serve_overhead import vllm_serve_args

    kwargs = to_vllm_kwargs(serve_engine(load_config("tiny", overrides)))
    argv = vllm_serve_args(kwargs)
    parsed = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", argv[0], *argv[1:]])
    engine = EngineArgs.from_cli_args(parsed)
    for key, value in kwargs.items():
        assert getattr(engine, key) == value, key
