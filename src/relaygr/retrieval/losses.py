"""SCCDR's losses on unit vectors. Each returns a scalar mean over its batch.

- matching: sampled softmax (positive against negatives shared by the batch) or BPR;
- intra-CL: BCE between two views of the same node (label 1) and of a shuffled node (label 0);
- inter-CL: the aligned-user InfoNCE (a user's vector in one domain against the same user in the
  partner domain and curriculum negatives there), and neighbour similarity (the user's vector
  against the mean of its partner-domain items).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def softmax_matching(users: torch.Tensor, positives: torch.Tensor, negatives: torch.Tensor,
                     temperature: float, pos_bias: torch.Tensor | float = 0.0,
                     neg_bias: torch.Tensor | float = 0.0) -> torch.Tensor:
    """``users``, ``positives``: ``(B, d)``; ``negatives``: ``(N, d)`` shared by the batch;
    biases (``(B,)``, ``(N,)``) are added to the logits after the temperature."""
    pos = (users * positives).sum(-1, keepdim=True) / temperature + (
        pos_bias[:, None] if isinstance(pos_bias, torch.Tensor) else pos_bias)   # (B, 1)
    neg = users @ negatives.T / temperature + neg_bias                          # (B, N)
    target = torch.zeros(len(users), dtype=torch.long)
    return F.cross_entropy(torch.cat([pos, neg], dim=1), target)


def bpr_matching(users: torch.Tensor, positives: torch.Tensor, negatives: torch.Tensor,
                 temperature: float, pos_bias: torch.Tensor | float = 0.0,
                 neg_bias: torch.Tensor | float = 0.0) -> torch.Tensor:
    """``negatives``: ``(B, d)``, one per positive; biases ``(B,)``."""
    diff = ((users * positives).sum(-1) - (users * negatives).sum(-1)) / temperature
    return F.softplus(-(diff + pos_bias - neg_bias)).mean()


def intra_bce(view1: torch.Tensor, view2: torch.Tensor, shuffled: torch.Tensor,
              temperature: float) -> torch.Tensor:
    """``view1[i]`` against ``view2[i]`` (positive) and ``view2[shuffled[i]]`` (negative)."""
    pos = (view1 * view2).sum(-1) / temperature
    neg = (view1 * view2[shuffled]).sum(-1) / temperature
    logits = torch.cat([pos, neg])
    labels = torch.cat([torch.ones_like(pos), torch.zeros_like(neg)])
    return F.binary_cross_entropy_with_logits(logits, labels)


def aligned_user(anchors: torch.Tensor, partners: torch.Tensor, negatives: torch.Tensor,
                 temperature: float) -> torch.Tensor:
    """InfoNCE: ``anchors``, ``partners``: ``(B, d)``; ``negatives``: ``(B, K, d)``."""
    pos = (anchors * partners).sum(-1, keepdim=True)                  # (B, 1)
    neg = torch.einsum("bd,bkd->bk", anchors, negatives)              # (B, K)
    logits = torch.cat([pos, neg], dim=1) / temperature
    return F.cross_entropy(logits, torch.zeros(len(anchors), dtype=torch.long))


def neighbour_similarity(anchors: torch.Tensor, neighbour_means: torch.Tensor) -> torch.Tensor:
    """``1 - cos`` between each anchor and the mean of its partner-domain item vectors."""
    return (1.0 - F.cosine_similarity(anchors, neighbour_means, dim=-1)).mean()
