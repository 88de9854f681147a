"""MMLU drift evaluation and quality gates: an artifact scored against its reference, question by question."""
