/* soft_moe_routing.h compiled for the compiler's baseline instruction set (SSE2 on x86-64): 4 float lanes
 * (see variant.h). */
#include "variant.h"
#define SOFTMOE_LANES 4
#define SOFTMOE_NS softmoe_portable
#include "soft_moe_routing.h"
