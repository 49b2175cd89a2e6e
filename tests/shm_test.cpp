// Shared-memory collectives (issue 15): every collective through shared memory against the same
// collective over Gloo (a second group with shared_memory(false), same ranks), at world 1-4 and
// sizes that do not divide evenly, with integer-valued data so every sum is exact and results
// must be equal bit for bit. Ranks are threads here; tests/process_test.cpp kills real processes.
#include "harness.h"

#include "../src/comm/peer_memory.h"

#include <ddpkit/comm/gradient_arena.h>

#include <c10/core/CPUAllocator.h>

#include <sys/mman.h>
#include <unistd.h>

#include <future>
#include <thread>

namespace ddpkit {
namespace {

using testing::spawn_groups;

ProcessGroupOptions shm_options(bool on, int64_t slot_bytes = 4096) {
  return ProcessGroupOptions().gloo_hostname("127.0.0.1").shared_memory(on).shm_slot_bytes(slot_bytes)
      .timeout(std::chrono::seconds(60));
}

// fn(rank, shm group, gloo group) on `world` rank threads.
void with_both(int world, const std::function<void(int, ProcessGroup&, ProcessGroup&)>& fn, int64_t slot_bytes = 4096) {
  spawn_groups(
      world,
      [&](const c10::intrusive_ptr<c10d::Store>& store, int r) {
        set_compute_threads(1);
        return std::make_shared<ProcessGroup>(store, r, world, shm_options(true, slot_bytes).group_name("shm"));
      },
      [&](int rank, std::shared_ptr<ProcessGroup> shm) {
        auto gloo = std::make_shared<ProcessGroup>(shm->store(), rank, world, shm_options(false).group_name("gloo"));
        EXPECT_EQ(shm->uses_shared_memory(), world > 1);
        EXPECT_FALSE(gloo->uses_shared_memory());
        fn(rank, *shm, *gloo);
      });
}

at::Tensor integers(int64_t n, int rank, at::ScalarType dt, int salt = 0) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 * rank + salt);
  return at::randint(-50, 50, {n}, gen).to(dt);
}

bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  return a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type() &&
         at::equal(a.contiguous().view(at::kByte), b.contiguous().view(at::kByte));
}

std::vector<int64_t> sizes() { return {0, 1, 7, 1000, 4099, 100003}; }  // 4 KiB slots: many steps

TEST(SharedMemory, AllreduceEqualsGloo) {
  for (int world : {1, 2, 3, 4}) {
    with_both(world, [&](int rank, ProcessGroup& shm, ProcessGroup& gloo) {
      for (int64_t n : sizes())
        for (auto dt : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16}) {
          at::Tensor a = integers(n, rank, dt), b = a.clone();
          ProcessGroup::wait(shm.allreduce(a));
          ProcessGroup::wait(gloo.allreduce(b));
          EXPECT_TRUE(same_bits(a, b)) << "world " << world << " n " << n << " " << dt;
        }
      // AVG (Gloo has none: ddpkit divides a SUM there).
      at::Tensor a = integers(999, rank, at::kFloat) * world, b = a.clone();
      ProcessGroup::wait(shm.allreduce(a, c10d::ReduceOp::AVG));
      ProcessGroup::wait(gloo.allreduce(b, c10d::ReduceOp::AVG));
      EXPECT_TRUE(at::allclose(a, b)) << "AVG, world " << world;
      // In place on a strided view.
      at::Tensor m = integers(60, rank, at::kFloat).view({6, 10}), v = m.t();
      at::Tensor want = m.clone();
      ProcessGroup::wait(gloo.allreduce(want));
      ProcessGroup::wait(shm.allreduce(v));
      EXPECT_TRUE(same_bits(m, want)) << "strided, world " << world;
    });
  }
}

// DDP's buckets (ProcessGroup::allreduce_buffer): every local rank maps every peer's buffer and
// sums its slice into all of them. Same bits as Gloo on whole buffers and on the same part of
// each; ranks that pass different parts, or plain memory, go through the slots, still right.
TEST(SharedMemory, AllreduceBuffersSumInPlaceAndEqualGloo) {
  for (int world : {1, 2, 3, 4}) {
    with_both(world, [&](int rank, ProcessGroup& shm, ProcessGroup& gloo) {
      for (int64_t n : {1, 7, 1000, 100003})
        for (auto dt : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16}) {
          at::Tensor buffer = shm.allreduce_buffer(n, dt);
          EXPECT_EQ(buffer.scalar_type(), dt);
          EXPECT_TRUE(at::equal(buffer, at::zeros({n}, dt))) << "zeroed";
          EXPECT_EQ(testing::in_shared_memory(buffer), world > 1) << "world " << world;
          buffer.copy_(integers(n, rank, dt));
          at::Tensor want = buffer.clone();
          ProcessGroup::wait(gloo.allreduce(want));
          ProcessGroup::wait(shm.allreduce(buffer));
          EXPECT_TRUE(same_bits(buffer, want)) << "world " << world << " n " << n << " " << dt;
          if (n < 1000) continue;
          at::Tensor part = buffer.narrow(0, 17, n - 40);  // the same part on every rank
          part.copy_(integers(n - 40, rank, dt, 1));
          at::Tensor part_want = part.clone();
          ProcessGroup::wait(gloo.allreduce(part_want));
          ProcessGroup::wait(shm.allreduce(part));
          EXPECT_TRUE(same_bits(part, part_want)) << "part, world " << world << " n " << n << " " << dt;
        }
      at::Tensor buffer = shm.allreduce_buffer(5000, at::kFloat);
      buffer.copy_(integers(5000, rank, at::kFloat, 2) * world);
      at::Tensor want = buffer.clone();
      ProcessGroup::wait(gloo.allreduce(want, c10d::ReduceOp::AVG));
      ProcessGroup::wait(shm.allreduce(buffer, c10d::ReduceOp::AVG));
      EXPECT_TRUE(at::allclose(buffer, want)) << "AVG, world " << world;
      // Rank 0 passes plain memory, the others parts at different offsets: the slots.
      at::Tensor mixed = rank == 0 ? at::empty({4000}) : buffer.narrow(0, 10 * rank, 4000);
      mixed.copy_(integers(4000, rank, at::kFloat, 3));
      at::Tensor mixed_want = mixed.clone();
      ProcessGroup::wait(gloo.allreduce(mixed_want));
      ProcessGroup::wait(shm.allreduce(mixed));
      EXPECT_TRUE(same_bits(mixed, mixed_want)) << "mixed, world " << world;
    });
  }
}

// FSDP's shards on one host (ProcessGroup::host_shared_tensor): one memory every local rank maps,
// zeroed; what each rank writes into its part, every rank reads after a barrier. A group over
// Gloo alone gets none (the caller keeps its own memory).
TEST(SharedMemory, HostSharedTensorIsOneMemoryEveryRankSees) {
  for (int world : {2, 3, 4}) {
    with_both(world, [&](int rank, ProcessGroup& shm, ProcessGroup& gloo) {
      EXPECT_FALSE(gloo.host_shared_tensor(100, at::kFloat).defined());
      const int64_t part = 1001;  // not a page's worth: parts share pages
      at::Tensor all = shm.host_shared_tensor(part * world, at::kFloat);
      ASSERT_TRUE(all.defined());
      EXPECT_TRUE(at::equal(all, at::zeros({part * world}))) << "zeroed";
      ProcessGroup::wait(shm.barrier());  // every rank has looked before any writes
      EXPECT_FALSE(shm.sums_in_place(all));  // allreduce does not treat it as its buffer
      all.narrow(0, rank * part, part).copy_(integers(part, rank, at::kFloat));
      ProcessGroup::wait(shm.barrier());
      for (int r = 0; r < world; ++r)
        EXPECT_TRUE(same_bits(all.narrow(0, r * part, part), integers(part, r, at::kFloat))) << "rank " << r << "'s part";
      ProcessGroup::wait(shm.barrier());  // no rank frees its mapping while a peer still reads
    });
  }
}

// DDP's gradients (ProcessGroup::allreduce_parts): each rank's values in tensors of its own, one
// of them the buffer's own place, reduced through the buffer and written back into them. Same
// bits as Gloo; a rank that allreduces its buffer instead sums along; a rank with plain memory
// sends everyone through the slots; Gloo's group takes the parts through its buffer.
TEST(SharedMemory, AllreducePartsEqualsGlooWhereverTheyLie) {
  for (int world : {1, 2, 3, 4}) {
    with_both(world, [&](int rank, ProcessGroup& shm, ProcessGroup& gloo) {
      const double scale = world == 3 ? 1.0 : 1.0 / world;  // exact on integers
      for (int64_t n : {1, 7, 1000, 100003})
        for (auto dt : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16}) {
          at::Tensor buffer = shm.allreduce_buffer(n, dt);
          const at::Tensor data = integers(n, rank, dt, 4);
          const int64_t a = n / 3, b = n - n / 3;  // parts [0, a) and [b, n) private, [a, b) the buffer's own
          std::vector<at::Tensor> parts = {data.narrow(0, 0, a).clone(), buffer.narrow(0, a, b - a),
                                           data.narrow(0, b, n - b).clone()};
          parts[1].copy_(data.narrow(0, a, b - a));
          at::Tensor want = data.clone();
          ProcessGroup::wait(gloo.allreduce(want));
          want.mul_(scale);
          ProcessGroup::wait(shm.allreduce_parts(buffer, parts, scale));
          EXPECT_TRUE(same_bits(at::cat(parts), want)) << "world " << world << " n " << n << " " << dt;
          // Gloo's group: the same call, through its (plain) buffer.
          at::Tensor plain = at::empty({n}, dt);
          std::vector<at::Tensor> again = {data.narrow(0, 0, a).clone(), plain.narrow(0, a, b - a),
                                           data.narrow(0, b, n - b).clone()};
          again[1].copy_(data.narrow(0, a, b - a));
          ProcessGroup::wait(gloo.allreduce_parts(plain, again, scale));
          EXPECT_TRUE(same_bits(at::cat(again), want)) << "gloo, world " << world << " n " << n << " " << dt;
        }
      const int64_t n = 30011;
      const at::Tensor data = integers(n, rank, at::kFloat, 5);
      at::Tensor want = data.clone();
      ProcessGroup::wait(gloo.allreduce(want));
      // Rank 0 allreduces its buffer, the others pass parts: in place for all.
      at::Tensor buffer = shm.allreduce_buffer(n, at::kFloat);
      std::vector<at::Tensor> parts = {data.narrow(0, 0, 5000).clone(), data.narrow(0, 5000, n - 5000).clone()};
      if (rank == 0) {
        buffer.copy_(data);
        ProcessGroup::wait(shm.allreduce(buffer));
      } else {
        ProcessGroup::wait(shm.allreduce_parts(buffer, parts));
      }
      EXPECT_TRUE(same_bits(rank == 0 ? buffer : at::cat(parts), want)) << "with allreduce, world " << world;
      // Rank 0 passes plain memory: everyone goes through the slots.
      parts = {data.narrow(0, 0, 5000).clone(), data.narrow(0, 5000, n - 5000).clone()};
      at::Tensor plain = data.clone();
      if (rank == 0) {
        ProcessGroup::wait(shm.allreduce(plain));
      } else {
        ProcessGroup::wait(shm.allreduce_parts(buffer, parts));
      }
      EXPECT_TRUE(same_bits(rank == 0 ? plain : at::cat(parts), want)) << "through the slots, world " << world;
      // Parts that lie in another shared buffer (a GradientArena's) on odd ranks: peers read and
      // write them where they lie; through the slots when rank 0 passes plain memory.
      at::Tensor home = shm.allreduce_buffer(n + 100, at::kFloat);
      for (bool slots : {false, true}) {
        std::vector<at::Tensor> spread = {data.narrow(0, 0, 5000).clone(), data.narrow(0, 5000, 20000).clone(),
                                          data.narrow(0, 25000, n - 25000).clone()};
        if (rank % 2 == 1) {  // parts 0 and 2 in `home`, away from their own positions
          spread[0] = home.narrow(0, 100 + (n - 25000), 5000).copy_(spread[0]);
          spread[2] = home.narrow(0, 50, n - 25000).copy_(spread[2]);
        }
        if (slots && rank == 0) {
          at::Tensor mine = data.clone();
          ProcessGroup::wait(shm.allreduce(mine));
          EXPECT_TRUE(same_bits(mine, want)) << "rank 0, world " << world;
          continue;
        }
        ProcessGroup::wait(shm.allreduce_parts(buffer, spread));
        EXPECT_TRUE(same_bits(at::cat(spread), want)) << "parts in a shared buffer, slots " << slots << ", world "
                                                      << world;
        if (rank % 2 == 1) EXPECT_TRUE(testing::in_shared_memory(spread[0]) == (world > 1));
      }
      // What is wrong with the parts is named.
      EXPECT_THAT(testing::error_of([&] { shm.allreduce_parts(buffer, {data.narrow(0, 0, 10)}); }),
                  ::testing::HasSubstr("allreduce_parts: the parts hold 10 elements, the buffer 30011"));
      EXPECT_THAT(testing::error_of([&] { shm.allreduce_parts(buffer, {data.to(at::kDouble)}); }),
                  ::testing::HasSubstr("allreduce_parts: part 0 is"));
    });
  }
}

// GradientArena: on the thread that uses it, CPU allocations of its block sizes come from memory
// every local rank maps (while it has room); others, and other threads, do not. Freed blocks are
// reused; raw_allocate/raw_deleter work through it; a retired arena stays valid until its last
// block is freed. Where buffers do not sum in place there is none.
TEST(SharedMemory, GradientArenaServesItsSizesOnTheThreadThatUsesIt) {
  for (int world : {1, 2}) {
    with_both(world, [&](int, ProcessGroup& shm, ProcessGroup& gloo) {
      EXPECT_EQ(gloo.gradient_arena({1 << 20}), nullptr);
      std::shared_ptr<GradientArena> arena = shm.gradient_arena({1 << 20, 3 << 20});
      if (world == 1) {
        EXPECT_EQ(arena, nullptr);
        return;
      }
      ASSERT_NE(arena, nullptr);
      EXPECT_EQ(arena->capacity(), size_t(7) << 20);  // one of each, and one more of the largest
      GradientArena::use(arena);
      at::Tensor a = at::empty({1 << 18});  // 1 MiB
      at::Tensor other = at::empty({1000});
      EXPECT_TRUE(arena->contains(a.data_ptr()));
      EXPECT_TRUE(testing::in_shared_memory(a));
      EXPECT_FALSE(arena->contains(other.data_ptr()));
      void* was = a.data_ptr();
      a = at::Tensor();
      EXPECT_EQ(arena->bytes_in_use(), 0u);
      a = at::empty({1 << 18});
      EXPECT_EQ(a.data_ptr(), was) << "a freed block is reused";
      std::vector<at::Tensor> more;  // 7 MiB hold 7 blocks of 1 MiB: the 8th is the caller's
      for (int i = 0; i < 7; ++i) more.push_back(at::empty({1 << 18}));
      EXPECT_TRUE(arena->contains(more[5].data_ptr()));
      EXPECT_FALSE(arena->contains(more[6].data_ptr()));
      more.clear();
      c10::Allocator* cpu = c10::GetCPUAllocator();
      void* raw = cpu->raw_allocate(1 << 20);
      EXPECT_TRUE(arena->contains(raw));
      cpu->raw_deleter()(raw);
      EXPECT_EQ(arena->bytes_in_use(), size_t(1) << 20);  // only `a`
      std::thread([&] { EXPECT_FALSE(arena->contains(at::empty({1 << 18}).data_ptr())) << "another thread"; }).join();
      GradientArena::use(nullptr);
      EXPECT_FALSE(arena->contains(at::empty({1 << 18}).data_ptr()));
      arena->retire();
      arena.reset();
      a.fill_(2);  // still mapped
      EXPECT_EQ(a.sum().item<float>(), 2.f * (1 << 18));
    });
  }
}

// Allocation is collective over the host's ranks: sizes must agree, and a rank that does not
// take part gives its peers an error within the timeout. Nothing is left in /dev/shm, and a
// buffer outlives its group.
TEST(SharedMemory, AllreduceBuffersAreAllocatedTogether) {
  spawn_groups(
      3,
      [](const c10::intrusive_ptr<c10d::Store>& store, int r) {
        return std::make_shared<ProcessGroup>(store, r, 3, shm_options(true).timeout(std::chrono::seconds(20)));
      },
      [&](int rank, std::shared_ptr<ProcessGroup> pg) {
        EXPECT_THAT(testing::error_of([&] { pg->allreduce_buffer(rank == 0 ? 100 : 200, at::kFloat); }),
                    ::testing::ContainsRegex("allocated (400|800) bytes as shared buffer #0 where this rank allocated "
                                             "(400|800): every rank must allocate the same buffers in the same order"));
        auto group = std::make_shared<ProcessGroup>(pg->store(), rank, 3, shm_options(true).group_name("buffers"));
        at::Tensor buffer = group->allreduce_buffer(3000, at::kFloat);
        buffer.fill_(rank + 1);
        ProcessGroup::wait(group->allreduce(buffer));
        EXPECT_TRUE(at::equal(buffer, at::full({3000}, 6.f)));
        EXPECT_TRUE(testing::shm_segments(getpid()).empty()) << "a buffer was named in /dev/shm";
        ProcessGroup::wait(pg->barrier());  // every rank is done with `group`
        group.reset();
        buffer.add_(1);  // still mapped
        EXPECT_TRUE(at::equal(buffer, at::full({3000}, 7.f)));
      });
  std::promise<void> rank0_done;
  spawn_groups(
      2,
      [](const c10::intrusive_ptr<c10d::Store>& store, int r) {
        return std::make_shared<ProcessGroup>(store, r, 2, shm_options(true).timeout(std::chrono::milliseconds(500)));
      },
      [&](int rank, std::shared_ptr<ProcessGroup> pg) {
        if (rank == 1) return rank0_done.get_future().wait();
        EXPECT_THAT(testing::error_of([&] { pg->allreduce_buffer(10, at::kFloat); }),
                    ::testing::ContainsRegex("allreduce_buffer of 10 Float elements in shared memory failed on rank 0 "
                                             "of 2: .*rank 1 \\(on this host\\) did not allocate shared buffer #0"));
        EXPECT_TRUE(testing::shm_segments(getpid()).empty());
        rank0_done.set_value();
      });
}

// 2048 + 1 + 1 in float16: summed pairwise in float16 it stays 2048 (the spacing there is 2);
// accumulated in fp32 and rounded once it is 2050.
TEST(SharedMemory, HalfSumsAccumulateInFloat32) {
  with_both(3, [&](int rank, ProcessGroup& shm, ProcessGroup&) {
    for (auto dt : {at::kHalf, at::kBFloat16}) {
      const float big = dt == at::kHalf ? 2048.f : 256.f, want = big + 2;
      at::Tensor t = at::full({5000}, rank == 0 ? big : 1.f).to(dt);
      ProcessGroup::wait(shm.allreduce(t));
      EXPECT_TRUE(at::equal(t.to(at::kFloat), at::full({5000}, want))) << dt;
    }
  });
}

TEST(SharedMemory, BroadcastAllgatherAlltoallReduceScatterEqualGloo) {
  for (int world : {1, 2, 3, 4}) {
    with_both(world, [&](int rank, ProcessGroup& shm, ProcessGroup& gloo) {
      for (int64_t n : sizes()) {
        for (int root = 0; root < world; ++root) {
          at::Tensor a = integers(n, rank, at::kFloat, root), b = a.clone();
          ProcessGroup::wait(shm.broadcast(a, root));
          ProcessGroup::wait(gloo.broadcast(b, root));
          EXPECT_TRUE(same_bits(a, b)) << "broadcast from " << root << " world " << world << " n " << n;
        }
        for (auto dt : {at::kFloat, at::kBFloat16}) {
          at::Tensor in = integers(n, rank, dt);
          std::vector<at::Tensor> x, y;
          for (int r = 0; r < world; ++r) x.push_back(at::empty({n}, dt)), y.push_back(at::empty({n}, dt));
          ProcessGroup::wait(shm.allgather(x, in));
          ProcessGroup::wait(gloo.allgather(y, in));
          for (int r = 0; r < world; ++r) EXPECT_TRUE(same_bits(x[r], y[r])) << "allgather world " << world << " n " << n;

          at::Tensor all = integers(n * world, rank, dt, 7), o1 = at::empty({n * world}, dt), o2 = o1.clone();
          ProcessGroup::wait(shm.alltoall(o1, all));
          ProcessGroup::wait(gloo.alltoall(o2, all));
          EXPECT_TRUE(same_bits(o1, o2)) << "alltoall world " << world << " n " << n << " " << dt;

          at::Tensor s1 = at::empty({n}, dt), s2 = at::empty({n}, dt);
          ProcessGroup::wait(shm.reduce_scatter(s1, all));
          ProcessGroup::wait(gloo.reduce_scatter(s2, all));
          EXPECT_TRUE(same_bits(s1, s2)) << "reduce_scatter world " << world << " n " << n << " " << dt;
        }
      }
      ProcessGroup::wait(shm.barrier());
    });
  }
}

TEST(SharedMemory, BytesAreCountedApartFromTheNetwork) {
  with_both(2, [&](int rank, ProcessGroup& shm, ProcessGroup& gloo) {
    at::Tensor t = at::ones({1000});
    ProcessGroup::wait(shm.allreduce(t));
    ProcessGroup::wait(gloo.allreduce(t));
    EXPECT_EQ(shm.stats().bytes_sent, 0u);
    EXPECT_EQ(shm.stats().shm_bytes_sent, 4000u);  // 2(n-1)/n of 4000 bytes
    EXPECT_EQ(gloo.stats().bytes_sent, 4000u);
    EXPECT_EQ(gloo.stats().shm_bytes_sent, 0u);
  });
}

// The int8 hook's two-phase job runs through shared memory too, with the same result as Gloo.
TEST(SharedMemory, TwoPhaseJobsEqualGloo) {
  with_both(3, [&](int rank, ProcessGroup& shm, ProcessGroup& gloo) {
    at::Tensor grad = testing::seeded_randn({5000}, rank);
    std::vector<at::Tensor> got;
    for (ProcessGroup* pg : {&shm, &gloo}) {
      auto hook = hooks::int8_allreduce_hook(std::shared_ptr<ProcessGroup>(pg, [](ProcessGroup*) {}));
      at::Tensor buffer = grad.clone();
      GradBucket bucket(0, 1, buffer, {0}, {{5000}}, {}, false);
      got.push_back(ProcessGroup::wait(hook(bucket)));
    }
    EXPECT_TRUE(same_bits(got[0], got[1]));
  });
}

// A rank that calls another collective is named, not fed the wrong bytes.
TEST(SharedMemory, MismatchedCollectivesAreNamed) {
  std::vector<std::string> errors(2);
  spawn_groups(
      2,
      [](const c10::intrusive_ptr<c10d::Store>& store, int r) {
        return std::make_shared<ProcessGroup>(store, r, 2, shm_options(true).timeout(std::chrono::seconds(5)));
      },
      [&](int rank, std::shared_ptr<ProcessGroup> pg) {
        at::Tensor t = at::ones({rank == 0 ? 100 : 200});
        errors[rank] = testing::error_of([&] { ProcessGroup::wait(pg->allreduce(t)); });
        // Broken for good: the steps are out of step.
        EXPECT_THAT(testing::error_of([&] { ProcessGroup::wait(pg->barrier()); }),
                    ::testing::HasSubstr("unusable after an earlier failure"));
      });
  for (int r = 0; r < 2; ++r) {
    EXPECT_THAT(errors[r], ::testing::HasSubstr("allreduce"));
    EXPECT_THAT(errors[r], ::testing::ContainsRegex("rank [01] \\(on this host\\) called allreduce of (100|200) "
                                                    "Float elements where this rank called allreduce of (100|200)"));
  }
}

// A rank that never comes gives its peers an error within the group's timeout. (A rank whose
// group is gone counts as dead at once: tests/process_test.cpp.)
TEST(SharedMemory, AMissingPeerTimesOut) {
  std::promise<void> rank0_done;
  spawn_groups(
      2,
      [](const c10::intrusive_ptr<c10d::Store>& store, int r) {
        return std::make_shared<ProcessGroup>(store, r, 2, shm_options(true).timeout(std::chrono::milliseconds(500)));
      },
      [&](int rank, std::shared_ptr<ProcessGroup> pg) {
        if (rank == 1) return rank0_done.get_future().wait();  // alive (its group too), but not calling
        const auto t0 = std::chrono::steady_clock::now();
        EXPECT_THAT(testing::error_of([&] { ProcessGroup::wait(pg->allreduce(at::ones({10}))); }),
                    ::testing::ContainsRegex("allreduce .* in shared memory failed on rank 0 of 2: rank 1 \\(on this "
                                             "host\\) did not take its part in shared-memory allreduce of 10 Float "
                                             "elements within the group's timeout of 500 ms"));
        EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(10));
        rank0_done.set_value();
      });
}

// Two groups over the same ranks have their own segments, and neither leaves a name behind.
// All shared memory is unnamed memfds that peers open through /proc/<pid>/fd: an address names
// the file, so a stale one (fd closed and reused, or the wrong size) is refused, never mapped.
TEST(SharedMemory, PeerMemoryOpensOnlyTheFileItsAddressNames) {
  void* base = nullptr;
  std::string error;
  const int fd = detail::create_peer_memory("ddpkit-test", 8192, &base, &error);
  ASSERT_GE(fd, 0) << error;
  static_cast<char*>(base)[100] = 42;
  detail::PeerMemoryAddress a;
  ASSERT_TRUE(detail::parse_peer_memory_address(detail::peer_memory_address(fd), &a));
  EXPECT_EQ(a.pid, getpid());
  EXPECT_EQ(a.bytes, 8192u);
  const int peer = detail::open_peer_memory(a, &error);
  ASSERT_GE(peer, 0) << error;
  void* mapped = mmap(nullptr, 8192, PROT_READ, MAP_SHARED, peer, 0);
  ASSERT_NE(mapped, MAP_FAILED);
  EXPECT_EQ(static_cast<char*>(mapped)[100], 42);
  munmap(mapped, 8192);
  close(peer);
  EXPECT_TRUE(testing::shm_segments(getpid()).empty()) << "nothing named in /dev/shm";

  detail::PeerMemoryAddress other = a;
  other.ino += 1;
  EXPECT_LT(detail::open_peer_memory(other, &error), 0);
  EXPECT_THAT(error, ::testing::HasSubstr("is no longer the memory its owner published"));
  other = a;
  other.bytes = 4096;
  EXPECT_LT(detail::open_peer_memory(other, &error), 0);
  EXPECT_THAT(error, ::testing::HasSubstr("is not a sealed 4096-byte memfd"));
  EXPECT_FALSE(detail::parse_peer_memory_address("123 4 5", &other));
  EXPECT_FALSE(detail::parse_peer_memory_address(detail::peer_memory_address(fd) + " x", &other));

  // The owner lets go of its fd and the number is reused by another file.
  close(fd);
  munmap(base, 8192);
  const int unrelated = memfd_create("unrelated", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  ASSERT_EQ(ftruncate(unrelated, 8192), 0);
  ASSERT_EQ(fcntl(unrelated, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
  ASSERT_EQ(dup2(unrelated, a.fd), a.fd);
  if (unrelated != a.fd) close(unrelated);
  EXPECT_LT(detail::open_peer_memory(a, &error), 0);
  EXPECT_THAT(error, ::testing::HasSubstr("is no longer the memory its owner published"));
  close(a.fd);
  EXPECT_LT(detail::open_peer_memory(a, &error), 0);
  EXPECT_THAT(error, ::testing::HasSubstr("cannot open /proc/"));
}

TEST(SharedMemory, GroupsHaveTheirOwnSegmentsAndNameNone) {
  spawn_groups(
      3,
      [](const c10::intrusive_ptr<c10d::Store>& store, int r) {
        return std::make_shared<ProcessGroup>(store, r, 3, shm_options(true).group_name("one"));
      },
      [&](int rank, std::shared_ptr<ProcessGroup> one) {
        auto two = std::make_shared<ProcessGroup>(one->store(), rank, 3, shm_options(true).group_name("two"));
        ProcessGroup::wait(two->barrier());  // every rank's group is made
        EXPECT_TRUE(testing::shm_segments(getpid()).empty()) << "a segment was named in /dev/shm";
        at::Tensor a = at::full({3000}, 1.f), b = at::full({3000}, 10.f);
        auto fa = one->allreduce(a);
        auto fb = two->allreduce(b);
        ProcessGroup::wait(fa);
        ProcessGroup::wait(fb);
        EXPECT_TRUE(at::equal(a, at::full({3000}, 3.f)));
        EXPECT_TRUE(at::equal(b, at::full({3000}, 30.f)));
      });
}

TEST(SharedMemory, OptionAndEnvironmentTurnItOff) {
  spawn_groups(
      2,
      [](const c10::intrusive_ptr<c10d::Store>& store, int r) {
        // Rank 1 does not want it: the group does without.
        return std::make_shared<ProcessGroup>(store, r, 2, shm_options(r == 0));
      },
      [&](int, std::shared_ptr<ProcessGroup> pg) {
        EXPECT_FALSE(pg->uses_shared_memory());
        at::Tensor t = at::ones({10});
        ProcessGroup::wait(pg->allreduce(t));
        EXPECT_TRUE(at::equal(t, at::full({10}, 2.f)));
        EXPECT_GT(pg->stats().bytes_sent, 0u);
      });
  setenv("DDPKIT_SHM", "0", 1);
  spawn_groups(
      2, [](const c10::intrusive_ptr<c10d::Store>& store, int r) { return std::make_shared<ProcessGroup>(store, r, 2, shm_options(true)); },
      [&](int, std::shared_ptr<ProcessGroup> pg) { EXPECT_FALSE(pg->uses_shared_memory()); });
  unsetenv("DDPKIT_SHM");
}


// Inputs in a shared buffer (at the same offset on every rank, or not) gather as private ones do:
// Gloo's result, the input unchanged.
TEST(SharedMemory, AllgatherFromSharedBuffersEqualsGloo) {
  for (int world : {2, 3, 4}) {
    testing::spawn_ranks(world, [&](int rank, std::shared_ptr<ProcessGroup> pg) {
      ASSERT_TRUE(pg->uses_shared_memory());
      const int64_t n = (3 << 20) / 4 + 5;  // over several slots, not a multiple of anything
      at::Tensor buffer = pg->allreduce_buffer(2 * n + 64, at::kFloat);
      ASSERT_TRUE(pg->sums_in_place(buffer));
      at::Tensor mine = testing::seeded_randn({n}, 77 + rank);
      at::Tensor want = at::empty({world * n});
      for (int r = 0; r < world; ++r) want.narrow(0, r * n, n).copy_(testing::seeded_randn({n}, 77 + r));
      for (int64_t offset : {int64_t{0}, int64_t{16} * rank}) {  // same offset everywhere, then not
        at::Tensor input = buffer.narrow(0, offset, n);
        input.copy_(mine);
        at::Tensor out = at::empty({world * n});
        ProcessGroup::wait(pg->allgather_into_tensor(out, input));
        EXPECT_TRUE(out.equal(want)) << "offset " << offset;
        EXPECT_TRUE(input.equal(mine));
      }
      at::Tensor out = at::empty({world * n});
      ProcessGroup::wait(pg->allgather_into_tensor(out, mine.clone()));  // private memory
      EXPECT_TRUE(out.equal(want));
    });
  }
}

}  // namespace
}  // namespace ddpkit
