// torch.autocast("sim"): PyTorch registers autocast kernels for its own backends only, so without
// these the AutocastPrivateUse1 key has no kernel at all and every op under autocast fails. The sim
// device stands in for a GPU, so it casts what CUDA's autocast casts (the op lists PyTorch shares
// with other backends), in the dtype torch.get_autocast_dtype("sim") names (float16 by default).
#include "extra_kernels.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>

namespace torch_pipeline {
namespace sim {

void register_autocast() {
  auto* all = new torch::Library(torch::Library::IMPL, "_", c10::DispatchKey::AutocastPrivateUse1,
                                 __FILE__, __LINE__);
  all->fallback(torch::CppFunction::makeFallthrough());

  auto* lib = new torch::Library(torch::Library::IMPL, "aten",
                                 c10::DispatchKey::AutocastPrivateUse1, __FILE__, __LINE__);
  torch::Library& m = *lib;  // the KERNEL macros register on `m`
  using namespace at;        // and name Tensor, Scalar, ScalarType, IntArrayRef unqualified
#define SIM_LOWER_PRECISION_FP(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, lower_precision_fp)
#define SIM_FP32(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32)
#define SIM_FP32_SET_OPT_DTYPE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32_set_opt_dtype)
#define SIM_PROMOTE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, promote)
  AT_FORALL_LOWER_PRECISION_FP(SIM_LOWER_PRECISION_FP)
  AT_FORALL_FP32(SIM_FP32)
  AT_FORALL_FP32_SET_OPT_DTYPE(SIM_FP32_SET_OPT_DTYPE)
  AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE(KERNEL_DIFFERENT_REDISPATCH_SIGNATURE_PRIVATEUSEONE)
  AT_FORALL_PROMOTE(SIM_PROMOTE)
#undef SIM_LOWER_PRECISION_FP
#undef SIM_FP32
#undef SIM_FP32_SET_OPT_DTYPE
#undef SIM_PROMOTE
}

}  // namespace sim
}  // namespace torch_pipeline
