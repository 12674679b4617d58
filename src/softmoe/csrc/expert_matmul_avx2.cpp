/* expert_matmul.h compiled for AVX2 and FMA: 8 float lanes (see variant.h). */
#define SOFTMOE_KERNEL "expert_matmul.h"
#define SOFTMOE_VARIANT SOFTMOE_AVX2
#include "variant.h"
