"""Pictures and tables of a plan: the layer x scheme sensitivity heatmap saved in every artifact.

Sensitivity is what justifies a mixed-precision plan, so the artifact carries it as a picture a reviewer can
read in a pull request: one panel per candidate scheme (blocks down, linear types across, log10 of predicted
KL), and one panel with the scheme each layer got.
"""

from __future__ import annotations

import io
import math
from typing import Any

from quantize.formats.schemes import Scheme
from quantize.planning.plan import Plan, block_index, short_name
from quantize.sensitivity.table import SensitivityTable

LINEAR_ORDER = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def grid(plan: Plan) -> tuple[list[int], list[str]]:
    decoder = [f for f in plan.schemes if f.startswith(("model.layers.", "layers."))]
    blocks = sorted({block_index(f) for f in decoder})
    names = [n for n in LINEAR_ORDER if any(short_name(f) == n for f in decoder)]
    names += sorted({short_name(f) for f in decoder} - set(names))
    return blocks, names


def heatmap_png(plan: Plan, table: SensitivityTable | None, candidates: list[Scheme]) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    blocks, names = grid(plan)
    by_position = {
        (block_index(f), short_name(f)): f for f in plan.schemes if f.startswith(("model.layers.", "layers."))
    }
    panels = len(candidates) + 1 if table is not None else 1
    fig, axes = plt.subplots(1, panels, figsize=(2.2 + 2.4 * panels, 1.5 + 0.22 * len(blocks)), squeeze=False)
    unit = "log10 KL" if table is None or table.method != "mse" else "log10 rel. output error"
    image = None
    if table is not None:
        values = []
        for scheme in candidates:
            matrix = np.full((len(blocks), len(names)), np.nan)
            for i, b in enumerate(blocks):
                for j, n in enumerate(names):
                    fqn = by_position.get((b, n))
                    if fqn is None:
                        continue
                    try:
                        value, _how = table.value(fqn, scheme)
                    except KeyError:
                        continue
                    matrix[i, j] = math.log10(max(value, 1e-12))
            values.append(matrix)
        finite = [m[np.isfinite(m)] for m in values if np.isfinite(m).any()]
        low = min((float(v.min()) for v in finite), default=-8.0)
        high = max((float(v.max()) for v in finite), default=0.0)
        for ax, scheme, matrix in zip(axes[0], candidates, values, strict=False):
            image = ax.imshow(matrix, aspect="auto", cmap="magma_r", vmin=low, vmax=high)
            ax.set_title(scheme.label(), fontsize=9)
    labels = sorted({s.label() if s else "fp32" for s in plan.schemes.values()})
    codes = {label: index for index, label in enumerate(labels)}
    chosen = np.full((len(blocks), len(names)), np.nan)
    for i, b in enumerate(blocks):
        for j, n in enumerate(names):
            fqn = by_position.get((b, n))
            if fqn is not None:
                kept = plan.schemes[fqn]
                chosen[i, j] = codes[kept.label() if kept else "fp32"]
    ax = axes[0][-1]
    cmap = plt.get_cmap("tab10", max(len(labels), 1))
    ax.imshow(chosen, aspect="auto", cmap=cmap, vmin=-0.5, vmax=len(labels) - 0.5)
    ax.set_title("plan", fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=cmap(codes[label])) for label in labels]
    ax.legend(handles, labels, fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    for axis in axes[0]:
        axis.set_xticks(range(len(names)))
        axis.set_xticklabels([n.replace("_proj", "") for n in names], rotation=90, fontsize=7)
        axis.set_yticks(range(len(blocks)))
        axis.set_yticklabels([str(b) for b in blocks], fontsize=6)
    axes[0][0].set_ylabel("decoder block")
    if image is not None:
        fig.colorbar(image, ax=list(axes[0][:-1]), shrink=0.8, label=unit)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return buffer.getvalue()


def plan_rows(plan: Plan) -> list[dict[str, Any]]:
    """One row per decoder block: the scheme label of each linear type (for the CLI table)."""
    blocks, names = grid(plan)
    by_position = {
        (block_index(f), short_name(f)): f for f in plan.schemes if f.startswith(("model.layers.", "layers."))
    }
    rows = []
    for b in blocks:
        row: dict[str, Any] = {"block": b}
        for n in names:
            fqn = by_position.get((b, n))
            scheme = plan.schemes.get(fqn) if fqn else None
            row[n] = "-" if fqn is None else (scheme.label() if scheme else "fp32")
        rows.append(row)
    return rows
