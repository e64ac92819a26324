#include "cpu/kernels.hpp"

namespace ep_moe {
namespace cpu {

const Kernels& kernels_for(Isa isa) {
#if defined(EP_MOE_X86_KERNELS)
  switch (isa) {
    case Isa::Avx512Bf16: return kernels_avx512bf16();
    case Isa::Avx512: return kernels_avx512();
    case Isa::Avx2: return kernels_avx2();
    case Isa::Generic: break;
  }
#else
  (void)isa;
#endif
  return kernels_generic();
}

}  // namespace cpu
}  // namespace ep_moe
