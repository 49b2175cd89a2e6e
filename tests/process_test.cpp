// Real processes: the test re-executes itself as workers (DDPKIT_TEST_WORKER=role) that
// rendezvous over TCPStore on loopback; and the process-wide allocator tuning, which a worker
// installs where the test's own process must stay as it is.
#include "harness.h"

#include <ddpkit/comm/gradient_arena.h>
#include <ddpkit/plan/profile.h>
#include <ddpkit/runtime/block_cache.h>
#include <ddpkit/runtime/memory_sampler.h>

#include <c10/core/CPUAllocator.h>

#include <torch/nn/modules/container/functional.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <csignal>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <thread>

namespace ddpkit {
namespace {

constexpr int kKilledPeerTimeoutS = 10;

int free_port() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t len = sizeof a;
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  close(fd);
  return ntohs(a.sin_port);
}

// Starts `world` workers (or only `start` of them) running `role`; returns their pids.
std::vector<pid_t> start_workers(const std::string& role, int world, int start, int port, const std::string& out_prefix) {
  std::vector<pid_t> pids;
  for (int r = 0; r < start; ++r) {
    pid_t pid = fork();
    if (pid == 0) {
      setenv("DDPKIT_TEST_WORKER", role.c_str(), 1);
      setenv("MASTER_ADDR", "127.0.0.1", 1);
      setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      setenv("RANK", std::to_string(r).c_str(), 1);
      setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
      setenv("DDPKIT_TEST_OUT", (out_prefix + std::to_string(r)).c_str(), 1);
      execl("/proc/self/exe", "ddpkit_process_tests", nullptr);
      _exit(127);
    }
    pids.push_back(pid);
  }
  return pids;
}

int wait_exit(pid_t pid) {
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

std::string slurp(const std::string& path) {
  std::ifstream f(path);
  return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

TEST(Processes, TrainingOverTcpStoreAgreesAcrossRanks) {
  const std::string out = "/tmp/ddpkit_pt_train_" + std::to_string(getpid()) + "_";
  auto pids = start_workers("train", 3, 3, free_port(), out);
  for (pid_t p : pids) EXPECT_EQ(wait_exit(p), 0);
  const std::string r0 = slurp(out + "0");
  EXPECT_FALSE(r0.empty());
  EXPECT_EQ(r0, slurp(out + "1"));
  EXPECT_EQ(r0, slurp(out + "2"));
  for (int r = 0; r < 3; ++r) std::remove((out + std::to_string(r)).c_str());
}

TEST(Processes, KilledPeerGivesSurvivorsAnErrorWithinTheTimeout) {
  const std::string out = "/tmp/ddpkit_pt_kill_" + std::to_string(getpid()) + "_";
  const auto t0 = std::chrono::steady_clock::now();
  auto pids = start_workers("killed_peer", 3, 3, free_port(), out);
  std::vector<int> codes;
  for (pid_t p : pids) codes.push_back(wait_exit(p));
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(codes[2], 9) << "rank 2 kills itself";
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(codes[r], 42) << "rank " << r << " should have caught a CommError; said: " << slurp(out + std::to_string(r));
    const std::string msg = slurp(out + std::to_string(r));
    EXPECT_THAT(msg, ::testing::HasSubstr("on rank " + std::to_string(r) + " of 3"));
    EXPECT_THAT(msg, ::testing::AnyOf(::testing::HasSubstr("allreduce"), ::testing::HasSubstr("bucket")));
  }
  EXPECT_LT(seconds, kKilledPeerTimeoutS + 20);
  for (int r = 0; r < 3; ++r) std::remove((out + std::to_string(r)).c_str());
}

// Issue 15: ranks on one host talk through shared memory. A peer SIGKILLed or SIGSTOPped in the
// middle of training gives every survivor a CommError within the timeout (death is noticed at
// once through the peer's lock; a stop by the deadline), and nothing is left in /dev/shm.
void expect_survivors_fail(const std::string& role, int signal, const std::string& cause) {
  const std::string out = "/tmp/ddpkit_pt_" + role + "_" + std::to_string(getpid()) + "_";
  const auto t0 = std::chrono::steady_clock::now();
  auto pids = start_workers(role, 3, 3, free_port(), out);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(wait_exit(pids[r]), 42) << "rank " << r << " said: " << slurp(out + std::to_string(r));
    const std::string msg = slurp(out + std::to_string(r));
    EXPECT_THAT(msg, ::testing::HasSubstr("on rank " + std::to_string(r) + " of 3"));
    EXPECT_THAT(msg, ::testing::HasSubstr("shared memory"));
    EXPECT_THAT(msg, ::testing::HasSubstr("rank 2 (on this host) " + cause));
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(seconds, kKilledPeerTimeoutS + 20);
  if (signal == SIGSTOP) kill(pids[2], SIGKILL);  // still stopped: the test ends it
  EXPECT_EQ(wait_exit(pids[2]), 128 + SIGKILL);
  for (pid_t p : pids) EXPECT_TRUE(testing::shm_segments(p).empty()) << "a segment was left in /dev/shm";
  for (int r = 0; r < 3; ++r) std::remove((out + std::to_string(r)).c_str());
}

TEST(Processes, SharedMemoryPeerSigkilledGivesSurvivorsAnError) {
  expect_survivors_fail("sigkill_peer", SIGKILL, "died or shut its group down during shared-memory allreduce");
}

TEST(Processes, SharedMemoryPeerSigstoppedGivesSurvivorsAnErrorWithinTheTimeout) {
  expect_survivors_fail("sigstop_peer", SIGSTOP, "did not take its part in shared-memory allreduce");
}

TEST(Processes, HybridShardBuiltTwiceInOneJobTrainsAlikeAndLeavesNoKeys) {
  for (int world : {2, 3}) {
    const std::string out = "/tmp/ddpkit_pt_hybrid_" + std::to_string(getpid()) + "_";
    auto pids = start_workers("fsdp_hybrid_twice", world, world, free_port(), out);
    for (int r = 0; r < world; ++r) EXPECT_EQ(wait_exit(pids[r]), 0) << "rank " << r << ": " << slurp(out + std::to_string(r));
    for (int r = 0; r < world; ++r) {
      std::istringstream said(slurp(out + std::to_string(r)));
      std::string first, second, keys;
      std::getline(said, first);
      std::getline(said, second);
      std::getline(said, keys);
      EXPECT_EQ(first.substr(6), second.substr(7)) << "W=" << world << " rank " << r << ": the second instance trained otherwise";
      int64_t before = -1, between = -2, after = -3;
      std::istringstream(keys.substr(5)) >> before >> between >> after;
      EXPECT_EQ(before, between) << "W=" << world << ": the first instance left store keys";
      EXPECT_EQ(before, after) << "W=" << world << ": the second instance left store keys";
      std::remove((out + std::to_string(r)).c_str());
    }
  }
}

TEST(Processes, MissingPeerTimesOutAtRendezvous) {
  const std::string out = "/tmp/ddpkit_pt_missing_" + std::to_string(getpid()) + "_";
  const auto t0 = std::chrono::steady_clock::now();
  auto pids = start_workers("missing_peer", 2, 1, free_port(), out);  // rank 1 never starts
  EXPECT_EQ(wait_exit(pids[0]), 42) << slurp(out + "0");
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(seconds, 30);
  EXPECT_THAT(slurp(out + "0"), ::testing::HasSubstr("rank 0 of 2"));
  std::remove((out + "0").c_str());
}

TEST(PeakMemorySampler, CountsPagesSharedWithAnotherProcessInProportion) {
  constexpr size_t kBytes = 64 << 20;
  const int fd = memfd_create("ddpkit-test-pss", MFD_CLOEXEC);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, kBytes), 0);
  auto* shared = static_cast<char*>(mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
  ASSERT_NE(shared, MAP_FAILED);
  std::memset(shared, 1, kBytes);
  int ready[2], release[2];
  ASSERT_EQ(pipe(ready), 0);
  ASSERT_EQ(pipe(release), 0);
  const pid_t child = fork();
  if (child == 0) {  // maps every page of the segment too, then waits
    volatile char sum = 0;
    for (size_t i = 0; i < kBytes; i += 4096) sum = static_cast<char>(sum + shared[i]);
    char c = 1;
    if (write(ready[1], &c, 1) != 1 || read(release[0], &c, 1) != 1) _exit(2);
    _exit(0);
  }
  ASSERT_GT(child, 0);
  char c = 0;
  ASSERT_EQ(read(ready[0], &c, 1), 1);
  PeakMemorySampler sampler(std::chrono::milliseconds(5));
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  sampler.stop();
  const MemoryCounts now = read_memory_counts(true);
  ASSERT_EQ(write(release[1], &c, 1), 1);
  EXPECT_EQ(wait_exit(child), 0);
  EXPECT_GE(now.shmem, static_cast<int64_t>(kBytes)) << "the segment is resident here";
  EXPECT_GE(now.rss - sampler.peak_pss_bytes(), static_cast<int64_t>(kBytes) * 45 / 100)
      << "half of the segment is the other process's";
  EXPECT_GE(sampler.peak_pss_bytes(), now.pss) << "anonymous pages count in full, so never below PSS";
  EXPECT_GE(sampler.pss_reads(), 2);
  munmap(shared, kBytes);
  close(fd);
  for (int f : {ready[0], ready[1], release[0], release[1]}) close(f);
}

TEST(PeakMemorySampler, SharedMemoryMadeForPeersCountsInFullForItsMaker) {
  // Reserved pages are allocated though no process has touched them: RSS and PSS leave them out.
  constexpr size_t kBytes = 48 << 20;
  const int fd = memfd_create("ddpkit-test-owned", MFD_CLOEXEC);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, kBytes), 0);
  ASSERT_EQ(posix_fallocate(fd, 0, kBytes), 0);
  void* p = mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ASSERT_NE(p, MAP_FAILED);
  const MemoryCounts before = read_memory_counts(false);
  note_owned_shared_memory(p, kBytes, /*reserved=*/true);
  const MemoryCounts after = read_memory_counts(false);
  EXPECT_EQ(after.owned_shared - before.owned_shared, static_cast<int64_t>(kBytes));
  EXPECT_LT(after.rss - before.rss, static_cast<int64_t>(kBytes) / 8) << "untouched: not resident here";
  PeakMemorySampler sampler(std::chrono::milliseconds(5));
  sampler.stop();
  EXPECT_GE(sampler.peak_pss_bytes(), after.anon + static_cast<int64_t>(kBytes));
  forget_owned_shared_memory(p);
  EXPECT_EQ(read_memory_counts(false).owned_shared, before.owned_shared);
  munmap(p, kBytes);
  close(fd);
}

TEST(PeakMemorySampler, APeakBetweenPollsIsNotMissed) {
  std::ofstream("/proc/self/clear_refs") << "5";  // VmHWM back to the present resident size
  PeakMemorySampler sampler(std::chrono::hours(1));  // no poll while it runs
  const int64_t before = sampler.peak_pss_bytes();
  constexpr size_t kBytes = 96 << 20;
  void* p = mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(p, MAP_FAILED);
  std::memset(p, 1, kBytes);
  munmap(p, kBytes);
  sampler.stop();
  EXPECT_GE(sampler.peak_pss_bytes() - before, static_cast<int64_t>(kBytes) * 9 / 10);
  EXPECT_THROW(PeakMemorySampler(std::chrono::milliseconds(0)), c10::Error);
}

TEST(LargeBlockCache, ReusesItsOwnSizeThenCutsTheSmallestLargerBlock) {
  constexpr size_t MB = 1 << 20;
  LargeBlockCache cache(MB, 64 * MB);
  EXPECT_FALSE(cache.serves(MB - 1));
  EXPECT_TRUE(cache.serves(MB));
  void* three = cache.take(3 * MB);
  void* five = cache.take(5 * MB);
  ASSERT_TRUE(three && five);
  std::memset(three, 1, 3 * MB);
  std::memset(five, 2, 5 * MB);
  EXPECT_TRUE(cache.give_back(three));
  EXPECT_EQ(cache.take(3 * MB - 100), three) << "the same page-rounded size is the kept block";
  EXPECT_TRUE(cache.give_back(three));
  EXPECT_TRUE(cache.give_back(five));
  EXPECT_EQ(cache.stats().idle_bytes, 8 * MB);
  EXPECT_EQ(cache.take(2 * MB), three) << "the smallest larger kept block";
  const LargeBlockCache::Stats s = cache.stats();
  EXPECT_EQ(s.mapped_bytes, 7 * MB) << "its last MB unmapped";
  EXPECT_EQ(s.idle_bytes, 5 * MB);
  EXPECT_EQ(s.mapped, 2);
  EXPECT_EQ(s.reused, 2);
  std::memset(three, 3, 2 * MB);
  int on_stack = 0;
  EXPECT_FALSE(cache.give_back(&on_stack)) << "not the cache's";
  EXPECT_TRUE(cache.give_back(three));
  EXPECT_FALSE(cache.give_back(three)) << "given back twice";
}

TEST(LargeBlockCache, KeepsNoMoreThanItsIdleLimitOldestGoingFirst) {
  constexpr size_t MB = 1 << 20;
  LargeBlockCache cache(MB, 5 * MB);
  void* a = cache.take(2 * MB);
  void* b = cache.take(2 * MB);
  void* c = cache.take(2 * MB);
  for (void* p : {a, b, c}) EXPECT_TRUE(cache.give_back(p));
  LargeBlockCache::Stats s = cache.stats();
  EXPECT_EQ(s.idle_bytes, 4 * MB);
  EXPECT_EQ(s.unmapped, 1);
  EXPECT_EQ(s.mapped_bytes, 4 * MB);
  EXPECT_EQ(cache.take(2 * MB), c) << "the most recently kept of a size first";
  EXPECT_EQ(cache.take(2 * MB), b);
  cache.give_back(b);
  cache.release_idle();
  s = cache.stats();
  EXPECT_EQ(s.idle_bytes, 0u);
  EXPECT_EQ(s.mapped_bytes, 2 * MB) << "c is still out";
  cache.give_back(c);
}

// Installed by tune_allocator_for_training, in front of libtorch's allocator and behind DDP's
// gradient arena: large tensors come back at the same address, raw allocations free either way,
// and a DDP job computes the same gradients as without it.
TEST(Processes, LargeBlockCacheServesLibtorchAndDdpGradientsAreUnchanged) {
  const std::string out = "/tmp/ddpkit_pt_cache_" + std::to_string(getpid()) + "_";
  std::vector<std::string> gradients;
  for (const char* tuning : {"1", "0"}) {
    setenv("DDPKIT_MALLOC_TUNING", tuning, 1);
    auto pids = start_workers("cached_train", 2, 2, free_port(), out);
    unsetenv("DDPKIT_MALLOC_TUNING");
    for (pid_t p : pids) EXPECT_EQ(wait_exit(p), 0) << slurp(out + "0") << slurp(out + "1");
    EXPECT_EQ(slurp(out + "0"), slurp(out + "1"));
    gradients.push_back(slurp(out + "0"));
  }
  EXPECT_THAT(gradients[0], ::testing::HasSubstr("cache on"));
  EXPECT_THAT(gradients[1], ::testing::HasSubstr("cache off"));
  EXPECT_EQ(gradients[0].substr(gradients[0].find('\n')), gradients[1].substr(gradients[1].find('\n')));
  for (int r = 0; r < 2; ++r) std::remove((out + std::to_string(r)).c_str());
}

// ddpkit's CPU allocator asks the thread's gradient arena before the large block cache, whichever
// of them came first: here the arena is in use before tune_allocator_for_training puts the cache in.
TEST(Processes, GradientArenaComesBeforeTheCacheInstalledAfterIt) {
  const std::string out = "/tmp/ddpkit_pt_order_" + std::to_string(getpid()) + "_";
  auto pids = start_workers("arena_then_cache", 1, 1, free_port(), out);
  EXPECT_EQ(wait_exit(pids[0]), 0) << slurp(out + "0");
  EXPECT_EQ(slurp(out + "0"), "ok");
  std::remove((out + "0").c_str());
}

// ---- workers -------------------------------------------------------------------------------------
int cached_train_worker() {
  const AllocatorTuning tuning = tune_allocator_for_training();
  set_compute_threads(1);
  std::ofstream out(std::getenv("DDPKIT_TEST_OUT"));
  LargeBlockCache* cache = installed_large_block_cache();
  if (tuning.large_block_cache != (cache != nullptr)) {
    out << "tune_allocator_for_training said " << tuning.large_block_cache << " of an installed cache";
    return 1;
  }
  out << (cache ? "cache on" : "cache off") << "\n";
  if (cache) {
    const void* first = at::empty({1 << 20}).data_ptr();  // 4 MB, freed at once
    if (at::empty({1 << 20}).data_ptr() != first) {
      out << "a 4 MB tensor freed and made again was not its kept block";
      return 1;
    }
    c10::Allocator* cpu = c10::GetCPUAllocator();
    for (size_t n : {size_t{64}, size_t{8} << 20}) cpu->raw_deallocate(cpu->raw_allocate(n));
  }
  try {
    auto pg = init_process_group(InitOptions().timeout(std::chrono::seconds(60)));
    torch::manual_seed(5);
    auto model = std::make_shared<torch::nn::LinearImpl>(1024, 768);  // a 3 MB gradient
    DistributedDataParallel<std::shared_ptr<torch::nn::LinearImpl>> ddp(model, pg);
    for (int step = 0; step < 3; ++step) {
      for (auto& p : model->parameters()) p.mutable_grad() = at::Tensor();
      torch::manual_seed(100 * step + pg->rank());
      ddp.forward(at::randn({8, 1024})).pow(2).sum().backward();
      for (auto& p : model->parameters()) out << p.grad().sum().item<double>() << "\n";
    }
    if (cache && cache->stats().reused == 0) {
      out << "the cache reused no block";
      return 1;
    }
    return 0;
  } catch (const std::exception& e) {
    out << e.what();
    return 1;
  }
}

// An arena with one 4 MB place, used on this thread; then the cache; each block from its stage.
int arena_then_cache_worker() {
  std::ofstream out(std::getenv("DDPKIT_TEST_OUT"));
  unsetenv("MALLOC_MMAP_THRESHOLD_");  // either would keep the cache out
  unsetenv("DDPKIT_MALLOC_TUNING");
  constexpr size_t kBlock = size_t{4} << 20;
  auto memory = std::shared_ptr<void>(std::malloc(2 * kBlock), &std::free);
  auto arena = std::make_shared<GradientArena>(memory, static_cast<uint8_t*>(memory.get()), 2 * kBlock,
                                               std::vector<GradientArena::Place>{{kBlock, 0}});
  GradientArena::use(arena);
  at::Tensor in_arena = at::empty({static_cast<int64_t>(kBlock / 4)});
  if (!arena->contains(in_arena.data_ptr())) return out << "the arena did not serve its size", 1;
  const AllocatorTuning tuning = tune_allocator_for_training();
  LargeBlockCache* cache = installed_large_block_cache();
  if (!tuning.large_block_cache || !cache) return out << "no cache after an arena was in use", 1;
  // The arena's one place is out: the same size goes on to the cache.
  at::Tensor in_cache = at::empty({static_cast<int64_t>(kBlock / 4)});
  if (arena->contains(in_cache.data_ptr()) || cache->stats().mapped_bytes < kBlock)
    return out << "the second 4 MB block did not come from the cache", 1;
  const void* place = in_arena.data_ptr();
  in_arena = at::Tensor();
  if (at::empty({static_cast<int64_t>(kBlock / 4)}).data_ptr() != place)
    return out << "the freed place was not served again before the cache's kept block", 1;
  // raw_allocate's blocks, each stage's and the default's, freed through raw_deleter.
  c10::Allocator* cpu = c10::GetCPUAllocator();
  void* from_arena = cpu->raw_allocate(kBlock);
  if (!arena->contains(from_arena)) return out << "raw_allocate did not go to the arena", 1;
  for (size_t n : {size_t{64}, size_t{8} << 20}) cpu->raw_deallocate(cpu->raw_allocate(n));
  cpu->raw_deallocate(from_arena);
  if (arena->bytes_in_use() != 0) return out << "raw_deallocate did not give the arena its place back", 1;
  GradientArena::use(nullptr);
  if (arena->contains(at::empty({static_cast<int64_t>(kBlock / 4)}).data_ptr()))
    return out << "the arena served a thread that no longer uses it", 1;
  out << "ok";
  return 0;
}

// The profile's replicas in lockstep (plan::StepBarrier): a worker process joins the parent's
// barrier by address and records, per round, when it arrived and when it left.
constexpr int kBarrierRounds = 20;

double monotonic_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Arrives after a nap that differs by party and round, so each round someone else is last.
std::vector<std::pair<double, double>> meet(plan::StepBarrier& barrier, int party) {
  std::vector<std::pair<double, double>> times;
  for (int k = 0; k < kBarrierRounds; ++k) {
    std::this_thread::sleep_for(std::chrono::microseconds(300 * ((k + party) % 4)));
    const double arrived = monotonic_ms();
    barrier.arrive_and_wait();
    times.emplace_back(arrived, monotonic_ms());
  }
  return times;
}

int step_barrier_worker() {
  std::ofstream out(std::getenv("DDPKIT_TEST_OUT"));
  plan::StepBarrier barrier(std::string(std::getenv("DDPKIT_TEST_BARRIER")));
  for (const auto& t : meet(barrier, std::atoi(std::getenv("RANK")) + 1))
    out << std::setprecision(17) << t.first << " " << t.second << "\n";
  out.flush();
  // The parent meets no more: this wait ends in an error, not a hang.
  try {
    barrier.arrive_and_wait(nullptr, std::chrono::seconds(1));
  } catch (const std::exception& e) {
    out << e.what();
    return 42;
  }
  return 1;
}

TEST(Processes, StepBarrierHoldsEveryPartyUntilTheLastArrives) {
  plan::StepBarrier barrier(3);
  const std::string prefix = ::testing::TempDir() + "step_barrier_" + std::to_string(getpid()) + "_";
  setenv("DDPKIT_TEST_BARRIER", barrier.address().c_str(), 1);
  const auto pids = start_workers("step_barrier", 2, 2, 0, prefix);
  unsetenv("DDPKIT_TEST_BARRIER");
  std::vector<std::vector<std::pair<double, double>>> parties{meet(barrier, 0)};
  std::vector<std::string> errors;
  for (size_t r = 0; r < pids.size(); ++r) {
    EXPECT_EQ(wait_exit(pids[r]), 42);
    std::istringstream in(slurp(prefix + std::to_string(r)));
    std::vector<std::pair<double, double>> times(kBarrierRounds);
    for (auto& t : times) in >> t.first >> t.second;
    parties.push_back(times);
    std::string rest;
    std::getline(in >> std::ws, rest);
    errors.push_back(rest);
    std::remove((prefix + std::to_string(r)).c_str());
  }
  for (int k = 0; k < kBarrierRounds; ++k) {
    double last_arrival = 0, first_departure = 1e300;
    for (const auto& p : parties) {
      last_arrival = std::max(last_arrival, p[k].first);
      first_departure = std::min(first_departure, p[k].second);
    }
    EXPECT_LE(last_arrival, first_departure) << "round " << k << ": a party left before the last arrived";
  }
  for (const auto& e : errors) EXPECT_THAT(e, ::testing::HasSubstr("stopped meeting at the end of backward"));
}

TEST(Processes, AStoppedReplicaLeavesTheStepBarrier) {
  plan::StepBarrier barrier(2);
  std::atomic<bool> stop{false};
  std::thread stopper([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    stop = true;
  });
  EXPECT_FALSE(barrier.arrive_and_wait(&stop));
  stopper.join();
  EXPECT_THROW(plan::StepBarrier("not an address"), std::exception);
}

// Issue 52: a FullyShardedDataParallel with the default hybrid groups, trained, destroyed and built
// again in one job over TCPStore (a reload into a fresh instance). Writes each instance's losses
// and the store's key count before, between and after; rank 0 comes late to the second.
int fsdp_hybrid_twice_worker() {
  set_compute_threads(1);
  std::ofstream out(std::getenv("DDPKIT_TEST_OUT"));
  try {
    auto pg = init_process_group(InitOptions().timeout(std::chrono::seconds(20)));
    auto train = [&] {
      torch::manual_seed(3);
      auto seq = torch::nn::Sequential(torch::nn::Linear(16, 32), torch::nn::Functional(torch::relu),
                                       torch::nn::Linear(32, 16), torch::nn::Linear(16, 4));
      FullyShardedDataParallel<torch::nn::Sequential> fsdp(
          seq, pg,
          FullyShardedDataParallelOptions().sharding_strategy(ShardingStrategy::kHybridShard).auto_wrap_policy(
              size_based_auto_wrap_policy(100)));
      torch::optim::SGD opt(fsdp.parameters(), 0.1);
      std::ostringstream losses;
      for (int step = 0; step < 3; ++step) {
        opt.zero_grad();
        at::Tensor loss = fsdp.forward(testing::seeded_randn({4, 16}, 100 * step + pg->rank())).pow(2).mean();
        loss.backward();
        opt.step();
        losses << std::setprecision(9) << loss.item<double>() << " ";
      }
      return losses.str();
    };
    auto keys = [&] {  // once every rank is here, and before any goes on
      ProcessGroup::wait(pg->barrier());
      const int64_t n = pg->store()->getNumKeys();
      ProcessGroup::wait(pg->barrier());
      return n;
    };
    const int64_t before = keys();
    const std::string first = train();
    const int64_t between = keys();
    if (pg->rank() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(500));
    const std::string second = train();
    const int64_t after = keys();
    out << "first " << first << "\nsecond " << second << "\nkeys " << before << " " << between << " " << after << "\n";
    return 0;
  } catch (const std::exception& e) {
    out << e.what();
    return 1;
  }
}

int worker(const std::string& role) {
  if (role == "step_barrier") return step_barrier_worker();
  if (role == "cached_train") return cached_train_worker();
  if (role == "arena_then_cache") return arena_then_cache_worker();
  if (role == "fsdp_hybrid_twice") return fsdp_hybrid_twice_worker();
  set_compute_threads(1);
  std::ofstream out(std::getenv("DDPKIT_TEST_OUT"));
  const auto timeout = std::chrono::seconds(role == "missing_peer" ? 3 : kKilledPeerTimeoutS);
  try {
    auto pg = init_process_group(InitOptions().timeout(timeout));
    torch::manual_seed(11 + pg->rank());
    auto model = std::make_shared<torch::nn::LinearImpl>(64, 64);
    DistributedDataParallel<std::shared_ptr<torch::nn::LinearImpl>> ddp(model, pg);
    for (int step = 0; step < 1000; ++step) {
      if (step == 0 && role != "missing_peer" && !pg->uses_shared_memory()) {
        out << "ranks on one host should use shared memory";
        return 1;
      }
      if (pg->rank() == 2 && step == 3) {
        std::cout.flush();
        if (role == "killed_peer") _exit(9);
        if (role == "sigkill_peer") raise(SIGKILL);
        if (role == "sigstop_peer") raise(SIGSTOP);
      }
      for (auto& p : model->parameters()) p.mutable_grad() = at::Tensor();
      ddp.forward(at::randn({4, 64})).sum().backward();
      if (role == "train" && step == 5) {
        for (auto& p : model->parameters()) out << p.grad().sum().item<double>() << "\n";
        return 0;
      }
    }
    out << "finished without error";
    return 1;
  } catch (const CommError& e) {
    out << e.what();
    return 42;
  } catch (const std::exception& e) {
    out << "not a CommError: " << e.what();
    return 1;
  }
}

}  // namespace
}  // namespace ddpkit

int main(int argc, char** argv) {
  if (const char* role = std::getenv("DDPKIT_TEST_WORKER")) return ddpkit::worker(role);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
