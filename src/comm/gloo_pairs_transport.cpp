// Gloo over lazily connected pairs (ProcessGroupOptions::lazy_connections): a rank connects to a
// peer the first time a collective needs it, as a two-rank c10d Gloo group of its own (all of them
// on one Gloo device: one listener and one I/O thread per rank). Gloo's own groups connect every
// pair when made: N-1 connections and N-1 store reads per rank, every time a quorum of N sites
// changes. Here making the group connects nothing, and the collectives are chosen to need few
// peers:
//
//   allreduce      below kRingMinBytes, recursive doubling (log2 N peers, log2 N rounds; ranks
//                  beyond a power of two fold into a partner first); above, a ring (2 peers,
//                  2(N-1) rounds, 2(N-1)/N of the bytes sent per rank). Every rank ends with
//                  the same bits: each sum is formed in one order (or commutes).
//   broadcast      binomial tree from the root (log2 N peers)
//   allgather      ring (2 peers)
//   barrier        recursive doubling of one element
//   alltoall, two_phase (fp16/bf16 allreduce, DiLoCo's outer mean), reduce_scatter
//                  point to point with every peer: they need every pair, which they connect
//                  (once) at their first call
//
// Collectives run one at a time, in issue order, on this transport's own thread; each is bounded
// by the group's timeout (connecting included). A pair's rendezvous keys stay in the group's store
// for as long as the store lives (the peer may read them late). monitored_barrier and the raw
// c10d backend (ProcessGroup::with_backend) are refused by name: there is no one backend.
#include "gloo_transport.h"
#include "polling_store.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <algorithm>
#include <chrono>
#include <deque>
#include <map>
#include <mutex>
#include <stdexcept>
#include <thread>

namespace ddpkit {

namespace gloo_pairs {  // named: the sources of src/comm compile as one unit

using detail::bytes_of;
using detail::describe_tensor;

using Clock = std::chrono::steady_clock;

// Below this, allreduce is recursive doubling (latency: log2 N rounds); from it, a ring
// (bandwidth: each rank sends 2(N-1)/N of the tensor).
constexpr uint64_t kRingMinBytes = 256 << 10;

at::Tensor as_bytes(const at::Tensor& t) { return t.reshape({-1}).view(at::kByte); }

// dst = dst (op) src, elementwise; commutative, so both ends of an exchange get the same bits.
void combine(const at::Tensor& dst, const at::Tensor& src, c10d::ReduceOp op) {
  switch (op) {
    case c10d::ReduceOp::SUM: dst.add_(src); return;
    case c10d::ReduceOp::PRODUCT: dst.mul_(src); return;
    case c10d::ReduceOp::MIN: dst.copy_(at::minimum(dst, src)); return;
    case c10d::ReduceOp::MAX: dst.copy_(at::maximum(dst, src)); return;
    default: break;
  }
  throw std::invalid_argument("reduce op " + std::to_string(static_cast<int>(op)) +
                              " is not supported over lazily connected pairs (SUM, AVG, PRODUCT, MIN, MAX are)");
}

class GlooPairsTransport final : public Transport {
 public:
  GlooPairsTransport(GroupCore& core, c10::intrusive_ptr<c10d::Store> store)
      : Transport(core), store_(c10::make_intrusive<PollingStore>(std::move(store))) {
    const ProcessGroupOptions& o = core.options();
    DDPKIT_CHECK(o.backend() == "gloo", "lazy_connections needs the gloo backend, got ", o.backend());
    survive_writes_to_dead_peers();
    device_ = make_gloo_device(o);
    runner_ = std::make_unique<JobThread>();
  }

  std::string name() const override { return "gloo (pairs connected on demand)"; }

  FuturePtr allreduce(const at::Tensor& tensor, c10d::ReduceOp op) override {
    if (core_.size() == 1) return completed_future(tensor);
    if (op == c10d::ReduceOp::AVG) return core_.divided_by_size(allreduce(tensor, c10d::ReduceOp::SUM), tensor);
    DDPKIT_CHECK(tensor.device().is_cpu() && !tensor.is_sparse(),
                 "lazy_connections: allreduce takes dense CPU tensors, got ", describe_tensor(tensor), " on ",
                 tensor.device(), tensor.is_sparse() ? " (sparse)" : "");
    const std::string what = "allreduce (" + describe_tensor(tensor) + ")";
    return run(what, tensor, [this, tensor, op](const std::string& w, Clock::time_point deadline) {
      detail::on_contiguous(tensor, [&](const at::Tensor& t) {
        const at::Tensor flat = t.view({-1});
        if (bytes_of(flat) >= kRingMinBytes && flat.numel() >= core_.size())
          ring_allreduce(flat, op, w, deadline);
        else
          doubling_allreduce(flat, op, w, deadline);
      });
    });
  }

  FuturePtr broadcast(const at::Tensor& tensor, int root) override {
    if (core_.size() == 1) return completed_future(tensor);
    const std::string what = "broadcast from rank " + std::to_string(root) + " (" + describe_tensor(tensor) + ")";
    return run(what, tensor, [this, tensor, root](const std::string& w, Clock::time_point deadline) {
      detail::on_contiguous(tensor, [&](const at::Tensor& t) { tree_broadcast(as_bytes(t), root, w, deadline); });
    });
  }

  FuturePtr allgather_into_tensor(const at::Tensor& output, const at::Tensor& input) override {
    if (core_.size() == 1) {
      output.view({-1}).copy_(input.reshape({-1}));
      return completed_future(output);
    }
    const std::string what = "allgather (" + describe_tensor(input) + " per rank)";
    return run(what, output, [this, output, input](const std::string& w, Clock::time_point deadline) {
      detail::on_contiguous(output, [&](const at::Tensor& out) {
        ring_allgather(as_bytes(out), as_bytes(input.contiguous()), w, deadline);
      });
    });
  }

  FuturePtr alltoall(const at::Tensor& output, const at::Tensor& input) override {
    const std::string what = "alltoall (" + describe_tensor(input) + ")";
    return run(what, output, [this, output, input](const std::string& w, Clock::time_point deadline) {
      detail::on_contiguous(output, [&](const at::Tensor& out) {
        direct_alltoall(as_bytes(out), as_bytes(input.contiguous()), w, deadline);
      });
    });
  }

  FuturePtr barrier() override {
    auto token = at::zeros({1}, at::kFloat);
    if (core_.size() == 1) return completed_future(token);
    return run("barrier", token, [this, token](const std::string& w, Clock::time_point deadline) {
      doubling_allreduce(token, c10d::ReduceOp::SUM, w, deadline);
    });
  }

  FuturePtr two_phase(const std::shared_ptr<TwoPhaseJob>& job, const at::Tensor& value,
                      const std::string& what) override {
    return run(what, value, [this, job](const std::string& w, Clock::time_point deadline) {
      check_two_phase(core_, *job, w);
      connect(every_peer(), w);
      const int tag = next_tag();
      auto block = [&](const at::Tensor& t, int64_t p) { return as_bytes(two_phase_block(t, job->pieces, p)); };
      auto first = [&](int64_t p) {
        if (job->encode) job->encode(p);
        return post_alltoall(block(job->recv1, p), block(job->send1, p), tag);
      };
      // Phase 1 of `window` pieces in flight, and as many phase 2s: over a long round trip a
      // piece's wait overlaps the others' transfers (as Gloo's workers do for two_phase there).
      const int64_t window = std::max(2, core_.options().gloo_threads());
      std::deque<std::vector<PeerMessage>> firsts, seconds;
      for (int64_t p = 0; p < std::min(window, job->pieces); ++p) firsts.push_back(first(p));
      int64_t decoded = 0;
      auto decode_oldest = [&] {
        wait(seconds.front(), deadline);
        seconds.pop_front();
        if (job->decode) job->decode(decoded);
        ++decoded;
      };
      for (int64_t p = 0; p < job->pieces; ++p) {
        wait(firsts.front(), deadline);
        firsts.pop_front();
        job->reduce(p);
        seconds.push_back(post_alltoall(block(job->recv2, p), block(job->send2, p), tag));
        if (p + window < job->pieces) firsts.push_back(first(p + window));
        if (static_cast<int64_t>(seconds.size()) >= window) decode_oldest();
      }
      while (!seconds.empty()) decode_oldest();
    });
  }

  FuturePtr monitored_barrier(std::chrono::milliseconds, bool) override {
    throw std::invalid_argument("monitored_barrier: process group '" + core_.options().group_name() +
                                "' connects its peers lazily (ProcessGroupOptions::lazy_connections); use barrier()");
  }

  detail::BackendCall backend_call() override {
    throw std::invalid_argument("process group '" + core_.options().group_name() +
                                "' connects its peers lazily (ProcessGroupOptions::lazy_connections): it has no "
                                "single c10d backend to call");
  }

 private:
  using Body = std::function<void(const std::string& what, Clock::time_point deadline)>;

  // Orders the collective on the sequencer, runs it on this transport's thread within the timeout.
  FuturePtr run(const std::string& what, const at::Tensor& value, Body body) {
    auto result = make_tensor_future(value.device());
    core_.post([this, what, value, result, body = std::move(body)] {
      runner_->post([this, what, value, result, body, key = TrafficScope::current()] {
        TrafficScope scope(key);  // the poster's, which the sequencer carried
        try {
          body(what, Clock::now() + core_.timeout());
          result->markCompleted(c10::IValue(value));
        } catch (...) {
          core_.fail(result, what, std::current_exception());
        }
      });
    });
    return result;
  }

  // Makes the pairs to `peers` that are not there yet, all at once: each peer makes its end in
  // the same collective (every collective's peers are symmetric), so none waits on another.
  void connect(std::vector<int> peers, const std::string& what) {
    peers.erase(std::remove_if(peers.begin(), peers.end(), [&](int p) { return pairs_.count(p) > 0; }), peers.end());
    std::sort(peers.begin(), peers.end());
    peers.erase(std::unique(peers.begin(), peers.end()), peers.end());
    if (peers.empty()) return;
    std::vector<c10::intrusive_ptr<c10d::ProcessGroupGloo>> made(peers.size());
    std::vector<std::string> errors(peers.size());
    auto make = [&](size_t i) {
      const int me = core_.rank(), peer = peers[i];
      try {
        auto store = c10::make_intrusive<c10d::PrefixStore>(
            "ddpkit/pair/" + std::to_string(std::min(me, peer)) + "-" + std::to_string(std::max(me, peer)), store_);
        auto opts = c10d::ProcessGroupGloo::Options::create(core_.timeout());
        opts->devices.push_back(device_);
        opts->threads = 1;  // send/recv do not use Gloo's workers: one idle thread per pair
        made[i] = c10::make_intrusive<c10d::ProcessGroupGloo>(store, me < peer ? 0 : 1, 2, opts);
      } catch (const std::exception& e) {
        errors[i] = "connecting to rank " + std::to_string(peer) + " failed: " + e.what();
      }
    };
    std::vector<std::thread> threads;
    for (size_t i = 1; i < peers.size(); ++i) threads.emplace_back(make, i);
    make(0);
    for (auto& t : threads) t.join();
    for (size_t i = 0; i < peers.size(); ++i) {
      if (made[i]) pairs_[peers[i]] = made[i];
    }
    for (const auto& e : errors)
      if (!e.empty()) throw std::runtime_error(e + " (first needed by " + what + ")");
  }

  // Posts one message, one call into Gloo at a time across the process (lock_gloo_calls).
  PeerMessage post(bool send, int peer, const at::Tensor& bytes, int tag) {
    std::vector<at::Tensor> t{bytes};
    auto lock = lock_gloo_calls();
    auto& pair = *pairs_.at(peer);
    const int other = core_.rank() < peer ? 1 : 0;
    return {send ? pair.send(t, other, tag) : pair.recv(t, other, tag), peer, !send};
  }

  void wait(const std::vector<PeerMessage>& messages, Clock::time_point deadline) const {
    wait_for_messages(messages, deadline, core_.timeout());
  }

  // One tag per collective: messages of one collective between two ranks match in order.
  int next_tag() { return exchange_tag(collectives_++); }

  // Sends `send` to `to` and receives `recv` from `from` at once (either may be -1: none).
  void send_recv(int to, const at::Tensor& send, int from, const at::Tensor& recv, int tag, Clock::time_point deadline) {
    std::vector<PeerMessage> m;
    if (from >= 0) m.push_back(post(false, from, recv, tag));
    if (to >= 0) m.push_back(post(true, to, send, tag));
    wait(m, deadline);
  }

  void doubling_allreduce(const at::Tensor& flat, c10d::ReduceOp op, const std::string& what,
                          Clock::time_point deadline) {
    const int n = core_.size(), r = core_.rank();
    int p = 1;
    while (p * 2 <= n) p *= 2;
    const int rem = n - p;  // ranks 0 .. 2*rem-1 pair up: the even one folds into the odd one
    const int folded = r < 2 * rem ? (r % 2 == 0 ? -1 : r / 2) : r - rem;
    auto actual = [rem](int v) { return v < rem ? 2 * v + 1 : v + rem; };
    std::vector<int> peers;
    if (r < 2 * rem) peers.push_back(r % 2 == 0 ? r + 1 : r - 1);
    if (folded >= 0)
      for (int mask = 1; mask < p; mask <<= 1) peers.push_back(actual(folded ^ mask));
    connect(peers, what);
    const int tag = next_tag();
    const at::Tensor bytes = as_bytes(flat);
    at::Tensor other = core_.take_workspace(flat.scalar_type(), flat.numel());
    uint64_t sent = 0;
    if (r < 2 * rem && r % 2 == 0) {
      send_recv(r + 1, bytes, -1, {}, tag, deadline);
      sent += bytes_of(flat);
    } else if (r < 2 * rem) {
      send_recv(-1, {}, r - 1, as_bytes(other), tag, deadline);
      combine(flat, other, op);
    }
    if (folded >= 0) {
      for (int mask = 1; mask < p; mask <<= 1) {
        const int peer = actual(folded ^ mask);
        send_recv(peer, bytes, peer, as_bytes(other), tag, deadline);
        combine(flat, other, op);
        sent += bytes_of(flat);
      }
    }
    if (r < 2 * rem && r % 2 == 0) {
      send_recv(-1, {}, r + 1, bytes, tag, deadline);
    } else if (r < 2 * rem) {
      send_recv(r - 1, bytes, -1, {}, tag, deadline);
      sent += bytes_of(flat);
    }
    core_.give_workspace(other);
    core_.count(sent, sent);
  }

  // Chunk i of n near-equal chunks of `flat`.
  static at::Tensor chunk(const at::Tensor& flat, int n, int i) {
    const int64_t begin = flat.numel() * i / n, end = flat.numel() * (i + 1) / n;
    return flat.narrow(0, begin, end - begin);
  }

  void ring_allreduce(const at::Tensor& flat, c10d::ReduceOp op, const std::string& what, Clock::time_point deadline) {
    const int n = core_.size(), r = core_.rank(), right = (r + 1) % n, left = (r + n - 1) % n;
    connect({left, right}, what);
    const int tag = next_tag();
    at::Tensor scratch = core_.take_workspace(flat.scalar_type(), flat.numel() / n + 1);
    auto at = [n](int i) { return ((i % n) + n) % n; };
    // Reduce-scatter: after step s, chunk r-s-1 holds s+2 ranks' values; at the end rank r
    // holds chunk r+1 complete.
    for (int s = 0; s < n - 1; ++s) {
      const at::Tensor in = chunk(flat, n, at(r - s - 1));
      const at::Tensor landing = scratch.narrow(0, 0, in.numel());
      send_recv(right, as_bytes(chunk(flat, n, at(r - s))), left, as_bytes(landing), tag, deadline);
      combine(in, landing, op);
    }
    // Allgather: the complete chunks go round.
    for (int s = 0; s < n - 1; ++s)
      send_recv(right, as_bytes(chunk(flat, n, at(r + 1 - s))), left, as_bytes(chunk(flat, n, at(r - s))), tag,
                deadline);
    core_.give_workspace(scratch);
    const uint64_t bus = 2 * static_cast<uint64_t>(n - 1) * bytes_of(flat) / static_cast<uint64_t>(n);
    core_.count(bus, bus);
  }

  void ring_allgather(const at::Tensor& out, const at::Tensor& in, const std::string& what, Clock::time_point deadline) {
    const int n = core_.size(), r = core_.rank(), right = (r + 1) % n, left = (r + n - 1) % n;
    connect({left, right}, what);
    const int tag = next_tag();
    const int64_t block = in.numel();
    auto at = [&](int i) { return out.narrow(0, static_cast<int64_t>(((i % n) + n) % n) * block, block); };
    at(r).copy_(in);
    for (int s = 0; s < n - 1; ++s) send_recv(right, at(r - s), left, at(r - s - 1), tag, deadline);
    const uint64_t bytes = static_cast<uint64_t>(n - 1) * static_cast<uint64_t>(block);
    core_.count(bytes, bytes);
  }

  void tree_broadcast(const at::Tensor& bytes, int root, const std::string& what, Clock::time_point deadline) {
    const int n = core_.size(), v = (core_.rank() - root + n) % n;
    auto actual = [&](int rel) { return (rel + root) % n; };
    std::vector<int> peers;
    for (int mask = 1; mask < n; mask <<= 1) {
      if (v < mask && v + mask < n) peers.push_back(actual(v + mask));
      else if (v >= mask && v < 2 * mask) peers.push_back(actual(v - mask));
    }
    connect(peers, what);
    const int tag = next_tag();
    uint64_t sent = 0;
    for (int mask = 1; mask < n; mask <<= 1) {
      if (v < mask && v + mask < n) {
        send_recv(actual(v + mask), bytes, -1, {}, tag, deadline);
        sent += bytes_of(bytes);
      } else if (v >= mask && v < 2 * mask) {
        send_recv(-1, {}, actual(v - mask), bytes, tag, deadline);
      }
    }
    core_.count(sent, v == 0 ? 0 : bytes_of(bytes));
  }

  std::vector<int> every_peer() const {
    std::vector<int> peers;
    for (int p = 0; p < core_.size(); ++p)
      if (p != core_.rank()) peers.push_back(p);
    return peers;
  }

  // Block r of `in` to rank r, block r of `out` from rank r: one message each way with every
  // (connected) peer, posted; this rank's own block copied.
  std::vector<PeerMessage> post_alltoall(const at::Tensor& out, const at::Tensor& in, int tag) {
    const int n = core_.size(), me = core_.rank();
    const int64_t block = in.numel() / n;
    std::vector<PeerMessage> m;
    // Round i sends to me + i and receives from me - i, as Gloo's alltoall does: every rank starts
    // on a different peer instead of all on rank 0.
    for (int i = 1; i < n; ++i) {
      const int to = (me + i) % n, from = (me - i + n) % n;
      m.push_back(post(false, from, out.narrow(0, from * block, block), tag));
      m.push_back(post(true, to, in.narrow(0, to * block, block), tag));
    }
    out.narrow(0, me * block, block).copy_(in.narrow(0, me * block, block));
    const uint64_t bytes = static_cast<uint64_t>(n - 1) * static_cast<uint64_t>(block);
    core_.count(bytes, bytes);
    return m;
  }

  void direct_alltoall(const at::Tensor& out, const at::Tensor& in, const std::string& what, Clock::time_point deadline) {
    connect(every_peer(), what);
    wait(post_alltoall(out, in, next_tag()), deadline);
  }

  c10::intrusive_ptr<c10d::Store> store_;
  std::shared_ptr<::gloo::transport::Device> device_;
  std::map<int, c10::intrusive_ptr<c10d::ProcessGroupGloo>> pairs_;  // on the runner only
  uint32_t collectives_ = 0;                                         // on the runner only
  // Last, so destroyed first: it finishes what is queued (each bounded by the timeout) while the
  // pairs are still there.
  std::unique_ptr<JobThread> runner_;
};

}  // namespace gloo_pairs

std::unique_ptr<Transport> make_gloo_pairs_transport(GroupCore& core, const c10::intrusive_ptr<c10d::Store>& store) {
  return std::make_unique<gloo_pairs::GlooPairsTransport>(core, store);
}

}  // namespace ddpkit
