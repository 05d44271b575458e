// The fast layer's C++ kernels as one Python module (fast/kernels.py builds and loads it).
#include <torch/extension.h>

#include "kernels.h"

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
  m.def("lane_linear_available", &lane_linear_available, "built with AVX-512 VNNI");
  m.def("lane_linear", &lane_linear, "linear of several rows on Q4_0 (format 4), Q8_0 (8) or int8 row-scaled "
        "(1) weights, 16 weight rows at a time copied into the lanes, the input quantized per block of 32 "
        "to int8, VNNI dot products (optionally silu(gate) * up)", py::arg("x"), py::arg("weight"),
        py::arg("scale"), py::arg("bias") = py::none(), py::arg("format") = 4, py::arg("silu_mul") = false);
  py::class_<LayerWeights>(m, "LayerWeights", "what decode_layer reads of one decoder layer, kept")
      .def(py::init<std::vector<at::Tensor>, double, std::vector<int64_t>, std::vector<at::Tensor>,
                    std::vector<c10::optional<at::Tensor>>, std::vector<c10::optional<at::Tensor>>,
                    c10::optional<at::Tensor>, c10::optional<at::Tensor>, double, double>(),
           py::arg("norms"), py::arg("eps"), py::arg("kinds"), py::arg("weights"), py::arg("scales"),
           py::arg("biases"), py::arg("q_norm"), py::arg("k_norm"), py::arg("head_eps"), py::arg("scale"));
  m.def("decode_layer", &decode_layer, "a decode step's decoder layer: norm, qkv, heads' norm + RoPE, K/V "
        "written, decode attention, o, residual, norm, silu(gate) * up, down, residual; each linear by "
        "the kernel its kind names", py::arg("x"), py::arg("layer"), py::arg("cos"), py::arg("sin"),
        py::arg("pool_k"), py::arg("pool_v"), py::arg("slots"), py::arg("rows"), py::arg("tables"),
        py::arg("lo"), py::arg("hi"), py::arg("block_size"));
  m.def("rms_norm", &rms_norm, "RMSNorm of each row, rounded as model.RMSNorm",
        py::arg("x"), py::arg("weight"), py::arg("eps"));
  m.def("norm_rope", &norm_rope, "each head's optional RMSNorm, then rotate-half RoPE",
        py::arg("x"), py::arg("weight"), py::arg("eps"), py::arg("cos"), py::arg("sin"));
}
