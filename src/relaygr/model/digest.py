"""A model's identity as a short hash: processes that must serve the same model compare it."""

from __future__ import annotations

import hashlib

import torch
from torch import nn


def model_digest(model: nn.Module) -> str:
    """A hash of the model's config (when it has one) and weights: equal iff two processes
    serve one model."""
    digest = hashlib.blake2b(repr(getattr(model, "cfg", None)).encode(), digest_size=16)
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        digest.update(flat.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
