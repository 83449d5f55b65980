"""entmtp-ray: Ray batch generation with entropy-guided Hydra tree speculative decoding (EntMTP).
The design: docs/design.md. Imports run config <- model <- decode <- calibrate <- pipeline <- train, bench."""
