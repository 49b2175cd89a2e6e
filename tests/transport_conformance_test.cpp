// The transport conformance suite: every collective, dtype, op and error case, run against every
// transport a process group can choose (src/comm/transport.h). A new transport is one file there
// and one line in kTransports below.
#include "harness.h"

#include "host_key_override.h"

#include <torch/cuda.h>

#include <chrono>
#include <csignal>
#include <array>
#include <optional>
#include <set>

namespace ddpkit {
namespace testing {
namespace {

constexpr int kWorld = 4;

struct TransportCase {
  std::string name;
  std::string transport;  // what ProcessGroup::transport_name() starts with
  ProcessGroupOptions options;
  // The modelled host of each rank ("" is the real one): ranks of one process as several hosts.
  std::function<std::string(int rank)> host = [](int) { return std::string(); };
  bool nccl = false;  // CUDA tensors, one GPU per rank
};

void PrintTo(const TransportCase& c, std::ostream* os) { *os << c.name; }

ProcessGroupOptions base_options() { return ProcessGroupOptions().gloo_hostname("127.0.0.1").timeout(std::chrono::seconds(60)); }

const std::vector<TransportCase>& transports() {
  static const std::vector<TransportCase> cases = {
      {"SharedMemory", "shared memory", base_options()},
      {"Gloo", "gloo + two-phase allreduce", base_options().shared_memory(false)},
      {"TwoPhase", "gloo + two-phase allreduce", base_options().shared_memory(false).two_phase_min_bytes(1)},
      {"Hierarchical", "hierarchical", base_options(), [](int rank) { return "host" + std::to_string(rank / 2); }},
      {"Nccl", "nccl", base_options().backend("nccl").shared_memory(false), [](int) { return std::string(); }, true},
      {"AbortableGloo", "gloo", base_options().shared_memory(false).abortable(true)},
      {"AbortableSharedMemory", "shared memory", base_options().abortable(true)},
      {"LazyPairs", "gloo (pairs connected on demand)", base_options().shared_memory(false).lazy_connections(true)},
  };
  return cases;
}

class Conformance : public ::testing::TestWithParam<TransportCase> {
 protected:
  void SetUp() override {
    if (GetParam().nccl) {
      const auto backends = available_backends();
      if (std::find(backends.begin(), backends.end(), "nccl") == backends.end())
        GTEST_SKIP() << "this libtorch has no NCCL";
      if (!torch::cuda::is_available() || static_cast<int>(torch::cuda::device_count()) < kWorld)
        GTEST_SKIP() << "NCCL needs " << kWorld << " GPUs";
    }
  }

  at::TensorOptions on(int rank, at::ScalarType dtype = at::kFloat) const {
    auto o = at::TensorOptions().dtype(dtype);
    return GetParam().nccl ? o.device(at::Device(at::kCUDA, rank)) : o;
  }

  // Runs fn(rank, group) on kWorld threads, each group made with the case's options (changed by
  // `adjust`) on its modelled host.
  void run(const RankFn& fn, const std::function<void(ProcessGroupOptions&)>& adjust = nullptr) {
    const TransportCase& c = GetParam();
    spawn_groups(
        kWorld,
        [&](const c10::intrusive_ptr<c10d::Store>& store, int rank) {
          set_compute_threads(1);
          ScopedHostKey host(c.host(rank));
          ProcessGroupOptions o = c.options;
          if (adjust) adjust(o);
          return std::make_shared<ProcessGroup>(store, rank, kWorld, o);
        },
        fn);
  }

  // Rank r's data for element i: small integers, so every op's result is exact in every dtype.
  at::Tensor data(int rank, int64_t numel, at::ScalarType dtype) const {
    return (at::arange(numel, at::kLong).remainder(3) + 1).mul(rank + 1).to(on(rank, dtype));
  }
  at::Tensor expected(int64_t numel, at::ScalarType dtype, c10d::ReduceOp::RedOpType op) const {
    at::Tensor all = at::stack({data(0, numel, at::kDouble).cpu(), data(1, numel, at::kDouble).cpu(),
                                data(2, numel, at::kDouble).cpu(), data(3, numel, at::kDouble).cpu()});
    at::Tensor r;
    switch (op) {
      case c10d::ReduceOp::SUM: r = all.sum(0); break;
      case c10d::ReduceOp::AVG: r = all.mean(0); break;
      case c10d::ReduceOp::MAX: r = std::get<0>(all.max(0)); break;
      case c10d::ReduceOp::MIN: r = std::get<0>(all.min(0)); break;
      default: r = all.prod(0); break;
    }
    return r.to(dtype);
  }
};

TEST_P(Conformance, ChoosesItsTransportWhenTheGroupIsMade) {
  run([&](int, std::shared_ptr<ProcessGroup> pg) {
    EXPECT_EQ(pg->transport_name().rfind(GetParam().transport, 0), 0u) << pg->transport_name();
  });
}

TEST_P(Conformance, AllreduceEveryDtypeAndOp) {
  const std::vector<at::ScalarType> dtypes = {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16, at::kInt, at::kLong};
  const std::vector<c10d::ReduceOp::RedOpType> ops = {c10d::ReduceOp::SUM, c10d::ReduceOp::AVG, c10d::ReduceOp::MAX,
                                                      c10d::ReduceOp::MIN, c10d::ReduceOp::PRODUCT};
  run([&](int rank, std::shared_ptr<ProcessGroup> pg) {
    for (auto dtype : dtypes)
      for (auto op : ops) {
        const bool floating = at::isFloatingType(dtype);
        const bool low = dtype == at::kHalf || dtype == at::kBFloat16;
        if (op == c10d::ReduceOp::AVG && !floating) continue;  // no integer AVG, as in PyTorch
        SCOPED_TRACE(std::string(c10::toString(dtype)) + " op " + std::to_string(static_cast<int>(op)));
        at::Tensor t = data(rank, 1001, dtype);
        if (low && op != c10d::ReduceOp::SUM && op != c10d::ReduceOp::AVG && !GetParam().nccl) {
          EXPECT_THAT(error_of([&] { pg->allreduce(t, op); }), ::testing::HasSubstr("supports only SUM and AVG"));
          continue;
        }
        ProcessGroup::wait(pg->allreduce(t, op));
        EXPECT_TRUE(at::equal(t.cpu(), expected(1001, dtype, op)));
      }
  });
}

TEST_P(Conformance, AllreduceOfLargeStridedAndEmptyTensors) {
  run([&](int rank, std::shared_ptr<ProcessGroup> pg) {
    pg->set_piece_bytes(64 << 10);  // several pieces per peer on the paths that cut them
    for (auto dtype : {at::kFloat, at::kBFloat16}) {
      at::Tensor big = data(rank, (5 << 20) / 4 + 3, dtype);
      ProcessGroup::wait(pg->allreduce(big));
      EXPECT_TRUE(at::equal(big.cpu(), expected(big.numel(), dtype, c10d::ReduceOp::SUM)));
    }
    at::Tensor strided = data(rank, 2000, at::kFloat).view({1000, 2}).t();  // not contiguous
    ProcessGroup::wait(pg->allreduce(strided));
    EXPECT_TRUE(at::equal(strided.cpu(), expected(2000, at::kFloat, c10d::ReduceOp::SUM).view({1000, 2}).t()));
    at::Tensor empty = at::empty({0}, on(rank));
    EXPECT_EQ(ProcessGroup::wait(pg->allreduce(empty)).numel(), 0);
  });
}

TEST_P(Conformance, BroadcastFromEveryRoot) {
  run([&](int rank, std::shared_ptr<ProcessGroup> pg) {
    for (auto dtype : {at::kFloat, at::kBFloat16, at::kLong})
      for (int root = 0; root < kWorld; ++root) {
        at::Tensor t = data(rank, 777, dtype);
        ProcessGroup::wait(pg->broadcast(t, root));
        EXPECT_TRUE(at::equal(t.cpu(), data(root, 777, dtype).cpu())) << "root " << root;
      }
  });
}

TEST_P(Conformance, AllgatherIntoListsAndOneTensor) {
  run([&](int rank, std::shared_ptr<ProcessGroup> pg) {
    for (auto dtype : {at::kFloat, at::kBFloat16, at::kLong}) {
      at::Tensor in = data(rank, 301, dtype);
      std::vector<at::Tensor> outs;
      for (int r = 0; r < kWorld; ++r) outs.push_back(at::empty({301}, on(rank, dtype)));
      ProcessGroup::wait(pg->allgather(outs, in));
      at::Tensor one = at::empty({kWorld * 301}, on(rank, dtype));
      ProcessGroup::wait(pg->allgather_into_tensor(one, in));
      for (int r = 0; r < kWorld; ++r) {
        EXPECT_TRUE(at::equal(outs[r].cpu(), data(r, 301, dtype).cpu()));
        EXPECT_TRUE(at::equal(one.narrow(0, r * 301, 301).cpu(), data(r, 301, dtype).cpu()));
      }
    }
  });
}

TEST_P(Conformance, AlltoallAndReduceScatter) {
  run([&](int rank, std::shared_ptr<ProcessGroup> pg) {
    for (auto dtype : {at::kFloat, at::kBFloat16, at::kLong}) {
      // Block r of rank q's input holds q * 100 + r.
      at::Tensor in = (at::arange(kWorld, at::kLong) + rank * 100).repeat_interleave(5).to(on(rank, dtype));
      at::Tensor out = at::empty_like(in);
      ProcessGroup::wait(pg->alltoall(out, in));
      at::Tensor want = (at::arange(kWorld, at::kLong) * 100 + rank).repeat_interleave(5).to(dtype);
      EXPECT_TRUE(at::equal(out.cpu(), want));

      at::Tensor whole = data(rank, kWorld * 64, dtype);
      at::Tensor mine = at::empty({64}, on(rank, dtype));
      ProcessGroup::wait(pg->reduce_scatter(mine, whole));
      EXPECT_TRUE(at::equal(mine.cpu(), expected(kWorld * 64, dtype, c10d::ReduceOp::SUM).narrow(0, rank * 64, 64)));
    }
  });
}

TEST_P(Conformance, BarrierAndOrderedJobs) {
  run([&](int rank, std::shared_ptr<ProcessGroup> pg) {
    ProcessGroup::wait(pg->barrier());
    // A chain issued on the sequencer, in order with the collectives around it.
    at::Tensor a = data(rank, 10, at::kFloat), b = data(rank, 10, at::kFloat);
    auto first = pg->allreduce(a);
    auto chained = pg->run_ordered([&] { return ProcessGroup::wait(pg->allreduce(b)); }, a.device());
    ProcessGroup::wait(first);
    ProcessGroup::wait(chained);
    EXPECT_TRUE(at::equal(b.cpu(), expected(10, at::kFloat, c10d::ReduceOp::SUM)));
  });
}

TEST_P(Conformance, TwoPhaseJobsAndAllreduceParts) {
  if (GetParam().nccl) GTEST_SKIP() << "two-phase jobs and shared buffers are CPU paths";
  run([&](int rank, std::shared_ptr<ProcessGroup> pg) {
    // A sum as a two-phase job: 2 pieces, each 4 chunks of 8.
    const int64_t pieces = 2, chunk = 8, n = kWorld;
    at::Tensor send = data(rank, pieces * n * chunk, at::kFloat), scratch = at::empty_like(send);
    auto job = std::make_shared<TwoPhaseJob>();
    job->pieces = pieces;
    job->send1 = job->recv2 = send;
    job->recv1 = job->send2 = scratch;
    job->reduce = [&, rank](int64_t p) {
      at::Tensor parts = scratch.narrow(0, p * n * chunk, n * chunk).view({n, chunk});
      at::Tensor sum = parts.sum(0);
      for (int64_t k = 0; k < n; ++k) parts[k].copy_(sum);
    };
    ProcessGroup::wait(pg->two_phase(job, send, "sum job"));
    EXPECT_TRUE(at::equal(send, expected(send.numel(), at::kFloat, c10d::ReduceOp::SUM)));

    // Parts reduced through a buffer from allreduce_buffer, scaled.
    at::Tensor buffer = pg->allreduce_buffer(30, at::kFloat);
    at::Tensor p1 = data(rank, 30, at::kFloat).narrow(0, 0, 12).clone(), p2 = data(rank, 30, at::kFloat).narrow(0, 12, 18).clone();
    ProcessGroup::wait(pg->allreduce_parts(buffer, {p1, p2}, 0.5));
    at::Tensor want = expected(30, at::kFloat, c10d::ReduceOp::SUM) * 0.5;
    EXPECT_TRUE(at::equal(at::cat({p1, p2}), want));
  });
}

TEST_P(Conformance, CountsTrafficByTheBusModel) {
  run([&](int rank, std::shared_ptr<ProcessGroup> pg) {
    pg->reset_stats();
    ProcessGroup::wait(pg->allreduce(at::ones({1 << 16}, on(rank))));
    const CommStats s = pg->stats();
    const uint64_t bus = 2 * (kWorld - 1) * (uint64_t{4} << 16) / kWorld;
    EXPECT_EQ(s.bytes_sent + s.shm_bytes_sent, bus) << "sent over the network and through shared memory";
  });
}

TEST_P(Conformance, BadArgumentsAreNamedErrors) {
  run([&](int rank, std::shared_ptr<ProcessGroup> pg) {
    at::Tensor t = at::zeros({10}, on(rank));
    EXPECT_THAT(error_of([&] { pg->broadcast(t, kWorld); }), ::testing::HasSubstr("broadcast root must be in [0, 4)"));
    EXPECT_THAT(error_of([&] { pg->allgather({t, t}, t); }), ::testing::HasSubstr("allgather needs 4 outputs, got 2"));
    EXPECT_THAT(error_of([&] { pg->allgather_into_tensor(at::zeros({30}, on(rank)), t); }),
                ::testing::HasSubstr("allgather_into_tensor: output is"));
    EXPECT_THAT(error_of([&] { pg->alltoall(at::zeros({10}, on(rank)), t); }),
                ::testing::HasSubstr("alltoall: dim 0 (10) must divide evenly among 4 ranks"));
    EXPECT_THAT(error_of([&] { pg->reduce_scatter(at::zeros({3}, on(rank)), t); }),
                ::testing::HasSubstr("reduce_scatter: input has 10 elements, expected 4 x output (3)"));
    EXPECT_THAT(error_of([&] { pg->monitored_barrier(std::chrono::milliseconds(-1)); }),
                ::testing::HasSubstr("must not be negative"));
    ProcessGroup::wait(pg->barrier());  // the group still works: nothing was issued
  });
}

// What a rank sees when a peer breaks a collective: a CommError naming the operation, within the
// group's timeout (plus slack for a loaded machine), never a hang.
void expect_comm_error_within(const std::function<void()>& collective, std::chrono::milliseconds timeout) {
  const auto start = std::chrono::steady_clock::now();
  try {
    collective();
    ADD_FAILURE() << "the collective completed";
  } catch (const CommError& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("allreduce"));
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, timeout + std::chrono::seconds(20));
}

// The group's timeout bounds the rendezvous too: long enough for four groups to meet on a busy
// machine, short enough for a quick test.
constexpr std::chrono::milliseconds kShortTimeout{5000};

TEST_P(Conformance, APeerThatNeverComesIsATimeout) {
  const auto timeout = kShortTimeout;
  std::atomic<int> released{0};
  run(
      [&](int rank, std::shared_ptr<ProcessGroup> pg) {
        if (rank == kWorld - 1) {  // alive, but never issues it
          const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(120);
          while (released < kWorld - 1 && std::chrono::steady_clock::now() < give_up)
            std::this_thread::sleep_for(std::chrono::milliseconds(20));
          return;
        }
        expect_comm_error_within([&] { ProcessGroup::wait(pg->allreduce(data(rank, 1000, at::kFloat))); }, timeout);
        ++released;
      },
      [&](ProcessGroupOptions& o) { o.timeout(timeout); });
}

TEST_P(Conformance, APeerWhoseGroupIsGoneIsAnError) {
  const auto timeout = kShortTimeout;
  run(
      [&](int rank, std::shared_ptr<ProcessGroup> pg) {
        if (rank == kWorld - 1) {
          pg.reset();  // closes its connections and leaves the shared segment
          return;
        }
        expect_comm_error_within([&] { ProcessGroup::wait(pg->allreduce(data(rank, 1000, at::kFloat))); }, timeout);
      },
      [&](ProcessGroupOptions& o) { o.timeout(timeout); });
}

// Checked groups compare every call first: each rank fails naming every rank's call, and the
// group goes on working. (Unchecked, Gloo aborts the process on a size mismatch; shared memory
// names the mismatch it meets, SharedMemoryNamesAMismatchUnchecked below.)
TEST_P(Conformance, MismatchedCallsAreNamedWhenChecked) {
  run(
      [&](int rank, std::shared_ptr<ProcessGroup> pg) {
        EXPECT_THAT(pg->transport_name(), ::testing::HasSubstr(", checked"));
        at::Tensor t = data(rank, rank == 0 ? 1200 : 1000, at::kFloat);
        std::string error = error_of([&] { ProcessGroup::wait(pg->allreduce(t)); });
        EXPECT_THAT(error, ::testing::HasSubstr("called different collectives (rank 0: allreduce of 1200 Float"));
        EXPECT_THAT(error, ::testing::HasSubstr("rank 1: allreduce of 1000 Float"));
        error = error_of([&] { ProcessGroup::wait(pg->broadcast(data(rank, 10, at::kFloat), rank == 2 ? 1 : 0)); });
        EXPECT_THAT(error, ::testing::HasSubstr("rank 2: broadcast of 10 Float from rank 1"));
        at::Tensor same = data(rank, 10, at::kFloat);
        ProcessGroup::wait(pg->allreduce(same));
        EXPECT_TRUE(at::equal(same.cpu(), expected(10, at::kFloat, c10d::ReduceOp::SUM)));
      },
      [&](ProcessGroupOptions& o) { o.check_collectives(true); });
}

// abort() releases every rank waiting on a peer that never comes, at once and naming the reason,
// and fails what is issued afterwards without waiting; destroying the group then waits out only
// the group's own timeout (shortened here).
TEST(AbortableTransport, AbortReleasesWaitersAtOnceAndFailsLaterCalls) {
  for (bool shm : {false, true}) {
    std::atomic<int> released{0};
    spawn_groups(
        kWorld,
        [&](const c10::intrusive_ptr<c10d::Store>& store, int rank) {
          return std::make_shared<ProcessGroup>(
              store, rank, kWorld, base_options().shared_memory(shm).abortable(true).timeout(std::chrono::seconds(4)));
        },
        [&](int rank, std::shared_ptr<ProcessGroup> pg) {
          EXPECT_THAT(pg->transport_name(), ::testing::EndsWith(", abortable"));
          if (rank == kWorld - 1) {  // alive, never issues it
            while (released < kWorld - 1) std::this_thread::sleep_for(std::chrono::milliseconds(10));
            return;
          }
          std::thread aborter([&] {
            std::this_thread::sleep_for(std::chrono::milliseconds(300));
            pg->abort("replica group 3 lost (no heartbeat)");
          });
          const auto start = std::chrono::steady_clock::now();
          const std::string error = error_of([&] { ProcessGroup::wait(pg->allreduce(at::ones({1000}))); });
          const auto waited = std::chrono::steady_clock::now() - start;
          aborter.join();
          EXPECT_THAT(error, ::testing::HasSubstr("collective aborted on rank " + std::to_string(rank)));
          EXPECT_THAT(error, ::testing::HasSubstr("replica group 3 lost (no heartbeat)"));
          EXPECT_LT(waited, std::chrono::seconds(3)) << "released by the abort, not the 4 s timeout";
          EXPECT_THAT(error_of([&] { ProcessGroup::wait(pg->broadcast(at::ones({4}), 0)); }),
                      ::testing::HasSubstr("replica group 3 lost"));
          ++released;
        });
  }
}

TEST(AbortableTransport, AbortNeedsTheOption) {
  spawn_ranks(2, [&](int, std::shared_ptr<ProcessGroup> pg) {
    EXPECT_THAT(error_of([&] { pg->abort("why"); }), ::testing::HasSubstr("was made without ProcessGroupOptions::abortable"));
  });
}

TEST(SharedMemoryTransport, NamesAMismatchUnchecked) {
  spawn_ranks(kWorld, [&](int rank, std::shared_ptr<ProcessGroup> pg) {
    ASSERT_EQ(pg->transport_name(), "shared memory");
    at::Tensor t = at::ones({rank == 0 ? 1200 : 1000});
    expect_comm_error_within([&] { ProcessGroup::wait(pg->allreduce(t)); }, std::chrono::seconds(60));
  });
}

// Gloo writes with writev, so a peer that died raises SIGPIPE in the writer: that must fail the
// collective (EPIPE), not end the process as the signal's default would.
TEST(GlooTransport, SigpipeFromADeadPeerDoesNotEndTheProcess) {
  const auto cases = transports();
  const auto gloo = std::find_if(cases.begin(), cases.end(), [](const TransportCase& c) { return c.name == "Gloo"; });
  ASSERT_NE(gloo, cases.end());
  spawn_groups(
      2,
      [&](const c10::intrusive_ptr<c10d::Store>& store, int rank) {
        ScopedHostKey host(gloo->host(rank));
        return std::make_shared<ProcessGroup>(store, rank, 2, gloo->options);
      },
      [&](int rank, std::shared_ptr<ProcessGroup> pg) {
        ASSERT_EQ(pg->transport_name().rfind(gloo->transport, 0), 0u) << pg->transport_name();
        if (rank == 0) std::raise(SIGPIPE);
        ProcessGroup::wait(pg->barrier());
      });
}

// Counts the store calls a rank's group construction makes, by the key's part after the group name.
class CountingStore final : public compat::ForwardingStore {
 public:
  using compat::ForwardingStore::ForwardingStore;
  void set(const std::string& key, const std::vector<uint8_t>& value) override {
    note("set", key);
    inner_->set(key, value);
  }
  std::vector<uint8_t> get(const std::string& key) override {
    note("get", key);
    return inner_->get(key);
  }
  int64_t add(const std::string& key, int64_t value) override {
    note("add", key);
    return inner_->add(key, value);
  }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    note("wait", keys.front());
    inner_->wait(keys, timeout);
  }
#if DDPKIT_TORCH_AT_LEAST(2, 1)
  std::vector<std::vector<uint8_t>> multiGet(const std::vector<std::string>& keys) override {
    note("multiGet", keys.front());
    return inner_->multiGet(keys);
  }
#endif
  int calls_under(const std::string& prefix) const {
    int n = 0;
    for (const auto& c : calls())
      if (c.second.rfind(prefix, 0) == 0) ++n;
    return n;
  }
  int calls_of(const std::string& op, const std::string& prefix) const {
    int n = 0;
    for (const auto& c : calls())
      if (c.first == op && c.second.rfind(prefix, 0) == 0) ++n;
    return n;
  }
  // (op, key) in order; a copy: a rank's lazily made pairs call the store from several threads.
  std::vector<std::pair<std::string, std::string>> calls() const {
    std::lock_guard<std::mutex> lock(mu_);
    return calls_;
  }

 private:
  void note(const char* op, const std::string& key) {
    std::lock_guard<std::mutex> lock(mu_);
    calls_.emplace_back(op, key);
  }
  mutable std::mutex mu_;
  std::vector<std::pair<std::string, std::string>> calls_;
};

// Over a long round trip each store call costs one or two of them (a TCPStore get waits, then
// gets): a group whose hosts each hold one rank (DiLoCo's sites, a cross-group group of fault
// tolerance) decides against shared memory from the topology alone, which it learns from two
// counters without reading any rank's host key: the same few calls at 4 ranks as at 64.
TEST(GroupRendezvous, AcrossHostsAsksTheStoreNoMoreThanItMust) {
  const int world = 4;
  std::vector<c10::intrusive_ptr<CountingStore>> counted(world);
  spawn_groups(
      world,
      [&](const c10::intrusive_ptr<c10d::Store>& store, int rank) {
        ScopedHostKey host("site" + std::to_string(rank));
        counted[rank] = c10::make_intrusive<CountingStore>(store);
        return std::make_shared<ProcessGroup>(counted[rank], rank, world, base_options().group_name("sites"));
      },
      [&](int, std::shared_ptr<ProcessGroup> pg) {
        EXPECT_FALSE(pg->uses_shared_memory());
        ProcessGroup::wait(pg->barrier());
      });
  for (int r = 0; r < world; ++r) {
    const CountingStore& s = *counted[r];
    EXPECT_EQ(s.calls_under("sites//ddpkit/shm/"), 0) << "rank " << r << " exchanged shared-memory keys across hosts";
    const int gets = s.calls_of("get", "sites//ddpkit/topology/"), batches = s.calls_of("multiGet", "sites//ddpkit/topology/");
    EXPECT_EQ(gets + batches, 0) << "rank " << r << ": " << gets << " gets and " << batches << " batches of the topology keys";
    // Its key, its host's counter, the host count, the arrivals, the last one's word, the wait, the count read.
    EXPECT_LE(s.calls_under("sites//ddpkit/topology/"), 7) << "rank " << r;
    std::cout << "rank " << r << ": " << s.calls().size() << " store calls to build the group\n";
  }
}

// The peers each rank connected to over lazily connected pairs: one store set per pair it made
// (its address), under "<group>//ddpkit/pair/<lo>-<hi>".
std::set<std::string> pairs_made(const CountingStore& s) {
  std::set<std::string> pairs;
  for (const auto& c : s.calls()) {
    const auto at = c.second.find("ddpkit/pair/");
    if (c.first == "set" && at != std::string::npos) pairs.insert(c.second.substr(at, c.second.find('/', at + 12) - at));
  }
  return pairs;
}

// Rings and trees at sizes that are not powers of two (recursive doubling folds the extra ranks
// in), with the peers each rank connects to: log2 N + 1 for a small allreduce, 2 more for a ring,
// every one for an alltoall.
TEST(LazyPairs, RingsAndTreesAtEverySizeConnectOnlyTheirPeers) {
  for (int world : {2, 3, 5, 6}) {
    SCOPED_TRACE("world " + std::to_string(world));
    std::vector<c10::intrusive_ptr<CountingStore>> counted(world);
    std::vector<std::array<size_t, 3>> pairs(world);  // after the small allreduce, the large, the alltoall
    spawn_groups(
        world,
        [&](const c10::intrusive_ptr<c10d::Store>& store, int rank) {
          counted[rank] = c10::make_intrusive<CountingStore>(store);
          return std::make_shared<ProcessGroup>(
              counted[rank], rank, world, base_options().shared_memory(false).lazy_connections(true).group_name("lazy"));
        },
        [&](int rank, std::shared_ptr<ProcessGroup> pg) {
          EXPECT_TRUE(pairs_made(*counted[rank]).empty()) << "connected before any collective";
          at::Tensor small = at::full({37}, static_cast<float>(rank + 1));
          ProcessGroup::wait(pg->allreduce(small));
          EXPECT_TRUE(at::equal(small, at::full({37}, world * (world + 1) / 2.0f)));
          at::Tensor m = at::full({5}, static_cast<double>(rank));
          ProcessGroup::wait(pg->allreduce(m, c10d::ReduceOp::MAX));
          EXPECT_TRUE(at::equal(m, at::full({5}, static_cast<double>(world - 1))));
          pairs[rank][0] = pairs_made(*counted[rank]).size();
          // A ring: uneven chunks (numel not a multiple of the world), random values whose sums
          // must come out bit-identical on every rank.
          at::Tensor large = at::randn({(300 << 10) / 4 + 7}, at::TensorOptions().dtype(at::kFloat));
          at::Tensor sum = large.clone();
          ProcessGroup::wait(pg->allreduce(sum));
          std::vector<at::Tensor> every(world);
          for (auto& t : every) t = at::empty_like(sum);
          ProcessGroup::wait(pg->allgather(every, sum));
          for (int r = 0; r < world; ++r) EXPECT_TRUE(at::equal(every[r], sum)) << "rank " << r << "'s sum differs";
          std::vector<at::Tensor> inputs(world);
          for (auto& t : inputs) t = at::empty_like(large);
          ProcessGroup::wait(pg->allgather(inputs, large));
          at::Tensor want = at::zeros_like(large);
          for (const auto& t : inputs) want += t;
          EXPECT_TRUE(at::allclose(sum, want, 1e-5, 1e-4));
          for (int root = 0; root < world; ++root) {
            at::Tensor b = at::full({9}, static_cast<int64_t>(rank * 10 + root), at::kLong);
            ProcessGroup::wait(pg->broadcast(b, root));
            EXPECT_TRUE(at::equal(b, at::full({9}, static_cast<int64_t>(root * 11), at::kLong))) << "root " << root;
          }
          ProcessGroup::wait(pg->barrier());
          pairs[rank][1] = pairs_made(*counted[rank]).size();
          at::Tensor in = at::arange(world * 3, at::kFloat) + 100 * rank, out = at::empty_like(in);
          ProcessGroup::wait(pg->alltoall(out, in));
          for (int r = 0; r < world; ++r)
            EXPECT_TRUE(at::equal(out.narrow(0, r * 3, 3), at::arange(rank * 3, rank * 3 + 3, at::kFloat) + 100 * r));
          pairs[rank][2] = pairs_made(*counted[rank]).size();
          EXPECT_THAT(error_of([&] { pg->monitored_barrier(std::chrono::seconds(1)); }),
                      ::testing::HasSubstr("connects its peers lazily"));
        });
    int log2 = 0;
    while ((2 << log2) <= world) ++log2;
    for (int r = 0; r < world; ++r) {
      EXPECT_LE(pairs[r][0], static_cast<size_t>(log2 + 1)) << "rank " << r << " after a small allreduce";
      EXPECT_EQ(pairs[r][2], static_cast<size_t>(world - 1)) << "rank " << r << " after an alltoall";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(EveryTransport, Conformance, ::testing::ValuesIn(transports()),
                         [](const ::testing::TestParamInfo<TransportCase>& info) { return info.param.name; });

}  // namespace
}  // namespace testing
}  // namespace ddpkit
