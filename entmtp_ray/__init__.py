"""entmtp-ray: Ray batch generation with entropy-guided Hydra tree speculative decoding (EntMTP).
The design: docs/design.md. Imports run config <- model <- decode <- calibrate <- pipeline <- train, bench.

    from entmtp_ray import build_processor, ProcessorConfig   # the generation stage for a Ray Data pipeline
"""

__all__ = ["build_processor", "ProcessorConfig"]


def __getattr__(name):  # lazy: importing the package (or its config) loads no framework
    if name == "build_processor":
        from entmtp_ray.pipeline.processor import build_processor

        return build_processor
    if name == "ProcessorConfig":
        from entmtp_ray.config import ProcessorConfig

        return ProcessorConfig
    raise AttributeError(f"module 'entmtp_ray' has no attribute {name!r}")
