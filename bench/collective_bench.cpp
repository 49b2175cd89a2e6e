// Collective bandwidth through ddpkit::ProcessGroup (Gloo), ranks as threads over a HashStore,
// printed like nccl-tests:
//
//   build/collective_bench [--ranks N] [--reps R] [--gloo-threads T]
//
// algbw = bytes / time. busbw = algbw * 2(n-1)/n for allreduce (the bytes each rank must send and
// receive in an optimal ring), algbw * (n-1)/n for allgather/alltoall/reduce-scatter (bytes: the
// whole gathered output, or the whole reduce-scatter input). Each row: median of R reps. With
// libtorch >= 2.2 it adds Gloo's own _reduce_scatter_base/_allgather_base rows.
#include <ddpkit/ddpkit.h>

#include <ATen/Parallel.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <thread>

using namespace ddpkit;

int main(int argc, char** argv) {
  int world = 2, reps = 7, gloo_threads = 2;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--ranks")) world = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--reps")) reps = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--gloo-threads")) gloo_threads = std::atoi(argv[i + 1]);
    else {
      std::fprintf(stderr, "usage: collective_bench [--ranks N] [--reps R] [--gloo-threads T]\n");
      return 2;
    }
  }
  tune_allocator_for_training();  // as ddpkit's programs do
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::printf("# ddpkit collectives over Gloo, %d ranks as threads, %d Gloo threads, median of %d\n", world,
              gloo_threads, reps);
  std::printf("# libtorch %s; busbw factor: allreduce 2(n-1)/n, allgather/alltoall/reduce_scatter (n-1)/n\n", TORCH_VERSION);
  std::printf("%-34s %12s %10s %10s %10s\n", "op", "bytes", "time_ms", "algbw_GB/s", "busbw_GB/s");
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      at::set_num_threads(1);
      auto pg = std::make_shared<ProcessGroup>(
          store, r, world, ProcessGroupOptions().gloo_hostname("127.0.0.1").gloo_threads(gloo_threads).two_phase_min_bytes(1));
      auto ring = std::make_shared<ProcessGroup>(store, r, world,
                                                 ProcessGroupOptions()
                                                     .gloo_hostname("127.0.0.1")
                                                     .gloo_threads(gloo_threads)
                                                     .group_name("ring")
                                                     .two_phase_min_bytes(0));
      auto multi = std::make_shared<ProcessGroup>(store, r, world,
                                                  ProcessGroupOptions()
                                                      .gloo_hostname("127.0.0.1")
                                                      .gloo_threads(gloo_threads)
                                                      .group_name("multi")
                                                      .gloo_connections(2));
      auto run = [&](const char* name, int64_t bytes, double bus_factor, const std::function<void()>& op) {
        op();
        std::vector<double> ms;
        for (int i = 0; i < reps; ++i) {
          ProcessGroup::wait(pg->barrier());
          const auto t0 = std::chrono::steady_clock::now();
          op();
          ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
        }
        std::sort(ms.begin(), ms.end());
        const double t = ms[ms.size() / 2], alg = bytes / (t * 1e6);
        if (r == 0) std::printf("%-34s %12lld %10.2f %10.2f %10.2f\n", name, static_cast<long long>(bytes), t, alg, alg * bus_factor);
      };
      const double n = world;
      for (int64_t elems : {int64_t(1) << 18, int64_t(1) << 22, int64_t(25) << 20}) {
        at::Tensor f = at::ones({elems}), h = at::ones({elems}, at::kHalf), b = at::ones({elems}, at::kBFloat16);
        at::Tensor out = at::empty({elems});
        std::vector<at::Tensor> gathered;
        for (int k = 0; k < world; ++k) gathered.push_back(at::empty({elems / world}));
        run("allreduce fp32 (gloo ring)", elems * 4, 2 * (n - 1) / n, [&] { ProcessGroup::wait(ring->allreduce(f)); });
        run("allreduce fp32 (ring, 2 connections)", elems * 4, 2 * (n - 1) / n, [&] { ProcessGroup::wait(multi->allreduce(f)); });
        run("allreduce fp32 (two-phase alltoall)", elems * 4, 2 * (n - 1) / n, [&] { ProcessGroup::wait(pg->allreduce(f)); });
        run("allreduce fp16 (two-phase alltoall)", elems * 2, 2 * (n - 1) / n, [&] { ProcessGroup::wait(pg->allreduce(h)); });
        run("allreduce bf16 (two-phase alltoall)", elems * 2, 2 * (n - 1) / n, [&] { ProcessGroup::wait(pg->allreduce(b)); });
        run("alltoall fp32", elems * 4, (n - 1) / n, [&] { ProcessGroup::wait(pg->alltoall(out, f)); });
        // Gloo's own collectives, called on the backend directly (barrier first, so they are not
        // issued while the sequencer still has work), beside ddpkit's paths.
        auto native = [&](const std::function<c10::intrusive_ptr<c10d::Work>()>& op) {
          ProcessGroup::wait(ring->barrier());
          op()->wait(ring->timeout());
        };
        at::Tensor piece = f.narrow(0, 0, elems / world);
        run("allgather fp32 (ddpkit)", elems * 4, (n - 1) / n,
            [&] { ProcessGroup::wait(pg->allgather(gathered, piece)); });
        run("allgather fp32 (gloo list)", elems * 4, (n - 1) / n, [&] {
          native([&] {
            std::vector<std::vector<at::Tensor>> out{gathered};
            std::vector<at::Tensor> in{piece};
            c10d::AllgatherOptions o;
            o.timeout = ring->timeout();
            return ring->backend().allgather(out, in, o);
          });
        });
        // reduce-scatter: elems in, elems/world out per rank; busbw (n-1)/n of the input.
        at::Tensor shard = at::empty({elems / world});
        run("reduce_scatter fp32 (ddpkit)", elems * 4, (n - 1) / n,
            [&] { ProcessGroup::wait(pg->reduce_scatter(shard, f)); });
#if DDPKIT_GLOO_HAS_BASE_COLLECTIVES
        run("reduce_scatter fp32 (gloo _base)", elems * 4, (n - 1) / n, [&] {
          native([&] {
            c10d::ReduceScatterOptions o;
            o.timeout = ring->timeout();
            return ring->backend()._reduce_scatter_base(shard, f, o);
          });
        });
        at::Tensor flat_out = at::empty({elems});
        run("allgather fp32 (gloo _base)", elems * 4, (n - 1) / n, [&] {
          native([&] {
            c10d::AllgatherOptions o;
            o.timeout = ring->timeout();
            return ring->backend()._allgather_base(flat_out, piece, o);
          });
        });
#endif
      }
    });
  }
  for (auto& t : threads) t.join();
  return 0;
}
