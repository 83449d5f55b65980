"""An engine as the one-machine CLI makes one: the plan resolved once for this process (assemble.resolve), then the
engine built from it (the engine never resolves)."""

from __future__ import annotations

from entmtp_ray.config import DecodingConfig, ModelConfig
from entmtp_ray.pipeline.assemble import resolve
from entmtp_ray.pipeline.engine import Engine


def make_engine(model_cfg: ModelConfig, decoding: DecodingConfig, bank=None, bank_label: str | None = None,
                **kwargs) -> Engine:
    """Engine(model_cfg, resolve(model_cfg, decoding, bank=..., bank_label=...), **kwargs)."""
    return Engine(model_cfg, resolve(model_cfg, decoding, bank=bank, bank_label=bank_label), **kwargs)
