/* soft_moe_small.h compiled for the baseline instruction set (SSE2 on x86-64): 4 float lanes (see variant.h). */
#define SOFTMOE_KERNEL "soft_moe_small.h"
#define SOFTMOE_VARIANT SOFTMOE_PORTABLE
#include "variant.h"
