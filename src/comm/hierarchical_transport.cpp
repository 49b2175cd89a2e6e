// The hierarchical transport: ranks on several hosts, the same number on each. Allreduce (SUM or
// AVG of a type shared memory sums) goes through shared memory within each host and a group of
// one rank per host across them, so the network carries each host's sum once, split over its
// ranks. Every other collective goes to the network transport it wraps, over the whole group.
#include <ddpkit/codecs/cast.h>

#include "shm_engine.h"
#include "transport.h"

#include <algorithm>

namespace ddpkit {

using detail::bytes_of;
using detail::describe_tensor;
using detail::on_contiguous;

namespace {

class HierarchicalTransport final : public ForwardingTransport {
 public:
  HierarchicalTransport(GroupCore& core, std::shared_ptr<ShmEngine> engine, std::shared_ptr<ProcessGroup> across,
                        std::unique_ptr<Transport> inner)
      : ForwardingTransport(core, std::move(inner)), across_(std::move(across)), engine_(std::move(engine)) {}

  std::string name() const override { return "hierarchical (shared memory within hosts, " + across_->transport_name() + " across)"; }
  bool uses_shared_memory() const override { return true; }
  bool hierarchical() const override { return true; }
  void piece_bytes_changed(int64_t bytes) override {
    ForwardingTransport::piece_bytes_changed(bytes);
    across_->set_piece_bytes(bytes);
  }

  FuturePtr allreduce(const at::Tensor& tensor, c10d::ReduceOp op) override {
    const bool avg = op == c10d::ReduceOp::AVG;
    if (!tensor.device().is_cpu() || tensor.is_sparse() || !(op == c10d::ReduceOp::SUM || avg) ||
        !codecs::sums_raw(tensor.scalar_type()))
      return inner_->allreduce(tensor, op);
    const double scale = avg ? 1.0 / core_.size() : 1.0;
    const uint64_t hosts = static_cast<uint64_t>(across_->size());
    const uint64_t local = static_cast<uint64_t>(engine_->domain().local_size());
    const uint64_t net = 2 * (hosts - 1) * bytes_of(tensor) / hosts / local;
    const uint64_t within = 2 * (local - 1) * bytes_of(tensor) / local;
    GroupCore* core = &core_;
    return engine_->issue(
        "allreduce (" + describe_tensor(tensor) + ") (hierarchical: shared memory within hosts, gloo across)",
        tensor,
        [core, net, within] {
          core->count(net, net);
          core->count(within, within, /*shared_memory=*/true);
        },
        [core, engine = engine_.get(), across = across_.get(), tensor, scale] {
          on_contiguous(tensor, [&](const at::Tensor& c) { run(*core, *engine, *across, c, scale); });
        });
  }

 private:
  // On the engine's thread, `data` contiguous. Local rank l owns row l of the tensor viewed as
  // [local_size, m]: shared-memory reduce-scatter gives it its host's sum of row l, the group of
  // the ranks with local rank l on every host allreduces that shard, and a shared-memory allgather
  // hands every shard to every local rank. In pieces, so piece k crosses the network while piece
  // k + 1 is reduced here.
  static void run(GroupCore& core, ShmEngine& engine, ProcessGroup& across_hosts, const at::Tensor& data,
                  double scale) {
    shm::Domain& d = engine.domain();
    const int64_t L = d.local_size(), numel = data.numel(), m = (numel + L - 1) / L;
    const auto dtype = data.scalar_type();
    const int64_t elt = static_cast<int64_t>(data.element_size());
    at::Tensor rows = data.view({-1});
    const bool padded = m * L != numel;
    if (padded) {
      rows = core.take_workspace(dtype, m * L);
      rows.narrow(0, 0, numel).copy_(data.view({-1}));
      rows.narrow(0, numel, m * L - numel).zero_();
    }
    at::Tensor shard = core.take_workspace(dtype, std::max<int64_t>(m, 1));
    const int64_t piece = std::max<int64_t>(1, std::max<int64_t>(core.piece_bytes(), 1 << 20) / elt);
    auto* rows_ptr = static_cast<uint8_t*>(rows.data_ptr());
    std::vector<std::pair<int64_t, FuturePtr>> across;
    for (int64_t off = 0; off < m; off += piece) {
      const int64_t c = std::min(piece, m - off);
      d.reduce_scatter(rows_ptr + off * elt, static_cast<uint8_t*>(shard.data_ptr()) + off * elt, c, dtype, m);
      across.emplace_back(off, across_hosts.allreduce(shard.narrow(0, off, c)));
    }
    for (auto& [off, future] : across) {
      at::Tensor part = ProcessGroup::wait(future);
      if (scale != 1.0) part.mul_(scale);
      d.allgather(part.data_ptr(), rows_ptr + off * elt, part.numel() * elt, m * elt);
    }
    core.give_workspace(shard);
    if (padded) {
      data.view({-1}).copy_(rows.narrow(0, 0, numel));
      core.give_workspace(rows);
    }
  }

  // The engine is destroyed first (declared last): its thread drains, running jobs that use the
  // across group, while that group lives.
  std::shared_ptr<ProcessGroup> across_;
  std::shared_ptr<ShmEngine> engine_;
};

}  // namespace

std::unique_ptr<Transport> make_hierarchical_transport(GroupCore& core, std::shared_ptr<ShmEngine> engine,
                                                       std::shared_ptr<ProcessGroup> across,
                                                       std::unique_ptr<Transport> inner) {
  return std::make_unique<HierarchicalTransport>(core, std::move(engine), std::move(across), std::move(inner));
}

}  // namespace ddpkit
