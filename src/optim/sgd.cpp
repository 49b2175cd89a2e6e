#include <ddpkit/optim/sgd.h>

#include <ddpkit/compat.h>
#include <ddpkit/error.h>

#include <ATen/Parallel.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <cstdlib>
#include <cstring>
#include <memory>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace ddpkit {
namespace optim {
namespace {

// The constants as ATen's kernels see them: a Scalar applied to a float tensor becomes a float.
// Whether to decay is decided on the double option, as libtorch does: a weight decay too small
// for a float still runs its (zero) multiply-add there, which can turn a -0 gradient into +0.
struct Coefficients {
  float weight_decay, momentum, one_minus_dampening, minus_lr;
  bool decay, nesterov;
};

#if defined(__x86_64__)
// ATen's float add with alpha is vec::fmadd(other, alpha, self), and its scalar tails are
// contracted to the same instruction in its AVX2/AVX512 kernels; mul is a plain multiply.
// Writing those operations here, in that order, gives its results bit for bit.
__attribute__((target("avx2,fma"))) void update_avx2(float* p, const float* g, float* buf, int64_t n,
                                                     const Coefficients& c) {
  const __m256 wd = _mm256_set1_ps(c.weight_decay), m = _mm256_set1_ps(c.momentum),
               keep = _mm256_set1_ps(c.one_minus_dampening), step = _mm256_set1_ps(c.minus_lr);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 pv = _mm256_loadu_ps(p + i);
    __m256 d = _mm256_loadu_ps(g + i);
    if (c.decay) d = _mm256_fmadd_ps(pv, wd, d);
    const __m256 b = _mm256_fmadd_ps(d, keep, _mm256_mul_ps(_mm256_loadu_ps(buf + i), m));
    _mm256_storeu_ps(buf + i, b);
    d = c.nesterov ? _mm256_fmadd_ps(b, m, d) : b;
    _mm256_storeu_ps(p + i, _mm256_fmadd_ps(d, step, pv));
  }
  for (; i < n; ++i) {
    float d = g[i];
    if (c.decay) d = __builtin_fmaf(p[i], c.weight_decay, d);
    const float b = __builtin_fmaf(d, c.one_minus_dampening, buf[i] * c.momentum);
    buf[i] = b;
    d = c.nesterov ? __builtin_fmaf(b, c.momentum, d) : b;
    p[i] = __builtin_fmaf(d, c.minus_lr, p[i]);
  }
}

// Whether ATen's float kernels run with FMA here: its dispatch picks AVX512 or AVX2 (both fuse)
// unless the CPU lacks them or ATEN_CPU_CAPABILITY=default asks for the plain kernels.
bool aten_fuses_multiply_add() {
  static const bool fuses = [] {
    const char* forced = std::getenv("ATEN_CPU_CAPABILITY");
    if (forced && std::strcmp(forced, "default") == 0) return false;
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  return fuses;
}
#endif

bool one_pass_applies(const at::Tensor& p, const at::Tensor& g, const at::Tensor& buf) {
#if defined(__x86_64__)
  auto plain_float = [&](const at::Tensor& t) {
    return t.device().is_cpu() && t.layout() == at::kStrided && t.scalar_type() == at::kFloat && t.is_contiguous() &&
           t.sizes() == p.sizes();
  };
  return aten_fuses_multiply_add() && buf.defined() && plain_float(p) && plain_float(g) && plain_float(buf) &&
         !g.is_same(p) && !buf.is_same(p) && !buf.is_same(g);
#else
  return false;
#endif
}

// Above this, ATen splits an elementwise kernel across threads (at::internal::GRAIN_SIZE).
constexpr int64_t kGrain = 32768;

}  // namespace

void sgd_update(const at::Tensor& param, const at::Tensor& grad, at::Tensor& momentum_buffer,
                const torch::optim::SGDOptions& o) {
  at::NoGradGuard no_grad;
  at::Tensor p = param.detach();
  if (o.momentum() != 0 && one_pass_applies(p, grad, momentum_buffer)) {
#if defined(__x86_64__)
    const Coefficients c{static_cast<float>(o.weight_decay()), static_cast<float>(o.momentum()),
                         static_cast<float>(1 - o.dampening()), static_cast<float>(-1 * o.lr()),
                         o.weight_decay() != 0, o.nesterov()};
    float* pp = p.data_ptr<float>();
    const float* gp = grad.data_ptr<float>();
    float* bp = momentum_buffer.data_ptr<float>();
    at::parallel_for(0, p.numel(), kGrain, [&](int64_t begin, int64_t end) {
      update_avx2(pp + begin, gp + begin, bp + begin, end - begin, c);
    });
    return;
#endif
  }
  // libtorch's torch::optim::SGD::step, operation by operation.
  at::Tensor d_p = grad;
  if (o.weight_decay() != 0) d_p = d_p.add(p, o.weight_decay());
  if (o.momentum() != 0) {
    if (!momentum_buffer.defined()) {
      momentum_buffer = d_p.clone().detach();
    } else {
      momentum_buffer.mul_(o.momentum()).add_(d_p, 1 - o.dampening());
    }
    d_p = o.nesterov() ? d_p.add(momentum_buffer, o.momentum()) : momentum_buffer;
  }
  p.add_(d_p, -1 * o.lr());
}

at::Tensor SGD::step(LossClosure closure) {
  at::NoGradGuard no_grad;
  at::Tensor loss;
  if (closure != nullptr) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  for (auto& group : param_groups_) {
    const auto& options = static_cast<const torch::optim::SGDOptions&>(group.options());
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      if (options.momentum() == 0) {
        at::Tensor none;
        sgd_update(p, p.grad(), none, options);
        continue;
      }
      const auto key = compat::optimizer_state_key(state_, p);
      auto it = state_.find(key);
      if (it == state_.end()) {
        at::Tensor buf;
        sgd_update(p, p.grad(), buf, options);
        auto state = std::make_unique<torch::optim::SGDParamState>();
        state->momentum_buffer(buf);
        state_[key] = std::move(state);
      } else {
        auto& state = static_cast<torch::optim::SGDParamState&>(*it->second);
        at::Tensor buf = state.momentum_buffer();
        sgd_update(p, p.grad(), buf, options);
      }
    }
  }
  return loss;
}

}  // namespace optim
}  // namespace ddpkit
