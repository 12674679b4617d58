/* The autograd of softmoe's differentiable native ops: soft_moe_routing, soft_moe_mixing, top_k_combine and the
 * expert matmul's three products (their schemas and fakes in softmoe/kernels/*.py, their CPU kernels in
 * bindings.cpp).
 *
 * Each op's Autograd kernel is a torch::autograd::Function that runs the op below autograd, saves what its backward
 * reads and differentiates it with the backward op (with nothing to record, the op below autograd alone),
 * every step through the dispatcher: torch.compile, the profiler and dispatch modes see each op that runs, eager and
 * compiled calls run the same kernels, and an eager call, with or without gradients, costs no Python beyond the op's
 * call.
 *
 * An absent optional tensor is no input of a Function's node: needs_input_grad counts only the tensors present,
 * while the gradients returned have one place for every argument. */
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/repeat_interleave.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/functions/utils.h> /* compute_requires_grad, isFwGradDefined */
#include <torch/library.h>

#include <string>
#include <tuple>

namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using OptionalTensor = c10::optional<Tensor>;

OptionalTensor optional(const Tensor &t) { return t.defined() ? OptionalTensor(t) : c10::nullopt; }

template <class Signature> c10::TypedOperatorHandle<Signature> op(const char *name)
{
    return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

/* An op's kernel below autograd: what each Function's forward runs, and all that an Autograd kernel runs where no
 * gradient is to be recorded (grad mode off, or no input requires one), as torch's own ops do: no Function node,
 * context or saved tensors then. */
template <class Signature, class... Args>
auto below_autograd(const c10::TypedOperatorHandle<Signature> &handle, const Args &...args)
{
    at::AutoDispatchBelowADInplaceOrView guard;
    return handle.call(args...);
}

/* Whether an Autograd kernel has anything to record: a gradient (grad mode on and an input that requires one), or a
 * forward-mode tangent, which the Functions refuse with torch's error rather than drop. */
template <class... Inputs> bool records(const Inputs &...inputs)
{
    return torch::autograd::compute_requires_grad(inputs...) || (torch::autograd::isFwGradDefined(inputs) || ...);
}

/* ---- softmoe::soft_moe_routing ------------------------------------------------------------------------------ */

using Routing4 = std::tuple<Tensor, Tensor, Tensor, Tensor>;
using Grads3 = std::tuple<Tensor, Tensor, Tensor>;
using RoutingOp = Routing4(const Tensor &, const Tensor &, const OptionalTensor &, c10::string_view, c10::string_view,
                           bool);
using RoutingBackwardOp = Grads3(const OptionalTensor &, const OptionalTensor &, const OptionalTensor &,
                                 const Tensor &, const Tensor &, const OptionalTensor &, const Tensor &,
                                 const Tensor &, const Tensor &, const Tensor &, c10::string_view, c10::string_view,
                                 bool);
using RoutingTorchGradsOp = Grads3(const OptionalTensor &, const OptionalTensor &, const OptionalTensor &,
                                   const Tensor &, const Tensor &, const OptionalTensor &, c10::string_view);

const c10::TypedOperatorHandle<RoutingOp> &routing_op()
{
    static const auto handle = op<RoutingOp>("softmoe::soft_moe_routing");
    return handle;
}

struct Routing : public torch::autograd::Function<Routing> {
    static variable_list forward(AutogradContext *ctx, const Tensor &x, const Tensor &phi,
                                 const OptionalTensor &scale, const std::string &normalize, const std::string &isa,
                                 bool onednn)
    {
        const auto [logits, dispatch, combine, r] = below_autograd(routing_op(), x, phi, scale, normalize, isa, onednn);
        ctx->save_for_backward({x, phi, scale.value_or(Tensor()), logits, dispatch, combine, r});
        ctx->mark_non_differentiable({r});
        ctx->set_materialize_grads(false); /* an output left unused (the layer's logits) gets no gradient of zeros */
        ctx->saved_data["normalize"] = normalize;
        ctx->saved_data["isa"] = isa;
        ctx->saved_data["onednn"] = onednn;
        return {logits, dispatch, combine, r};
    }

    static variable_list backward(AutogradContext *ctx, variable_list grads)
    {
        static const auto native = op<RoutingBackwardOp>("softmoe::soft_moe_routing_backward");
        static const auto in_torch = op<RoutingTorchGradsOp>("softmoe::soft_moe_routing_torch_grads");
        const variable_list saved = ctx->get_saved_variables();
        const Tensor &x = saved[0], &phi = saved[1], &scale = saved[2];
        const std::string normalize = ctx->saved_data["normalize"].toStringRef();
        const OptionalTensor g_logits = optional(grads[0]), g_dispatch = optional(grads[1]);
        const OptionalTensor g_combine = optional(grads[2]);
        /* a double backward (create_graph) differentiates the routing recomputed in torch's ops */
        const auto [grad_x, grad_phi, grad_scale] =
            at::GradMode::is_enabled()
                ? in_torch.call(g_logits, g_dispatch, g_combine, x, phi, optional(scale), normalize)
                : native.call(g_logits, g_dispatch, g_combine, x, phi, optional(scale), saved[3], saved[4], saved[5],
                              saved[6], normalize, ctx->saved_data["isa"].toStringRef(),
                              ctx->saved_data["onednn"].toBool());
        return {ctx->needs_input_grad(0) ? grad_x : Tensor(), ctx->needs_input_grad(1) ? grad_phi : Tensor(),
                scale.defined() && ctx->needs_input_grad(2) ? grad_scale.reshape(scale.sizes()) : Tensor(),
                Tensor(), Tensor(), Tensor()};
    }
};

Routing4 routing_autograd(const Tensor &x, const Tensor &phi, const OptionalTensor &scale,
                          c10::string_view normalize, c10::string_view isa, bool onednn)
{
    if (!records(x, phi, scale))
        return below_autograd(routing_op(), x, phi, scale, normalize, isa, onednn);
    const variable_list out = Routing::apply(x, phi, scale, std::string(normalize), std::string(isa), onednn);
    return {out[0], out[1], out[2], out[3]};
}

/* ---- softmoe::soft_moe_mixing ------------------------------------------------------------------------------- */

using MixingOp = std::tuple<Tensor, Tensor>(const Tensor &, const Tensor &, const Tensor &, const Tensor &,
                                            const OptionalTensor &, const Tensor &, const OptionalTensor &, bool,
                                            c10::string_view);
using MixingBackwardOp = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>(
    const Tensor &, const Tensor &, const Tensor &, const Tensor &, const Tensor &, const Tensor &,
    const OptionalTensor &, const Tensor &, c10::string_view);

const c10::TypedOperatorHandle<MixingOp> &mixing_op()
{
    static const auto handle = op<MixingOp>("softmoe::soft_moe_mixing");
    return handle;
}

struct Mixing : public torch::autograd::Function<Mixing> {
    static variable_list forward(AutogradContext *ctx, const Tensor &x, const Tensor &dispatch, const Tensor &combine,
                                 const Tensor &weight1, const OptionalTensor &bias1, const Tensor &weight2,
                                 const OptionalTensor &bias2, bool keep_outputs, const std::string &isa)
    {
        const auto [out, saved] =
            below_autograd(mixing_op(), x, dispatch, combine, weight1, bias1, weight2, bias2, keep_outputs, isa);
        ctx->save_for_backward({x, dispatch, combine, weight1, weight2, bias2.value_or(Tensor()), saved});
        ctx->mark_non_differentiable({saved});
        ctx->set_materialize_grads(false); /* no zeros written for saved's gradient */
        ctx->saved_data["isa"] = isa;
        ctx->saved_data["bias1"] = bias1.has_value();
        return {out, saved};
    }

    /* The backward op has no formula of its own: a double backward through it raises (see the registration). */
    static variable_list backward(AutogradContext *ctx, variable_list grads)
    {
        static const auto mixing_backward = op<MixingBackwardOp>("softmoe::soft_moe_mixing_backward");
        variable_list result(9);
        if (!grads[0].defined()) return result;
        const variable_list s = ctx->get_saved_variables();
        const auto [gx, gd, gc, gw1, gb1, gw2, gb2] = mixing_backward.call(
            grads[0], s[0], s[1], s[2], s[3], s[4], optional(s[5]), s[6], ctx->saved_data["isa"].toStringRef());
        const Tensor all[] = {gx, gd, gc, gw1, gb1, gw2, gb2};
        const bool present[] = {true, true, true, true, ctx->saved_data["bias1"].toBool(), true, s[5].defined()};
        for (int i = 0, edge = 0; i < 7; i++)
            if (present[i] && ctx->needs_input_grad(edge++)) result[i] = all[i]; /* not for a frozen bias */
        return result;
    }
};

std::tuple<Tensor, Tensor> mixing_autograd(const Tensor &x, const Tensor &dispatch, const Tensor &combine,
                                           const Tensor &weight1, const OptionalTensor &bias1, const Tensor &weight2,
                                           const OptionalTensor &bias2, bool keep_outputs, c10::string_view isa)
{
    if (!records(x, dispatch, combine, weight1, bias1, weight2, bias2))
        return below_autograd(mixing_op(), x, dispatch, combine, weight1, bias1, weight2, bias2, keep_outputs, isa);
    const variable_list out =
        Mixing::apply(x, dispatch, combine, weight1, bias1, weight2, bias2, keep_outputs, std::string(isa));
    return {out[0], out[1]};
}

/* ---- softmoe::expert_matmul and its gradients' ops, expert_matmul_nt and expert_matmul_tn --------------------- */

/* The gradients of each of the three products are the other two (and a sum for the bias), each called through the
 * dispatcher, so that they are differentiable to any order. */
using ExpertMatmulOp = Tensor(const Tensor &, const Tensor &, const OptionalTensor &, c10::string_view,
                              c10::string_view);
using ExpertMatmulPairOp = Tensor(const Tensor &, const Tensor &, c10::string_view);

const c10::TypedOperatorHandle<ExpertMatmulOp> &expert_matmul_op()
{
    static const auto handle = op<ExpertMatmulOp>("softmoe::expert_matmul");
    return handle;
}

const c10::TypedOperatorHandle<ExpertMatmulPairOp> &pair_op(bool nt)
{
    static const auto nt_handle = op<ExpertMatmulPairOp>("softmoe::expert_matmul_nt");
    static const auto tn_handle = op<ExpertMatmulPairOp>("softmoe::expert_matmul_tn");
    return nt ? nt_handle : tn_handle;
}

/* act(x @ weight + bias); a fused activation has no backward */
struct ExpertMatmul : public torch::autograd::Function<ExpertMatmul> {
    static Tensor forward(AutogradContext *ctx, const Tensor &x, const Tensor &weight, const OptionalTensor &bias,
                          const std::string &activation, const std::string &isa)
    {
        ctx->save_for_backward({x, weight});
        ctx->saved_data["activation"] = activation;
        ctx->saved_data["isa"] = isa;
        ctx->saved_data["has_bias"] = bias.has_value();
        return below_autograd(expert_matmul_op(), x, weight, bias, activation, isa);
    }

    static variable_list backward(AutogradContext *ctx, variable_list grads)
    {
        const std::string activation = ctx->saved_data["activation"].toStringRef();
        TORCH_CHECK(activation == "none", "softmoe::expert_matmul with the fused ", activation, " has no backward");
        const auto saved = ctx->get_saved_variables();
        const std::string isa = ctx->saved_data["isa"].toStringRef();
        const Tensor &grad = grads[0];
        Tensor grad_x, grad_weight, grad_bias;
        if (ctx->needs_input_grad(0)) grad_x = pair_op(true).call(grad, saved[1], isa);
        if (ctx->needs_input_grad(1)) grad_weight = pair_op(false).call(saved[0], grad, isa);
        if (ctx->saved_data["has_bias"].toBool() && ctx->needs_input_grad(2)) grad_bias = grad.sum(1);
        return {grad_x, grad_weight, grad_bias, Tensor(), Tensor()};
    }
};

Tensor expert_matmul_autograd(const Tensor &x, const Tensor &weight, const OptionalTensor &bias,
                              c10::string_view activation, c10::string_view isa)
{
    if (!records(x, weight, bias))
        return below_autograd(expert_matmul_op(), x, weight, bias, activation, isa);
    return ExpertMatmul::apply(x, weight, bias, std::string(activation), std::string(isa));
}

/* nt: grad (E, M, N) @ weight (E, K, N)^T; tn: x (E, M, K)^T @ grad (E, M, N). With upstream u, nt's gradients
 * are u @ weight (expert_matmul) and u^T @ grad (tn); tn's are grad @ u^T (nt) and x @ u (expert_matmul). */
template <bool NT> struct ExpertMatmulPair : public torch::autograd::Function<ExpertMatmulPair<NT>> {
    static Tensor forward(AutogradContext *ctx, const Tensor &a, const Tensor &b, const std::string &isa)
    {
        ctx->save_for_backward({a, b});
        ctx->saved_data["isa"] = isa;
        return below_autograd(pair_op(NT), a, b, isa);
    }

    static variable_list backward(AutogradContext *ctx, variable_list grads)
    {
        const auto saved = ctx->get_saved_variables();
        const std::string isa = ctx->saved_data["isa"].toStringRef();
        const Tensor &u = grads[0];
        Tensor grad_a, grad_b;
        if (NT) {
            if (ctx->needs_input_grad(0)) grad_a = expert_matmul_op().call(u, saved[1], c10::nullopt, "none", isa);
            if (ctx->needs_input_grad(1)) grad_b = pair_op(false).call(u, saved[0], isa);
        } else {
            if (ctx->needs_input_grad(0)) grad_a = pair_op(true).call(saved[1], u, isa);
            if (ctx->needs_input_grad(1)) grad_b = expert_matmul_op().call(saved[0], u, c10::nullopt, "none", isa);
        }
        return {grad_a, grad_b, Tensor()};
    }
};

template <bool NT> Tensor expert_matmul_pair_autograd(const Tensor &a, const Tensor &b, c10::string_view isa)
{
    if (!records(a, b)) return below_autograd(pair_op(NT), a, b, isa);
    return ExpertMatmulPair<NT>::apply(a, b, std::string(isa));
}

/* ---- softmoe::top_k_combine --------------------------------------------------------------------------------- */

using TopKCombineOp = std::tuple<Tensor, Tensor>(const Tensor &, int64_t, int64_t, c10::string_view);

const c10::TypedOperatorHandle<TopKCombineOp> &top_k_combine_op()
{
    static const auto handle = op<TopKCombineOp>("softmoe::top_k_combine");
    return handle;
}

struct TopKCombine : public torch::autograd::Function<TopKCombine> {
    static variable_list forward(AutogradContext *ctx, const Tensor &combine, int64_t p, int64_t k,
                                 const std::string &isa)
    {
        const auto [kept, selected] = below_autograd(top_k_combine_op(), combine, p, k, isa);
        ctx->mark_non_differentiable({selected});
        ctx->save_for_backward({selected});
        ctx->saved_data["experts"] = combine.size(2) / p;
        ctx->saved_data["p"] = p;
        return {kept, selected};
    }

    /* kept's gradient is the upstream gradient on the kept slots, zero elsewhere */
    static variable_list backward(AutogradContext *ctx, variable_list grads)
    {
        if (!grads[0].defined()) return variable_list(4);
        const Tensor selected = ctx->get_saved_variables()[0];
        const int64_t experts = ctx->saved_data["experts"].toInt(), p = ctx->saved_data["p"].toInt();
        const Tensor chosen = at::zeros({selected.size(0), experts}, selected.options().dtype(at::kBool))
                                  .scatter_(1, selected, true);
        const Tensor kept_slots = at::repeat_interleave(chosen, p, 1).unsqueeze(1);
        return {at::where(kept_slots, grads[0], 0.0), Tensor(), Tensor(), Tensor()};
    }
};

std::tuple<Tensor, Tensor> top_k_combine_autograd(const Tensor &combine, int64_t p, int64_t k,
                                                  c10::string_view isa)
{
    if (!records(combine)) return below_autograd(top_k_combine_op(), combine, p, k, isa);
    const variable_list out = TopKCombine::apply(combine, p, k, std::string(isa));
    return {out[0], out[1]};
}

} // namespace

TORCH_LIBRARY_IMPL(softmoe, Autograd, m)
{
    m.impl("soft_moe_routing", &routing_autograd);
    m.impl("soft_moe_mixing", &mixing_autograd);
    m.impl("top_k_combine", &top_k_combine_autograd);
    m.impl("expert_matmul", &expert_matmul_autograd);
    m.impl("expert_matmul_nt", &expert_matmul_pair_autograd<true>);
    m.impl("expert_matmul_tn", &expert_matmul_pair_autograd<false>);
    /* the inference ops (the training path runs differentiable ops): a gradient through them raises, never a silent
     * zero. Algorithm 1's selected plan, the fused mixing without records, the routing with Algorithm 1's choice. */
    m.impl("selected_mixing", torch::autograd::autogradNotImplementedFallback());
    m.impl("soft_moe_mixing_inference", torch::autograd::autogradNotImplementedFallback());
    m.impl("soft_moe_routing_top_k", torch::autograd::autogradNotImplementedFallback());
    /* the backward ops, run with gradients recorded (create_graph), give outputs whose backward raises */
    m.impl("soft_moe_mixing_backward", torch::autograd::autogradNotImplementedFallback());
    m.impl("soft_moe_routing_backward", torch::autograd::autogradNotImplementedFallback());
}
