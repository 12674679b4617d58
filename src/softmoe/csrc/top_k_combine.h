/* Algorithm 1's choice of experts from a layer's combine weights: the kernel source of softmoe::top_k_combine,
 * compiled once per instruction set by top_k_combine_{avx512,avx2,portable}.cpp (see variant.h).
 *
 * For combine (B, M, S) with S = n * P slots (expert j's slots j * P ... j * P + P - 1), per input b:
 *
 *   score[j]    = sum over tokens and expert j's slots of combine                  (in double)
 *   selected[b] = the k experts of largest score, ascending (NaN largest, ties to the lower index)
 *   kept[b]     = combine[b] with the slots of the other experts zeroed (NaN too)
 *
 * The ranking is that of an unsigned 64-bit key per score (larger scores larger keys, NaN the largest, -0 as +0),
 * found without a sort or a data-dependent branch per expert: up to RANK_MAX_EXPERTS experts by counting each one's
 * rank; beyond, by the k-th largest key, on the keys' high halves first (as 32-bit integers in the same order), by
 * bisection on counts, each count one vectorized pass over the experts, then on the low halves of the keys that share
 * the k-th high half. std::nth_element on the keys was slower: its comparisons mispredicted.
 * C++ compatible C: no system header is included here.
 */
#if !defined(SOFTMOE_LANES) || !defined(SOFTMOE_NS)
#error "top_k_combine.h is included by a variant unit that defines SOFTMOE_LANES and SOFTMOE_NS (see variant.h)"
#endif

namespace SOFTMOE_NS {

/* The order key of a score, as top_k_combine's comment says. */
static inline uint64_t order_key(double score)
{
    uint64_t bits;
    const double v = score + 0.0; /* -0 becomes +0 */
    memcpy(&bits, &v, sizeof bits);
    const uint64_t key = bits ^ ((uint64_t)((int64_t)bits >> 63) | ((uint64_t)1 << 63)); /* negative: ~bits */
    return score != score ? ~(uint64_t)0 : key;
}

/* A half of a key as a signed 32-bit integer in the same order (its top bit flipped), and back. */
static inline int32_t signed_half(uint32_t half) { return (int32_t)(half ^ 0x80000000u); }
static inline uint32_t unsigned_half(int32_t half) { return (uint32_t)half ^ 0x80000000u; }

/* How many of the n values are at least t: one vectorized pass. */
static long count_at_least(const int32_t *v, long n, int32_t t)
{
    int32_t count = 0;
    for (long j = 0; j < n; j++) count += v[j] >= t;
    return count;
}

/* The k-th largest of n values (1 <= k <= n): the largest t that at least k values reach, searched between their
 * least and largest by counts, stopped early where exactly k values reach a probe (the k-th is then the least of
 * those). The probes alternate between the point where the counts at the ends, interpolated linearly, reach k (a few
 * counts for values spread smoothly, as the keys of summed combine weights are) and the midpoint (at most twice the
 * 32 counts of a bisection whatever the values). */
static int32_t kth_largest(const int32_t *v, long n, long k)
{
    int32_t least = INT32_MAX, most = INT32_MIN;
    for (long j = 0; j < n; j++) {
        least = v[j] < least ? v[j] : least;
        most = v[j] > most ? v[j] : most;
    }
    if (k == n) return least;
    long lo = least, hi = most, at_lo = n, at_hi = count_at_least(v, n, most); /* at_lo >= k > at_hi */
    if (at_hi >= k) return most;
    for (int interpolate = 1; hi - lo > 1; interpolate = !interpolate) {
        long mid = lo + (hi - lo) / 2;
        if (interpolate) {
            mid = lo + (long)((double)(hi - lo) * (double)(at_lo - k) / (double)(at_lo - at_hi));
            mid = mid <= lo ? lo + 1 : mid >= hi ? hi - 1 : mid;
        }
        const long count = count_at_least(v, n, (int32_t)mid);
        if (count == k) {
            const int32_t t = (int32_t)mid; /* (32-bit comparisons: the loop vectorizes) */
            int32_t kth = INT32_MAX;
            for (long j = 0; j < n; j++) { /* the least of the values >= t, as bit masks: a vectorized minimum */
                const int32_t at_least = -(int32_t)(v[j] >= t), above = (v[j] & at_least) | (INT32_MAX & ~at_least);
                kth = above < kth ? above : kth;
            }
            return kth;
        }
        if (count > k)
            lo = mid, at_lo = count;
        else
            hi = mid, at_hi = count;
    }
    return (int32_t)lo;
}

/* keep[j] all ones for the k largest of the n keys (ties to the lower index), else zero: the k-th largest high half,
 * and where the keys of that high half are as many as the places left (nearly always) every key of a high half at
 * least that; otherwise the k-th largest key by its low half among the keys of that high half (high, low, tied:
 * scratch of n each), then every key above it and, of those at it, the lowest indices. */
static void select_kept(const uint64_t *key, int32_t *high, int32_t *low, int32_t *tied, uint32_t *keep, long n,
                        long k)
{
    for (long j = 0; j < n; j++) high[j] = signed_half((uint32_t)(key[j] >> 32));
    const int32_t top = kth_largest(high, n, k);
    const long above = top < INT32_MAX ? count_at_least(high, n, top + 1) : 0;
    if (count_at_least(high, n, top) == k) {
        for (long j = 0; j < n; j++) keep[j] = high[j] >= top ? ~0u : 0u;
        return;
    }
    long ties = 0;
    for (long j = 0; j < n; j++) low[j] = signed_half((uint32_t)key[j]);
    for (long j = 0; j < n; j++)
        if (high[j] == top) tied[ties++] = low[j];
    const uint64_t at = (uint64_t)unsigned_half(top) << 32 | unsigned_half(kth_largest(tied, ties, k - above));
    long left = k, equal = 0;
    for (long j = 0; j < n; j++) {
        left -= key[j] > at;
        equal += key[j] == at;
    }
    if (equal == left) {
        for (long j = 0; j < n; j++) keep[j] = key[j] >= at ? ~0u : 0u;
    } else {
        for (long j = 0; j < n; j++) {
            const int tie = key[j] == at;
            keep[j] = (key[j] > at) | (tie & (left > 0)) ? ~0u : 0u;
            left -= tie;
        }
    }
}

/* Up to this many experts each expert's rank is counted instead (n^2 comparisons in vectors): faster than the
 * selection above for few experts, slower beyond as n^2 grows (docs/performance.md has the measurements). */
#define RANK_MAX_EXPERTS 16

/* The experts kept as words of bits, 64 to a word: keep (n, all ones or zero) -> bits (ceil(n / 64)). */
static void kept_words(const uint32_t *keep, uint64_t *bits, long n)
{
    for (long j0 = 0; j0 < n; j0 += 64) {
        const long width = n - j0 < 64 ? n - j0 : 64;
        uint64_t word = 0;
        for (long i = 0; i < width; i++) word |= (uint64_t)(keep[j0 + i] & 1) << i;
        bits[j0 / 64] = word;
    }
}

/* The bits of a word of `width` experts that are not kept. */
static inline uint64_t dropped_in(uint64_t word, long width)
{
    return ~word & (width == 64 ? ~(uint64_t)0 : ((uint64_t)1 << width) - 1);
}

/* out[count ...] = first ... end - 1 (a vectorized store); the count after them. */
static inline long write_run(int64_t *out, long count, long first, long end)
{
    for (long i = 0; i < end - first; i++) out[count + i] = first + i;
    return count + (end > first ? end - first : 0);
}

/* The kept experts in ascending order from their words of bits: in a word keeping at most half its experts the set
 * bits one at a time (count trailing zeros), in one keeping more the runs between the clear bits (at k = n - 1 one
 * bit at a time took much of the choice's time: each step waits on the last). */
static void kept_in_order(const uint64_t *bits, long n, int64_t *out)
{
    long count = 0;
    for (long j0 = 0; j0 < n; j0 += 64) {
        const long width = n - j0 < 64 ? n - j0 : 64;
        uint64_t word = bits[j0 / 64];
        if (2 * __builtin_popcountll(word) <= width) {
            for (; word; word &= word - 1) out[count++] = j0 + __builtin_ctzll(word);
            continue;
        }
        long first = j0;
        for (uint64_t gaps = dropped_in(word, width); gaps; gaps &= gaps - 1) {
            const long gap = j0 + __builtin_ctzll(gaps);
            count = write_run(out, count, first, gap);
            first = gap + 1;
        }
        count = write_run(out, count, first, j0 + width);
    }
}

/* The scratch top_k_input takes for S slots of P per expert: the scores, the keys and their halves, the low halves of
 * the keys tied at the k-th high half, per expert all ones where kept and their words of bits, per slot all ones
 * where kept. */
long top_k_scratch_bytes(long S, long P)
{
    const long n = S / P;
    return 8 * n + 8 * n + 4 * n * 4 + 8 * ((n + 63) / 64) + 4 * S;
}

/* One input's choice, as the comment at the top says: cb (M, S) -> kept (M, S; cb itself may be given: each value is
 * read before it is written), selected (k; NULL: not written), slots (ceil(S / 64) words, bit s % 64 of word s / 64
 * set for each slot s of a kept expert; NULL: not written); scratch of top_k_scratch_bytes(S, P). */
void top_k_input(const float *cb, float *kept, int64_t *selected, uint64_t *slots, long M, long S, long P, long k,
                 void *scratch)
{
    const long n = S / P, words = (n + 63) / 64;
    double *score = (double *)scratch;
    uint64_t *key = (uint64_t *)(score + n), *bits = key + n;
    int32_t *high = (int32_t *)(bits + words), *low = high + n, *tied = low + n;
    uint32_t *keep = (uint32_t *)(tied + n), *mask = keep + n;
    for (long j = 0; j < n; j++) score[j] = 0.0;
    long m = 0;
    if (P == 1) /* the common case, in vectors, four tokens a pass (added in the same order) */
        for (; m + 4 <= M; m += 4) {
            const float *r0 = cb + m * S, *r1 = r0 + S, *r2 = r1 + S, *r3 = r2 + S;
            for (long j = 0; j < n; j++) score[j] = (((score[j] + r0[j]) + r1[j]) + r2[j]) + r3[j];
        }
    for (; m < M; m++) {
        const float *row = cb + m * S;
        if (P == 1)
            for (long j = 0; j < n; j++) score[j] += row[j];
        else
            for (long j = 0; j < n; j++)
                for (long i = 0; i < P; i++) score[j] += row[j * P + i];
    }
    for (long j = 0; j < n; j++) key[j] = order_key(score[j]);
    if (n <= RANK_MAX_EXPERTS) { /* each expert's rank: how many come before it */
        for (long j = 0; j < n; j++) {
            long rank = 0;
            for (long i = 0; i < n; i++) rank += (key[i] > key[j]) | ((key[i] == key[j]) & (i < j));
            keep[j] = rank < k ? ~0u : 0u;
        }
    } else {
        select_kept(key, high, low, tied, keep, n, k);
    }
    kept_words(keep, bits, n);
    if (selected) kept_in_order(bits, n, selected);
    if (P > 1)
        for (long j = 0; j < n; j++)
            for (long i = 0; i < P; i++) mask[j * P + i] = keep[j];
    if (slots && P == 1)
        memcpy(slots, bits, words * sizeof(uint64_t));
    else if (slots)
        kept_words(mask, slots, S);
    if ((n - k) * SOFTMOE_LANES <= n) { /* few dropped: their slots zeroed one by one (NaN too) */
        if (kept != cb) memcpy(kept, cb, M * S * sizeof(float));
        for (long j0 = 0; j0 < n; j0 += 64)
            for (uint64_t gaps = dropped_in(bits[j0 / 64], n - j0 < 64 ? n - j0 : 64); gaps; gaps &= gaps - 1)
                for (long m = 0; m < M; m++)
                    memset(kept + m * S + (j0 + __builtin_ctzll(gaps)) * P, 0, P * sizeof(float));
        return;
    }
    for (long m = 0; m < M; m++) { /* zeros (NaN too) outside the kept slots */
        const uint32_t *row = (const uint32_t *)(cb + m * S);
        uint32_t *o = (uint32_t *)(kept + m * S);
        for (long s = 0; s < S; s++) o[s] = row[s] & (P == 1 ? keep : mask)[s];
    }
}

/* combine (B, M, S) -> kept (B, M, S), selected (B, k) as the comment at the top says; `threads` OpenMP threads
 * split the inputs. */
void top_k_combine(const float *combine, float *kept, int64_t *selected, long B, long M, long S, long P, long k,
                   int threads)
{
    if (threads > B) threads = (int)B;
    if (threads < 1) threads = 1;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        void *scratch = softmoe_scratch(0, top_k_scratch_bytes(S, P));
#pragma omp for schedule(static)
        for (long b = 0; b < B; b++)
            top_k_input(combine + b * M * S, kept + b * M * S, selected + b * k, NULL, M, S, P, k, scratch);
        softmoe_scratch_release(0);
    }
}

} /* namespace SOFTMOE_NS */
