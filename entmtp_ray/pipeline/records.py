"""Output rows: a GenerationResult (or a failure) and its RowContext -> the row fields of
docs/design.md §5, and the Arrow schema they are written with (so error rows and good rows share
one type)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import pyarrow as pa

from entmtp_ray.config import DecodingConfig

if TYPE_CHECKING:  # a type only: the read tasks take OUTPUT_COLUMNS from here, and must not import torch for it
    from entmtp_ray.decode.results import GenerationResult

OUTPUT_SCHEMA = pa.schema([
    ("id", pa.string()),
    ("sample_index", pa.int64()),  # 0..n-1: which of the row's samples (--n, or the row's sampling_params)
    ("task", pa.string()),  # --task, null for a plain --dataset run
    ("prompt", pa.string()),
    ("output_text", pa.string()),
    ("output_token_ids", pa.list_(pa.int64())),
    ("num_prompt_tokens", pa.int64()),
    ("num_output_tokens", pa.int64()),
    ("finish_reason", pa.string()),  # stop | length | context | error
    ("policy", pa.string()),
    ("temperature", pa.float64()),
    ("acceptance", pa.string()),
    ("model", pa.string()),
    ("heads", pa.string()),
    ("bank", pa.string()),
    ("steps", pa.int64()),
    ("verified_nodes", pa.int64()),  # tree nodes verified over all steps (nodes per step = this / steps)
    ("mean_accepted_length", pa.float64()),
    # vLLM's speculative-decoding counters: draft tokens verified (every tree node below a root) and those kept
    # (a step's accepted drafts, its bonus token not counted); acceptance rate = accepted / draft
    ("num_draft_tokens", pa.int64()),
    ("num_accepted_tokens", pa.int64()),
    ("accepted_per_position", pa.list_(pa.float64())),  # [depth]: fraction of steps accepting depth i+1
    ("tree_usage", pa.map_(pa.string(), pa.int64())),  # tree name -> steps
    ("tree_switches", pa.int64()),
    ("step_accepted_lengths", pa.list_(pa.int64())),  # [steps] tokens each step committed, bonus included
    ("step_signals", pa.list_(pa.float64())),  # [steps] scheduling signal before each step; null if not traced
    ("prefill_s", pa.float64()),
    ("decode_s", pa.float64()),
    ("schedule_s", pa.float64()),  # inside decode_s: choosing trees and the verifier statistic the signal reads
    ("total_s", pa.float64()),
    ("tokens_per_s", pa.float64()),  # output tokens / total_s
    ("started_at", pa.float64()),  # unix seconds when the row started decoding
    ("actor_id", pa.string()),
    ("error", pa.string()),  # null when the row succeeded
])
OUTPUT_COLUMNS = tuple(OUTPUT_SCHEMA.names)


@dataclass(frozen=True)
class RowContext:
    """What a row says about how it was made, beside the generation itself."""

    id: str
    prompt: str | None  # the user message (chat turns: their repr)
    decoding: DecodingConfig  # task, policy, temperature and acceptance come from here (the row's own settings)
    model: str  # --model as the user gave it
    heads: str | None  # the heads directory that drafted (None: no drafting)
    bank: str | None  # the bank file the policy read (None: no bank)
    max_depth: int  # draft depths the heads have: the length of accepted_per_position
    started_at: float | None = None  # unix seconds when the row started
    actor_id: str | None = None  # the Ray actor that decoded it (None outside Ray)
    sample_index: int = 0  # which of the row's samples


def _base(context: RowContext) -> dict:
    decoding = context.decoding
    return {
        "id": context.id,
        "sample_index": context.sample_index,
        "task": decoding.task,
        "prompt": context.prompt,
        "policy": decoding.policy,
        "temperature": decoding.temperature,
        "acceptance": decoding.acceptance,
        "model": context.model,
        "heads": context.heads,
        "bank": context.bank,
        "started_at": context.started_at,
        "actor_id": context.actor_id,
    }


def result_row(context: RowContext, result: GenerationResult) -> dict:
    return {
        **_base(context),
        "output_text": result.output_text,
        "output_token_ids": result.output_token_ids,
        "num_prompt_tokens": len(result.prompt_token_ids),
        "num_output_tokens": result.num_output_tokens,
        "finish_reason": result.finish_reason,
        "steps": len(result.steps),
        "verified_nodes": sum(s.nodes for s in result.steps),
        "mean_accepted_length": result.mean_accepted_length,
        "num_draft_tokens": sum(s.nodes - 1 for s in result.steps),
        "num_accepted_tokens": sum(s.accepted_drafts for s in result.steps),
        "accepted_per_position": result.accepted_per_position(context.max_depth),
        "tree_usage": result.tree_usage(),
        "tree_switches": result.tree_switches(),
        "step_accepted_lengths": result.step_accepted_lengths(),
        "step_signals": result.step_signals(),
        "prefill_s": result.prefill_s,
        "decode_s": result.decode_s,
        "schedule_s": result.schedule_s,
        "total_s": result.total_s,
        "tokens_per_s": result.tokens_per_s,
        "error": None,
    }


def error_row(context: RowContext, error: str) -> dict:
    return {
        **_base(context),
        "output_text": None,
        "output_token_ids": None,
        "num_prompt_tokens": None,
        "num_output_tokens": 0,
        "finish_reason": "error",
        "steps": 0,
        "verified_nodes": 0,
        "mean_accepted_length": None,
        "num_draft_tokens": 0,
        "num_accepted_tokens": 0,
        "accepted_per_position": None,
        "tree_usage": None,
        "tree_switches": 0,
        "step_accepted_lengths": None,
        "step_signals": None,
        "prefill_s": None,
        "decode_s": None,
        "schedule_s": None,
        "total_s": None,
        "tokens_per_s": None,
        "error": error,
    }


def output_table(passthrough: pa.Table, rows: list[dict]) -> pa.Table:
    """Output rows (in OUTPUT_SCHEMA) followed by the input's own columns, row for row."""
    assert passthrough.num_rows == len(rows)
    table = pa.Table.from_pylist(rows, schema=OUTPUT_SCHEMA)
    for name in passthrough.column_names:
        table = table.append_column(passthrough.field(name), passthrough.column(name))
    return table
