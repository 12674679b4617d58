/* The whole Soft MoE mixing C f(D^T X) in one pass, for layers of many small relu MLP experts.
 *
 * For S = n * P slots (P per expert; slot s belongs to expert j = s / P), each expert an MLP Dm -> Hd -> Dm with
 * weights w1[j] (Dm, Hd), b1[j], w2[j] (Hd, Dm), b2[j], and one input of M tokens x[t] (Dm):
 *
 *   slot[s]  = sum_t dispatch[t, s] x[t]                 (Dm)
 *   pre[s]   = slot[s] @ w1[j] + b1[j]                   (Hd)   saved for the backward pass
 *   y[s]     = relu(pre[s]) @ w2[j] + b2[j]              (Dm)    saved too where the caller asks (keep)
 *   out[t]   = sum_s combine[t, s] y[s]                  (Dm)
 *
 * With small experts (the "Beyond Parameter Count" MNIST layer: 4 tokens, Dm = 196, n = 8..512, Hd = 784 / n)
 * torch runs this as a chain of thin batched matmuls (contractions over 4 tokens, outputs of width Hd) that write
 * (batch, S, Dm) slot and output tensors to memory (100 MB each at n = 512). Here the inputs are processed in
 * groups of LANES, one input per vector lane: a group's tokens are gathered into a "grouped" buffer (M * Dm vectors,
 * the group's inputs side by side), so a slot vector of a group is Dm vectors that stay in a thread's cache, the
 * routing weights of a (slot, token) are one vector, the expert weights are scalars broadcast to all lanes, and no
 * step needs a sum across lanes but the weight gradients of experts under OUTER_MIN_HIDDEN hidden units (one per
 * weight and block of GROUP_BLOCK groups; wider experts transpose the rows instead, see add_outer_products).
 * Every slot runs dispatch, both expert layers and the combine back to back, KBLOCK hidden units at a time; experts
 * of at most PAIR_MAX_HIDDEN units run two slots side by side, each pass over dim serving both; with AVX2 two groups
 * run each slot side by side, each weight broadcast once for both (SIDE_GROUPS).
 *
 * Threads (OpenMP, sharing torch's libgomp pool): the forward pass splits the groups (each thread owns its groups'
 * outputs); the backward pass splits the experts (each thread owns its experts' weight gradients and writes its
 * share of the input gradient into a partial sum of its own; the threads then add the partials up, a range of
 * rows each).
 *
 * Algorithm 1's kept combine (inference) may instead run, where bindings.cpp counts it cheaper, as the rows of each
 * expert (its inputs that keep it, ROWS at a time, vectors along hidden and dim) or as each input's kept experts one
 * at a time (the sections "kept rows of one expert" and "kept pairs one at a time").
 *
 * The kernel source of softmoe::soft_moe_mixing and its backward op, compiled once per instruction set by
 * soft_moe_small_{avx512,avx2,portable}.cpp (see variant.h), each copy in its own namespace SOFTMOE_NS with
 * LANES = SOFTMOE_LANES inputs per group. C++ compatible C: no system header is included here.
 */
#if !defined(SOFTMOE_LANES) || !defined(SOFTMOE_NS)
#error "soft_moe_small.h is included by a variant unit that defines SOFTMOE_LANES and SOFTMOE_NS (see variant.h)"
#endif

#include "kernels.h" /* SOFTMOE_MIXING_ROWS */

namespace SOFTMOE_NS {

#define LANES SOFTMOE_LANES
#if LANES == 16
#define IOTA {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}
#elif LANES == 8
#define IOTA {0, 1, 2, 3, 4, 5, 6, 7}
#else
#define IOTA {0, 1, 2, 3}
#endif
/* Hidden units per register block. The forward pass takes 8. The backward, with AVX-512's 32 vector registers, 16:
 * at 12 hidden units one block instead of two, and no loss at more. The forward would gain from 16 at 12 and more
 * units too, but lost at 2-6 units, whose loops are the same: with the larger function the compiler kept fewer
 * pointers in registers. With AVX2's 16 registers 16 or 12 spilled (docs/performance.md has the measurements). */
#define FORWARD_KBLOCK 8
/* Groups of lanes that run a slot side by side, each weight broadcast once for all of them (SIDE_GROUPS: the
 * forward pass; the backward's from BACKWARD_GROUPS_MIN_HIDDEN units), and hidden units per register block then
 * (SIDE_KBLOCK). With AVX2 two, 6 units per block (12 accumulators and two slot vectors in its 16 registers): one
 * group's 8 lanes per broadcast weight (its load and broadcast, which AVX-512 folds into the multiply-add, and the
 * weights streamed once per 8 inputs) held layer 1's loop well below the speed of two groups' (1.2-2.6 MB of
 * weights), and two groups sped up the MNIST layer's mixing op forward most at n = 2-64 (hidden 392-12). AVX-512:
 * one group, two gaining nothing there (docs/performance.md has the measurements). */
#if LANES == 8
#define SIDE_GROUPS 2
#else
#define SIDE_GROUPS 1
#endif
#define SIDE_KBLOCK 6
#define FORWARD_KBLOCK_OF(ng) ((ng) == 2 ? SIDE_KBLOCK : FORWARD_KBLOCK)
#if LANES == 16
#define KBLOCK 16
#define BLOCK_CASES_WIDE(CALL, k, first, last)                                                                        \
    case 8: CALL(k, 8, first, last); break;                                                                           \
    case 9: CALL(k, 9, first, last); break;                                                                           \
    case 10: CALL(k, 10, first, last); break;                                                                         \
    case 11: CALL(k, 11, first, last); break;                                                                         \
    case 12: CALL(k, 12, first, last); break;                                                                         \
    case 13: CALL(k, 13, first, last); break;                                                                         \
    case 14: CALL(k, 14, first, last); break;                                                                         \
    case 15: CALL(k, 15, first, last); break;
#else
#define KBLOCK 8
#define BLOCK_CASES_WIDE(CALL, k, first, last)
#endif
#define BLOCK_CASES_NONE(CALL, k, first, last)
/* Experts of at most this many hidden units run two slots of a group side by side (pair = 1 below): one pass over
 * dim for both, each token vector (and output gradient) loaded once for the two. Against one slot at a time, with
 * AVX-512 this gains up to 6 hidden units and loses beyond, where the registers run out; with AVX2's 16 registers it
 * lost at every size, so never. The code of the other sizes, one slot at a time, kept its speed (docs/performance.md
 * has the measurements). */
#if LANES == 16
#define PAIR_MAX_HIDDEN 6
#else
#define PAIR_MAX_HIDDEN 0
#endif
#define GROUP_BLOCK 4  /* groups whose slot vectors and gradients a thread keeps while it runs through its experts */
/* The backward pass runs a slot for SIDE_GROUPS groups of a block side by side from BACKWARD_GROUPS_MIN_HIDDEN
 * hidden units, SIDE_KBLOCK units per register block (with AVX2: two, 6). Against one group at a time this gains from
 * that many units up, the more the wider the experts, and loses below, where the second layer's products, a and the
 * output sums of two groups, spill (docs/performance.md has the measurements). */
#define BACKWARD_GROUPS_MIN_HIDDEN 20
#define BACKWARD_KBLOCK_OF(two) ((two) ? SIDE_KBLOCK : KBLOCK)
#define INLINE static inline __attribute__((always_inline))
#define RESTRICT __restrict__ /* C's restrict */

typedef float vec __attribute__((vector_size(LANES * 4)));
typedef int ivec __attribute__((vector_size(LANES * 4)));

int soft_moe_small_lanes() { return LANES; }

INLINE vec splat(float s) { return vec{} + s; }
INLINE vec relu(vec v) { return (vec)((ivec)v & (v > 0)); }
INLINE vec relu_slope(vec v) { return (vec)((ivec)splat(1.0f) & (v > 0)); }

#define MAX_TOKENS 8 /* tokens per input the kernels accept; their routing weights stay in registers */

/* CALL(k, kb, first, last) for the blocks of Hd hidden units, KB at a time (k the block's first unit, kb <= KB its
 * width, first / last whether it is the first / last block), with kb, first and last constants so that loops unroll
 * and the branches on first and last fold away; WIDE: the cases of widths 8 .. KB - 1. */
#define BLOCK_SWITCH(rem, CALL, k, first, last, KB, WIDE)                                                            \
    switch (rem) {                                                                                                    \
    case 1: CALL(k, 1, first, last); break;                                                                           \
    case 2: CALL(k, 2, first, last); break;                                                                           \
    case 3: CALL(k, 3, first, last); break;                                                                           \
    case 4: CALL(k, 4, first, last); break;                                                                           \
    case 5: CALL(k, 5, first, last); break;                                                                           \
    case 6: CALL(k, 6, first, last); break;                                                                           \
    case 7: CALL(k, 7, first, last); break;                                                                           \
    WIDE(CALL, k, first, last)                                                                                        \
    default: CALL(k, KB, first, last); break;                                                                         \
    }
#define FOR_BLOCKS_OF(Hd, CALL, KB, WIDE)                                                                             \
    if ((Hd) <= (KB)) {                                                                                               \
        BLOCK_SWITCH(Hd, CALL, 0, 1, 1, KB, WIDE)                                                                     \
    } else {                                                                                                          \
        CALL(0, KB, 1, 0);                                                                                            \
        long k_ = KB;                                                                                                 \
        for (; k_ + (KB) < (Hd); k_ += KB) CALL(k_, KB, 0, 0);                                                        \
        BLOCK_SWITCH((Hd) - k_, CALL, k_, 0, 1, KB, WIDE)                                                             \
    }
#define FOR_BLOCKS(Hd, CALL) FOR_BLOCKS_OF(Hd, CALL, KBLOCK, BLOCK_CASES_WIDE)

/* ---- forward ------------------------------------------------------------------------------------------------ */

enum { SHARE_TOKENS, SHARE_WEIGHTS }; /* what two slot vectors of layer1_block share */

/* h_i[k + kk] = sum_d slot_i[d] w1_i[d * Hd + k + kk] for kk < kb and the ns (1 or 2) slot vectors i: two slots of
 * one group (share = SHARE_TOKENS: their token vectors loaded once for both, w1_1 the second slot's weights; one
 * block only) or one slot of two groups (SHARE_WEIGHTS: each weight loaded and broadcast once for both). On the first
 * block slot_i = sum_t ds_i[t] xg_i[t] is computed here (and kept in keep_i unless it is also the last block); later
 * blocks read it from keep_i. */
INLINE void layer1_block(vec *RESTRICT h0, vec *RESTRICT h1, const vec *RESTRICT xg0, const vec *RESTRICT xg1,
                         const vec *RESTRICT ds0, const vec *RESTRICT ds1, vec *RESTRICT keep0, vec *RESTRICT keep1,
                         const float *RESTRICT w10, const float *RESTRICT w11, long k, long Hd, long M, long Dm,
                         const int kb, const int first, const int last, const int ns, const int share)
{
    vec acc[2][FORWARD_KBLOCK] = {{{0}}}, dsv[2][MAX_TOKENS];
    for (long t = 0; t < M; t++) dsv[0][t] = ds0[t], dsv[1][t] = ns == 2 ? ds1[t] : vec{};
    for (long d = 0; d < Dm; d++) {
        vec sv[2];
        for (int i = 0; i < ns; i++) {
            if (first) {
                const vec *RESTRICT x = i == 0 || share == SHARE_TOKENS ? xg0 : xg1;
                sv[i] = dsv[i][0] * x[d];
                for (long t = 1; t < M; t++) sv[i] += dsv[i][t] * x[t * Dm + d];
                if (!last) (i == 0 ? keep0 : keep1)[d] = sv[i];
            } else {
                sv[i] = (i == 0 ? keep0 : keep1)[d];
            }
        }
        for (int kk = 0; kk < kb; kk++) {
            if (share == SHARE_WEIGHTS) {
                const float w = w10[d * Hd + k + kk];
                for (int i = 0; i < ns; i++) acc[i][kk] += sv[i] * w;
            } else {
                acc[0][kk] += sv[0] * w10[d * Hd + k + kk];
                if (ns == 2) acc[1][kk] += sv[1] * w11[d * Hd + k + kk];
            }
        }
    }
    for (int kk = 0; kk < kb; kk++) {
        h0[k + kk] = acc[0][kk];
        if (ns == 2) h1[k + kk] = acc[1][kk];
    }
}

/* y_i[d] (+)= sum_kk a_i[k + kk] w2[kk * Dm + d] for the ng (1 or 2) groups i of one slot, each weight broadcast once
 * for all, starting from b2[d] (or 0) on the first block. Two sums per d: the even and odd kk of one group, or one
 * per group: one chain of kb dependent multiply-adds per d left AVX2's two FMA units waiting (with AVX-512 the two
 * sums neither gained nor lost; docs/performance.md has the measurements). */
INLINE void layer2_block(vec *RESTRICT y0, vec *RESTRICT y1, const vec *RESTRICT a0, const vec *RESTRICT a1, long k,
                         const float *RESTRICT w2, const float *RESTRICT b2, long Dm, const int kb, const int first,
                         const int ng)
{
    vec av[2][FORWARD_KBLOCK];
    for (int kk = 0; kk < kb; kk++) av[0][kk] = a0[k + kk], av[1][kk] = ng == 2 ? a1[k + kk] : vec{};
    for (long d = 0; d < Dm; d++) {
        vec sum[2], odd = {0};
        sum[0] = first ? splat(b2 ? b2[d] : 0.0f) : y0[d];
        if (ng == 2) sum[1] = first ? sum[0] : y1[d];
        for (int kk = 0; kk < kb; kk++) {
            const float w = w2[kk * Dm + d];
            if (ng == 1 && kk % 2)
                odd += av[0][kk] * w;
            else
                for (int i = 0; i < ng; i++) sum[i] += av[i][kk] * w;
        }
        y0[d] = ng == 1 ? sum[0] + odd : sum[0];
        if (ng == 2) y1[d] = sum[1];
    }
}

#define SPREAD_SLOTS 4 /* slots whose outputs (or token gradients) are added to a group's rows in one pass */

/* rows[t * Dm + d] += sum_{i < count} coef[i * M + t] vals[i * ldv + d]: the combine of a few slots' outputs into
 * the tokens (or the dispatch of their slot gradients back to the tokens), the rows read and written once. */
INLINE void spread_slots(vec *RESTRICT rows, const vec *RESTRICT coef, const vec *RESTRICT vals, long ldv,
                         long count, long M, long Dm)
{
    vec c[SPREAD_SLOTS * MAX_TOKENS];
    for (long i = 0; i < count * M; i++) c[i] = coef[i];
    for (long d = 0; d < Dm; d++)
        for (long t = 0; t < M; t++) {
            vec acc = rows[t * Dm + d];
            for (long i = 0; i < count; i++) acc += c[i * M + t] * vals[i * ldv + d];
            rows[t * Dm + d] = acc;
        }
}

static void spread_pending(vec *RESTRICT rows, const vec *RESTRICT coef, const vec *RESTRICT vals, long ldv,
                           long count, long M, long Dm)
{
    if (count == SPREAD_SLOTS && M == 4)
        spread_slots(rows, coef, vals, ldv, SPREAD_SLOTS, 4, Dm);
    else
        spread_slots(rows, coef, vals, ldv, count, M, Dm);
}

/* A slot of ng (1 or 2) groups after its first layer's products ps_i: the bias, relu into a_i, the second layer into
 * y_i. */
INLINE void second_layer(vec *const *y, vec *const *ps, const float *RESTRICT b1, const float *RESTRICT w2,
                         const float *RESTRICT b2, vec *const *a, long Hd, long Dm, const int ng)
{
    for (int i = 0; i < ng; i++)
        for (long k = 0; k < Hd; k++) {
            ps[i][k] += b1 ? b1[k] : 0.0f;
            a[i][k] = relu(ps[i][k]);
        }
#define LAYER2(k, kb, first, last)                                                                                    \
    layer2_block(y[0], y[ng - 1], a[0], a[ng - 1], k, w2 + (k) * Dm, b2, Dm, kb, first, ng)
    FOR_BLOCKS_OF(Hd, LAYER2, FORWARD_KBLOCK_OF(ng), BLOCK_CASES_NONE)
#undef LAYER2
}

/* Where a slot's data lie: its expert's weights, its routing weights in a gathered chunk, its saved record. */
typedef struct {
    const float *w1, *b1, *w2, *b2;
    const vec *ds, *cs;
    vec *record;
} slot_t;

/* Slot s of a chunk of slots from s0 (routing weights ds, cs: M vectors per slot of the chunk) of a group whose
 * saved records (W vectors per slot) for the chunk start at records. */
INLINE slot_t slot_at(long s, long s0, long P, long M, long Hd, long Dm, long W, const float *w1, const float *b1,
                      const float *w2, const float *b2, const vec *ds, const vec *cs, vec *records)
{
    const long j = s / P;
    const slot_t q = {w1 + j * Dm * Hd, b1 ? b1 + j * Hd : NULL, w2 + j * Hd * Dm, b2 ? b2 + j * Dm : NULL,
                      ds + (s - s0) * M, cs + (s - s0) * M, records + (s - s0) * W};
    return q;
}

/* ---- layouts ------------------------------------------------------------------------------------------------ */

/* A group of lanes holds places first ... first + lanes - 1 (lanes <= LANES) of the inputs in order: order[place]
 * (an input's index; NULL: the inputs as they come, place = index). */
typedef struct {
    long first, lanes;
    const long *order;
} group_t;

/* Group g of the inputs LANES at a time (lanes < LANES only in the last group). */
static group_t group_of(long g, long B, const long *order)
{
    const group_t grp = {g * LANES, B - g * LANES < LANES ? B - g * LANES : LANES, order};
    return grp;
}

/* The input in lane l of a group */
INLINE long input_of(group_t grp, long l) { return grp.order ? grp.order[grp.first + l] : grp.first + l; }

typedef float uvec __attribute__((vector_size(LANES * 4), aligned(4))); /* a vector at any float address */

/* The transpose of a LANES x LANES block held in v (v[i][l] becomes v[l][i]): the off-diagonal sub-blocks of width
 * 1, 2, 4, ... are swapped, two shuffles per pair of vectors and width. */
INLINE void transpose_block(vec *v)
{
    const ivec iota = IOTA;
#pragma GCC unroll 4
    for (int w = 1; w < LANES; w *= 2) {
        const ivec upper = (iota & w) != 0;
        const ivec lo = (upper & (iota - w + LANES)) | (~upper & iota);
        const ivec hi = (upper & (iota + LANES)) | (~upper & (iota + w));
#pragma GCC unroll 16
        for (int i = 0; i < LANES; i++) {
            if (i & w) continue;
            const vec x = v[i], y = v[i + w];
            v[i] = __builtin_shuffle(x, y, lo);
            v[i + w] = __builtin_shuffle(x, y, hi);
        }
    }
}

enum { MOVE_GATHER, MOVE_SCATTER };

/* Between the routing layout and vectors of a group: v[(s - s0) * M + t][l] = routing[(input_of(grp, l) * M + t) *
 * S + s] for slots s0 <= s < s0 + count and t < M, one vector per (slot, token). MOVE_GATHER copies the routing
 * weights into v (zero in lanes past the group's inputs); MOVE_SCATTER writes v's gradients back into routing.
 * Rows move LANES slots at a time, transposed in registers (the lanes past the group's inputs neither read nor
 * written); the remaining slots one float at a time. */
static void move_slots(vec *RESTRICT v, float *RESTRICT routing, group_t grp, long s0, long count, long M, long S,
                       int mode)
{
    long done = 0;
    for (; done + LANES <= count; done += LANES)
        for (long t = 0; t < M; t++) {
            float *rows = routing + t * S + s0 + done;
            vec block[LANES];
#pragma GCC unroll 16
            for (long i = 0; i < LANES; i++)
                block[i] = mode != MOVE_GATHER ? v[(done + i) * M + t]
                         : i < grp.lanes       ? *(uvec *)(rows + input_of(grp, i) * M * S)
                                               : vec{};
            transpose_block(block);
#pragma GCC unroll 16
            for (long i = 0; i < LANES; i++) {
                if (mode == MOVE_GATHER)
                    v[(done + i) * M + t] = block[i];
                else if (i < grp.lanes)
                    *(uvec *)(rows + input_of(grp, i) * M * S) = block[i];
            }
        }
    if (mode == MOVE_GATHER && grp.lanes < LANES) memset(v + done * M, 0, (count - done) * M * sizeof(vec));
    for (long l = 0; l < grp.lanes; l++)
        for (long t = 0; t < M; t++) {
            float *row = routing + (input_of(grp, l) * M + t) * S + s0;
            for (long s = done; s < count; s++) {
                if (mode == MOVE_GATHER)
                    v[s * M + t][l] = row[s];
                else
                    row[s] = v[s * M + t][l];
            }
        }
}

static void gather_slots(vec *v, const float *routing, group_t grp, long s0, long count, long M, long S)
{
    move_slots(v, (float *)routing, grp, s0, count, M, S, MOVE_GATHER);
}

static void scatter_slots(float *routing, vec *v, group_t grp, long s0, long count, long M, long S)
{
    move_slots(v, routing, grp, s0, count, M, S, MOVE_SCATTER);
}

/* v[e][l] = rows[input_of(grp, l) * count + e] for e < count: a group's inputs (rows of `count` floats) as vectors. */
static void gather_rows(vec *v, const float *rows, group_t grp, long count)
{
    move_slots(v, (float *)rows, grp, 0, count, 1, count, MOVE_GATHER);
}

/* The vectors back into the group's rows. */
static void scatter_rows(float *rows, vec *v, group_t grp, long count)
{
    move_slots(v, rows, grp, 0, count, 1, count, MOVE_SCATTER);
}

#define SLOT_CHUNK 64 /* slots whose routing weights are gathered (and gradients scattered) together */

/* Whether a slot's M combine weights cs are zero (of either sign) in every lane: its outputs reach no token. */
INLINE int slot_idle(const vec *RESTRICT cs, long M)
{
    ivec bits = {0};
    for (long t = 0; t < M; t++) bits |= (ivec)cs[t];
    bits &= 0x7fffffff;
    for (int l = 0; l < LANES; l++)
        if (bits[l]) return 0;
    return 1;
}

/* A group of lanes in the forward pass: its outputs og, its saved records sg and its scratch: token vectors xg, a
 * slot vector buf, activations a, a chunk's routing weights ds and cs, outputs waiting to be combined ys; the
 * slots waiting (pending, their combine weights coef, the first one's outputs at waiting). */
typedef struct {
    group_t grp;
    vec *og, *sg, *xg, *buf, *a, *ds, *cs, *ys, *waiting;
    long pending;
    vec coef[SPREAD_SLOTS * MAX_TOKENS];
} lanes_t;

/* The scratch vectors of one group in the forward pass (lanes_t) */
INLINE long lanes_scratch(long M, long Hd, long Dm)
{
    return (2 * M + 1 + SPREAD_SLOTS) * Dm + Hd + 2 * SLOT_CHUNK * M;
}

/* A group's scratch laid out in lanes_scratch vectors from scratch (its place, records and waiting slots unset) */
INLINE lanes_t lanes_at(vec *scratch, long M, long Hd, long Dm)
{
    lanes_t L;
    L.xg = scratch, L.og = L.xg + M * Dm, L.buf = L.og + M * Dm, L.a = L.buf + Dm, L.ds = L.a + Hd;
    L.cs = L.ds + SLOT_CHUNK * M, L.ys = L.cs + SLOT_CHUNK * M;
    return L;
}

/* A slot to run for a group of lanes: its data, its outputs' place y, whether it is idle there (not run). */
typedef struct {
    lanes_t *L;
    slot_t q;
    vec *y;
    int idle;
} run_t;

/* nr (1 or 2) runs together: dispatch and both expert layers, the outputs to r[i].y, the pre-activations to the
 * records. Two runs are two slots of one group (share = SHARE_TOKENS: hidden <= PAIR_MAX_HIDDEN, one block) or one
 * slot of two groups (SHARE_WEIGHTS). */
INLINE void forward_runs(const run_t *r, const int nr, const int share, long M, long Hd, long Dm)
{
    const vec *xg[2], *ds[2];
    vec *y[2], *h[2], *keep[2], *a[2];
    const float *w1[2];
    for (int i = 0; i < nr; i++) {
        xg[i] = r[i].L->xg, ds[i] = r[i].q.ds, y[i] = r[i].y, h[i] = r[i].q.record, keep[i] = r[i].L->buf;
        a[i] = r[i].L->a, w1[i] = r[i].q.w1;
    }
    if (nr == 2 && share == SHARE_TOKENS) {
#define LAYER1(k, kb, first, last)                                                                                    \
    layer1_block(h[0], h[1], xg[0], xg[0], ds[0], ds[1], NULL, NULL, w1[0], w1[1], 0, Hd, M, Dm, kb, 1, 1, 2,         \
                 SHARE_TOKENS) /* one block: nothing kept */
        BLOCK_SWITCH(Hd, LAYER1, 0, 1, 1, FORWARD_KBLOCK, BLOCK_CASES_NONE)
#undef LAYER1
        for (int i = 0; i < 2; i++) second_layer(y + i, h + i, r[i].q.b1, r[i].q.w2, r[i].q.b2, a + i, Hd, Dm, 1);
    } else {
#define LAYER1(k, kb, first, last)                                                                                    \
    layer1_block(h[0], h[nr - 1], xg[0], xg[nr - 1], ds[0], ds[nr - 1], keep[0], keep[nr - 1], w1[0], w1[0], k, Hd,  \
                 M, Dm, kb, first, last, nr, SHARE_WEIGHTS)
        FOR_BLOCKS_OF(Hd, LAYER1, FORWARD_KBLOCK_OF(nr), BLOCK_CASES_NONE)
#undef LAYER1
        second_layer(y, h, r[0].q.b1, r[0].q.w2, r[0].q.b2, a, Hd, Dm, nr);
    }
}

/* The slots of ng (1 or 2, SIDE_GROUPS) groups L[i], outputs to L[i].og, saved records (W vectors per slot: Hd
 * pre-activations, then with keep its Dm slot outputs) to L[i].sg; each slot runs for the groups side by side.
 * Without keep the outputs of up to SPREAD_SLOTS slots wait in ys until they are combined. pairs (one group): slots
 * two at a time (Hd <= PAIR_MAX_HIDDEN); a constant, so that the code of the others has no trace of it (with the
 * choice made per slot, one slot at a time ran slower at hidden 3-24). skip_idle (for a call without
 * a backward pass, and so without keep): a slot idle in a group (slot_idle; of a pair, one alone) is neither run nor
 * combined there, its records left unwritten: Algorithm 1's unselected experts cost nothing where no input of the
 * group keeps them. */
INLINE void forward_groups(lanes_t *L, const int ng, const float *dispatch, const float *combine, const float *w1,
                           const float *b1, const float *w2, const float *b2, long M, long S, long P, long Hd, long Dm,
                           long W, int keep, int skip_idle, const int pairs)
{
    for (int i = 0; i < ng; i++) memset(L[i].og, 0, M * Dm * sizeof(vec));
    for (long s0 = 0; s0 < S; s0 += SLOT_CHUNK) {
        const long count = S - s0 < SLOT_CHUNK ? S - s0 : SLOT_CHUNK;
        for (int i = 0; i < ng; i++) {
            gather_slots(L[i].ds, dispatch, L[i].grp, s0, count, M, S);
            gather_slots(L[i].cs, combine, L[i].grp, s0, count, M, S);
            L[i].pending = 0, L[i].waiting = L[i].ys; /* with keep: the first waiting slot's outputs */
        }
        for (long s = s0; s < s0 + count; s++) {
            const int pair = pairs && L[0].pending + 2 <= SPREAD_SLOTS && s + 1 < s0 + count, nr = pair ? 2 : ng;
            run_t r[2];
            for (int i = 0; i < nr; i++) {
                lanes_t *Li = &L[pair ? 0 : i];
                r[i].L = Li;
                r[i].q = slot_at(s + (pair ? i : 0), s0, P, M, Hd, Dm, W, w1, b1, w2, b2, Li->ds, Li->cs,
                                 Li->sg + s0 * W);
                r[i].idle = skip_idle && slot_idle(r[i].q.cs, M);
                r[i].y = keep ? r[i].q.record + Hd : Li->ys + (Li->pending + (pair && i == 1 && !r[0].idle)) * Dm;
            }
            if (nr == 2 && !r[0].idle && !r[1].idle) {
                forward_runs(r, 2, pairs ? SHARE_TOKENS : SHARE_WEIGHTS, M, Hd, Dm); /* with pairs a pair */
            } else {
                for (int i = 0; i < nr; i++)
                    if (!r[i].idle) forward_runs(r + i, 1, SHARE_WEIGHTS, M, Hd, Dm);
            }
            for (int i = 0; i < nr; i++) {
                lanes_t *Li = r[i].L;
                if (r[i].idle) continue;
                if (keep && Li->pending == 0) Li->waiting = r[i].y;
                memcpy(Li->coef + Li->pending++ * M, r[i].q.cs, M * sizeof(vec));
            }
            s += pair;
            for (int i = 0; i < ng; i++)
                if (L[i].pending == SPREAD_SLOTS || (L[i].pending && s == s0 + count - 1)) {
                    spread_pending(L[i].og, L[i].coef, L[i].waiting, keep ? W : Dm, L[i].pending, M, Dm);
                    L[i].pending = 0;
                }
        }
    }
}

/* forward_groups for ng groups with the token count M = 4 a constant where it is 4. */
static void forward_groups_of(lanes_t *L, int ng, const float *dispatch, const float *combine, const float *w1,
                              const float *b1, const float *w2, const float *b2, long M, long S, long P, long Hd,
                              long Dm, long W, int keep, int skip_idle)
{
#define FORWARD(ng, M, pairs)                                                                                         \
    forward_groups(L, ng, dispatch, combine, w1, b1, w2, b2, M, S, P, Hd, Dm, W, keep, skip_idle, pairs)
    if (ng == 2 && M == 4)
        FORWARD(2, 4, 0);
    else if (ng == 2)
        FORWARD(2, M, 0);
    else if (PAIR_MAX_HIDDEN > 0 && M == 4 && Hd <= PAIR_MAX_HIDDEN)
        FORWARD(1, 4, 1);
    else if (M == 4)
        FORWARD(1, 4, 0);
    else
        FORWARD(1, M, 0);
#undef FORWARD
}

/* x, out (B, M, Dm); dispatch, combine (B, M, S); saved (G, S, W, LANES) with G = ceil(B / LANES) and W = Hd
 * (keep 0) or Hd + Dm (keep 1): per group and slot the pre-activations, then with keep the slot's outputs (the
 * backward pass reads them instead of running the second layer again), lane l of group g for input LANES * g + l
 * (with order: order[LANES * g + l]).
 * Weights as the layer holds them: w1 (n, Dm, Hd), b1 (n, Hd), w2 (n, Hd, Dm), b2 (n, Dm); b1 and b2 may be NULL.
 * skip_idle: the slots whose combine weights are zero for every input of a group are not run there (forward_groups;
 * saved then holds no record of them: for calls without a backward pass). order (the input indices, or NULL for the
 * inputs as they come): the inputs in the order they are grouped in, LANES at a time (saved's groups too). Each
 * thread runs its groups SIDE_GROUPS at a time. Returns 0, or 1 when M is outside 1..MAX_TOKENS (nothing is
 * written then). */
int soft_moe_small_forward(const float *x, const float *dispatch, const float *combine, const float *w1,
                           const float *b1, const float *w2, const float *b2, float *out, float *saved, long B,
                           long M, long S, long P, long Hd, long Dm, int keep, int skip_idle, const long *order,
                           int threads)
{
    const long W = keep ? Hd + Dm : Hd, G = (B + LANES - 1) / LANES;
    if (M < 1 || M > MAX_TOKENS) return 1;
    if (G <= 0) return 0;
    if (threads > G) threads = (int)G;
    if (threads < 1) threads = 1;
#pragma omp parallel num_threads(threads)
    {
        const long each = lanes_scratch(M, Hd, Dm);
        vec *scratch = (vec *)softmoe_scratch(0, SIDE_GROUPS * each * sizeof(vec));
        lanes_t L[SIDE_GROUPS];
        for (int i = 0; i < SIDE_GROUPS; i++) L[i] = lanes_at(scratch + i * each, M, Hd, Dm);
        const long t = omp_get_thread_num(), count = omp_get_num_threads(), end = G * (t + 1) / count;
        for (long g = G * t / count; g < end; g += SIDE_GROUPS) {
            const int ng = end - g < SIDE_GROUPS ? (int)(end - g) : SIDE_GROUPS;
            for (int i = 0; i < ng; i++) {
                L[i].grp = group_of(g + i, B, order);
                L[i].sg = (vec *)saved + (g + i) * S * W;
                gather_rows(L[i].xg, x, L[i].grp, M * Dm);
            }
            forward_groups_of(L, ng, dispatch, combine, w1, b1, w2, b2, M, S, P, Hd, Dm, W, keep, skip_idle);
            for (int i = 0; i < ng; i++) scatter_rows(out, L[i].og, L[i].grp, M * Dm);
        }
        softmoe_scratch_release(0);
    }
    return 0;
}

/* ---- kept pairs one at a time ------------------------------------------------------------------------------- */

/* rows[i] += sum_{r < 4} coef[r] vecs[r * ld + i] for i < count: four rows added at once, each output vector loaded
 * and stored once per four. */
INLINE void add_four_rows(float *RESTRICT rows, const float *RESTRICT vecs, long ld, const float *coef, long count)
{
    const float c0 = coef[0], c1 = coef[1], c2 = coef[2], c3 = coef[3];
    const float *v1 = vecs + ld, *v2 = vecs + 2 * ld, *v3 = vecs + 3 * ld;
    for (long i = 0; i < count; i++) rows[i] += c0 * vecs[i] + c1 * v1[i] + c2 * v2[i] + c3 * v3[i];
}

/* rows (count) += sum_r coef[r] vecs[r * ld ...] over r < n: the rows four at a time. */
static void add_rows(float *RESTRICT rows, const float *RESTRICT vecs, long ld, const float *coef, long n, long count)
{
    long r = 0;
    for (; r + 4 <= n; r += 4) add_four_rows(rows, vecs + r * ld, ld, coef + r, count);
    for (; r < n; r++) {
        const float c = coef[r];
        const float *v = vecs + r * ld;
        for (long i = 0; i < count; i++) rows[i] += c * v[i];
    }
}

/* slot (Dm) = sum_t db[t * S + s] xb[t]: slot s of one input, from its tokens xb (M, Dm) and dispatch db (M, S). */
static void input_slot(float *RESTRICT slot, const float *RESTRICT xb, const float *db, long s, long M, long S,
                       long Dm)
{
    float d[MAX_TOKENS];
    for (long t = 0; t < M; t++) d[t] = db[t * S + s];
    for (long i = 0; i < Dm; i++) slot[i] = 0.0f;
    add_rows(slot, xb, Dm, d, M, Dm);
}

/* ob[t] += cb[t * S + s] y for t < M: slot s's outputs y (Dm) combined into one input's rows ob (M, Dm). */
static void combine_slot(float *RESTRICT ob, const float *RESTRICT y, const float *cb, long s, long M, long S, long Dm)
{
    for (long t = 0; t < M; t++) {
        const float c = cb[t * S + s];
        for (long i = 0; i < Dm; i++) ob[t * Dm + i] += c * y[i];
    }
}

/* One slot s of expert j for input b, the outputs added to ob (M, Dm): vectors along dim and hidden (the compiler's),
 * slot (Dm) and h (Hd) scratch. */
static void forward_pair_slot(float *RESTRICT ob, const float *RESTRICT xb, const float *db, const float *cb,
                              long s, long j, long M, long S, long Hd, long Dm, const float *w1, const float *b1,
                              const float *w2, const float *b2, float *RESTRICT slot, float *RESTRICT h)
{
    input_slot(slot, xb, db, s, M, S, Dm);
    for (long k = 0; k < Hd; k++) h[k] = b1 ? b1[j * Hd + k] : 0.0f;
    add_rows(h, w1 + j * Dm * Hd, Hd, slot, Dm, Hd);                        /* h = slot w1[j] + b1[j] */
    for (long k = 0; k < Hd; k++) h[k] = h[k] > 0.0f ? h[k] : 0.0f;          /* relu */
    for (long i = 0; i < Dm; i++) slot[i] = b2 ? b2[j * Dm + i] : 0.0f;     /* y, in slot's place */
    add_rows(slot, w2 + j * Hd * Dm, Dm, h, Hd, Dm);                        /* y = relu(h) w2[j] + b2[j] */
    combine_slot(ob, slot, cb, s, M, S, Dm);
}

/* The slots of pair e (input b's expert experts[e]), outputs added to ob (input b's rows): with skip_idle a slot
 * whose combine weights are all zero (of either sign) over b's tokens is not run. */
static void forward_pair(float *RESTRICT ob, long b, long e, const float *x, const float *dispatch,
                         const float *combine, const float *w1, const float *b1, const float *w2, const float *b2,
                         long M, long S, long P, long Hd, long Dm, const long *experts, int skip_idle,
                         float *RESTRICT slot, float *RESTRICT h)
{
    const float *cb = combine + b * M * S;
    for (long s = experts[e] * P; s < (experts[e] + 1) * P; s++) {
        uint32_t any = !skip_idle;
        for (long t = 0; t < M; t++) any |= ((const uint32_t *)cb)[t * S + s] & 0x7fffffffu;
        if (any)
            forward_pair_slot(ob, x + b * M * Dm, dispatch + b * M * S, cb, s, experts[e], M, S, Hd, Dm, w1, b1, w2,
                              b2, slot, h);
    }
}

/* The kept pairs one at a time, for calls without a backward pass (arguments as soft_moe_small_forward's): input
 * b's kept experts are experts[first[b]] ... experts[first[b + 1] - 1], each run on its slots (with skip_idle those
 * of nonzero combine weights) with vectors along dim and hidden instead of across inputs: for small batches, whose
 * groups of lanes would run mostly empty. Threads split the inputs; with fewer inputs than threads they split the
 * pairs, each adding its outputs into a partial sum of its own (the first into out), which they then add up, a range
 * of floats each. out is written whole (zeros for an input that keeps nothing). */
void soft_moe_small_forward_pairs(const float *x, const float *dispatch, const float *combine, const float *w1,
                                  const float *b1, const float *w2, const float *b2, float *out, long B, long M,
                                  long S, long P, long Hd, long Dm, const long *first, const long *experts,
                                  int skip_idle, int threads)
{
    const long E = first[B], total = B * M * Dm;
    if (B >= threads || E <= 1) {
        if (threads > B) threads = (int)B;
        if (threads < 1) threads = 1;
#pragma omp parallel num_threads(threads) if (threads > 1)
        {
            float *slot = (float *)softmoe_scratch(0, (Dm + Hd) * sizeof(float)), *h = slot + Dm;
#pragma omp for schedule(static)
            for (long b = 0; b < B; b++) {
                float *ob = out + b * M * Dm;
                memset(ob, 0, M * Dm * sizeof(float));
                for (long e = first[b]; e < first[b + 1]; e++)
                    forward_pair(ob, b, e, x, dispatch, combine, w1, b1, w2, b2, M, S, P, Hd, Dm, experts, skip_idle,
                                 slot, h);
            }
            softmoe_scratch_release(0);
        }
        return;
    }
    if (threads > E) threads = (int)E;
    float **partials = (float **)malloc(threads * sizeof(float *)); /* thread t's partial sum of out, t >= 1 */
#pragma omp parallel num_threads(threads)
    {
        const long t = omp_get_thread_num(), count = omp_get_num_threads();
        float *slot = (float *)softmoe_scratch(0, (Dm + Hd) * sizeof(float)), *h = slot + Dm;
        float *mine = t == 0 ? out : (partials[t] = (float *)softmoe_scratch(2, total * sizeof(float)));
        memset(mine, 0, total * sizeof(float));
        long b = 0;
        for (long e = E * t / count; e < E * (t + 1) / count; e++) {
            while (first[b + 1] <= e) b++;
            forward_pair(mine + b * M * Dm, b, e, x, dispatch, combine, w1, b1, w2, b2, M, S, P, Hd, Dm, experts,
                         skip_idle, slot, h);
        }
        softmoe_scratch_release(0);
#pragma omp barrier
        for (long other = 1; other < count; other++) {
            const float *part = partials[other];
            for (long i = total * t / count; i < total * (t + 1) / count; i++) out[i] += part[i];
        }
#pragma omp barrier
        if (t > 0) softmoe_scratch_release(2);
    }
    free(partials);
}

/* ---- kept rows of one expert -------------------------------------------------------------------------------- */

/* Inputs of one expert whose slots run together, and vectors of hidden units (layer 1) or of dim (layer 2) per
 * register block: ROWS x ROW_VECS accumulators, each weight vector loaded once for ROWS inputs. */
#define ROWS SOFTMOE_MIXING_ROWS(LANES)
#define ROW_VECS 2

/* The first count floats at p (all LANES where count >= LANES), zeros after. */
INLINE vec load_upto(const float *p, long count)
{
    if (count >= LANES) return *(const uvec *)p;
    vec v = {0};
    for (long i = 0; i < count; i++) v[i] = p[i];
    return v;
}

/* out[r][c0 + i] = bias[c0 + i] (or 0) + sum_{e < E} in[r][e] w[e * ldw + c0 + i] for rows r < R and i < nv LANES
 * (in rows of lds floats, out rows of ldo floats, padded: the lanes past the C columns get values that are not
 * used). The rows of w are read in whole vectors, past their C columns into the rows after them, but for the last
 * LANES floats of w, which may end the tensor: those rows are read up to their C columns. */
INLINE void rows_block(float *RESTRICT out, long ldo, const float *RESTRICT in, long lds, const float *RESTRICT w,
                       long ldw, const float *RESTRICT bias, long E, long C, long c0, const int R, const int nv)
{
    vec acc[ROWS][ROW_VECS], wv[ROW_VECS];
    for (int v = 0; v < nv; v++) {
        const vec b = bias ? load_upto(bias + c0 + v * LANES, C - c0 - v * LANES) : vec{};
        for (int r = 0; r < R; r++) acc[r][v] = b;
    }
    const long whole = E - (LANES + ldw - 1) / ldw; /* the rows read in whole vectors */
    for (long e = 0; e < E; e++) {
        const float *we = w + e * ldw + c0;
        if (e < whole)
            for (int v = 0; v < nv; v++) wv[v] = *(const uvec *)(we + v * LANES);
        else
            for (int v = 0; v < nv; v++) wv[v] = load_upto(we + v * LANES, C - c0 - v * LANES);
        for (int r = 0; r < R; r++) {
            const float s = in[r * lds + e]; /* (a vector times a float: a broadcast, where splat adds +0) */
            for (int v = 0; v < nv; v++) acc[r][v] += wv[v] * s;
        }
    }
    for (int r = 0; r < R; r++)
        for (int v = 0; v < nv; v++) *(uvec *)(out + r * ldo + c0 + v * LANES) = acc[r][v];
}

/* rows_block over all C columns, ROW_VECS vectors at a time, for R (a constant) rows. */
INLINE void rows_product_of(float *RESTRICT out, long ldo, const float *RESTRICT in, long lds, const float *RESTRICT w,
                            long ldw, const float *RESTRICT bias, long E, long C, const int R)
{
    long c0 = 0;
    for (; c0 + ROW_VECS * LANES <= C; c0 += ROW_VECS * LANES)
        rows_block(out, ldo, in, lds, w, ldw, bias, E, C, c0, R, ROW_VECS);
    if (c0 < C) {
        if (C - c0 > LANES)
            rows_block(out, ldo, in, lds, w, ldw, bias, E, C, c0, R, 2);
        else
            rows_block(out, ldo, in, lds, w, ldw, bias, E, C, c0, R, 1);
    }
}

/* out (R, C) = in (R, E) w (E, C) + bias, R <= ROWS rows (a switch to the constant). */
static void rows_product(float *RESTRICT out, long ldo, const float *RESTRICT in, long lds, const float *RESTRICT w,
                         long ldw, const float *RESTRICT bias, long E, long C, long R)
{
    switch (R) {
    case 1: rows_product_of(out, ldo, in, lds, w, ldw, bias, E, C, 1); break;
    case 2: rows_product_of(out, ldo, in, lds, w, ldw, bias, E, C, 2); break;
    case 3: rows_product_of(out, ldo, in, lds, w, ldw, bias, E, C, 3); break;
#if ROWS > 4
    case 4: rows_product_of(out, ldo, in, lds, w, ldw, bias, E, C, 4); break;
    case 5: rows_product_of(out, ldo, in, lds, w, ldw, bias, E, C, 5); break;
    case 6: rows_product_of(out, ldo, in, lds, w, ldw, bias, E, C, 6); break;
    case 7: rows_product_of(out, ldo, in, lds, w, ldw, bias, E, C, 7); break;
#endif
    default: rows_product_of(out, ldo, in, lds, w, ldw, bias, E, C, ROWS); break;
    }
}

/* Slot s of expert j for the R <= ROWS inputs in[0 .. R - 1], each output added to its rows of out: the slots
 * (dispatch), both layers with each weight vector serving the R inputs, the combine. slot (ROWS x ld), h (ROWS x
 * ld) scratch, ld >= max(Dm, Hd) rounded up to LANES. */
static void forward_rows_slot(float *RESTRICT out, const long *in, long R, long s, long j, const float *x,
                              const float *dispatch, const float *combine, long M, long S, long Hd, long Dm,
                              const float *w1, const float *b1, const float *w2, const float *b2, float *RESTRICT slot,
                              float *RESTRICT h, long ld)
{
    for (long r = 0; r < R; r++) /* slot = sum_t d[t] x[t] */
        input_slot(slot + r * ld, x + in[r] * M * Dm, dispatch + in[r] * M * S, s, M, S, Dm);
    rows_product(h, ld, slot, ld, w1 + j * Dm * Hd, Hd, b1 ? b1 + j * Hd : NULL, Dm, Hd, R);
    for (long r = 0; r < R; r++)
        for (long k = 0; k < Hd; k++) h[r * ld + k] = h[r * ld + k] > 0.0f ? h[r * ld + k] : 0.0f; /* relu */
    rows_product(slot, ld, h, ld, w2 + j * Hd * Dm, Dm, b2 ? b2 + j * Dm : NULL, Hd, Dm, R); /* y, in slot's place */
    for (long r = 0; r < R; r++) /* out[t] += c[t] y */
        combine_slot(out + in[r] * M * Dm, slot + r * ld, combine + in[r] * M * S, s, M, S, Dm);
}

/* The kept rows, for calls without a backward pass (arguments as soft_moe_small_forward's with experts): group g
 * holds the inputs order[experts[3 g]] ... (experts[3 g + 1] of them) that keep expert experts[3 g + 2], the groups
 * split into parts (no input in two parts, a thread runs whole parts); each slot of the expert runs for ROWS of the
 * group's inputs at a time, vectors along hidden and dim, with skip_idle an input left out of a slot whose combine
 * weights are all zero (of either sign) over its tokens. out holds zeros on the call; each input's outputs are
 * added to it. */
void soft_moe_small_forward_rows(const float *x, const float *dispatch, const float *combine, const float *w1,
                                 const float *b1, const float *w2, const float *b2, float *out, long M, long S,
                                 long P, long Hd, long Dm, const long *order, const long *experts, const long *parts,
                                 long n_parts, int skip_idle, int threads)
{
    if (threads > n_parts) threads = (int)n_parts;
    if (threads < 1) threads = 1;
    const long ld = ((Dm > Hd ? Dm : Hd) + LANES - 1) / LANES * LANES;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        float *slot = (float *)softmoe_scratch(0, 2 * ROWS * ld * sizeof(float)), *h = slot + ROWS * ld;
        const long t = omp_get_thread_num(), count = omp_get_num_threads();
        for (long g = parts[n_parts * t / count]; g < parts[n_parts * (t + 1) / count]; g++) {
            const long *e = experts + 3 * g, j = e[2];
            for (long s = j * P; s < (j + 1) * P; s++) {
                long in[ROWS], R = 0;
                for (long l = 0; l < e[1]; l++) {
                    const long b = order[e[0] + l];
                    uint32_t any = !skip_idle;
                    for (long tk = 0; tk < M; tk++)
                        any |= ((const uint32_t *)combine)[(b * M + tk) * S + s] & 0x7fffffffu;
                    if (any) in[R++] = b;
                    if (R == ROWS || (R && l + 1 == e[1])) {
                        forward_rows_slot(out, in, R, s, j, x, dispatch, combine, M, S, Hd, Dm, w1, b1, w2, b2, slot,
                                          h, ld);
                        R = 0;
                    }
                }
            }
        }
        softmoe_scratch_release(0);
    }
}

/* ---- backward ----------------------------------------------------------------------------------------------- */

/* Through the second layer and the combine, one block of hidden units: gy = sum_t cs[t] gog[t] (computed and kept
 * in `gy` on the first block, read after), gpre[kk] = gy . w2[kk] over d, and gcs[t] = gog[t] . y over d: with the
 * slot's outputs kept by the forward pass (kept, keep = 1) on the first block; otherwise on the last, y = (b2 +)
 * sum_kk a[kk] w2[kk] summed up in `y` block by block (the output gradients read twice per slot, not once per
 * block). With two the same for a second slot (its ...2 arguments): of the same group (share = SHARE_TOKENS: one
 * block, outputs not kept; gog2 is gog) or the same slot of another group (SHARE_WEIGHTS: w22 and b22 are w2 and
 * b2, each weight loaded and broadcast once for both). */
INLINE void layer2_back_block(vec *RESTRICT gcs, vec *RESTRICT gpre, vec *RESTRICT gy, vec *RESTRICT y,
                              const vec *RESTRICT kept, const vec *RESTRICT gog, const vec *RESTRICT cs,
                              const vec *RESTRICT a, const float *RESTRICT w2, const float *RESTRICT b2,
                              vec *RESTRICT gcs2, vec *RESTRICT gpre2, vec *RESTRICT gy2, vec *RESTRICT y2,
                              const vec *RESTRICT kept2, const vec *RESTRICT gog2, const vec *RESTRICT cs2,
                              const vec *RESTRICT a2, const float *RESTRICT w22, const float *RESTRICT b22, long M,
                              long Dm, const int kb, const int first, const int last, const int keep, const int two,
                              const int share)
{
    vec acc[KBLOCK] = {{0}}, av[KBLOCK], csv[MAX_TOKENS], gc[MAX_TOKENS];
    vec acc2[KBLOCK] = {{0}}, av2[KBLOCK], csv2[MAX_TOKENS], gc2[MAX_TOKENS];
    for (int kk = 0; kk < kb; kk++) av[kk] = a[kk], av2[kk] = two ? a2[kk] : vec{};
    for (long t = 0; t < M; t++) csv[t] = cs[t], gc[t] = vec{}, csv2[t] = two ? cs2[t] : vec{}, gc2[t] = vec{};
    for (long d = 0; d < Dm; d++) {
        vec g, g2 = {0};
        if (first) {
            g = csv[0] * gog[d];
            if (two) g2 = csv2[0] * gog2[d];
            for (long t = 1; t < M; t++) {
                g += csv[t] * gog[t * Dm + d];
                if (two) g2 += csv2[t] * gog2[t * Dm + d];
            }
            gy[d] = g;
            if (two) gy2[d] = g2;
        } else {
            g = gy[d];
            if (two) g2 = gy2[d];
        }
        if (keep) {
            for (int kk = 0; kk < kb; kk++) {
                const float w = w2[kk * Dm + d];
                acc[kk] += g * w;
                if (two) acc2[kk] += g2 * (share == SHARE_WEIGHTS ? w : w22[kk * Dm + d]);
            }
            if (first)
                for (long t = 0; t < M; t++) {
                    gc[t] += gog[t * Dm + d] * kept[d];
                    if (two) gc2[t] += gog2[t * Dm + d] * kept2[d];
                }
            continue;
        }
        vec v = first ? splat(b2 ? b2[d] : 0.0f) : y[d];
        vec v2 = two ? (first ? splat(b22 ? b22[d] : 0.0f) : y2[d]) : vec{};
        for (int kk = 0; kk < kb; kk++) {
            const float w = w2[kk * Dm + d];
            v += av[kk] * w;
            acc[kk] += g * w;
            if (two) {
                const float w_2 = share == SHARE_WEIGHTS ? w : w22[kk * Dm + d];
                v2 += av2[kk] * w_2;
                acc2[kk] += g2 * w_2;
            }
        }
        if (last) {
            for (long t = 0; t < M; t++) {
                gc[t] += gog[t * Dm + d] * v;
                if (two) gc2[t] += gog2[t * Dm + d] * v2;
            }
        } else {
            y[d] = v;
            if (two) y2[d] = v2;
        }
    }
    for (int kk = 0; kk < kb; kk++) {
        gpre[kk] = acc[kk];
        if (two) gpre2[kk] = acc2[kk];
    }
    if (keep ? first : last)
        for (long t = 0; t < M; t++) {
            gcs[t] = gc[t];
            if (two) gcs2[t] = gc2[t];
        }
}

/* Through the first layer, one block of hidden units: gslot (+)= sum_kk gpre[kk] w1[., kk]; the first block also
 * computes slot = sum_t ds[t] xg[t] into `slot`, the last one gds[t] = xg[t] . gslot (the tokens' share,
 * ds[t] gslot, is added later by spread_pending). With two the same for a second slot (its ...2 arguments), as in
 * layer2_back_block: share = SHARE_TOKENS (one block; xg2 is xg) or SHARE_WEIGHTS (w12 is w1). */
INLINE void layer1_back_block(vec *RESTRICT gds, vec *RESTRICT slot, vec *RESTRICT gslot,
                              const vec *RESTRICT xg, const vec *RESTRICT ds, const vec *RESTRICT gpre,
                              const float *RESTRICT w1, vec *RESTRICT gds2, vec *RESTRICT slot2,
                              vec *RESTRICT gslot2, const vec *RESTRICT xg2, const vec *RESTRICT ds2,
                              const vec *RESTRICT gpre2, const float *RESTRICT w12, long Hd, long M, long Dm,
                              const int kb, const int first, const int last, const int two, const int share)
{
    vec gp[KBLOCK], dsv[MAX_TOKENS], gd[MAX_TOKENS], gp2[KBLOCK], dsv2[MAX_TOKENS], gd2[MAX_TOKENS];
    for (int kk = 0; kk < kb; kk++) gp[kk] = gpre[kk], gp2[kk] = two ? gpre2[kk] : vec{};
    for (long t = 0; t < M; t++) dsv[t] = ds[t], gd[t] = vec{}, dsv2[t] = two ? ds2[t] : vec{}, gd2[t] = vec{};
    for (long d = 0; d < Dm; d++) {
        if (first) {
            vec sv = dsv[0] * xg[d], sv2 = {0};
            if (two) sv2 = dsv2[0] * xg2[d];
            for (long t = 1; t < M; t++) {
                sv += dsv[t] * xg[t * Dm + d];
                if (two) sv2 += dsv2[t] * xg2[t * Dm + d];
            }
            slot[d] = sv;
            if (two) slot2[d] = sv2;
        }
        vec g = first ? vec{} : gslot[d], g2 = two && !first ? gslot2[d] : vec{};
        for (int kk = 0; kk < kb; kk++) {
            const float w = w1[d * Hd + kk];
            g += gp[kk] * w;
            if (two) g2 += gp2[kk] * (share == SHARE_WEIGHTS ? w : w12[d * Hd + kk]);
        }
        if (last)
            for (long t = 0; t < M; t++) {
                gd[t] += xg[t * Dm + d] * g;
                if (two) gd2[t] += xg2[t * Dm + d] * g2;
            }
        gslot[d] = g;
        if (two) gslot2[d] = g2;
    }
    if (last)
        for (long t = 0; t < M; t++) {
            gds[t] = gd[t];
            if (two) gds2[t] = gd2[t];
        }
}

/* Where the backward pass of one slot of a group leaves its results: the gradients of its routing weights (gcs, gds:
 * M vectors each) and of its slot vector (gslot, to be spread to the tokens), and gy, slot, a = relu(pre) and gpre
 * (Dm, Dm, Hd, Hd vectors) for the weight gradients. */
typedef struct {
    vec *gcs, *gds, *gy, *slot, *a, *gpre, *gslot;
} slot_grads_t;

/* One slot of one group, backward, from its saved record q.record (pre-activations, then with keep the slot's
 * outputs), with the group's output gradients gog and tokens xg, into o; with two a second one too, q2 into o2: the
 * next slot of the group (share = SHARE_TOKENS: hidden <= PAIR_MAX_HIDDEN, outputs not kept; gog2, xg2 are gog, xg)
 * or the same slot of another group (SHARE_WEIGHTS), in blocks of BACKWARD_KBLOCK_OF(two) hidden units. */
INLINE void backward_slots(slot_t q, slot_grads_t o, slot_t q2, slot_grads_t o2, const vec *RESTRICT gog,
                           const vec *RESTRICT xg, const vec *RESTRICT gog2, const vec *RESTRICT xg2, long M,
                           long Hd, long Dm, int keep, const int two, const int share)
{
    const vec *RESTRICT ps = q.record, *RESTRICT ps2 = q2.record;
    vec *RESTRICT a = o.a, *RESTRICT a2 = o2.a, *RESTRICT gpre = o.gpre, *RESTRICT gpre2 = o2.gpre;
    for (long k = 0; k < Hd; k++) a[k] = relu(ps[k]);
    if (two)
        for (long k = 0; k < Hd; k++) a2[k] = relu(ps2[k]);
#define LAYER2(k, kb, first, last, keep)                                                                              \
    layer2_back_block(o.gcs, o.gpre + (k), o.gy, o.slot, ps + Hd, gog, q.cs, o.a + (k), q.w2 + (k) * Dm, q.b2, o2.gcs, \
                      o2.gpre + (k), o2.gy, o2.slot, ps2 + Hd, gog2, q2.cs, o2.a + (k), q2.w2 + (k) * Dm, q2.b2, M,   \
                      Dm, kb, first, last, keep, two, share)
#define LAYER2_KEPT(k, kb, first, last) LAYER2(k, kb, first, last, 1)
#define LAYER2_ALONE(k, kb, first, last) LAYER2(k, kb, first, last, 0)
    if (two && share == SHARE_TOKENS) {
        BLOCK_SWITCH(Hd, LAYER2_ALONE, 0, 1, 1, KBLOCK, BLOCK_CASES_WIDE)
    } else if (keep) {
        FOR_BLOCKS_OF(Hd, LAYER2_KEPT, BACKWARD_KBLOCK_OF(two), BLOCK_CASES_WIDE)
    } else {
        FOR_BLOCKS_OF(Hd, LAYER2_ALONE, BACKWARD_KBLOCK_OF(two), BLOCK_CASES_WIDE)
    }
#undef LAYER2
#undef LAYER2_KEPT
#undef LAYER2_ALONE
    for (long k = 0; k < Hd; k++) gpre[k] *= relu_slope(ps[k]);
    if (two)
        for (long k = 0; k < Hd; k++) gpre2[k] *= relu_slope(ps2[k]);
#define LAYER1(k, kb, first, last)                                                                                    \
    layer1_back_block(o.gds, o.slot, o.gslot, xg, q.ds, o.gpre + (k), q.w1 + (k), o2.gds, o2.slot, o2.gslot, xg2,     \
                      q2.ds, o2.gpre + (k), q2.w1 + (k), Hd, M, Dm, kb, first, last, two, share)
    if (two && share == SHARE_TOKENS) {
        BLOCK_SWITCH(Hd, LAYER1, 0, 1, 1, KBLOCK, BLOCK_CASES_WIDE)
    } else {
        FOR_BLOCKS_OF(Hd, LAYER1, BACKWARD_KBLOCK_OF(two), BLOCK_CASES_WIDE)
    }
#undef LAYER1
}

/* ---- weight gradients -------------------------------------------------------------------------------------- */

/* r[i] = sum of the lanes of v[i], for i < LANES (v is overwritten): pairs of vectors are folded LANES/2, then
 * LANES/4, ... lanes at a time, one shuffle taking the lower and one the upper half of every group of lanes. */
INLINE vec lane_sums(vec *v)
{
    const ivec iota = IOTA, half = iota % (LANES / 2), second = (ivec)(iota >= LANES / 2) & LANES;
    int count = LANES;
#pragma GCC unroll 4
    for (int w = LANES; w > 1; w /= 2, count /= 2) {
        const ivec lo = half / (w / 2) * w + half % (w / 2) + second, hi = lo + w / 2;
#pragma GCC unroll 8
        for (int i = 0; i < count / 2; i++)
            v[i] = __builtin_shuffle(v[2 * i], v[2 * i + 1], lo) + __builtin_shuffle(v[2 * i], v[2 * i + 1], hi);
    }
    return v[0];
}

/* row[d0 + dd] += sum over groups g < ng and lanes of c[g] * rows[g * Dm + d0 + dd], for dd < width <= LANES */
INLINE void lane_sums_chunk(float *RESTRICT row, const vec *RESTRICT c, const vec *RESTRICT rows, long Dm, long d0,
                            const long ng, const long width)
{
    vec part[LANES];
#pragma GCC unroll 16
    for (long dd = 0; dd < LANES; dd++) {
        vec acc = {0};
        if (dd < width)
#pragma GCC unroll 8
            for (long g = 0; g < ng; g++) acc += c[g] * rows[g * Dm + d0 + dd];
        part[dd] = acc;
    }
    const vec r = lane_sums(part);
    if (width == LANES)
        *(uvec *)(row + d0) += r;
    else
        for (long dd = 0; dd < width; dd++) row[d0 + dd] += r[dd];
}

/* row[d] += sum over groups g < ng and lanes of coef[g * cs] * rows[g * Dm + d] (coef NULL: 1), for d < Dm. Full
 * blocks of groups take a chunk compiled for them, whose partial sums do not spill to the stack (docs/performance.md
 * has the measurements). */
static void add_lane_sums(float *RESTRICT row, const vec *RESTRICT coef, long cs, const vec *RESTRICT rows, long ng,
                          long Dm)
{
    vec c[GROUP_BLOCK];
    for (long g = 0; g < ng; g++) c[g] = coef ? coef[g * cs] : splat(1.0f);
    long d0 = 0;
    if (ng == GROUP_BLOCK)
        for (; d0 + LANES <= Dm; d0 += LANES) lane_sums_chunk(row, c, rows, Dm, d0, GROUP_BLOCK, LANES);
    for (; d0 < Dm; d0 += LANES)
        lane_sums_chunk(row, c, rows, Dm, d0, ng, Dm - d0 < LANES ? Dm - d0 : LANES);
}

/* grad[k * Dm + d] += sum over groups and lanes of coef[g * Hd + k] * rows[g * Dm + d], for k < Hd, d0 <= d < d0 +
 * width: one chunk of LANES columns of dim at a time, so that the chunk's rows (ng * LANES vectors) stay in L1
 * while every hidden unit's coefficients pass over them. */
INLINE void add_products_chunk(float *RESTRICT grad, long ld, const vec *RESTRICT coef, const vec *RESTRICT rows,
                               long ng, long Hd, long Dm, long d0, const long full, const long width)
{
    for (long k = 0; k < Hd; k++) {
        vec c[GROUP_BLOCK];
        for (long g = 0; g < (full ? GROUP_BLOCK : ng); g++) c[g] = coef[g * Hd + k];
        lane_sums_chunk(grad + k * ld, c, rows, Dm, d0, full ? GROUP_BLOCK : ng, width);
    }
}

/* grad (Hd rows of ld floats, Dm used) += the lane sums of coef (ng * Hd vectors) times rows (ng * Dm vectors).
 * With 4 or more hidden units the chunks of dim go outermost, so rows are read from L1 (rather than all of rows, from
 * L2, for every unit); with fewer, one unit after the other (there chunks first were slower; docs/performance.md has
 * the measurements). Full blocks of groups take a chunk compiled for
 * them (unrolled). */
static void add_products(float *RESTRICT grad, long ld, const vec *RESTRICT coef, const vec *RESTRICT rows, long ng,
                         long Hd, long Dm)
{
    if (Hd < 4) {
        for (long k = 0; k < Hd; k++) add_lane_sums(grad + k * ld, coef + k, Hd, rows, ng, Dm);
        return;
    }
    long d0 = 0;
    if (ng == GROUP_BLOCK)
        for (; d0 + LANES <= Dm; d0 += LANES) add_products_chunk(grad, ld, coef, rows, ng, Hd, Dm, d0, 1, LANES);
    for (; d0 < Dm; d0 += LANES)
        add_products_chunk(grad, ld, coef, rows, ng, Hd, Dm, d0, 0, Dm - d0 < LANES ? Dm - d0 : LANES);
}

/* ---- weight gradients of wide experts: outer products of transposed rows ---------------------------------- */

/* From OUTER_MIN_HIDDEN hidden units up, a weight gradient (Hd, Dm) += sum over the block's inputs of coef_i (Hd)
 * times row_i (Dm) is a small matrix product over the ng * LANES inputs: the rows (gy or slot, one vector per
 * element of dim) are transposed into one row of floats per input (16 x 16 blocks in registers), and a register
 * tile of OUTER_R hidden units by OUTER_C vectors of dim runs over the inputs, coef_i[k] read as a scalar from the
 * vector that holds it. The lane sums (two shuffles and an add per vector and level) disappear; the transposes cost
 * Dm / LANES blocks per input group, against Hd * Dm / LANES lane sums: the fewer the hidden units, the larger the
 * transposes' share, and below OUTER_MIN_HIDDEN the outer products gained little or lost against the lane sums in
 * the op's backward (docs/performance.md has the measurements). */
#define OUTER_MIN_HIDDEN (LANES == 8 ? 12 : 16)
#define OUTER_R 4
#if LANES == 16
#define OUTER_C 4
#else
#define OUTER_C 2
#endif

/* out[l * ld + d] = v[d][l] for d < Dm and every lane l; zeros in columns Dm .. ld - 1 (ld: a multiple of LANES) */
static void transpose_rows(float *RESTRICT out, long ld, const vec *RESTRICT v, long Dm)
{
    for (long d0 = 0; d0 < ld; d0 += LANES) {
        vec block[LANES];
#pragma GCC unroll 16
        for (long i = 0; i < LANES; i++) block[i] = d0 + i < Dm ? v[d0 + i] : vec{};
        transpose_block(block);
#pragma GCC unroll 16
        for (long l = 0; l < LANES; l++) *(vec *)(out + l * ld + d0) = block[l];
    }
}

/* grad[(k0 + r) * ld + d0 + c * LANES ...] += sum over inputs i (group g, lane l) of coef[g * Hd + k0 + r][l] times
 * rows[i * ld + d0 + c * LANES ...], for r < R, c < C */
INLINE void outer_tile(float *RESTRICT grad, long ld, const vec *RESTRICT coef, const float *RESTRICT rows, long ng,
                       long Hd, long k0, long d0, const int R, const int C)
{
    vec acc[OUTER_R][OUTER_C] = {};
    for (long g = 0; g < ng; g++) {
        const float *RESTRICT cg = (const float *)(coef + g * Hd + k0);
        for (int l = 0; l < LANES; l++) {
            const float *RESTRICT row = rows + (g * LANES + l) * ld + d0;
            vec rv[OUTER_C];
            for (int c = 0; c < C; c++) rv[c] = *(const vec *)(row + c * LANES);
            for (int r = 0; r < R; r++) {
                const float s = cg[r * LANES + l];
                for (int c = 0; c < C; c++) acc[r][c] += s * rv[c];
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) *(vec *)(grad + (k0 + r) * ld + d0 + c * LANES) += acc[r][c];
}

#define OUTER_ROWS(C)                                                                                                 \
    switch (Hd - k0 < OUTER_R ? Hd - k0 : OUTER_R) {                                                                  \
    case 1: outer_tile(grad, ld, coef, rows, ng, Hd, k0, d0, 1, C); break;                                           \
    case 2: outer_tile(grad, ld, coef, rows, ng, Hd, k0, d0, 2, C); break;                                           \
    case 3: outer_tile(grad, ld, coef, rows, ng, Hd, k0, d0, 3, C); break;                                           \
    default: outer_tile(grad, ld, coef, rows, ng, Hd, k0, d0, OUTER_R, C); break;                                    \
    }

/* grad (Hd rows of ld floats) += sum over the ng * LANES inputs of coef_i times rows_i (ld floats per input, as
 * transpose_rows leaves them): the dim chunks outermost, so that a chunk of rows stays in L1 over every unit */
static void add_outer_products(float *RESTRICT grad, long ld, const vec *RESTRICT coef, const float *RESTRICT rows,
                               long ng, long Hd)
{
    long d0 = 0;
    for (; d0 + OUTER_C * LANES <= ld; d0 += OUTER_C * LANES)
        for (long k0 = 0; k0 < Hd; k0 += OUTER_R) OUTER_ROWS(OUTER_C)
    for (; d0 < ld; d0 += LANES)
        for (long k0 = 0; k0 < Hd; k0 += OUTER_R) OUTER_ROWS(1)
}

/* The gradients of expert j's weights from one slot of a block of ng groups: gy, slot (ng * Dm vectors), a, gpre
 * (ng * Hd vectors), group after group, as kept by backward_slots; gw1t, gw2 (Hd rows of ld floats), gb1, gb2.
 * rows: scratch for the transposed rows of ng groups (ng * LANES * ld floats), used from OUTER_MIN_HIDDEN units. */
static void add_weight_grads(float *gw1t, float *gb1, float *gw2, float *gb2, long ld, const vec *a, const vec *gpre,
                             const vec *gy, const vec *slot, float *rows, long ng, long Hd, long Dm)
{
    if (Hd >= OUTER_MIN_HIDDEN) {
        for (long g = 0; g < ng; g++) transpose_rows(rows + g * LANES * ld, ld, gy + g * Dm, Dm);
        add_outer_products(gw2, ld, a, rows, ng, Hd);
        for (long g = 0; g < ng; g++) transpose_rows(rows + g * LANES * ld, ld, slot + g * Dm, Dm);
        add_outer_products(gw1t, ld, gpre, rows, ng, Hd);
    } else {
        add_products(gw2, ld, a, gy, ng, Hd, Dm);
        add_products(gw1t, ld, gpre, slot, ng, Hd, Dm);
    }
    if (gb1) add_lane_sums(gb1, NULL, 0, gpre, ng, Hd);
    if (gb2) add_lane_sums(gb2, NULL, 0, gy, ng, Dm);
}

/* One thread's share of soft_moe_small_backward (arguments as there, with n = S / P experts, G groups, MD = M * Dm,
 * ld = Dm rounded up to whole vectors and W the record's width). pairs: slots two at a time where they may be (outputs
 * not kept, 4 tokens, Hd <= PAIR_MAX_HIDDEN); groups: 1, or 2 to run two groups side by side (SIDE_GROUPS); both
 * constants, so that the code of the others has no trace of them. */
INLINE void backward_thread(const float *grad_out, const float *x, const float *dispatch, const float *combine,
                            const float *w1, const float *w2, const float *b2, const float *saved, float *grad_x,
                            float **partials, float *grad_dispatch, float *grad_combine, float *grad_w1,
                            float *grad_b1, float *grad_w2, float *grad_b2, long B, long M, long S, long P, long Hd,
                            long Dm, int keep, long n, long G, long MD, long ld, long W, const int pairs,
                            const int groups)
{
    const long t = omp_get_thread_num(), count = omp_get_num_threads();
    const long first = n * t / count, last = n * (t + 1) / count;
    float *gx = t == 0 ? grad_x : (partials[t] = (float *)softmoe_scratch(2, B * MD * sizeof(float)));
    /* per group of a block: x, grad_out, grad_x (M * Dm each), gy, slot (Dm), a, gpre (Hd) for two slots, the
     * routing weights of a chunk of slots and their gradients (4 * SLOT_CHUNK * M), the slot gradients not yet
     * spread to the tokens (SPREAD_SLOTS * Dm), the transposed rows of gy or slot (LANES * ld floats: ld
     * vectors) */
    const long per_group = 3 * MD + (4 + SPREAD_SLOTS) * Dm + 4 * Hd + 4 * SLOT_CHUNK * M + ld;
    vec *xg = (vec *)softmoe_scratch(0, GROUP_BLOCK * per_group * sizeof(vec));
    vec *gog = xg + GROUP_BLOCK * MD, *gxg = gog + GROUP_BLOCK * MD, *gy = gxg + GROUP_BLOCK * MD;
    vec *slot = gy + GROUP_BLOCK * Dm, *a = slot + GROUP_BLOCK * Dm, *gpre = a + GROUP_BLOCK * Hd;
    vec *gslots = gpre + GROUP_BLOCK * Hd, *ds = gslots + GROUP_BLOCK * SPREAD_SLOTS * Dm;
    vec *cs = ds + GROUP_BLOCK * SLOT_CHUNK * M;
    vec *gds_all = cs + GROUP_BLOCK * SLOT_CHUNK * M, *gcs_all = gds_all + GROUP_BLOCK * SLOT_CHUNK * M;
    vec *gy2 = gcs_all + GROUP_BLOCK * SLOT_CHUNK * M, *slot2 = gy2 + GROUP_BLOCK * Dm;
    vec *a2 = slot2 + GROUP_BLOCK * Dm, *gpre2 = a2 + GROUP_BLOCK * Hd;
    float *rows = (float *)(gpre2 + GROUP_BLOCK * Hd);
    /* the weight gradients of the thread's experts, w1's transposed, in rows of ld floats */
    float *gw1t = (float *)softmoe_scratch(1, 2 * (last - first) * Hd * ld * sizeof(float));
    float *gw2 = gw1t + (last - first) * Hd * ld;
    memset(gw1t, 0, 2 * (last - first) * Hd * ld * sizeof(float));
    if (grad_b1) memset(grad_b1 + first * Hd, 0, (last - first) * Hd * sizeof(float));
    if (grad_b2) memset(grad_b2 + first * Dm, 0, (last - first) * Dm * sizeof(float));
    for (long g0 = 0; g0 < G; g0 += GROUP_BLOCK) {
        const long ng = G - g0 < GROUP_BLOCK ? G - g0 : GROUP_BLOCK;
        for (long gi = 0; gi < ng; gi++) {
            const group_t grp = group_of(g0 + gi, B, NULL);
            gather_rows(xg + gi * MD, x, grp, MD);
            gather_rows(gog + gi * MD, grad_out, grp, MD);
        }
        memset(gxg, 0, ng * MD * sizeof(vec));
        for (long s0 = first * P; s0 < last * P; s0 += SLOT_CHUNK) {
            const long count = last * P - s0 < SLOT_CHUNK ? last * P - s0 : SLOT_CHUNK, chunk = count * M;
            for (long gi = 0; gi < ng; gi++) {
                gather_slots(ds + gi * chunk, dispatch, group_of(g0 + gi, B, NULL), s0, count, M, S);
                gather_slots(cs + gi * chunk, combine, group_of(g0 + gi, B, NULL), s0, count, M, S);
            }
            for (long s = s0; s < s0 + count; s++) {
                const long at = (s - s0) * M, pending = (s - s0) % SPREAD_SLOTS;
                const int pair = pairs && pending % 2 == 0 && s + 1 < s0 + count;
                for (long gi = 0; gi < ng;) {
                    const long side = groups == 2 && gi + 1 < ng ? 2 : 1;
                    slot_t q[2];
                    slot_grads_t o[2];
                    for (long i = 0; i < side; i++) {
                        vec *records = (vec *)saved + ((g0 + gi + i) * S + s0) * W;
                        const vec *dsi = ds + (gi + i) * chunk, *csi = cs + (gi + i) * chunk;
                        q[i] = slot_at(s, s0, P, M, Hd, Dm, W, w1, NULL, w2, b2, dsi, csi, records);
                        const slot_grads_t oi = {gcs_all + (gi + i) * chunk + at, gds_all + (gi + i) * chunk + at,
                                                 gy + (gi + i) * Dm, slot + (gi + i) * Dm, a + (gi + i) * Hd,
                                                 gpre + (gi + i) * Hd,
                                                 gslots + ((gi + i) * SPREAD_SLOTS + pending) * Dm};
                        o[i] = oi;
                    }
                    const vec *gogi = gog + gi * MD, *xgi = xg + gi * MD;
                    if (pair) {
                        vec *records = (vec *)saved + ((g0 + gi) * S + s0) * W;
                        const slot_t q2 = slot_at(s + 1, s0, P, M, Hd, Dm, W, w1, NULL, w2, b2, ds + gi * chunk,
                                                  cs + gi * chunk, records);
                        const slot_grads_t o2 = {o[0].gcs + M, o[0].gds + M, gy2 + gi * Dm, slot2 + gi * Dm,
                                                 a2 + gi * Hd, gpre2 + gi * Hd, o[0].gslot + Dm};
                        backward_slots(q[0], o[0], q2, o2, gogi, xgi, gogi, xgi, 4, Hd, Dm, 0, 1, SHARE_TOKENS);
                    } else {
/* the slot for groups gi .. gi + two, with the token count Mc (4 a constant where it is 4) */
#define SLOTS(Mc, two)                                                                                                \
    backward_slots(q[0], o[0], q[two], o[two], gogi, xgi, gogi + (two) * MD, xgi + (two) * MD, Mc, Hd, Dm, keep, two,  \
                   SHARE_WEIGHTS)
                        if (side == 2 && M == 4)
                            SLOTS(4, 1);
                        else if (side == 2)
                            SLOTS(M, 1);
                        else if (M == 4)
                            SLOTS(4, 0);
                        else
                            SLOTS(M, 0);
#undef SLOTS
                    }
                    const long done = pending + pair; /* the last slot's place among the pending ones */
                    if (done == SPREAD_SLOTS - 1 || s + pair == s0 + count - 1)
                        for (long i = 0; i < side; i++)
                            spread_pending(gxg + (gi + i) * MD, q[i].ds - pending * M, o[i].gslot - pending * Dm,
                                           Dm, done + 1, M, Dm);
                    gi += side;
                }
                for (long i = 0; i <= pair; i++) {
                    const long j = (s + i) / P;
                    add_weight_grads(gw1t + (j - first) * Hd * ld, grad_b1 ? grad_b1 + j * Hd : NULL,
                                     gw2 + (j - first) * Hd * ld, grad_b2 ? grad_b2 + j * Dm : NULL, ld,
                                     i ? a2 : a, i ? gpre2 : gpre, i ? gy2 : gy, i ? slot2 : slot, rows, ng, Hd,
                                     Dm);
                }
                s += pair;
            }
            for (long gi = 0; gi < ng; gi++) {
                scatter_slots(grad_dispatch, gds_all + gi * chunk, group_of(g0 + gi, B, NULL), s0, count, M, S);
                scatter_slots(grad_combine, gcs_all + gi * chunk, group_of(g0 + gi, B, NULL), s0, count, M, S);
            }
        }
        for (long gi = 0; gi < ng; gi++)
            scatter_rows(gx, gxg + gi * MD, group_of(g0 + gi, B, NULL), MD);
    }
    softmoe_scratch_release(0);
    for (long j = first; j < last; j++)
        for (long d = 0; d < Dm; d++)
            for (long k = 0; k < Hd; k++) grad_w1[(j * Dm + d) * Hd + k] = gw1t[((j - first) * Hd + k) * ld + d];
    for (long j = first; j < last; j++)
        for (long k = 0; k < Hd; k++)
            memcpy(grad_w2 + (j * Hd + k) * Dm, gw2 + ((j - first) * Hd + k) * ld, Dm * sizeof(float));
    softmoe_scratch_release(1);
#pragma omp barrier
    const long total = B * MD, end = total * (t + 1) / count;
    for (long other = 1; other < count; other++) {
        const float *part = partials[other];
        for (long i = total * t / count; i < end; i++) grad_x[i] += part[i];
    }
}

/* Gradients, for the arguments of soft_moe_small_forward and its `saved` (keep as given to it): grad_x (B, M, Dm),
 * grad_dispatch, grad_combine (B, M, S); grad_w1, grad_b1, grad_w2, grad_b2 like the weights (grad_b1 / grad_b2 may
 * be NULL). Threads split the experts; each writes its share of grad_x whole (the first into grad_x, the others
 * into partial sums in their scratch memory), and the threads then add the partials up, a range of rows each.
 * Inputs are taken GROUP_BLOCK groups at a time; for each block every thread runs through its experts' slots,
 * keeping the block's slot vectors and gradients, and adds the block's products to its weight gradients (w1's
 * summed transposed, (Hd, Dm) per expert, so that its rows run along dim like those of w2's, and put in w1's layout
 * at the end). Returns 0, or 1 when M is outside 1..MAX_TOKENS. */
int soft_moe_small_backward(const float *grad_out, const float *x, const float *dispatch, const float *combine,
                            const float *w1, const float *w2, const float *b2, const float *saved,
                            float *grad_x, float *grad_dispatch, float *grad_combine, float *grad_w1,
                            float *grad_b1, float *grad_w2, float *grad_b2, long B, long M, long S, long P, long Hd,
                            long Dm, int keep, int threads)
{
    const long n = S / P, G = (B + LANES - 1) / LANES, MD = M * Dm, ld = (Dm + LANES - 1) / LANES * LANES;
    const long W = keep ? Hd + Dm : Hd;
    if (M < 1 || M > MAX_TOKENS) return 1;
    if (n <= 0) return 0;
    if (threads > n) threads = (int)n;
    if (threads < 1) threads = 1;
    float **partials = (float **)malloc(threads * sizeof(float *)); /* thread t's partial sum of grad_x, t >= 1 */
#pragma omp parallel num_threads(threads)
    {
#define BACKWARD(pairs, groups)                                                                                       \
    backward_thread(grad_out, x, dispatch, combine, w1, w2, b2, saved, grad_x, partials, grad_dispatch, grad_combine, \
                    grad_w1, grad_b1, grad_w2, grad_b2, B, M, S, P, Hd, Dm, keep, n, G, MD, ld, W, pairs, groups)
        if (PAIR_MAX_HIDDEN > 0 && !keep && M == 4 && Hd <= PAIR_MAX_HIDDEN)
            BACKWARD(1, 1);
        else if (SIDE_GROUPS == 2 && Hd >= BACKWARD_GROUPS_MIN_HIDDEN)
            BACKWARD(0, 2);
        else
            BACKWARD(0, 1);
#undef BACKWARD
    }
    free(partials);
    return 0;
}

} /* namespace SOFTMOE_NS */
