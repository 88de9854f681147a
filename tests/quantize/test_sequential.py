"""The block-at-a-time pass: packing, block-by-block runs equal to the whole model, Hessians, KL to a reference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from quantize.model.sources import load_model, resolve_model
from quantize.sensitivity.exact import kl_to_reference, reference_logits
from quantize.sequential.packing import common_prefix, make_packs, next_token_targets
from quantize.sequential.runner import BlockRunner


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])
@pytest.mark.parametrize("share", [False, True])
def test_packed_forward_equals_per_sequence_forward(
    fixture: str, share: bool, request: pytest.FixtureRequest
) -> None:
    model = load_model(resolve_model(str(request.getfixturevalue(fixture))))
    torch.manual_seed(0)
    prefix = torch.randint(3, 500, (7,))
    sequences = [torch.cat([prefix, torch.randint(3, 500, (n,))]) for n in (4, 11, 2, 19, 6)]
    packs = make_packs(sequences, 40, share_prefix=share)
    assert all(p.num_tokens <= 40 for p in packs)
    assert (packs[0].prefix == 7) == share
    represented = sum(p.represented_tokens for p in packs)
    assert represented == sum(len(s) for s in sequences)
    blocks = BlockRunner(model)
    seen = 0
    with torch.inference_mode():
        for pack in packs:
            hidden = blocks.final_hidden(pack)[0]
            start = pack.prefix
            for length in pack.lengths:
                ids = torch.cat([pack.input_ids[0, : pack.prefix], pack.input_ids[0, start : start + length]])
                expected = model.model(input_ids=ids[None]).last_hidden_state[0]
                torch.testing.assert_close(
                    hidden[start : start + length], expected[pack.prefix :], atol=1e-5, rtol=1e-4
                )
                torch.testing.assert_close(
                    hidden[: pack.prefix], expected[: pack.prefix], atol=1e-5, rtol=1e-4
                )
                start += length
                seen += 1
    assert seen == len(sequences)


def test_common_prefix_and_targets() -> None:
    a, b = torch.tensor([1, 2, 3, 4]), torch.tensor([1, 2, 3])
    assert common_prefix([a, b]) == 2  # each keeps at least one own token
    assert common_prefix([a]) == 0
    (pack,) = make_packs([torch.tensor([5, 6, 7]), torch.tensor([8, 9])], 10)
    assert next_token_targets(pack).tolist() == [6, 7, -1, 9, -1]


def test_kl_to_reference_matches_direct_kl(tiny_llama: Path) -> None:
    model = load_model(resolve_model(str(tiny_llama)))
    torch.manual_seed(1)
    reference = torch.randn(13, 64)
    for eps in (0.3, 1e-3):
        candidate = reference + eps * torch.randn(13, 64)
        kl = kl_to_reference(model.lm_head, reference_logits(model.lm_head, reference), candidate, chunk=5)
        p = torch.log_softmax(model.lm_head(reference).double(), -1)
        q = torch.log_softmax(model.lm_head(candidate).double(), -1)
        direct = (p.exp() * (p - q)).sum(-1)
        torch.testing.assert_close(kl.double(), direct, rtol=1e-2, atol=1e-8)
