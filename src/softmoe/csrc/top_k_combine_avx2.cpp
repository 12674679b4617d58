/* top_k_combine.h compiled for AVX2 and FMA: 8 float lanes (see variant.h). */
#define SOFTMOE_KERNEL "top_k_combine.h"
#define SOFTMOE_VARIANT SOFTMOE_AVX2
#include "variant.h"
