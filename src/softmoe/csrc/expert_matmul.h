/* Batched float32 matmuls for experts that see few rows each: the kernel source of softmoe::expert_matmul and its
 * backward ops, compiled once per instruction set by expert_matmul_{avx512,avx2,portable}.cpp (see variant.h),
 * each copy in its own namespace SOFTMOE_NS with SOFTMOE_LANES float lanes per vector.
 *
 * With E experts, each with its own weight, and M rows per expert:
 *
 *   expert_matmul     out[e] = act(x[e] @ w[e] (+ bias[e]))   x (E, M, K), w (E, K, N), bias (E, N), out (E, M, N)
 *   expert_matmul_nt  out[e] = g[e] @ w[e]^T             g (E, M, N), w (E, K, N),            out (E, M, K)
 *   expert_matmul_tn  out[e] = xt[e]^T @ g[e]            xt (E, M, K), g (E, M, N),           out (E, K, N)
 *
 * All tensors are contiguous, row-major. With few rows (M around 8) these products read every weight once and do
 * only 2*M FLOPs per weight: they are bound by memory bandwidth, which BLAS libraries tuned for large products do
 * not reach here (MKL reads the weights well below the rate of a plain copy; docs/performance.md has the measurements).
 * The kernels below keep the whole (rows x 48 columns) output tile in registers, walk the weight in panels of
 * PANEL rows and prefetch the next panel linearly while computing on the current one, so the memory system streams
 * while the FMA units work. The weight gradient is written with non-temporal stores where rows are 64-byte aligned
 * (no read of the destination before it is overwritten). Threads: OpenMP, work split over (expert, column range)
 * items, as many threads as torch uses. The extension is linked with -fopenmp and binds to the libgomp.so.1 that
 * torch has already loaded, so both share one thread pool (a second pool would compete with torch's spinning
 * threads).
 *
 * C++ compatible C: no system header is included here (variant.h includes them before the target pragma).
 */
#if !defined(SOFTMOE_LANES) || !defined(SOFTMOE_NS)
#error "expert_matmul.h is included by a variant unit that defines SOFTMOE_LANES and SOFTMOE_NS (see variant.h)"
#endif

namespace SOFTMOE_NS {

#define LANES SOFTMOE_LANES
#if LANES == 16
#define MAX_ROWS 8
#else
#define MAX_ROWS 4
#endif

#include "vector_math.h"

#define TILE_VECS 3                     /* output tile width in vectors */
#define TILE_COLS (TILE_VECS * LANES)
#define PANEL 32                        /* weight rows per panel */
#define OUT_BLOCK_BYTES (256 << 10)     /* output kept in cache while the panels pass (nn_item) */
#define NEAR_PANEL_BYTES (128 << 10)    /* panels up to this size prefetch one panel ahead (nn_item) */
#define WIDE_AHEAD_COLS 96              /* wider panels prefetch this many columns ahead of the tile (nn_item) */
/* A wide block is wider than WIDE_AHEAD_COLS (the prefetch wraps into the next panel's first columns), and whole
   tiles fit in the distance (no prefetched tile straddles the block's end). */
static_assert(WIDE_AHEAD_COLS % TILE_COLS == 0 && WIDE_AHEAD_COLS * PANEL * 4 < NEAR_PANEL_BYTES,
              "WIDE_AHEAD_COLS: whole tiles, and less than a wide block");
/* With AVX-512 a block of columns is at most as wide as a panel that prefetches one panel ahead (the wide prefetch
   below is then never needed): at 2-12 rows the weights are read closer to the rate of a plain read than through one
   wide block; 16-48 rows (bound by the FMA units there) neither gain nor lose. With AVX2 (two passes of 4 rows, the
   later one reading a copy of the tile) the narrow blocks were slower through 768 x 3072 and 768 x 30720, so AVX2
   and the portable code keep one block (docs/performance.md has the measurements). */
#if LANES == 16
#define BLOCK_MAX_COLS (NEAR_PANEL_BYTES / (4 * PANEL) / TILE_COLS * TILE_COLS)
#else
#define BLOCK_MAX_COLS (1L << 40)
#endif
#define LINE 64
#define PACK_MIN_ROW_BYTES 4096    /* weight rows this long: passes over a tile read a copy of it (nn_item) */


static inline void store_stream(float *p, vec v)
{
#if SOFTMOE_X86 && LANES == 16
    _mm512_stream_ps(p, (__m512)v);
#elif SOFTMOE_X86 && LANES == 8
    _mm256_stream_ps(p, (__m256)v);
#else
    store(p, v);
#endif
}

static inline void stream_fence()
{
#if SOFTMOE_X86 && LANES >= 8
    _mm_sfence();
#endif
}

/* ---- activations, applied to the output of expert_matmul -------------------------------------------------- */

enum { ACT_NONE = 0, ACT_GELU = 1, ACT_GELU_TANH = 2, ACT_RELU = 3 };

/* gelu(x) = x Phi(x), with erf by Abramowitz and Stegun 7.1.26 (absolute error below 1.5e-7): for z = |x| / sqrt 2,
   1 - erf(z) = t (a1 + t (a2 + ...)) e^(-z^2), t = 1 / (1 + p z); then gelu = x - q for x >= 0 and q for x < 0,
   q = x (1 - erf(z)) / 2. */
static inline vec gelu_erf(vec x)
{
    const vec z = absolute(x) * 0.707106781f;
    const vec t = 1.0f / (1.0f + 0.3275911f * z);
    vec poly = splat(1.061405429f);
    poly = poly * t - 1.453152027f;
    poly = poly * t + 1.421413741f;
    poly = poly * t - 0.284496736f;
    poly = poly * t + 0.254829592f;
    const vec q = 0.5f * x * (poly * t) * exp_nonpositive(-z * z);
    return choose((ivec)(x >= 0), x - q, q);
}

/* gelu with tanh: x (1 + tanh(u)) / 2, u = sqrt(2 / pi) (x + 0.044715 x^3), tanh(|u|) = (1 - w) / (1 + w) with
   w = e^(-2 |u|). */
static inline vec gelu_tanh(vec x)
{
    const vec u = 0.797884561f * (x + 0.044715f * x * x * x);
    const vec w = exp_nonpositive(-2.0f * absolute(u));
    const vec th = (1.0f - w) / (1.0f + w);
    return 0.5f * x * (1.0f + choose((ivec)(u < 0), -th, th));
}

static inline vec activate(vec v, int act)
{
    switch (act) {
    case ACT_GELU: return gelu_erf(v);
    case ACT_GELU_TANH: return gelu_tanh(v);
    case ACT_RELU: return choose((ivec)(v <= 0), vec{}, v); /* NaN stays NaN */
    default: return v;
    }
}

/* out[r * ldo + c] = act(out[r * ldo + c]) for r < M, c0 <= c < c1 */
static void activate_rows(float *out, long ldo, long M, long c0, long c1, int act)
{
    if (act == ACT_NONE) return;
    for (long r = 0; r < M; r++) {
        float *row = out + r * ldo;
        long c = c0;
        for (; c + LANES <= c1; c += LANES) *(vec *)(row + c) = activate(*(vec *)(row + c), act);
        if (c < c1) {
            vec tail = {0};
            for (long i = 0; i < c1 - c; i++) tail[i] = row[c + i];
            tail = activate(tail, act);
            for (long i = 0; i < c1 - c; i++) row[c + i] = tail[i];
        }
    }
}

/* ---- work splitting -------------------------------------------------------------------------------------- */

typedef struct job job_t;
typedef void (*item_fn)(const job_t *, long expert, long split, long begin, long end);

struct job {
    const float *a, *b, *bias;
    float *out;
    long M, K, N;
    long units, splits;  /* units (tiles or rows) per expert, split into `splits` ranges */
    float *partial;      /* per (expert, split) output rows where a split's sum is partial (row_item) */
    int stream;          /* non-temporal stores allowed */
    int act;             /* activation applied to the output (ACT_*) */
    item_fn fn;
};

static void run_items(const job_t *j, long first, long last)
{
    for (long item = first; item < last; item++) {
        long e = item / j->splits, s = item % j->splits;
        long begin = j->units * s / j->splits, end = j->units * (s + 1) / j->splits;
        if (begin < end) j->fn(j, e, s, begin, end);
    }
}

/* The ranges each expert's units are split into: with fewer experts than threads, enough to give every thread one. */
static long split_count(long experts, long units, int threads)
{
    if (threads < 1) threads = 1;
    long splits = experts >= threads ? 1 : (threads + experts - 1) / experts;
    return splits > units ? (units > 0 ? units : 1) : splits;
}

/* Items are (expert, range of units); with fewer experts than threads each expert's units are split. */
static void run_parallel(job_t job, long experts, int threads)
{
    if (experts <= 0) return;
    if (threads < 1) threads = 1;
    job.splits = split_count(experts, job.units, threads);
    const long items = experts * job.splits;
    if (threads > items) threads = (int)items;
#pragma omp parallel num_threads(threads)
    {
        const long t = omp_get_thread_num(), count = omp_get_num_threads();
        run_items(&job, items * t / count, items * (t + 1) / count);
    }
}

/* ---- out = x @ w (+ bias) ---------------------------------------------------------------------------------- */

/* out[R, V*LANES] += x[R, kn] @ w[kn, V*LANES]; also prefetches the same rows of `ahead` (a tile further down w) and
   copies the tile of w into `pack` (kn rows of V*LANES floats) where given. */
static inline __attribute__((always_inline)) void nn_tile(const float *x, long ldx, const float *w, long ldw,
                                                         float *out, long ldo, long kn, const int R, const int V,
                                                         const char *ahead, float *pack)
{
    vec acc[MAX_ROWS][TILE_VECS];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < V; v++) acc[r][v] = load(out + r * ldo + v * LANES);
    for (long k = 0; k < kn; k++) {
        const float *wk = w + k * ldw;
        if (ahead)
            for (int q = 0; q < V * LANES * 4; q += LINE) __builtin_prefetch(ahead + k * ldw * 4 + q, 0, 2);
        vec wv[TILE_VECS];
        for (int v = 0; v < V; v++) wv[v] = load(wk + v * LANES);
        if (pack)
            for (int v = 0; v < V; v++) store(pack + (k * V + v) * LANES, wv[v]);
        for (int r = 0; r < R; r++) {
            float s = x[r * ldx + k];
            for (int v = 0; v < V; v++) acc[r][v] += s * wv[v];
        }
    }
    for (int r = 0; r < R; r++)
        for (int v = 0; v < V; v++) store(out + r * ldo + v * LANES, acc[r][v]);
}

#define ROW_CASES(call)          \
    switch (R) {                 \
    case 1: call(1); break;      \
    case 2: call(2); break;      \
    case 3: call(3); break;      \
    case 4: call(4); break;      \
    ROW_CASES_WIDE(call)         \
    }
/* A tile kernel compiled for each row count (1..MAX_ROWS) and both widths, so that its loops unroll fully. */
#define SPECIALIZE(wide, call_wide, call_narrow) \
    do {                                         \
        if (wide) {                              \
            ROW_CASES(call_wide)                 \
        } else {                                 \
            ROW_CASES(call_narrow)               \
        }                                        \
    } while (0)
#if MAX_ROWS == 8
#define ROW_CASES_WIDE(call) \
    case 5: call(5); break;  \
    case 6: call(6); break;  \
    case 7: call(7); break;  \
    case 8: call(8); break;
#else
#define ROW_CASES_WIDE(call)
#endif

static void nn_tile_any(const float *x, long ldx, const float *w, long ldw, float *out, long ldo, long kn, int R,
                        int V, const char *ahead, float *pack)
{
#define NN_WIDE(r) nn_tile(x, ldx, w, ldw, out, ldo, kn, r, TILE_VECS, ahead, pack)
#define NN_ONE(r) nn_tile(x, ldx, w, ldw, out, ldo, kn, r, 1, ahead, pack)
    SPECIALIZE(V == TILE_VECS, NN_WIDE, NN_ONE);
#undef NN_WIDE
#undef NN_ONE
}

/* One expert, output column tiles [begin, end) (the last tile may be narrower). The columns are walked in blocks
   whose output (M rows) stays in L2 while every panel of the weight passes through it: a wide output (768 -> 30720
   columns at 25 rows is 3 MB) would otherwise be read and written once per panel, as much traffic as the weight. */
static void nn_item(const job_t *j, long e, long split, long begin, long end)
{
    const long M = j->M, K = j->K, N = j->N;
    const float *x = j->a + e * M * K, *w = j->b + e * K * N;
    const float *bias = j->bias ? j->bias + e * N : NULL;
    float *out = j->out + e * M * N;
    const long c0 = begin * TILE_COLS, c1 = end * TILE_COLS < N ? end * TILE_COLS : N;
    const long vec_end = c0 + (c1 - c0) / LANES * LANES;
    long block = OUT_BLOCK_BYTES / (4 * (M > 0 ? M : 1)) / TILE_COLS * TILE_COLS;
    if (block > BLOCK_MAX_COLS) block = BLOCK_MAX_COLS;
    if (block < TILE_COLS) block = TILE_COLS;
    for (long r = 0; r < M; r++)
        for (long c = c0; c < c1; c++) out[r * N + c] = bias ? bias[c] : 0.0f;
    for (long b0 = c0, last = 0; !last; b0 += block) { /* once at least, for the tail columns */
        const long b1 = vec_end - b0 > block ? b0 + block : vec_end;
        const int near = PANEL * (b1 - b0) * 4 <= NEAR_PANEL_BYTES;
        last = b1 == vec_end;
        for (long k0 = 0; k0 < K; k0 += PANEL) {
            const long kn = K - k0 < PANEL ? K - k0 : PANEL;
            for (long c = b0; c < b1;) {
                const int V = b1 - c >= TILE_COLS ? TILE_VECS : 1;
                /* While a tile runs over this panel, a later tile is prefetched, row for row. Through a narrow
                   block (a panel of at most NEAR_PANEL_BYTES) the same tile of the next panel, one panel ahead
                   (past the last panel, the next expert's weight: a prefetch past the end is only a hint). Through a
                   wide one that tile would come megabytes later, evicted before use: there the columns
                   WIDE_AHEAD_COLS further on in the order the tiles run (this panel, else the next panel's first
                   columns, else the next block's first panel), so that each weight row is streamed in order. One
                   tile ahead (48 columns with AVX-512, 24 with AVX2) left the loads too little time; WIDE_AHEAD_COLS
                   ahead, wide weights stream as fast as narrow ones (docs/performance.md has the measurements). */
                const long next = c + V * LANES, far = c + WIDE_AHEAD_COLS;
                const float *ahead = near ? w + (k0 + kn) * N + c
                                   : far < b1 ? w + k0 * N + far
                                   : k0 + kn < K ? w + (k0 + kn) * N + b0 + (far - b1) : w + far;
                /* More rows than registers hold (MAX_ROWS) run in passes over the tile. Where w's rows lie at least
                   PACK_MIN_ROW_BYTES apart the first pass copies the tile into `packed` and the later ones read that:
                   in w the tile's rows had left L1 by the next pass. Through weights of shorter rows (30720 x 768,
                   1536 x 384) the copy made no difference or cost a little (docs/performance.md has the
                   measurements). */
                float packed[PANEL * TILE_COLS] __attribute__((aligned(64)));
                const int R0 = M < MAX_ROWS ? (int)M : MAX_ROWS, pack = M > MAX_ROWS && N * 4 >= PACK_MIN_ROW_BYTES;
                nn_tile_any(x + k0, K, w + k0 * N + c, N, out + c, N, kn, R0, V, (const char *)ahead,
                            pack ? packed : NULL);
                for (long r = MAX_ROWS; r < M; r += MAX_ROWS) {
                    const int R = M - r < MAX_ROWS ? (int)(M - r) : MAX_ROWS;
                    nn_tile_any(x + r * K + k0, K, pack ? packed : w + k0 * N + c, pack ? V * LANES : N,
                                out + r * N + c, N, kn, R, V, NULL, NULL);
                }
                c = next;
            }
            if (last) /* the columns past the last whole vector, with the last block */
                for (long r = 0; r < M; r++)
                    for (long c = vec_end; c < c1; c++) {
                        float s = out[r * N + c];
                        for (long k = k0; k < k0 + kn; k++) s += x[r * K + k] * w[k * N + c];
                        out[r * N + c] = s;
                    }
        }
    }
    activate_rows(out, N, M, c0, c1, j->act);
}

/* ---- one row per expert: out[e] = act(x[e] @ w[e] (+ bias[e])) ---------------------------------------------- */

/* A single row does one multiply-add per weight read: its product is a stream of w. nn_item's tiles read each row of
   w in pieces, tile after tile, which the memory system serves well below the rate of a plain read; here w is read in
   memory order, row after row, into an output row kept in L1. Rows of w of at least ROW_GROUP_MIN_BYTES go
   ROW_GROUP at a time through each pass over the output row (so many bytes of output would otherwise be read and
   written once per row of w); shorter rows one at a time, since ROW_GROUP streams a short row apart were slower
   (docs/performance.md has the measurements). */
#define ROW_GROUP 4
#define ROW_GROUP_MIN_BYTES 4096
#define ROW_SPLIT_MIN_ROWS 64 /* fewest rows of w per range where one expert's rows are split over threads */

/* acc[0:N] += x[k0:k1] @ w[k0:k1, 0:N] (w's rows N floats apart) */
static void row_pass(const float *x, const float *w, float *acc, long k0, long k1, long N)
{
    const long vec_end = N / LANES * LANES;
    long k = k0;
    if (N * 4 >= ROW_GROUP_MIN_BYTES)
        for (; k + ROW_GROUP <= k1; k += ROW_GROUP) {
            const float *w0 = w + k * N, *w1 = w0 + N, *w2 = w1 + N, *w3 = w2 + N;
            const float a0 = x[k], a1 = x[k + 1], a2 = x[k + 2], a3 = x[k + 3];
            for (long c = 0; c < vec_end; c += LANES)
                store(acc + c, load(acc + c) + a0 * load(w0 + c) + a1 * load(w1 + c) + a2 * load(w2 + c) +
                                   a3 * load(w3 + c));
            for (long c = vec_end; c < N; c++) acc[c] += a0 * w0[c] + a1 * w1[c] + a2 * w2[c] + a3 * w3[c];
        }
    for (; k < k1; k++) {
        const float *wk = w + k * N, a = x[k];
        for (long c = 0; c < vec_end; c += LANES) store(acc + c, load(acc + c) + a * load(wk + c));
        for (long c = vec_end; c < N; c++) acc[c] += a * wk[c];
    }
}

/* One expert's rows of w in units of ROW_SPLIT_MIN_ROWS: with fewer experts than threads they are split into ranges
   (run_parallel), whose partial output rows are then summed in a fixed order (the same bits for the same thread
   count). */
static void row_item(const job_t *j, long e, long split, long begin, long end)
{
    const long K = j->K, N = j->N, k0 = begin * ROW_SPLIT_MIN_ROWS, k1 = end == j->units ? K : end * ROW_SPLIT_MIN_ROWS;
    float *acc = j->partial ? j->partial + (e * j->splits + split) * N : j->out + e * N;
    for (long c = 0; c < N; c++) acc[c] = j->bias && !j->partial ? j->bias[e * N + c] : 0.0f;
    row_pass(j->a + e * K, j->b + e * K * N, acc, k0, k1, N);
}

/* x (E, 1, K): the items of row_item, then the partial rows' sums, then the activation. */
static void expert_row(const float *x, const float *w, const float *bias, float *out, long E, long K, long N, int act,
                       int threads)
{
    if (E <= 0) return;
    job_t j{};
    j.a = x; j.b = w; j.bias = bias; j.out = out; j.K = K; j.N = N; j.fn = row_item;
    j.units = K / ROW_SPLIT_MIN_ROWS > 0 ? K / ROW_SPLIT_MIN_ROWS : 1;
    const long splits = split_count(E, j.units, threads);
    if (splits > 1) j.partial = (float *)softmoe_scratch(2, E * splits * N * sizeof(float));
    run_parallel(j, E, threads);
    if (j.partial) {
        for (long e = 0; e < E; e++)
            for (long c = 0; c < N; c++) {
                float sum = bias ? bias[e * N + c] : 0.0f;
                for (long s = 0; s < splits; s++) sum += j.partial[(e * splits + s) * N + c];
                out[e * N + c] = sum;
            }
        softmoe_scratch_release(2);
    }
    activate_rows(out, N, E, 0, N, act);
}

/* act: one of ACT_* (0 none, 1 gelu, 2 gelu with tanh, 3 relu) */
void expert_matmul(const float *x, const float *w, const float *bias, float *out, long E, long M, long K, long N,
                   int act, int threads)
{
    if (M == 1) {
        expert_row(x, w, bias, out, E, K, N, act, threads);
        return;
    }
    job_t j{};
    j.a = x; j.b = w; j.bias = bias; j.out = out; j.M = M; j.K = K; j.N = N;
    j.units = (N + TILE_COLS - 1) / TILE_COLS; j.act = act; j.fn = nn_item;
    run_parallel(j, E, threads);
}

/* ---- out = g @ w^T ----------------------------------------------------------------------------------------- */

#define NT_KROWS 2
#define NT_AHEAD_ROWS 8                 /* prefetch distance down w, in rows */
#define NT_ONE_ROW_BYTES (12 << 10)     /* g up to this size: w one row at a time (nt_item) */
#define NT_ONE_ROW_MIN_COLS 256         /* ... where w's rows are at least this long */
#define NT_SUMS (MAX_ROWS * NT_KROWS)

/* sums[i] = the sum of the lanes of v[i], for i < NT_SUMS. With 16 lanes (and 16 vectors) a tree of 15 pairwise
   shuffle-adds leaves the 16 sums in one vector, instead of 16 scalar reductions. */
static inline void lane_sums(const vec *v, float *sums)
{
#if LANES == 16 && NT_SUMS == 16
    typedef int32_t mask __attribute__((vector_size(64)));
    const mask lo8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const mask hi8 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    const mask lo4 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
    const mask hi4 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
    const mask lo2 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
    const mask hi2 = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
    const mask lo1 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    const mask hi1 = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
    vec a[8], b[4], c[2];
    for (int i = 0; i < 8; i++) a[i] = __builtin_shuffle(v[2 * i], v[2 * i + 1], lo8) + __builtin_shuffle(v[2 * i], v[2 * i + 1], hi8);
    for (int i = 0; i < 4; i++) b[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], lo4) + __builtin_shuffle(a[2 * i], a[2 * i + 1], hi4);
    for (int i = 0; i < 2; i++) c[i] = __builtin_shuffle(b[2 * i], b[2 * i + 1], lo2) + __builtin_shuffle(b[2 * i], b[2 * i + 1], hi2);
    const vec all = __builtin_shuffle(c[0], c[1], lo1) + __builtin_shuffle(c[0], c[1], hi1);
    for (int i = 0; i < 16; i++) sums[i] = all[i];
#else
    for (int i = 0; i < NT_SUMS; i++) {
        float s = 0.0f;
        for (int l = 0; l < LANES; l++) s += v[i][l];
        sums[i] = s;
    }
#endif
}

/* out[r, i] = sum_n g[r, n] w[i, n] for R rows of g and KR rows of w: dot products along contiguous rows of w, each
   prefetched NT_AHEAD_ROWS rows ahead (past the end of w that is only a hint). */
static inline __attribute__((always_inline)) void nt_tile(const float *g, long ldg, const float *w, long N,
                                                         float *out, long ldo, const int R, const int KR)
{
    vec acc[NT_SUMS];
    for (int i = 0; i < NT_SUMS; i++) acc[i] = vec{};
    const long vec_end = N / LANES * LANES;
    for (long n = 0; n < vec_end; n += LANES) {
        vec wv[NT_KROWS];
        for (int i = 0; i < KR; i++) {
            __builtin_prefetch(w + (i + NT_AHEAD_ROWS) * N + n, 0, 2);
            wv[i] = load(w + i * N + n);
        }
        for (int r = 0; r < R; r++) {
            vec gv = load(g + r * ldg + n);
            for (int i = 0; i < KR; i++) acc[r * NT_KROWS + i] += gv * wv[i];
        }
    }
    float sums[NT_SUMS];
    lane_sums(acc, sums);
    for (int r = 0; r < R; r++)
        for (int i = 0; i < KR; i++) {
            float s = sums[r * NT_KROWS + i];
            for (long n = vec_end; n < N; n++) s += g[r * ldg + n] * w[i * N + n];
            out[r * ldo + i] = s;
        }
}

static void nt_tile_any(const float *g, long ldg, const float *w, long N, float *out, long ldo, int R, int KR)
{
#define NT_WIDE(r) nt_tile(g, ldg, w, N, out, ldo, r, NT_KROWS)
#define NT_ONE(r) nt_tile(g, ldg, w, N, out, ldo, r, 1)
    SPECIALIZE(KR == NT_KROWS, NT_WIDE, NT_ONE);
#undef NT_WIDE
#undef NT_ONE
}

/* One expert, weight rows (output columns) [begin, end). Two rows of w at a time take each vector of g once for
   both, but read w in two interleaved streams, which the memory system serves more slowly than one read in memory
   order. Where all of g is one pass of rows (M <= MAX_ROWS) small enough to stay in L1 (NT_ONE_ROW_BYTES) and w's
   rows are long enough for their lane sums to be a small part (NT_ONE_ROW_MIN_COLS), w is read one row at a time.
   Outside those bounds one row at a time was mostly slower (docs/performance.md has the measurements). */
static void nt_item(const job_t *j, long e, long split, long begin, long end)
{
    const long M = j->M, K = j->K, N = j->N;
    const float *g = j->a + e * M * N, *w = j->b + e * K * N;
    float *out = j->out + e * M * K;
    const int pairs = M > MAX_ROWS || M * N * 4 > NT_ONE_ROW_BYTES || N < NT_ONE_ROW_MIN_COLS;
    for (long k = begin; k < end;) {
        const int KR = pairs && end - k >= NT_KROWS ? NT_KROWS : 1;
        for (long r = 0; r < M; r += MAX_ROWS) {
            const int R = M - r < MAX_ROWS ? (int)(M - r) : MAX_ROWS;
            nt_tile_any(g + r * N, N, w + k * N, N, out + r * K + k, K, R, KR);
        }
        k += KR;
    }
}

void expert_matmul_nt(const float *g, const float *w, float *out, long E, long M, long K, long N, int threads)
{
    job_t j{};
    j.a = g; j.b = w; j.out = out; j.M = M; j.K = K; j.N = N; j.units = K; j.fn = nt_item;
    run_parallel(j, E, threads);
}

/* ---- out = xt^T @ g ---------------------------------------------------------------------------------------- */

/* The weight gradient's column tiles are 4 vectors, whole cache lines at every width (256 bytes with AVX-512, 128
   with AVX2, 64 portable), so that each streamed row segment fills its lines: a non-temporal store of part of a
   line leaves the write-combining buffer half full, and the memory system then writes the line in pieces (AVX2
   tiles of 3 vectors, 96 bytes, made the ViT-S weight gradient much slower; docs/performance.md has the
   measurements). */
#define TN_VECS 4
#define TN_COLS (TN_VECS * LANES)

/* out[k, c:c+V*LANES] = sum_r xt[r, k] g[r, c:c+V*LANES] for every k of [0, K). */
static inline __attribute__((always_inline)) void tn_tile(const float *xt, long K, const float *g, long N, long M,
                                                         float *out, const int V, int stream)
{
    for (long k = 0; k < K; k++) {
        vec acc[TN_VECS];
        for (int v = 0; v < V; v++) acc[v] = vec{};
        for (long r = 0; r < M; r++) {
            const float s = xt[r * K + k];
            for (int v = 0; v < V; v++) acc[v] += s * load(g + r * N + v * LANES);
        }
        float *o = out + k * N;
        if (stream)
            for (int v = 0; v < V; v++) store_stream(o + v * LANES, acc[v]);
        else
            for (int v = 0; v < V; v++) store(o + v * LANES, acc[v]);
    }
}

/* One expert, output column tiles [begin, end). */
static void tn_item(const job_t *j, long e, long split, long begin, long end)
{
    const long M = j->M, K = j->K, N = j->N;
    const float *xt = j->a + e * M * K, *g = j->b + e * M * N;
    float *out = j->out + e * K * N;
    const long c0 = begin * TN_COLS, c1 = end * TN_COLS < N ? end * TN_COLS : N;
    const long vec_end = c0 + (c1 - c0) / LANES * LANES;
    for (long c = c0; c < vec_end;) {
        if (vec_end - c >= TN_COLS) {
            tn_tile(xt, K, g + c, N, M, out + c, TN_VECS, j->stream);
            c += TN_COLS;
        } else {
            tn_tile(xt, K, g + c, N, M, out + c, 1, j->stream);
            c += LANES;
        }
    }
    for (long k = 0; k < K; k++)
        for (long c = vec_end; c < c1; c++) {
            float s = 0.0f;
            for (long r = 0; r < M; r++) s += xt[r * K + k] * g[r * N + c];
            out[k * N + c] = s;
        }
    if (j->stream) stream_fence();
}

void expert_matmul_tn(const float *xt, const float *g, float *out, long E, long M, long K, long N, int threads)
{
    /* Non-temporal stores need every output row to start on a 64-byte boundary. */
    const int stream = ((uintptr_t)out % LINE == 0) && ((N * 4) % LINE == 0);
    job_t j{};
    j.a = xt; j.b = g; j.out = out; j.M = M; j.K = K; j.N = N;
    j.units = (N + TN_COLS - 1) / TN_COLS; j.stream = stream; j.fn = tn_item;
    run_parallel(j, E, threads);
}

} /* namespace SOFTMOE_NS */
