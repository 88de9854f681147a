"""How close a quantized model stays to its FP32 original on held-out user queries: next-token KL, top-1
agreement and perplexity of both.

`qpack quantize` measures it before writing an artifact (the manifest's `quality`), `qpack evaluate` again
against any reference. The reference side is computed once as final hidden states (far smaller than logits at
a 49k vocabulary), and logits of both sides are formed a chunk of positions at a time.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from quantize.config import HeldoutQuality
from quantize.io.calibration import CalibrationData
from quantize.sequential.packing import Pack, make_packs, next_token_targets, sample_sequences
from quantize.sequential.runner import BlockRunner


def eval_packs(calibration: CalibrationData, tokens: int, seed: int) -> list[Pack]:
    """About `tokens` held-out tokens, packed 512 to a row; the sample differs from the calibration one."""
    return make_packs(sample_sequences(calibration.heldout, tokens, seed + 1), 512)


@torch.inference_mode()
def reference_hidden(model: nn.Module, packs: list[Pack]) -> list[torch.Tensor]:
    """Final normed hidden states [tokens, hidden] of `model` on each pack, block by block (each block loaded
    once for all packs when the model is streamed)."""
    blocks = BlockRunner(model)
    hidden = blocks.run_blocks([blocks.embed(p) for p in packs], packs)
    out = [blocks.norm(h)[0] for h in hidden]
    blocks.forget_rope()
    return out


@torch.inference_mode()
def compare_to_reference(
    model: nn.Module,
    packs: list[Pack],
    reference: list[torch.Tensor],
    reference_head: nn.Module,
    chunk: int = 128,
) -> HeldoutQuality:
    """KL, top-1 agreement and perplexities of `model` against FP32 final hidden states on held-out packs."""
    candidate = reference_hidden(model, packs)
    return compare_hidden(packs, reference, candidate, reference_head, BlockRunner(model).lm_head, chunk)


@torch.inference_mode()
def compare_hidden(
    packs: list[Pack],
    reference: list[torch.Tensor],
    candidate: list[torch.Tensor],
    reference_head: nn.Module,
    candidate_head: nn.Module,
    chunk: int = 128,
) -> HeldoutQuality:
    """KL, top-1 agreement and perplexities from the two models' final normed hidden states on held-out packs.

    Logits are formed `chunk` positions at a time (a 49k vocabulary at 512 positions is 100 MB per copy).
    """
    kl, top1, nll_ref, nll_q = [], [], [], []
    for pack, ref, cand in zip(packs, reference, candidate, strict=True):
        targets = next_token_targets(pack)
        for part in range(0, pack.num_tokens, chunk):
            rows = slice(part, min(part + chunk, pack.num_tokens))
            ref_logp = torch.log_softmax(reference_head(ref[rows]).float(), -1)
            cand_logp = torch.log_softmax(candidate_head(cand[rows]).float(), -1)
            kl.append((ref_logp.exp() * (ref_logp - cand_logp)).sum(-1).clamp_min(0))
            top1.append(ref_logp.argmax(-1) == cand_logp.argmax(-1))
            t = targets[rows]
            valid = t >= 0
            idx = t.clamp_min(0)[:, None]
            nll_ref.append(-ref_logp.gather(1, idx)[:, 0][valid])
            nll_q.append(-cand_logp.gather(1, idx)[:, 0][valid])
            del ref_logp, cand_logp
    kl_all, nll_r, nll_c = torch.cat(kl), torch.cat(nll_ref), torch.cat(nll_q)
    return HeldoutQuality(
        tokens=int(kl_all.numel()),
        kl=float(kl_all.mean()),
        kl_p95=float(torch.quantile(kl_all, 0.95)),
        top1_agreement=float(torch.cat(top1).float().mean()),
        ppl_reference=float(math.exp(float(nll_r.mean()))),
        ppl=float(math.exp(float(nll_c.mean()))),
    )
