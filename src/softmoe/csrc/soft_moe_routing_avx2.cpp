/* soft_moe_routing.h compiled for AVX2 and FMA: 8 float lanes (see variant.h). */
#include "variant.h"
#if SOFTMOE_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#define SOFTMOE_LANES 8
#define SOFTMOE_NS softmoe_avx2
#include "soft_moe_routing.h"
#pragma GCC pop_options
#endif
