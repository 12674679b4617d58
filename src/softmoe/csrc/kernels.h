/* The entry points of every kernel variant (one namespace per instruction set; see variant.h), as bindings.cpp
 * calls them. All tensors are contiguous row-major float32 buffers; shapes are in the comments of
 * expert_matmul.h, soft_moe_small.h and soft_moe_routing.h. */
#pragma once

/* Up to this many slots the routing computes its products itself (dot products along dim up to half a vector of
 * slots, else from phi's rows, padded to this width: two vectors with AVX-512, four with AVX2, eight of SSE's), in
 * its passes over each input; from more, bindings.cpp runs them in MKL or oneDNN. */
#define SOFTMOE_ROUTING_SMALL_SLOTS 32

/* Up to this many slots (with `lanes` floats per vector) a small routing's products are dot products along dim, from
 * phi_n's columns as rows (S, D); from more, products from phi_n's rows padded to SOFTMOE_ROUTING_SMALL_SLOTS. */
#define SOFTMOE_ROUTING_DOT_SLOTS(lanes) ((lanes) == 16 ? 6 : (lanes) / 2)

/* Inputs of one expert whose slots run together when Algorithm 1's kept combine runs as the rows of each expert
 * (soft_moe_small.h; bindings.cpp's cost model counts its blocks): each weight vector loaded once for them. With
 * AVX-512's 32 registers 8 rows of 2 vectors of accumulators, else 4. */
#define SOFTMOE_MIXING_ROWS(lanes) ((lanes) == 16 ? 8 : 4)

#define SOFTMOE_DECLARE_KERNELS(ns)                                                                                  \
    namespace ns {                                                                                                    \
    void expert_matmul(const float *x, const float *w, const float *bias, float *out, long E, long M, long K, long N, \
                       int act, int threads);                                                                         \
    void expert_matmul_nt(const float *g, const float *w, float *out, long E, long M, long K, long N, int threads);  \
    void expert_matmul_tn(const float *xt, const float *g, float *out, long E, long M, long K, long N, int threads); \
    int soft_moe_small_lanes();                                                                                       \
    int soft_moe_small_forward(const float *x, const float *dispatch, const float *combine, const float *w1,         \
                               const float *b1, const float *w2, const float *b2, float *out, float *saved, long B,   \
                               long M, long S, long P, long Hd, long Dm, int keep, int skip_idle,                     \
                               const long *order, int threads);                                                      \
    void soft_moe_small_forward_pairs(const float *x, const float *dispatch, const float *combine, const float *w1,  \
                                      const float *b1, const float *w2, const float *b2, float *out, long B, long M,  \
                                      long S, long P, long Hd, long Dm, const long *first, const long *experts,       \
                                      int skip_idle, int threads);                                                     \
    void soft_moe_small_forward_rows(const float *x, const float *dispatch, const float *combine, const float *w1,   \
                                     const float *b1, const float *w2, const float *b2, float *out, long M, long S,    \
                                     long P, long Hd, long Dm, const long *order, const long *experts,                \
                                     const long *parts, long n_parts, int skip_idle, int threads);                    \
    int soft_moe_small_backward(const float *grad_out, const float *x, const float *dispatch, const float *combine,  \
                                const float *w1, const float *w2, const float *b2, const float *saved,               \
                                float *grad_x, float *grad_dispatch, float *grad_combine,                           \
                                float *grad_w1, float *grad_b1, float *grad_w2, float *grad_b2, long B, long M,      \
                                long S, long P, long Hd, long Dm, int keep, int threads);                             \
    void top_k_combine(const float *combine, float *kept, int64_t *selected, long B, long M, long S, long P, long k, \
                       int threads);                                                                                  \
    long top_k_scratch_bytes(long S, long P);                                                                         \
    void top_k_input(const float *cb, float *kept, int64_t *selected, uint64_t *slots, long M, long S, long P,      \
                     long k, void *scratch);                                                                          \
    void soft_moe_routing_forward(float *logits, const float *x, const float *phi_t, const float *phi_rows,        \
                                  float *dispatch, float *combine, float *r, long B, long M, long S, long D,          \
                                  int router, long P, long k, int64_t *selected, uint64_t *slots, int threads);      \
    void soft_moe_routing_backward(const float *gl, const float *gd, const float *gc, const float *logits,           \
                                   const float *dispatch, const float *combine, const float *r, float *gp,           \
                                   float *dot, const float *x, const float *phi_t, float *grad_x,                    \
                                   float *grad_phi_t, long B, long M, long S, long D, int router, int threads);      \
    }

SOFTMOE_DECLARE_KERNELS(softmoe_portable)
#if defined(__x86_64__) || defined(__i386__)
SOFTMOE_DECLARE_KERNELS(softmoe_avx2)
SOFTMOE_DECLARE_KERNELS(softmoe_avx512)
#endif
