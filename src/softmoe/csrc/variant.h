/* Shared by the variant translation units (expert_matmul_<isa>.cpp, soft_moe_small_<isa>.cpp,
 * soft_moe_routing_<isa>.cpp).
 *
 * Each kernel source (expert_matmul.h, soft_moe_small.h, soft_moe_routing.h) is compiled three times, once per instruction set:
 * "avx512" (AVX-512 F/BW/DQ/VL and FMA, 16 float lanes), "avx2" (AVX2 and FMA, 8 lanes) and "portable" (the
 * compiler's baseline, e.g. SSE2 on x86-64, 4 lanes). A variant unit includes this header first, then raises the
 * instruction set with `#pragma GCC target` (push/pop), defines SOFTMOE_LANES and SOFTMOE_NS (its own namespace,
 * so that the three copies of every function are distinct symbols) and includes the kernel source.
 *
 * The ISA macros (__AVX512F__, __AVX2__, ...) are not used: g++ does not define them under `#pragma GCC target`
 * (gcc in C mode does). Every system header is included here, before the pragma, so that no inline function of a
 * library header is compiled for a wider instruction set and then shared with (linked into) the portable code.
 * bindings.cpp picks the variant at run time with __builtin_cpu_supports.
 */
#pragma once

#include <omp.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#define SOFTMOE_X86 1
#include <immintrin.h>
#else
#define SOFTMOE_X86 0
#endif
