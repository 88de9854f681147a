from __future__ import annotations

import torch

from calibrate.stats import collect_stats
from quantize.model.sources import load_model, resolve_model
from quantize.sequential.streamed import StreamedModel


def test_blockwise_stats_match_a_per_sequence_forward(tiny_llama) -> None:
    """An independent answer: hooks on the whole Hugging Face model, each sequence on its own (no packing), and
    the same numbers from the streamed model read block by block with sequences packed."""
    sequences = [[1, 20, 30, 40, 50], [1, 7, 8], [1, 9, 10, 11, 12, 13, 14], [1, 60]]
    model = load_model(resolve_model(str(tiny_llama)))
    inputs: dict[str, list[torch.Tensor]] = {}
    handles = [
        module.register_forward_pre_hook(lambda _m, args, n=name: inputs.setdefault(n, []).append(args[0][0]))
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and name != "lm_head"
    ]
    with torch.inference_mode():
        finals = [model.model(input_ids=torch.tensor([s])).last_hidden_state[0] for s in sequences]
    for handle in handles:
        handle.remove()
    inputs["lm_head"] = finals
    streamed = StreamedModel(tiny_llama)
    for budget in (1000, 8):  # one row, and one sequence per row
        stats = collect_stats(streamed, sequences, token_budget=budget)
        assert set(stats) == set(inputs) and streamed.peak_blocks == 1
        for name, xs in inputs.items():
            x = torch.cat(xs)
            assert stats[name].num_tokens == sum(len(s) for s in sequences) == x.shape[0]
            torch.testing.assert_close(stats[name].abs_max, x.abs().amax(0), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(stats[name].mean_sq, (x**2).mean(0), rtol=1e-4, atol=1e-6)
