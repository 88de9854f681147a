"""MMLU drift evaluation, quality gates, and the `qpack` command line (the top of the pipeline)."""
