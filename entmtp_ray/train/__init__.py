"""Training Hydra heads on the frozen base model, and evaluating them (per-head top-1, tau per task)."""
