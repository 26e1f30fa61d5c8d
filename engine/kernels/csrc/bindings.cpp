#include <torch/extension.h>

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor context_lens, double scale);
torch::Tensor paged_prefill(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                            torch::Tensor block_tables, torch::Tensor q_starts, torch::Tensor q_lens,
                            torch::Tensor ctx_lens, double scale);
bool has_paged_prefill();
torch::Tensor add_rms_norm(torch::Tensor x, c10::optional<torch::Tensor> delta, torch::Tensor weight, double eps);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention (CPU)");
  m.def("paged_prefill", &paged_prefill, "paged causal prefill attention (CPU, AVX-512)");
  m.def("has_paged_prefill", &has_paged_prefill, "whether paged_prefill was built (AVX-512)");
  m.def("add_rms_norm", &add_rms_norm, "optional residual add, then RMSNorm (CPU)");
}
