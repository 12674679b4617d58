/* The elementwise part of the Soft MoE routing, forward and backward, one pass over each input: the kernel source of
 * softmoe::soft_moe_routing and its backward op, compiled once per instruction set by
 * soft_moe_routing_{avx512,avx2,portable}.cpp (see variant.h). bindings.cpp computes the products around it (x phi
 * forward; the gradients of x and phi backward) with torch's matmul or oneDNN's linear.
 *
 * For B inputs of M tokens x[b, t] and S slots, with P = x phi (B, M, S) and, with vmoe's normalization of the
 * tokens ("router"), r[b, t] = rsqrt(|x[b, t]|^2 + 1e-6) (else r = 1):
 *
 *   logits   = P r
 *   dispatch = softmax of logits over the M tokens         combine = softmax of logits over the S slots
 *
 * and backward, from the gradients gl, gd, gc of logits, dispatch and combine (each may be absent, i.e. zero):
 *
 *   g        = gl + dispatch (gd - sum over tokens of gd dispatch) + combine (gc - sum over slots of gc combine)
 *   gp       = g r,   dot[b, t] = sum over slots of g logits        ("router": grad_x = gp phi^T - r^2 dot x)
 *
 * The threads split the inputs; rows (slots) and columns (tokens) are walked with vectors along the slots.
 */
#if !defined(SOFTMOE_LANES) || !defined(SOFTMOE_NS)
#error "soft_moe_routing.h is included by a variant unit that defines SOFTMOE_LANES and SOFTMOE_NS (see variant.h)"
#endif

namespace SOFTMOE_NS {

#define LANES SOFTMOE_LANES
#include "vector_math.h"

#define ROUTING_EPS 1e-6f

static inline vec vmax(vec a, vec b) { return choose((ivec)(a > b), a, b); }

/* The lanes below n set (all ones). */
static inline ivec lanes_below(long n)
{
    ivec iota;
    for (int i = 0; i < LANES; i++) iota[i] = i;
    return iota < (int)n;
}

/* The first n < LANES floats at p, zeros after (masked loads where the instruction set has them); and back. */
static inline vec load_part(const float *p, long n)
{
#if SOFTMOE_X86 && LANES == 16
    return (vec)_mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p);
#elif SOFTMOE_X86 && LANES == 8
    return (vec)_mm256_maskload_ps(p, (__m256i)lanes_below(n));
#else
    vec v = {0};
    for (long i = 0; i < n; i++) v[i] = p[i];
    return v;
#endif
}

static inline void store_part(float *p, vec v, long n)
{
#if SOFTMOE_X86 && LANES == 16
    _mm512_mask_storeu_ps(p, (__mmask16)((1u << n) - 1), (__m512)v);
#elif SOFTMOE_X86 && LANES == 8
    _mm256_maskstore_ps(p, (__m256i)lanes_below(n), (__m256)v);
#else
    for (long i = 0; i < n; i++) p[i] = v[i];
#endif
}

/* Whole vectors, or the first `count` lanes. */
static inline vec load_n(const float *p, long count) { return count == LANES ? load(p) : load_part(p, count); }
static inline void store_n(float *p, vec v, long count)
{
    if (count == LANES)
        store(p, v);
    else
        store_part(p, v, count);
}

/* sum over i < n of a[i] b[i] in vectors (the compiler keeps a plain float sum in its order: one element at a time,
 * each addition waiting for the last) */
static inline float dot_n(const float *a, const float *b, long n)
{
    vec acc = {0};
    long i = 0;
    for (; i + LANES <= n; i += LANES) acc += load(a + i) * load(b + i);
    if (i < n) acc += load_part(a + i, n - i) * load_part(b + i, n - i);
    float sum = 0.0f;
    for (int l = 0; l < LANES; l++) sum += acc[l];
    return sum;
}

/* out[i * stride] = the softmax of in[i * stride] over i < n, for count <= LANES columns side by side. */
static void softmax_columns(float *out, const float *in, long n, long stride, long count)
{
    vec m = splat(-__builtin_inff()), sum = {0};
    for (long i = 0; i < n; i++) m = vmax(load_n(in + i * stride, count), m);
    for (long i = 0; i < n; i++) {
        const vec e = exp_nonpositive(load_n(in + i * stride, count) - m);
        sum += e;
        store_n(out + i * stride, e, count);
    }
    const vec inverse = 1.0f / sum;
    for (long i = 0; i < n; i++) store_n(out + i * stride, load_n(out + i * stride, count) * inverse, count);
}

/* out = the softmax of the n floats at in. */
static void softmax_row(float *out, const float *in, long n)
{
    vec mv = splat(-__builtin_inff()), sv = {0};
    for (long s = 0; s < n; s += LANES) {
        const long count = n - s < LANES ? n - s : LANES;
        mv = vmax(choose(lanes_below(count), load_n(in + s, count), splat(-__builtin_inff())), mv);
    }
    float m = mv[0], sum = 0.0f;
    for (int i = 1; i < LANES; i++) m = mv[i] > m ? mv[i] : m;
    for (long s = 0; s < n; s += LANES) {
        const long count = n - s < LANES ? n - s : LANES;
        const vec e = choose(lanes_below(count), exp_nonpositive(load_n(in + s, count) - m), vec{});
        sv += e;
        store_n(out + s, e, count);
    }
    for (int i = 0; i < LANES; i++) sum += sv[i];
    const vec inverse = splat(1.0f / sum);
    for (long s = 0; s < n; s += LANES) {
        const long count = n - s < LANES ? n - s : LANES;
        store_n(out + s, load_n(out + s, count) * inverse, count);
    }
}

/* logits (B, M, S) holds P on entry and the logits on return; r (B, M) gets rsqrt(|x|^2 + 1e-6) of the tokens of x
 * (B, M, D) when `router`, else ones. */
void soft_moe_routing_forward(float *logits, const float *x, float *dispatch, float *combine, float *r, long B,
                              long M, long S, long D, int router, int threads)
{
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long b = 0; b < B; b++) {
        float *lb = logits + b * M * S;
        for (long t = 0; t < M; t++) {
            float *row = lb + t * S;
            if (router) {
                const float *xt = x + (b * M + t) * D;
                const float rt = 1.0f / __builtin_sqrtf(dot_n(xt, xt, D) + ROUTING_EPS);
                r[b * M + t] = rt;
                for (long s = 0; s < S; s++) row[s] *= rt;
            } else {
                r[b * M + t] = 1.0f;
            }
            softmax_row(combine + (b * M + t) * S, row, S);
        }
        for (long s = 0; s < S; s += LANES)
            softmax_columns(dispatch + b * M * S + s, lb + s, M, S, S - s < LANES ? S - s : LANES);
    }
}

/* gl, gd, gc (B, M, S) or NULL; writes gp (B, M, S) and dot_out (B, M), the sums over slots of g logits. */
void soft_moe_routing_backward(const float *gl, const float *gd, const float *gc, const float *logits,
                               const float *dispatch, const float *combine, const float *r, float *gp, float *dot_out,
                               long B, long M, long S, int router, int threads)
{
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long b = 0; b < B; b++) {
        const long base = b * M * S;
        float *g = gp + base;
        for (long i = 0; i < M * S; i++) g[i] = gl ? gl[base + i] : 0.0f;
        if (gc)
            for (long t = 0; t < M; t++) {
                const float *c = combine + base + t * S, *gct = gc + base + t * S;
                const float dot = dot_n(gct, c, S);
                for (long s = 0; s < S; s++) g[t * S + s] += c[s] * (gct[s] - dot);
            }
        if (gd)
            for (long s = 0; s < S; s += LANES) {
                const long count = S - s < LANES ? S - s : LANES;
                const float *dsp = dispatch + base + s, *gds = gd + base + s;
                vec dot = {0};
                for (long t = 0; t < M; t++) dot += load_n(gds + t * S, count) * load_n(dsp + t * S, count);
                for (long t = 0; t < M; t++) {
                    const vec add = load_n(dsp + t * S, count) * (load_n(gds + t * S, count) - dot);
                    store_n(g + t * S + s, load_n(g + t * S + s, count) + add, count);
                }
            }
        for (long t = 0; t < M; t++) {
            const float *l = logits + base + t * S;
            dot_out[b * M + t] = dot_n(g + t * S, l, S);
            if (router)
                for (long s = 0; s < S; s++) g[t * S + s] *= r[b * M + t];
        }
    }
}

} /* namespace SOFTMOE_NS */
