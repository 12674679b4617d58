/* top_k_combine.h compiled for AVX-512 (F/BW/DQ/VL, FMA): 16 float lanes (see variant.h). */
#define SOFTMOE_KERNEL "top_k_combine.h"
#define SOFTMOE_VARIANT SOFTMOE_AVX512
#include "variant.h"
