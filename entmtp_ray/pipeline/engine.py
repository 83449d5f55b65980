"""One process's generation service: configs in, a ready decoder; a prompt in, an output row out.

Shared by the one-machine CLI and the Ray actor. A bad row (empty, non-string or over-long
prompt, or a failure while decoding it) becomes a row with `error` set; a broken config
fails in the constructor, before any row runs.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from entmtp_ray.calibrate.bank import Bank, current_hardware, load_bank, resolve_bank_path, warn_if_other_hardware
from entmtp_ray.config import DecodingConfig, ModelConfig
from entmtp_ray.decode.loop import GenerationResult, HydraDrafter, SpecDecoder, row_generator
from entmtp_ray.model.loading import (
    UNTRAINED_HEADS,
    LoadedModel,
    available_depth,
    draft_vocab_for,
    load_model,
    load_model_heads,
    resolve_heads_path,
)
from entmtp_ray.decode.policy import BANK_POLICIES, Policy, make_policy
from entmtp_ray.pipeline.records import error_row, result_row
from entmtp_ray.decode.tree import load_topology, make_topology

log = logging.getLogger(__name__)

WARMUP_PROMPT = "Say hello."


def preflight(model_cfg: ModelConfig, decoding: DecodingConfig) -> tuple[Policy, bool, Path | None, Bank | None]:
    """Every config check that needs no model: policy, bank, tree files, heads directory and depth.

    Returns the policy, whether it drafts (needs heads), and the bank's path and contents (None
    unless an entmtp policy). Raises ValueError/FileNotFoundError naming the fix.
    """
    bank_path = bank = None
    if decoding.policy in BANK_POLICIES:
        bank_path = resolve_bank_path(model_cfg.model, decoding.task, decoding.bank)
        bank = load_bank(bank_path, available_depth(model_cfg.model, model_cfg.heads), Path(model_cfg.model).name)
    policy = make_policy(decoding, bank)
    topologies = [load_topology(spec) for spec in policy.trees()]
    needs_heads = any(t.depth > 0 for t in topologies)
    if needs_heads:
        depth = available_depth(model_cfg.model, model_cfg.heads)
        for topology in topologies:
            make_topology(topology.paths, topology.name, max_depth=depth)
        draft_vocab_for(model_cfg.model, model_cfg.heads, model_cfg.draft_vocab)  # a bad --draft-vocab fails here
    return policy, needs_heads, bank_path, bank


def encode_checked(loaded: LoadedModel, prompt, max_input_tokens: int) -> list[int]:
    """Prompt ids for one user message (or a list of chat turns); ValueError says why a prompt is bad."""
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(t.get("content"), str) for t in prompt):
            raise ValueError("messages must be a non-empty list of {role, content} turns")
    elif not isinstance(prompt, str):
        raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
    elif not prompt.strip():
        raise ValueError("empty prompt: nothing to generate from")
    ids = loaded.encode_prompt(prompt)
    if len(ids) > max_input_tokens:
        raise ValueError(f"prompt has {len(ids)} tokens, over --max-input-tokens {max_input_tokens}; shorten it or "
                         "raise --max-input-tokens")
    return ids


class Engine:
    def __init__(self, model_cfg: ModelConfig, decoding: DecodingConfig):
        self.model_cfg = model_cfg
        self.decoding = decoding
        policy, needs_heads, bank_path, bank = preflight(model_cfg, decoding)
        self.loaded = load_model(model_cfg.model, model_cfg.dtype, model_cfg.device, model_cfg.chat_format)
        drafter = None
        self.heads_label = None
        self.draft_vocab_size = 0  # 0 = drafts over the full vocabulary
        if needs_heads:
            heads = load_model_heads(self.loaded, model_cfg.heads)
            vocab = draft_vocab_for(model_cfg.model, model_cfg.heads, model_cfg.draft_vocab)
            drafter = HydraDrafter(heads, self.loaded.model, vocab)
            self.draft_vocab_size = len(vocab) if vocab else 0
            self.heads_label = (UNTRAINED_HEADS if model_cfg.heads == UNTRAINED_HEADS
                                else str(resolve_heads_path(model_cfg.model, model_cfg.heads)))
        self.decoder = SpecDecoder(self.loaded, drafter, policy)
        self.bank_label = str(bank_path) if bank_path else None
        if bank is not None:
            warn_if_other_hardware(bank, current_hardware(self.loaded.device, self.loaded.dtype), bank_path)
        self.actor_id: str | None = None  # set by the Ray actor that owns this engine

    def warm_up(self, max_new_tokens: int = 16) -> None:
        """One short generation outside any timed region (allocates caches, warms kernels)."""
        cfg = self.decoding.model_copy(update={"max_new_tokens": max_new_tokens})
        self.decoder.generate(self.loaded.encode_prompt(WARMUP_PROMPT), cfg, row_generator(cfg.seed, "warmup",
                                                                                            self.loaded.device))

    def encode(self, prompt) -> list[int]:
        """Prompt ids for one user message (or a list of chat turns); ValueError says why a prompt is bad."""
        return encode_checked(self.loaded, prompt, self.decoding.max_input_tokens)

    def generate(self, row_id, prompt) -> GenerationResult:
        ids = self.encode(prompt)
        gen = row_generator(self.decoding.seed, row_id, self.loaded.device)
        return self.decoder.generate(ids, self.decoding, gen)

    def _context(self, row_id, prompt) -> dict:
        return {"id": row_id, "prompt": prompt if isinstance(prompt, str) or prompt is None else repr(prompt),
                "model": self.model_cfg.model, "heads": self.heads_label, "decoding": self.decoding,
                "max_depth": self.decoder.drafter.max_depth, "actor_id": self.actor_id, "bank": self.bank_label,
                "started_at": time.time()}

    def error_row(self, row_id, prompt, message: str) -> dict:
        """The output row of a row that cannot run (e.g. unreadable input)."""
        return error_row(self._context(row_id, prompt), message)

    def run(self, row_id, prompt, messages: list[dict] | None = None) -> dict:
        """The output row for one prompt (or chat, `messages`); never raises for a bad row."""
        context = self._context(row_id, prompt)
        try:
            result = self.generate(row_id, messages if messages else prompt)
        except ValueError as exc:
            return error_row(context, str(exc))
        except RuntimeError as exc:  # e.g. a decode failure on this row only
            log.exception("row %s failed", row_id)
            return error_row(context, f"{type(exc).__name__}: {exc}")
        return result_row(context, result)
