"""Hydra draft heads: modules, our own save/load, and the published Hydra checkpoint format.

No tree logic here: a head maps a batch of draft rows [h, E(root), E(d_1), ..., E(d_i)] to
vocabulary logits; which rows to run is decoding's business.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F
from pydantic import BaseModel, Field
from safetensors.torch import load_file, save_file

from entmtp_ray.model.kv_cache import KVCache
from entmtp_ray.model.layers import DecoderLayer, LlamaParams, RMSNorm
from entmtp_ray.model import step
from entmtp_ray.model.llama import attention_mask, decoder_layer, native_layers, rotary_tables
from entmtp_ray.model.kernels import LayerPlan, Projection, linear, projection

CONFIG_FILE = "heads_config.json"
WEIGHTS_FILE = "heads.safetensors"
HYDRA_WEIGHTS_FILE = "hydra_lm_head.pt"  # a published Hydra checkpoint's weights, beside its config.json
DRAFT_VOCAB_FILE = "draft_vocab.json"
SEEN_PROMPTS_FILE = "seen_prompts.json"  # {task: [prompt ids]} the heads were trained on (jobs/train_heads.py)
FORMAT_VERSION = 1


class HeadsConfig(BaseModel):
    """Shape of a set of Hydra heads; saved beside the weights."""

    format_version: int = FORMAT_VERSION
    arch: Literal["prefix-mlp", "mlp"] = Field(
        "prefix-mlp", description="prefix-mlp = Hydra++ (one extra decoder layer builds the context); "
        "mlp = original Hydra (context is the base hidden state itself)")
    num_heads: int = Field(4, ge=1, description="draft depth the heads support; trees deeper than this are refused")
    num_layers: int = Field(4, ge=1, description="residual blocks per head: one widening block, then one "
                            "tied H->H block applied num_layers-1 times (as the reference ties them)")
    hidden_size: int
    vocab_size: int
    shared_lm_head: bool = Field(
        False, description="reuse the base model's lm_head instead of one vocab projection per head; "
        "the only shippable choice for small models (a 49k x 576 projection is 28M parameters)")
    base_model: str = Field("", description="model the heads were trained for; a mismatch is warned about")
    hidden_state_offset: int = 0


class HeadMLP(nn.Module):
    """One head's trunk: res(x) + SiLU(W x) from (i+2)H to H, then the tied H->H block."""

    def __init__(self, in_features: int, hidden: int, num_layers: int):
        super().__init__()
        self.first_linear = nn.Linear(in_features, hidden)
        self.first_res = nn.Linear(in_features, hidden)
        self.block = nn.Linear(hidden, hidden)
        self.repeats = num_layers - 1
        nn.init.zeros_(self.first_linear.weight)  # start as the residual map, as Hydra does
        nn.init.zeros_(self.block.weight)

    def forward(self, x: torch.Tensor, dropout: float = 0.0) -> torch.Tensor:
        x = F.dropout(x, dropout, self.training)
        x = linear(x, self.first_res) + F.silu(linear(x, self.first_linear))
        for _ in range(self.repeats):
            x = F.dropout(x, dropout, self.training)
            x = x + F.silu(linear(x, self.block))
        return x


@dataclass(frozen=True)
class HeadPlan:
    """One head's trunk for inference (HeadMLP without dropout), its projections looked up once."""

    first_res: Projection
    first_linear: Projection
    block: Projection
    repeats: int

    @classmethod
    def of(cls, mlp: HeadMLP) -> HeadPlan:
        return cls(projection(mlp.first_res).for_drafting(), projection(mlp.first_linear).for_drafting(),
                   projection(mlp.block).for_drafting(), mlp.repeats)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = self.first_res(x) + F.silu(self.first_linear(x))
        for _ in range(self.repeats):
            x = x + F.silu(self.block(x))
        return x


@dataclass(frozen=True)
class HeadsPlan:
    """What drafting runs each step, prepared once per generation (`HydraHeads.prepare`): the prefix
    layer's plan and each head's trunk, one-row products through the faster GEMV (drafts only steer
    which tokens are verified, so their rounding is free to differ from the base model's)."""

    prefix: LayerPlan | None
    trunks: tuple[HeadPlan, ...]
    prefix_step: object | None = None  # the prefix layer as a native step (step.py), where one serves


class HydraHeads(nn.Module):
    def __init__(self, config: HeadsConfig, base_config):
        super().__init__()
        self.config = config
        h = config.hidden_size
        if config.arch == "prefix-mlp":
            if isinstance(base_config, LlamaParams):  # a model in layers.py's containers: the same parameters
                self.prefix_layer = DecoderLayer(base_config)
                self.prefix_norm = RMSNorm(h, base_config.rms_norm_eps)
            else:  # a transformers model: training runs the layer's own forward (imported here: 3 s on 2 cores)
                from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm

                prefix_cfg = copy.deepcopy(base_config)
                prefix_cfg.num_hidden_layers = 1
                self.prefix_layer = LlamaDecoderLayer(prefix_cfg, layer_idx=0)
                self.prefix_norm = LlamaRMSNorm(h, eps=base_config.rms_norm_eps)
        else:
            self.prefix_layer = None
            self.prefix_norm = None
        self.mlps = nn.ModuleList(HeadMLP((i + 2) * h, h, config.num_layers) for i in range(config.num_heads))
        self.lm_heads = None if config.shared_lm_head else nn.ModuleList(
            nn.Linear(h, config.vocab_size) for _ in range(config.num_heads))

    def new_cache(self, capacity: int, dtype, device) -> KVCache | None:
        """The prefix layer's own KV cache (None for the `mlp` arch)."""
        if self.prefix_layer is None:
            return None
        attn = self.prefix_layer.self_attn
        num_kv = attn.k_proj.out_features // attn.head_dim
        return KVCache(1, num_kv, attn.head_dim, capacity, dtype, device)

    def prepare(self) -> HeadsPlan:
        """The inference plan, with derived weights rebuilt for any weight changed since the last one."""
        prefix = LayerPlan.of(self.prefix_layer).for_drafting() if self.prefix_layer is not None else None
        native = step.for_layers(self.prefix_layer, [prefix]) if prefix is not None else None
        return HeadsPlan(prefix, tuple(HeadPlan.of(mlp) for mlp in self.mlps), native)

    def context(self, base_hidden: torch.Tensor, positions: torch.Tensor, cache: KVCache | None,
                rotary_emb: nn.Module, plan: HeadsPlan | None = None) -> torch.Tensor:
        """Context vectors [n, H] for newly committed tokens.

        base_hidden: [n, H] final (post-norm) base hidden states of the committed tokens, at
        `positions` ([n]). The prefix layer runs causally over them and commits them to its cache.
        """
        if self.prefix_layer is None:
            return base_hidden
        if plan is not None and plan.prefix_step is not None and not torch.is_grad_enabled():
            out = native_layers(plan.prefix_step, base_hidden, rotary_emb, cache, positions, None, plan.prefix.groups)
            cache.commit(base_hidden.shape[0])
            return self.prefix_norm(out)
        x = base_hidden[None]
        n = x.shape[1]
        layer_plan = plan.prefix if plan is not None else LayerPlan.of(self.prefix_layer)
        mask = attention_mask(None, cache.length, n, x.device, layer_plan.groups)
        out = decoder_layer(self.prefix_layer, x, rotary_tables(rotary_emb, x, positions), cache, 0, mask, layer_plan)
        cache.commit(n)
        return self.prefix_norm(out)[0]

    def head_hidden(self, head: int, rows: torch.Tensor, dropout: float = 0.0) -> torch.Tensor:
        """rows: [..., (head + 2) * H] -> [..., H] before the vocab projection."""
        return self.mlps[head](rows, dropout)

    def project(self, head: int, hidden: torch.Tensor, base_lm_head: nn.Module,
                vocab: torch.Tensor | None = None) -> torch.Tensor:
        """[..., H] -> [..., V] with the head's own projection or the shared base lm_head; with `vocab`
        (token ids) onto those rows only, [..., len(vocab)] (training over the draft vocabulary)."""
        proj = base_lm_head if self.lm_heads is None else self.lm_heads[head]
        if vocab is None:
            return linear(hidden, proj)
        weight = proj.weight[vocab].to(hidden.dtype)  # a bf16 base's rows for fp32 heads outside autocast
        return F.linear(hidden, weight, None if proj.bias is None else proj.bias[vocab].to(hidden.dtype))

    def logits(self, head: int, rows: torch.Tensor, base_lm_head: nn.Module) -> torch.Tensor:
        return self.project(head, self.head_hidden(head, rows), base_lm_head)


def init_heads(base_model, num_heads: int = 4, num_layers: int = 4, arch: str = "prefix-mlp",
               shared_lm_head: bool = True, seed: int = 0, base_name: str = "") -> HydraHeads:
    """Fresh (untrained) heads for `base_model`, deterministically initialised from `seed`."""
    cfg = base_model.config
    config = HeadsConfig(arch=arch, num_heads=num_heads, num_layers=num_layers, hidden_size=cfg.hidden_size,
                         vocab_size=cfg.vocab_size, shared_lm_head=shared_lm_head, base_model=base_name)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        heads = HydraHeads(config, cfg)
    if heads.lm_heads is not None:
        with torch.no_grad():
            for proj in heads.lm_heads:
                proj.weight.copy_(base_model.lm_head.weight)
                proj.bias.zero_()
    return heads


def save_heads(heads: HydraHeads, directory: str | Path, dtype: torch.dtype | None = None) -> None:
    """heads_config.json + heads.safetensors; `dtype` (e.g. bf16, half the size) is what is stored,
    and loading casts back to the heads' own dtype."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / CONFIG_FILE).write_text(heads.config.model_dump_json(indent=2) + "\n")
    state = {k: v.detach().to(dtype or v.dtype).contiguous().cpu() for k, v in heads.state_dict().items()}
    save_file(state, str(directory / WEIGHTS_FILE))


def load_heads(directory: str | Path, base_model) -> HydraHeads:
    """Our format (heads_config.json + heads.safetensors) or the published Hydra one (config.json +
    hydra_lm_head.pt), detected from the files present."""
    directory = Path(directory)
    weights = weights_file(directory)
    if weights.name == HYDRA_WEIGHTS_FILE:
        return load_hydra_checkpoint(directory, base_model)
    config = HeadsConfig.model_validate_json((directory / CONFIG_FILE).read_text())
    if config.format_version != FORMAT_VERSION:
        raise ValueError(f"heads {directory}: format_version {config.format_version} is not "
                         f"{FORMAT_VERSION}; retrain or convert the heads")
    _check_dims(config, base_model, directory)
    heads = HydraHeads(config, base_model.config)
    heads.load_state_dict(load_file(str(weights)))
    return heads


def weights_file(directory: str | Path) -> Path:
    """The file holding a heads folder's weights, in the format its files say: ours (heads_config.json +
    heads.safetensors) first, else a published Hydra checkpoint's hydra_lm_head.pt."""
    directory = Path(directory)
    if (directory / CONFIG_FILE).is_file():
        return directory / WEIGHTS_FILE
    if (directory / HYDRA_WEIGHTS_FILE).is_file():
        return directory / HYDRA_WEIGHTS_FILE
    raise _no_heads(directory)


def _no_heads(directory: Path) -> FileNotFoundError:
    return FileNotFoundError(
        f"no heads in {directory}: expected {CONFIG_FILE} + {WEIGHTS_FILE} (this project's format) or "
        "config.json + hydra_lm_head.pt (a published Hydra checkpoint, e.g. a local copy of "
        "ankner/hydra-vicuna-7b-v1.3); pass the right directory with --heads")


def heads_depth(directory: str | Path) -> int:
    """Number of heads in a heads directory, read from its config alone (no weights, no model)."""
    directory = Path(directory)
    if (directory / CONFIG_FILE).is_file():
        return HeadsConfig.model_validate_json((directory / CONFIG_FILE).read_text()).num_heads
    if (directory / "config.json").is_file():  # the weights need not be here: a hub id's configs come first
        raw = json.loads((directory / "config.json").read_text())
        if "hydra_num_heads" in raw:
            return int(raw["hydra_num_heads"])
    raise _no_heads(directory)


def _check_dims(config: HeadsConfig, base_model, where) -> None:
    cfg = base_model.config
    if (config.hidden_size, config.vocab_size) != (cfg.hidden_size, cfg.vocab_size):
        raise ValueError(
            f"heads {where}: hidden/vocab {config.hidden_size}/{config.vocab_size} do not match the base model's "
            f"{cfg.hidden_size}/{cfg.vocab_size}; pass heads trained for this --model")


# Published Hydra layout: hydra_mlp.{i} is a Sequential. prefix-mlp interleaves Dropouts
# (blocks at 1, 3, 5, 7; lm head at hydra_lm_head.{i}.1); mlp has no Dropouts (blocks at 0, 1, 2, ...).
_FIRST_BLOCK = {"prefix-mlp": 1, "mlp": 0}
_BLOCK_STRIDE = {"prefix-mlp": 2, "mlp": 1}
_LM_HEAD = {"prefix-mlp": "hydra_lm_head.{i}.1.", "mlp": "hydra_lm_head.{i}."}
_IGNORED = re.compile(r"^(input_embed_fn\.|prefix_embeding_layer\.embed_tokens\.|.*rotary_emb\.inv_freq$)")


def load_hydra_checkpoint(directory: str | Path, base_model) -> HydraHeads:
    """Heads from a published Hydra checkpoint directory (config.json + hydra_lm_head.pt)."""
    directory = Path(directory)
    raw = json.loads((directory / "config.json").read_text())
    arch = raw.get("hydra_head_arch", "mlp")
    if arch not in _FIRST_BLOCK:
        raise ValueError(f"heads {directory}: hydra_head_arch '{arch}' is not supported; "
                         f"supported: {sorted(_FIRST_BLOCK)}")
    if not raw.get("grounded_heads", True):
        raise ValueError(f"heads {directory}: ungrounded (Medusa-style) Hydra heads are not supported; "
                         "use grounded heads")
    cfg = base_model.config
    config = HeadsConfig(arch=arch, num_heads=raw["hydra_num_heads"], num_layers=raw["hydra_num_layers"],
                         hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size, shared_lm_head=False,
                         base_model=raw.get("base_model_name_or_path", ""),
                         hidden_state_offset=raw.get("hidden_state_offset", 0))
    if config.hidden_state_offset != 0:
        raise ValueError(f"heads {directory}: hidden_state_offset {config.hidden_state_offset} is not supported "
                         "(only 0, as in the published Hydra++ heads)")
    source = torch.load(directory / HYDRA_WEIGHTS_FILE, map_location="cpu", weights_only=True)
    heads = HydraHeads(config, cfg)
    expected = heads.state_dict()
    state = _map_hydra_state(source, config, expected, directory)
    heads.load_state_dict({k: v.to(expected[k].dtype) for k, v in state.items()})
    return heads


def _map_hydra_state(source: dict, config: HeadsConfig, expected: dict, where) -> dict:
    """Our state dict from the published one; every expected key must come from a source key."""
    arch, state, used = config.arch, {}, set()

    def take(src_key: str, dst_key: str) -> None:
        if src_key not in source:
            raise ValueError(f"heads {where}: hydra_lm_head.pt lacks '{src_key}' for a {arch} checkpoint "
                             f"with {config.num_heads} heads x {config.num_layers} layers")
        if source[src_key].shape != expected[dst_key].shape:
            raise ValueError(f"heads {where}: '{src_key}' has shape {tuple(source[src_key].shape)}, expected "
                             f"{tuple(expected[dst_key].shape)} for this --model; pass heads trained for it")
        state[dst_key] = source[src_key]
        used.add(src_key)

    if arch == "prefix-mlp":
        for key in expected:
            if key.startswith("prefix_layer."):
                take("prefix_embeding_layer.layers.0." + key[len("prefix_layer."):], key)
        take("prefix_embeding_layer.norm.weight", "prefix_norm.weight")
    first, stride = _FIRST_BLOCK[arch], _BLOCK_STRIDE[arch]
    for i in range(config.num_heads):
        for part in ("weight", "bias"):
            take(f"hydra_mlp.{i}.{first}.linear.{part}", f"mlps.{i}.first_linear.{part}")
            take(f"hydra_mlp.{i}.{first}.res_connection.{part}", f"mlps.{i}.first_res.{part}")
            take(_LM_HEAD[arch].format(i=i) + part, f"lm_heads.{i}.{part}")
            tied = [f"hydra_mlp.{i}.{first + stride * j}.linear.{part}" for j in range(1, config.num_layers)]
            if tied:
                take(tied[0], f"mlps.{i}.block.{part}")
                for key in tied[1:]:
                    take(key, f"mlps.{i}.block.{part}")
                    if not torch.equal(source[key], source[tied[0]]):
                        raise ValueError(f"heads {where}: '{key}' differs from '{tied[0]}'; the H->H blocks "
                                         "must be tied as in the reference Hydra code")
    unknown = [k for k in source if k not in used and not _IGNORED.match(k)]
    if unknown:
        raise ValueError(f"heads {where}: unexpected keys {unknown[:5]} in hydra_lm_head.pt; "
                         "is this a Hydra checkpoint of a supported arch?")
    return state


# ---- draft vocabulary ------------------------------------------------------------------------
# Heads that share the base lm_head spend most of a draft depth projecting onto the whole
# vocabulary. Projecting onto the K tokens most frequent in the heads' training text instead (as
# FR-Spec does) costs V/K times less; a draft can then never be a rarer token, which only lowers
# acceptance, never changes the output (verification uses the full lm_head).

def save_draft_vocab(token_ids: list[int], counts: list[int], directory: str | Path, source: dict,
                     default_size: int) -> None:
    """Token ids by descending count in the heads' training targets, beside the heads; `default_size`
    is how many of them drafting uses unless told otherwise."""
    assert len(token_ids) == len(counts) and 0 < default_size <= len(token_ids)
    data = {"format_version": FORMAT_VERSION, "source": source, "target_tokens": sum(counts),
            "default_size": default_size, "token_ids": token_ids, "counts": counts}
    (Path(directory) / DRAFT_VOCAB_FILE).write_text(json.dumps(data) + "\n")


def load_draft_vocab(directory: str | Path, size: int | None) -> list[int] | None:
    """The `size` most frequent token ids of the heads in `directory` (None: the file's default size,
    or the full vocabulary when there is no file; 0: the full vocabulary, returned as None)."""
    path = Path(directory) / DRAFT_VOCAB_FILE
    if size == 0 or (size is None and not path.is_file()):
        return None
    if not path.is_file():
        raise FileNotFoundError(f"--draft-vocab {size}: {path} is missing; build it with jobs/draft_vocab.py "
                                "--heads DIR, or pass --draft-vocab 0 (the full vocabulary)")
    data = json.loads(path.read_text())
    if data.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: format_version {data.get('format_version')!r}, expected {FORMAT_VERSION}; "
                         "rebuild it with jobs/draft_vocab.py")
    ids = data["token_ids"]
    size = data["default_size"] if size is None else size
    if size > len(ids):
        raise ValueError(f"--draft-vocab {size}: {path} ranks only {len(ids)} tokens (the others never occur "
                         f"in the heads' training text); pass at most {len(ids)}, or 0 for the full vocabulary")
    return ids[:size]
