// Collective bandwidth through ddpkit::ProcessGroup, ranks as threads over a HashStore, printed
// like nccl-tests:
//
//   build/collective_bench [--ranks N] [--reps R] [--gloo-threads T] [--max-mb M] [--gloo-variants]
//
// The main table runs each collective at 1 KB .. M MB (default 100) twice in one run: through
// shared memory (the default on one host) and over Gloo's loopback TCP (shared_memory off), and
// prints both times, both bus bandwidths and the speedup. --gloo-variants adds the older table of
// Gloo paths (ring, two connections, two-phase alltoall, Gloo's own allgather/_base collectives).
// Rows "allreduce bucket", "allreduce parts" and "allreduce arena" are DDP's: a bucket from
// allreduce_buffer() summed in place; four gradient tensors reduced through it (allreduce_parts);
// the same four born in a GradientArena, as DDP's gradients are by default. Gloo's side runs the
// same calls on plain memory.
//
// algbw = bytes / time. busbw = algbw * 2(n-1)/n for allreduce (the bytes each rank must send and
// receive in an optimal ring), algbw * (n-1)/n for allgather/alltoall/reduce-scatter (bytes: the
// whole gathered output, or the whole reduce-scatter input) and broadcast. Each row: median of R
// reps, each rep preceded by a barrier.
//
// --processes --outer CODEC: DiLoCo's outer all-reduce across launched processes (e.g. one per
// network namespace of bench/diloco_sites.py's shaped switch), after idle links: its goodput.
#include <ddpkit/codecs/codec.h>
#include <ddpkit/ddpkit.h>
#include <ddpkit/diloco/outer_allreduce.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <thread>

using namespace ddpkit;

namespace {

double median_ms(ProcessGroup& sync, int reps, const std::function<void()>& op) {
  op();  // warm: workspaces, page faults
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    ProcessGroup::wait(sync.barrier());
    const auto t0 = std::chrono::steady_clock::now();
    op();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// Shared memory against Gloo loopback, each collective and size in turn (interleaved, so drift in
// this machine's speed hits both columns alike).
void shm_vs_gloo(int world, int reps, int gloo_threads, int64_t max_bytes) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::printf("# ddpkit collectives: shared memory vs Gloo loopback TCP, %d ranks as threads, median of %d\n", world, reps);
  std::printf("# libtorch %s; busbw factor: allreduce 2(n-1)/n, the others (n-1)/n\n", TORCH_VERSION);
  std::printf("%-16s %12s %10s %10s %10s %10s %8s\n", "op", "bytes", "gloo_ms", "shm_ms", "gloo_busbw", "shm_busbw",
              "speedup");
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      at::set_num_threads(1);
      auto options = ProcessGroupOptions().gloo_hostname("127.0.0.1").gloo_threads(gloo_threads);
      auto shm = std::make_shared<ProcessGroup>(store, r, world, ProcessGroupOptions(options).group_name("shm"));
      auto gloo = std::make_shared<ProcessGroup>(store, r, world,
                                                 ProcessGroupOptions(options).group_name("gloo").shared_memory(false));
      if (r == 0 && !shm->uses_shared_memory()) std::printf("# shared memory is off (DDPKIT_SHM=0?)\n");
      const double n = world;
      std::vector<int64_t> sizes;
      for (int64_t b = 1024; b < max_bytes; b *= 4) sizes.push_back(b);
      sizes.push_back(max_bytes);
      for (int64_t bytes : sizes) {
        const int64_t elems = bytes / 4 / world * world;
        at::Tensor f = at::ones({elems}), out = at::empty({elems}), shard = at::empty({elems / world});
        at::Tensor h = at::ones({elems}, at::kHalf);
        // A DDP bucket: on the shm side in memory every local rank maps, so it sums in place.
        at::Tensor bucket = shm->allreduce_buffer(elems, at::kFloat).fill_(1);
        // DDP's gradients: four tensors of their own, reduced through the bucket.
        // The same four born in a GradientArena (as DDP's are by default), read and written in place.
        std::vector<at::Tensor> grads, born_shared;
        std::vector<int64_t> sizes;
        for (int64_t at = 0, k = 0; k < 4; ++k) {
          const int64_t m = k < 3 ? elems / 4 : elems - at;
          grads.push_back(at::ones({m}));
          sizes.push_back(m * 4);
          at += m;
        }
        std::shared_ptr<GradientArena> arena = shm->gradient_arena(sizes);
        GradientArena::use(arena);
        for (const at::Tensor& g : grads) born_shared.push_back(at::ones_like(g));
        GradientArena::use(nullptr);
        std::vector<at::Tensor> gathered;
        for (int k = 0; k < world; ++k) gathered.push_back(at::empty({elems / world}));
        struct Row {
          const char* name;
          int64_t bytes;
          double factor;
          std::function<void(ProcessGroup&)> op;
        };
        const std::vector<Row> rows = {
            {"allreduce fp32", elems * 4, 2 * (n - 1) / n, [&](ProcessGroup& pg) { ProcessGroup::wait(pg.allreduce(f)); }},
            {"allreduce bucket", elems * 4, 2 * (n - 1) / n,
             [&](ProcessGroup& pg) { ProcessGroup::wait(pg.allreduce(&pg == shm.get() ? bucket : f)); }},
            {"allreduce parts", elems * 4, 2 * (n - 1) / n,
             [&](ProcessGroup& pg) { ProcessGroup::wait(pg.allreduce_parts(&pg == shm.get() ? bucket : f, grads)); }},
            {"allreduce arena", elems * 4, 2 * (n - 1) / n,
             [&](ProcessGroup& pg) {
               ProcessGroup::wait(&pg == shm.get() ? pg.allreduce_parts(bucket, born_shared) : pg.allreduce_parts(f, grads));
             }},
            {"allreduce fp16", elems * 2, 2 * (n - 1) / n, [&](ProcessGroup& pg) { ProcessGroup::wait(pg.allreduce(h)); }},
            {"broadcast", elems * 4, (n - 1) / n, [&](ProcessGroup& pg) { ProcessGroup::wait(pg.broadcast(f, 0)); }},
            {"allgather", elems * 4, (n - 1) / n,
             [&](ProcessGroup& pg) { ProcessGroup::wait(pg.allgather(gathered, shard)); }},
            {"reduce_scatter", elems * 4, (n - 1) / n,
             [&](ProcessGroup& pg) { ProcessGroup::wait(pg.reduce_scatter(shard, f)); }},
            {"alltoall", elems * 4, (n - 1) / n, [&](ProcessGroup& pg) { ProcessGroup::wait(pg.alltoall(out, f)); }},
        };
        for (const Row& row : rows) {
          const int row_reps = row.bytes >= (16 << 20) ? std::max(3, reps / 2) : reps;
          const double g = median_ms(*gloo, row_reps, [&] { row.op(*gloo); });
          const double s = median_ms(*shm, row_reps, [&] { row.op(*shm); });
          auto bw = [&](double ms) { return row.bytes / (ms * 1e6) * row.factor; };
          if (r == 0)
            std::printf("%-16s %12lld %10.3f %10.3f %10.2f %10.2f %7.2fx\n", row.name, static_cast<long long>(row.bytes),
                        g, s, bw(g), bw(s), g / s);
        }
      }
    });
  }
  for (auto& t : threads) t.join();
}

// One process per rank (torchrun variables; e.g. bench/netns_hierarchical.sh puts two ranks in
// each of two network namespaces). Checks that the group's default path (shared memory within a
// host; hierarchical allreduce across hosts) gives the bits flat Gloo gives, on integer data so
// every sum is exact, then times fp32 allreduce both ways, interleaved. Returns nonzero on a mismatch.
int processes(int reps, const std::vector<int64_t>& sizes_bytes) {
  auto pg = init_process_group(InitOptions().timeout(std::chrono::seconds(120)));
  const int rank = pg->rank(), world = pg->size();
  auto flat = std::make_shared<ProcessGroup>(pg->store(), rank, world,
                                             ProcessGroupOptions(pg->options()).group_name("flat").shared_memory(false));
  const auto& topo = pg->topology();
  if (rank == 0)
    std::printf("# %d ranks on %d host(s), %d per host; default group: %s\n", world, topo.hosts(), topo.local_size(),
                pg->hierarchical() ? "hierarchical (shared memory within hosts, Gloo across)"
                                   : pg->uses_shared_memory() ? "shared memory" : "Gloo only");
  int mismatches = 0;
  for (auto dt : {at::kFloat, at::kHalf, at::kBFloat16})
    for (int64_t n : {int64_t(0), int64_t(1), int64_t(7), int64_t(4099), int64_t(100003), int64_t(1 << 20) + 3}) {
      auto gen = at::make_generator<at::CPUGeneratorImpl>(rank * 7919 + n);
      at::Tensor a = at::randint(-50, 50, {n}, gen).to(dt), b = a.clone();
      ProcessGroup::wait(pg->allreduce(a));
      ProcessGroup::wait(flat->allreduce(b));
      if (!at::equal(a.view(at::kByte), b.view(at::kByte))) {
        std::fprintf(stderr, "rank %d: allreduce of %lld %s differs from flat Gloo\n", rank, static_cast<long long>(n),
                     c10::toString(dt));
        ++mismatches;
      }
    }
  if (rank == 0) std::printf("# equal to flat Gloo (fp32/fp16/bf16, 0..1M elements): %s\n", mismatches ? "NO" : "yes");
  if (rank == 0) std::printf("%12s %10s %10s %8s\n", "bytes", "flat_ms", "default_ms", "ratio");
  for (int64_t bytes : sizes_bytes) {
    at::Tensor t = at::ones({bytes / 4});
    std::vector<double> f, d;
    for (int i = 0; i <= reps; ++i) {  // the first round warms up
      const double fm = median_ms(*flat, 1, [&] { ProcessGroup::wait(flat->allreduce(t)); });
      const double dm = median_ms(*pg, 1, [&] { ProcessGroup::wait(pg->allreduce(t)); });
      if (i) f.push_back(fm), d.push_back(dm);
    }
    std::sort(f.begin(), f.end());
    std::sort(d.begin(), d.end());
    if (rank == 0)
      std::printf("%12lld %10.3f %10.3f %7.2fx\n", static_cast<long long>(t.numel() * 4), f[f.size() / 2], d[d.size() / 2],
                  d[d.size() / 2] / f[f.size() / 2]);
  }
  ProcessGroup::wait(pg->barrier());
  return mismatches ? 1 : 0;
}

// DiLoCo's outer all-reduce (diloco::weighted_mean: reduce-scatter, fp32 accumulate, all-gather)
// of `values` float32 in `codec` across the launched ranks, each rep after the links sat idle for
// `idle_s` (a round's inner steps: Linux's tcp_slow_start_after_idle restarts a connection idle
// for more than its RTO from a 10-segment window). Per size: the bytes a rank sends (the layout's
// count: 2(n-1)/n of the encoded values plus 16 B a chunk), the slowest rank's median time, busbw
// = those bytes / time, and goodput = busbw over the link's rate (--rate-mbit; 0 leaves it out).
int outer_sync(int reps, const std::vector<int64_t>& sizes_bytes, const std::string& codec_name, double idle_s,
               double rate_mbit, int gloo_threads, double piece_mb, int connections) {
  auto pg = init_process_group(InitOptions()
                                   .timeout(std::chrono::seconds(300))
                                   .gloo_threads(gloo_threads)
                                   .gloo_connections(connections)
                                   .piece_bytes(static_cast<int64_t>(piece_mb * (1 << 20))));
  const int rank = pg->rank(), world = pg->size();
  const auto codec = codecs::make_codec(codec_name);
  int slow_start = -1;
  if (FILE* f = std::fopen("/proc/sys/net/ipv4/tcp_slow_start_after_idle", "r")) {
    if (std::fscanf(f, "%d", &slow_start) != 1) slow_start = -1;
    std::fclose(f);
  }
  if (rank == 0) {
    std::printf("# outer all-reduce (%s) across %d ranks, %.1f s idle before each of %d reps (+1 warm-up); "
                "tcp_slow_start_after_idle=%d here; %d Gloo threads, %d connection(s) a peer, pieces of %.2f MiB a peer\n",
                codec_name.c_str(), world, idle_s, reps, slow_start, gloo_threads, connections, piece_mb);
    std::printf("%12s %12s %12s %10s %12s %8s\n", "values", "encoded_B", "sent_B/rank", "time_ms", "busbw_MB/s",
                "goodput");
  }
  for (int64_t bytes : sizes_bytes) {
    const int64_t n = bytes / 4;
    at::Tensor values = at::randn({n});
    const auto layout = diloco::outer_allreduce_layout(n, world, *codec,
        pg->pieces_for(static_cast<uint64_t>(codec->encoded_bytes(n)) * (world - 1) / world));
    std::vector<double> slowest;
    for (int i = 0; i <= reps; ++i) {
      ProcessGroup::wait(pg->barrier());
      std::this_thread::sleep_for(std::chrono::duration<double>(i ? idle_s : 0.0));
      const auto t0 = std::chrono::steady_clock::now();
      ProcessGroup::wait(diloco::weighted_mean(pg.get(), values, 1.0f, codec));
      const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      at::Tensor times = at::zeros({world}, at::kDouble);
      times[rank] = ms;
      ProcessGroup::wait(pg->allreduce(times));
      if (i) slowest.push_back(times.max().item<double>());
    }
    std::sort(slowest.begin(), slowest.end());
    const double ms = slowest[slowest.size() / 2];
    const double busbw = layout.bytes_sent_per_rank / (ms * 1e3);  // MB/s
    if (rank == 0) {
      std::printf("%12lld %12lld %12lld %10.1f %12.2f ", static_cast<long long>(n),
                  static_cast<long long>(codec->encoded_bytes(n)), static_cast<long long>(layout.bytes_sent_per_rank),
                  ms, busbw);
      if (rate_mbit > 0) std::printf("%8.3f\n", busbw * 8 / rate_mbit);
      else std::printf("%8s\n", "-");
      std::fflush(stdout);
    }
  }
  ProcessGroup::wait(pg->barrier());
  return 0;
}

constexpr const char* kUsage =
    "usage: collective_bench [--ranks N] [--reps R] [--gloo-threads T] [--max-mb M] [--gloo-variants]\n"
    "       collective_bench --processes [--reps R] [--sizes-mb A,B,..]   (one process per rank, under a launcher:\n"
    "                                    ddpkit launch --nproc N, torchrun, srun; MiB, fractions allowed: 0.004 is ~4 KiB)\n"
    "       collective_bench --processes --outer CODEC [--idle-s S] [--rate-mbit R] [--reps R] [--sizes-mb A,B,..]\n"
    "                                    [--gloo-threads T] [--gloo-connections C] [--piece-mb M]\n"
    "                                    (DiLoCo's outer all-reduce after S idle seconds; goodput against R Mbit/s)\n";

int bench_main(int argc, char** argv) {
  int world = 2, reps = 7, gloo_threads = 2;
  int64_t max_mb = 100;
  bool variants = false, from_env = false;
  std::string outer;
  double idle_s = 0, rate_mbit = 0, piece_mb = 1;
  int connections = 1;
  std::vector<int64_t> sizes_bytes = {1 << 20, 25 << 20, 100 << 20};
  for (int i = 1; i < argc; ++i) {
    const bool has_value = i + 1 < argc;
    if (!std::strcmp(argv[i], "--ranks") && has_value) world = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--reps") && has_value) reps = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--gloo-threads") && has_value) gloo_threads = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--max-mb") && has_value) max_mb = std::atoll(argv[++i]);
    else if (!std::strcmp(argv[i], "--gloo-variants")) variants = true;
    else if (!std::strcmp(argv[i], "--processes")) from_env = true;
    else if (!std::strcmp(argv[i], "--outer") && has_value) outer = argv[++i];
    else if (!std::strcmp(argv[i], "--idle-s") && has_value) idle_s = std::atof(argv[++i]);
    else if (!std::strcmp(argv[i], "--rate-mbit") && has_value) rate_mbit = std::atof(argv[++i]);
    else if (!std::strcmp(argv[i], "--piece-mb") && has_value) piece_mb = std::atof(argv[++i]);
    else if (!std::strcmp(argv[i], "--gloo-connections") && has_value) connections = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--sizes-mb") && has_value) {
      sizes_bytes.clear();  // MiB, fractions allowed (0.004 is 4 KiB), at least one fp32 element
      for (char* p = argv[++i]; *p;) {
        const double mb = std::strtod(p, &p);
        sizes_bytes.push_back(mb * (1 << 20) >= 4 ? static_cast<int64_t>(mb * (1 << 20)) : -1);
        if (*p == ',') ++p;
        else if (*p) sizes_bytes.push_back(-1), p += std::strlen(p);
      }
    }
    else throw UsageError(std::string("unknown argument '") + argv[i] + "'" + (has_value ? "" : " (or a flag without its value)"));
  }
  if (world < 1 || reps < 1 || max_mb < 1 ||
      std::any_of(sizes_bytes.begin(), sizes_bytes.end(), [](int64_t b) { return b < 4; }))
    throw UsageError("--ranks, --reps and --max-mb must be positive integers, --sizes-mb positive numbers of MiB (at "
                     "least 4 bytes each)");
  if (from_env && !detect_launch_environment().found())
    throw UsageError("--processes runs one rank per process and finds no launcher's variables (RANK, WORLD_SIZE, "
                     "MASTER_ADDR, MASTER_PORT): start it as `ddpkit launch --nproc 2 collective_bench --processes`, "
                     "under torchrun or srun");
  if (idle_s < 0 || rate_mbit < 0 || piece_mb <= 0 || connections < 1)
    throw UsageError("--idle-s and --rate-mbit must be >= 0, --piece-mb > 0, --gloo-connections >= 1");
  if (!outer.empty() && !from_env) throw UsageError("--outer runs one rank per process: add --processes, under a launcher");
  tune_allocator_for_training();  // as ddpkit's programs do
  if (!outer.empty()) return outer_sync(reps, sizes_bytes, outer, idle_s, rate_mbit, gloo_threads, piece_mb, connections);
  if (from_env) return processes(reps, sizes_bytes);
  shm_vs_gloo(world, reps, gloo_threads, max_mb << 20);
  if (!variants) return 0;
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::printf("\n# Gloo paths, %d ranks as threads, %d Gloo threads, median of %d\n", world,
              gloo_threads, reps);
  std::printf("# libtorch %s; busbw factor: allreduce 2(n-1)/n, allgather/alltoall/reduce_scatter (n-1)/n\n", TORCH_VERSION);
  std::printf("%-34s %12s %10s %10s %10s\n", "op", "bytes", "time_ms", "algbw_GB/s", "busbw_GB/s");
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      at::set_num_threads(1);
      auto pg = std::make_shared<ProcessGroup>(
          store, r, world, ProcessGroupOptions().gloo_hostname("127.0.0.1").gloo_threads(gloo_threads).two_phase_min_bytes(1).shared_memory(false));
      auto ring = std::make_shared<ProcessGroup>(store, r, world,
                                                 ProcessGroupOptions()
                                                     .gloo_hostname("127.0.0.1")
                                                     .gloo_threads(gloo_threads)
                                                     .group_name("ring")
                                                     .two_phase_min_bytes(0)
                                                     .shared_memory(false));
      auto multi = std::make_shared<ProcessGroup>(store, r, world,
                                                  ProcessGroupOptions()
                                                      .gloo_hostname("127.0.0.1")
                                                      .gloo_threads(gloo_threads)
                                                      .group_name("multi")
                                                      .gloo_connections(2)
                                                      .shared_memory(false));
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
            return ring->with_backend([&](compat::Backend& b) { return b.allgather(out, in, o); });
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
            return ring->with_backend([&](compat::Backend& b) { return compat::reduce_scatter_single(b, shard, f, o); });
          });
        });
        at::Tensor flat_out = at::empty({elems});
        run("allgather fp32 (gloo _base)", elems * 4, (n - 1) / n, [&] {
          native([&] {
            c10d::AllgatherOptions o;
            o.timeout = ring->timeout();
            return ring->with_backend([&](compat::Backend& b) { return compat::all_gather_single(b, flat_out, piece, o); });
          });
        });
#endif
      }
    });
  }
  for (auto& t : threads) t.join();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return run_main("collective_bench", [&] { return bench_main(argc, argv); }, [] { return std::string(kUsage); });
}
