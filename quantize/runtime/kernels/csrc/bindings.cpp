// Python bindings of the ops in ops.h.
#include <torch/python.h>

#include "amx.h"
#include "ops.h"

// The GIL is released while a kernel runs (as torch's own ops do): the serving engine steps in a background
// thread, and the HTTP event loop must keep answering during a 10-20 ms decode step.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using release = py::call_guard<py::gil_scoped_release>;
  m.def("linear", &qpack::linear, "small-batch weight-streaming linear", release());
  m.def("decode_attention", &qpack::decode_attention, "paged attention of one new token per sequence", release());
  m.def("rms_norm", &qpack::rms_norm, "Llama RMSNorm over rows", release());
  m.def("decode_layers", &qpack::decode_layers, "decoder layers of a decode step in one parallel region", release());
  m.def("dequantize_int4", &qpack::dequantize_int4, "int4 weights to float32 in one pass", release());
  m.def("peak_rate", &qpack::peak_rate, "multiply-adds per second of the int16-pair or fp32 FMA instruction", release());
  m.def("amx_enabled", &qpack::amx_enabled, "whether int8 prompt products run on AMX tiles");
  m.def("set_amx", &qpack::set_amx, "switch the AMX int8 GEMM on or off (where the CPU allows); whether it is on");
}
