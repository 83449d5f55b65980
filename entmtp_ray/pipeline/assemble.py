"""The one place a decoder is put together from configs: the policy (and its bank), the model, the
heads and their drafter. The engine, the benchmark and the bank builder all assemble here.

Checks that need no model run first (`plan`), so a broken config fails before any weight loads.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from entmtp_ray.assets import shipped_bank
from entmtp_ray.calibrate.bank import (BANK_POLICIES, Bank, bank_policy, current_hardware, load_bank,
                                       resolve_bank_path, warn_if_other_hardware)
from entmtp_ray.config import DecodingConfig, ModelConfig
from entmtp_ray.decode.drafting import HydraDrafter
from entmtp_ray.decode.loop import SpecDecoder
from entmtp_ray.decode.policy import POLICIES, Policy, make_policy
from entmtp_ray.decode.static import static_capacity
from entmtp_ray.decode.tree import make_topology
from entmtp_ray.model.loading import (LoadedModel, available_depth, check_model_source, check_quantization,
                                      draft_vocab_for, heads_source, load_model, load_model_heads)

log = logging.getLogger(__name__)

AUTO = "auto"  # the default policy: resolve_policy
ALL_POLICIES = sorted([AUTO, *POLICIES, *BANK_POLICIES])
# the bank a run without --task reads: calibrated on an even mix of the three tasks' tune prompts, which ran at
# least as fast as ShareGPT's bank on every task's held-out prompts (docs/measurements.md, "The general bank")
GENERAL_BANK_TASK = "general"


AUTO_BANK = "auto"  # --bank auto: calibrated by the job on its own prompts (pipeline/autobank.py)


@dataclass(frozen=True)
class Plan:
    """What a decoding config resolves to before any model loads."""

    requested: DecodingConfig  # the policy resolved (never `auto`), the bank as given (`auto` kept): the manifest's
    decoding: DecodingConfig  # what runs: as requested, or, for an auto bank not calibrated yet, its fallback
    policy: Policy
    needs_heads: bool  # some tree of the policy drafts
    bank_path: Path | None  # the bank file an entmtp policy reads (None otherwise, and for a calibrated bank)
    bank: Bank | None
    bank_label: str | None = None  # where the bank came from, for output rows
    auto_bank: bool = False  # --bank auto with no calibrated bank yet: `decoding` is the fallback


def policy_for(decoding: DecodingConfig, bank: Bank | None) -> Policy:
    """The policy named by decoding.policy; the entmtp ones take their trees and thresholds from `bank`."""
    if decoding.policy in BANK_POLICIES:
        if bank is None:
            raise ValueError(f"--policy {decoding.policy} needs a topology bank (--task or --bank)")
        return bank_policy(decoding, bank)
    if decoding.policy not in POLICIES:
        raise ValueError(f"unknown policy '{decoding.policy}'; choose one of {ALL_POLICIES}")
    return make_policy(decoding)


def resolve_policy(model_cfg: ModelConfig, decoding: DecodingConfig) -> DecodingConfig:
    """`--policy auto` (the default) made concrete: entmtp-tau with --bank, else with the bank shipped for the
    model and --task, else (no task) with the model's general bank, else with a bank the job calibrates
    (`--bank auto`). Other policies come back unchanged."""
    if decoding.policy != AUTO:
        return decoding
    if decoding.bank:
        return decoding.model_copy(update={"policy": "entmtp-tau"})
    task = decoding.task or GENERAL_BANK_TASK
    bank = shipped_bank(model_cfg.model, task)
    if bank.is_file():
        update = {"policy": "entmtp-tau"} if decoding.task else {"policy": "entmtp-tau", "bank": str(bank)}
        return decoding.model_copy(update=update)
    return decoding.model_copy(update={"policy": "entmtp-tau", "bank": AUTO_BANK})


def fallback_decoding(model_cfg: ModelConfig, decoding: DecodingConfig) -> DecodingConfig:
    """What an auto bank's policy runs with while there is no calibrated bank (a process that does not calibrate,
    or a calibration that failed): the bank shipped for the model and --task (no task: its general bank), else
    Hydra's tree."""
    shipped = shipped_bank(model_cfg.model, decoding.task or GENERAL_BANK_TASK)
    if shipped.is_file():
        policy = decoding.policy if decoding.policy in BANK_POLICIES else "entmtp-tau"
        return decoding.model_copy(update={"policy": policy, "bank": str(shipped)})
    return decoding.model_copy(update={"policy": "hydra", "bank": None, "signal": None})


def fallback_warning(model_cfg: ModelConfig, decoding: DecodingConfig, why: str) -> str:
    """The warning for a run of an auto bank's fallback: what runs instead, and how to get a bank."""
    task = decoding.task or GENERAL_BANK_TASK
    ran = f"bank {decoding.bank}" if decoding.bank else "Hydra's tree, which may run slower than plain decoding"
    return (f"--bank auto: {why}, so decoding uses {ran}; calibrate with the generation job (jobs/generate.py "
            f"--bank auto), or build a bank with `python jobs/build_bank.py --task {task} --model {model_cfg.model} "
            f"--out banks/{task}.json --work runs/bank` and pass --bank banks/{task}.json")


def plan(model_cfg: ModelConfig, decoding: DecodingConfig, bank: Bank | None = None,
         bank_label: str | None = None) -> Plan:
    """Every config check that needs no model: the model's source, its --quantize scheme on --device (the weights'
    shapes from the model's config), policy, bank, tree files, heads directory and depth (hub ids: their JSON files
    only). `bank`: one already in hand (an auto bank the job calibrated), used instead of the file decoding.bank
    names. Raises ValueError/FileNotFoundError naming the fix."""
    check_model_source(model_cfg.model)
    check_quantization(model_cfg.model, model_cfg.quantize, model_cfg.device, model_cfg.dtype)
    requested = resolve_policy(model_cfg, decoding)
    auto = requested.bank == AUTO_BANK and bank is None
    if requested.bank == AUTO_BANK and requested.policy not in BANK_POLICIES:
        raise ValueError(f"--bank auto calibrates a bank for the entmtp policies; --policy {requested.policy} reads "
                         "none: drop --bank or pick an entmtp policy")
    running = fallback_decoding(model_cfg, requested) if auto else requested
    bank_path = depth = None
    if running.policy in BANK_POLICIES:
        depth = available_depth(model_cfg.model, model_cfg.heads)
        if bank is None:
            bank_path = resolve_bank_path(model_cfg.model, running.task, running.bank)
            bank = load_bank(bank_path, depth, Path(model_cfg.model).name)
            bank_label = str(bank_path)
        else:
            for tree in bank.trees:
                make_topology(tree.paths, tree.name, max_depth=depth)  # a bank from other heads names the fix
    else:
        bank = bank_label = None
    policy = policy_for(running, bank)
    needs_heads = auto or any(t.depth > 0 for t in policy.trees())  # an auto bank's calibration drafts
    if needs_heads:
        depth = depth if depth is not None else available_depth(model_cfg.model, model_cfg.heads)
        for topology in policy.trees():
            make_topology(topology.paths, topology.name, max_depth=depth)
        draft_vocab_for(model_cfg.model, model_cfg.heads, model_cfg.draft_vocab)  # a bad --draft-vocab fails here
    return Plan(requested, running, policy, needs_heads, bank_path, bank, bank_label, auto)


@dataclass
class Stack:
    """A loaded model with (optionally) its heads' drafter: decoders for any policy share it."""

    loaded: LoadedModel
    drafter: HydraDrafter | None
    heads_label: str | None  # the heads directory, owner/name@commit of a hub id, or 'untrained', for output rows
    draft_vocab_size: int  # 0 = drafts over the full vocabulary

    @property
    def max_depth(self) -> int:
        return self.drafter.max_depth if self.drafter is not None else 0

    def decoder(self, policy: Policy, decoding: DecodingConfig | None = None) -> SpecDecoder:
        """A decoder for `policy` on this model; a policy that never drafts gets no drafter (no heads' work). With
        `decoding`, a static KV cache (CUDA) holds what its longest prompt allowed and its new tokens need
        (static.static_capacity), not the model's whole context."""
        drafts = any(t.depth > 0 for t in policy.trees())
        capacity = None if decoding is None else static_capacity(
            decoding.max_input_tokens, decoding.max_new_tokens, max(t.num_nodes for t in policy.trees()),
            self.loaded.max_positions)
        return SpecDecoder(self.loaded, self.drafter if drafts else None, policy, capacity=capacity)


def load_stack(model_cfg: ModelConfig, with_heads: bool) -> Stack:
    """The model of `model_cfg`, and its heads and drafter when `with_heads`."""
    loaded = load_model(model_cfg.model, model_cfg.dtype, model_cfg.device, model_cfg.chat_format, model_cfg.quantize)
    if not with_heads:
        return Stack(loaded, None, None, 0)
    heads = load_model_heads(loaded, model_cfg.heads)
    vocab = draft_vocab_for(model_cfg.model, model_cfg.heads, model_cfg.draft_vocab)
    label = heads_source(model_cfg.model, model_cfg.heads)
    return Stack(loaded, HydraDrafter(heads, loaded.model, vocab), label, len(vocab) if vocab else 0)


def warn_if_bank_elsewhere(stack: Stack, resolved: Plan, concurrency: int = 1) -> None:
    """A bank measured on other hardware (or at another concurrency) still runs (its trees may just be slower
    here): warn once."""
    if resolved.bank is not None:
        warn_if_other_hardware(resolved.bank, current_hardware(stack.loaded.device, stack.loaded.dtype, concurrency,
                                                                 stack.loaded.quantize),
                               resolved.bank_label)
