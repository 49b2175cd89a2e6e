#include <ddpkit/codecs/cast.h>
#include <ddpkit/comm/process_group.h>

#include "process_group_internal.h"
#include "setup_keys.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#ifdef USE_C10D_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <algorithm>
#include <cstdlib>
#include <sstream>

namespace ddpkit {

using detail::bytes_of;
using detail::describe_tensor;
using detail::fail;

std::string describe_comm_failure(const std::string& op, int rank, int world_size,
                                  std::exception_ptr cause) {
  std::string msg;
  try {
    std::rethrow_exception(cause);
  } catch (const c10::Error& e) {
    msg = e.what_without_backtrace();
  } catch (const std::exception& e) {
    msg = e.what();
  } catch (...) {
    msg = "unknown error";
  }
  // CommErrors raised further down already carry the context; do not wrap them twice.
  if (msg.rfind("ddpkit: ", 0) == 0) return msg;
  return "ddpkit: " + op + " failed on rank " + std::to_string(rank) + " of " +
         std::to_string(world_size) + ": " + msg;
}

namespace detail {
void fail(const FuturePtr& result, const std::string& op, int rank, int world_size, std::exception_ptr cause) {
  result->setError(std::make_exception_ptr(CommError(describe_comm_failure(op, rank, world_size, cause))));
}

std::string describe_tensor(const at::Tensor& t) {
  std::ostringstream os;
  os << t.numel() * t.element_size() << " B " << t.scalar_type();
  return os.str();
}
}  // namespace detail

FuturePtr make_tensor_future(c10::Device device) {
  std::vector<c10::Device> devices;
  if (!device.is_cpu()) devices.push_back(device);
  return c10::make_intrusive<c10::ivalue::Future>(c10::TensorType::get(), std::move(devices));
}

FuturePtr completed_future(const at::Tensor& value) {
  auto f = make_tensor_future(value.defined() ? value.device() : c10::Device(c10::kCPU));
  f->markCompleted(c10::IValue(value));
  return f;
}

FuturePtr when_all(const std::vector<FuturePtr>& all, const at::Tensor& value) {
  if (all.empty()) return completed_future(value);
  auto result = make_tensor_future(value.defined() ? value.device() : c10::Device(c10::kCPU));
  auto remaining = std::make_shared<std::atomic<size_t>>(all.size());
  auto failed = std::make_shared<std::atomic<bool>>(false);
  for (const auto& f : all) {
    f->addCallback([result, remaining, failed, value](c10::ivalue::Future& done) {
      if (done.hasError()) {
        if (!failed->exchange(true)) result->setError(done.exception_ptr());
      } else if (remaining->fetch_sub(1) == 1 && !failed->load()) {
        result->markCompleted(c10::IValue(value));
      }
    });
  }
  return result;
}

namespace {

// Runs fn on `t` if contiguous, else on a contiguous copy that is copied back (in-place collectives).
void on_contiguous(const at::Tensor& t, const std::function<void(const at::Tensor&)>& fn) {
  if (t.is_contiguous()) return fn(t);
  at::Tensor c = t.contiguous();
  fn(c);
  t.copy_(c);
}

bool is_loopback(const std::string& host) {
  return host.empty() || host == "localhost" || host.rfind("127.", 0) == 0 || host == "::1";
}

std::shared_ptr<::gloo::transport::Device> make_gloo_device(const ProcessGroupOptions& o) {
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME")) {
    return c10d::ProcessGroupGloo::createDeviceForInterface(ifname);
  }
  if (!o.gloo_hostname().empty()) {
    return c10d::ProcessGroupGloo::createDeviceForHostname(o.gloo_hostname());
  }
  const char* master = std::getenv("MASTER_ADDR");
  if (is_loopback(master ? master : "")) {
    return c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
  }
  return c10d::ProcessGroupGloo::createDefaultDevice();
}

}  // namespace

ProcessGroup::ProcessGroup(c10::intrusive_ptr<c10d::Store> store, int rank, int world_size,
                           ProcessGroupOptions options)
    : store_(std::move(store)),
      rank_(rank),
      world_size_(world_size),
      options_(std::move(options)),
      piece_bytes_(options_.piece_bytes()) {
  DDPKIT_CHECK(store_, "ProcessGroup needs a store");
  DDPKIT_CHECK(world_size_ >= 1, "world_size must be >= 1, got ", world_size_);
  DDPKIT_CHECK(rank_ >= 0 && rank_ < world_size_, "rank must be in [0, ", world_size_, "), got ", rank_);
  DDPKIT_CHECK(options_.timeout().count() > 0, "timeout must be positive, got ", options_.timeout().count(), " ms");
  DDPKIT_CHECK(options_.piece_bytes() >= 1, "piece_bytes must be >= 1, got ", options_.piece_bytes());
  DDPKIT_CHECK(options_.backend() == "gloo" || options_.backend() == "nccl", "unknown backend '", options_.backend(),
               "' (expected gloo or nccl)");
  // Every key construction touches passes through `setup`, so the last rank done can delete them.
  // (NCCL's rendezvous is lazy, at its first collective: it gets the group's store itself.)
  c10::intrusive_ptr<c10d::Store> group_store = c10::make_intrusive<c10d::PrefixStore>(options_.group_name() + "/", store_);
  auto setup = c10::make_intrusive<detail::SetupKeysStore>(group_store);
  c10::intrusive_ptr<c10d::Store> prefixed = setup;
  const std::string what = "rendezvous of process group '" + options_.group_name() + "' (" +
                           options_.backend() + ", timeout " +
                           std::to_string(options_.timeout().count()) + " ms)";
  try {
    if (options_.backend() == "gloo") {
      DDPKIT_CHECK(options_.gloo_threads() >= 1, "gloo_threads must be >= 1, got ", options_.gloo_threads());
      auto gopts = c10d::ProcessGroupGloo::Options::create(options_.timeout());
      DDPKIT_CHECK(options_.gloo_connections() >= 1, "gloo_connections must be >= 1, got ", options_.gloo_connections());
      for (int c = 0; c < options_.gloo_connections(); ++c) gopts->devices.push_back(make_gloo_device(options_));
      gopts->threads = std::max(options_.gloo_threads(), options_.gloo_connections());
      backend_ = c10::make_intrusive<c10d::ProcessGroupGloo>(prefixed, rank_, world_size_, gopts);
    } else if (options_.backend() == "nccl") {
#ifdef USE_C10D_NCCL
      auto nopts = c10d::ProcessGroupNCCL::Options::create();
      nopts->timeout = options_.timeout();
      backend_ = c10::make_intrusive<c10d::ProcessGroupNCCL>(group_store, rank_, world_size_, nopts);
#else
      DDPKIT_CHECK(false, "backend 'nccl' is not available: this libtorch was built without CUDA/NCCL"
                   " (available: gloo)");
#endif
    }
  } catch (const std::exception&) {
    throw CommError(describe_comm_failure(what, rank_, world_size_, std::current_exception()));
  }
  // Which ranks share a host: per group, from what each rank publishes (docs/design.md).
  topology_ = discover_host_topology(*prefixed, "ddpkit/topology", rank_, world_size_, options_.timeout());
  setup_shared_memory(prefixed);
  sequencer_ = std::make_unique<JobThread>();
  if (options_.backend() == "gloo") exchange_waiter_ = std::make_unique<JobThread>();
  // Gloo's lazy connections (TORCH_GLOO_LAZY_INIT, libtorch 2.8+) read the rendezvous keys at the
  // first collective: they stay then.
  const char* lazy = std::getenv("TORCH_GLOO_LAZY_INIT");
  if (lazy && !std::string(lazy).empty() && std::string(lazy) != "0") return;
  try {
    setup->finish(world_size_, options_.timeout());
  } catch (const std::exception&) {
    throw CommError(describe_comm_failure(what, rank_, world_size_, std::current_exception()));
  }
}

ProcessGroup::~ProcessGroup() {
  sequencer_.reset();  // drains: its jobs may still hand work to the shm and exchange threads
  exchange_waiter_.reset();
  shm_.reset();
}

namespace {
thread_local int64_t t_traffic_key = -1;
}

TrafficScope::TrafficScope(int64_t key) : previous_(t_traffic_key) { t_traffic_key = key; }
TrafficScope::~TrafficScope() { t_traffic_key = previous_; }
int64_t TrafficScope::current() { return t_traffic_key; }

std::unique_lock<std::mutex> ProcessGroup::backend_call_lock() const {
  // Not NCCL's: its first collective on a group joins the peers' (a lock held across it would
  // wait forever for rank threads of one process).
  static std::mutex gloo_calls;
  if (options_.backend() != "gloo") return {};
  return std::unique_lock<std::mutex>(gloo_calls);
}

void ProcessGroup::post(Job job) {
  if (sequencer_->is_current()) {  // inside run_ordered: issue inline, in program order
    job();
    return;
  }
  // The job's collectives count towards the key of the thread that handed it over.
  sequencer_->post([key = TrafficScope::current(), job = std::move(job)] {
    TrafficScope scope(key);
    job();
  });
}

void ProcessGroup::count(uint64_t bytes_sent, uint64_t bytes_received, bool shared_memory) {
  std::lock_guard<std::mutex> lock(stats_mutex_);
  for (CommStats* s : {&totals_, TrafficScope::current() >= 0 ? &by_key_[TrafficScope::current()] : nullptr}) {
    if (!s) continue;
    (shared_memory ? s->shm_bytes_sent : s->bytes_sent) += bytes_sent;
    (shared_memory ? s->shm_bytes_received : s->bytes_received) += bytes_received;
    s->collectives += 1;
  }
}

at::Tensor ProcessGroup::take_workspace(at::ScalarType dtype, int64_t numel) {
  {
    std::lock_guard<std::mutex> lock(pool_mutex_);
    auto it = pool_.find({static_cast<int>(dtype), numel});
    if (it != pool_.end() && !it->second.empty()) {
      at::Tensor t = std::move(it->second.back());
      it->second.pop_back();
      return t;
    }
  }
  return at::empty({numel}, at::TensorOptions().dtype(dtype));
}

void ProcessGroup::give_workspace(at::Tensor t) {
  std::lock_guard<std::mutex> lock(pool_mutex_);
  auto& slot = pool_[{static_cast<int>(t.scalar_type()), t.numel()}];
  if (slot.size() < 4) slot.push_back(std::move(t));  // bounded: at most 4 per shape
}

CommStats ProcessGroup::stats() const {
  std::lock_guard<std::mutex> lock(stats_mutex_);
  return totals_;
}

CommStats ProcessGroup::traffic(int64_t key) const {
  std::lock_guard<std::mutex> lock(stats_mutex_);
  auto it = by_key_.find(key);
  return it == by_key_.end() ? CommStats{} : it->second;
}

void ProcessGroup::reset_stats() {
  std::lock_guard<std::mutex> lock(stats_mutex_);
  totals_ = {};
  by_key_.clear();
}

void ProcessGroup::link(const c10::intrusive_ptr<c10d::Work>& work, const FuturePtr& result,
                        const at::Tensor& value, const std::string& what) {
  const int rank = rank_, world = world_size_;
  work->getFuture()->addCallback([result, value, what, rank, world](c10::ivalue::Future& f) {
    if (f.hasError()) {
      fail(result, what, rank, world, f.exception_ptr());
    } else {
      result->markCompleted(c10::IValue(value));
    }
  });
}

FuturePtr ProcessGroup::issue(const std::string& what, uint64_t bus_bytes, const at::Tensor& value,
                              std::function<c10::intrusive_ptr<c10d::Work>()> op) {
  auto result = make_tensor_future(value.device());
  post([this, result, value, what, bus_bytes, op = std::move(op)] {
    try {
      count(bus_bytes, bus_bytes);
      link(op(), result, value, what);
    } catch (...) {
      fail(result, what, rank_, world_size_, std::current_exception());
    }
  });
  return result;
}

bool ProcessGroup::use_two_phase(const at::Tensor& tensor, c10d::ReduceOp op) const {
  if (options_.backend() != "gloo" || world_size_ == 1 || tensor.is_sparse() || !tensor.device().is_cpu()) return false;
  const auto dt = tensor.scalar_type();
  if (dt == at::kHalf || dt == at::kBFloat16) {
    // Gloo has no bf16 and sums fp16 one element at a time in software.
    DDPKIT_CHECK(op == c10d::ReduceOp::SUM, "allreduce of ", dt, " on gloo supports only SUM");
    return true;
  }
  return op == c10d::ReduceOp::SUM && (dt == at::kFloat || dt == at::kDouble) &&
         options_.two_phase_min_bytes() > 0 && bytes_of(tensor) >= static_cast<uint64_t>(options_.two_phase_min_bytes());
}

FuturePtr ProcessGroup::allreduce(const at::Tensor& tensor, c10d::ReduceOp op) {
  // One rank: every reduction is the identity (and Gloo would reject bfloat16).
  if (world_size_ == 1 && options_.backend() == "gloo") return completed_future(tensor);
  const bool avg = op == c10d::ReduceOp::AVG;
  if (shm_ && tensor.device().is_cpu() && !tensor.is_sparse() && (op == c10d::ReduceOp::SUM || avg) &&
      codecs::sums_raw(tensor.scalar_type())) {
    const double scale = avg ? 1.0 / world_size_ : 1.0;
    const uint64_t n = static_cast<uint64_t>(world_size_);
    const std::string what = "allreduce (" + describe_tensor(tensor) + ")";
    if (!shm_->across)
      return shm_issue(what, 2 * (n - 1) * bytes_of(tensor) / n, tensor, [this, tensor, scale] {
        on_contiguous(tensor, [&](const at::Tensor& c) {
          shm_->domain->allreduce(c.data_ptr(), c.numel(), c.scalar_type(), scale);
        });
      });
    // Hierarchical: the network carries each host's sum once, split over its ranks.
    const uint64_t hosts = static_cast<uint64_t>(topology_.hosts()), local = static_cast<uint64_t>(topology_.local_size());
    const uint64_t net = 2 * (hosts - 1) * bytes_of(tensor) / hosts / local;
    const uint64_t within = 2 * (local - 1) * bytes_of(tensor) / local;
    return shm_issue(
        what + " (hierarchical: shared memory within hosts, gloo across)", tensor,
        [this, net, within] {
          count(net, net);
          count(within, within, /*shared_memory=*/true);
        },
        [this, tensor, scale] {
          on_contiguous(tensor, [&](const at::Tensor& c) { hierarchical_allreduce(c, scale); });
        });
  }
  if (avg) {
    // Gloo has no AVG: a SUM, divided when it lands.
    auto result = make_tensor_future(tensor.device());
    const int rank = rank_, world = world_size_;
    allreduce(tensor, c10d::ReduceOp::SUM)->addCallback([tensor, result, rank, world](c10::ivalue::Future& f) {
      if (f.hasError()) return result->setError(f.exception_ptr());
      try {
        tensor.div_(world);
        result->markCompleted(c10::IValue(tensor));
      } catch (...) {
        fail(result, "allreduce (AVG)", rank, world, std::current_exception());
      }
    });
    return result;
  }
  if (use_two_phase(tensor, op)) {
    auto result = make_tensor_future(tensor.device());
    post([this, tensor, result] { two_phase_allreduce(tensor, result); });
    return result;
  }
  const uint64_t n = static_cast<uint64_t>(world_size_);
  const uint64_t bus = tensor.is_sparse()
                           ? (n - 1) * (bytes_of(tensor._indices()) + bytes_of(tensor._values()))
                           : 2 * (n - 1) * bytes_of(tensor) / n;
  const int slices = options_.gloo_connections();
  if (slices > 1 && options_.backend() == "gloo" && !tensor.is_sparse() && tensor.is_contiguous() &&
      bytes_of(tensor) >= (4u << 20)) {
    // One allreduce per connection, issued back to back: Gloo runs them concurrently.
    auto result = make_tensor_future(tensor.device());
    const std::string what = "allreduce (" + describe_tensor(tensor) + ", " + std::to_string(slices) + " slices)";
    post([this, tensor, op, slices, result, what, bus] {
      try {
        count(bus, bus);
        const at::Tensor flat = tensor.view({-1});
        const int64_t step = (flat.numel() + slices - 1) / slices;
        auto remaining = std::make_shared<std::atomic<int>>(0);
        std::vector<c10::intrusive_ptr<c10d::Work>> works;
        for (int64_t off = 0; off < flat.numel(); off += step) {
          std::vector<at::Tensor> v{flat.narrow(0, off, std::min(step, flat.numel() - off))};
          c10d::AllreduceOptions o;
          o.reduceOp = op;
          o.timeout = options_.timeout();
          works.push_back(with_backend([&](compat::Backend& b) { return b.allreduce(v, o); }));
        }
        remaining->store(static_cast<int>(works.size()));
        auto failed = std::make_shared<std::atomic<bool>>(false);
        const int rank = rank_, world = world_size_;
        for (auto& w : works) {
          w->getFuture()->addCallback([=](c10::ivalue::Future& f) {
            if (f.hasError() && !failed->exchange(true)) {
              fail(result, what, rank, world, f.exception_ptr());
            }
            if (remaining->fetch_sub(1) == 1 && !failed->load()) result->markCompleted(c10::IValue(tensor));
          });
        }
      } catch (...) {
        fail(result, what, rank_, world_size_, std::current_exception());
      }
    });
    return result;
  }
  return issue("allreduce (" + describe_tensor(tensor) + ")", bus, tensor, [this, tensor, op] {
    std::vector<at::Tensor> v{tensor};
    c10d::AllreduceOptions o;
    o.reduceOp = op;
    o.timeout = options_.timeout();
    return with_backend([&](compat::Backend& b) { return b.allreduce(v, o); });
  });
}

FuturePtr ProcessGroup::broadcast(const at::Tensor& tensor, int root) {
  DDPKIT_CHECK(root >= 0 && root < world_size_, "broadcast root must be in [0, ", world_size_, "), got ", root);
  const uint64_t n = static_cast<uint64_t>(world_size_);
  if (shm_takes(tensor))
    return shm_issue("broadcast from rank " + std::to_string(root) + " (" + describe_tensor(tensor) + ")",
                     (n - 1) * bytes_of(tensor) / n, tensor, [this, tensor, root] {
                       on_contiguous(tensor, [&](const at::Tensor& c) { shm_->domain->broadcast(c.data_ptr(), bytes_of(c), root); });
                     });
  return issue("broadcast from rank " + std::to_string(root) + " (" + describe_tensor(tensor) + ")",
               (n - 1) * bytes_of(tensor) / n, tensor, [this, tensor, root] {
                 std::vector<at::Tensor> v{tensor};
                 c10d::BroadcastOptions o;
                 o.rootRank = root;
                 o.timeout = options_.timeout();
                 return with_backend([&](compat::Backend& b) { return b.broadcast(v, o); });
               });
}

FuturePtr ProcessGroup::allgather(const std::vector<at::Tensor>& outputs, const at::Tensor& input) {
  DDPKIT_CHECK(static_cast<int>(outputs.size()) == world_size_, "allgather needs ", world_size_,
               " outputs, got ", outputs.size());
  for (size_t k = 0; k < outputs.size(); ++k)
    DDPKIT_CHECK(outputs[k].numel() == input.numel() && outputs[k].scalar_type() == input.scalar_type(),
                 "allgather: output ", k, " is ", describe_tensor(outputs[k]), ", the input ", describe_tensor(input));
  if (options_.backend() == "nccl") {
    auto out_copy = outputs;
    const uint64_t n = static_cast<uint64_t>(world_size_);
    return issue("allgather (" + describe_tensor(input) + " per rank)", (n - 1) * bytes_of(input), input,
                 [this, out_copy, input] {
                   std::vector<std::vector<at::Tensor>> out{out_copy};
                   std::vector<at::Tensor> in{input};
                   c10d::AllgatherOptions o;
                   o.timeout = options_.timeout();
                   return with_backend([&](compat::Backend& b) { return b.allgather(out, in, o); });
                 });
  }
  if (world_size_ > 1 && options_.backend() == "gloo" && input.device().is_cpu() && !input.is_sparse() &&
      !shm_takes(input)) {
    auto result = make_tensor_future(input.device());
    post([this, outputs, input, result] { gloo_allgather(outputs, input, input, result); });
    return result;
  }
  // Where ranks share memory: gathered into pooled scratch, then copied out as local work once it
  // lands.
  const int64_t m = input.numel();
  at::Tensor all = take_workspace(input.scalar_type(), m * world_size_);
  return allgather_into_tensor(all, input)->then(
      [this, outputs, input, all, m](c10::ivalue::Future& f) -> c10::IValue {
        f.value();  // rethrows the collective's error
        for (size_t k = 0; k < outputs.size(); ++k)
          outputs[k].copy_(all.narrow(0, static_cast<int64_t>(k) * m, m).view(outputs[k].sizes()));
        give_workspace(all);
        return c10::IValue(input);
      },
      c10::TensorType::get());
}

FuturePtr ProcessGroup::allgather_into_tensor(const at::Tensor& output, const at::Tensor& input) {
  DDPKIT_CHECK(output.numel() == input.numel() * world_size_ && output.scalar_type() == input.scalar_type() &&
                   output.device() == input.device(),
               "allgather_into_tensor: output is ", describe_tensor(output), ", expected ", world_size_,
               " x the input (", describe_tensor(input), ")");
  DDPKIT_CHECK(output.is_contiguous(), "allgather_into_tensor: the output must be contiguous");
  const uint64_t n = static_cast<uint64_t>(world_size_);
  const std::string what = "allgather (" + describe_tensor(input) + " per rank)";
  if (world_size_ == 1) {
    output.view({-1}).copy_(input.reshape({-1}));
    return completed_future(output);
  }
  if (shm_takes(input)) {
    return shm_issue(what, (n - 1) * bytes_of(input), output, [this, output, input] {
      const at::Tensor in = input.contiguous();
      shm_->domain->allgather(in.data_ptr(), output.data_ptr(), bytes_of(in));
    });
  }
  if (options_.backend() == "gloo" && input.device().is_cpu() && !input.is_sparse()) {
    auto result = make_tensor_future(input.device());
    post([this, output, input, result] {
      const int64_t m = input.numel();
      std::vector<at::Tensor> blocks;
      for (int64_t r = 0; r < world_size_; ++r) blocks.push_back(output.view({-1}).narrow(0, r * m, m));
      gloo_allgather(blocks, input, output, result);
    });
    return result;
  }
  return issue(what, (n - 1) * bytes_of(input), output, [this, output, input] {
    at::Tensor out = output, in = input.contiguous();
    c10d::AllgatherOptions o;
    o.timeout = options_.timeout();
    return with_backend([&](compat::Backend& b) { return b._allgather_base(out, in, o); });
  });
}

FuturePtr ProcessGroup::alltoall(const at::Tensor& output, const at::Tensor& input) {
  DDPKIT_CHECK(input.size(0) % world_size_ == 0, "alltoall: dim 0 (", input.size(0),
               ") must divide evenly among ", world_size_, " ranks");
  const uint64_t n = static_cast<uint64_t>(world_size_);
  DDPKIT_CHECK(bytes_of(output) == bytes_of(input), "alltoall: output is ", describe_tensor(output), ", the input ",
               describe_tensor(input));
  if (shm_takes(input))
    return shm_issue("alltoall (" + describe_tensor(input) + ")", (n - 1) * bytes_of(input) / n, output,
                     [this, output, input] {
                       const at::Tensor in = input.contiguous();
                       on_contiguous(output, [&](const at::Tensor& out) {
                         shm_->domain->alltoall(in.data_ptr(), out.data_ptr(), bytes_of(in) / world_size_);
                       });
                     });
  if (options_.backend() == "gloo" && input.device().is_cpu() && !input.is_sparse()) {
    auto result = make_tensor_future(output.device());
    post([this, output, input, result] { gloo_alltoall(output, input, result); });
    return result;
  }
  return issue("alltoall (" + describe_tensor(input) + ")", (n - 1) * bytes_of(input) / n, output,
               [this, output, input] {
                 // Only bytes move: 16-bit types travel as bytes.
                 const bool half = input.scalar_type() == at::kHalf || input.scalar_type() == at::kBFloat16;
                 at::Tensor out = half ? output.view(at::kByte) : output, in = half ? input.view(at::kByte) : input;
                 std::vector<int64_t> equal;
                 c10d::AllToAllOptions o;
                 o.timeout = options_.timeout();
                 return with_backend([&](compat::Backend& b) { return b.alltoall_base(out, in, equal, equal, o); });
               });
}

FuturePtr ProcessGroup::reduce_scatter(const at::Tensor& output, const at::Tensor& input) {
  DDPKIT_CHECK(input.numel() == output.numel() * world_size_, "reduce_scatter: input has ", input.numel(),
               " elements, expected ", world_size_, " x output (", output.numel(), ")");
  DDPKIT_CHECK(input.scalar_type() == output.scalar_type() && input.device() == output.device(),
               "reduce_scatter: input ", describe_tensor(input), " and output ", describe_tensor(output),
               " must share dtype and device");
  DDPKIT_CHECK(input.is_contiguous() && output.is_contiguous(), "reduce_scatter: tensors must be contiguous");
  if (shm_takes(input) && codecs::sums_raw(input.scalar_type())) {
    const uint64_t n = static_cast<uint64_t>(world_size_);
    return shm_issue("reduce_scatter (" + describe_tensor(input) + ")", (n - 1) * bytes_of(input) / n, output,
                     [this, output, input] {
                       shm_->domain->reduce_scatter(input.data_ptr(), output.data_ptr(), output.numel(), input.scalar_type());
                     });
  }
  if (options_.backend() == "nccl") {
    const uint64_t n = static_cast<uint64_t>(world_size_);
    return issue("reduce_scatter (" + describe_tensor(input) + ")", (n - 1) * bytes_of(input) / n, output,
                 [this, output, input] {
                   at::Tensor out = output, in = input;
                   c10d::ReduceScatterOptions o;
                   o.timeout = options_.timeout();
                   return with_backend([&](compat::Backend& b) { return b._reduce_scatter_base(out, in, o); });
                 });
  }
  // Pooled: a fresh buffer of the input's size costs more in page faults than the local sum.
  at::Tensor received = take_workspace(input.scalar_type(), input.numel()).view({world_size_, output.numel()});
  auto result = make_tensor_future(output.device());
  const int rank = rank_, world = world_size_;
  alltoall(received, input.reshape({world_size_, -1}))
      ->addCallback([=](c10::ivalue::Future& f) {
    if (f.hasError()) {
      fail(result, "reduce_scatter", rank, world, f.exception_ptr());
      return;
    }
    try {
      at::Tensor out = output.view({-1});
      if (received.scalar_type() == at::kHalf || received.scalar_type() == at::kBFloat16) {
        out.copy_(received.to(at::kFloat).sum(0));
      } else {
        at::sum_out(out, received, {0});
      }
      give_workspace(received.view({-1}));
      result->markCompleted(c10::IValue(output));
    } catch (...) {
      fail(result, "reduce_scatter", rank, world, std::current_exception());
    }
  });
  return result;
}

FuturePtr ProcessGroup::barrier() {
  // An allreduce of one element: unlike c10d barrier it goes through the same ordered path and
  // carries the same error decoration.
  auto t = at::zeros({1}, at::kFloat);
  if (shm_takes(t)) return shm_issue("barrier", 0, t, [this] { shm_->domain->barrier(); });
  return issue("barrier", 0, t, [this, t] {
    std::vector<at::Tensor> v{t};
    c10d::AllreduceOptions o;
    o.timeout = options_.timeout();
    return with_backend([&](compat::Backend& b) { return b.allreduce(v, o); });
  });
}

FuturePtr ProcessGroup::run_ordered_async(std::function<FuturePtr()> fn, c10::Device device) {
  auto result = make_tensor_future(device);
  post([this, result, fn = std::move(fn)] {
    try {
      FuturePtr inner = fn();
      DDPKIT_CHECK(inner, "run_ordered_async: the job returned no future");
      const int rank = rank_, world = world_size_;
      inner->addCallback([result, rank, world](c10::ivalue::Future& f) {
        if (f.hasError()) {
          fail(result, "ordered job", rank, world, f.exception_ptr());
        } else {
          result->markCompleted(f.value());
        }
      });
    } catch (...) {
      fail(result, "ordered job", rank_, world_size_, std::current_exception());
    }
  });
  return result;
}

FuturePtr ProcessGroup::run_ordered(std::function<at::Tensor()> fn, c10::Device device) {
  return run_ordered_async([fn = std::move(fn)] { return completed_future(fn()); }, device);
}

at::Tensor ProcessGroup::wait(const FuturePtr& future) {
  future->wait();
  if (future->hasError()) {
    try {
      std::rethrow_exception(future->exception_ptr());
    } catch (const CommError&) {
      throw;
    } catch (const std::exception& e) {
      throw CommError(std::string("ddpkit: ") + e.what());
    }
  }
  return future->value().toTensor();
}

}  // namespace ddpkit
