"""Small-batch CPU kernels for the decode step, built on first use: weight-streaming matrix-vector products for
int8, bf16 and FP32 weights, paged decode attention, and RMSNorm.

Decoding a few sequences is a matrix-vector product per linear layer, bound by reading the weights. torch's CPU
paths for it read far below the memory bandwidth on AVX2 machines: `_weight_int8pack_mm` ~5 GB/s (it
converts the activations to bf16 and is compute-bound), MKL's FP32 GEMV for the LM head ~6 GB/s, bf16 `mm`
slower still, against ~17-20 GB/s that a plain `sum` reads on the same 2-core machine. `linear` streams each
weight row once for all rows of the activation (FP32, never rounded to bf16), widens int8/bf16 to FP32 in
registers, and splits the output rows over torch's own OpenMP threads (the extension links the libgomp torch
loaded). `decode_attention` reads each sequence's keys and values in place from the paged pool through its
slot list, instead of gathering a padded copy per layer for SDPA; `rms_norm` is one pass where torch's CPU
op runs ~8. Together they took the batch-1 int8 step from ~62 to ~41 ms and batch 16 from ~165 to ~133 ms.

The extension compiles once per machine and environment (~1 min, cached under qpack's user cache dir) and needs a
C++ compiler and an AVX2+FMA CPU. Nothing builds it behind a user's back: the serving engine calls `enable()`
at start-up (a server pays the minute once, before traffic); until then, and where the compiler or AVX2 is
missing or the build fails, `ready()` is False and the quantized modules keep torch's ops. Results differ
from torch's only by float summation order (and are closer to FP32 than `_weight_int8pack_mm`, which rounds
activations to bf16).
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

import torch

_log = logging.getLogger("qpack.native")

MAX_ROWS = 16  # activation rows routed here; measured faster than torch's paths up to 16 rows (2-core AVX2)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <immintrin.h>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 load8(const at::BFloat16* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline float scalar(float v) { return v; }
inline float scalar(int8_t v) { return static_cast<float>(v); }
inline float scalar(at::BFloat16 v) { return static_cast<float>(v); }

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// y[m, n] = sum_k x[m, k] * w[n, k] for MB activation rows; U independent accumulator chains per row.
template <typename W, int MB, int U>
inline void row_dot(const float* x, int64_t K, const W* w, float* out) {
  __m256 acc[MB][U];
  for (int j = 0; j < MB; ++j)
    for (int u = 0; u < U; ++u) acc[j][u] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 * U <= K; k += 8 * U) {
    for (int u = 0; u < U; ++u) {
      __m256 wv = load8(w + k + 8 * u);
      for (int j = 0; j < MB; ++j)
        acc[j][u] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + j * K + k + 8 * u), acc[j][u]);
    }
  }
  for (; k + 8 <= K; k += 8) {
    __m256 wv = load8(w + k);
    for (int j = 0; j < MB; ++j) acc[j][0] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + j * K + k), acc[j][0]);
  }
  for (int j = 0; j < MB; ++j) {
    for (int u = 1; u < U; ++u) acc[j][0] = _mm256_add_ps(acc[j][0], acc[j][u]);
    float s = hsum(acc[j][0]);
    for (int64_t t = k; t < K; ++t) s += x[j * K + t] * scalar(w[t]);
    out[j] = s;
  }
}

template <typename W>
void gemv(const float* x, int64_t M, int64_t K, const W* w, int64_t ldw, const float* scale,
          const float* bias, float* y, int64_t N) {
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    float out[8];
    for (int64_t n = begin; n < end; ++n) {
      const W* row = w + n * ldw;
      for (int64_t m = 0; m < M; m += 8) {
        int64_t mb = std::min<int64_t>(8, M - m);
        const float* xm = x + m * K;
        switch (mb) {
          case 1: row_dot<W, 1, 4>(xm, K, row, out); break;
          case 2: row_dot<W, 2, 2>(xm, K, row, out); break;
          case 3: row_dot<W, 3, 1>(xm, K, row, out); break;
          case 4: row_dot<W, 4, 1>(xm, K, row, out); break;
          case 5: row_dot<W, 5, 1>(xm, K, row, out); break;
          case 6: row_dot<W, 6, 1>(xm, K, row, out); break;
          case 7: row_dot<W, 7, 1>(xm, K, row, out); break;
          default: row_dot<W, 8, 1>(xm, K, row, out); break;
        }
        float s = scale ? scale[n] : 1.0f;
        float b = bias ? bias[n] : 0.0f;
        for (int64_t j = 0; j < mb; ++j) y[(m + j) * N + n] = out[j] * s + b;
      }
    }
  });
}

template <typename T>
inline float dot(const float* a, const T* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t e = 0;
  for (; e + 8 <= n; e += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + e), load8(b + e), acc);
  float s = hsum(acc);
  for (; e < n; ++e) s += a[e] * scalar(b[e]);
  return s;
}

// One query row per (sequence, head) against its context, read in place from the paged pool through the
// sequence's slot list: no gathered copy of K/V, no padding to the longest context.
template <typename T>
void paged_decode(const float* q, const T* k_cache, const T* v_cache, const int64_t* slots,
                  const int64_t* starts, const int64_t* lengths, float* out, int64_t D, int64_t H,
                  int64_t KVH, int64_t d, int64_t L, float scale) {
  const int64_t group = H / KVH, slot_stride = KVH * d;
  at::parallel_for(0, D * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc(d);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / H, head = task % H, kv = head / group;
      const int64_t first = starts[i], n = lengths[i] - first;
      const float* qh = q + (i * H + head) * d;
      const int64_t* row_slots = slots + i * L + first;
      scores.resize(n);
      float peak = -INFINITY;
      for (int64_t t = 0; t < n; ++t) {
        scores[t] = dot(qh, k_cache + row_slots[t] * slot_stride + kv * d, d) * scale;
        peak = std::max(peak, scores[t]);
      }
      float total = 0.f;
      for (int64_t t = 0; t < n; ++t) total += (scores[t] = std::exp(scores[t] - peak));
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < n; ++t) {
        const T* v = v_cache + row_slots[t] * slot_stride + kv * d;
        const float p = scores[t] / total;
        for (int64_t e = 0; e < d; ++e) acc[e] += p * scalar(v[e]);
      }
      std::copy(acc.begin(), acc.end(), out + (i * H + head) * d);
    }
  });
}

}  // namespace

// q [D, H, d] float32; k_cache, v_cache [slots, KVH, d] float32 or bfloat16; slots [D, L] int64 (each row
// the sequence's context slots in order); starts/lengths [D] int64 (keys starts[i]..lengths[i]-1 are attended,
// a sliding window moves starts) -> [D, H * d] float32.
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots,
                               torch::Tensor starts, torch::Tensor lengths, double scale) {
  RECORD_FUNCTION("qpack::paged_decode_attention", std::vector<c10::IValue>());
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q: [D, H, d] float32");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 3, "caches: [S, KVH, d]");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "caches: one dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.dim() == 2, "slots: [D, L]");
  int64_t D = q.size(0), H = q.size(1), d = q.size(2), KVH = k_cache.size(1), L = slots.size(1);
  TORCH_CHECK(k_cache.size(2) == d && H % KVH == 0 && slots.size(0) == D, "shapes");
  auto out = torch::empty({D, H * d}, q.options());
  auto st = starts.contiguous(), ln = lengths.contiguous();
  const int64_t *sp = slots.data_ptr<int64_t>(), *s0 = st.data_ptr<int64_t>(), *n = ln.data_ptr<int64_t>();
  switch (k_cache.scalar_type()) {
    case at::kFloat:
      paged_decode(q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), sp, s0, n,
                   out.data_ptr<float>(), D, H, KVH, d, L, static_cast<float>(scale));
      break;
    case at::kBFloat16:
      paged_decode(q.data_ptr<float>(), k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>(), sp,
                   s0, n, out.data_ptr<float>(), D, H, KVH, d, L, static_cast<float>(scale));
      break;
    default: TORCH_CHECK(false, "KV cache must be float32 or bfloat16");
  }
  return out;
}

// x [T, H] float32 -> x * rsqrt(mean(x^2) + eps) * weight, per row (Llama RMSNorm, float32 throughout).
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  RECORD_FUNCTION("qpack::rms_norm", std::vector<c10::IValue>());
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: [T, H] float32");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.numel() == x.size(1), "weight: [H] float32");
  const int64_t T = x.size(0), H = x.size(1);
  auto out = torch::empty_like(x);
  const float *xp = x.data_ptr<float>(), *w = weight.contiguous().data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* row = xp + t * H;
      const float inv = 1.0f / std::sqrt(dot(row, row, H) / static_cast<float>(H) + static_cast<float>(eps));
      for (int64_t e = 0; e < H; ++e) op[t * H + e] = row[e] * inv * w[e];
    }
  });
  return out;
}

// x [M, K] float32; weight [N, >= K] (float32, int8 or bfloat16, rows contiguous); scale [N] float32 or
// empty; bias [N] float32 or empty -> [M, N] float32.
torch::Tensor linear(torch::Tensor x, torch::Tensor weight, torch::Tensor scale, torch::Tensor bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: [M, K] float32");
  TORCH_CHECK(weight.dim() == 2 && weight.stride(1) == 1 && weight.size(1) >= x.size(1), "weight: [N, >=K]");
  int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const float* s = scale.numel() ? scale.data_ptr<float>() : nullptr;
  const float* b = bias.numel() ? bias.data_ptr<float>() : nullptr;
  TORCH_CHECK(!s || scale.numel() == N, "scale: [N]");
  TORCH_CHECK(!b || bias.numel() == N, "bias: [N]");
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  int64_t ld = weight.stride(0);
  switch (weight.scalar_type()) {
    case at::kFloat: {
      RECORD_FUNCTION("qpack::linear_fp32", std::vector<c10::IValue>());
      gemv(xp, M, K, weight.data_ptr<float>(), ld, s, b, yp, N);
      break;
    }
    case at::kChar: {
      RECORD_FUNCTION("qpack::linear_int8", std::vector<c10::IValue>());
      gemv(xp, M, K, weight.data_ptr<int8_t>(), ld, s, b, yp, N);
      break;
    }
    case at::kBFloat16: {
      RECORD_FUNCTION("qpack::linear_bf16", std::vector<c10::IValue>());
      gemv(xp, M, K, weight.data_ptr<at::BFloat16>(), ld, s, b, yp, N);
      break;
    }
    default: TORCH_CHECK(false, "weight must be float32, int8 or bfloat16");
  }
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &linear, "small-batch weight-streaming linear");
  m.def("decode_attention", &decode_attention, "paged attention of one new token per sequence");
  m.def("rms_norm", &rms_norm, "Llama RMSNorm over rows");
}
"""

_lock = threading.Lock()
_module: ModuleType | None = None
_failed: str | None = None


def _cpu_supported() -> bool:
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def enable() -> ModuleType | None:
    """Build (first time on this machine) and load the extension; None, with the reason logged and kept in
    `unavailable_reason()`, where it can't be."""
    global _module, _failed
    if _module is not None or _failed is not None:
        return _module
    with _lock:
        if _module is not None or _failed is not None:
            return _module
        if os.environ.get("QPACK_NATIVE", "1") == "0":
            _failed = "disabled by QPACK_NATIVE=0"
        elif not _cpu_supported():
            _failed = f"CPU capability {torch.backends.cpu.get_cpu_capability()} lacks AVX2"
        else:
            try:
                from torch.utils.cpp_extension import load_inline

                _ninja_on_path()
                name, folder = _build_folder()
                _module = load_inline(
                    name=name,
                    cpp_sources=[_SOURCE],
                    extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"],
                    extra_ldflags=["-fopenmp"],
                    build_directory=str(folder),
                    verbose=False,
                )
            except Exception as error:  # no compiler, no ninja, a build error: keep torch's kernels
                _failed = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        if _failed is not None:
            _log.info("native small-batch kernels unavailable (%s); using torch's", _failed)
        return _module


STALE_LOCK_S = 600.0  # a build takes ~1 min; a lock this old was left by a process killed mid-build


def _build_folder() -> tuple[str, Path]:
    """One build folder per (source, torch, Python environment): torch's build files name the environment's
    include paths, so two venvs sharing a folder would rebuild on every switch, each start holding the lock.
    A lock left by a process killed mid-build would make every later start wait forever: clear it when stale."""
    from quantize.models import cache_dir

    key = "\n".join((_SOURCE, torch.__version__, sys.prefix, torch.__file__))
    name = f"qpack_native_{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    folder = cache_dir() / "native" / name
    folder.mkdir(parents=True, exist_ok=True)
    lock = folder / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        age = 0.0
    if age > STALE_LOCK_S:
        _log.warning("removing a stale build lock (%.0f s old): %s", age, lock)
        lock.unlink(missing_ok=True)
    return name, folder


def _ninja_on_path() -> None:
    """torch builds with `ninja` from PATH; a venv's own ninja (the `ninja` wheel) is not on PATH when the venv's
    python is run without activating it."""
    import shutil

    scripts = os.path.dirname(sys.executable)
    if shutil.which("ninja") is None and os.path.exists(os.path.join(scripts, "ninja")):
        os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")


def ready() -> bool:
    """Whether `enable()` has loaded the kernels (never builds anything itself)."""
    return _module is not None


def takes(x: torch.Tensor) -> bool:
    """Whether `linear` serves these activation rows: kernels loaded, CPU, at most MAX_ROWS rows, no autograd
    (the kernels have no backward)."""
    return (
        _module is not None
        and x.device.type == "cpu"
        and x.shape[0] <= MAX_ROWS
        and not (torch.is_grad_enabled() and x.requires_grad)
    )


def unavailable_reason() -> str | None:
    return _failed


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] float32 @ weight[:, :K].T (float32/int8/bfloat16) * scale[N] + bias[N] -> [M, N] float32.
    Call only when `ready()`. Eager calls go straight to the extension (no dispatcher round trip: a decode
    step makes ~120 of them); inside torch.compile it is the opaque custom op `qpack::small_batch_linear`."""
    empty = x.new_empty(0)
    args = (
        x.contiguous(),
        weight,
        empty if scale is None else scale,
        empty if bias is None else bias.float(),
    )
    if torch.compiler.is_compiling():
        return _small_batch_linear(*args)
    module = _module
    assert module is not None, "native kernels are not loaded: call enable() first"
    return module.linear(*args)


@torch.library.custom_op("qpack::small_batch_linear", mutates_args=())
def _small_batch_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor
) -> torch.Tensor:
    module = _module
    assert module is not None, "native kernels are not loaded: call enable() first"
    return module.linear(x, weight, scale, bias)


@_small_batch_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    starts: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of one new token per sequence over its context, read in place from the paged KV pool.

    q [D, heads, d] float32; k_cache/v_cache [slots, kv_heads, d] float32 or bfloat16; slots [D, L] int64
    (row i: sequence i's context slots in order, padding beyond lengths[i] ignored); keys starts[i] ..
    lengths[i] - 1 are attended -> [D, heads * d] float32. Call only when `ready()`."""
    module = _module
    assert module is not None, "native kernels are not loaded: call enable() first"
    return module.decode_attention(q.contiguous(), k_cache, v_cache, slots, starts, lengths, scale)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama RMSNorm of x [T, H] float32 rows (torch's CPU `rms_norm` runs ~8 ops, ~50-90 us a call here).
    Call only when `ready()`."""
    module = _module
    assert module is not None, "native kernels are not loaded: call enable() first"
    return module.rms_norm(x.contiguous(), weight, eps)
