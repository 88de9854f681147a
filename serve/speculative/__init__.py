"""Speculative decoding: propose several tokens cheaply, verify them in one step of the served model.

Batch-1 decode reads every weight once per token, so it runs at the memory-bandwidth ceiling whatever the
kernels do; verifying k proposed tokens as k+1 rows of one native step reads the weights once for up to k+1
tokens. The output must not change:
- greedy requests keep the served model's own greedy tokens: a proposal is kept only where it equals the
  target's argmax, and each verified row computes the same bits a one-token decode would (the fused native
  step's rows do not depend on the rows beside them), so the text is the same as without speculation;
- sampled requests use rejection sampling against a deterministic proposal, so every token's distribution is
  exactly the target's, drawn from the request's per-token seeded generator.

Modules: `ngram` (prompt lookup: proposals copied from the context itself), `draft` (a cheaper copy of the same
model, with its own KV pool), `verify` (acceptance: greedy and rejection sampling), `policy` (how many tokens to
propose, from which source, and when speculation is worth it at all; pure, tested without a model). The engine
(`serve/engine/core.py`) asks for proposals, the runner verifies them as extra rows of its step, and the scheduler
rolls the rejected tokens' blocks back.
"""
