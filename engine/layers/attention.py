"""Paged attention: the plain torch reference (CPU, tests, the oracle for the GPU kernels).

KV cache layout, per layer: `k_cache`, `v_cache` of shape [num_blocks, block_size, num_kv_heads, head_dim].
Token t of a request lives in block `block_table[t // block_size]` at offset `t % block_size`; its flat slot is
`block_id * block_size + offset` (the slot mapping). Source: Kwon et al., "Efficient Memory Management for Large
Language Model Serving with PagedAttention" (SOSP 2023).

Sliding-window attention (Mistral; Jiang et al., "Mistral 7B", 2023): every paged attention function takes
`sliding_window=W`; when set, the query at position i sees only keys j with i - W < j <= i (its last W keys, itself
included: HF transformers' `sliding_window_overlay`, `kv_idx > q_idx - sliding_window`). None: full causal attention.
Models may give each layer its own window (Gemma: sliding and global layers); a step keeps one BatchPlan per window.

Bidirectional image attention (Gemma 3): a step's AttentionMetadata.image_spans let the placeholders of one image see
each other in prefill (engine.layers.batch_plan, which builds the torch path's masks). Only the torch path reads
them: the C++ and Triton kernels are causal, so their backends run a step with image spans through it.

Soft-capping (Gemma 2; Gemma Team, "Gemma 2", 2024): with `softcap=c` each scaled score s becomes c * tanh(s / c)
before the mask and the softmax, as HF transformers' eager Gemma 2 attention computes it. Attention sinks (gpt-oss):
with `sinks` [num_heads] each head's softmax denominator has one more term (engine.layers.eager_attention).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.kernels.cpu_features import cpu_has_avx512
from engine.kernels.cpu_kernels import cpu_ops
from engine.layers.batch_plan import BatchPlan
from engine.layers.eager_attention import check_sinks, eager_attention


@dataclass
class AttentionMetadata:
    """Where the tokens of one step sit in the batch and in the KV cache. Built once per step by the model runner.

    The step's tokens are flattened: request b owns rows query_start_loc[b]:query_start_loc[b+1] of every [T, ...]
    activation. Its query token j sits at position seq_lens[b] - q_len_b + j and attends to keys 0..that position.

    Attributes:
        slot_mapping: int64 [T], the flat KV slot each new token's K/V is written to.
        query_start_loc: int32 [B + 1], prefix sums of the per-request query lengths (host copy in `query_lens`).
        seq_lens: int32 [B], tokens in the KV cache per request after this step (context + new tokens).
        block_tables: int32 [B, max_blocks], block ids per request, padded with 0.
        query_lens: list of B ints (host), new tokens per request this step.
        seq_lens_host: list of B ints (host), the same as seq_lens.
        decode_only: True when every request has exactly one new token (the fast decode path).
        image_spans: (request index b, first placeholder position, one past the last) of each image whose
            placeholders attend to each other in this step's prefill chunks (a model with bidirectional_images:
            engine.model.gemma3_vl; engine.multimodal.image_spans), each chunk holding its images up to their last
            placeholder; () for every other step (causal).
        plan: the torch path's batching of this step (BatchPlan) for the last window asked, built on first use and
            then shared by every layer with that window; the Triton kernels do not read it.
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    query_lens: list[int]
    seq_lens_host: list[int]
    decode_only: bool
    image_spans: tuple[tuple[int, int, int], ...] = ()
    plan: BatchPlan | None = None
    _leading_decodes: int | None = None
    _prefill_pairs: int | None = None
    _plans: dict[tuple[int | None, torch.dtype], BatchPlan] | None = None

    def max_prefill_pairs(self) -> int:
        """The most (query, key) pairs of one prefill chunk of the step (q_len x seq_len; 0 when all decode)."""
        if self._prefill_pairs is None:
            self._prefill_pairs = max((q * s for q, s in zip(self.query_lens, self.seq_lens_host, strict=True)
                                       if q > 1), default=0)
        return self._prefill_pairs

    def num_leading_decodes(self) -> int:
        """How many requests decode (one new token each) when they all lead the step, as the model runner orders
        them; -1 when a decode follows a prefill chunk. Counted once per step."""
        if self._leading_decodes is None:
            n = 0
            while n < len(self.query_lens) and self.query_lens[n] == 1:
                n += 1
            self._leading_decodes = n if 1 not in self.query_lens[n:] else -1
        return self._leading_decodes

    def batch_plan(self, block_size: int, dtype: torch.dtype, sliding_window: int | None = None) -> BatchPlan:
        """This step's BatchPlan for KV blocks of `block_size` tokens, attention in `dtype` and `sliding_window`
        (None: full causal), built once per window and dtype (models with sliding and global layers use two)."""
        if self._plans is None:
            self._plans = {}
        plan = self._plans.get((sliding_window, dtype))
        if plan is None:
            plan = self._plans[(sliding_window, dtype)] = BatchPlan.build(self, block_size, dtype, sliding_window)
        self.plan = plan
        return plan

    @classmethod
    def single_prefill(cls, n: int, block_size: int, device: torch.device) -> AttentionMetadata:
        """One request prefilling n tokens from an empty private cache whose blocks 0..ceil(n / block_size) - 1 it
        owns in order (slot i = token i): the metadata of perplexity scoring and calibration forwards."""
        blocks = -(-n // block_size)
        return cls(slot_mapping=torch.arange(n, device=device),
                   query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=device),
                   seq_lens=torch.tensor([n], dtype=torch.int32, device=device),
                   block_tables=torch.arange(blocks, dtype=torch.int32, device=device)[None],
                   query_lens=[n], seq_lens_host=[n], decode_only=False)


def check_sliding_window(sliding_window: int | None) -> None:
    """Raise ValueError unless `sliding_window` is None or an int >= 1 (tokens)."""
    if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
                                       or sliding_window < 1):
        raise ValueError(f"sliding_window must be None or an int >= 1 (tokens), got {sliding_window!r}")


def private_kv_cache(n: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed (k_cache, v_cache), each [ceil(n / block_size), block_size, num_kv_heads, head_dim] of `dtype`: one
    layer's cache for a single request of n tokens, laid out as `AttentionMetadata.single_prefill` expects."""
    shape = (-(-n // block_size), block_size, num_kv_heads, head_dim)
    return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store the step's keys and values in the paged cache.

    k, v: [T, num_kv_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim];
    slot_mapping: int64 [T]. Writes in place.
    """
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, num_seqs: int, dtype: torch.dtype) -> torch.Tensor:
    """Contexts read through block tables: [num_seqs, Hkv, nb * block_size, D] in `dtype` (one copy of the blocks)."""
    ctx = cache.index_select(0, block_ids)  # [S * nb, block_size, Hkv, D]
    ctx = ctx.view(num_seqs, -1, cache.shape[2], cache.shape[3]).transpose(1, 2)
    return ctx if ctx.dtype == dtype else ctx.to(dtype)


def check_softcap(softcap: float | None) -> None:
    """Raise ValueError unless `softcap` is None or a number > 0."""
    if softcap is not None and (isinstance(softcap, bool) or not softcap > 0):
        raise ValueError(f"softcap must be None or > 0, got {softcap!r}")


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
          softcap: float | None, gqa: bool = False, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """torch's scaled_dot_product_attention, or with `softcap` or `sinks` (shaped to broadcast against the scores)
    the eager form (engine.layers.eager_attention): q [..., H, Lq, D], k/v [..., Hkv, L, D] (Hkv = H, or with `gqa`
    any divisor of H), mask additive, broadcast to [..., H, Lq, L]."""
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return eager_attention(q, k, v, mask, scale, softcap=softcap, sinks=sinks, gqa=gqa)


def _attend_decodes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: BatchPlan,
                    scale: float, softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The decode rows of `plan` through one SDPA call: [Bd, num_heads, head_dim]."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    qd = q[plan.decode_rows] if isinstance(plan.decode_rows, slice) else q.index_select(0, plan.decode_rows)
    b = qd.shape[0]
    k = _gather(k_cache, plan.decode_block_ids, b, q.dtype)  # [B, Hkv, L, D]
    v = _gather(v_cache, plan.decode_block_ids, b, q.dtype)
    # GQA without copies: the `group` query heads of one KV head are that head's queries, all at the same
    # position, so they share the padding mask: [B, Hkv, group, D] against [B, Hkv, L, D].
    group = num_heads // num_kv_heads
    sinks = None if sinks is None else sinks.view(1, num_kv_heads, group, 1)  # query head h = (h // group, h % group)
    return _sdpa(qd.view(b, num_kv_heads, group, head_dim), k, v, plan.decode_mask, scale, softcap,
                 sinks=sinks).reshape(b, num_heads, head_dim)


def _attend_prefills(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: BatchPlan, scale: float,
                     out: torch.Tensor, softcap: float | None = None, sinks: torch.Tensor | None = None) -> None:
    """The prefill rows of `plan` through one SDPA call over the padded chunks, written into `out` [T, H, D]."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_seqs = plan.prefill_mask.shape[0]
    qp = q.new_zeros(num_seqs * plan.max_q_len, num_heads, head_dim)
    qp.index_copy_(0, plan.prefill_pad_index, q.index_select(0, plan.prefill_rows))
    qp = qp.view(num_seqs, plan.max_q_len, num_heads, head_dim).transpose(1, 2)  # [P, H, Lq, D]
    k = _gather(k_cache, plan.prefill_block_ids, num_seqs, q.dtype)
    v = _gather(v_cache, plan.prefill_block_ids, num_seqs, q.dtype)
    o = _sdpa(qp, k, v, plan.prefill_mask, scale, softcap, gqa=True,
              sinks=None if sinks is None else sinks.view(1, num_heads, 1, 1))
    o = o.transpose(1, 2).reshape(num_seqs * plan.max_q_len, num_heads, head_dim)
    out.index_copy_(0, plan.prefill_rows, o.index_select(0, plan.prefill_pad_index))


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                        scale: float, *, sliding_window: int | None = None, softcap: float | None = None,
                        sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of the step's queries over each request's cached keys and values (the torch path: tests,
    and the oracle of the CPU and GPU kernels).

    q: [T, num_heads, head_dim]; caches as in the module docstring (already holding this step's K/V);
    returns [T, num_heads, head_dim] in q's dtype. Grouped-query attention: query head h reads KV head
    h // (num_heads // num_kv_heads) (Ainslie et al., "GQA", 2023). At most two calls of torch's
    scaled_dot_product_attention per layer (BatchPlan): all decode rows together, all prefill chunks together.
    sliding_window: W >= 1 limits each query to its last W keys (see the module docstring), by the masks; None:
    full causal. softcap: c > 0 caps the scores (module docstring; the eager form of SDPA). sinks: [num_heads]
    logits in each head's softmax denominator (module docstring). Raises ValueError on an invalid window, cap or sinks.
    """
    check_sliding_window(sliding_window)
    check_softcap(softcap)
    check_sinks(sinks, q.shape[1])
    plan = meta.batch_plan(k_cache.shape[1], q.dtype, sliding_window)
    if plan.prefill_rows is None and isinstance(plan.decode_rows, slice) and plan.decode_rows.stop == q.shape[0]:
        return _attend_decodes(q, k_cache, v_cache, plan, scale, softcap, sinks)  # decode only: all of the output
    out = torch.empty_like(q)
    if plan.decode_rows is not None:
        o = _attend_decodes(q, k_cache, v_cache, plan, scale, softcap, sinks)
        if isinstance(plan.decode_rows, slice):
            out[plan.decode_rows] = o
        else:
            out.index_copy_(0, plan.decode_rows, o)
    if plan.prefill_rows is not None:
        _attend_prefills(q, k_cache, v_cache, plan, scale, out, softcap, sinks)
    return out


# Prefill chunks of at most this many (query, key) pairs per request go through the C++ kernel together with the
# decodes: one call, no padding, no mask. Longer ones take SDPA's blocked (GEMM) path, which wins there: the
# kernel's cost grows as q_len x seq_len with dot products at vector rather than GEMM rates. Measured crossover
# (`python -m bench.cpu_kernels --prefill`, 2-core EPYC, SmolLM2's 9/3 heads of 64): see bench/README.md. On CPUs
# without AVX-512 the kernel's 16-lane blocking takes two registers a vector and SDPA wins at every prefill length
# (bench/README.md "AVX2-only CPUs: where the time goes, and the attention fix").
CPU_KERNEL_MAX_PREFILL_PAIRS = 1024 * 1024 if cpu_has_avx512() else 0


def paged_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                        scale: float, *, sliding_window: int | None = None, softcap: float | None = None,
                        sinks: torch.Tensor | None = None) -> torch.Tensor:
    """`paged_attention_ref`'s contract on the CPU, in a C++ kernel (engine/kernels/csrc/cpu_kernels.cpp) that reads
    each
    context in place through the block table: no gather copy, no padding to the longest context, fp32 softmax.
    Decodes and short prefill chunks (CPU_KERNEL_MAX_PREFILL_PAIRS) run in one kernel call; a step with a longer
    chunk, or with image spans (meta.image_spans: the kernel is causal), sends the decodes to the kernel and the
    chunks to the reference's SDPA path. Falls back to
    `paged_attention_ref` when the kernels are not built (engine.kernels.cpu_kernels). With `sliding_window` the kernel
    skips the whole KV blocks before a row's window and masks the rest of the boundary block; with `softcap` it caps
    each score before the softmax; with `sinks` it adds exp(sinks[h]) to each head's denominator. Raises
    ValueError on an invalid window, cap or sinks.
    """
    check_sliding_window(sliding_window)
    check_softcap(softcap)
    check_sinks(sinks, q.shape[1])
    ops, extra = cpu_ops(), {"softcap": softcap} | ({"sinks": sinks} if sinks is not None else {})
    if ops is None:
        return paged_attention_ref(q, k_cache, v_cache, meta, scale, sliding_window=sliding_window, **extra)
    window, cap = sliding_window or 0, softcap or 0.0  # the kernel's "no window", "no cap"
    sink_arg = {} if sinks is None else {"sinks": sinks.float().contiguous()}  # the kernel's "no sinks": None
    if meta.max_prefill_pairs() <= CPU_KERNEL_MAX_PREFILL_PAIRS and not meta.image_spans:
        return ops.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                   scale, window, cap, **sink_arg)
    nd = meta.num_leading_decodes()
    if nd <= 0:
        return paged_attention_ref(q, k_cache, v_cache, meta, scale, sliding_window=sliding_window, **extra)
    out = torch.empty_like(q)
    out[:nd] = ops.paged_attention(q[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd],
                                   meta.query_start_loc[:nd + 1], scale, window, cap, **sink_arg)
    _attend_prefills(q, k_cache, v_cache, meta.batch_plan(k_cache.shape[1], q.dtype, sliding_window), scale, out,
                     softcap, sinks)
    return out
