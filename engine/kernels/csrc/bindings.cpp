#include <torch/extension.h>

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor context_lens, double scale);
torch::Tensor paged_prefill(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                            torch::Tensor block_tables, torch::Tensor q_starts, torch::Tensor q_lens,
                            torch::Tensor ctx_lens, double scale);
bool has_paged_prefill();
torch::Tensor add_rms_norm(torch::Tensor x, c10::optional<torch::Tensor> delta, torch::Tensor weight, double eps);
bool has_fused_bf16();
torch::Tensor argmax_rows(torch::Tensor logits);
#if defined(__AVX512F__)
std::vector<torch::Tensor> rope_and_cache(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin,
                                          torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots,
                                          int64_t num_heads, int64_t num_kv_heads);
torch::Tensor silu_mul(torch::Tensor gate_up);
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention (CPU)");
  m.def("paged_prefill", &paged_prefill, "paged causal prefill attention (CPU, AVX-512)");
  m.def("has_paged_prefill", &has_paged_prefill, "whether paged_prefill was built (AVX-512)");
  m.def("add_rms_norm", &add_rms_norm, "optional residual add, then RMSNorm (CPU)");
  m.def("argmax_rows", &argmax_rows, "first index of each row's maximum (CPU, float32, bf16 or fp16)");
  m.def("has_fused_bf16", &has_fused_bf16, "whether rope_and_cache and silu_mul were built (AVX-512, bf16)");
#if defined(__AVX512F__)
  m.def("rope_and_cache", &rope_and_cache, "rotary on q, k + K/V cache write (CPU, bf16)");
  m.def("silu_mul", &silu_mul, "SiLU(gate) * up (CPU, bf16)");
#endif
}
