"""Output rows: a GenerationResult (or a failure) -> the row fields of DESIGN.md section 5."""

from __future__ import annotations

from .decoding import GenerationResult


def _base(context: dict) -> dict:
    decoding = context["decoding"]
    return {
        "id": context["id"],
        "prompt": context["prompt"],
        "policy": decoding.policy,
        "temperature": decoding.temperature,
        "acceptance": decoding.acceptance,
        "model": context["model"],
        "heads": context["heads"],
    }


def result_row(context: dict, result: GenerationResult) -> dict:
    return {
        **_base(context),
        "output_text": result.output_text,
        "output_token_ids": result.output_token_ids,
        "num_prompt_tokens": len(result.prompt_token_ids),
        "num_output_tokens": result.num_output_tokens,
        "finish_reason": result.finish_reason,
        "steps": len(result.steps),
        "mean_accepted_length": result.mean_accepted_length,
        "accepted_per_position": result.accepted_per_position(context["max_depth"]),
        "tree_usage": result.tree_usage(),
        "tree_switches": result.tree_switches(),
        "prefill_s": result.prefill_s,
        "decode_s": result.decode_s,
        "total_s": result.total_s,
        "tokens_per_s": result.tokens_per_s,
        "error": None,
    }


def error_row(context: dict, error: str) -> dict:
    return {
        **_base(context),
        "output_text": None,
        "output_token_ids": None,
        "num_prompt_tokens": None,
        "num_output_tokens": 0,
        "finish_reason": "error",
        "steps": 0,
        "mean_accepted_length": None,
        "accepted_per_position": None,
        "tree_usage": None,
        "tree_switches": 0,
        "prefill_s": None,
        "decode_s": None,
        "total_s": None,
        "tokens_per_s": None,
        "error": error,
    }
