"""The one place a decoder is put together from configs: the policy (and its bank), the model, the
heads and their drafter. The engine, the benchmark and the bank builder all assemble here.

Which policy and bank run is decided in one place, `resolve`; its checks need no model, so a broken config fails
before any weight loads.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from entmtp_ray.assets import shipped_bank
from entmtp_ray.calibrate.bank import (BANK_POLICIES, Actors, Bank, build_policy, current_hardware, default_bank_path,
                                       load_bank, resolve_bank_path, warn_if_other_hardware)
from entmtp_ray.config import DecodingConfig, ModelConfig
from entmtp_ray.decode.costs import CostTable, awaiting, measure_costs
from entmtp_ray.decode.drafting import HydraDrafter
from entmtp_ray.decode.loop import SpecDecoder
from entmtp_ray.decode.policy import Adaptive, Policy
from entmtp_ray.decode.static import static_capacity
from entmtp_ray.decode.tree import Topology, make_topology
from entmtp_ray.model.loading import (LoadedModel, available_depth, check_model_source, check_quantization,
                                      cpu_isa, draft_vocab_for, heads_source, load_model, load_model_heads,
                                      package_version, pick_activations, pick_dtype)
from entmtp_ray.model.native import extension
from entmtp_ray.model.products import native_expected

log = logging.getLogger(__name__)

AUTO = "auto"  # the default policy: resolve_policy
# the bank a run without --task reads: calibrated on an even mix of the three tasks' tune prompts, which ran at
# least as fast as ShareGPT's bank on every task's held-out prompts (docs/measurements.md, "The general bank")
GENERAL_BANK_TASK = "general"


AUTO_BANK = "auto"  # --bank auto: calibrated by the job on its own prompts (pipeline/autobank.py)


@dataclass(frozen=True)
class Plan:
    """What a job runs, decided by `resolve` before any model loads."""

    requested: DecodingConfig  # the policy resolved (never `auto`), the bank as resolved (`auto` kept): the manifest's
    decoding: DecodingConfig  # what runs: as requested, or, while an auto bank is not calibrated, its fallback
    policy: Policy
    needs_heads: bool  # some tree of the policy drafts (or the calibration does)
    bank_path: Path | None  # the bank file an entmtp policy reads (None otherwise, and for a calibrated bank)
    bank: Bank | None
    bank_label: str | None = None  # where the bank came from, for output rows
    calibrate: bool = False  # --bank auto with no calibrated bank yet: `decoding` is the fallback until one is
    source: str = ""  # why this policy and bank, in a line, for the job's summary


def actors_here(model_cfg: ModelConfig, concurrency: int = 1, on_gpu: bool | None = None) -> Actors:
    """This process as the actor that decodes (an engine, the bench): its kind of device (or `on_gpu`) and the dtype
    --dtype gives here. Never raises: a --device this host lacks is checked where the model loads."""
    if on_gpu is None:
        on_gpu = model_cfg.device.startswith("cuda") or (model_cfg.device == "auto" and torch.cuda.is_available())
    dtype = pick_dtype(model_cfg.dtype, torch.device("cuda" if on_gpu else "cpu"), model_cfg.quantize,
                       model_cfg.model)
    return Actors(on_gpu, concurrency, model_cfg.quantize, str(dtype).replace("torch.", ""))


def resolve_policy(model_cfg: ModelConfig, decoding: DecodingConfig,
                   actors: Actors | None = None) -> tuple[DecodingConfig, str]:
    """`--policy auto` (the default) made concrete, and where its bank comes from: entmtp-tau with --bank, else with
    the bank shipped for the model and --task (no task: the model's general bank), in its variant timed on the
    actors' kind of hardware where one ships (default_bank_path; `actors`: this process when not given), else with
    a bank the job calibrates (`--bank auto`). Other policies come back unchanged."""
    if decoding.policy != AUTO:
        return decoding, f"--policy {decoding.policy}"
    if decoding.bank:
        return decoding.model_copy(update={"policy": "entmtp-tau"}), (
            "--bank auto: calibrated on the job's prompts" if decoding.bank == AUTO_BANK else f"--bank {decoding.bank}")
    task = decoding.task or GENERAL_BANK_TASK
    bank = default_bank_path(model_cfg.model, task, actors or actors_here(model_cfg))
    if bank.is_file():
        update = {"policy": "entmtp-tau"} if decoding.task and bank == shipped_bank(model_cfg.model, task) \
            else {"policy": "entmtp-tau", "bank": str(bank)}
        variant = "" if bank.parent.name == Path(model_cfg.model).name else f" (its {bank.parent.name} variant)"
        source = f"the bank shipped for {model_cfg.model} and --task {task}{variant}" if decoding.task else \
            f"{model_cfg.model}'s general bank{variant} (no --task)"
        return decoding.model_copy(update=update), source
    return decoding.model_copy(update={"policy": "entmtp-tau", "bank": AUTO_BANK}), (
        f"calibrated on the job's prompts: no bank ships for {model_cfg.model} and {task}")


def fallback_decoding(model_cfg: ModelConfig, decoding: DecodingConfig, actors: Actors | None = None) -> DecodingConfig:
    """What an auto bank's policy runs with while there is no calibrated bank (a process that does not calibrate,
    or a calibration that failed): the bank shipped for the model and --task (no task: its general bank), in the
    variant that suits `actors` where one ships, else Hydra's tree."""
    shipped = default_bank_path(model_cfg.model, decoding.task or GENERAL_BANK_TASK, actors)
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


def resolve(model_cfg: ModelConfig, decoding: DecodingConfig, actors: Actors | None = None, bank: Bank | None = None,
            bank_label: str | None = None) -> Plan:
    """The one decision of what runs: the user's settings and what is known of the actors -> the Plan (policy, bank,
    where the bank comes from and why, whether the job calibrates one). Pure: it reads configs and files, never a
    model, so every check that needs no model runs here and a broken config fails before any weight loads.

    The rules, in order: `--policy auto` is entmtp-tau with --bank, else the bank shipped for the model and --task
    (no task: its general bank), in the variant timed on the actors' kind of hardware where one ships (`actors`, else
    this process: actors_here), else a bank the job calibrates (`--bank auto`); a shipped bank chosen by default
    whose hardware does not match the actors (`Hardware.matches`: another kind of device, concurrency, weights or
    dtype) is replaced by a calibrated one (`actors`: None before the actors are placed, and in an engine, which
    runs what it is given); until a calibrated bank is in hand (`bank`, from `bank_label`), an auto bank runs its
    fallback (the shipped bank, else Hydra's tree).

    Also checked: the model's source, its --quantize scheme (on the actors' device once known), the bank and tree
    files against the heads' depth, and --draft-vocab. Raises ValueError/FileNotFoundError naming the fix."""
    check_model_source(model_cfg.model)
    device = model_cfg.device if actors is None else ("cuda" if actors.on_gpu else "cpu")
    check_quantization(model_cfg.model, model_cfg.quantize, device, model_cfg.dtype)
    if device != "auto":  # --activations int8 where nothing takes it fails here, before any work
        pick_activations(model_cfg.activations, model_cfg.dtype, torch.device(device.split(":")[0]),
                         model_cfg.quantize, model_cfg.model)
    facts = actors or actors_here(model_cfg)  # which shipped variant of a bank suits them
    requested, source = resolve_policy(model_cfg, decoding, facts)
    if requested.bank == AUTO_BANK and requested.policy not in BANK_POLICIES:
        raise ValueError(f"--bank auto calibrates a bank for the entmtp policies; --policy {requested.policy} reads "
                         "none: drop --bank or pick an entmtp policy")
    by_default = decoding.policy == AUTO and not decoding.bank
    if by_default and actors is not None and requested.bank != AUTO_BANK:  # a calibrated bank in hand too
        shipped = load_bank(resolve_bank_path(model_cfg.model, requested.task, requested.bank, facts))
        differences = shipped.hardware.matches(actors)
        if differences:
            requested = requested.model_copy(update={"bank": AUTO_BANK})
            source = (f"calibrated for the actors: {source} was timed on {shipped.hardware.describe()} "
                      f"({'; '.join(differences)}); pass --bank to keep it")
    calibrate = requested.bank == AUTO_BANK and bank is None
    running = fallback_decoding(model_cfg, requested, facts) if calibrate else requested
    if bank is not None:
        source = f"calibrated on the job's prompts ({bank_label})"
    bank_path = depth = None
    if running.policy in BANK_POLICIES:
        depth = available_depth(model_cfg.model, model_cfg.heads)
        if bank is None:
            bank_path = resolve_bank_path(model_cfg.model, running.task, running.bank, facts)
            bank = load_bank(bank_path, depth, Path(model_cfg.model).name)
            bank_label = str(bank_path)
        else:
            for tree in bank.trees:
                make_topology(tree.paths, tree.name, max_depth=depth)  # a bank from other heads names the fix
    else:
        bank = bank_label = None
    policy = build_policy(running, bank)
    needs_heads = calibrate or any(t.depth > 0 for t in policy.trees())  # an auto bank's calibration drafts
    if needs_heads:
        depth = depth if depth is not None else available_depth(model_cfg.model, model_cfg.heads)
        for topology in policy.trees():
            make_topology(topology.paths, topology.name, max_depth=depth)
        draft_vocab_for(model_cfg.model, model_cfg.heads, model_cfg.draft_vocab)  # a bad --draft-vocab fails here
    if calibrate:
        source += f"; until calibrated, {running.bank or running.policy}"
    return Plan(requested, running, policy, needs_heads, bank_path, bank, bank_label, calibrate, source)


def fixed_plan(decoding: DecodingConfig) -> Plan:
    """The plan of a policy that reads no bank (ar, hydra, a --tree of its own) as `decoding` gives it, for a process
    whose model and heads a job's plan has checked already (an auto bank's calibration task decodes its rollouts and
    drafts its trees with such policies). ValueError for `auto` or a bank's policy, which only `resolve` decides."""
    if decoding.policy == AUTO or decoding.policy in BANK_POLICIES or decoding.bank:
        raise ValueError(f"--policy {decoding.policy} (bank {decoding.bank}) is resolved with its bank: use resolve")
    policy = build_policy(decoding, None)
    return Plan(decoding, decoding, policy, any(t.depth > 0 for t in policy.trees()), None, None,
                source=f"--policy {decoding.policy}")


def check(model_cfg: ModelConfig, decoding: DecodingConfig) -> None:
    """Every check `resolve` makes, for this process's facts, dropping the plan: a broken config fails at once
    (build_processor), before Ray starts or any actor is placed. It decides nothing: the job's plan is resolved once
    the actors' facts are known (Processor.plan)."""
    resolve(model_cfg, decoding)


@dataclass
class Stack:
    """A loaded model with (optionally) its heads' drafter: decoders for any policy share it."""

    loaded: LoadedModel
    drafter: HydraDrafter | None
    heads_label: str | None  # the heads directory, owner/name@commit of a hub id, or 'untrained', for output rows
    draft_vocab_size: int  # 0 = drafts over the full vocabulary
    # seconds a step of each tree on this machine (decode/costs.py): opened at the first adaptive decoder
    step_costs: CostTable | None = field(default=None, repr=False)

    @property
    def max_depth(self) -> int:
        return self.drafter.max_depth if self.drafter is not None else 0

    def decoder(self, policy: Policy, decoding: DecodingConfig | None = None, defer_costs: bool = False
                ) -> SpecDecoder:
        """A decoder for `policy` on this model; a policy that never drafts gets no drafter (no heads' work). With
        `decoding`, a static KV cache (CUDA) holds what its longest prompt allowed and its new tokens need
        (static.static_capacity), not the model's whole context. A policy that adapts to content gets its bank's
        trees' step costs on this machine (this machine's cost table, measured into it on first use) and settles at
        them (decode/costs.py; the decoder's `costs` says where they came from). `defer_costs`: where the table
        lacks some, the decoder runs at the bank's costs (`costs_pending`), and whoever runs it measures them later
        by building it again without (Engine.settle_costs: after its first row, which the measuring never holds
        back)."""
        def build(trees: list[Topology]) -> SpecDecoder:
            capacity = None if decoding is None else static_capacity(
                decoding.max_input_tokens, decoding.max_new_tokens, max(t.num_nodes for t in policy.trees()),
                self.loaded.max_positions)
            drafts = any(t.depth > 0 for t in trees)
            return SpecDecoder(self.loaded, self.drafter if drafts else None, policy, capacity=capacity)

        if not isinstance(policy, Adaptive):
            return build(policy.trees())
        # it weighs its trees at what their steps cost here, not on the bank's machine: from this machine's table, or
        # timed through a decoder that drafts for every tree of the bank it may settle on (built only to time)
        if self.step_costs is None:
            self.step_costs = CostTable.open(cost_key(self))
        pending = awaiting(policy, self.step_costs) if defer_costs else None
        costs = pending or measure_costs(policy, lambda: build([*policy.trees(), *policy.homes]), self.step_costs)
        log.info("%s: %s", policy.name, costs)
        decoder = build(policy.trees())  # the trees it settled on (the bank's, while its costs are pending)
        decoder.costs, decoder.costs_pending = costs, pending is not None
        return decoder


def cost_key(stack: Stack) -> dict:
    """What a step's cost on this machine depends on, naming its cost table (decode/costs.CostTable): the model, its
    heads' shape (not where they lie: two checkouts of one project share a table) and draft vocabulary, the hardware
    a bank records (the CPU model, or the GPU and its backend; the threads, dtype, weights, activations), and the
    code: the torch and package versions and, on a CPU, its vector extensions and the C++ kernels' source hash."""
    loaded = stack.loaded
    hardware = current_hardware(loaded.device, loaded.dtype, 1, loaded.quantize, loaded.activations)
    heads = stack.drafter.heads.config.model_dump(exclude={"base_model"}) if stack.drafter is not None else None
    key = {"model": Path(loaded.name).name, "heads": heads, "draft_vocab": stack.draft_vocab_size,
           **hardware.model_dump(exclude={"concurrency"}), "torch": torch.__version__, "package": package_version()}
    if not hardware.on_gpu:
        key["isa"] = cpu_isa()
        key["kernels"] = extension().name if native_expected() else None
    return key


def load_stack(model_cfg: ModelConfig, with_heads: bool, transformers_forward: bool = True) -> Stack:
    """The model of `model_cfg`, and its heads and drafter when `with_heads` (`transformers_forward`: load_model)."""
    loaded = load_model(model_cfg.model, model_cfg.dtype, model_cfg.device, model_cfg.chat_format, model_cfg.quantize,
                        transformers_forward, model_cfg.activations)
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
                                                                 stack.loaded.quantize, stack.loaded.activations),
                               resolved.bank_label)
