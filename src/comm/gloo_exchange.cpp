// Allgather and alltoall on Gloo as point-to-point messages: every block a rank sends or receives
// is one message per peer, all posted at once. Gloo's own alltoall goes round by round and
// reached about half a shaped link's rate, where these reach the link's rate
// (bench/exchange_bench.py, bench/results/gloo-exchange-2026-11-26.txt). FSDP's gathers and
// reduce-scatters, ZeRO's, and the torch.distributed backend's all ride on these between hosts.
#include "gloo_transport.h"

#include <algorithm>
#include <chrono>
#include <stdexcept>

namespace ddpkit {

using detail::bytes_of;
using detail::describe_tensor;

namespace {

// Point-to-point tags of the exchanges (exchange_tag).
constexpr uint32_t kExchangeTagBase = static_cast<uint32_t>(ProcessGroup::kFirstInternalTag);
constexpr uint32_t kExchangeTags = 0x00FFFFFFu;
// monitored_barrier's two messages, above the exchanges': a rank that never calls it (the barrier
// is there to catch one) must not shift the exchanges' numbering.
constexpr int kArriveTag = static_cast<int>(kExchangeTagBase + kExchangeTags);
constexpr int kReleaseTag = kArriveTag + 1;

at::Tensor as_bytes(const at::Tensor& t) { return t.reshape({-1}).view(at::kByte); }

using PutBack = std::vector<std::pair<at::Tensor, at::Tensor>>;  // (output, where it was received)

// Where a block for `output` is received: the output itself when contiguous, else a contiguous
// copy, listed in `put_back` to be copied into it once every message has landed.
at::Tensor landing_for(const at::Tensor& output, PutBack& put_back) {
  if (output.is_contiguous()) return output;
  at::Tensor landing = at::empty_like(output, at::MemoryFormat::Contiguous);
  put_back.emplace_back(output, landing);
  return landing;
}

// The exchange's `after`: the copies back into strided outputs, if any.
std::function<void()> putting_back(PutBack put_back) {
  if (put_back.empty()) return nullptr;
  return [put_back = std::move(put_back)] {
    for (const auto& [output, landing] : put_back) output.copy_(landing);
  };
}

}  // namespace

int exchange_tag(uint32_t n) { return static_cast<int>(kExchangeTagBase + n % kExchangeTags); }

void wait_for_messages(const std::vector<PeerMessage>& messages, std::chrono::steady_clock::time_point deadline,
                       std::chrono::milliseconds timeout) {
  for (const auto& m : messages) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    try {
      m.work->wait(std::max(left, std::chrono::milliseconds(1)));  // (a Gloo wait of 0 ms waits for ever)
    } catch (const std::exception& e) {
      throw std::runtime_error("rank " + std::to_string(m.peer) +
                               (m.receive ? " sent nothing" : " took nothing this rank sent") + " within " +
                               std::to_string(timeout.count()) + " ms (gloo: " + e.what() + ")");
    }
  }
}

void GlooTransport::exchange(const std::vector<at::Tensor>& sends, const std::vector<at::Tensor>& recvs,
                                 const std::string& what, const at::Tensor& value, const FuturePtr& result,
                                 std::function<void()> during, std::function<void()> after) {
  std::vector<PeerMessage> messages;
  try {
    const int tag = exchange_tag(exchange_count_++);
    for (int peer = 0; peer < core_.size(); ++peer) {
      if (peer == core_.rank()) continue;
      std::vector<at::Tensor> out{sends[peer]}, in{recvs[peer]};
      messages.push_back({with_backend([&](compat::Backend& b) { return b.recv(in, peer, tag); }), peer, true});
      messages.push_back({with_backend([&](compat::Backend& b) { return b.send(out, peer, tag); }), peer, false});
    }
  } catch (...) {
    return core_.fail(result, what, std::current_exception());
  }
  // Gloo's send and receive works have no future in libtorch 1.13: they are waited for here, off
  // the sequencer, which goes on issuing the collectives that follow.
  const auto timeout = core_.timeout();
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  GroupCore* core = &core_;
  exchange_waiter_->post([messages = std::move(messages), deadline, timeout, what, value, result, core,
                          during = std::move(during), after = std::move(after)] {
    try {
      if (during) during();
      wait_for_messages(messages, deadline, timeout);
      if (after) after();
      result->markCompleted(c10::IValue(value));
    } catch (...) {
      core->fail(result, what, std::current_exception());
    }
  });
}

void GlooTransport::exchange_allgather(const std::vector<at::Tensor>& outputs, const at::Tensor& input,
                                  const at::Tensor& value, const FuturePtr& result) {
  const std::string what = "allgather (" + describe_tensor(input) + " per rank)";
  const int64_t n = core_.size();
  const int64_t bytes = static_cast<int64_t>(bytes_of(input));
  const at::Tensor in = as_bytes(input.contiguous());
  PutBack put_back;
  std::vector<at::Tensor> landings(n);
  for (int64_t r = 0; r < n; ++r) landings[r] = landing_for(outputs[r], put_back);
  std::vector<at::Tensor> sends(n), recvs(n);
  for (int64_t r = 0; r < n; ++r) {
    if (r == core_.rank()) continue;
    sends[r] = in;
    recvs[r] = as_bytes(landings[r]);
  }
  core_.count((n - 1) * bytes, (n - 1) * bytes);
  const at::Tensor mine = as_bytes(landings[core_.rank()]);
  exchange(sends, recvs, what, value, result, [mine, in] { mine.copy_(in); }, putting_back(std::move(put_back)));
}

void GlooTransport::exchange_alltoall(const at::Tensor& output, const at::Tensor& input, const FuturePtr& result) {
  const std::string what = "alltoall (" + describe_tensor(input) + ")";
  const int64_t n = core_.size();
  const int64_t block = static_cast<int64_t>(bytes_of(input)) / n;
  const at::Tensor in = as_bytes(input.contiguous());
  PutBack put_back;
  const at::Tensor out = as_bytes(landing_for(output, put_back));
  std::vector<at::Tensor> sends(n), recvs(n);
  for (int64_t r = 0; r < n; ++r) {
    if (r == core_.rank()) continue;
    sends[r] = in.narrow(0, r * block, block);
    recvs[r] = out.narrow(0, r * block, block);
  }
  core_.count((n - 1) * block, (n - 1) * block);
  const int64_t me = core_.rank();
  const at::Tensor mine_in = in.narrow(0, me * block, block), mine_out = out.narrow(0, me * block, block);
  exchange(sends, recvs, what, output, result, [mine_out, mine_in] { mine_out.copy_(mine_in); },
                putting_back(std::move(put_back)));
}

FuturePtr GlooTransport::monitored_barrier(std::chrono::milliseconds timeout, bool wait_all_ranks) {
  auto result = make_tensor_future();
  core_.post([this, timeout, wait_all_ranks, result] {
    try {
      run_monitored_barrier(timeout, wait_all_ranks);
    } catch (...) {
      return core_.fail(result, "monitored_barrier", std::current_exception());
    }
    result->markCompleted(c10::IValue(at::Tensor()));
  });
  return result;
}

void GlooTransport::run_monitored_barrier(std::chrono::milliseconds timeout, bool wait_all_ranks) {
  using clock = std::chrono::steady_clock;
  at::Tensor token = at::zeros({1}, at::kByte);
  auto message = [&](bool send, int peer, int tag) {
    std::vector<at::Tensor> t{token};
    return with_backend([&](compat::Backend& b) { return send ? b.send(t, peer, tag) : b.recv(t, peer, tag); });
  };
  if (core_.rank() != 0) {
    auto arrive = message(true, 0, kArriveTag);
    auto release = message(false, 0, kReleaseTag);
    try {
      arrive->wait(core_.timeout());
      release->wait(core_.timeout());
    } catch (const std::exception& e) {
      throw std::runtime_error("Rank " + std::to_string(core_.rank()) +
                               " successfully reached monitoredBarrier, but received errors while waiting for "
                               "send/recv from rank 0. Please check rank 0 logs for faulty rank. (" + e.what() + ")");
    }
    return;
  }
  const auto start = clock::now();
  const std::string in = " failed to pass monitoredBarrier in " + std::to_string(timeout.count()) + " ms";
  // Waits for each rank's message in rank order: within what is left of `timeout`, or (all
  // ranks) within the whole of it each, so that every late rank is found.
  auto wait_each = [&](std::vector<c10::intrusive_ptr<c10d::Work>>& works) {
    std::vector<int> failed;
    std::string passed;
    for (int peer = 1; peer < core_.size(); ++peer) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(timeout - (clock::now() - start));
      if (!wait_all_ranks && left.count() <= 0)
        throw std::runtime_error("Rank 0 timed out in monitoredBarrier after " + std::to_string(timeout.count()) +
                                 " ms. Ranks that passed: " + (passed.empty() ? "none" : passed));
      try {
        // (A Gloo wait of 0 ms waits for ever.)
        works[peer]->wait(std::max(wait_all_ranks ? timeout : left, std::chrono::milliseconds(1)));
        passed += (passed.empty() ? "" : ", ") + std::to_string(peer);
      } catch (const std::exception& e) {
        if (!wait_all_ranks) throw std::runtime_error("[Rank 0]: Rank " + std::to_string(peer) + in + " (" + e.what() + ")");
        failed.push_back(peer);
      }
    }
    if (failed.empty()) return;
    std::string ranks;
    for (int r : failed) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
    throw std::runtime_error("[Rank 0]: Rank" + std::string(failed.size() > 1 ? "s " : " ") + ranks + in);
  };
  std::vector<c10::intrusive_ptr<c10d::Work>> works(core_.size());
  for (int peer = 1; peer < core_.size(); ++peer) works[peer] = message(false, peer, kArriveTag);
  wait_each(works);
  // Every rank came: let them all go (all leave the barrier or none does).
  for (int peer = 1; peer < core_.size(); ++peer) works[peer] = message(true, peer, kReleaseTag);
  wait_each(works);
}

}  // namespace ddpkit
