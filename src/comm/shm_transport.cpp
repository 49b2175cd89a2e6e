// The shared-memory transport: every rank of the group on one host, collectives through one
// segment (shm_domain.h, docs/shared_memory.md), and memory the host's ranks share so DDP's
// buckets sum in place. CUDA and sparse tensors, and reductions the segment does not sum (MAX,
// MIN, PRODUCT, integer types it cannot), go to the network transport it wraps.
#include <ddpkit/codecs/cast.h>

#include "shm_engine.h"
#include "transport.h"

#include <algorithm>

namespace ddpkit {

using detail::bytes_of;
using detail::describe_tensor;
using detail::on_contiguous;

namespace {

class ShmTransport final : public ForwardingTransport {
 public:
  ShmTransport(GroupCore& core, std::shared_ptr<ShmEngine> engine, std::unique_ptr<Transport> inner)
      : ForwardingTransport(core, std::move(inner)), engine_(std::move(engine)) {}

  std::string name() const override { return "shared memory"; }
  bool uses_shared_memory() const override { return true; }

  FuturePtr allreduce(const at::Tensor& tensor, c10d::ReduceOp op) override {
    const bool avg = op == c10d::ReduceOp::AVG;
    if (!takes(tensor) || !(op == c10d::ReduceOp::SUM || avg) || !codecs::sums_raw(tensor.scalar_type()))
      return inner_->allreduce(tensor, op);
    const double scale = avg ? 1.0 / core_.size() : 1.0;
    return engine_->issue("allreduce (" + describe_tensor(tensor) + ")", allreduce_bus_bytes(tensor), tensor,
                          [engine = engine_.get(), tensor, scale] {
                            on_contiguous(tensor, [&](const at::Tensor& c) {
                              engine->domain().allreduce(c.data_ptr(), c.numel(), c.scalar_type(), scale);
                            });
                          });
  }

  FuturePtr broadcast(const at::Tensor& tensor, int root) override {
    if (!takes(tensor)) return inner_->broadcast(tensor, root);
    const uint64_t n = static_cast<uint64_t>(core_.size());
    return engine_->issue("broadcast from rank " + std::to_string(root) + " (" + describe_tensor(tensor) + ")",
                          (n - 1) * bytes_of(tensor) / n, tensor, [engine = engine_.get(), tensor, root] {
                            on_contiguous(tensor, [&](const at::Tensor& c) {
                              engine->domain().broadcast(c.data_ptr(), bytes_of(c), root);
                            });
                          });
  }

  FuturePtr allgather_into_tensor(const at::Tensor& output, const at::Tensor& input) override {
    if (!takes(input)) return inner_->allgather_into_tensor(output, input);
    const uint64_t n = static_cast<uint64_t>(core_.size());
    return engine_->issue("allgather (" + describe_tensor(input) + " per rank)", (n - 1) * bytes_of(input), output,
                          [engine = engine_.get(), output, input] {
                            const at::Tensor in = input.contiguous();
                            engine->domain().allgather(in.data_ptr(), output.data_ptr(), bytes_of(in));
                          });
  }

  FuturePtr alltoall(const at::Tensor& output, const at::Tensor& input) override {
    if (!takes(input)) return inner_->alltoall(output, input);
    const int64_t n = core_.size();
    return engine_->issue("alltoall (" + describe_tensor(input) + ")", (n - 1) * bytes_of(input) / n, output,
                          [engine = engine_.get(), output, input, n] {
                            const at::Tensor in = input.contiguous();
                            on_contiguous(output, [&](const at::Tensor& out) {
                              engine->domain().alltoall(in.data_ptr(), out.data_ptr(), bytes_of(in) / n);
                            });
                          });
  }

  FuturePtr reduce_scatter(const at::Tensor& output, const at::Tensor& input) override {
    if (!takes(input)) return inner_->reduce_scatter(output, input);
    // Types the segment cannot sum: its alltoall and a local sum.
    if (!codecs::sums_raw(input.scalar_type())) return Transport::reduce_scatter(output, input);
    const uint64_t n = static_cast<uint64_t>(core_.size());
    return engine_->issue("reduce_scatter (" + describe_tensor(input) + ")", (n - 1) * bytes_of(input) / n, output,
                          [engine = engine_.get(), output, input] {
                            engine->domain().reduce_scatter(input.data_ptr(), output.data_ptr(), output.numel(),
                                                            input.scalar_type());
                          });
  }

  FuturePtr barrier() override {
    return engine_->issue("barrier", 0, at::zeros({1}, at::kFloat), [engine = engine_.get()] { engine->domain().barrier(); });
  }

  // In shared memory, piece by piece: each exchange runs at memory speed, nothing to overlap.
  FuturePtr two_phase(const std::shared_ptr<TwoPhaseJob>& job, const at::Tensor& value,
                      const std::string& what) override {
    if (!takes(job->send1)) return inner_->two_phase(job, value, what);
    GroupCore* core = &core_;
    const int64_t n = core_.size();
    return engine_->issue(
        what, value,
        [core, job, what, n] {
          check_two_phase(*core, *job, what);
          for (int64_t p = 0; p < job->pieces; ++p)
            for (const at::Tensor* t : {&job->send1, &job->send2}) {
              const uint64_t bytes = bytes_of(*t) / job->pieces * (n - 1) / n;
              core->count(bytes, bytes, /*shared_memory=*/true);
            }
        },
        [engine = engine_.get(), job, n] {
          auto block = [&](const at::Tensor& t, int64_t p) {
            const int64_t len = t.numel() / job->pieces;
            return t.view({-1}).narrow(0, p * len, len);
          };
          auto exchange = [&](const at::Tensor& send, const at::Tensor& recv, int64_t p) {
            const at::Tensor s = block(send, p);
            engine->domain().alltoall(s.data_ptr(), block(recv, p).data_ptr(), bytes_of(s) / n);
          };
          for (int64_t p = 0; p < job->pieces; ++p) {
            if (job->encode) job->encode(p);
            exchange(job->send1, job->recv1, p);
            job->reduce(p);
            exchange(job->send2, job->recv2, p);
            if (job->decode) job->decode(p);
          }
        });
  }

  at::Tensor allreduce_buffer(int64_t numel, at::ScalarType dtype) override {
    if (numel == 0) return Transport::allreduce_buffer(numel, dtype);
    std::shared_ptr<shm::SharedBuffer> buffer = engine_->allocate(
        static_cast<size_t>(numel) * c10::elementSize(dtype),
        "allreduce_buffer of " + std::to_string(numel) + " " + c10::toString(dtype) + " elements",
        "allreduce buffers stay in private memory; allreduce still goes through shared memory, with one more copy "
        "each way",
        /*one_region=*/false,
        // Unreserved: where DDP's gradients sum in a GradientArena, their parts of a bucket are
        // never touched and cost nothing.
        /*reserve=*/false);
    if (!buffer) return Transport::allreduce_buffer(numel, dtype);
    // The tensor owns the mappings: they outlive the group if the tensor does.
    return at::from_blob(buffer->base[engine_->domain().local_rank()], {numel}, [buffer](void*) {},
                         at::TensorOptions().dtype(dtype).device(at::kCPU));
  }

  at::Tensor host_shared_tensor(int64_t numel, at::ScalarType dtype) override {
    if (numel == 0) return at::Tensor();
    std::shared_ptr<shm::SharedBuffer> region = engine_->allocate(
        static_cast<size_t>(numel) * c10::elementSize(dtype),
        "host_shared_tensor of " + std::to_string(numel) + " " + c10::toString(dtype) + " elements",
        "no memory is shared between this host's ranks for their tensors; each keeps its own", /*one_region=*/true);
    if (!region) return at::Tensor();
    return at::from_blob(region->base[0], {numel}, [region](void*) {}, at::TensorOptions().dtype(dtype).device(at::kCPU));
  }

  std::shared_ptr<GradientArena> gradient_arena(const std::vector<int64_t>& block_bytes) override {
    if (block_bytes.empty()) return nullptr;
    size_t capacity = 0, largest = 0;
    std::vector<size_t> sizes;
    for (int64_t b : block_bytes) {
      DDPKIT_CHECK(b > 0, "gradient_arena: block sizes must be positive, got ", b);
      const size_t rounded = (static_cast<size_t>(b) + 4095) / 4096 * 4096;
      capacity += rounded;
      largest = std::max(largest, rounded);
      sizes.push_back(static_cast<size_t>(b));
    }
    capacity += largest;  // a transient gradient beside the kept ones (gradients accumulated in .grad)
    std::shared_ptr<shm::SharedBuffer> buffer =
        engine_->allocate(capacity, "gradient_arena of " + std::to_string(capacity) + " bytes",
                          "gradients stay in private memory; their allreduce copies them through the buckets");
    if (!buffer) return nullptr;
    return std::make_shared<GradientArena>(buffer, buffer->base[engine_->domain().local_rank()], std::move(sizes));
  }

  bool sums_in_place(const at::Tensor& buffer) const override {
    return buffer.defined() && buffer.device().is_cpu() && !buffer.is_sparse() && buffer.is_contiguous() &&
           codecs::sums_raw(buffer.scalar_type()) &&
           engine_->domain().holds(buffer.data_ptr(), static_cast<int64_t>(bytes_of(buffer)));
  }

  // A rank copies into its buffer only the shares its peers sum, sums its own share straight from
  // its parts into them, and copies the peers' shares back.
  FuturePtr allreduce_parts(const at::Tensor& buffer, const std::vector<at::Tensor>& parts, double scale) override {
    if (!sums_in_place(buffer)) return Transport::allreduce_parts(buffer, parts, scale);
    const std::string what =
        "allreduce (" + describe_tensor(buffer) + " in " + std::to_string(parts.size()) + " parts)";
    return engine_->issue(what, allreduce_bus_bytes(buffer), buffer, [engine = engine_.get(), buffer, parts, scale] {
      std::vector<shm::Part> spans;
      int64_t at = 0;
      for (const at::Tensor& p : parts) {
        spans.push_back({at, p.numel(), p.data_ptr()});
        at += p.numel();
      }
      engine->domain().allreduce_parts(buffer.data_ptr(), buffer.numel(), buffer.scalar_type(), scale, spans);
    });
  }

 private:
  static bool takes(const at::Tensor& t) { return t.device().is_cpu() && !t.is_sparse(); }
  uint64_t allreduce_bus_bytes(const at::Tensor& t) const {
    const uint64_t n = static_cast<uint64_t>(core_.size());
    return 2 * (n - 1) * bytes_of(t) / n;
  }

  std::shared_ptr<ShmEngine> engine_;
};

}  // namespace

std::unique_ptr<Transport> make_shm_transport(GroupCore& core, std::shared_ptr<ShmEngine> engine,
                                              std::unique_ptr<Transport> inner) {
  return std::make_unique<ShmTransport>(core, std::move(engine), std::move(inner));
}

}  // namespace ddpkit
