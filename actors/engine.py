"""The one module that owns vLLM's async engine.

`Engine` builds `AsyncLLM` from an `EngineConfig` (through `configs.to_vllm_kwargs`, the
only translation), turns a validated request into a prompt and `SamplingParams`, runs
it, and returns a plain result dict. Many `generate` calls run concurrently on one event
loop, so vLLM's scheduler batches them continuously: a slow row never holds back the
others. Spec-decode and token counters come from a stat logger vLLM calls every step.

Knows nothing about Ray, S3 or row formats: the actor, the Ray Data stage and the Serve
deployment hold an `Engine`; they never build a vLLM engine their own way.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from typing import Any

from actors.k0_skip import METHOD as K0_SKIP_METHOD
from actors.live_schedule import GET_METHOD as GET_SCHEDULE_METHOD, METHOD as SET_SCHEDULE_METHOD
from actors.step_split import METHOD as STEP_SPLIT_METHOD
from actors.requests import (
    GenerationRequest,
    RequestError,
    error_result,
    parse_request,
    resolved_sampling,
)
from actors.engine_lifecycle import EngineLifecycle, engine_kwargs, keep_serving, stop_engine
from actors.spec_stats import SpecDecodeStats, StepWindow
from configs.schema import EngineConfig, SamplingDefaults
from configs.spec_k import check_schedule
from configs.vllm_args import live_k_values
from control.live import LiveSpecController

log = logging.getLogger(__name__)

SPEC_COUNTER_NAMES = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
)
SPEC_PER_POS_NAME = "vllm:spec_decode_num_accepted_tokens_per_pos"


def prepare_process_env(device: str) -> None:
    """Process-wide settings vLLM reads at import/start. VLLM_ENABLE_V1_MULTIPROCESSING=0
    keeps a synchronous `vllm.LLM` (benchmarks' bare arm) in-process on CPU; `AsyncLLM`,
    which `Engine` uses, runs its engine core in a child process whatever it says
    (actors.engine_lifecycle handles that process dying)."""
    if device == "cpu":
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


class _StatsSink:
    """vLLM stat logger (its `StatLoggerBase` protocol) feeding a `SpecDecodeStats` and
    the latest scheduler signals. Built by vLLM through the factory in `Engine`."""

    def __init__(self, stats: SpecDecodeStats, signals: dict[str, Any], window: StepWindow):
        self.stats = stats
        self.signals = signals
        self.window = window
        self.kv_capacity_tokens = 0  # set once the engine knows its KV size

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
        now = time.monotonic()
        if scheduler_stats is not None:
            self.signals.update(
                num_running_reqs=scheduler_stats.num_running_reqs,
                num_waiting_reqs=scheduler_stats.num_waiting_reqs,
                kv_cache_usage=scheduler_stats.kv_cache_usage,
                updated_at_s=now,
            )
            spec = scheduler_stats.spec_decoding_stats
            per_pos = list(spec.num_accepted_tokens_per_pos) if spec is not None else []
            if spec is not None:
                self.stats.observe_drafts(spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens, per_pos)
            running = scheduler_stats.num_running_reqs
            self.window.observe_step(
                now, running, spec.num_drafts if spec else 0, spec.num_draft_tokens if spec else 0, per_pos,
                iteration_stats.num_prompt_tokens if iteration_stats is not None else 0,
                scheduler_stats.kv_cache_usage * self.kv_capacity_tokens / running if running else 0.0,
                iteration_stats.num_generation_tokens if iteration_stats is not None else 0)
        if iteration_stats is not None:
            self.stats.observe_tokens(
                iteration_stats.num_prompt_tokens, iteration_stats.num_generation_tokens, now
            )

    def log_engine_initialized(self):
        pass

    def log(self):
        pass

    def record_sleep_state(self, is_awake: int, level: int):
        pass


def _kv_capacity_tokens(vllm_config) -> int:
    """KV slots the engine ended up with (blocks x block size), 0 if not known."""
    cache = vllm_config.cache_config
    blocks = getattr(cache, "num_gpu_blocks", None) or 0
    return int(blocks * (cache.block_size or 0))


class Engine(EngineLifecycle):
    """One vLLM `AsyncLLM` plus request mapping and statistics; restarts and recovery
    from a dead engine core in `actors.engine_lifecycle`."""

    def __init__(self, cfg: EngineConfig, defaults: SamplingDefaults | None = None, device: str = "cpu"):
        if cfg.spec.controller is not None and cfg.spec.schedule is None:
            raise ValueError("an engine config with a controller and no start-up table (spec.schedule=None): "
                             "resolve it first (control.plan.resolve, or startup_engine for one engine)")
        prepare_process_env(device)
        from vllm.v1.metrics.loggers import StatLoggerBase

        self.cfg = cfg
        self.device = device  # a CPU engine's restart overlaps the old core's teardown (engine_lifecycle)
        self.defaults = defaults or SamplingDefaults()
        self.stats = SpecDecodeStats(num_spec_tokens=cfg.spec.num_speculative_tokens or 0)
        self.signals: dict[str, Any] = {}
        self.step_window = StepWindow()
        sink = _StatsSink(self.stats, self.signals, self.step_window)

        class _Logger(StatLoggerBase):  # vLLM checks the base class of custom loggers
            def __init__(self, vllm_config, engine_index=0):
                pass

            record = staticmethod(sink.record)
            log_engine_initialized = staticmethod(sink.log_engine_initialized)

        self._sink, self._logger_cls = sink, _Logger
        # False after a restart without speculation, or from the start where the controller
        # is told to start without the drafter (the config keeps it for the way back).
        self.speculating = cfg.spec.method != "none" and (
            cfg.spec.controller is None or cfg.spec.controller.replacement.start_speculating)
        self.kwargs = engine_kwargs(cfg, self.speculating)
        self._openai: tuple | None = None  # (app, args, tasks) once the OpenAI app is built
        self._init_lifecycle()
        self._start_llm(self.kwargs)
        self.controller = None
        if cfg.spec.controller is not None:
            self.controller = LiveSpecController(self, cfg, self.kv_capacity_tokens)

    def _start_llm(self, kwargs: dict[str, Any]) -> None:
        """Build vLLM's engine (blocking; seconds to minutes) and what depends on it."""
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        started = time.monotonic()
        self._llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs), stat_loggers=[self._logger_cls])
        self._stop_at_exit()
        self._tokenizer = self._llm.get_tokenizer()
        self.max_model_len = self._llm.model_config.max_model_len
        self.kv_capacity_tokens = _kv_capacity_tokens(self._llm.vllm_config)
        self._sink.kv_capacity_tokens = self.kv_capacity_tokens
        self.startup_s = time.monotonic() - started
        log.info("engine ready in %.1fs: %s spec=%s", self.startup_s, self.cfg.model,
                 self.cfg.spec.method if kwargs.get("speculative_config") else "none")

    # -- request mapping -------------------------------------------------------------

    def _prompt_token_ids(self, req: GenerationRequest) -> list[int]:
        if req.messages is not None:
            messages = [m.model_dump() for m in req.messages]
            text = self._tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
            return self._tokenizer.encode(text, add_special_tokens=False)
        return self._tokenizer.encode(req.prompt)

    def _sampling_params(self, req: GenerationRequest, num_prompt_tokens: int):
        from vllm import SamplingParams
        from vllm.exceptions import VLLMValidationError

        values = resolved_sampling(req, self.defaults)
        room = self.max_model_len - num_prompt_tokens
        if room < 1:
            raise RequestError(
                f"prompt is {num_prompt_tokens} tokens; max_model_len={self.max_model_len} "
                "leaves no room for output"
            )
        # Output is bounded by what the context still holds; a request for more gets
        # what fits and finish_reason "length", as OpenAI-compatible servers do.
        values["max_tokens"] = min(values["max_tokens"], room)
        try:
            return SamplingParams(**values)
        except (ValueError, TypeError, VLLMValidationError) as exc:  # vLLM's is neither of the first two
            raise RequestError(f"invalid sampling values {values!r}: {exc}") from exc

    # -- serving -----------------------------------------------------------------------

    async def generate(self, request: dict[str, Any], pause=None) -> dict[str, Any]:
        """Run one request; never raises for a bad or failed request: the result dict
        carries `ok: False` and an `error` with a reason instead.

        `pause` (a `serving.batch_gate.BatchSlot`, or anything with a `must_yield` event
        and an async `resume()`): when the event is set the request is stopped in the
        engine, keeps the tokens it has, waits in `resume()`, and goes on from its prompt
        plus those tokens. Greedy output is the same as without pauses; a sampled (or
        seeded) row draws again from where it stopped."""
        request_id = str(request.get("id", "")) if isinstance(request, dict) else ""
        self._ensure_controller()
        try:
            req = parse_request(request)
            prompt_ids = self._prompt_token_ids(req)
            if len(prompt_ids) >= self.max_model_len:
                return error_result(
                    req.id,
                    "prompt_too_long",
                    f"prompt is {len(prompt_ids)} tokens, max_model_len is {self.max_model_len}",
                )
            params = self._sampling_params(req, len(prompt_ids))
        except RequestError as exc:
            return error_result(request_id, "invalid_request", str(exc))
        return await self.run_with_recovery(req.id, lambda: self._run(req, prompt_ids, params, pause), error_result)

    async def _run(self, req: GenerationRequest, prompt_ids: list[int], params, pause=None) -> dict[str, Any]:
        """One try on the current engine, in segments when paused; raises what the engine raised."""
        started = time.monotonic()
        token_ids: list[int] = []
        first_token_at, num_pauses = None, 0
        while True:
            segment = params.clone()
            segment.max_tokens = params.max_tokens - len(token_ids)
            completion, paused, first_at = await self._segment(req, prompt_ids + token_ids, segment, pause)
            first_token_at = first_token_at or first_at
            token_ids += completion.token_ids if completion is not None else []
            if not paused or len(token_ids) >= params.max_tokens:
                break
            num_pauses += 1
            async with self.stepped_out():  # a restart asked for meanwhile need not wait for this row
                await pause.resume()
        finish_reason = completion.finish_reason if completion is not None and not paused else "length"
        if num_pauses == 0:
            text = completion.text
        else:  # from all tokens: a later segment's own text lacks its left context
            text = self._tokenizer.decode(token_ids, skip_special_tokens=params.skip_special_tokens)
            cut = min((i for i in (text.find(stop) for stop in params.stop or []) if i >= 0), default=-1)
            if cut >= 0:  # a stop string (also one spanning two segments) ends the text, as it would have
                text, finish_reason = text[:cut], "stop"
        return {
            "id": req.id,
            "ok": True,
            "text": text,
            "token_ids": token_ids,
            "finish_reason": finish_reason,
            "num_prompt_tokens": len(prompt_ids),
            "num_output_tokens": len(token_ids),
            "num_pauses": num_pauses,
            "ttft_s": first_token_at - started if first_token_at is not None else None,
            "latency_s": time.monotonic() - started,
        }

    async def _segment(self, req: GenerationRequest, prompt_ids: list[int], params, pause):
        """Run until finished or told to yield: (last output, paused?, when its first
        token came). Cancelling vLLM's generator aborts the request in the engine."""
        from vllm import TokensPrompt

        state: dict[str, Any] = {"out": None, "ttft": None}

        async def consume() -> None:
            async for out in self._llm.generate(TokensPrompt(prompt_token_ids=prompt_ids), params,
                                                f"{req.id}-{uuid.uuid4().hex[:12]}", priority=req.priority):
                if state["ttft"] is None and out.outputs and out.outputs[0].token_ids:
                    state["ttft"] = time.monotonic()
                state["out"] = out

        if pause is None:
            await consume()
            return state["out"].outputs[0], False, state["ttft"]
        consumer = asyncio.ensure_future(consume())
        told = asyncio.ensure_future(pause.must_yield.wait())
        try:
            await asyncio.wait({consumer, told}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            told.cancel()
            if not consumer.done():
                consumer.cancel()
            await asyncio.gather(consumer, told, return_exceptions=True)
        out = state["out"]
        paused = consumer.cancelled() and not (out is not None and out.finished)
        if not consumer.cancelled():
            consumer.result()  # raises what the engine raised
        return (out.outputs[0] if out is not None else None), paused, state["ttft"]

    # -- online (OpenAI-compatible HTTP) -----------------------------------------------

    async def openai_app(self, served_model_name: str):
        """vLLM's own OpenAI-compatible FastAPI app (/v1/models, /v1/completions,
        /v1/chat/completions with streaming, usage and OpenAI error bodies, /health,
        /metrics) bound to THIS engine, so online requests and `generate` calls share
        one scheduler. Online requests use vLLM's default priority 0; `generate` uses
        the request's (batch rows: 1), so online goes first."""
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.entrypoints.launchers.app import build_app
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        self._ensure_controller()
        argv = ["--model", self.kwargs["model"], "--served-model-name", served_model_name]
        args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
        tasks = await self._llm.get_supported_tasks()
        app = build_app(args, tasks, self._llm.model_config)
        await init_app_state(self._llm, app.state, args, tasks)
        keep_serving(app)
        self._openai = (app, args, tasks)  # re-bound to the new engine after a restart
        self._ensure_watchdog()
        return app

    # -- speculation depth -------------------------------------------------------------

    async def set_spec_schedule(self, schedule: list[list[int]]) -> dict[str, Any]:
        """Put a batch-size -> K table ([[lo, hi, K], ...]) in force from the next step on,
        without touching running requests (`actors.live_schedule`). Returns the table now
        in force. Raises ValueError naming the problem for a bad table or a K this engine
        cannot run (`configs.spec_k.allowed_k`); the engine core refuses a table
        when the engine was started without one."""
        max_k = self.cfg.spec.num_speculative_tokens or 0
        if not max_k or not self.speculating:
            method = self.cfg.spec.method if self.speculating else "none (restarted without speculation)"
            raise ValueError(f"engine runs spec.method={method!r}: there is no K to change")
        table = [[int(v) for v in r] for r in schedule]
        check_schedule(table, max_k)
        allowed = live_k_values(self.cfg)
        bad = sorted({r[2] for r in table} - set(allowed))
        if bad:
            raise ValueError(f"K={bad} cannot run on this engine (spec.method={self.cfg.spec.method!r}, "
                             f"num_speculative_tokens={max_k}); allowed K values are {allowed} "
                             "(why: configs.spec_k.allowed_k)")
        async with self.admitted():  # a restart waits for the call (the core answers before it stops)
            if not self.speculating:  # restarted plain while this call waited
                raise ValueError("engine runs spec.method='none (restarted without speculation)': there is no K to change")
            applied = await self._llm.engine_core.call_utility_async(SET_SCHEDULE_METHOD, table)
        self.step_window.skip_next_gap()  # that gap holds the change itself
        return applied

    def _ensure_controller(self) -> None:
        if self.controller is not None:
            self.controller.ensure_running()

    def spec_control_state(self) -> dict[str, Any] | None:
        """The controller's view (K in force, table, latest reason, recent changes,
        predicted capacity), or None when K is fixed (no `engine.spec.controller`)."""
        return self.controller.state() if self.controller is not None else None

    async def spec_schedule(self) -> dict[str, Any]:
        """The batch-size -> K table in force."""
        async with self.admitted():
            if not self.speculating:
                raise ValueError("engine runs without speculation (restarted plain): there is no K table")
            return await self._llm.engine_core.call_utility_async(GET_SCHEDULE_METHOD)

    async def step_split(self, action: str = "read") -> dict[str, Any]:
        """Seconds per decode step spent in the target model, in drafting and in the rest,
        by batch size, timed inside the engine core (`actors.step_split`): action "start"
        begins (or restarts) the sums, "read" returns them, "stop" ends the timing."""
        async with self.admitted():
            return await self._llm.engine_core.call_utility_async(STEP_SPLIT_METHOD, action)

    async def k0_skip(self, settings: dict[str, Any] | None = None) -> dict[str, Any]:
        """P-EAGLE K=0 skip counters (head forwards, skipped steps, catch-up passes, prompt
        tokens stashed, blocks evicted), after applying test/benchmark `settings`
        (`actors.k0_skip._utility`: catch_up, skip, skip_prompts, evict_holes, stash_tokens,
        reset, force_k_cycle, reset_prefix_cache, ...)."""
        async with self.admitted():
            return await self._llm.engine_core.call_utility_async(K0_SKIP_METHOD, settings)

    # -- introspection -----------------------------------------------------------------

    def stats_dict(self) -> dict[str, Any]:
        return {**self.stats.as_dict(), "signals": dict(self.signals), "spec_control": self.spec_control_state(),
                "startup_s": round(self.startup_s, 2),
                "num_restarts": self.num_restarts, "num_engine_deaths": self.num_engine_deaths,
                "num_requests_rerun": self.num_requests_rerun,
                "num_requests_failed_alone": self.num_requests_failed_alone}

    @staticmethod
    def vllm_spec_counters() -> dict[str, Any]:
        """vLLM's own Prometheus spec-decode counters in this process (summed over label
        sets), for cross-checking our statistics."""
        from vllm.v1.metrics.reader import Counter, Vector, get_metrics_snapshot

        out: dict[str, Any] = {name: 0 for name in SPEC_COUNTER_NAMES}
        per_pos: list[int] = []
        for metric in get_metrics_snapshot():
            if isinstance(metric, Counter) and metric.name in SPEC_COUNTER_NAMES:
                out[metric.name] += metric.value
            elif isinstance(metric, Vector) and metric.name == SPEC_PER_POS_NAME:
                per_pos += [0] * (len(metric.values) - len(per_pos))
                for i, v in enumerate(metric.values):
                    per_pos[i] += v
        out[SPEC_PER_POS_NAME] = per_pos
        return out

    def shutdown(self) -> None:
        self.closed = True  # before the engine stops: a stopped engine is not a dead one to rebuild
        if self.controller is not None:
            self.controller.stop()
        stop_engine(self._llm)

    # -- scoring -----------------------------------------------------------------------

    async def score(
        self,
        request_id: str,
        prompt: str,
        completion: str,
        num_top_logprobs: int = 0,
        priority: int = 1,
    ) -> dict[str, Any]:
        """Log-probability of each `completion` token given everything before it.

        The scored sequence is `encode(prompt)` (exactly as `generate` tokenizes a raw
        prompt) followed by `encode(completion, add_special_tokens=False)`: the split
        between prompt and completion is a token boundary by construction, and the
        completion's tokens are the ones a generation of that text after this prompt
        would consist of when the tokenizer round-trips it. It can differ from
        `encode(prompt + completion)` when a token would straddle the boundary (e.g. a
        prompt ending in a space); score whole tokens, not text.

        One prefill with vLLM prompt log-probs (`max_tokens=1`; the one sampled token is
        discarded). Log-probs are the target model's raw ones (vLLM's default
        `logprobs_mode`), before any sampling transform; prefix-cache reads are skipped
        for such requests, so every position is computed. Speculative decoding, when
        configured, never verifies a draft here (no decode step follows), so it cannot
        change a score (the tiny model with P-EAGLE K=4 gives bitwise the same log-probs
        as without speculation, and no drafts are counted). The discarded token does
        count in the engine's output-token statistics. `priority` 1 = batch
        (`actors.requests.PRIORITY_BATCH`). Never raises for a bad row: returns
        `ok: False` with a reason instead.
        """
        from vllm import SamplingParams, TokensPrompt

        prompt_ids = self._tokenizer.encode(prompt)
        completion_ids = self._tokenizer.encode(completion, add_special_tokens=False)
        token_ids = prompt_ids + completion_ids
        if not prompt_ids:
            return error_result(request_id, "empty_prompt", "the prompt has no tokens to condition on")
        if not completion_ids:
            return error_result(request_id, "empty_completion", "the completion has no tokens to score")
        if len(token_ids) >= self.max_model_len:
            return error_result(request_id, "too_long", f"prompt + completion is {len(token_ids)} tokens, "
                                f"max_model_len is {self.max_model_len} (one slot is needed for the discarded token)")
        try:
            params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=num_top_logprobs,
                                    detokenize=num_top_logprobs > 0)
        except (ValueError, TypeError) as exc:
            return error_result(request_id, "invalid_request", f"num_top_logprobs={num_top_logprobs!r}: {exc}")
        async def attempt():
            final = None
            async for out in self._llm.generate(TokensPrompt(prompt_token_ids=token_ids), params,
                                                f"{request_id}-score-{uuid.uuid4().hex[:12]}", priority=priority):
                final = out
            return {"ok": True, "final": final}

        outcome = await self.run_with_recovery(request_id, attempt, error_result)
        if not outcome["ok"]:
            return outcome
        positions = outcome["final"].prompt_logprobs[len(prompt_ids):]
        result: dict[str, Any] = {
            "id": request_id,
            "ok": True,
            "num_prompt_tokens": len(prompt_ids),
            "token_ids": completion_ids,
            "token_logprobs": [pos[tid].logprob for pos, tid in zip(positions, completion_ids)],
        }
        if num_top_logprobs:
            result["top_logprobs"] = [
                [[tid, lp.logprob, lp.decoded_token] for tid, lp in sorted(pos.items(), key=lambda kv: kv[1].rank)
                 if lp.rank <= num_top_logprobs]
                for pos in positions
            ]
        return result
