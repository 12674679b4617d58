/* top_k_combine.h compiled for the baseline instruction set (SSE2 on x86-64): 4 float lanes (see variant.h). */
#define SOFTMOE_KERNEL "top_k_combine.h"
#define SOFTMOE_VARIANT SOFTMOE_PORTABLE
#include "variant.h"
