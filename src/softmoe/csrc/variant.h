/* Shared by the variant translation units (expert_matmul_<isa>.cpp, soft_moe_small_<isa>.cpp,
 * soft_moe_routing_<isa>.cpp, top_k_combine_<isa>.cpp).
 *
 * Each kernel source (expert_matmul.h, soft_moe_small.h, soft_moe_routing.h, top_k_combine.h) is compiled three
 * times, once per instruction set: "avx512" (AVX-512 F/BW/DQ/VL and FMA, 16 float lanes), "avx2" (AVX2 and FMA, 8
 * lanes) and "portable" (the compiler's baseline, e.g. SSE2 on x86-64, 4 lanes). A variant unit defines
 * SOFTMOE_KERNEL (the kernel source's name) and SOFTMOE_VARIANT (SOFTMOE_AVX512, SOFTMOE_AVX2 or SOFTMOE_PORTABLE)
 * and includes this header, which includes the system headers, then raises the instruction set with `#pragma GCC
 * target` (push/pop), defines SOFTMOE_LANES and SOFTMOE_NS (the variant's own namespace, so that the three copies of
 * every function are distinct symbols) and includes the kernel source.
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

/* A thread's scratch memory, kept from one kernel call to the next (bindings.cpp): `bytes` aligned to 64 in the
 * calling thread's block `slot` (0, 1 or 2), valid until its next softmoe_scratch or softmoe_scratch_release of that
 * slot; the release frees a block only if it is larger than the blocks kept. */
void *softmoe_scratch(int slot, size_t bytes);
void softmoe_scratch_release(int slot);

#define SOFTMOE_AVX512 1
#define SOFTMOE_AVX2 2
#define SOFTMOE_PORTABLE 3

#if SOFTMOE_VARIANT == SOFTMOE_AVX512 && SOFTMOE_X86
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma")
#define SOFTMOE_LANES 16
#define SOFTMOE_NS softmoe_avx512
#include SOFTMOE_KERNEL
#pragma GCC pop_options
#elif SOFTMOE_VARIANT == SOFTMOE_AVX2 && SOFTMOE_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#define SOFTMOE_LANES 8
#define SOFTMOE_NS softmoe_avx2
#include SOFTMOE_KERNEL
#pragma GCC pop_options
#elif SOFTMOE_VARIANT == SOFTMOE_PORTABLE
#define SOFTMOE_LANES 4
#define SOFTMOE_NS softmoe_portable
#include SOFTMOE_KERNEL
#endif
