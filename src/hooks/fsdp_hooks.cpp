#include <ddpkit/hooks/fsdp_hooks.h>

namespace ddpkit {
namespace fsdp {

DefaultState::DefaultState(std::shared_ptr<ProcessGroup> pg) : process_group(std::move(pg)) {
  DDPKIT_CHECK(process_group, "fsdp::DefaultState needs an explicit process group, got null");
  world_size = process_group->size();
  gradient_predivide_factor = predivide_factor(world_size);
  gradient_postdivide_factor = world_size / gradient_predivide_factor;
}

double DefaultState::predivide_factor(int world_size) {
  DDPKIT_CHECK(world_size >= 1, "world size must be positive, got ", world_size);
  int factor = 1;
  while (world_size % factor == 0 && world_size / factor > factor) factor *= 2;
  return static_cast<double>(factor);
}

LowPrecisionState::LowPrecisionState(std::shared_ptr<ProcessGroup> pg, at::ScalarType parameter_type)
    : DefaultState(std::move(pg)), parameter_type(parameter_type) {
  DDPKIT_CHECK(at::isFloatingType(parameter_type), "LowPrecisionState: parameter type must be floating point, got ",
               parameter_type);
}

namespace {

// Once `done` completes: t /= post, then (when given) t is cast into `target`; the future's value
// is target (or t). Runs as a future callback: local work only.
FuturePtr then_postdivide(const FuturePtr& done, double post, at::Tensor t, at::Tensor target = {}) {
  return done->then(
      [post, t, target](c10::ivalue::Future& f) -> c10::IValue {
        f.value();  // rethrows the collective's error
        if (post > 1) t.div_(post);
        if (!target.defined()) return c10::IValue(t);
        target.view({-1}).copy_(t.view({-1}));
        return c10::IValue(target);
      },
      c10::TensorType::get());
}

FuturePtr low_precision_hook(at::ScalarType precision, const LowPrecisionState& state, const at::Tensor& grad,
                             const at::Tensor& output) {
  const at::Tensor& target = output.defined() ? output : grad;
  DDPKIT_CHECK(target.scalar_type() == state.parameter_type, "low-precision hook: the result tensor is ",
               target.scalar_type(), " but the state's parameter type is ", state.parameter_type);
  at::Tensor low = grad.to(precision).contiguous();
  if (low.data_ptr() == grad.data_ptr()) low = low.clone();  // never communicate in the caller's tensor
  if (state.gradient_predivide_factor > 1) low.div_(state.gradient_predivide_factor);
  if (output.defined()) {
    DDPKIT_CHECK(grad.numel() == output.numel() * state.world_size, "low-precision hook: grad has ", grad.numel(),
                 " elements, expected world size (", state.world_size, ") x output (", output.numel(), ")");
    at::Tensor low_out = at::empty({output.numel()}, low.options());
    return then_postdivide(state.process_group->reduce_scatter(low_out, low.view({-1})),
                           state.gradient_postdivide_factor, low_out, output);
  }
  return then_postdivide(state.process_group->allreduce(low), state.gradient_postdivide_factor, low, grad);
}

}  // namespace

FuturePtr allreduce_hook(const DefaultState& state, const at::Tensor& grad) {
  if (state.gradient_predivide_factor > 1) grad.div_(state.gradient_predivide_factor);
  return then_postdivide(state.process_group->allreduce(grad), state.gradient_postdivide_factor, grad);
}

FuturePtr reduce_scatter_hook(const DefaultState& state, const at::Tensor& grad, const at::Tensor& output) {
  DDPKIT_CHECK(grad.numel() == output.numel() * state.world_size, "reduce_scatter_hook: grad has ", grad.numel(),
               " elements, expected world size (", state.world_size, ") x output (", output.numel(), ")");
  if (state.gradient_predivide_factor > 1) grad.div_(state.gradient_predivide_factor);
  return then_postdivide(state.process_group->reduce_scatter(output, grad.reshape({-1})),
                         state.gradient_postdivide_factor, output);
}

FuturePtr fp16_compress_hook(const LowPrecisionState& state, const at::Tensor& grad, const at::Tensor& output) {
  return low_precision_hook(at::kHalf, state, grad, output);
}

FuturePtr bf16_compress_hook(const LowPrecisionState& state, const at::Tensor& grad, const at::Tensor& output) {
  return low_precision_hook(at::kBFloat16, state, grad, output);
}

}  // namespace fsdp
}  // namespace ddpkit
