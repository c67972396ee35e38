"""The oracle's mask of causal attention over packed sequences, for the float64 prefill oracles of the tests."""

import torch


def causal_visibility(q_offsets: list[int], k_offsets: list[int]) -> torch.Tensor:
    """[total_q, total_k]: query i of a sequence sees key j of the same sequence where j <= k_len - q_len + i (its
    queries are the last q_len of its k_len keys), entry by entry, the plainest way to say it."""
    visible = torch.zeros(q_offsets[-1], k_offsets[-1], dtype=torch.bool)
    for b in range(len(q_offsets) - 1):
        q_len, k_len = q_offsets[b + 1] - q_offsets[b], k_offsets[b + 1] - k_offsets[b]
        for i in range(q_len):
            for j in range(k_len):
                visible[q_offsets[b] + i, k_offsets[b] + j] = j <= k_len - q_len + i
    return visible
