"""Per-layer sensitivity: what each candidate scheme would cost each linear, in predicted KL.

`measure` chooses the method and drives it; `exact` measures KL with the layer quantized alone; `fisher`
estimates it from one forward and one backward pass; `table` holds the results, derives the values the planner
reads, and caches them beside the calibration data.
"""
