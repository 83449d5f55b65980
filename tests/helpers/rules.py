"""The acceptance rules' tensor parts read back to the host, for tests that check them on made-up trees and logits
(the product reads each step back once, in decode/acceptance.py's `accept`)."""

from __future__ import annotations

import torch

from entmtp_ray.config import TYPICAL_ALPHA, TYPICAL_EPSILON
from entmtp_ray.decode.acceptance import greedy_path, sample_token, typical_path


def greedy_accept(tokens: torch.Tensor, logits: torch.Tensor, row_of_node: torch.Tensor,
                  retrieve: torch.Tensor) -> torch.Tensor:
    """greedy_path's accepted node indices [a], root first."""
    best, length = greedy_path(tokens, logits, row_of_node, retrieve)
    return retrieve[int(best), : int(length) + 1]


def typical_accept(tokens: torch.Tensor, logits: torch.Tensor, row_of_node: torch.Tensor, retrieve: torch.Tensor,
                   temperature: float, epsilon: float = TYPICAL_EPSILON, alpha: float = TYPICAL_ALPHA) -> torch.Tensor:
    """typical_path's accepted node indices [a], root first."""
    best, length = typical_path(tokens, logits, row_of_node, retrieve, temperature, epsilon, alpha)
    return retrieve[int(best), : int(length) + 1]


def next_token(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    """sample_token, read back."""
    return int(sample_token(logits, temperature, generator))
