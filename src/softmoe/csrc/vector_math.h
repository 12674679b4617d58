/* Vectors of SOFTMOE_LANES floats and the elementwise math the kernels share (expert_matmul.h, soft_moe_routing.h):
 * included inside a variant's namespace (see variant.h), after LANES is defined. No system header. */

typedef float vec __attribute__((vector_size(LANES * 4), aligned(4))); /* loads and stores at any float address */
typedef int32_t ivec __attribute__((vector_size(LANES * 4), aligned(4)));

static inline vec splat(float s) { return vec{} + s; }
static inline vec load(const float *p) { return *(const vec *)p; }
static inline void store(float *p, vec v) { *(vec *)p = v; }

/* lanes of a where mask is set (all ones), of b elsewhere */
static inline vec choose(ivec mask, vec a, vec b) { return (vec)((mask & (ivec)a) | (~mask & (ivec)b)); }
static inline vec absolute(vec v) { return (vec)((ivec)v & 0x7fffffff); }

/* e^y for y <= 0, relative error about 2e-7 (y below -87 gives 0): y = k ln2 + r with |r| <= ln2 / 2 (ln2 split in
   a high and a low part), e^r by its Taylor series to r^7, 2^k written into the exponent bits. */
static inline vec exp_nonpositive(vec y)
{
    const vec lo = splat(-87.0f);
    y = choose((ivec)(y < lo), lo, y);
    const ivec k = __builtin_convertvector(y * 1.44269504f - 0.5f, ivec);
    const vec kf = __builtin_convertvector(k, vec);
    const vec r = (y - kf * 0.693145752f) - kf * 1.42860677e-6f;
    vec p = splat(1.0f / 5040.0f);
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const vec scale = (vec)((k + 127) << 23);
    return choose((ivec)(y <= lo), vec{}, p * scale);
}
