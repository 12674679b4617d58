/* softmoe's native kernels behind the ops (one extension, built by softmoe/kernels/build.py): functions on at::Tensor
 * that check their arguments, allocate the outputs and call the kernel variant (see variant.h) named by their `isa`
 * argument, after checking with __builtin_cpu_supports that this CPU runs it. Every op's kernel is registered with
 * the dispatcher here (TORCH_LIBRARY_IMPL at the end; their schemas and fakes are defined in Python, their autograd in
 * autograd.cpp), so that an op's call costs no Python beyond the call. The kernels run on as many OpenMP threads as
 * torch uses (at::get_num_threads()).
 */
/* Only the headers needed (torch/extension.h would triple the build time). */
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/gather.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/addcmul.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "kernels.h"

/* The kernels' scratch memory (declared in variant.h). A block malloc'ed and freed on every call comes back, once
 * glibc returns it to the system, as fresh pages: a page fault and the kernel's zeroing for every 4 KB the kernel
 * touches (the fused small-expert op's backward touches 2.4 MB per thread at the MNIST layer's n = 2, enough for the
 * faults to show in the time per step; docs/performance.md has the measurements). So each thread keeps its blocks, up
 * to SCRATCH_KEEP_BYTES each (glibc's largest mmap threshold; a larger block is freed on release, its faults
 * small next to the work that fills it). OpenMP's threads live as long as the process, and their blocks with them. */
namespace {
constexpr size_t SCRATCH_KEEP_BYTES = size_t(32) << 20;
constexpr int SCRATCH_SLOTS = 3;

struct ScratchBlock {
    void *data = nullptr;
    size_t bytes = 0;
    ~ScratchBlock() { std::free(data); }
};

thread_local ScratchBlock scratch_blocks[SCRATCH_SLOTS];
} // namespace

void *softmoe_scratch(int slot, size_t bytes)
{
    ScratchBlock &block = scratch_blocks[slot];
    if (block.bytes < bytes) {
        std::free(block.data);
        block.bytes = (bytes + 63) / 64 * 64;
        block.data = std::aligned_alloc(64, block.bytes);
        if (!block.data) { /* inside an OpenMP region: no exception can leave it */
            std::fprintf(stderr, "softmoe: out of memory (%zu bytes of a kernel's scratch)\n", block.bytes);
            std::abort();
        }
    }
    return block.data;
}

void softmoe_scratch_release(int slot)
{
    ScratchBlock &block = scratch_blocks[slot];
    if (block.bytes > SCRATCH_KEEP_BYTES) {
        std::free(block.data);
        block.data = nullptr;
        block.bytes = 0;
    }
}

namespace {

struct Variant {
    const char *name;
    int lanes;
    bool (*supported)();
    decltype(&softmoe_portable::expert_matmul) expert_matmul;
    decltype(&softmoe_portable::expert_matmul_nt) expert_matmul_nt;
    decltype(&softmoe_portable::expert_matmul_tn) expert_matmul_tn;
    decltype(&softmoe_portable::soft_moe_small_forward) mixing_forward;
    decltype(&softmoe_portable::soft_moe_small_forward_pairs) mixing_forward_pairs;
    decltype(&softmoe_portable::soft_moe_small_forward_rows) mixing_forward_rows;
    decltype(&softmoe_portable::soft_moe_small_backward) mixing_backward;
    decltype(&softmoe_portable::soft_moe_small_lanes) mixing_lanes;
    decltype(&softmoe_portable::soft_moe_routing_forward) routing_forward;
    decltype(&softmoe_portable::soft_moe_routing_backward) routing_backward;
    decltype(&softmoe_portable::top_k_combine) top_k_combine;
};

#if defined(__x86_64__) || defined(__i386__)
bool has_avx512()
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx2") &&
           __builtin_cpu_supports("fma");
}

bool has_avx2()
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
#endif

bool always() { return true; }

#define SOFTMOE_VARIANT(label, lanes, supported, ns)                                                                  \
    Variant                                                                                                           \
    {                                                                                                                 \
        label, lanes, supported, ns::expert_matmul, ns::expert_matmul_nt, ns::expert_matmul_tn,                      \
            ns::soft_moe_small_forward, ns::soft_moe_small_forward_pairs, ns::soft_moe_small_forward_rows,            \
            ns::soft_moe_small_backward, ns::soft_moe_small_lanes,                                                    \
            ns::soft_moe_routing_forward, ns::soft_moe_routing_backward, ns::top_k_combine                            \
    }

/* Best first: the variant chosen by default is the first this CPU supports. */
const Variant VARIANTS[] = {
#if defined(__x86_64__) || defined(__i386__)
    SOFTMOE_VARIANT("avx512", 16, has_avx512, softmoe_avx512),
    SOFTMOE_VARIANT("avx2", 8, has_avx2, softmoe_avx2),
#endif
    SOFTMOE_VARIANT("portable", 4, always, softmoe_portable),
};

const Variant &variant(const std::string &isa)
{
    for (const Variant &v : VARIANTS)
        if (isa == v.name) {
            TORCH_CHECK(v.supported(), "softmoe: this CPU cannot run the ", isa, " kernels");
            return v;
        }
    TORCH_CHECK(false, "softmoe: no ", isa, " kernels in this build (", sizeof(VARIANTS) / sizeof(VARIANTS[0]),
                " variants: see supported_isas())");
}

/* The ISAs of the variants this CPU runs, best first. */
std::vector<std::string> supported_isas()
{
    std::vector<std::string> names;
    for (const Variant &v : VARIANTS)
        if (v.supported()) names.emplace_back(v.name);
    return names;
}

/* The ISAs of every variant in this build, best first (whether this CPU runs them or not). */
std::vector<std::string> built_isas()
{
    std::vector<std::string> names;
    for (const Variant &v : VARIANTS) names.emplace_back(v.name);
    return names;
}

/* The float lanes of a variant's vectors (16, 8 or 4), as compiled (asked of the variant where this CPU runs it). */
int variant_lanes(const std::string &isa)
{
    for (const Variant &v : VARIANTS)
        if (isa == v.name) {
            if (v.supported())
                TORCH_CHECK(v.mixing_lanes() == v.lanes, "softmoe: the ", isa, " kernels were compiled with ",
                            v.mixing_lanes(), " lanes, not ", v.lanes);
            return v.lanes;
        }
    TORCH_CHECK(false, "softmoe: no ", isa, " kernels in this build");
}

void check_float_cpu(const at::Tensor &t, const char *name, int64_t dim)
{
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, "softmoe: ", name,
                " must be a float32 CPU tensor, got ", t.scalar_type(), " on ", t.device());
    TORCH_CHECK(t.dim() == dim, "softmoe: ", name, " must have ", dim, " dimensions, got ", t.sizes());
}

void check_shape(const at::Tensor &t, const char *name, at::IntArrayRef shape)
{
    TORCH_CHECK(t.sizes() == shape, "softmoe: ", name, " must have shape ", shape, ", got ", t.sizes());
}

const float *pointer(const c10::optional<at::Tensor> &t) { return t ? t->data_ptr<float>() : nullptr; }

int threads() { return at::get_num_threads(); }

/* The code of an activation the expert matmul applies to its output (ACT_* of expert_matmul.h). */
int64_t activation_code(c10::string_view activation)
{
    static const char *const names[] = {"none", "gelu", "gelu_tanh", "relu"};
    for (int64_t code = 0; code < 4; code++)
        if (activation == names[code]) return code;
    TORCH_CHECK_VALUE(false, "activation must be one of ['gelu', 'gelu_tanh', 'none', 'relu'], got '",
                      std::string(activation), "'");
}

/* act(x @ weight (+ bias)): x (E, M, K), weight (E, K, N), bias (E, N) -> (E, M, N); activation "none", "gelu",
 * "gelu_tanh" or "relu". */
at::Tensor expert_matmul(const at::Tensor &x_in, const at::Tensor &weight_in, const c10::optional<at::Tensor> &bias_in,
                         c10::string_view activation, c10::string_view isa)
{
    const Variant &v = variant(std::string(isa));
    const int64_t act = activation_code(activation);
    check_float_cpu(x_in, "x", 3);
    check_float_cpu(weight_in, "weight", 3);
    const int64_t E = x_in.size(0), M = x_in.size(1), K = x_in.size(2), N = weight_in.size(2);
    check_shape(weight_in, "weight", {E, K, N});
    c10::optional<at::Tensor> bias;
    if (bias_in) {
        check_float_cpu(*bias_in, "bias", 2);
        check_shape(*bias_in, "bias", {E, N});
        bias = bias_in->contiguous();
    }
    const at::Tensor x = x_in.contiguous(), weight = weight_in.contiguous();
    at::Tensor out = at::empty({E, M, N}, x.options());
    v.expert_matmul(x.data_ptr<float>(), weight.data_ptr<float>(), pointer(bias), out.data_ptr<float>(), E, M, K, N,
                    (int)act, threads());
    return out;
}

/* Algorithm 1's selected plan for inference, every step in this call: x (B, T, D) the slot inputs, dispatch and
 * combine (B, T, n * p), selected (B, k) int64 (-1: an unused place), w1 (n, D, H), b1 (n, H), w2 (n, H, O), b2 (n, O)
 * -> (B, T, O). The slots of each input's kept experts (D_kept^T X), each kept expert's MLP (act between its layers)
 * on the slots of the inputs that keep it, grouped by expert so that each expert's weights are read once (the
 * expert matmul's kernel), and the combine (C_kept Y); an unused place contributes nothing. */
at::Tensor selected_mixing(const at::Tensor &x, const at::Tensor &dispatch, const at::Tensor &combine,
                           const at::Tensor &selected_in, const at::Tensor &w1_in, const c10::optional<at::Tensor> &b1_in,
                           const at::Tensor &w2_in, const c10::optional<at::Tensor> &b2_in, int64_t p,
                           c10::string_view activation, c10::string_view isa)
{
    const Variant &v = variant(std::string(isa));
    const int64_t act = activation_code(activation);
    check_float_cpu(x, "x", 3);
    check_float_cpu(dispatch, "dispatch", 3);
    check_float_cpu(combine, "combine", 3);
    check_float_cpu(w1_in, "w1", 3);
    check_float_cpu(w2_in, "w2", 3);
    const int64_t B = x.size(0), T = x.size(1), D = x.size(2), n = w1_in.size(0), H = w1_in.size(2);
    const int64_t O = w2_in.size(2), k = selected_in.size(-1);
    TORCH_CHECK(p >= 1, "softmoe: slots_per_expert must be >= 1, got ", p);
    check_shape(dispatch, "dispatch", {B, T, n * p});
    check_shape(combine, "combine", {B, T, n * p});
    check_shape(w1_in, "w1", {n, D, H});
    check_shape(w2_in, "w2", {n, H, O});
    TORCH_CHECK(selected_in.device().is_cpu() && selected_in.scalar_type() == at::kLong, "softmoe: selected must be "
                "an int64 CPU tensor, got ", selected_in.scalar_type(), " on ", selected_in.device());
    check_shape(selected_in, "selected", {B, k});
    c10::optional<at::Tensor> b1, b2;
    if (b1_in) {
        check_float_cpu(*b1_in, "b1", 2);
        check_shape(*b1_in, "b1", {n, H});
        b1 = b1_in->contiguous();
    }
    if (b2_in) {
        check_float_cpu(*b2_in, "b2", 2);
        check_shape(*b2_in, "b2", {n, O});
        b2 = b2_in->contiguous();
    }
    const at::Tensor selected = selected_in.contiguous(), w1 = w1_in.contiguous(), w2 = w2_in.contiguous();
    const int64_t *chosen = selected.data_ptr<int64_t>();
    /* each place's slots (an unused place takes expert 0's; it gets no rows below), and the places of each expert in
       the order of the inputs: a counting sort */
    at::Tensor index = at::empty({B, 1, k * p}, selected.options());
    int64_t *slot = index.data_ptr<int64_t>();
    std::vector<int64_t> first(n + 1, 0);
    for (int64_t i = 0; i < B * k; i++) {
        const int64_t e = chosen[i];
        TORCH_CHECK(e >= -1 && e < n, "softmoe: selected experts must lie in [-1, ", n, "), got ", e);
        for (int64_t q = 0; q < p; q++) slot[i * p + q] = std::max<int64_t>(e, 0) * p + q;
        if (e >= 0) first[e + 1]++;
    }
    for (int64_t e = 0; e < n; e++) first[e + 1] += first[e];
    std::vector<int64_t> places(first[n]), next(first.begin(), first.end() - 1);
    for (int64_t i = 0; i < B * k; i++)
        if (chosen[i] >= 0) places[next[chosen[i]]++] = i;
    const at::Tensor gather_index = index.expand({B, T, k * p});
    const at::Tensor slots = at::bmm(dispatch.gather(2, gather_index).transpose(1, 2), x).contiguous(); /* (B, kp, D) */
    const int64_t rows = first[n] * p;
    at::Tensor grouped = at::empty({rows, D}, x.options()), hidden = at::empty({rows, H}, x.options());
    at::Tensor out_rows = at::empty({rows, O}, x.options());
    float *g = grouped.data_ptr<float>(), *h = hidden.data_ptr<float>(), *y = out_rows.data_ptr<float>();
    const float *sl = slots.data_ptr<float>();
    for (int64_t r = 0; r < first[n]; r++) std::copy_n(sl + places[r] * p * D, p * D, g + r * p * D);
    const float *bias1 = pointer(b1), *bias2 = pointer(b2);
    for (int64_t e = 0; e < n; e++) {
        const int64_t r0 = first[e] * p, m = (first[e + 1] - first[e]) * p;
        if (m == 0) continue;
        v.expert_matmul(g + r0 * D, w1.data_ptr<float>() + e * D * H, bias1 ? bias1 + e * H : nullptr, h + r0 * H, 1,
                        m, D, H, (int)act, threads());
        v.expert_matmul(h + r0 * H, w2.data_ptr<float>() + e * H * O, bias2 ? bias2 + e * O : nullptr, y + r0 * O, 1,
                        m, H, O, 0, threads());
    }
    at::Tensor expert_out = at::zeros({B, k * p, O}, x.options()); /* an unused place's rows stay zero */
    float *eo = expert_out.data_ptr<float>();
    for (int64_t r = 0; r < first[n]; r++) std::copy_n(y + r * p * O, p * O, eo + places[r] * p * O);
    return at::bmm(combine.gather(2, gather_index), expert_out);
}

/* grad @ weight^T: grad (E, M, N), weight (E, K, N) -> (E, M, K) */
at::Tensor expert_matmul_nt(const at::Tensor &grad_in, const at::Tensor &weight_in, c10::string_view isa)
{
    const Variant &v = variant(std::string(isa));
    check_float_cpu(grad_in, "grad", 3);
    check_float_cpu(weight_in, "weight", 3);
    const int64_t E = grad_in.size(0), M = grad_in.size(1), N = grad_in.size(2), K = weight_in.size(1);
    check_shape(weight_in, "weight", {E, K, N});
    const at::Tensor grad = grad_in.contiguous(), weight = weight_in.contiguous();
    at::Tensor out = at::empty({E, M, K}, grad.options());
    v.expert_matmul_nt(grad.data_ptr<float>(), weight.data_ptr<float>(), out.data_ptr<float>(), E, M, K, N, threads());
    return out;
}

/* Weight gradients of large expert banks are hundreds of MB, a fresh block every step. glibc serves such blocks
 * with new mmap pages, and the first write to each page costs a page fault and the kernel's zeroing (they dominated a
 * ViT-S layer's forward+backward; docs/performance.md has the measurements). So these
 * gradients come from a small pool of blocks kept alive here: a block is handed out again once nothing but the pool
 * holds its storage (the gradient it backed was set to None, or added into an existing .grad and dropped). The
 * tensor handed out is a new tensor on the block's storage, which autograd takes as the parameter's .grad as it
 * takes any fresh gradient. Blocks below POOL_MIN_BYTES come from the allocator as usual. */
constexpr int64_t POOL_MIN_BYTES = int64_t(32) << 20; /* glibc's largest mmap threshold */
constexpr size_t POOL_BLOCKS = 8;

at::Tensor reusable_empty(at::IntArrayRef sizes, const at::TensorOptions &options)
{
    static std::mutex mutex;
    static std::vector<at::Tensor> pool;
    int64_t bytes = 4;
    for (int64_t size : sizes) bytes *= size;
    if (bytes < POOL_MIN_BYTES) return at::empty(sizes, options);
    std::lock_guard<std::mutex> lock(mutex);
    auto is_free = [](const at::Tensor &block) { return block.storage().use_count() == 1; };
    for (const at::Tensor &block : pool)
        if (block.sizes() == sizes && is_free(block)) return at::empty({0}, options).set_(block);
    at::Tensor block = at::empty(sizes, options);
    if (pool.size() >= POOL_BLOCKS) {
        auto free = std::find_if(pool.begin(), pool.end(), is_free);
        if (free == pool.end()) return block;
        pool.erase(free);
    }
    pool.push_back(block);
    return at::empty({0}, options).set_(block);
}

/* An uninitialized float32 CPU tensor of `sizes` from reusable_empty's pool: for the outputs of torch's own products
 * that are as large and as short-lived (the slot backend's weight gradients). */
at::Tensor reusable_float_empty(const std::vector<int64_t> &sizes)
{
    return reusable_empty(sizes, at::TensorOptions().dtype(at::kFloat).device(at::kCPU));
}

/* x^T @ grad: x (E, M, K), grad (E, M, N) -> (E, K, N), in a reused block (reusable_empty) */
at::Tensor expert_matmul_tn(const at::Tensor &x_in, const at::Tensor &grad_in, c10::string_view isa)
{
    const Variant &v = variant(std::string(isa));
    check_float_cpu(x_in, "x", 3);
    check_float_cpu(grad_in, "grad", 3);
    const int64_t E = x_in.size(0), M = x_in.size(1), K = x_in.size(2), N = grad_in.size(2);
    check_shape(grad_in, "grad", {E, M, N});
    const at::Tensor x = x_in.contiguous(), grad = grad_in.contiguous();
    at::Tensor out = reusable_empty({E, K, N}, x.options());
    v.expert_matmul_tn(x.data_ptr<float>(), grad.data_ptr<float>(), out.data_ptr<float>(), E, M, K, N, threads());
    return out;
}

constexpr int64_t MIXING_MAX_TOKENS = 8; /* MAX_TOKENS of soft_moe_small.h */

struct MixingShapes {
    int64_t B, M, Dm, S, n, Hd;
};

MixingShapes check_mixing(const at::Tensor &x, const at::Tensor &dispatch, const at::Tensor &combine,
                          const at::Tensor &w1, const at::Tensor &w2, const c10::optional<at::Tensor> &b2)
{
    check_float_cpu(x, "x", 3);
    check_float_cpu(dispatch, "dispatch", 3);
    check_float_cpu(combine, "combine", 3);
    check_float_cpu(w1, "weight1", 3);
    check_float_cpu(w2, "weight2", 3);
    const MixingShapes s{x.size(0), x.size(1), x.size(2), dispatch.size(2), w1.size(0), w1.size(2)};
    check_shape(dispatch, "dispatch", {s.B, s.M, s.S});
    check_shape(combine, "combine", {s.B, s.M, s.S});
    check_shape(w1, "weight1", {s.n, s.Dm, s.Hd});
    check_shape(w2, "weight2", {s.n, s.Hd, s.Dm});
    if (b2) {
        check_float_cpu(*b2, "bias2", 2);
        check_shape(*b2, "bias2", {s.n, s.Dm});
    }
    TORCH_CHECK(s.M >= 1 && s.M <= MIXING_MAX_TOKENS, "softmoe: the native Soft MoE kernel takes 1..",
                MIXING_MAX_TOKENS, " tokens, got ", s.M);
    TORCH_CHECK(s.n >= 1 && s.S >= 1 && s.S % s.n == 0, "softmoe: the ", s.S,
                " slots must be a positive multiple of the ", s.n, " experts");
    return s;
}

c10::optional<at::Tensor> contiguous(const c10::optional<at::Tensor> &t)
{
    return t ? c10::optional<at::Tensor>(t->contiguous()) : c10::nullopt;
}

/* Items per task of at::parallel_for over items of `work` elements each: at least 2^15 elements a task, so that
 * small arrays (phi of a few slots) stay on the calling thread instead of paying for a parallel region. */
int64_t grain(int64_t work) { return std::max<int64_t>(1, (int64_t(1) << 15) / std::max<int64_t>(work, 1)); }

/* Per input, the bits of its slots of nonzero combine weight (of either sign, over its tokens): `words` 64-bit
 * words each. combine (B, M, S). */
std::vector<uint64_t> slot_bits(const float *combine, int64_t B, int64_t M, int64_t S, int64_t words)
{
    std::vector<uint64_t> bits(B * words);
    at::parallel_for(0, B, grain(M * S), [&](int64_t first, int64_t last) {
        for (int64_t b = first; b < last; b++)
            for (int64_t w = 0; w < words; w++) { /* a word at a time, in a register */
                const int64_t s0 = w * 64, count = std::min<int64_t>(64, S - s0);
                uint64_t word = 0;
                for (int64_t t = 0; t < M; t++) {
                    const float *row = combine + (b * M + t) * S + s0;
                    int64_t s = 0;
#if defined(__SSE2__) /* four floats a compare (NaN too is not zero) */
                    for (; s + 4 <= count; s += 4)
                        word |= uint64_t(_mm_movemask_ps(_mm_cmpneq_ps(_mm_loadu_ps(row + s), _mm_setzero_ps()))) << s;
#endif
                    for (; s < count; s++) word |= uint64_t(row[s] != 0.0f) << s;
                }
                bits[b * words + w] = word;
            }
    });
    return bits;
}

/* How the fused kernel lays out Algorithm 1's kept combine (combine zero outside each input's kept slots): groups of
 * inputs in vector lanes for soft_moe_small_forward (`order` puts those that keep the same slots side by side;
 * empty: as they come), each running the slots one of its inputs keeps; or, where `parts` is not empty, the rows of
 * each expert for soft_moe_small_forward_rows: groups of the inputs that keep it (experts: (first place in order,
 * count, expert) per group; parts: the groups of each thread's share of the inputs); or, where `first` is not
 * empty, each input's kept experts one at a time with vectors along dim and hidden (soft_moe_small_forward_pairs:
 * input b's experts pair_experts[first[b]] ... pair_experts[first[b + 1] - 1]). */
struct KeptLanes {
    std::vector<long> order, experts, parts, first, pair_experts;
};

enum { LANES_AUTO, LANES_BY_INPUTS, LANES_BY_ROWS, LANES_BY_PAIRS };

/* The cost model below counts multiply-adds of a vector, with measured costs (LayoutCosts, the op's `layout_costs`
 * argument: softmoe.tuning.TABLE's "mixing_layout_costs" for the variant, in this order): `input_group_moves` what
 * moving one vector of a group of inputs' rows costs (gathered, then written back, once for all their slots);
 * `sorted_group` what a slot run costs more in groups of the inputs sorted by the slots they keep than in groups of
 * the inputs as they come, whose rows lie side by side (the inputs are sorted only where that saves more slot runs);
 * a slot of one pair `pair_token` per token float (its dispatch and combine) and `pair_weight` per weight of its
 * expert (the pair streams them alone, in short loops along hidden); for the rows of an expert, with `products` = Dm
 * ceil(Hd / lanes) + Hd ceil(Dm / lanes) (a slot's two products for one row, in vectors along hidden and dim), a
 * block of r <= SOFTMOE_MIXING_ROWS rows of a slot `row_block`, `row_block_products` x products (the expert's weights
 * streamed once for the block) and `row` x products x max(r, 4) (a block of fewer than 4 rows takes as long as one of
 * 4: its few chains of multiply-adds wait on each other), and each row `row_token` per vector of its tokens' rows (M
 * ceil(Dm / lanes): its dispatch, its combine and their moves). */
struct LayoutCosts {
    double input_group_moves, sorted_group, pair_token, pair_weight, row_block, row_block_products, row, row_token;
};
constexpr int64_t LAYOUT_COST_COUNT = 8;
constexpr int64_t ROW_LATENCY_ROWS = 4;

LayoutCosts layout_costs(c10::ArrayRef<double> costs)
{
    TORCH_CHECK(int64_t(costs.size()) == LAYOUT_COST_COUNT, "softmoe: layout_costs must hold ", LAYOUT_COST_COUNT,
                " costs, got ", costs.size());
    return {costs[0], costs[1], costs[2], costs[3], costs[4], costs[5], costs[6], costs[7]};
}

/* The layout of the lanes for kept combine (B, M, S) with P slots per expert of Hd hidden units and dim Dm, `lanes`
 * per vector and `threads` threads: `how` one of the layouts, or LANES_AUTO for the one of fewest vector operations
 * counted. A slot run for a group of lanes costs its dispatch, both layers and its combine (2 M Dm + 2 Dm Hd
 * multiply-adds of a vector), a group's rows (M Dm vectors) c.input_group_moves each; the rows of an expert and the
 * pairs as LayoutCosts says; each over the threads that its units of work (groups of inputs, parts, inputs or with
 * fewer inputs than threads pairs) can keep busy. The groups of inputs and the blocks of rows are counted only where
 * bounds on the costs (from the kept slots' count) do not rule them out. The slots each input keeps: `kept_slots`
 * (B, ceil(S / 64) words of bits, as the routing's choice gives them), or where NULL those of nonzero combine
 * weights (slot_bits). */
KeptLanes kept_lanes(const float *combine, const uint64_t *kept_slots, int64_t B, int64_t M, int64_t S, int64_t P,
                     int64_t Hd, int64_t Dm, int64_t lanes, int64_t threads, int how, const LayoutCosts &c)
{
    const int64_t words = (S + 63) / 64, n = S / P;
    const std::vector<uint64_t> found = kept_slots ? std::vector<uint64_t>() : slot_bits(combine, B, M, S, words);
    const uint64_t *bits = kept_slots ? kept_slots : found.data();
    const double slot_cost = 2.0 * M * Dm + 2.0 * Dm * Hd, rows = double(M) * Dm;
    const double dim_vectors = double((Dm + lanes - 1) / lanes), hidden_vectors = double((Hd + lanes - 1) / lanes);
    const int64_t block_rows = SOFTMOE_MIXING_ROWS(lanes);
    const double products = Dm * hidden_vectors + Hd * dim_vectors;
    const double row_block_cost = c.row_block + c.row_block_products * products;
    const double pair_slot_cost = c.pair_token * M * Dm + c.pair_weight * Dm * Hd;
    const int64_t parts = std::max<int64_t>(1, std::min(threads, B)); /* each thread's share of the inputs */
    /* each expert of input b that keeps a slot, through the set bits */
    const auto for_each_expert = [&](int64_t b, auto &&use) {
        int64_t last = -1;
        for (int64_t w = 0; w < words; w++)
            for (uint64_t word = bits[b * words + w]; word; word &= word - 1) {
                const int64_t j = (w * 64 + __builtin_ctzll(word)) / P;
                if (j != last) use(j);
                last = j;
            }
    };
    int64_t pair_slots = 0; /* kept (input, slot) pairs */
    for (int64_t i = 0; i < B * words; i++) pair_slots += __builtin_popcountll(bits[i]);
    const double groups = double((B + lanes - 1) / lanes);
    const double busy_groups = std::max(1.0, std::min(double(threads), groups)); /* threads the layouts keep busy */
    const double busy_pairs = std::max(1.0, std::min(double(threads), std::max(double(B), double(pair_slots) / P)));
    const double pairs_cost = pair_slots * pair_slot_cost / busy_pairs;
    const double row_token_cost = pair_slots * c.row_token * M * dim_vectors; /* (full blocks: the least) */
    const double rows_least = (row_token_cost + double(pair_slots) / double(block_rows) * row_block_cost +
                               pair_slots * c.row * products) / double(parts); /* (block_rows >= 4) */
    double rows_counted = -1.0; /* with the blocks counted: each part's inputs that keep an expert, a block at a time */
    const auto rows_cost = [&] {
        if (rows_counted < 0.0) {
            std::vector<int64_t> count(n);
            double blocks = 0.0, block_row_work = 0.0; /* the blocks, and their rows but at least 4 a block */
            for (int64_t part = 0; part < parts; part++) {
                std::fill(count.begin(), count.end(), 0);
                for (int64_t b = B * part / parts; b < B * (part + 1) / parts; b++)
                    for_each_expert(b, [&](int64_t j) { count[j]++; });
                for (int64_t j = 0; j < n; j++) {
                    const int64_t full = count[j] / block_rows, rest = count[j] % block_rows;
                    blocks += double(P * (full + (rest > 0)));
                    const int64_t last = rest > 0 ? std::max(rest, ROW_LATENCY_ROWS) : 0;
                    block_row_work += double(P * (full * block_rows + last));
                }
            }
            rows_counted =
                (row_token_cost + blocks * row_block_cost + block_row_work * c.row * products) / double(parts);
        }
        return rows_counted;
    };
    /* whether a cost is at most the rows': the blocks counted only where the bound does not decide */
    const auto at_most_rows = [&](double cost) { return cost <= rows_least || cost <= rows_cost(); };
    /* a group runs at least the mean of its inputs' kept slots */
    const double inputs_least =
        (double(pair_slots) / lanes * slot_cost + groups * c.input_group_moves * rows) / busy_groups;
    KeptLanes layout;
    if (how == LANES_BY_INPUTS || (how == LANES_AUTO && inputs_least < std::min(rows_least, pairs_cost))) {
        /* a group runs the slots one of its inputs keeps: the runs of the groups of inputs in `order` (NULL: as
           they come) */
        const auto group_runs = [&](const long *order) {
            int64_t runs = 0;
            for (int64_t g = 0; g < B; g += lanes)
                for (int64_t w = 0; w < words; w++) {
                    uint64_t any = 0;
                    for (int64_t l = g; l < std::min(B, g + lanes); l++)
                        any |= bits[(order ? order[l] : l) * words + w];
                    runs += __builtin_popcountll(any);
                }
            return runs;
        };
        double runs = double(group_runs(nullptr)); /* (sorted: times 1 + c.sorted_group) */
        /* sorted, the groups still run their inputs' kept slots (pair_slots / lanes at least): sorted only where
           that bound leaves a saving */
        bool same = true;
        for (int64_t b = 1; b < B && same; b++) same = std::equal(bits + b * words, bits + (b + 1) * words, bits);
        bool sort = !same && runs > (1.0 + c.sorted_group) * double(pair_slots) / double(lanes);
        std::vector<long> order;
        if (sort) { /* by their bits, then their index (a stable order); the first words nearly always decide */
            order.resize(B);
            for (int64_t b = 0; b < B; b++) order[b] = long(b);
            std::sort(order.begin(), order.end(), [&](long a, long c) {
                const uint64_t *x = bits + a * words, *y = bits + c * words;
                if (x[0] != y[0]) return x[0] < y[0];
                for (int64_t w = 1; w < words; w++)
                    if (x[w] != y[w]) return x[w] < y[w];
                return a < c;
            });
            const double sorted_runs = double(group_runs(order.data())) * (1.0 + c.sorted_group);
            sort = sorted_runs < runs;
            runs = sort ? sorted_runs : runs;
        }
        const double inputs_cost = (runs * slot_cost + groups * c.input_group_moves * rows) / busy_groups;
        if (how == LANES_BY_INPUTS || (how == LANES_AUTO && inputs_cost <= pairs_cost && at_most_rows(inputs_cost))) {
            if (sort) layout.order = std::move(order);
            return layout;
        }
    }
    if (how == LANES_BY_PAIRS || (how == LANES_AUTO && at_most_rows(pairs_cost))) {
        layout.first.push_back(0);
        for (int64_t b = 0; b < B; b++) {
            for_each_expert(b, [&](int64_t j) { layout.pair_experts.push_back(long(j)); });
            layout.first.push_back(long(layout.pair_experts.size()));
        }
        return layout;
    }
    std::vector<std::vector<long>> keep(n); /* per expert, the inputs of a part that keep it */
    layout.parts.push_back(0);
    for (int64_t part = 0; part < parts; part++) {
        for (int64_t b = B * part / parts; b < B * (part + 1) / parts; b++)
            for_each_expert(b, [&](int64_t j) { keep[j].push_back(long(b)); });
        for (int64_t j = 0; j < n; j++)
            if (!keep[j].empty()) {
                layout.experts.insert(layout.experts.end(), {long(layout.order.size()), long(keep[j].size()), long(j)});
                layout.order.insert(layout.order.end(), keep[j].begin(), keep[j].end());
                keep[j].clear();
            }
        layout.parts.push_back(long(layout.experts.size() / 3));
    }
    return layout;
}

/* The fused mixing C relu-MLP(D^T X): x (B, M, Dm), dispatch / combine (B, M, S), weight1 (n, Dm, Hd), bias1 (n,
 * Hd), weight2 (n, Hd, Dm), bias2 (n, Dm) -> out (B, M, Dm) and what the backward reads, saved (ceil(B / lanes), S,
 * Hd (+ Dm with keep_outputs), lanes) with lanes those of the variant (16, 8 or 4): the pre-activations, then with
 * keep_outputs the slots' outputs. kept_combine, for inference only (saved is then incomplete, or empty where the
 * layout has no groups of inputs): combine is zero outside the slots each input keeps (Algorithm 1's dense plan);
 * the work is laid out by kept_lanes (kept_lanes_by: LANES_AUTO, or one layout forced) from the slots each input
 * keeps (kept_slots, the routing's choice as bits, or where None its nonzero combine weights), and a slot whose
 * combine weights are zero for every input of a group of lanes is not run for that group. every_slot, for inference
 * without Algorithm 1 (saved as with kept_combine): every slot runs and none is skipped, laid out by kept_lanes as
 * if every slot were kept where some thread would have no full group of lanes (fewer inputs than lanes x threads;
 * beyond, the groups won every case measured): a group of lanes mostly empty spends most of its work on lanes
 * without an input (docs/performance.md has the measurements). */
std::tuple<at::Tensor, at::Tensor> mixing_forward(const at::Tensor &x_in, const at::Tensor &dispatch_in,
                                                  const at::Tensor &combine_in, const at::Tensor &w1_in,
                                                  const c10::optional<at::Tensor> &b1_in, const at::Tensor &w2_in,
                                                  const c10::optional<at::Tensor> &b2_in, bool keep_outputs,
                                                  bool kept_combine, c10::string_view isa, int64_t kept_lanes_by,
                                                  c10::ArrayRef<double> costs,
                                                  const c10::optional<at::Tensor> &kept_slots, bool every_slot)
{
    const Variant &v = variant(std::string(isa));
    const MixingShapes s = check_mixing(x_in, dispatch_in, combine_in, w1_in, w2_in, b2_in);
    if (b1_in) {
        check_float_cpu(*b1_in, "bias1", 2);
        check_shape(*b1_in, "bias1", {s.n, s.Hd});
    }
    const at::Tensor x = x_in.contiguous(), dispatch = dispatch_in.contiguous(), combine = combine_in.contiguous();
    const at::Tensor w1 = w1_in.contiguous(), w2 = w2_in.contiguous();
    const c10::optional<at::Tensor> b1 = contiguous(b1_in), b2 = contiguous(b2_in);
    const int64_t lanes = v.lanes;
    TORCH_CHECK(kept_lanes_by >= LANES_AUTO && kept_lanes_by <= LANES_BY_PAIRS, "softmoe: kept_lanes_by must be ",
                LANES_AUTO, " (auto), ", LANES_BY_INPUTS, " (by inputs), ", LANES_BY_ROWS, " (by rows) or ",
                LANES_BY_PAIRS, " (by pairs), got ", kept_lanes_by);
    const int64_t P = s.S / s.n, width = s.Hd + (keep_outputs ? s.Dm : 0);
    TORCH_CHECK(!kept_slots || kept_combine, "softmoe: kept_slots are for a kept combine (kept_combine true)");
    const int64_t words = (s.S + 63) / 64;
    if (kept_slots) {
        TORCH_CHECK(kept_slots->scalar_type() == at::kLong && kept_slots->device().is_cpu() &&
                        kept_slots->is_contiguous(), "softmoe: kept_slots must be a contiguous int64 CPU tensor");
        check_shape(*kept_slots, "kept_slots", {s.B, words});
    }
    every_slot = every_slot && s.B < lanes * threads();
    std::vector<uint64_t> every; /* with every_slot: all ones, the bits past the slots clear */
    if (every_slot) {
        every.assign(s.B * words, ~uint64_t(0));
        if (s.S % 64)
            for (int64_t b = 0; b < s.B; b++) every[b * words + words - 1] = (uint64_t(1) << (s.S % 64)) - 1;
    }
    const uint64_t *bits = every_slot ? every.data()
                         : kept_slots ? reinterpret_cast<const uint64_t *>(kept_slots->data_ptr<int64_t>())
                                      : nullptr;
    KeptLanes layout;
    if (kept_combine || every_slot) {
        layout = kept_lanes(combine.data_ptr<float>(), bits, s.B, s.M, s.S, P, s.Hd, s.Dm, lanes, threads(),
                            int(kept_lanes_by), layout_costs(costs));
    }
    at::Tensor out = at::empty({s.B, s.M, s.Dm}, x.options());
    const auto no_records = [&] { return at::empty({0, s.S, width, lanes}, x.options()); };
    if (!layout.first.empty()) { /* pairs one at a time: no groups, no records */
        v.mixing_forward_pairs(x.data_ptr<float>(), dispatch.data_ptr<float>(), combine.data_ptr<float>(),
                               w1.data_ptr<float>(), pointer(b1), w2.data_ptr<float>(), pointer(b2),
                               out.data_ptr<float>(), s.B, s.M, s.S, P, s.Hd, s.Dm, layout.first.data(),
                               layout.pair_experts.data(), kept_combine, threads());
        return {out, no_records()};
    }
    if (!layout.parts.empty()) { /* the rows of each expert: outputs added to zeros (an input keeping nothing: 0) */
        out.zero_();
        v.mixing_forward_rows(x.data_ptr<float>(), dispatch.data_ptr<float>(), combine.data_ptr<float>(),
                              w1.data_ptr<float>(), pointer(b1), w2.data_ptr<float>(), pointer(b2),
                              out.data_ptr<float>(), s.M, s.S, P, s.Hd, s.Dm, layout.order.data(),
                              layout.experts.data(), layout.parts.data(), int64_t(layout.parts.size()) - 1,
                              kept_combine, threads());
        return {out, no_records()};
    }
    at::Tensor saved = at::empty({(s.B + lanes - 1) / lanes, s.S, width, lanes}, x.options());
    const int status = v.mixing_forward(x.data_ptr<float>(), dispatch.data_ptr<float>(), combine.data_ptr<float>(),
                                        w1.data_ptr<float>(), pointer(b1), w2.data_ptr<float>(), pointer(b2),
                                        out.data_ptr<float>(), saved.data_ptr<float>(), s.B, s.M, s.S, P, s.Hd, s.Dm,
                                        keep_outputs, kept_combine,
                                        layout.order.empty() ? nullptr : layout.order.data(), threads());
    TORCH_CHECK(status == 0, "softmoe: the native Soft MoE kernel refused its inputs");
    return {out, saved};
}

/* softmoe::soft_moe_mixing: the mixing with the records its backward reads */
std::tuple<at::Tensor, at::Tensor> soft_moe_mixing(const at::Tensor &x, const at::Tensor &dispatch,
                                                   const at::Tensor &combine, const at::Tensor &w1,
                                                   const c10::optional<at::Tensor> &b1, const at::Tensor &w2,
                                                   const c10::optional<at::Tensor> &b2, bool keep_outputs,
                                                   c10::string_view isa)
{
    return mixing_forward(x, dispatch, combine, w1, b1, w2, b2, keep_outputs, false, isa, LANES_AUTO, {},
                          c10::nullopt, false);
}

/* softmoe::soft_moe_mixing_inference: no records; with kept_combine only the kept slots run (kept_slots: them as
 * bits, or None to find them from combine), else every slot; layout: LANES_AUTO (the cheapest by layout_costs) or
 * one layout forced */
at::Tensor soft_moe_mixing_inference(const at::Tensor &x, const at::Tensor &dispatch, const at::Tensor &combine,
                                     const at::Tensor &w1, const c10::optional<at::Tensor> &b1, const at::Tensor &w2,
                                     const c10::optional<at::Tensor> &b2, bool kept_combine,
                                     const c10::optional<at::Tensor> &kept_slots, int64_t layout,
                                     c10::ArrayRef<double> layout_costs, c10::string_view isa)
{
    return std::get<0>(mixing_forward(x, dispatch, combine, w1, b1, w2, b2, false, kept_combine, isa, layout,
                                      layout_costs, kept_slots, !kept_combine));
}

/* The gradients of soft_moe_mixing from grad (B, M, Dm) and its saved (with or without the slots' outputs, as its
 * shape says): (x, dispatch, combine, weight1, bias1, weight2, bias2), the bias gradients always computed, (n, Hd)
 * and (n, Dm). */
using Grads7 = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

Grads7 soft_moe_mixing_backward(const at::Tensor &grad_in, const at::Tensor &x_in, const at::Tensor &dispatch_in,
                                const at::Tensor &combine_in, const at::Tensor &w1_in, const at::Tensor &w2_in,
                                const c10::optional<at::Tensor> &b2_in, const at::Tensor &saved_in,
                                c10::string_view isa)
{
    const Variant &v = variant(std::string(isa));
    const MixingShapes s = check_mixing(x_in, dispatch_in, combine_in, w1_in, w2_in, b2_in);
    check_float_cpu(grad_in, "grad", 3);
    check_shape(grad_in, "grad", {s.B, s.M, s.Dm});
    check_float_cpu(saved_in, "saved", 4);
    const int64_t lanes = v.lanes;
    const bool kept = saved_in.size(2) == s.Hd + s.Dm;
    check_shape(saved_in, "saved", {(s.B + lanes - 1) / lanes, s.S, kept ? s.Hd + s.Dm : s.Hd, lanes});
    const at::Tensor grad = grad_in.contiguous(), x = x_in.contiguous(), dispatch = dispatch_in.contiguous();
    const at::Tensor combine = combine_in.contiguous(), w1 = w1_in.contiguous(), w2 = w2_in.contiguous();
    const at::Tensor saved = saved_in.contiguous();
    const c10::optional<at::Tensor> b2 = contiguous(b2_in);
    const int count = (int)std::max<int64_t>(1, std::min<int64_t>(threads(), s.n));
    /* the first thread's share of the input gradient goes into grad_x, the others' into partial sums that the kernel
       adds to it: grad_x is a tensor of its own, not a view of a larger one, so that autograd adds the routing's
       share to it in place (to a view it adds out of place, into a new tensor) */
    at::Tensor grad_x = at::empty({s.B, s.M, s.Dm}, x.options());
    at::Tensor grad_dispatch = at::empty_like(dispatch), grad_combine = at::empty_like(combine);
    at::Tensor grad_w1 = at::empty_like(w1), grad_w2 = at::empty_like(w2);
    at::Tensor grad_b1 = at::empty({s.n, s.Hd}, x.options()), grad_b2 = at::empty({s.n, s.Dm}, x.options());
    const int status =
        v.mixing_backward(grad.data_ptr<float>(), x.data_ptr<float>(), dispatch.data_ptr<float>(),
                          combine.data_ptr<float>(), w1.data_ptr<float>(), w2.data_ptr<float>(), pointer(b2),
                          saved.data_ptr<float>(), grad_x.data_ptr<float>(), grad_dispatch.data_ptr<float>(),
                          grad_combine.data_ptr<float>(), grad_w1.data_ptr<float>(), grad_b1.data_ptr<float>(),
                          grad_w2.data_ptr<float>(), grad_b2.data_ptr<float>(), s.B, s.M, s.S, s.S / s.n, s.Hd, s.Dm,
                          kept, count);
    TORCH_CHECK(status == 0, "softmoe: the native Soft MoE kernel refused its inputs");
    return {grad_x, grad_dispatch, grad_combine, grad_w1, grad_b1, grad_w2, grad_b2};
}


/* ---- the routing: logits, dispatch and combine (soft_moe_routing.h) ------------------------------------------ */

typedef float float4_t __attribute__((vector_size(16)));
typedef float float4_any_t __attribute__((vector_size(16), aligned(4))); /* at any float address */
typedef int int4_t __attribute__((vector_size(16)));

/* out[c * ldo + r] = in[r * ldi + c] for r, c < 4: four rows in, four columns out, eight shuffles */
inline void transpose_4x4(const float *in, int64_t ldi, float *out, int64_t ldo)
{
    const int4_t low = {0, 4, 1, 5}, high = {2, 6, 3, 7}, first = {0, 1, 4, 5}, second = {2, 3, 6, 7};
    const float4_t a = *(const float4_any_t *)in, b = *(const float4_any_t *)(in + ldi);
    const float4_t c = *(const float4_any_t *)(in + 2 * ldi), d = *(const float4_any_t *)(in + 3 * ldi);
    const float4_t ab_low = __builtin_shuffle(a, b, low), ab_high = __builtin_shuffle(a, b, high);
    const float4_t cd_low = __builtin_shuffle(c, d, low), cd_high = __builtin_shuffle(c, d, high);
    *(float4_any_t *)out = __builtin_shuffle(ab_low, cd_low, first);
    *(float4_any_t *)(out + ldo) = __builtin_shuffle(ab_low, cd_low, second);
    *(float4_any_t *)(out + 2 * ldo) = __builtin_shuffle(ab_high, cd_high, first);
    *(float4_any_t *)(out + 3 * ldo) = __builtin_shuffle(ab_high, cd_high, second);
}

/* The transpose (C, R) of a contiguous float32 (R, C), in blocks of 64 x 64 over torch's threads, 4 x 4 at a time
 * in vector registers, an output column of blocks after the other (a copy of the transposed view runs on one
 * thread). In the routing's backward pass of the MNIST layer (which transposes its tokens) this beat the same blocks
 * copied one float at a time through a tile, and rows of 4 x 4 blocks (4 KB apart in the output; docs/performance.md
 * has the measurements). */
at::Tensor transposed(const at::Tensor &a)
{
    constexpr int64_t BLOCK = 64;
    const int64_t R = a.size(0), C = a.size(1);
    at::Tensor out = at::empty({C, R}, a.options());
    const float *src = a.data_ptr<float>();
    float *dst = out.data_ptr<float>();
    at::parallel_for(0, (R + BLOCK - 1) / BLOCK, grain(BLOCK * C), [&](int64_t first, int64_t last) {
        for (int64_t r0 = first * BLOCK; r0 < std::min(R, last * BLOCK); r0 += BLOCK)
            for (int64_t c0 = 0; c0 < C; c0 += BLOCK) {
                const int64_t rows = std::min(BLOCK, R - r0), cols = std::min(BLOCK, C - c0);
                const float *in = src + r0 * C + c0;
                float *to = dst + c0 * R + r0;
                const int64_t rows4 = rows / 4 * 4, cols4 = cols / 4 * 4;
                for (int64_t c = 0; c < cols4; c += 4)
                    for (int64_t r = 0; r < rows4; r += 4) transpose_4x4(in + r * C + c, C, to + c * R + r, R);
                for (int64_t c = 0; c < cols; c++)
                    for (int64_t r = c < cols4 ? rows4 : 0; r < rows; r++) to[c * R + r] = in[r * C + c];
            }
    });
    return out;
}

/* a @ w^T for a (R, K) and w (N, K): in oneDNN's linear (mkldnn::_linear_pointwise, the kernel that
 * softmoe.kernels.onednn_linear calls) where `onednn`, else in torch's matmul (MKL). The caller decides where oneDNN
 * pays (softmoe.kernels.onednn.onednn_pays). */
at::Tensor linear_product(const at::Tensor &a, const at::Tensor &w, bool onednn)
{
    if (!onednn) return at::mm(a, w.t());
    static const auto op =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
            .typed<at::Tensor(const at::Tensor &, const at::Tensor &, const std::optional<at::Tensor> &,
                              c10::string_view, c10::List<std::optional<at::Scalar>>, std::optional<c10::string_view>)>();
    return op.call(a, w, std::nullopt, "none", c10::List<std::optional<at::Scalar>>(), std::nullopt);
}

enum { ROUTING_NONE = 0, ROUTING_ROUTER = 1, ROUTING_INPUTS = 2 }; /* normalize "none", "router", "inputs" */
constexpr double ROUTING_NORM_EPS = 1e-6;

/* The normalized slot parameters the logits take, (D, width) with phi's rows padded by zeros to width >= S:
 * phi_n[d, s] = scale phi[d, s] q[s] with q (S,): "router" q = rsqrt(|phi_s|^2 + 1e-6), "inputs" q = 1 / (|phi_s| +
 * 1e-6), "none" q = 1 and no scale; and the columns' norms |phi_s| (S,). Both passes run along phi's rows, and the
 * products take phi_n as it is (torch's CPU matmul ran x phi_n as fast as x phi_t^T): no transposition, which cost
 * more than its size suggests at 16-512 slots and few inputs (without it the same outputs bit for bit;
 * docs/performance.md has the measurements). The routing kernel computes a small routing's logits from phi_n padded to
 * SOFTMOE_ROUTING_SMALL_SLOTS. */
struct NormalizedPhi {
    at::Tensor phi_n;
    std::vector<double> q, norms;
};

NormalizedPhi normalized_phi(const at::Tensor &phi, float scale, int64_t mode, int64_t width)
{
    const int64_t D = phi.size(0), S = phi.size(1);
    const float *p = phi.data_ptr<float>();
    at::Tensor out = width > S ? at::zeros({D, width}, phi.options()) : at::empty({D, S}, phi.options());
    NormalizedPhi n{out, std::vector<double>(S, 1.0), std::vector<double>(S, 0.0)};
    float *o = n.phi_n.data_ptr<float>();
    at::parallel_for(0, S, grain(D), [&](int64_t first, int64_t last) {
        std::vector<double> sums(last - first, 0.0);
        std::vector<float> f(last - first);
        for (int64_t d = 0; d < D; d++) /* row by row, in phi's memory order (vectorized along the slots) */
            for (int64_t s = first; s < last; s++) sums[s - first] += double(p[d * S + s]) * p[d * S + s];
        for (int64_t s = first; s < last; s++) {
            const double sum = sums[s - first];
            n.norms[s] = std::sqrt(sum);
            if (mode != ROUTING_NONE)
                n.q[s] = float(mode == ROUTING_ROUTER ? 1.0 / std::sqrt(sum + ROUTING_NORM_EPS)
                                                      : 1.0 / (n.norms[s] + ROUTING_NORM_EPS));
            f[s - first] = float(n.q[s]) * scale;
        }
        for (int64_t d = 0; d < D; d++)
            for (int64_t s = first; s < last; s++) o[d * width + s] = p[d * S + s] * f[s - first];
    });
    return n;
}

float scale_value(const c10::optional<at::Tensor> &scale, int64_t mode)
{
    if (mode == ROUTING_NONE) return 1.0f;
    TORCH_CHECK(scale && scale->numel() == 1, "softmoe: the normalized routing needs a scalar scale");
    check_float_cpu(*scale, "scale", scale->dim());
    return scale->item<float>();
}

void check_routing(const at::Tensor &x, const at::Tensor &phi, int64_t mode)
{
    check_float_cpu(x, "x", 3);
    check_float_cpu(phi, "phi", 2);
    TORCH_CHECK(phi.size(0) == x.size(2), "softmoe: phi must have ", x.size(2), " rows (the tokens' dim), got ",
                phi.sizes());
    TORCH_CHECK(mode >= ROUTING_NONE && mode <= ROUTING_INPUTS, "softmoe: unknown routing normalization ", mode);
}

/* x (B, M, D), phi (D, S), scale () -> logits, dispatch, combine (B, M, S) and r (B, M), the tokens' inverse norms
 * ("router"; else ones), which the backward reads. mode: ROUTING_*; onednn: the products in oneDNN. Up to
 * SOFTMOE_ROUTING_SMALL_SLOTS slots the kernel computes the products itself, in its passes over each input, faster
 * than MKL or oneDNN for logits this thin (the MNIST layer's: 1024 x 196 by 196 x 2-32; docs/performance.md has the
 * measurements). With k >= 1 also
 * Algorithm 1's choice of k experts of p slots, made in the same pass (combine then zero outside their slots) ->
 * selected (B, k) where `with_selected` (else undefined), and the kept slots as bits, (B, ceil(S / 64)) int64 (empty
 * for k = 0). */
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
routing_forward(const at::Tensor &x_in, const at::Tensor &phi_in, const c10::optional<at::Tensor> &scale, int64_t mode,
                const std::string &isa, bool onednn, int64_t p, int64_t k, bool with_selected)
{
    const Variant &v = variant(isa);
    check_routing(x_in, phi_in, mode);
    const at::Tensor x = x_in.contiguous(), phi = phi_in.contiguous();
    const int64_t B = x.size(0), M = x.size(1), D = x.size(2), S = phi.size(1);
    TORCH_CHECK(p >= 1 && S % p == 0, "softmoe: phi's ", S, " slots are not a multiple of ", p, " per expert");
    TORCH_CHECK(k >= 0 && k <= S / p, "softmoe: k must be in [1, ", S / p, "] (the experts), got ", k);
    const bool small = S <= SOFTMOE_ROUTING_SMALL_SLOTS, dots = S <= SOFTMOE_ROUTING_DOT_SLOTS(v.lanes);
    const bool rows = small && !dots; /* phi_n padded to the kernel's rows */
    const at::Tensor phi_n =
        normalized_phi(phi, scale_value(scale, mode), mode, rows ? SOFTMOE_ROUTING_SMALL_SLOTS : S).phi_n;
    const at::Tensor phi_t = dots ? transposed(phi_n) : at::Tensor();
    at::Tensor logits = small ? at::empty({B, M, S}, x.options())
                              : linear_product(x.view({B * M, D}), phi_n.t(), onednn).view({B, M, S});
    at::Tensor dispatch = at::empty_like(logits), combine = at::empty_like(logits);
    at::Tensor r = at::empty({B, M}, x.options());
    const at::Tensor selected = with_selected ? at::empty({B, k}, x.options().dtype(at::kLong)) : at::Tensor();
    const at::Tensor slots = at::empty({B, k ? (S + 63) / 64 : 0}, x.options().dtype(at::kLong));
    v.routing_forward(logits.data_ptr<float>(), x.data_ptr<float>(), dots ? phi_t.data_ptr<float>() : nullptr,
                      rows ? phi_n.data_ptr<float>() : nullptr, dispatch.data_ptr<float>(),
                      combine.data_ptr<float>(), r.data_ptr<float>(), B, M, S, D, mode == ROUTING_ROUTER, p, k,
                      with_selected ? selected.data_ptr<int64_t>() : nullptr,
                      reinterpret_cast<uint64_t *>(slots.data_ptr<int64_t>()), threads());
    return {logits, dispatch, combine, r, selected, slots};
}

/* normalize ("none", "router", "inputs") -> ROUTING_* */
int64_t routing_mode(c10::string_view normalize)
{
    if (normalize == "none") return ROUTING_NONE;
    if (normalize == "router") return ROUTING_ROUTER;
    TORCH_CHECK(normalize == "inputs", "softmoe: normalize must be \"none\", \"router\" or \"inputs\", got ",
                normalize);
    return ROUTING_INPUTS;
}

/* softmoe::soft_moe_routing */
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> soft_moe_routing(const at::Tensor &x,
                                                                            const at::Tensor &phi,
                                                                            const c10::optional<at::Tensor> &scale,
                                                                            c10::string_view normalize,
                                                                            c10::string_view isa, bool onednn)
{
    const auto [logits, dispatch, combine, r, selected, slots] =
        routing_forward(x, phi, scale, routing_mode(normalize), std::string(isa), onednn, 1, 0, false);
    return {logits, dispatch, combine, r};
}

/* softmoe::soft_moe_routing_top_k: inference's routing with Algorithm 1's choice in the same pass: (dispatch,
 * combine zero outside the kept experts' slots, the kept slots as bits (B, ceil(S / 64)) int64 (bit s % 64 of word
 * s / 64 for slot s), selected (B, k) ascending where `with_selected`, else (B, 0)), as soft_moe_routing and
 * top_k_combine would give them. */
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>
soft_moe_routing_top_k(const at::Tensor &x, const at::Tensor &phi, const c10::optional<at::Tensor> &scale,
                       c10::string_view normalize, int64_t p, int64_t k, bool with_selected, c10::string_view isa,
                       bool onednn)
{
    TORCH_CHECK(k >= 1, "softmoe: k must be at least 1, got ", k);
    const auto [logits, dispatch, combine, r, selected, slots] =
        routing_forward(x, phi, scale, routing_mode(normalize), std::string(isa), onednn, p, k, with_selected);
    return {dispatch, combine, slots, with_selected ? selected : at::empty({x.size(0), 0}, slots.options())};
}

/* The gradients of soft_moe_routing's x, phi and scale (0 without normalization) from those of logits, dispatch and
 * combine (each may be absent) and its outputs; onednn: the products in oneDNN (grad_phi's from 256 slots up). */
std::tuple<at::Tensor, at::Tensor, at::Tensor> soft_moe_routing_backward(
    const c10::optional<at::Tensor> &grad_logits, const c10::optional<at::Tensor> &grad_dispatch,
    const c10::optional<at::Tensor> &grad_combine, const at::Tensor &x_in, const at::Tensor &phi_in,
    const c10::optional<at::Tensor> &scale, const at::Tensor &logits_in, const at::Tensor &dispatch_in,
    const at::Tensor &combine_in, const at::Tensor &r_in, c10::string_view normalize, c10::string_view isa,
    bool onednn)
{
    const Variant &v = variant(std::string(isa));
    const int64_t mode = routing_mode(normalize);
    check_routing(x_in, phi_in, mode);
    const at::Tensor x = x_in.contiguous(), phi = phi_in.contiguous();
    const int64_t B = x.size(0), M = x.size(1), D = x.size(2), S = phi.size(1);
    const at::Tensor logits = logits_in.contiguous(), dispatch = dispatch_in.contiguous();
    const at::Tensor combine = combine_in.contiguous(), r = r_in.contiguous();
    for (const at::Tensor *t : {&logits, &dispatch, &combine}) {
        check_float_cpu(*t, "a routing tensor", 3);
        check_shape(*t, "a routing tensor", {B, M, S});
    }
    check_float_cpu(r, "r", 2);
    check_shape(r, "r", {B, M});
    c10::optional<at::Tensor> grads[3] = {grad_logits, grad_dispatch, grad_combine};
    for (auto &g : grads)
        if (g) {
            check_float_cpu(*g, "a routing gradient", 3);
            check_shape(*g, "a routing gradient", {B, M, S});
            g = g->contiguous();
        }
    const float scale_v = scale_value(scale, mode);
    const NormalizedPhi n = normalized_phi(phi, scale_v, mode, S);
    const std::vector<double> &q = n.q;
    at::Tensor gp = at::empty({B, M, S}, x.options()), dot = at::empty({B, M}, x.options());
    /* up to SOFTMOE_ROUTING_SMALL_SLOTS slots the kernel computes grad_x and phi_n's gradient (transposed) itself */
    const bool small = S <= SOFTMOE_ROUTING_SMALL_SLOTS;
    const at::Tensor phi_t = small ? transposed(n.phi_n) : at::Tensor();
    at::Tensor grad_x = small ? at::empty({B * M, D}, x.options()) : at::Tensor();
    const at::Tensor grad_phi_t = small ? at::empty({S, D}, x.options()) : at::Tensor();
    v.routing_backward(pointer(grads[0]), pointer(grads[1]), pointer(grads[2]), logits.data_ptr<float>(),
                       dispatch.data_ptr<float>(), combine.data_ptr<float>(), r.data_ptr<float>(),
                       gp.data_ptr<float>(), dot.data_ptr<float>(), small ? x.data_ptr<float>() : nullptr,
                       small ? phi_t.data_ptr<float>() : nullptr, small ? grad_x.data_ptr<float>() : nullptr,
                       small ? grad_phi_t.data_ptr<float>() : nullptr, B, M, S, D, mode == ROUTING_ROUTER,
                       threads());
    const at::Tensor x_flat = x.view({B * M, D}), gp_flat = gp.view({B * M, S});
    /* the logits are proportional to scale: its gradient is sum(g logits) / scale, summed here in double (through
       grad_phi_n below, a sum with much cancellation, it came out far less accurate than torch's) */
    const float *dots = dot.data_ptr<float>(), *rs = r.data_ptr<float>();
    double dot_sum = 0.0;
    for (int64_t i = 0; i < B * M; i++) dot_sum += dots[i];
    if (!small) grad_x = linear_product(gp_flat, n.phi_n, onednn);
    if (!small && mode == ROUTING_ROUTER) {
        at::Tensor coef = at::empty({B * M, 1}, x.options());
        float *c = coef.data_ptr<float>();
        for (int64_t i = 0; i < B * M; i++) c[i] = dots[i] * rs[i] * rs[i];
        grad_x.addcmul_(x_flat, coef, -1.0);
    }
    /* (D, S), a contraction over the B M rows: the kernel's up to SOFTMOE_ROUTING_SMALL_SLOTS slots; beyond, oneDNN,
       where it outruns MKL, takes x^T as its rows, given them transposed (its own copy of the view runs on one
       thread; docs/performance.md has the measurements). */
    const at::Tensor grad_phi_n = small    ? grad_phi_t.t()
                                : onednn ? linear_product(transposed(x_flat), gp_flat.t(), true)
                                         : at::mm(x_flat.t(), gp_flat);
    const int64_t g_d = grad_phi_n.stride(0), g_s = grad_phi_n.stride(1);
    /* through phi_n = scale phi q: with t[s] = sum_d grad_phi_n phi, "router" (dq/dphi = -q^3 phi) gives
       scale q (grad_phi_n - q^2 t phi), "inputs" (dq/dphi = -q^2 phi / |phi|, 0 at |phi| = 0) scale q (grad_phi_n
       - q t phi / |phi|); the scale's gradient is sum_s q t. */
    at::Tensor grad_phi = at::empty({D, S}, x.options()), grad_scale = at::empty({}, x.options());
    const float *g = grad_phi_n.data_ptr<float>(), *p = phi.data_ptr<float>();
    float *out = grad_phi.data_ptr<float>();
    std::vector<double> t(S, 0.0), k(S), f(S);
    at::parallel_for(0, S, grain(D), [&](int64_t first, int64_t last) {
        for (int64_t d = 0; d < D; d++) /* row by row, in phi's memory order */
            for (int64_t s = first; s < last; s++) t[s] += double(g[d * g_d + s * g_s]) * p[d * S + s];
    });
    double scale_grad = 0.0;
    for (int64_t s = 0; s < S; s++) {
        scale_grad += q[s] * t[s];
        k[s] = mode == ROUTING_ROUTER                          ? q[s] * q[s] * t[s]
             : mode == ROUTING_INPUTS && n.norms[s] > 0.0 ? q[s] * t[s] / n.norms[s]
                                                           : 0.0;
        f[s] = mode == ROUTING_NONE ? 1.0 : double(scale_v) * q[s];
    }
    at::parallel_for(0, D, grain(S), [&](int64_t first, int64_t last) {
        for (int64_t d = first; d < last; d++)
            for (int64_t s = 0; s < S; s++)
                out[d * S + s] = float(f[s] * (g[d * g_d + s * g_s] - k[s] * p[d * S + s]));
    });
    const double scale_gradient = scale_v != 0.0f ? dot_sum / scale_v : scale_grad;
    *grad_scale.data_ptr<float>() = mode == ROUTING_NONE ? 0.0f : float(scale_gradient);
    return {grad_x.view({B, M, D}), grad_phi, grad_scale};
}

/* ---- Algorithm 1's choice from the combine weights (softmoe::top_k_combine) ---------------------------------- */

/* combine (B, M, S) with S = n * p slots -> (kept, selected): Algorithm 1's choice with the `isa` variant of
 * top_k_combine.h (which says what they hold), on as many threads as the work is worth (2^15 floats each). */
std::tuple<at::Tensor, at::Tensor> top_k_combine(const at::Tensor &combine_in, int64_t p, int64_t k,
                                                 c10::string_view isa)
{
    const Variant &v = variant(std::string(isa));
    check_float_cpu(combine_in, "combine", 3);
    const at::Tensor combine = combine_in.contiguous();
    const int64_t B = combine.size(0), M = combine.size(1), S = combine.size(2);
    TORCH_CHECK(p >= 1 && S % p == 0, "softmoe: combine's ", S, " slots are not a multiple of ", p, " per expert");
    const int64_t n = S / p;
    TORCH_CHECK(k >= 1 && k <= n, "softmoe: k must be in [1, ", n, "] (the experts), got ", k);
    at::Tensor kept = at::empty_like(combine), selected = at::empty({B, k}, combine.options().dtype(at::kLong));
    const int count = int(std::min<int64_t>(threads(), std::max<int64_t>(1, (B * M * S) >> 15)));
    v.top_k_combine(combine.data_ptr<float>(), kept.data_ptr<float>(), selected.data_ptr<int64_t>(), B, M, S, p,
                    k, count);
    return {kept, selected};
}

} // namespace

/* The CPU kernels of the ops the Python modules define (softmoe/kernels/soft_moe_routing.py, soft_moe_mixing.py,
 * top_k_combine.py, expert_matmul.py: their schemas and fakes); their autograd is in autograd.cpp. */
TORCH_LIBRARY_IMPL(softmoe, CPU, m)
{
    m.impl("soft_moe_routing", &soft_moe_routing);
    m.impl("soft_moe_routing_backward", &soft_moe_routing_backward);
    m.impl("soft_moe_routing_top_k", &soft_moe_routing_top_k);
    m.impl("soft_moe_mixing", &soft_moe_mixing);
    m.impl("soft_moe_mixing_backward", &soft_moe_mixing_backward);
    m.impl("soft_moe_mixing_inference", &soft_moe_mixing_inference);
    m.impl("top_k_combine", &top_k_combine);
    m.impl("expert_matmul", &expert_matmul);
    m.impl("expert_matmul_nt", &expert_matmul_nt);
    m.impl("expert_matmul_tn", &expert_matmul_tn);
    m.impl("selected_mixing", &selected_mixing);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)
{
    m.doc() = "softmoe's native CPU kernels (see softmoe.kernels)";
    m.def("supported_isas", &supported_isas, "the kernel variants this CPU runs, best first");
    m.def("built_isas", &built_isas, "every kernel variant in this build, best first");
    m.def("lanes", &variant_lanes, "float lanes per vector of a variant", pybind11::arg("isa"));
    m.def("reusable_empty", &reusable_float_empty, "an uninitialized float32 CPU tensor from the pool of large blocks",
          pybind11::arg("sizes"));
}
