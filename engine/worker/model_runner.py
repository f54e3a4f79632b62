"""The model runner owns every tensor of a step: inputs, slot mapping, block tables, KV cache, logits."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from engine.config import ModelConfig
from engine.core.request import Request
from engine.core.scheduler import ScheduledRequest
from engine.layers.attention import AttentionMetadata, paged_attention_cpu, paged_attention_ref
from engine.layers.self_attn import AttentionFn
from engine.model.base import ModelBase
from engine.multimodal.image_attention import image_spans
from engine.multimodal.mrope import step_rope_rows
from engine.quant.packed_linear import gguf_kernel_scope
from engine.sample.logits_processors import LogitsProcessors
from engine.sample.sampler import sample_rows_on_device
from engine.worker.cuda_graph import DecodeGraphs
from engine.worker.device import cpu_zeros
from engine.worker.input_batch import InputBatch, StepInputs
from engine.worker.mm_embeds import ImageEmbedder, default_budget


@dataclass
class LaunchedStep:
    """A step queued on the device whose sampled tokens the host has not read yet (ModelRunner.launch).

    Attributes:
        scheduled: the step's plan (request, tokens fed), for the callers that attribute a step's time.
        sampling: the requests that sample in the step, in the order of `tokens`.
        tokens: int64 [S], the sampled token ids on the device (the next step's input ids are gathered from it).
        host: int64 [S] on the host (pinned, filled by a copy queued behind the step; `tokens` itself on the CPU).
        ready: the CUDA event recorded after that copy (None on the CPU, where the step ran already).
    """

    scheduled: list[ScheduledRequest]
    sampling: list[Request]
    tokens: torch.Tensor
    host: torch.Tensor
    ready: torch.cuda.Event | None

    def token_ids(self) -> list[int]:
        """The sampled token ids as host ints: waits for the step and its copy (the step's one host sync)."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.tolist()


def select_attention(backend: str, device: torch.device) -> AttentionFn:
    """The paged attention function for EngineConfig.attention_backend on `device`.

    "auto": the Triton kernels on CUDA when triton imports, the C++ decode kernel on CPU (paged_attention_cpu),
    else the torch reference; "triton" insists (raises ValueError when triton cannot run here: no CUDA and no
    TRITON_INTERPRET=1); "cpu": paged_attention_cpu (ValueError off the CPU); "torch": the reference.
    """
    from engine.layers.triton_attention import paged_attention_triton, triton_available

    if backend == "torch":
        return paged_attention_ref
    if backend == "cpu" or (backend == "auto" and device.type == "cpu"):
        if device.type != "cpu":
            raise ValueError(f"attention_backend='cpu' runs on the CPU, not {device.type}; use 'auto'")
        return paged_attention_cpu
    if backend == "triton":
        if not triton_available():
            raise ValueError("attention_backend='triton' needs triton and a CUDA device (or TRITON_INTERPRET=1 on "
                             "CPU); pip install triton, or use attention_backend='torch'")
        return paged_attention_triton
    if backend != "auto":
        raise ValueError(f"attention_backend must be auto, triton, cpu or torch, got {backend!r}")
    return paged_attention_triton if device.type == "cuda" and triton_available() else paged_attention_ref


class ModelRunner:
    """Runs one scheduled step through the model and samples.

    A step's inputs come from the persistent batch (engine.worker.input_batch: a preallocated block table updated by
    diffs, positions and slot mappings computed vectorized); the engine tells it which requests left
    (`remove_requests`), and rows of requests that left unannounced are found stale and reused.

    Args:
        model: the filled decoder.
        cfg: its shape.
        num_blocks, block_size: KV pool geometry (blocks, tokens per block) the scheduler hands out. With CUDA
            graphs one more block is allocated: the scratch block that padded graph rows write to.
        device, dtype: where and in which precision the KV cache lives.
        seed: seed of the generator for unseeded sampled requests.
        attn_fn: paged attention (see select_attention), passed to the model on every step (None: the reference).
        cuda_graphs: capture decode steps as CUDA graphs (engine.worker.cuda_graph), one per batch-size bucket up to
            `max_num_seqs`, on the first decode step; needs a CUDA device and an attention function that reads only
            device tensors (the Triton kernels). Raises ValueError when asked for without them.
        max_num_seqs: the largest decode batch (the largest graph bucket).
        max_model_len: the longest sequence in tokens (sizes the graphs' static block table).
        max_num_batched_tokens: a step's token budget; for a vision-language model (cfg.vision) it sizes the encoder
            cache of `images` (engine.worker.mm_embeds.default_budget), which builds the input embeddings of the
            steps that feed image placeholders (None for a text-only model).
    """

    def __init__(self, model: ModelBase, cfg: ModelConfig, num_blocks: int, block_size: int,
                 device: torch.device, dtype: torch.dtype, seed: int = 0, *, attn_fn: AttentionFn | None = None,
                 cuda_graphs: bool = False, max_num_seqs: int = 256, max_model_len: int = 2048,
                 max_num_batched_tokens: int = 2048) -> None:
        self.model = model
        self.attn_fn: AttentionFn = attn_fn or paged_attention_ref
        if cuda_graphs and (device.type != "cuda" or self.attn_fn is paged_attention_ref):
            raise ValueError("CUDA graphs need a CUDA device and the Triton attention backend; set enforce_eager")
        if cfg.attention_sinks and self.attn_fn not in (paged_attention_ref, paged_attention_cpu):
            raise ValueError(f"{cfg.architecture}'s attention sinks run on the torch and cpu attention backends only "
                             "(the Triton kernels do not implement them); set attention_backend='torch' or 'cpu'")
        self.block_size = block_size
        self.device = device
        # One (k_cache, v_cache) per layer as the model lays its KV cache out (model.kv_cache_specs): [blocks,
        # block_size, kv_heads, head_size] each, or empty for a layer without a cache. On the CPU the pool's pages
        # are mapped as blocks are first written (cpu_zeros): an auto-sized pool (half the free memory) holds what
        # the batch uses, not its whole size from load on.
        zeros = cpu_zeros if device.type == "cpu" else functools.partial(torch.zeros, device=device)
        blocks = num_blocks + int(cuda_graphs)
        self.kv_caches = [(zeros(spec.block_shape(blocks, block_size), dtype=dtype),
                           zeros(spec.block_shape(blocks, block_size), dtype=dtype)) for spec in model.kv_cache_specs]
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.input_batch = InputBatch(max_num_seqs, -(-max_model_len // block_size), block_size)
        self.graphs: DecodeGraphs | None = None
        self.mrope = model.uses_mrope  # rope rows [3, T] for the steps with image prompts (Qwen2-VL)
        self.images = None if cfg.vision is None else ImageEmbedder(
            model, device, default_budget(cfg.vision.tokens_per_image, max_num_batched_tokens))
        # Logprobs, penalties, logit_bias, min_tokens and grammar masks of the rows that ask for them (set by the
        # engine); a step with none of them registered skips it after one test.
        self.logits_processors: LogitsProcessors | None = None
        if cuda_graphs:
            self.graphs = DecodeGraphs(model, self.attn_fn, self.kv_caches, block_size, num_blocks, max_num_seqs,
                                       -(-max_model_len // block_size), max_model_len)

    def _prepare(self, scheduled: list[ScheduledRequest], block_tables: dict[str, list[int]],
                 pending_tokens: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor | None, StepInputs]:
        """Inputs of one step on the device: input_ids and RoPE table rows (int64 [T]: the positions, or with
        LongRoPE's two factor sets the rows each token's position and its request's kv_start_len pick, as HF
        transformers' generate picks them: engine.layers.rope.longrope_table_rows; int64 [3, T] for an M-RoPE model's
        step with image prompts: engine.multimodal.mrope.step_rope_rows), the attention metadata, and the
        rows of the hidden states to sample from (int64 [S]; None when they are all rows in order, the decode
        step), with the host inputs (their `sampling`: the requests whose step reaches their last token). Built
        from the persistent batch (engine.worker.input_batch) with a few vectorized ops. `pending_tokens` (int64 [S'] on
        the device): the sampled tokens of the step still running, which the placeholders -1 - i among the input
        ids stand for (engine.core.scheduler.Scheduler.hold_pending_tokens); they are gathered on the device."""
        x = self.input_batch.prepare(scheduled, block_tables)
        dev = self._to_device
        input_ids = dev(x.input_ids)
        if pending_tokens is not None:
            at = np.flatnonzero(x.input_ids < 0)
            if at.size:
                input_ids[dev(at)] = pending_tokens[dev(-1 - x.input_ids[at])]
        meta = AttentionMetadata(
            slot_mapping=dev(x.slot_mapping),
            query_start_loc=dev(x.query_start_loc),
            seq_lens=dev(x.seq_lens),
            block_tables=dev(x.block_tables),
            query_lens=x.query_lens,
            seq_lens_host=x.seq_lens.tolist(),
            decode_only=x.decode_only,
            # a model whose image placeholders attend to each other: the images its prefill chunks feed
            image_spans=image_spans(x.order) if self.model.bidirectional_images else (),
        )
        all_rows = len(x.sampling) == len(x.input_ids)  # every token is sampled: rows 0..T-1 in order
        logits_rows = None if all_rows else dev(x.logits_rows)
        rotary = self.model.rotary
        rope_rows = x.positions if rotary.long_from is None else rotary.table_rows(
            x.positions, self.input_batch.kv_start_len[x.token_rows])
        if self.mrope and (mrope_rows := step_rope_rows(x.order, x.positions)) is not None:
            rope_rows = mrope_rows  # [3, T]: a step with image prompts of an M-RoPE model (engine.multimodal.mrope)
        return input_ids, dev(rope_rows), meta, logits_rows, x

    def _to_device(self, a: np.ndarray) -> torch.Tensor:
        """A host array as a tensor on the runner's device: shared with numpy on the CPU; on CUDA copied from
        pinned memory, non-blocking (a pageable copy would wait for the running step: a hidden sync). The caching
        host allocator does not hand the pinned block out again before its copy has run, so the next step may be
        prepared while this one runs."""
        t = torch.from_numpy(a)
        if self.device.type == "cpu":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    def remove_requests(self, request_ids: Iterable[str]) -> None:
        """Free the persistent batch rows of requests that left (finished, aborted); see engine.worker.input_batch."""
        if self.images is not None:
            request_ids = list(request_ids)
            self.images.forget_requests(request_ids)
        self.input_batch.remove(request_ids)

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledRequest], block_tables: dict[str, list[int]]
                ) -> list[tuple[Request, int]]:
        """Run one step; return (request, sampled token) for each request whose step reached its last token
        (decodes and final prefill chunks). Requests mid-prefill sample nothing."""
        sampling, tokens = self._run(scheduled, block_tables, None)
        return list(zip(sampling, tokens.tolist(), strict=True)) if tokens is not None else []

    @torch.inference_mode()
    def launch(self, scheduled: list[ScheduledRequest], block_tables: dict[str, list[int]],
               pending_tokens: torch.Tensor | None) -> LaunchedStep | None:
        """Queue one step on the device without waiting for it (asynchronous scheduling): the same work as
        `execute`, whose sampled tokens stay on the device (the next step's input ids are gathered from them) and
        are copied to pinned host memory behind the step; `LaunchedStep.token_ids` waits for that copy. Input ids
        that are placeholders (-1 - i) take the i-th of `pending_tokens`, the tokens of the step launched before.
        No request of the step may have a logits processor (they read each step's tokens on the host); raises
        RuntimeError when one does. Returns None when no request samples in this step."""
        sampling, tokens = self._run(scheduled, block_tables, pending_tokens, asynchronous=True)
        if tokens is None:
            return None
        if tokens.device.type != "cuda":
            return LaunchedStep(scheduled, sampling, tokens, tokens, None)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return LaunchedStep(scheduled, sampling, tokens, host, event)

    def _run(self, scheduled: list[ScheduledRequest], block_tables: dict[str, list[int]],
             pending_tokens: torch.Tensor | None, asynchronous: bool = False
             ) -> tuple[list[Request], torch.Tensor | None]:
        """The step's forward pass and sampling: the sampled requests and their tokens (int64 [S] on the device;
        None when none samples)."""
        input_ids, rope_rows, meta, logits_rows, x = self._prepare(scheduled, block_tables, pending_tokens)
        images = None if self.images is None else self.images.inputs(x.order, input_ids)
        sampling = x.sampling
        sampled_rows = self.input_batch.sampled_rows(x)
        # The CPU's small-batch GGUF kernel: decode-only steps without a seeded row (engine.quant.packed_linear's NOTE).
        small_kernel = meta.decode_only and (sampled_rows is None or not sampled_rows.seeded.any())
        graphs = self.graphs
        with gguf_kernel_scope(small_kernel):
            if images is not None:  # image placeholders: the token embeddings with the images' features merged
                hidden = self.model(None, rope_rows, self.kv_caches, meta, self.attn_fn, **images.model_kwargs())
            elif (graphs is not None and meta.decode_only and rope_rows.dim() == 1
                  and graphs.bucket(len(scheduled)) is not None):  # M-RoPE rows [3, T] run eagerly
                if not graphs.graphs:
                    graphs.capture()  # once, on the first decode step: warm-up and capture of every bucket
                hidden = graphs.run(input_ids, rope_rows, meta)
            else:
                hidden = self.model(input_ids, rope_rows, self.kv_caches, meta, self.attn_fn)
            if not sampling:
                return sampling, None
            if logits_rows is not None:
                hidden = hidden.index_select(0, logits_rows)
            logits = self.model.compute_logits(hidden, full_precision=False)
        procs, pending = self.logits_processors, None
        if procs is not None and procs.active:
            logits, pending = procs.apply(logits, sampling)
            if pending is not None and asynchronous:
                raise RuntimeError("a step with a logits processor (logprobs, penalties, logit_bias, min_tokens, "
                                   "structured output) cannot run asynchronously; use execute")
        # The rows' sampling parameters come from the persistent batch: nothing per row when all are greedy.
        tokens = sample_rows_on_device(logits, sampled_rows, self.generator)
        if pending is not None:
            procs.record(pending, tokens.tolist())
        return sampling, tokens
