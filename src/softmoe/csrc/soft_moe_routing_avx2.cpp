/* soft_moe_routing.h compiled for AVX2 and FMA: 8 float lanes (see variant.h). */
#define SOFTMOE_KERNEL "soft_moe_routing.h"
#define SOFTMOE_VARIANT SOFTMOE_AVX2
#include "variant.h"
