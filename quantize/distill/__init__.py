"""End-to-end distillation after quantization: the FP32 model's next-token distributions teach the quantized
model's scales (`settings.Distill`, the math of a learned scale in `scales`, the student model in `student`, the
training loop in `train`)."""

from quantize.distill.settings import Distill

__all__ = ["Distill"]
