/* expert_matmul.h compiled for the baseline instruction set (SSE2 on x86-64): 4 float lanes (see variant.h). */
#define SOFTMOE_KERNEL "expert_matmul.h"
#define SOFTMOE_VARIANT SOFTMOE_PORTABLE
#include "variant.h"
