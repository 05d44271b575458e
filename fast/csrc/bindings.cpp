// The fast layer's C++ kernels as one Python module (fast/kernels.py builds and loads it).
#include <torch/extension.h>

at::Tensor decode_attention(at::Tensor q, at::Tensor pool_k, at::Tensor pool_v, at::Tensor rows,
                            at::Tensor tables, at::Tensor lo, at::Tensor hi, int64_t block_size,
                            double scale, at::Tensor out, bool vector);
bool prefill_attention_available();
at::Tensor prefill_attention(at::Tensor q, at::Tensor pool_k, at::Tensor pool_v, at::Tensor first_token,
                             at::Tensor starts, at::Tensor lengths, at::Tensor tables, int64_t block_size,
                             double scale, int64_t window, at::Tensor out);
at::Tensor shared_decode_attention(at::Tensor q, at::Tensor pool_k, at::Tensor pool_v, at::Tensor rows,
                                   at::Tensor tables, at::Tensor hi, int64_t shared_blocks, int64_t block_size,
                                   double scale, at::Tensor out);
bool small_linear_available();
at::Tensor small_linear(const at::Tensor& x, const at::Tensor& weight,
                        const c10::optional<at::Tensor>& bias, bool silu_mul);
bool int8_linear_available();
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                       const c10::optional<at::Tensor>& bias, bool silu_mul);
bool int8_tiles_available();
at::Tensor int8_tiles(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                      const c10::optional<at::Tensor>& bias, bool silu_mul);
at::Tensor int8_dequantize(const at::Tensor& weight, const at::Tensor& scale, at::ScalarType dtype);
bool block_linear_available();
at::Tensor block_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                        const c10::optional<at::Tensor>& bias, int64_t bits, bool silu_mul);
at::Tensor block_dequantize(const at::Tensor& weight, const at::Tensor& scale, int64_t bits, at::ScalarType dtype);
at::Tensor block_dequantize_panels(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                                   const c10::optional<at::Tensor>& bias, int64_t bits, bool silu_mul);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor norm_rope(const at::Tensor& x, const c10::optional<at::Tensor>& weight, double eps,
                     const at::Tensor& cos, const at::Tensor& sin);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "paged decode attention (one query per row)",
        py::arg("q"), py::arg("pool_k"), py::arg("pool_v"), py::arg("rows"), py::arg("tables"),
        py::arg("lo"), py::arg("hi"), py::arg("block_size"), py::arg("scale"), py::arg("out"),
        py::arg("vector") = true);
  m.def("prefill_attention_available", &prefill_attention_available, "built with AVX-512");
  m.def("prefill_attention", &prefill_attention, "paged prompt-chunk attention (causal, optional window)",
        py::arg("q"), py::arg("pool_k"), py::arg("pool_v"), py::arg("first_token"), py::arg("starts"),
        py::arg("lengths"), py::arg("tables"), py::arg("block_size"), py::arg("scale"), py::arg("window"),
        py::arg("out"));
  m.def("shared_decode_attention", &shared_decode_attention,
        "paged decode attention of rows that share their leading blocks (full attention)",
        py::arg("q"), py::arg("pool_k"), py::arg("pool_v"), py::arg("rows"), py::arg("tables"), py::arg("hi"),
        py::arg("shared_blocks"), py::arg("block_size"), py::arg("scale"), py::arg("out"));
  m.def("small_linear_available", &small_linear_available, "built with AVX-512 BF16");
  m.def("small_linear", &small_linear, "bfloat16 linear of a few rows (optionally silu(gate) * up)",
        py::arg("x"), py::arg("weight"), py::arg("bias") = py::none(), py::arg("silu_mul") = false);
  m.def("int8_linear_available", &int8_linear_available, "built with AVX-512 BF16");
  m.def("int8_linear", &int8_linear, "linear of a few bfloat16 rows on int8 weights with row scales "
        "(optionally silu(gate) * up)", py::arg("x"), py::arg("weight"), py::arg("scale"),
        py::arg("bias") = py::none(), py::arg("silu_mul") = false);
  m.def("int8_tiles_available", &int8_tiles_available, "built with AMX-BF16 and the tiles granted");
  m.def("int8_tiles", &int8_tiles, "linear of many bfloat16 rows on int8 weights with row scales, on AMX "
        "tiles (optionally silu(gate) * up)", py::arg("x"), py::arg("weight"), py::arg("scale"),
        py::arg("bias") = py::none(), py::arg("silu_mul") = false);
  m.def("int8_dequantize", &int8_dequantize, "int8 weight times its row scales, in bfloat16 or float32",
        py::arg("weight"), py::arg("scale"), py::arg("dtype"));
  m.def("block_linear_available", &block_linear_available, "built with AVX-512 VNNI");
  m.def("block_linear", &block_linear, "linear on Q4_0 (bits 4) or Q8_0 (bits 8) block weights, the input "
        "quantized per block of 32 to int8, VNNI dot products (optionally silu(gate) * up)", py::arg("x"),
        py::arg("weight"), py::arg("scale"), py::arg("bias") = py::none(), py::arg("bits") = 4,
        py::arg("silu_mul") = false);
  m.def("block_dequantize", &block_dequantize, "a Q4_0 / Q8_0 block weight in bfloat16 or float32",
        py::arg("weight"), py::arg("scale"), py::arg("bits"), py::arg("dtype"));
  m.def("block_dequantize_panels", &block_dequantize_panels, "linear on Q4_0 / Q8_0 block weights, "
        "dequantized a panel of rows at a time, one matmul each (optionally silu(gate) * up)", py::arg("x"),
        py::arg("weight"), py::arg("scale"), py::arg("bias") = py::none(), py::arg("bits") = 4,
        py::arg("silu_mul") = false);
  m.def("rms_norm", &rms_norm, "RMSNorm of each row, rounded as model.RMSNorm",
        py::arg("x"), py::arg("weight"), py::arg("eps"));
  m.def("norm_rope", &norm_rope, "each head's optional RMSNorm, then rotate-half RoPE",
        py::arg("x"), py::arg("weight"), py::arg("eps"), py::arg("cos"), py::arg("sin"));
}
