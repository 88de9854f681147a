from __future__ import annotations

import torch
from torch import nn

from calibrate.stats import ActivationStatsCollector, collect_stats, length_batches, pad_batch


class Toy(nn.Module):
    """embed → (q, k share an input) → out, like a decoder's fan-out; padding must not count."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 3)
        self.q = nn.Linear(3, 2)
        self.k = nn.Linear(3, 2)
        self.out = nn.Linear(2, 4)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        return self.out(self.q(h) + self.k(h))


def test_stats_match_hand_computation_and_ignore_padding() -> None:
    torch.manual_seed(0)
    model = Toy()
    sequences = [[1, 2, 3], [4, 5], [6]]
    collector = ActivationStatsCollector(model)
    input_ids, mask = pad_batch(sequences, pad_id=9)
    with torch.no_grad():
        model.embed.weight[9] = 100.0  # a padding row that would dominate abs-max if counted
    collector.collect(input_ids, mask)
    stats = collector.results()
    collector.close()

    tokens = torch.tensor([t for s in sequences for t in s])
    h = model.embed.weight.detach()[tokens]  # [6, 3]
    for name in ("q", "k"):
        assert stats[name].num_tokens == 6
        torch.testing.assert_close(stats[name].abs_max, h.abs().amax(0))
        torch.testing.assert_close(stats[name].mean_sq, (h**2).mean(0))
    qk = model.q(h) + model.k(h)
    torch.testing.assert_close(stats["out"].abs_max, qk.detach().abs().amax(0))
    torch.testing.assert_close(stats["out"].mean_sq, (qk.detach() ** 2).mean(0))
    assert not model.q._forward_pre_hooks


def test_batches_are_accumulated_exactly() -> None:
    torch.manual_seed(1)
    model = Toy()
    sequences = [[1, 2, 3, 4], [5], [6, 7], [8, 1, 2]]
    whole = collect_stats(model, sequences, pad_id=0, token_budget=1000)
    split = collect_stats(model, sequences, pad_id=0, token_budget=4)
    for name in whole:
        torch.testing.assert_close(whole[name].mean_sq, split[name].mean_sq)
        torch.testing.assert_close(whole[name].abs_max, split[name].abs_max)
        assert whole[name].num_tokens == split[name].num_tokens == 10


def test_length_batches_respect_budget() -> None:
    lengths = [5, 100, 30, 30, 7, 64]
    batches = list(length_batches(lengths, token_budget=100))
    assert sorted(i for b in batches for i in b) == list(range(6))
    for batch in batches:
        assert max(lengths[i] for i in batch) * len(batch) <= 100 or len(batch) == 1
