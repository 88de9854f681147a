"""Hadamard matrices for the sizes LLMs use, and the randomized orthogonal rotations built from them.

A Hadamard matrix H of order n has entries ±1 and H Hᵀ = n I, so H / √n is orthogonal and spreads any one channel
evenly over all n. Sylvester's construction gives every power of two; other widths (SmolLM2's 576 and 1,536, an
8B model's 14,336) need a factor that is not: n = 2^a · m, with m = q + 1 for a prime q ≡ 3 (mod 4), whose Paley
construction (Paley I) is a Hadamard matrix, and H_n = H_{2^a} ⊗ H_m. The factor chosen is the smallest such m,
since a fast transform costs n log 2^a + n·m. For example 576 = 8 · 72 (q = 71), 1,536 = 128 · 12 (q = 11),
14,336 = 64 · 224 (q = 223). A size with no such factor is refused rather than rotated by something slower.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class HadamardOrder:
    """n = power · paley: Sylvester's 2^a times Paley I's q + 1 (paley 1: a power of two alone)."""

    power: int
    paley: int

    @property
    def size(self) -> int:
        return self.power * self.paley

    def describe(self) -> str:
        return f"{self.power}" if self.paley == 1 else f"{self.power} x Paley({self.paley - 1})"


def _is_prime(q: int) -> bool:
    return q >= 2 and all(q % d for d in range(2, int(q**0.5) + 1))


def _is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def hadamard_order(n: int) -> HadamardOrder | None:
    """How a Hadamard matrix of order `n` is built here, None when it is not."""
    if n < 1:
        return None
    for m in range(1, n + 1):
        if n % m or not _is_power_of_two(n // m):
            continue
        if m == 1 or (m % 4 == 0 and _is_prime(m - 1) and (m - 1) % 4 == 3):
            return HadamardOrder(n // m, m)
    return None


def _sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def _paley(q: int) -> torch.Tensor:
    """Paley I: order q + 1 from the quadratic residues mod a prime q ≡ 3 (mod 4)."""
    residues = {(x * x) % q for x in range(1, q)}
    chi = torch.tensor([0.0] + [1.0 if a in residues else -1.0 for a in range(1, q)], dtype=torch.float64)
    index = (torch.arange(q)[None, :] - torch.arange(q)[:, None]) % q
    jacobsthal = chi[index]  # Q[i, j] = χ(j - i), skew-symmetric for q ≡ 3 (mod 4)
    s = torch.zeros(q + 1, q + 1, dtype=torch.float64)
    s[0, 1:] = 1.0
    s[1:, 0] = -1.0
    s[1:, 1:] = jacobsthal
    return s + torch.eye(q + 1, dtype=torch.float64)


def hadamard(n: int) -> torch.Tensor:
    """A Hadamard matrix of order `n` (float64, entries ±1); ValueError for an order not built here."""
    order = hadamard_order(n)
    if order is None:
        raise ValueError(
            f"no Hadamard matrix of order {n} is built here (it must be 2^a, or 2^a times q + 1 for a prime q = 3 "
            "mod 4)"
        )
    sylvester = _sylvester(order.power)
    return sylvester if order.paley == 1 else torch.kron(sylvester, _paley(order.paley - 1))


def random_hadamard(n: int, seed: int) -> torch.Tensor:
    """An orthogonal [n, n] float64 matrix: a Hadamard matrix with its rows' signs drawn from `seed`, over √n."""
    return random_signs(n, seed)[:, None] * hadamard(n) / n**0.5


def hadamard_rows(x: torch.Tensor) -> torch.Tensor:
    """x @ H for the Hadamard matrix H of order x.shape[-1] built here, in float64, without forming H: a fast
    Walsh–Hadamard transform over the power-of-two factor (n log 2^a additions) and a product with the Paley factor
    (x @ (A ⊗ B) = Aᵀ X B, and Sylvester's A is symmetric)."""
    n = x.shape[-1]
    order = hadamard_order(n)
    if order is None:
        raise ValueError(f"no Hadamard matrix of order {n} is built here")
    power, paley = order.power, order.paley
    y = x.to(torch.float64).reshape(-1, power, paley)
    half = 1
    while half < power:
        pairs = y.reshape(-1, power // (2 * half), 2, half, paley)
        y = torch.stack((pairs[:, :, 0] + pairs[:, :, 1], pairs[:, :, 0] - pairs[:, :, 1]), dim=2)
        half *= 2
    y = y.reshape(-1, power, paley)
    if paley > 1:
        y = y @ _paley(paley - 1)
    return y.reshape(x.shape)


def random_signs(n: int, seed: int) -> torch.Tensor:
    """±1 per channel (float64), drawn from `seed`: the randomization of `random_hadamard`."""
    signs = torch.randint(0, 2, (n,), generator=torch.Generator().manual_seed(seed), dtype=torch.int64)
    return 2.0 * signs.to(torch.float64) - 1.0
