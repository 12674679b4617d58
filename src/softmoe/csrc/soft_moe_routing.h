/* The elementwise part of the Soft MoE routing, forward and backward, one pass over each input: the kernel source of
 * softmoe::soft_moe_routing and its backward op, compiled once per instruction set by
 * soft_moe_routing_{avx512,avx2,portable}.cpp (see variant.h). The products around it (x phi forward; the gradients
 * of x and phi backward) are computed here, in the same passes, up to SOFTMOE_ROUTING_SMALL_SLOTS slots (kernels.h);
 * with more, bindings.cpp computes them with torch's matmul or oneDNN's linear.
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
 * The threads split the inputs; each input's (M, S) block is walked in rows of vectors along the slots: three passes
 * forward (the logits with the rows' and columns' maxima; both softmaxes' exponentials, two independent chains in
 * one loop; their normalization), two backward (the sums over slots and over tokens; g). */
#if !defined(SOFTMOE_LANES) || !defined(SOFTMOE_NS)
#error "soft_moe_routing.h is included by a variant unit that defines SOFTMOE_LANES and SOFTMOE_NS (see variant.h)"
#endif

#include "kernels.h" /* SOFTMOE_ROUTING_SMALL_SLOTS */

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

/* v with each lane swapped with the lane `distance` away (a power of two below LANES). */
static inline vec swapped(vec v, int distance)
{
    ivec iota;
    for (int i = 0; i < LANES; i++) iota[i] = i;
    return __builtin_shuffle(v, iota ^ distance);
}

/* The sum of the lanes of v, and their maximum: log2 LANES shuffles in registers, every lane ending with the
   result (lane by lane, the compiler went through memory, a store then scalar loads that waited on it). */
static inline float lane_sum(vec v)
{
    for (int distance = LANES / 2; distance > 0; distance /= 2) v += swapped(v, distance);
    return v[0];
}

static inline float lane_max(vec v)
{
    for (int distance = LANES / 2; distance > 0; distance /= 2) v = vmax(v, swapped(v, distance));
    return v[0];
}

/* rsqrt(|x|^2 + 1e-6) for the n floats at x: four partial sums, so that the adds do not wait on each other. */
static inline float inverse_norm(const float *x, long n)
{
    vec acc[4] = {{0}};
    long i = 0;
    for (; i + 4 * LANES <= n; i += 4 * LANES)
        for (int a = 0; a < 4; a++) acc[a] += load(x + i + a * LANES) * load(x + i + a * LANES);
    for (; i + LANES <= n; i += LANES) acc[0] += load(x + i) * load(x + i);
    if (i < n) acc[1] += load_part(x + i, n - i) * load_part(x + i, n - i);
    return 1.0f / __builtin_sqrtf(lane_sum((acc[0] + acc[1]) + (acc[2] + acc[3])) + ROUTING_EPS);
}

/* ---- the products of small routings (S <= SOFTMOE_ROUTING_SMALL_SLOTS), a few tokens at a time ---------------- */

#define SMALL SOFTMOE_ROUTING_SMALL_SLOTS
#define SMALL_VECS (SMALL / LANES) /* vectors per row of phi, padded to SMALL slots */
#define TOKEN_BLOCK 4              /* tokens of an input whose products run together */
#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* lb[t * S + s] = sum_d xb[t * D + d] rows[d * SMALL + s] for the TB tokens from t0 and s < S: the first NV
   vectors of phi's row d (as many as S needs), each token's element broadcast to them. With one vector per row,
   even and odd d go to two sets of sums (TB chains of dependent multiply-adds left the FMA units half idle). */
ALWAYS_INLINE void block_logits(float *lb, const float *xb, const float *rows, long t0, long S, long D, const int TB,
                                const int NV)
{
    const int sets = NV == 1 ? 2 : 1;
    vec acc[2][TOKEN_BLOCK][SMALL_VECS] = {};
    long d = 0;
    for (; d + sets <= D; d += sets)
        for (int k = 0; k < sets; k++) {
            vec p[SMALL_VECS];
            for (int v = 0; v < NV; v++) p[v] = load(rows + (d + k) * SMALL + v * LANES);
            for (int t = 0; t < TB; t++) {
                const float e = xb[(t0 + t) * D + d + k];
                for (int v = 0; v < NV; v++) acc[k][t][v] += e * p[v];
            }
        }
    for (; d < D; d++)
        for (int t = 0; t < TB; t++)
            for (int v = 0; v < NV; v++) acc[0][t][v] += xb[(t0 + t) * D + d] * load(rows + d * SMALL + v * LANES);
    for (int t = 0; t < TB; t++)
        for (int v = 0; v < NV; v++) {
            const vec sum = sets == 2 ? acc[0][t][v] + acc[1][t][v] : acc[0][t][v];
            store_n(lb + (t0 + t) * S + v * LANES, sum, S - v * LANES < LANES ? S - v * LANES : LANES);
        }
}

/* Tokens per block with NV vectors per row of phi: as many as leave their sums, the row and a token's element in
   the vector registers (32 with AVX-512, 16 with AVX2 and SSE), at most TOKEN_BLOCK. Four tokens of four AVX2
   vectors (25-32 slots) spilled their sums, and the op forward then lost to MKL's product (two tokens did not). */
ALWAYS_INLINE int token_block(const int NV)
{
    const int fit = ((LANES == 16 ? 32 : 16) - 1 - NV) / NV;
    return fit > TOKEN_BLOCK ? TOKEN_BLOCK : fit < 1 ? 1 : fit;
}

ALWAYS_INLINE void tokens_logits(float *lb, const float *xb, const float *rows, long M, long S, long D, const int NV)
{
    const int TB = token_block(NV);
    long t0 = 0;
    for (; t0 + TB <= M; t0 += TB) block_logits(lb, xb, rows, t0, S, D, TB, NV);
    switch (M - t0) {
    case 1: block_logits(lb, xb, rows, t0, S, D, 1, NV); break;
    case 2: block_logits(lb, xb, rows, t0, S, D, 2, NV); break;
    case 3: block_logits(lb, xb, rows, t0, S, D, 3, NV); break;
    }
}

/* The product x phi of one input's M tokens xb into lb (M, S), phi given as `rows` (D, SMALL): phi's columns, zeros
   past S. */
static void input_logits(float *lb, const float *xb, const float *rows, long M, long S, long D)
{
    switch ((S + LANES - 1) / LANES) {
    case 1: tokens_logits(lb, xb, rows, M, S, D, 1); break;
#if SMALL_VECS >= 2
    case 2: tokens_logits(lb, xb, rows, M, S, D, 2); break;
#endif
#if SMALL_VECS >= 4
    case 3: tokens_logits(lb, xb, rows, M, S, D, 3); break;
    case 4: tokens_logits(lb, xb, rows, M, S, D, 4); break;
#endif
#if SMALL_VECS >= 8
    case 5: tokens_logits(lb, xb, rows, M, S, D, 5); break;
    case 6: tokens_logits(lb, xb, rows, M, S, D, 6); break;
    case 7: tokens_logits(lb, xb, rows, M, S, D, 7); break;
    case 8: tokens_logits(lb, xb, rows, M, S, D, 8); break;
#endif
    }
}

/* Up to DOT_SLOTS slots the logits are dot products along dim instead: (S + 1) / LANES of a multiply-add per token
   and element of dim against the rows' 1 + 1 / LANES (a vector of phi's row per element, mostly padding), and S
   sums across lanes per token. The fewer the slots, the more this saves; past DOT_SLOTS the gain fades and the lane
   sums take over (docs/performance.md has the measurements). */
#define DOT_SLOTS SOFTMOE_ROUTING_DOT_SLOTS(LANES)

/* lb[t * S + s] = sum_d xb[t * D + d] phi_t[s * D + d] for the TB tokens from t0, phi_t (S, D): TB * S sums, one
   vector each, chains of multiply-adds that do not wait on each other. */
ALWAYS_INLINE void block_dots(float *lb, const float *xb, const float *phi_t, long t0, long D, const int TB,
                              const int S)
{
    vec acc[TOKEN_BLOCK][DOT_SLOTS] = {};
    long d = 0;
    for (; d + LANES <= D; d += LANES) {
        vec p[DOT_SLOTS];
        for (int s = 0; s < S; s++) p[s] = load(phi_t + s * D + d);
        for (int t = 0; t < TB; t++) {
            const vec xv = load(xb + (t0 + t) * D + d);
            for (int s = 0; s < S; s++) acc[t][s] += xv * p[s];
        }
    }
    if (d < D)
        for (int t = 0; t < TB; t++) {
            const vec xv = load_part(xb + (t0 + t) * D + d, D - d);
            for (int s = 0; s < S; s++) acc[t][s] += xv * load_part(phi_t + s * D + d, D - d);
        }
    for (int t = 0; t < TB; t++)
        for (int s = 0; s < S; s++) lb[(t0 + t) * S + s] = lane_sum(acc[t][s]);
}

/* Tokens per block with S sums each: as many as leave the sums, phi's S vectors and a token's vector in the
   registers (32 with AVX-512, 16 with AVX2 and SSE), at most TOKEN_BLOCK. */
ALWAYS_INLINE int dot_token_block(const int S)
{
    const int fit = ((LANES == 16 ? 32 : 16) - 1 - S) / S;
    return fit > TOKEN_BLOCK ? TOKEN_BLOCK : fit < 1 ? 1 : fit;
}

ALWAYS_INLINE void tokens_dots(float *lb, const float *xb, const float *phi_t, long M, long D, const int S)
{
    const int TB = dot_token_block(S);
    long t0 = 0;
    for (; t0 + TB <= M; t0 += TB) block_dots(lb, xb, phi_t, t0, D, TB, S);
    switch (M - t0) {
    case 1: block_dots(lb, xb, phi_t, t0, D, 1, S); break;
    case 2: block_dots(lb, xb, phi_t, t0, D, 2, S); break;
    case 3: block_dots(lb, xb, phi_t, t0, D, 3, S); break;
    }
}

/* The product x phi of one input's M tokens xb into lb (M, S <= DOT_SLOTS), phi given as phi_t (S, D). */
static void input_dots(float *lb, const float *xb, const float *phi_t, long M, long S, long D)
{
    switch (S) {
    case 1: tokens_dots(lb, xb, phi_t, M, D, 1); break;
    case 2: tokens_dots(lb, xb, phi_t, M, D, 2); break;
#if DOT_SLOTS >= 4
    case 3: tokens_dots(lb, xb, phi_t, M, D, 3); break;
    case 4: tokens_dots(lb, xb, phi_t, M, D, 4); break;
#endif
#if DOT_SLOTS >= 6
    case 5: tokens_dots(lb, xb, phi_t, M, D, 5); break;
    case 6: tokens_dots(lb, xb, phi_t, M, D, 6); break;
#endif
    }
}

/* For the TB tokens from t0 of one input, one vector of dim after the other: gxb[t] = sum_s gpb[t, s] phi_t[s] -
   c[t] xb[t] (with `router`; c = dot r^2) and acc[s] += sum_t gpb[t, s] xb[t] (phi's gradient, S rows of DV). */
ALWAYS_INLINE void block_grads(float *gxb, float *acc, const float *xb, const float *gpb, const float *phi_t,
                               const float *c, long t0, long S, long D, long DV, int router, const int TB)
{
    for (long d = 0; d < D; d += LANES) {
        const long n = D - d < LANES ? D - d : LANES;
        vec xv[TOKEN_BLOCK], gv[TOKEN_BLOCK];
        for (int t = 0; t < TB; t++) {
            xv[t] = load_n(xb + (t0 + t) * D + d, n);
            gv[t] = router ? xv[t] * -c[t0 + t] : vec{};
        }
        for (long s = 0; s < S; s++) {
            const vec p = load_n(phi_t + s * D + d, n);
            vec a = load(acc + s * DV + d);
            for (int t = 0; t < TB; t++) {
                const float g = gpb[(t0 + t) * S + s];
                gv[t] += g * p;
                a += g * xv[t];
            }
            store(acc + s * DV + d, a);
        }
        for (int t = 0; t < TB; t++) store_n(gxb + (t0 + t) * D + d, gv[t], n);
    }
}

/* The products of one input's backward: its M tokens' gradient gxb (M, D) from gpb (M, S) and phi_t (S, D), and
   its share of phi's gradient added to acc (S rows of DV); c (M): the router's term dot r^2. */
static void input_grads(float *gxb, float *acc, const float *xb, const float *gpb, const float *phi_t,
                        const float *c, long M, long S, long D, long DV, int router)
{
    long t0 = 0;
    for (; t0 + TOKEN_BLOCK <= M; t0 += TOKEN_BLOCK)
        block_grads(gxb, acc, xb, gpb, phi_t, c, t0, S, D, DV, router, TOKEN_BLOCK);
    switch (M - t0) {
    case 1: block_grads(gxb, acc, xb, gpb, phi_t, c, t0, S, D, DV, router, 1); break;
    case 2: block_grads(gxb, acc, xb, gpb, phi_t, c, t0, S, D, DV, router, 2); break;
    case 3: block_grads(gxb, acc, xb, gpb, phi_t, c, t0, S, D, DV, router, 3); break;
    }
}

/* ---- the elementwise passes --------------------------------------------------------------------------------- */

/* logits (B, M, S) holds P = x phi on entry, or P is computed here: as dot products from phi_t (S, D: phi_n
 * transposed; S <= DOT_SLOTS), or from phi_rows (D, SOFTMOE_ROUTING_SMALL_SLOTS: phi_n's rows, zeros past S;
 * S <= SOFTMOE_ROUTING_SMALL_SLOTS); the logits on return. r (B, M) gets
 * rsqrt(|x|^2 + 1e-6) of the tokens of x (B, M, D) when `router`, else ones. With k >= 1, Algorithm 1's choice of k
 * experts of P slots each is made from each input's combine weights while they are in cache (top_k_input,
 * top_k_combine.h): selected (B, k; NULL: not written) gets the kept experts, slots (B, ceil(S / 64)) their slots
 * as bits, and combine is zeroed outside them. */
void soft_moe_routing_forward(float *logits, const float *x, const float *phi_t, const float *phi_rows,
                              float *dispatch, float *combine, float *r, long B, long M, long S, long D, int router,
                              long P, long k, int64_t *selected, uint64_t *slots, int threads)
{
    const long SV = (S + LANES - 1) / LANES * LANES; /* the columns' buffers in whole vectors */
#pragma omp parallel num_threads(threads)
    {
        /* per column (slot): the maximum of the logits over the tokens, then the sum of their exponentials and its
           inverse; per row (token): the maximum over the slots, then the inverse of the sum */
        float *colmax = (float *)malloc((2 * SV + 2 * M) * sizeof(float));
        float *colsum = colmax + SV, *rowmax = colsum + SV, *rowinv = rowmax + M;
        void *choice = k ? softmoe_scratch(0, top_k_scratch_bytes(S, P)) : NULL;
#pragma omp for schedule(static)
        for (long b = 0; b < B; b++) {
            float *lb = logits + b * M * S, *db = dispatch + b * M * S, *cb = combine + b * M * S;
            if (phi_t)
                input_dots(lb, x + b * M * D, phi_t, M, S, D);
            else if (phi_rows)
                input_logits(lb, x + b * M * D, phi_rows, M, S, D);
            for (long s = 0; s < SV; s++) colmax[s] = -__builtin_inff(), colsum[s] = 0.0f;
            for (long t = 0; t < M; t++) {
                const float rt = router ? inverse_norm(x + (b * M + t) * D, D) : 1.0f;
                float *row = lb + t * S;
                vec mv = splat(-__builtin_inff());
                r[b * M + t] = rt;
                for (long s = 0; s < S; s += LANES) {
                    const long count = S - s < LANES ? S - s : LANES;
                    const vec l = load_n(row + s, count) * rt;
                    const vec masked = choose(lanes_below(count), l, splat(-__builtin_inff()));
                    store_n(row + s, l, count);
                    mv = vmax(masked, mv);
                    store(colmax + s, vmax(l, load(colmax + s))); /* past S: 0, finite */
                }
                rowmax[t] = lane_max(mv);
            }
            for (long t = 0; t < M; t++) {
                const float *row = lb + t * S;
                const vec m = splat(rowmax[t]);
                vec sum = {0};
                for (long s = 0; s < S; s += LANES) {
                    const long count = S - s < LANES ? S - s : LANES;
                    const vec l = load_n(row + s, count);
                    const vec over_tokens = exp_nonpositive(l - load(colmax + s));
                    const vec over_slots = choose(lanes_below(count), exp_nonpositive(l - m), vec{});
                    store(colsum + s, load(colsum + s) + over_tokens);
                    sum += over_slots;
                    store_n(db + t * S + s, over_tokens, count);
                    store_n(cb + t * S + s, over_slots, count);
                }
                rowinv[t] = 1.0f / lane_sum(sum);
            }
            for (long s = 0; s < SV; s += LANES) store(colsum + s, 1.0f / load(colsum + s));
            for (long t = 0; t < M; t++) {
                float *drow = db + t * S, *crow = cb + t * S;
                const vec inverse = splat(rowinv[t]);
                for (long s = 0; s < S; s += LANES) {
                    const long count = S - s < LANES ? S - s : LANES;
                    store_n(drow + s, load_n(drow + s, count) * load(colsum + s), count);
                    store_n(crow + s, load_n(crow + s, count) * inverse, count);
                }
            }
            if (k)
                top_k_input(cb, cb, selected ? selected + b * k : NULL, slots + b * ((S + 63) / 64), M, S, P, k,
                            choice);
        }
        if (k) softmoe_scratch_release(0);
        free(colmax);
    }
}

/* gl, gd, gc (B, M, S) or NULL; writes gp (B, M, S) and dot_out (B, M), the sums over slots of g logits. With phi_t
 * (S, D: phi_n transposed; S <= SOFTMOE_ROUTING_SMALL_SLOTS) also the products: grad_x (B, M, D) = gp phi_t - (with
 * `router`) dot r^2 x, and grad_phi_t (S, D) = gp^T x. */
void soft_moe_routing_backward(const float *gl, const float *gd, const float *gc, const float *logits,
                               const float *dispatch, const float *combine, const float *r, float *gp, float *dot_out,
                               const float *x, const float *phi_t, float *grad_x, float *grad_phi_t, long B, long M,
                               long S, long D, int router, int threads)
{
    const long SV = (S + LANES - 1) / LANES * LANES, DV = (D + LANES - 1) / LANES * LANES;
    float **shares = (float **)malloc(threads * sizeof(float *)); /* each thread's share of phi's gradient */
#pragma omp parallel num_threads(threads)
    {
        /* sum over tokens of gd dispatch, per column; sum over slots of gc combine, per row; with phi_t the router's
           terms of a token (M) and the thread's share of phi's gradient (S rows of DV) */
        const long extra = phi_t ? M + S * DV : 0;
        float *coldot = (float *)malloc((SV + M + extra) * sizeof(float)), *rowdot = coldot + SV;
        float *terms = rowdot + M, *acc = terms + M;
        const long me = omp_get_thread_num(), count = omp_get_num_threads();
        if (phi_t) memset(acc, 0, S * DV * sizeof(float));
        shares[me] = acc;
#pragma omp for schedule(static)
        for (long b = 0; b < B; b++) {
            const long base = b * M * S;
            for (long s = 0; s < SV; s++) coldot[s] = 0.0f;
            for (long t = 0; t < M; t++) {
                const long row = base + t * S;
                vec sum = {0};
                for (long s = 0; s < S; s += LANES) {
                    const long count = S - s < LANES ? S - s : LANES;
                    if (gc) sum += load_n(gc + row + s, count) * load_n(combine + row + s, count);
                    if (gd)
                        store(coldot + s,
                              load(coldot + s) + load_n(gd + row + s, count) * load_n(dispatch + row + s, count));
                }
                rowdot[t] = lane_sum(sum);
            }
            for (long t = 0; t < M; t++) {
                const long row = base + t * S;
                const vec rd = splat(rowdot[t]), rt = splat(router ? r[b * M + t] : 1.0f);
                vec dot = {0};
                for (long s = 0; s < S; s += LANES) {
                    const long count = S - s < LANES ? S - s : LANES;
                    vec g = gl ? load_n(gl + row + s, count) : vec{};
                    if (gc) g += load_n(combine + row + s, count) * (load_n(gc + row + s, count) - rd);
                    if (gd) g += load_n(dispatch + row + s, count) * (load_n(gd + row + s, count) - load(coldot + s));
                    dot += g * load_n(logits + row + s, count);
                    store_n(gp + row + s, g * rt, count);
                }
                dot_out[b * M + t] = lane_sum(dot);
                if (phi_t) terms[t] = router ? dot_out[b * M + t] * r[b * M + t] * r[b * M + t] : 0.0f;
            }
            if (phi_t) input_grads(grad_x + b * M * D, acc, x + b * M * D, gp + base, phi_t, terms, M, S, D, DV, router);
        }
        if (phi_t) { /* after the loop's barrier: the shares summed in thread order (the same result every run), a
                        range of slots per thread */
            for (long s = S * me / count; s < S * (me + 1) / count; s++)
                for (long d = 0; d < D; d++) {
                    float sum = 0.0f;
                    for (long k = 0; k < count; k++) sum += shares[k][s * DV + d];
                    grad_phi_t[s * D + d] = sum;
                }
#pragma omp barrier
        }
        free(coldot);
    }
    free(shares);
}

} /* namespace SOFTMOE_NS */
