"""Resumable, deterministic training in chunks: a plan, a state, as many short runs as it takes.

    python -m models.train_chunks --work DIR [--minutes M] [--max-steps N] [--threads T]
        [--init FROM] [--plan NAME|PLAN.json] [--corpus CORPUS.npz] [--save-every-minutes S]
    python -m models.train_chunks --work DIR --snapshot OUT     # the heads so far, to measure

Each call trains one chunk: it loads DIR's plan and state, runs steps until --minutes
of wall clock have passed (checked between steps only), --max-steps steps have run in
this call, or the plan is finished, and saves. The wall clock decides only WHERE a
chunk ends, never what a step computes, so any chunking of a plan gives the same
weights bit for bit (on the same machine and thread count) as one call.

Owns: the plan (`Plan`: phases in order, `"target"` then/or `"heads"`, each with its
steps, batch, lr schedule and seed, plus the model spec), the state and its on-disk
form, the rule that makes a step a pure function of (phase seed, phase name, step)
(`step_generator`), the greedy pool of the heads phase built in resumable pieces, the
`init_target` hook (`--init FROM`), and the final `DIR/trained/` in the layout
`models.train_core` writes (so `models.train_all --from-trained DIR/trained` exports it).

    DIR/plan.json           the plan, written once; a later call naming another plan fails,
                            unless it changes only phases not yet started (then recorded
                            in the state's `amendments`)
    DIR/corpus.npz          the corpus (copied from --corpus, or made on first use; where
                            it is missing on resume, the default corpus is made again and
                            must have the sha256 the run began with)
    DIR/state.json          phase, step, loss history, chunk log, current checkpoint name
    DIR/ckpt-NNNNNN/        weights + AdamW state as `<stem>.NN.pt` shards (<= 12 MiB);
                            written to DIR/.tmp-*, fsynced, renamed; state.json is replaced
                            (atomically) only after, so a killed call leaves the last one.
                            A heads-only plan's checkpoints leave the frozen target out: it
                            is rebuilt from --init on resume, its fingerprint checked
                            (`target_is_init`). plan.json + state.json + this folder are
                            all a run needs to go on (`make train` commits them: .gitignore)
    DIR/pool-<target sha>/  the heads phase's greedy pool, one file per piece
    DIR/trained/            at the end: target/peagle_head/eagle3_head shards + metrics.json

Knows nothing about how a step computes its loss (`models.train_target.target_step`,
`models.train_heads.heads_step`), about vLLM or about tokenizers (a missing corpus is
made by `models.train_all.ensure_corpus`). CPU only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import torch

from models.build_tiny import REPO_ROOT
from models.data import load_corpus
from models.grow import grow_for_plan
from models.layout import sha256_file
from models.spec import TinySpec
from models.tokenizer import MASK_TOKEN, SPECIAL_TOKEN_IDS
from models.torch_head import EagleHead
from models.torch_llama import TinyLlama
from models.train_common import log, lr_at, sample_windows
from models.train_core import load_sharded, save_sharded
from models.train_heads import (
    HeadConfig,
    evaluate,
    generated_pool,
    head_loss_summary,
    heads_batch,
    heads_step,
    init_heads,
    make_eval_sets,
    make_optimizers,
)
from models.train_target import (
    TargetConfig,
    evaluate_target,
    loss_summary,
    make_optimizer,
    target_step,
)

PHASE_INDEX = {"target": 0, "heads": 1}  # by name: a heads-only plan draws the same batches
HEAD_NAMES = ("peagle", "eagle3")
HEAD_STEMS = {"peagle": "peagle_head", "eagle3": "eagle3_head"}
MAX_PHASE_STEPS = 100_003  # step seeds of two phases never overlap
POOL_SEED_OFFSET = 500_000  # pool piece seeds sit above both phases' step seeds
DEVICE = torch.device("cpu")


# ----------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class PhaseSpec:
    """One phase of a plan. Head-only fields are None for the target phase."""

    name: str  # "target" | "heads"
    steps: int
    batch_size: int
    seq_len: int
    peak_lr: float
    warmup_fraction: float
    final_lr_ratio: float
    weight_decay: float
    grad_clip: float
    seed: int
    eval_windows: int | None = None  # target: held-out windows scored at the phase end
    eval_sequences: int | None = None  # heads: held-out sequences of each kind
    num_depths: int | None = None
    num_generated: int | None = None
    prompt_len: int | None = None
    cod_ratio: float | None = None
    cod_min_ratio: float | None = None
    pool_piece: int | None = None  # pool sequences per piece (a chunk resumes between pieces)
    # heads: the trained head folder both heads start from (an EAGLE-3 head: P-EAGLE keeps
    # its own mask_hidden), or {"peagle": folder, "eagle3": folder}, one for each
    init_heads: str | dict | None = None

    HEAD_ONLY = ("eval_sequences", "num_depths", "num_generated", "prompt_len", "cod_ratio",
                 "cod_min_ratio", "pool_piece")

    def __post_init__(self) -> None:
        if self.name not in PHASE_INDEX:
            raise ValueError(f"phase name must be one of {sorted(PHASE_INDEX)}, got {self.name!r}")
        if not 1 <= self.steps < MAX_PHASE_STEPS:
            raise ValueError(f"{self.name}: steps must be in [1, {MAX_PHASE_STEPS}), got {self.steps!r}")
        if self.seed < 0:
            raise ValueError(f"{self.name}: seed must be >= 0, got {self.seed!r}")
        for name in ("batch_size", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{self.name}: {name} must be >= 1, got {getattr(self, name)!r}")
        if isinstance(self.init_heads, dict) and set(self.init_heads) != set(HEAD_NAMES):
            raise ValueError(f"{self.name}: init_heads as a mapping needs exactly the keys "
                             f"{list(HEAD_NAMES)!r}, got {sorted(self.init_heads)!r}")
        if self.name == "target":
            extra = [k for k in (*self.HEAD_ONLY, "init_heads") if getattr(self, k) is not None]
            if extra or self.eval_windows is None:
                raise ValueError(f"target phase: needs eval_windows and none of {extra!r}")
        else:
            missing = [k for k in self.HEAD_ONLY if getattr(self, k) is None]
            if missing or self.eval_windows is not None:
                raise ValueError(f"heads phase: missing {missing!r} (and eval_windows must be None)")
            if self.batch_size < 2:
                raise ValueError(f"heads: batch_size must be >= 2, got {self.batch_size!r}")
            if not 0 < self.prompt_len < self.seq_len:
                raise ValueError(f"heads: need 0 < prompt_len < seq_len, got "
                                 f"{self.prompt_len!r}, {self.seq_len!r}")

    def target_config(self) -> TargetConfig:
        return TargetConfig(
            steps=self.steps, batch_size=self.batch_size, seq_len=self.seq_len,
            peak_lr=self.peak_lr, warmup_fraction=self.warmup_fraction,
            final_lr_ratio=self.final_lr_ratio, weight_decay=self.weight_decay,
            grad_clip=self.grad_clip, eval_windows=self.eval_windows)

    def head_config(self) -> HeadConfig:
        return HeadConfig(
            steps=self.steps, batch_size=self.batch_size, seq_len=self.seq_len,
            num_depths=self.num_depths, num_generated=self.num_generated,
            prompt_len=self.prompt_len, peak_lr=self.peak_lr,
            warmup_fraction=self.warmup_fraction, final_lr_ratio=self.final_lr_ratio,
            weight_decay=self.weight_decay, grad_clip=self.grad_clip, cod_ratio=self.cod_ratio,
            cod_min_ratio=self.cod_min_ratio, eval_sequences=self.eval_sequences)

    def to_dict(self) -> dict:
        d = asdict(self)
        if self.name == "target":
            for key in self.HEAD_ONLY:
                d.pop(key)
        else:
            d.pop("eval_windows")
        if self.init_heads is None:  # plans written before the field existed stay equal
            d.pop("init_heads")
        return d

    @classmethod
    def from_dict(cls, d: dict) -> PhaseSpec:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"phase {d.get('name')!r}: unknown fields {unknown!r}")
        return cls(**d)


def spec_from_dict(d: dict) -> TinySpec:
    return TinySpec.from_dict(d)


@dataclass(frozen=True)
class Plan:
    """What a run trains: the model spec and the phases in order. JSON-serialisable."""

    name: str
    spec: dict  # TinySpec.to_dict(), normalised (every field present)
    phases: tuple[PhaseSpec, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "spec", spec_from_dict(self.spec).to_dict())
        object.__setattr__(self, "phases", tuple(self.phases))
        names = [p.name for p in self.phases]
        if names not in (["heads"], ["target", "heads"]):
            raise ValueError(f"phases must be target then heads, or heads alone (against an "
                             f"--init target), got {names!r}")

    def tiny_spec(self) -> TinySpec:
        return spec_from_dict(self.spec)

    @property
    def seed(self) -> int:
        return self.phases[0].seed

    def to_dict(self) -> dict:
        return {"name": self.name, "spec": dict(self.spec),
                "phases": [p.to_dict() for p in self.phases]}

    @classmethod
    def from_dict(cls, d: dict) -> Plan:
        unknown = sorted(set(d) - {"name", "spec", "phases"})
        if unknown:
            raise ValueError(f"plan: unknown fields {unknown!r}")
        return cls(name=d["name"], spec=d["spec"],
                   phases=tuple(PhaseSpec.from_dict(p) for p in d["phases"]))


def cpu_plan(seed: int = 0) -> Plan:
    """The default plan (`make train`): the committed TinySpec from scratch, sized for
    this 2-core machine (~800 target tokens/s on one thread): target ≈ 3.1 M tokens
    (about an hour), heads ≈ 600 steps after a 128-sequence greedy pool."""
    return Plan(name="cpu", spec=TinySpec().to_dict(), phases=(
        PhaseSpec(name="target", steps=1500, batch_size=8, seq_len=256, peak_lr=3e-3,
                  warmup_fraction=0.05, final_lr_ratio=0.1, weight_decay=0.1, grad_clip=1.0,
                  seed=seed, eval_windows=32),
        PhaseSpec(name="heads", steps=600, batch_size=8, seq_len=192, peak_lr=2e-3,
                  warmup_fraction=0.05, final_lr_ratio=0.05, weight_decay=0.01, grad_clip=1.0,
                  seed=seed, eval_sequences=8, num_depths=4, num_generated=128, prompt_len=64,
                  cod_ratio=0.7, cod_min_ratio=0.2, pool_piece=16),
    ))


# Earlier builds the default's recipe starts from, kept in git history rather than in the
# tree (the committed artifacts stay small). Put one back with
#   mkdir -p DIR && git archive COMMIT PATH | tar -x --strip-components=2 -C DIR
# (load_head_init and load_init_state print that line when the folder is missing).
EARLIER_BUILDS = {
    # the 4-layer build (target, P-EAGLE and EAGLE-3 heads trained for 2718 GPU steps)
    # that was artifacts/tiny until the 16-layer build replaced it
    "artifacts/base4": ("a699ca6", "artifacts/tiny"),
    # deep16-heads' output, deep16-peagle3's EAGLE-3 start
    "artifacts/deep16-heads": ("7b7025c", "artifacts/tiny16"),
}


def restore_hint(folder: Path) -> str:
    """How to put an EARLIER_BUILDS folder back, or "" for any other folder."""
    for rel, (commit, path) in EARLIER_BUILDS.items():
        if (REPO_ROOT / rel) in (folder, *folder.parents):  # folder: absolute
            return (f"; it is in git history: mkdir -p {rel} && git archive {commit} {path} "
                    f"| tar -x --strip-components=2 -C {rel}")
    return ""


def deep16_plan(seed: int = 0) -> Plan:
    """The shape chosen by measurement (docs/tiny-model.md): a 16-layer target grown from
    the 4-layer build (`--init artifacts/base4/target`, see EARLIER_BUILDS; `models.grow`:
    heads' taps (1, 2, 3) move to (4, 8, 12)), fine-tuned at a tenth of the from-scratch
    peak lr (at 1e-3 the grown model's loss rose from 1.55 to 1.8 as the warm-up ended:
    knocked out of the minimum it was grown from), and one-layer heads trained against it.
    Its target is the default build's (artifacts/tiny/target)."""
    spec = TinySpec(num_hidden_layers=16, aux_layer_ids=(4, 8, 12), peagle_head_num_hidden_layers=1)
    cpu = cpu_plan(seed)
    # Heads trained at 8 depths: serving K up to 7 needs draft positions 5..8 learned,
    # not extrapolated from a head that only ever saw 4.
    return Plan(name="deep16", spec=spec.to_dict(),
                phases=(replace(cpu.phases[0], peak_lr=3e-4), replace(cpu.phases[1], num_depths=8)))


def deep16_heads_plan(seed: int = 0) -> Plan:
    """deep16's heads again, against deep16's trained target (`--init` it), both
    warm-started from the 4-layer build's one-layer EAGLE-3 head (artifacts/base4, see
    EARLIER_BUILDS). That head was trained for 2718 steps (on a GPU) against the states
    the grown target still carries at its taps (4, 8, 12): untouched, it drafts for the
    16-layer target at acceptance length 3.23 at K=4 in vLLM, where deep16's own heads
    (600 CPU steps from random weights) reached 1.56 (EAGLE-3) and 1.41 (P-EAGLE). A lower
    peak lr than from scratch: the start is already good."""
    deep = deep16_plan(seed)
    heads = replace(deep.phases[1], peak_lr=1e-3, init_heads="artifacts/base4/eagle3-head")
    return Plan(name="deep16-heads", spec=deep.spec, phases=(heads,))


def deep16_peagle3_plan(seed: int = 0) -> Plan:
    """The default build's heads (artifacts/tiny): deep16-heads with a three-layer P-EAGLE
    head, warm-started from the 4-layer build's (artifacts/base4/peagle-head, 2718 GPU
    steps), the EAGLE-3 head from deep16-heads' output (artifacts/deep16-heads, see
    EARLIER_BUILDS). Why three layers: a one-layer P-EAGLE head reads each mask slot in a
    single attention hop, and deep16-heads' reached acceptance 0.11 at position 2 (vLLM,
    K=4: length 1.86, 1.14x no speculation at c=1); the three-layer head untouched,
    re-pointed at taps (4, 8, 12), drafts at length 2.35 and 1.50x (docs/tiny-model.md).
    Half the steps at a lower peak lr: a fine-tune of two good starts."""
    deep = deep16_plan(seed)
    spec = replace(deep.tiny_spec(), peagle_head_num_hidden_layers=3)
    heads = replace(deep.phases[1], steps=300, peak_lr=3e-4, init_heads={
        "peagle": "artifacts/base4/peagle-head", "eagle3": "artifacts/deep16-heads/eagle3-head"})
    return Plan(name="deep16-peagle3", spec=spec.to_dict(), phases=(heads,))


def deep16_peagle3_long_plan(seed: int = 0) -> Plan:
    """The default build's heads trained on, for #36's acceptance goals: both heads start
    from artifacts/tiny (deep16-peagle3's output) and train 2400 steps more at its peak lr,
    both alike, so the P-EAGLE / EAGLE-3 comparison stays fair. deep16-peagle3's 300 steps
    lowered the P-EAGLE head's training loss (3.60 -> 3.16) without moving vLLM's
    acceptance; the GPU recipe the heads started from ran ~2700 steps. About 10 steps a
    minute on one thread: run it in `make train` chunks over several sessions
    (`--init artifacts/tiny/target`), measure with `models.measure_acceptance` between them."""
    base = deep16_peagle3_plan(seed)
    # Seed 1: batches drawn afresh, not deep16-peagle3's first 300 again.
    heads = replace(base.phases[0], steps=2400, seed=seed + 1, init_heads={
        "peagle": "artifacts/tiny/peagle-head", "eagle3": "artifacts/tiny/eagle3-head"})
    return Plan(name="deep16-peagle3-long", spec=base.spec, phases=(heads,))


PLANS: dict[str, Callable[[], Plan]] = {"cpu": cpu_plan, "deep16": deep16_plan,
                                        "deep16-heads": deep16_heads_plan,
                                        "deep16-peagle3": deep16_peagle3_plan,
                                        "deep16-peagle3-long": deep16_peagle3_long_plan}


def load_plan_arg(value: str) -> Plan:
    """A preset name (see PLANS) or a path to a plan JSON file."""
    if value in PLANS:
        return PLANS[value]()
    path = Path(value)
    if not path.is_file():
        raise ValueError(f"--plan must be one of {sorted(PLANS)} or a plan JSON file, got {value!r}")
    return Plan.from_dict(json.loads(path.read_text()))


def plan_diff(old, new, path: str = "") -> list[str]:
    """Human-readable differences between two plan dicts ('phases[0].steps: 6 -> 8')."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for key in sorted(set(old) | set(new), key=str):
            sub = f"{path}.{key}" if path else str(key)
            if key not in old:
                out.append(f"{sub}: (absent) -> {new[key]!r}")
            elif key not in new:
                out.append(f"{sub}: {old[key]!r} -> (absent)")
            else:
                out.extend(plan_diff(old[key], new[key], sub))
        return out
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [d for i, (a, b) in enumerate(zip(old, new)) for d in plan_diff(a, b, f"{path}[{i}]")]
    return [] if old == new else [f"{path}: {old!r} -> {new!r}"]


# ----------------------------------------------------------------------------- determinism


def step_seed(seed: int, phase_name: str, step: int) -> int:
    return seed * 1_000_003 + PHASE_INDEX[phase_name] * 100_003 + step


def step_generator(seed: int, phase_name: str, step: int) -> torch.Generator:
    """The only source of randomness of a step: a pure function of (seed, phase, step)."""
    return torch.Generator().manual_seed(step_seed(seed, phase_name, step))


def phase_lr(phase: PhaseSpec, step: int) -> float:
    return lr_at(step / phase.steps, phase.peak_lr, phase.warmup_fraction, phase.final_lr_ratio)


# ----------------------------------------------------------------------------- --init


def load_init_state(source: Path) -> dict[str, torch.Tensor]:
    """A target state dict from a `target.NN.pt` folder, a Hugging Face folder
    (`model.safetensors`) or a `.safetensors` file."""
    source = Path(source)
    if source.is_dir() and any(source.glob("target.[0-9][0-9].pt")):
        return load_sharded(source, "target")
    file = source / "model.safetensors" if source.is_dir() else source
    if file.is_file() and file.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(file))
    raise FileNotFoundError(f"--init {str(source)!r}: no target.NN.pt shards and no model.safetensors"
                            f"{restore_hint(source.resolve())}")


def load_head_init(source: Path) -> dict[str, torch.Tensor]:
    """A trained head's tensors from a Hugging Face folder (`model.safetensors`)."""
    source = Path(source)
    if not source.is_absolute():  # plans name repository paths
        source = REPO_ROOT / source
    file = source / "model.safetensors"
    if not file.is_file():
        raise FileNotFoundError(f"init_heads {str(source)!r}: no model.safetensors in it"
                                f"{restore_hint(source)}")
    from safetensors.torch import load_file

    return load_file(str(file))


def _shape_summary(state: dict[str, torch.Tensor]) -> str:
    emb = state.get("model.embed_tokens.weight")
    layers = {k.split(".")[2] for k in state if k.startswith("model.layers.")}
    if emb is None:
        return f"{len(state)} tensors, no model.embed_tokens.weight"
    return f"vocab {emb.shape[0]}, hidden {emb.shape[1]}, {len(layers)} layers"


def init_target(plan: Plan, from_state: dict[str, torch.Tensor],
                grow: Callable[[Plan, dict], dict] | None = None) -> dict[str, torch.Tensor]:
    """HOOK: the target weights the plan starts from, given a loaded state dict.

    Today it checks that from_state has exactly the tensors and shapes of the plan's
    spec and returns float32 copies. Where they differ it raises, naming both shapes,
    unless grow(plan, from_state) is given: then that builds the state dict (e.g.
    depth growth), which must itself match the plan's spec.
    """
    want = TinyLlama(plan.tiny_spec()).state_dict()
    problems = [f"{k}: FROM has {tuple(from_state[k].shape)}, the plan's spec needs {tuple(v.shape)}"
                for k, v in want.items() if k in from_state and from_state[k].shape != v.shape]
    missing, extra = sorted(set(want) - set(from_state)), sorted(set(from_state) - set(want))
    if problems or missing or extra:
        if grow is not None:
            grown = grow(plan, from_state)
            return init_target(plan, grown)
        details = problems[:6] + ([f"missing {len(missing)} tensors, e.g. {missing[:4]!r}"]
                                  if missing else []) + (
            [f"{len(extra)} unexpected tensors, e.g. {extra[:4]!r}"] if extra else [])
        raise ValueError(
            f"--init target does not fit the plan: FROM is {_shape_summary(from_state)}, the "
            f"plan's spec is {_shape_summary(want)}: " + "; ".join(details)
            + " (a grow function in init_target could map one onto the other)")
    return {k: from_state[k].detach().to(torch.float32).clone().contiguous() for k in want}


# ----------------------------------------------------------------------------- files


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".tmp-{path.name}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync(path.parent)


def _write_json(path: Path, obj) -> None:
    _write_atomic(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def _cpu_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().cpu().contiguous() for k, v in module.state_dict().items()}


def state_fingerprint(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for key in sorted(state):
        h.update(key.encode())
        h.update(state[key].detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def optim_to_files(optim: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """AdamW state → (flat tensors '<param index>.<name>', JSON meta with param_groups)."""
    sd = optim.state_dict()
    tensors, scalars = {}, {}
    for idx, slots in sd["state"].items():
        for name, value in slots.items():
            if torch.is_tensor(value):
                tensors[f"{idx}.{name}"] = value.detach().cpu().clone().contiguous()
            else:
                scalars[f"{idx}.{name}"] = value
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def optim_from_files(optim: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    state: dict[int, dict] = {}
    for key, value in [*tensors.items(), *meta["scalars"].items()]:
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = value
    groups = [{**g, "betas": tuple(g["betas"])} if "betas" in g else g for g in meta["param_groups"]]
    optim.load_state_dict({"state": state, "param_groups": groups})


# ----------------------------------------------------------------------------- the run


class PlanMismatch(ValueError):
    pass


def _only_later_phases_change(old: Plan, new: Plan, state: dict) -> bool:
    """True when `new` differs from `old` only in phases after the one `state` is in."""
    current = state["phase_index"]
    return (old.name == new.name and old.spec == new.spec and len(old.phases) == len(new.phases)
            and [p.name for p in old.phases] == [p.name for p in new.phases]
            and old.phases[:current + 1] == new.phases[:current + 1])


@dataclass
class Runtime:
    """What a chunk holds in memory; everything in it is rebuilt from DIR exactly."""

    plan: Plan
    state: dict
    corpus: dict
    target: TinyLlama
    target_optim: torch.optim.Optimizer | None = None
    heads: dict[str, EagleHead] = field(default_factory=dict)
    head_optims: dict[str, torch.optim.Optimizer] = field(default_factory=dict)
    pool: torch.Tensor | None = None

    @property
    def phase(self) -> PhaseSpec:
        return self.plan.phases[self.state["phase_index"]]


def _new_state(plan: Plan, corpus_sha: str, init: dict | None) -> dict:
    return {"format": 1, "phase_index": 0, "step": 0, "finished": False,
            "history": {"target": [], **{name: [] for name in HEAD_NAMES}},
            "metrics": {}, "chunks": [], "corpus_sha256": corpus_sha, "init": init,
            "checkpoint": None, "checkpoint_seq": 0, "heads_initialized": False}


def target_is_init(plan: Plan, state: dict) -> bool:
    """Whether the run's target is its `--init` source throughout: a plan with no target
    phase trains heads against the frozen --init target, so a checkpoint leaves it out
    (the --init source, its fingerprint checked, rebuilds it on resume)."""
    return state.get("init") is not None and all(p.name != "target" for p in plan.phases)


def _init_target_again(plan: Plan, init: dict) -> dict[str, torch.Tensor]:
    """The frozen target of a heads-only run, from its --init source, exactly as it began."""
    source = Path(init["from"])
    if not source.is_absolute() and not source.exists():  # a repository path, read from elsewhere
        source = REPO_ROOT / source
    rebuilt = init_target(plan, load_init_state(source), grow_for_plan)
    if state_fingerprint(rebuilt) != init["sha256"]:
        raise ValueError(f"the target this run trains against ({str(source)!r}, --init at its first chunk) "
                         f"has changed since: fingerprint {state_fingerprint(rebuilt)[:12]}, the run began "
                         f"with {init['sha256'][:12]}; put that target back, or start a new --work DIR")
    return rebuilt


def save_checkpoint(work: Path, rt: Runtime) -> Path:
    """Weights + optimizer state into a new DIR/ckpt-NNNNNN (tmp dir, fsync, rename),
    then state.json pointing at it (atomic replace), then older checkpoints go. The
    target is left out where it is the --init source throughout (`target_is_init`)."""
    state = rt.state
    seq = state["checkpoint_seq"] + 1
    final = work / f"ckpt-{seq:06d}"
    tmp = work / f".tmp-ckpt-{seq:06d}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    written = [] if target_is_init(rt.plan, state) else save_sharded(_cpu_state(rt.target), tmp, "target")
    optim_meta = {}
    if rt.target_optim is not None:
        tensors, optim_meta["target"] = optim_to_files(rt.target_optim)
        if tensors:
            written += save_sharded(tensors, tmp, "target_optim")
    for name, head in rt.heads.items():
        written += save_sharded(head.head_state_dict(), tmp, HEAD_STEMS[name])
        tensors, optim_meta[name] = optim_to_files(rt.head_optims[name])
        if tensors:
            written += save_sharded(tensors, tmp, f"{name}_optim")
    (tmp / "optim.json").write_text(json.dumps(optim_meta, sort_keys=True))
    for path in [*written, tmp / "optim.json"]:
        _fsync(path)
    _fsync(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync(work)
    old = state["checkpoint"]
    state["checkpoint"], state["checkpoint_seq"] = final.name, seq
    _write_json(work / "state.json", state)
    if old and old != final.name and (work / old).exists():
        shutil.rmtree(work / old)
    return final


def _clean_stale(work: Path, state: dict | None) -> None:
    keep = state["checkpoint"] if state else None
    for path in work.glob(".tmp-*"):
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    for path in work.glob("ckpt-*"):
        if path.name != keep:
            shutil.rmtree(path)


def _prepare_corpus(work: Path, corpus_arg: Path | None, state: dict | None) -> Path:
    path = work / "corpus.npz"
    if state is None:
        if corpus_arg is not None:
            if not path.is_file() or sha256_file(path) != sha256_file(corpus_arg):
                tmp = work / ".tmp-corpus.npz"
                shutil.copyfile(corpus_arg, tmp)
                _fsync(tmp)
                os.replace(tmp, path)
        elif not path.is_file():
            from models.tokenizer import DEFAULT_CORPUS_MAX_BYTES, DEFAULT_VOCAB_SIZE, train_tokenizer
            from models.train_all import ensure_corpus

            log("chunks", f"no corpus in {work}: making the full one (tokenizer + stdlib)")
            ensure_corpus(path, "full", train_tokenizer(DEFAULT_VOCAB_SIZE, DEFAULT_CORPUS_MAX_BYTES))
        return path
    if not path.is_file():
        _remake_corpus(path, state["corpus_sha256"])
    if corpus_arg is not None and sha256_file(corpus_arg) != state["corpus_sha256"]:
        raise ValueError(f"--corpus {str(corpus_arg)!r} is not the corpus this run started with "
                         f"(sha256 {state['corpus_sha256'][:12]})")
    return path


def _remake_corpus(path: Path, sha: str) -> None:
    """A run's corpus is not kept with a committed checkpoint (it is 19 MB and made in
    seconds): the default corpus is made again and must be the one the run began with."""
    from models.tokenizer import DEFAULT_CORPUS_MAX_BYTES, DEFAULT_VOCAB_SIZE, train_tokenizer
    from models.train_all import ensure_corpus

    log("chunks", f"{path} is missing: making the default corpus again (the run began with sha256 {sha[:12]})")
    tmp = path.with_name(".tmp-remade-corpus.npz")
    ensure_corpus(tmp, "full", train_tokenizer(DEFAULT_VOCAB_SIZE, DEFAULT_CORPUS_MAX_BYTES))
    if sha256_file(tmp) != sha:
        tmp.unlink()
        raise FileNotFoundError(f"{path} is missing and the default corpus made again is not the run's "
                                f"(sha256 {sha[:12]}): copy the run's corpus back into DIR")
    os.replace(tmp, path)


def _load_runtime(work: Path, plan: Plan, state: dict, corpus: dict) -> Runtime:
    ckpt = work / state["checkpoint"]
    spec = plan.tiny_spec()
    target = TinyLlama(spec)
    if any(ckpt.glob("target.[0-9][0-9].pt")):
        target.load_state_dict(load_sharded(ckpt, "target"))
    else:
        target.load_state_dict(_init_target_again(plan, state["init"]))
    rt = Runtime(plan=plan, state=state, corpus=corpus, target=target)
    optim_meta = json.loads((ckpt / "optim.json").read_text())

    def optim_tensors(stem: str) -> dict:
        return load_sharded(ckpt, stem) if any(ckpt.glob(f"{stem}.[0-9][0-9].pt")) else {}

    if state["finished"]:
        return rt
    if rt.phase.name == "target":
        target.train()
        rt.target_optim = make_optimizer(target, rt.phase.target_config(), DEVICE)
        optim_from_files(rt.target_optim, optim_tensors("target_optim"), optim_meta["target"])
    elif state["heads_initialized"]:
        target.eval().requires_grad_(False)
        for name in HEAD_NAMES:
            head = EagleHead(spec, parallel_drafting=name == "peagle")
            head.load_state_dict(load_sharded(ckpt, HEAD_STEMS[name]))
            rt.heads[name] = head.train()
        rt.head_optims = make_optimizers(rt.heads, rt.phase.head_config())
        for name in HEAD_NAMES:
            optim_from_files(rt.head_optims[name], optim_tensors(f"{name}_optim"), optim_meta[name])
    return rt


def _fresh_runtime(plan: Plan, state: dict, corpus: dict, init_state: dict | None) -> Runtime:
    target = TinyLlama(plan.tiny_spec())
    if init_state is not None:
        target.load_state_dict(init_state)
    elif plan.phases[0].name == "target":
        target.init_weights(plan.phases[0].seed)
    else:
        raise ValueError("the plan has no target phase: give --init FROM (the frozen target)")
    rt = Runtime(plan=plan, state=state, corpus=corpus, target=target)
    if rt.phase.name == "target":
        target.train()
        rt.target_optim = make_optimizer(target, rt.phase.target_config(), DEVICE)
    return rt


def _fmt_s(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s"


class _Clock:
    """Where this call stands: when to stop, when to save, when to print."""

    def __init__(self, minutes: float | None, max_steps: int | None, save_every_min: float,
                 progress_every_s: float) -> None:
        self.started = time.monotonic()
        self.deadline = None if minutes is None else self.started + 60.0 * minutes
        self.max_steps = max_steps
        self.save_every_s = 60.0 * save_every_min
        self.progress_every_s = progress_every_s
        self.last_save = self.last_print = self.started
        self.steps = 0
        self.phase_steps = 0  # steps of the current phase in this call, for tokens/s
        self.phase_started = self.started

    def out_of_time(self) -> bool:
        return ((self.deadline is not None and time.monotonic() >= self.deadline)
                or (self.max_steps is not None and self.steps >= self.max_steps))

    def new_phase(self) -> None:
        self.phase_steps, self.phase_started = 0, time.monotonic()


def _report(rt: Runtime, clock: _Clock, force: bool = False) -> None:
    now = time.monotonic()
    if not force and now - clock.last_print < clock.progress_every_s:
        return
    clock.last_print = now
    phase, step = rt.phase, rt.state["step"]
    key = "target" if phase.name == "target" else "peagle"
    recent = rt.state["history"][key][-20:]
    elapsed = now - clock.phase_started
    rate = clock.phase_steps / elapsed if elapsed > 0 and clock.phase_steps else 0.0
    tok_s = rate * phase.batch_size * phase.seq_len
    phase_eta = (phase.steps - step) / rate if rate else float("nan")
    later = sum(p.steps * p.batch_size * p.seq_len for p in rt.plan.phases[rt.state["phase_index"] + 1:])
    plan_eta = phase_eta + (later / tok_s if tok_s else float("nan"))
    loss = (f"loss {sum(recent) / len(recent):.3f}" if recent else "loss -")
    if phase.name == "heads" and recent:
        e3 = rt.state["history"]["eagle3"][-20:]
        loss = f"peagle {loss} eagle3 loss {sum(e3) / len(e3):.3f}"
    eta = (f"phase ETA {_fmt_s(phase_eta)}, plan ETA ~{_fmt_s(plan_eta)}"
           if rate else "ETA -")
    log("chunks", f"{phase.name} step {step}/{phase.steps} {loss} (mean of last {len(recent)}) "
        f"{tok_s:.0f} tok/s, {eta}")


def _target_steps(rt: Runtime, clock: _Clock, work: Path) -> None:
    phase, cfg = rt.phase, rt.phase.target_config()
    train_tokens = rt.corpus["train"]
    while rt.state["step"] < phase.steps and not clock.out_of_time():
        s = rt.state["step"]
        torch.manual_seed(step_seed(phase.seed, phase.name, s))  # nothing should use it
        gen = step_generator(phase.seed, phase.name, s)
        windows = sample_windows(train_tokens, cfg.batch_size, cfg.seq_len + 1, gen)
        loss = target_step(rt.target, rt.target_optim, windows, phase_lr(phase, s), cfg)
        rt.state["history"]["target"].append(float(loss))
        rt.state["step"] = s + 1
        clock.steps += 1
        clock.phase_steps += 1
        _report(rt, clock, force=clock.phase_steps == 1)
        _maybe_save(rt, clock, work)


def _maybe_save(rt: Runtime, clock: _Clock, work: Path) -> None:
    if time.monotonic() - clock.last_save >= clock.save_every_s:
        _account(rt, clock)
        path = save_checkpoint(work, rt)
        clock.last_save = time.monotonic()
        log("chunks", f"saved {path} ({rt.phase.name} step {rt.state['step']}/{rt.phase.steps})")


def _account(rt: Runtime, clock: _Clock) -> None:
    """Fold this call's progress into the last chunk record (seconds, steps)."""
    record = rt.state["chunks"][-1]
    record["seconds"] = round(time.monotonic() - clock.started, 1)
    record["steps"] = clock.steps
    record["end"] = {"phase": rt.phase.name if not rt.state["finished"] else "finished",
                     "step": rt.state["step"]}


def _finish_target_phase(rt: Runtime) -> None:
    phase = rt.phase
    cfg = phase.target_config()
    losses = rt.state["history"]["target"]
    first, final = loss_summary(losses)
    rt.state["metrics"]["target"] = {
        "config": asdict(cfg), "steps_run": phase.steps, "stopped_by_clock": False,
        "tokens_seen": phase.steps * phase.batch_size * phase.seq_len,
        "first_loss": first, "final_loss": final,
        **evaluate_target(rt.target, rt.corpus, rt.plan.tiny_spec(), cfg),
        "init": rt.state["init"],
    }
    m = rt.state["metrics"]["target"]
    log("chunks", f"target done: loss {first} -> {final}, val ppl {m['val_perplexity']} "
        f"(unigram {m['unigram_val_perplexity']})")
    rt.target_optim = None
    rt.target.eval().requires_grad_(False)


def _pool_dir(work: Path, rt: Runtime) -> Path:
    return work / f"pool-{state_fingerprint(_cpu_state(rt.target))[:16]}"


def _build_pool(rt: Runtime, clock: _Clock, work: Path) -> bool:
    """Generate missing pool pieces (each from its own seeded generator); True when complete."""
    phase, cfg = rt.phase, rt.phase.head_config()
    folder = _pool_dir(work, rt)
    folder.mkdir(exist_ok=True)
    n_pieces = -(-phase.num_generated // phase.pool_piece)
    pieces = []
    for i in range(n_pieces):
        path = folder / f"piece-{i:05d}.pt"
        if path.is_file():
            pieces.append(torch.load(path, map_location="cpu", weights_only=True)["ids"])
            continue
        if clock.out_of_time():
            return False
        started = time.monotonic()
        gen = torch.Generator().manual_seed(phase.seed * 1_000_003 + POOL_SEED_OFFSET + i)
        num = min(phase.pool_piece, phase.num_generated - i * phase.pool_piece)
        ids = generated_pool(rt.target, rt.corpus["train"], num, cfg, gen)
        tmp = folder / f".tmp-piece-{i:05d}.pt"
        torch.save({"ids": ids.cpu()}, tmp)
        _fsync(tmp)
        os.replace(tmp, path)
        pieces.append(ids)
        log("chunks", f"heads: greedy pool piece {i + 1}/{n_pieces} ({num} sequences) "
            f"in {time.monotonic() - started:.1f}s")
    rt.pool = torch.cat(pieces)
    return True


def _heads_steps(rt: Runtime, clock: _Clock, work: Path) -> None:
    phase, cfg = rt.phase, rt.phase.head_config()
    spec = rt.plan.tiny_spec()
    mask_id = SPECIAL_TOKEN_IDS[MASK_TOKEN]
    if not rt.heads:
        rt.heads = init_heads(rt.target, rt.pool, spec, cfg, DEVICE, phase.seed)
        if phase.init_heads is not None:
            sources = (phase.init_heads if isinstance(phase.init_heads, dict)
                       else dict.fromkeys(HEAD_NAMES, phase.init_heads))
            rt.state["init_heads"] = {}
            for name, folder in sources.items():
                source = load_head_init(Path(folder))
                rt.heads[name].warm_start(source)
                rt.state["init_heads"][name] = {"from": folder, "sha256": state_fingerprint(source)}
                log("chunks", f"heads: {name} starts from {folder}")
        rt.head_optims = make_optimizers(rt.heads, cfg)
        rt.state["heads_initialized"] = True
    while rt.state["step"] < phase.steps and not clock.out_of_time():
        s = rt.state["step"]
        torch.manual_seed(step_seed(phase.seed, phase.name, s))
        gen = step_generator(phase.seed, phase.name, s)
        ids = heads_batch(rt.pool, rt.corpus["train"], cfg, gen)
        rows = heads_step(rt.heads, rt.head_optims, rt.target, ids, phase_lr(phase, s), cfg,
                          spec, mask_id, gen)
        for name in HEAD_NAMES:
            rt.state["history"][name].append(float(rows[name][0]))
        rt.state["step"] = s + 1
        clock.steps += 1
        clock.phase_steps += 1
        _report(rt, clock, force=clock.phase_steps == 1)
        _maybe_save(rt, clock, work)


def _heads_metrics(rt: Runtime) -> dict:
    phase, cfg = rt.phase, rt.phase.head_config()
    spec = rt.plan.tiny_spec()
    metrics = {"config": asdict(cfg), "steps_run": phase.steps, "stopped_by_clock": False}
    for name in HEAD_NAMES:
        metrics[name] = head_loss_summary(rt.state["history"][name])
    eval_sets = make_eval_sets(rt.target, rt.corpus["val"], cfg, phase.seed)
    for set_name, seqs in eval_sets.items():
        batches = list(seqs.split(max(1, cfg.batch_size // 2)))
        for name, values in evaluate(rt.heads, rt.target, rt.target.model.embed_tokens, batches,
                                     cfg, spec, SPECIAL_TOKEN_IDS[MASK_TOKEN]).items():
            metrics[name][set_name] = values
    return metrics


def write_trained(work: Path, rt: Runtime, out: Path | None = None) -> Path:
    """DIR/trained/ (or `out`) in `models.train_core`'s layout (written to a tmp dir, then renamed)."""
    out = Path(out) if out is not None else work / "trained"
    tmp = out.parent / f".tmp-{out.name}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    plan, state = rt.plan, rt.state
    paths = save_sharded(_cpu_state(rt.target), tmp, "target")
    for name in HEAD_NAMES:
        paths += save_sharded(rt.heads[name].head_state_dict(), tmp, HEAD_STEMS[name])
    target_metrics = state["metrics"].get("target")
    if target_metrics is None:  # heads-only plan: the --init target, untrained here
        heads = plan.phases[-1]
        cfg = TargetConfig(steps=1, batch_size=1, seq_len=heads.seq_len,
                           eval_windows=max(1, heads.eval_sequences))
        target_metrics = {"config": None, "steps_run": 0, "stopped_by_clock": False,
                          "tokens_seen": 0, "first_loss": None, "final_loss": None,
                          **evaluate_target(rt.target, rt.corpus, plan.tiny_spec(), cfg),
                          "init": state["init"]}
    metrics = {
        "seed": plan.seed,
        "budget": plan.name,
        "device": "cpu",
        "device_name": "cpu",
        "torch_version": torch.__version__,
        "seconds_total": round(sum(c.get("seconds", 0.0) for c in state["chunks"]), 1),
        "corpus_meta": rt.corpus["meta"],
        "spec": plan.spec,
        "target": target_metrics,
        "heads": state["metrics"]["heads"],
        "heads_init": state.get("init_heads"),
        "plan": plan.to_dict(),
        "chunks": state["chunks"],
        "recipe": "python -m models.train_chunks",
    }
    (tmp / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    for path in [*paths, tmp / "metrics.json"]:
        _fsync(path)
    if out.exists():
        shutil.rmtree(out)
    os.rename(tmp, out)
    _fsync(out.parent)
    return out


def snapshot(work: Path, out: Path) -> Path:
    """The heads phase's current checkpoint as a trained folder at `out` (the layout
    `models.train_all --from-trained` exports): to measure the heads in vLLM between chunks
    (`models.measure_acceptance`). The heads' metrics there are the loss history so far, no
    held-out evaluation. The run itself is left as it is."""
    state_path, plan_path = work / "state.json", work / "plan.json"
    if not state_path.is_file():
        raise FileNotFoundError(f"{work}: no state.json, nothing trained to snapshot")
    state = json.loads(state_path.read_text())
    plan = Plan.from_dict(json.loads(plan_path.read_text()))
    if plan.phases[state["phase_index"]].name != "heads" or not state["heads_initialized"]:
        raise ValueError(f"{work}: the run is at {plan.phases[state['phase_index']].name} step {state['step']}; "
                         "a snapshot needs the heads phase under way")
    corpus_file = work / "corpus.npz"
    if not corpus_file.is_file():
        _remake_corpus(corpus_file, state["corpus_sha256"])
    rt = _load_runtime(work, plan, state, load_corpus(corpus_file))
    rt.state = {**state, "metrics": {**state["metrics"], "heads": {
        "config": asdict(rt.phase.head_config()), "steps_run": state["step"], "stopped_by_clock": True,
        **{name: head_loss_summary(state["history"][name]) for name in HEAD_NAMES}}}}
    return write_trained(work, rt, out)


def run_chunk(work: Path, plan: Plan | None = None, *, minutes: float | None = None,
              max_steps: int | None = None, init_from: Path | None = None,
              corpus_path: Path | None = None, save_every_minutes: float = 5.0,
              progress_every_s: float = 30.0, threads: int | None = None,
              grow: Callable[[Plan, dict], dict] | None = None) -> dict:
    """Train one chunk in work; returns the state dict as saved. plan=None: the one in
    work/plan.json (or the `cpu` preset for a new work dir)."""
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    plan_path, state_path = work / "plan.json", work / "state.json"
    state = json.loads(state_path.read_text()) if state_path.is_file() else None
    if plan_path.is_file() and (state is not None or plan is None):
        stored = Plan.from_dict(json.loads(plan_path.read_text()))
        if plan is not None and plan != stored:
            changes = plan_diff(stored.to_dict(), plan.to_dict())
            if state is None or not _only_later_phases_change(stored, plan, state):
                raise PlanMismatch(f"{plan_path} holds another plan; this call would change "
                                   + "; ".join(changes) + " (use a new --work DIR for a new plan; "
                                   "only phases that have not started may change)")
            # A phase not yet started has computed nothing: changing it leaves every step
            # run so far as it is, and the run equals one made with the new plan throughout.
            at = f"{stored.phases[state['phase_index']].name} step {state['step']}"
            log("chunks", f"plan amended at {at}: " + "; ".join(changes))
            state.setdefault("amendments", []).append({"at": at, "changes": changes})
            _write_json(plan_path, plan.to_dict())
            _write_json(state_path, state)
            stored = plan
        plan = stored
    else:
        plan = plan or cpu_plan()  # nothing trained yet: a new plan may replace the old
        _write_json(plan_path, plan.to_dict())
    if state is not None and init_from is not None:
        raise ValueError(f"--init is only allowed at the first chunk; {work} already has a state "
                         f"(phase {plan.phases[state['phase_index']].name} step {state['step']})")
    _clean_stale(work, state)
    corpus_file = _prepare_corpus(work, corpus_path, state)
    corpus = load_corpus(corpus_file)
    spec = plan.tiny_spec()
    if corpus["meta"]["vocab_size"] != spec.vocab_size:
        raise ValueError(f"corpus vocab {corpus['meta']['vocab_size']!r} != plan spec {spec.vocab_size}")
    if threads is not None:
        torch.set_num_threads(threads)
    threads = torch.get_num_threads()

    if state is None:
        init_state, init = None, None
        if init_from is not None:
            init_state = init_target(plan, load_init_state(init_from), grow)
            init = {"from": str(init_from), "sha256": state_fingerprint(init_state)}
        state = _new_state(plan, sha256_file(corpus_file), init)
        rt = _fresh_runtime(plan, state, corpus, init_state)
        state["chunks"].append({"threads": threads, "torch": torch.__version__})
        save_checkpoint(work, rt)  # the starting point is on disk before any step
    else:
        if state["finished"]:
            log("chunks", f"{work}: the plan is finished; trained weights in {work / 'trained'}")
            return state
        previous = state["chunks"][-1].get("threads") if state["chunks"] else None
        if previous is not None and previous != threads:
            log("chunks", f"warning: this chunk runs {threads} torch threads, the last ran "
                f"{previous}; float sums may round differently, so the result can differ "
                "in the last bits from a run at one thread count")
        rt = _load_runtime(work, plan, state, corpus)
        state["chunks"].append({"threads": threads, "torch": torch.__version__})

    clock = _Clock(minutes, max_steps, save_every_minutes, progress_every_s)
    start = (rt.phase.name, state["step"])
    stops = ([f"{minutes:g} min"] if minutes is not None else []) + (
        [f"{max_steps} steps"] if max_steps is not None else [])
    log("chunks", f"{work}: plan {plan.name!r}, {rt.phase.name} step {state['step']}/"
        f"{rt.phase.steps}, torch threads {threads}"
        + (", stops after " + " or ".join(stops) if stops else ", runs to the end"))
    while not state["finished"] and not clock.out_of_time():
        phase = rt.phase
        if phase.name == "target":
            _target_steps(rt, clock, work)
            if state["step"] < phase.steps:
                break
            _finish_target_phase(rt)
            state["phase_index"] += 1  # a plan always ends with its heads phase
            state["step"] = 0
            clock.new_phase()
            _account(rt, clock)
            save_checkpoint(work, rt)
            clock.last_save = time.monotonic()
        else:
            rt.target.eval().requires_grad_(False)
            if rt.pool is None:
                if not _build_pool(rt, clock, work):
                    break
                clock.new_phase()  # tokens/s and the ETA count head steps, not the pool's build
            _heads_steps(rt, clock, work)
            if state["step"] < phase.steps:
                break
            state["metrics"]["heads"] = _heads_metrics(rt)
            state["finished"] = True
            _account(rt, clock)
            out = write_trained(work, rt)
            log("chunks", f"plan finished: wrote {out}; export with "
                f"`python -m models.train_all --out OUT --from-trained {out}`")

    _account(rt, clock)
    path = save_checkpoint(work, rt)
    done_steps = clock.steps
    if state["finished"]:
        log("chunks", f"saved {path}; the plan is finished ({done_steps} steps this call)")
    else:
        _report(rt, clock, force=True)
        log("chunks", f"saved {path}: {start[0]} step {start[1]} -> {rt.phase.name} step "
            f"{state['step']}/{rt.phase.steps} ({done_steps} steps in "
            f"{_fmt_s(time.monotonic() - clock.started)}); continue with `make train` "
            f"(python -m models.train_chunks --work {work})")
    return state


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m models.train_chunks",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, required=True, help="the run's folder (plan, state)")
    parser.add_argument("--minutes", type=float, default=None,
                        help="end this chunk after M minutes of wall clock (between steps)")
    parser.add_argument("--max-steps", type=int, default=None, help="end after N steps this call")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default 1; keep it the same across chunks "
                             "for bit-identical results)")
    parser.add_argument("--init", type=Path, default=None,
                        help="first chunk only: start the target from FROM (target.NN.pt shards "
                             "or a Hugging Face folder with model.safetensors)")
    parser.add_argument("--plan", default=None,
                        help=f"first chunk: a preset {sorted(PLANS)} or a plan JSON file (default "
                             "cpu); later: must equal DIR/plan.json if given")
    parser.add_argument("--corpus", type=Path, default=None,
                        help="first chunk: corpus .npz to copy into DIR (default: make the full one)")
    parser.add_argument("--save-every-minutes", type=float, default=5.0)
    parser.add_argument("--snapshot", type=Path, default=None, metavar="OUT",
                        help="train nothing: write the current heads checkpoint to OUT as a trained "
                             "folder (export it with models.train_all --from-trained OUT)")
    args = parser.parse_args(argv)
    if args.minutes is not None and args.minutes <= 0:
        parser.error(f"--minutes must be positive, got {args.minutes!r}")
    if args.max_steps is not None and args.max_steps < 1:
        parser.error(f"--max-steps must be >= 1, got {args.max_steps!r}")
    if args.save_every_minutes <= 0:
        parser.error(f"--save-every-minutes must be positive, got {args.save_every_minutes!r}")
    torch.set_num_threads(args.threads)
    if args.snapshot is not None:
        try:
            log("chunks", f"snapshot of {args.work} written to {snapshot(args.work, args.snapshot)}")
        except (ValueError, FileNotFoundError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        return 0
    try:
        plan = load_plan_arg(args.plan) if args.plan is not None else None
        run_chunk(args.work, plan, minutes=args.minutes, max_steps=args.max_steps,
                  init_from=args.init, corpus_path=args.corpus,
                  save_every_minutes=args.save_every_minutes, threads=args.threads,
                  grow=grow_for_plan)  # --init FROM shallower than the plan: grown in depth
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
