"""The persistent batch: each running request's row of a preallocated block table, and a step's inputs built from it
with a few vectorized numpy ops.

Rebuilding every step's block tables from Python lists (pad each, convert the nested list) and computing the slot of
every token in Python was the largest part of a step's host time per row (bench/README.md "Step overhead", its
"inputs" column); a decode step changes almost nothing of that state: one in 16 rows (block size 16) gains a block.
So the table is kept in a numpy array [rows, max_blocks] that is updated by diffs when a request joins (its row
written once), grows (only its new block ids copied) or leaves (its row freed for the next request), as vLLM v1's
InputBatch and BlockTable keep theirs; positions, sequence lengths and slot mappings of a step are computed from it
vectorized. Each row also holds its request's sampling parameters (greedy or not, temperature, top_p, top_k, seed)
and prompt length, written when the request joins, so the sampler slices arrays (an all-greedy step tests one
counter) instead of reading every row's SamplingParams every step (vLLM v1's InputBatch keeps its sampling tensors
the same way). Plain numpy; the model runner turns the arrays into tensors (engine.worker.model_runner).

NOTE: a row is tied to the block-table list the KV cache manager holds for the request (engine.core.kv_cache_manager:
the manager grows a request's list in place and makes a new one only when the request gets blocks again after
losing them). A row whose list is not the manager's current one is stale (the request was preempted, finished or
aborted) and is rebuilt or freed, so the batch is never wrong even if nobody tells it a request left.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from operator import attrgetter, getitem, is_, itemgetter
from typing import NamedTuple

import numpy as np

from engine.core.request import Request
from engine.core.scheduler import ScheduledRequest
from engine.sample.sampler import SampledRows, seed_bits

_request, _num_new_tokens = itemgetter(0), itemgetter(1)
_request_id, _num_computed, _all_token_ids = (attrgetter("request_id"), attrgetter("num_computed_tokens"),
                                              attrgetter("all_token_ids"))


class StepInputs(NamedTuple):
    """One step's model inputs on the host (numpy), rows ordered as the step runs them (decodes first).

    input_ids, positions, slot_mapping: int64 [T] (T = tokens in the step); query_start_loc: int32 [B + 1];
    seq_lens: int32 [B] (tokens in the KV cache per request after the step); block_tables: int32 [B, W] (W = the
    most blocks any of the B requests holds, padded with 0); query_lens: B host ints; logits_rows: int64 [S], the
    rows of the step's hidden states to sample from (a request's last token when the step reaches it); sampling: the
    S requests sampled, in that order; sample_rows: intp [S], their rows of the persistent batch; sample_seq_lens:
    int64 [S], their tokens after the step (prompt + output so far); decode_only: every request feeds exactly one
    token; token_rows: intp [T], each token's row of the persistent batch (its request's kv_start_len, for RoPE);
    order: the step's plan in the order its rows run (an image's placeholder rows: engine.worker.mm_embeds).
    """

    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    block_tables: np.ndarray
    query_lens: list[int]
    logits_rows: np.ndarray
    sampling: list[Request]
    sample_rows: np.ndarray
    sample_seq_lens: np.ndarray
    decode_only: bool
    token_rows: np.ndarray
    order: Sequence[ScheduledRequest]


class InputBatch:
    """Rows of a persistent block table for the running requests, and the step inputs built from it.

    Args:
        max_num_rows: rows to preallocate (the scheduler's max_num_seqs); more are added if ever needed.
        max_blocks_per_seq: columns of the block table (max_model_len / block_size, rounded up).
        block_size: tokens per KV block.
    Raises ValueError when a size is below 1.
    """

    def __init__(self, max_num_rows: int, max_blocks_per_seq: int, block_size: int) -> None:
        if max_num_rows < 1 or max_blocks_per_seq < 1 or block_size < 1:
            raise ValueError(f"max_num_rows, max_blocks_per_seq and block_size must be >= 1, got {max_num_rows}, "
                             f"{max_blocks_per_seq}, {block_size}")
        self.block_size = block_size
        self.block_table = np.zeros((max_num_rows, max_blocks_per_seq), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_rows, dtype=np.int32)  # valid columns of each row
        self._num_blocks: list[int] = [0] * max_num_rows  # the same as Python ints, for the per-request check
        self.row_of: dict[str, int] = {}  # request id -> row
        self._tables: list[list[int] | None] = [None] * max_num_rows  # the manager's list each row mirrors
        self._ids: list[str | None] = [None] * max_num_rows
        self._free_rows = list(range(max_num_rows - 1, -1, -1))  # popped from the end: low rows first
        # Sampling parameters per row (engine.sample.sampler.SampledRows' fields), written when a request joins.
        self.greedy = np.ones(max_num_rows, dtype=bool)
        self.temperature = np.zeros(max_num_rows, dtype=np.float32)
        self.top_p = np.ones(max_num_rows, dtype=np.float32)
        self.top_k = np.zeros(max_num_rows, dtype=np.int64)
        self.seed = np.zeros(max_num_rows, dtype=np.int64)
        self.seeded = np.zeros(max_num_rows, dtype=bool)
        self.prompt_len = np.zeros(max_num_rows, dtype=np.int64)
        self.kv_start_len = np.zeros(max_num_rows, dtype=np.int64)  # Request.kv_start_len of the row's blocks
        self.num_sampled_rows = 0  # rows held by non-greedy requests

    @property
    def num_rows(self) -> int:
        """Rows held by requests."""
        return len(self.row_of)

    def remove(self, request_ids: Iterable[str]) -> None:
        """Free the rows of requests that left the batch (finished, aborted); unknown ids are ignored."""
        for rid in request_ids:
            row = self.row_of.pop(rid, None)
            if row is not None:
                self._tables[row] = self._ids[row] = None
                self._free_rows.append(row)
                if not self.greedy[row]:
                    self.greedy[row] = True
                    self.num_sampled_rows -= 1

    def clear(self) -> None:
        """Free every row."""
        self.remove(list(self.row_of))

    def _sweep(self, block_tables: Mapping[str, list[int]]) -> None:
        """Free the rows whose request no longer holds the blocks they mirror (left without `remove`)."""
        self.remove([rid for rid, row in self.row_of.items() if block_tables.get(rid) is not self._tables[row]])

    def _new_row(self, block_tables: Mapping[str, list[int]]) -> int:
        if not self._free_rows:
            self._sweep(block_tables)
        if not self._free_rows:  # more requests hold blocks than rows were preallocated: double the rows
            n = len(self._tables)
            self.block_table = np.concatenate([self.block_table, np.zeros_like(self.block_table)])
            self.num_blocks = np.concatenate([self.num_blocks, np.zeros_like(self.num_blocks)])
            for name in ("greedy", "temperature", "top_p", "top_k", "seed", "seeded", "prompt_len", "kv_start_len"):
                a = getattr(self, name)
                setattr(self, name, np.concatenate([a, np.full_like(a, name == "greedy")]))
            self._num_blocks += [0] * n
            self._tables += [None] * n
            self._ids += [None] * n
            self._free_rows = list(range(2 * n - 1, n - 1, -1))
        return self._free_rows.pop()

    def _write_row(self, row: int, table: list[int], start: int) -> None:
        """Copy table[start:] into the row (the blocks it does not hold yet)."""
        n = len(table)
        if n > self.block_table.shape[1]:
            raise ValueError(f"a request holds {n} KV blocks, more than the {self.block_table.shape[1]} a row has "
                             "(max_model_len / block_size); the scheduler let it outgrow max_model_len")
        self.block_table[row, start:n] = table[start:]
        if self._num_blocks[row] > n:  # a previous occupant's blocks past the end: padding is 0, as ever
            self.block_table[row, n:self._num_blocks[row]] = 0
        self.num_blocks[row] = self._num_blocks[row] = n

    def _write_params(self, row: int, request: Request) -> None:
        """Write the sampling parameters and prompt length of the request that joins at `row`."""
        sp = request.sampling_params
        self.prompt_len[row] = request.num_prompt_tokens
        if sp.greedy:
            return
        self.greedy[row] = False
        self.num_sampled_rows += 1
        self.temperature[row], self.top_p[row], self.top_k[row] = sp.temperature, sp.top_p, sp.top_k
        self.seeded[row] = sp.seed is not None
        self.seed[row] = 0 if sp.seed is None else seed_bits(sp.seed)

    def sync_row(self, request_id: str, block_tables: Mapping[str, list[int]], request: Request | None = None
                 ) -> int:
        """The row of `request_id` with its block table equal to the manager's `block_tables[request_id]`: a new
        row for a request that joins (its sampling parameters written from `request`, greedy when None), the new
        blocks copied for one that grew, the row rewritten for one whose blocks changed (recomputed after a
        preemption). Raises KeyError when the request holds no blocks."""
        table = block_tables[request_id]
        row = self.row_of.get(request_id)
        if row is None:
            row = self._new_row(block_tables)
            self.row_of[request_id] = row
            self._ids[row] = request_id
            if request is not None:
                self._write_params(row, request)
        elif self._tables[row] is table:
            if len(table) != self._num_blocks[row]:
                self._write_row(row, table, self._num_blocks[row])
            return row
        self._tables[row] = table
        self._write_row(row, table, 0)
        if request is not None:  # new blocks: a new start (admitted, or again after a preemption)
            self.kv_start_len[row] = request.kv_start_len
        return row

    def prepare(self, scheduled: Sequence[ScheduledRequest], block_tables: Mapping[str, list[int]]) -> StepInputs:
        """The inputs of one step: each scheduled request feeds tokens [num_computed_tokens, + num_new_tokens).

        scheduled: the step's plan (engine.core.scheduler); block_tables: the KV cache manager's tables, which already
        hold every scheduled token's slot. Decodes run first (the torch attention path reads them as one slice).
        Cost: a decode step reads each request's counters through C-level `map`s (_decode_lists); a step with
        prefill chunks one short Python pass (_mixed_lists); the rest in numpy. Raises ValueError for an empty step.
        """
        if not scheduled:
            raise ValueError("a step needs at least one scheduled request")
        decode_only = sum(map(_num_new_tokens, scheduled)) == len(scheduled)
        if decode_only:
            rows, starts, input_ids, sampling, sample_at = self._decode_lists(scheduled, block_tables)
            query_lens = [1] * len(rows)
        else:
            # Decodes first, prefill chunks after (a stable sort keeps each group's order).
            scheduled = sorted(scheduled, key=lambda s: s.num_new_tokens != 1)
            rows, starts, query_lens, input_ids, sampling, sample_at = self._mixed_lists(scheduled, block_tables)
        bs = self.block_size
        r = np.array(rows, dtype=np.intp)
        start = np.array(starts, dtype=np.int64)
        b = len(rows)
        at = np.asarray(sample_at, dtype=np.intp)
        if decode_only:
            positions = start
            token_rows = r
            qsl = np.arange(b + 1, dtype=np.int32)
            logits_rows = at.astype(np.int64)
            ends = positions + 1
        else:
            q = np.array(query_lens, dtype=np.int64)
            cum = np.cumsum(q)
            qsl = np.zeros(b + 1, dtype=np.int32)
            qsl[1:] = cum
            token_rows = np.repeat(r, q)
            positions = np.repeat(start - (cum - q), q) + np.arange(int(cum[-1]), dtype=np.int64)
            logits_rows = cum[at] - 1
            ends = start + q
        slot_mapping = self.block_table[token_rows, positions // bs].astype(np.int64) * bs + positions % bs
        width = int(self.num_blocks[r].max())
        return StepInputs(
            input_ids=np.array(input_ids, dtype=np.int64), positions=positions, slot_mapping=slot_mapping,
            query_start_loc=qsl, seq_lens=ends.astype(np.int32), block_tables=self.block_table[:, :width][r],
            query_lens=query_lens, logits_rows=logits_rows, sampling=sampling, sample_rows=r[at],
            sample_seq_lens=ends[at], decode_only=decode_only, token_rows=token_rows, order=scheduled)

    def _decode_lists(self, scheduled: Sequence[ScheduledRequest], block_tables: Mapping[str, list[int]]
                      ) -> tuple[list[int], list[int], list[int], list[Request], np.ndarray]:
        """Rows, start positions, tokens fed, sampled requests and their indices of a step in which every request
        feeds one token, read through C-level maps (no Python statement per request); only the rows that joined,
        grew a block or changed their blocks are synced one by one (sync_row)."""
        reqs = list(map(_request, scheduled))
        ids = list(map(_request_id, reqs))
        row_of = self.row_of
        rows = list(map(row_of.get, ids))
        while None in rows:  # requests that join; a sync may sweep the stale row of another request of the step
            for rid, row, req in zip(ids, rows, reqs, strict=True):
                if row is None:
                    self.sync_row(rid, block_tables, req)
            rows = list(map(row_of.get, ids))
        current = list(map(block_tables.__getitem__, ids))
        b = len(rows)
        same = np.fromiter(map(is_, map(self._tables.__getitem__, rows), current), dtype=bool, count=b)
        lens = np.fromiter(map(len, current), dtype=np.int32, count=b)
        for i in np.flatnonzero(~same | (lens != self.num_blocks[rows])).tolist():  # grew a block, or rebuilt
            self.sync_row(ids[i], block_tables, reqs[i])
        starts = list(map(_num_computed, reqs))
        tokens = list(map(_all_token_ids, reqs))
        input_ids = list(map(getitem, tokens, starts))
        # A request samples when its step reaches its last token (a one-token prefill chunk may not).
        at = np.flatnonzero(np.fromiter(map(len, tokens), dtype=np.int64, count=b) == np.array(starts) + 1)
        sampling = reqs if len(at) == b else [reqs[i] for i in at.tolist()]
        return rows, starts, input_ids, sampling, at

    def _mixed_lists(self, scheduled: Sequence[ScheduledRequest], block_tables: Mapping[str, list[int]]
                     ) -> tuple[list[int], list[int], list[int], list[int], list[Request], list[int]]:
        """`_decode_lists` for a step with prefill chunks: rows, starts, query lengths, tokens fed, sampled requests
        and their indices, in one Python pass over the requests."""
        sync, row_of, tables, num_blocks = self.sync_row, self.row_of, self._tables, self._num_blocks
        rows: list[int] = []
        starts: list[int] = []
        query_lens: list[int] = []
        input_ids: list[int] = []
        sampling: list[Request] = []
        sample_at: list[int] = []
        for i, (req, n) in enumerate(scheduled):
            rid = req.request_id
            row = row_of.get(rid)
            # The common case inline (a request whose row is current): sync_row for the rest.
            if row is None or tables[row] is not (table := block_tables[rid]) or len(table) != num_blocks[row]:
                row = sync(rid, block_tables, req)
            rows.append(row)
            start = req.num_computed_tokens
            starts.append(start)
            query_lens.append(n)
            tokens = req.all_token_ids
            if n == 1:
                input_ids.append(tokens[start])
            else:
                input_ids.extend(tokens[start:start + n])
            if start + n == len(tokens):
                sampling.append(req)
                sample_at.append(i)
        return rows, starts, query_lens, input_ids, sampling, sample_at

    def sampled_rows(self, x: StepInputs) -> SampledRows | None:
        """The non-greedy rows of step `x` with their parameters (rows = positions in the step's logits, in the
        order of `x.sampling`), or None when every row the step samples is greedy: O(1) while the batch holds no
        sampled request, else a few numpy ops over the step's rows."""
        if not self.num_sampled_rows:
            return None
        rows = x.sample_rows
        at = np.flatnonzero(~self.greedy[rows])
        if not at.size:
            return None
        b = rows[at]
        return SampledRows(at.astype(np.int64), self.temperature[b], self.top_p[b], self.top_k[b], self.seed[b],
                           self.seeded[b], x.sample_seq_lens[at] - self.prompt_len[b])
