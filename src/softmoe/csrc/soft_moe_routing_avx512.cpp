/* soft_moe_routing.h compiled for AVX-512 (F/BW/DQ/VL, FMA): 16 float lanes (see variant.h). */
#define SOFTMOE_KERNEL "soft_moe_routing.h"
#define SOFTMOE_VARIANT SOFTMOE_AVX512
#include "variant.h"
