// The Gloo transport's collectives (gloo_transport.h). Allreduce, broadcast and barrier are
// c10d's; allgather and alltoall of CPU tensors go point to point (gloo_exchange.cpp).
#include "gloo_transport.h"

#include <signal.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <mutex>

namespace ddpkit {

using detail::bytes_of;
using detail::describe_tensor;

std::shared_ptr<::gloo::transport::Device> make_gloo_device(const ProcessGroupOptions& o) {
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME")) {
    return c10d::ProcessGroupGloo::createDeviceForInterface(ifname);
  }
  if (!o.gloo_hostname().empty()) {
    return c10d::ProcessGroupGloo::createDeviceForHostname(o.gloo_hostname());
  }
  const char* master = std::getenv("MASTER_ADDR");
  if (is_loopback_host(master ? master : "")) {
    return c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
  }
  const std::string towards = local_address_towards(master, 1);
  if (!towards.empty()) return c10d::ProcessGroupGloo::createDeviceForHostname(towards);
  return c10d::ProcessGroupGloo::createDefaultDevice();
}

namespace {
void swallow_sigpipe(int) {}
}  // namespace

// Gloo writes to its sockets with writev, which raises SIGPIPE once the peer has gone; at the
// signal's default that ends this process instead of failing the collective. Python ignores
// SIGPIPE at startup, so PyTorch never meets it; here, once, a handler that does nothing is set
// unless the program has its own: the write then fails with EPIPE and the collective with a
// CommError. (A handler rather than SIG_IGN: programs this one execs start with the default.)
void survive_writes_to_dead_peers() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction current {};
    if (sigaction(SIGPIPE, nullptr, &current) != 0 || (current.sa_flags & SA_SIGINFO) || current.sa_handler != SIG_DFL)
      return;
    struct sigaction swallow {};
    swallow.sa_handler = swallow_sigpipe;
    swallow.sa_flags = SA_RESTART;
    sigemptyset(&swallow.sa_mask);
    sigaction(SIGPIPE, &swallow, nullptr);
  });
}

std::unique_lock<std::mutex> lock_gloo_calls() {
  // libtorch's Gloo records each collective in one process-wide flight recorder whose table of
  // groups it fills without a lock (libtorch after 2.6): calls from two groups at once corrupt it.
  static std::mutex gloo_calls;
  return std::unique_lock<std::mutex>(gloo_calls);
}

GlooTransport::GlooTransport(GroupCore& core, const c10::intrusive_ptr<c10d::Store>& store) : Transport(core) {
  survive_writes_to_dead_peers();
  const ProcessGroupOptions& o = core.options();
  DDPKIT_CHECK(o.gloo_threads() >= 1, "gloo_threads must be >= 1, got ", o.gloo_threads());
  DDPKIT_CHECK(o.gloo_connections() >= 1, "gloo_connections must be >= 1, got ", o.gloo_connections());
  auto gopts = c10d::ProcessGroupGloo::Options::create(o.timeout());
  for (int c = 0; c < o.gloo_connections(); ++c) gopts->devices.push_back(make_gloo_device(o));
  gopts->threads = std::max(o.gloo_threads(), o.gloo_connections());
  backend_ = c10::make_intrusive<c10d::ProcessGroupGloo>(store, core.rank(), core.size(), gopts);
  exchange_waiter_ = std::make_unique<JobThread>();
}

GlooTransport::~GlooTransport() = default;

detail::BackendCall GlooTransport::backend_call() { return {lock_gloo_calls(), backend_.get()}; }

bool GlooTransport::point_to_point(const at::Tensor& t) const {
  return t.device().is_cpu() && !t.is_sparse();
}

FuturePtr GlooTransport::allreduce(const at::Tensor& tensor, c10d::ReduceOp op) {
  // One rank: every reduction is the identity (and Gloo would reject bfloat16).
  if (core_.size() == 1) return completed_future(tensor);
  // Gloo has no AVG: a SUM, divided when it lands.
  if (op == c10d::ReduceOp::AVG) return core_.divided_by_size(allreduce(tensor, c10d::ReduceOp::SUM), tensor);
  const uint64_t n = static_cast<uint64_t>(core_.size());
  const uint64_t bus = tensor.is_sparse() ? (n - 1) * (bytes_of(tensor._indices()) + bytes_of(tensor._values()))
                                          : 2 * (n - 1) * bytes_of(tensor) / n;
  if (core_.options().gloo_connections() > 1 && !tensor.is_sparse() && tensor.is_contiguous() &&
      bytes_of(tensor) >= (4u << 20))
    return sliced_allreduce(tensor, op, bus);
  const auto timeout = core_.timeout();
  return core_.issue("allreduce (" + describe_tensor(tensor) + ")", bus, tensor, [this, tensor, op, timeout] {
    std::vector<at::Tensor> v{tensor};
    c10d::AllreduceOptions o;
    o.reduceOp = op;
    o.timeout = timeout;
    return with_backend([&](compat::Backend& b) { return b.allreduce(v, o); });
  });
}

FuturePtr GlooTransport::sliced_allreduce(const at::Tensor& tensor, c10d::ReduceOp op, uint64_t bus) {
  const int slices = core_.options().gloo_connections();
  auto result = make_tensor_future(tensor.device());
  const std::string what = "allreduce (" + describe_tensor(tensor) + ", " + std::to_string(slices) + " slices)";
  core_.post([this, tensor, op, slices, result, what, bus] {
    try {
      core_.count(bus, bus);
      const at::Tensor flat = tensor.view({-1});
      const int64_t step = (flat.numel() + slices - 1) / slices;
      std::vector<c10::intrusive_ptr<c10d::Work>> works;
      for (int64_t off = 0; off < flat.numel(); off += step) {
        std::vector<at::Tensor> v{flat.narrow(0, off, std::min(step, flat.numel() - off))};
        c10d::AllreduceOptions o;
        o.reduceOp = op;
        o.timeout = core_.timeout();
        works.push_back(with_backend([&](compat::Backend& b) { return b.allreduce(v, o); }));
      }
      auto remaining = std::make_shared<std::atomic<int>>(static_cast<int>(works.size()));
      auto failed = std::make_shared<std::atomic<bool>>(false);
      GroupCore* core = &core_;
      for (auto& w : works) {
        w->getFuture()->addCallback([=](c10::ivalue::Future& f) {
          if (f.hasError() && !failed->exchange(true)) core->fail(result, what, f.exception_ptr());
          if (remaining->fetch_sub(1) == 1 && !failed->load()) result->markCompleted(c10::IValue(tensor));
        });
      }
    } catch (...) {
      core_.fail(result, what, std::current_exception());
    }
  });
  return result;
}

FuturePtr GlooTransport::broadcast(const at::Tensor& tensor, int root) {
  const uint64_t n = static_cast<uint64_t>(core_.size());
  const auto timeout = core_.timeout();
  return core_.issue("broadcast from rank " + std::to_string(root) + " (" + describe_tensor(tensor) + ")",
                     (n - 1) * bytes_of(tensor) / n, tensor, [this, tensor, root, timeout] {
                       // Only bytes move: Gloo has no bf16, so it travels as fp16 bits.
                       std::vector<at::Tensor> v{tensor.scalar_type() == at::kBFloat16 ? tensor.view(at::kHalf) : tensor};
                       c10d::BroadcastOptions o;
                       o.rootRank = root;
                       o.timeout = timeout;
                       return with_backend([&](compat::Backend& b) { return b.broadcast(v, o); });
                     });
}

FuturePtr GlooTransport::allgather(const std::vector<at::Tensor>& outputs, const at::Tensor& input) {
  if (core_.size() == 1 || !point_to_point(input)) return Transport::allgather(outputs, input);
  auto result = make_tensor_future(input.device());
  core_.post([this, outputs, input, result] { exchange_allgather(outputs, input, input, result); });
  return result;
}

FuturePtr GlooTransport::allgather_into_tensor(const at::Tensor& output, const at::Tensor& input) {
  if (core_.size() == 1) {
    output.view({-1}).copy_(input.reshape({-1}));
    return completed_future(output);
  }
  if (point_to_point(input)) {
    auto result = make_tensor_future(input.device());
    core_.post([this, output, input, result] {
      const int64_t m = input.numel();
      std::vector<at::Tensor> blocks;
      for (int64_t r = 0; r < core_.size(); ++r) blocks.push_back(output.view({-1}).narrow(0, r * m, m));
      exchange_allgather(blocks, input, output, result);
    });
    return result;
  }
  const uint64_t n = static_cast<uint64_t>(core_.size());
  const auto timeout = core_.timeout();
  return core_.issue("allgather (" + describe_tensor(input) + " per rank)", (n - 1) * bytes_of(input), output,
                     [this, output, input, timeout] {
                       at::Tensor out = output, in = input.contiguous();
                       c10d::AllgatherOptions o;
                       o.timeout = timeout;
                       return with_backend([&](compat::Backend& b) { return compat::all_gather_single(b, out, in, o); });
                     });
}

FuturePtr GlooTransport::alltoall(const at::Tensor& output, const at::Tensor& input) {
  if (point_to_point(input)) {
    auto result = make_tensor_future(output.device());
    core_.post([this, output, input, result] { exchange_alltoall(output, input, result); });
    return result;
  }
  const uint64_t n = static_cast<uint64_t>(core_.size());
  const auto timeout = core_.timeout();
  return core_.issue("alltoall (" + describe_tensor(input) + ")", (n - 1) * bytes_of(input) / n, output,
                     [this, output, input, timeout] {
                       // Only bytes move: 16-bit types travel as bytes.
                       const bool half = input.scalar_type() == at::kHalf || input.scalar_type() == at::kBFloat16;
                       at::Tensor out = half ? output.view(at::kByte) : output;
                       at::Tensor in = half ? input.view(at::kByte) : input;
                       std::vector<int64_t> equal;
                       c10d::AllToAllOptions o;
                       o.timeout = timeout;
                       return with_backend(
                           [&](compat::Backend& b) { return compat::all_to_all_single(b, out, in, equal, equal, o); });
                     });
}

FuturePtr GlooTransport::barrier() {
  // An allreduce of one element: unlike c10d's barrier it goes through the same ordered path and
  // carries the same error decoration.
  auto t = at::zeros({1}, at::kFloat);
  const auto timeout = core_.timeout();
  return core_.issue("barrier", 0, t, [this, t, timeout] {
    std::vector<at::Tensor> v{t};
    c10d::AllreduceOptions o;
    o.timeout = timeout;
    return with_backend([&](compat::Backend& b) { return b.allreduce(v, o); });
  });
}

FuturePtr GlooTransport::two_phase(const std::shared_ptr<TwoPhaseJob>& job, const at::Tensor& value,
                                   const std::string& what) {
  auto result = make_tensor_future(value.device());
  core_.post([this, job, value, what, result] { run_two_phase_over_backend(core_, *this, job, value, what, result); });
  return result;
}

std::unique_ptr<Transport> make_gloo_transport(GroupCore& core, const c10::intrusive_ptr<c10d::Store>& store) {
  return std::make_unique<GlooTransport>(core, store);
}

}  // namespace ddpkit
