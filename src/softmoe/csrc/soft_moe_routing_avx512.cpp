/* soft_moe_routing.h compiled for AVX-512 (F/BW/DQ/VL, FMA): 16 float lanes (see variant.h). */
#include "variant.h"
#if SOFTMOE_X86
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma")
#define SOFTMOE_LANES 16
#define SOFTMOE_NS softmoe_avx512
#include "soft_moe_routing.h"
#pragma GCC pop_options
#endif
