"""The base model and its heads: loading (the only caller of from_pretrained), the Llama forward over our
KV cache, the CPU kernel choices, and Hydra heads with their checkpoint formats. No trees, no policies."""
