// Measurements for the cost model (include/ddpkit/plan/profile.h).
#include <ddpkit/plan/profile.h>

#include <ddpkit/codecs/quantize.h>
#include <ddpkit/comm/gradient_arena.h>
#include <ddpkit/comm/process_group.h>
#include <ddpkit/error.h>
#include <ddpkit/runtime/runtime.h>

#include "../comm/futex.h"
#include "../comm/peer_memory.h"

#include <ATen/Parallel.h>
#include <torch/version.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <malloc.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <ctime>
#include <mutex>
#include <thread>

namespace ddpkit {
namespace plan {

namespace {

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

double timed_median(const std::vector<double>& v) {
  DDPKIT_CHECK(!v.empty(), "plan: nothing was timed");
  return median(v);
}


void clear_grads(torch::nn::Module& m) {
  for (auto& p : m.parameters()) p.mutable_grad().reset();
}

struct StepTimes {
  std::vector<double> forward, backward, optimizer;
  std::vector<std::vector<double>> ready;  // per step, per parameter
};

// How run_steps steps a replica.
struct StepRun {
  int warmup = 0, steps = 0;
  // More steps than `steps` where they are short: the timed ones then span this long at least
  // (a few steps of a small model would sample one moment of a machine whose slow spells last
  // longer).
  double min_timed_ms = 0;
  bool record_ready = false;
  std::function<void()> after_backward;  // ProfileOptions::after_backward
};

StepTimes run_steps(ProfileTarget& t, const StepRun& run) {
  const bool record_ready = run.record_ready;
  StepTimes out;
  auto params = t.module->parameters();
  std::vector<double> ready(params.size(), 0);
  Clock::time_point backward_start;
  std::mutex mu;
  // The hooks capture this frame's locals: removed however run_steps leaves.
  struct Hooks {
    std::vector<std::pair<at::Tensor, unsigned>> added;
    ~Hooks() {
      for (auto& h : added) {
        try {
          h.first.remove_hook(h.second);
        } catch (...) {
        }
      }
    }
  } hooks;
  if (record_ready) {
    for (size_t k = 0; k < params.size(); ++k) {
      if (!params[k].requires_grad()) continue;
      // The gradient of parameter k is computed: backward has reached it.
      hooks.added.emplace_back(params[k], params[k].register_hook([&ready, &backward_start, &mu, k](const at::Tensor&) {
        std::lock_guard<std::mutex> lock(mu);
        ready[k] = ms_since(backward_start);
      }));
    }
  }
  int steps = run.steps;
  double warmup_ms = 0;
  for (int i = 0; i < run.warmup + steps; ++i) {
    clear_grads(*t.module);
    const auto t0 = Clock::now();
    at::Tensor loss = t.loss();
    const auto t1 = Clock::now();
    backward_start = t1;
    loss.backward();
    if (run.after_backward) run.after_backward();
    const auto t2 = Clock::now();
    t.optimizer_step();
    const auto t3 = Clock::now();
    if (i < run.warmup) {
      warmup_ms += std::chrono::duration<double, std::milli>(t3 - t0).count();
      if (i + 1 == run.warmup && run.min_timed_ms > 0 && warmup_ms > 0)
        steps = std::max(steps, std::min(500, static_cast<int>(std::ceil(run.min_timed_ms * run.warmup / warmup_ms))));
      continue;
    }
    out.forward.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
    out.backward.push_back(std::chrono::duration<double, std::milli>(t2 - t1).count());
    out.optimizer.push_back(std::chrono::duration<double, std::milli>(t3 - t2).count());
    if (record_ready) out.ready.push_back(ready);
  }
  return out;
}

}  // namespace

int64_t heap_in_use() {
  const struct mallinfo2 m = mallinfo2();
  return static_cast<int64_t>(m.uordblks + m.hblkhd);
}

ModelProfile profile_model(const std::function<ProfileTarget()>& make, const ProfileOptions& o) {
  DDPKIT_CHECK(o.steps >= 1 && o.warmup >= 0 && o.busy_replicas >= 1 && o.threads >= 1,
               "plan: profile needs steps >= 1, warmup >= 0, concurrent >= 1, threads >= 1");
  ModelProfile prof;
  prof.threads = o.threads;
  prof.concurrent = o.busy_replicas;
  const int saved_threads = at::get_num_threads();
  set_compute_threads(o.threads);  // OpenBLAS's pool too: replicas must not share one

  // Alone: the shapes, units and the heap a step needs for activations.
  {
    const int64_t rss_start = process_resources().anon_rss_bytes, heap_start = heap_in_use();
    ProfileTarget t = make();
    const auto params = t.module->parameters();
    std::map<const void*, int> unit_of;
    for (size_t u = 0; u < t.units.size(); ++u) {
      int64_t n = 0;
      for (const auto& p : t.units[u]->parameters()) {
        unit_of[p.unsafeGetTensorImpl()] = static_cast<int>(u);
        n += p.numel();
      }
      prof.unit_numel.push_back(n);
    }
    for (const auto& p : params) {
      ParamProfile pp;
      pp.numel = p.numel();
      pp.shape = p.sizes().vec();
      auto it = unit_of.find(p.unsafeGetTensorImpl());
      pp.unit = it == unit_of.end() ? -1 : it->second;
      prof.params.push_back(pp);
    }
    run_steps(t, StepRun{2, 0, 0, false, {}});  // optimizer state exists, workspaces are warm
    // What forward leaves for backward, and what backward holds beyond the gradients it has made
    // so far, looked at as each gradient is born (attention's backward, for one, needs more).
    int64_t before = 0, grads_so_far = 0, backward_extra = 0;
    for (auto& p : params)
      p.register_hook([&](const at::Tensor& g) {
        grads_so_far += g.numel() * static_cast<int64_t>(g.element_size());
        backward_extra = std::max(backward_extra, heap_in_use() - before - grads_so_far);
      });
    clear_grads(*t.module);
    before = heap_in_use();
    at::Tensor loss = t.loss();
    const int64_t forward_extra = heap_in_use() - before;
    loss.backward();
    // The anonymous resident memory the steps grew by (library code faulted in is not counted),
    // less the heap still in use (the model, its gradients and optimizer state): the peak of what
    // steps free again plus the allocator's fragments, both of which a rank's peak holds. (The
    // allocator keeps freed memory here: the CLI tunes it as training does.) Seen between gradient
    // births too, where the hooks are blind.
    const int64_t slack = (process_resources().anon_rss_bytes - rss_start) - (heap_in_use() - heap_start);
    prof.activation_bytes = std::max<int64_t>(0, std::max({forward_extra, backward_extra, slack}));
  }

  // Timed on a replica of its own, while the caller keeps the other cores as busy as the job will.
  ProfileTarget t = make();
  const StepTimes times = run_steps(t, StepRun{o.warmup, o.steps, o.min_timed_ms, true, o.after_backward});
  at::set_num_threads(saved_threads);
  prof.forward_ms = timed_median(times.forward);
  prof.backward_ms = timed_median(times.backward);
  prof.optimizer_ms = timed_median(times.optimizer);
  for (size_t k = 0; k < prof.params.size(); ++k) {
    std::vector<double> r;
    for (const auto& step : times.ready) r.push_back(step[k]);
    prof.params[k].grad_ready_ms = timed_median(r);
  }
  return prof;
}

void step_until(const std::function<ProfileTarget()>& make, int threads, const std::atomic<bool>& stop,
                const std::function<void()>& started, const std::function<void()>& after_backward) {
  set_compute_threads(threads);
  ProfileTarget t = make();
  run_steps(t, StepRun{1, 0, 0, false, {}});
  started();
  while (!stop.load()) run_steps(t, StepRun{1, 0, 0, false, after_backward});
}

struct StepBarrier::Shared {
  std::atomic<int> arrived;
  std::atomic<uint32_t> generation;  // a futex word: waiters sleep on it
  int parties;
};

StepBarrier::StepBarrier(int parties) {
  DDPKIT_CHECK(parties >= 1, "plan: a step barrier needs at least one party, got ", parties);
  void* base = nullptr;
  std::string error;
  fd_ = ddpkit::detail::create_peer_memory("ddpkit-plan-step-barrier", sizeof(Shared), &base, &error);
  DDPKIT_CHECK(fd_ >= 0, "plan: the replicas' step barrier: ", error);
  shared_ = new (base) Shared;
  shared_->arrived.store(0);
  shared_->generation.store(0);
  shared_->parties = parties;
  address_ = ddpkit::detail::peer_memory_address(fd_);
}

StepBarrier::StepBarrier(const std::string& address) : address_(address) {
  ddpkit::detail::PeerMemoryAddress a;
  DDPKIT_CHECK(ddpkit::detail::parse_peer_memory_address(address, &a) && a.bytes == sizeof(Shared),
               "plan: '", address, "' is no step barrier's address");
  std::string error;
  void* base = ddpkit::detail::map_peer_memory(a, &error);
  DDPKIT_CHECK(base, "plan: cannot join the replicas' step barrier: ", error);
  shared_ = static_cast<Shared*>(base);
}

StepBarrier::~StepBarrier() {
  if (shared_) ::munmap(shared_, sizeof(Shared));
  if (fd_ >= 0) ::close(fd_);
}

bool StepBarrier::arrive_and_wait(const std::atomic<bool>* stop, std::chrono::seconds timeout) {
  Shared& s = *shared_;
  const uint32_t generation = s.generation.load(std::memory_order_acquire);
  if (s.arrived.fetch_add(1, std::memory_order_acq_rel) + 1 == s.parties) {
    s.arrived.store(0, std::memory_order_relaxed);  // before the release: no one arrives again earlier
    s.generation.fetch_add(1, std::memory_order_release);
    ddpkit::detail::futex_wake_all(s.generation);
    return true;
  }
  // Asleep on the generation word; awake every 10 ms to see `stop` (a signal handler's flag).
  const auto deadline = Clock::now() + timeout;
  const timespec nap{0, 10 * 1000 * 1000};
  while (s.generation.load(std::memory_order_acquire) == generation) {
    if (stop && stop->load()) return false;
    DDPKIT_CHECK(Clock::now() < deadline, "plan: the profile's replicas stopped meeting at the end of backward ",
                 "(waited ", timeout.count(), " s for ", s.parties, " of them)");
    ddpkit::detail::futex_wait(s.generation, generation, nap);
  }
  return true;
}

// ---- machine constants -----------------------------------------------------------------------

namespace {

constexpr int kCollectiveRounds = 3;

// (bus bytes, ms) pairs of several rounds: each size once, at its median over the rounds.
std::vector<std::pair<double, double>> median_per_size(const std::vector<std::pair<double, double>>& samples) {
  std::map<double, std::vector<double>> by_size;
  for (const auto& s : samples) by_size[s.first].push_back(s.second);
  std::vector<std::pair<double, double>> out;
  for (const auto& [bytes, ms] : by_size) out.push_back({bytes, timed_median(ms)});
  return out;
}

// Least squares of ms = latency + bus_bytes / bandwidth over the sizes timed.
PathCost fit(const std::vector<std::pair<double, double>>& bus_bytes_ms) {
  double n = static_cast<double>(bus_bytes_ms.size()), sx = 0, sy = 0, sxx = 0, sxy = 0;
  for (const auto& p : bus_bytes_ms) {
    sx += p.first;
    sy += p.second;
    sxx += p.first * p.first;
    sxy += p.first * p.second;
  }
  const double slope = (n * sxy - sx * sy) / std::max(1e-30, n * sxx - sx * sx);  // ms per byte
  const double intercept = (sy - slope * sx) / n;
  PathCost c;
  c.latency_us = std::max(0.0, intercept) * 1e3;
  c.gbyte_per_s = slope > 0 ? 1.0 / (slope * 1e6) : 1e3;
  return c;
}

double timed_ms(int reps, const std::function<void()>& op) {
  op();
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = Clock::now();
    op();
    ms.push_back(ms_since(t0));
  }
  return timed_median(ms);
}

}  // namespace

MachineConstants calibrate_machine(int world) {
  DDPKIT_CHECK(world >= 2, "plan: calibrate needs at least 2 ranks, got ", world);
  MachineConstants m;
  m.cores = static_cast<int>(std::max(1L, sysconf(_SC_NPROCESSORS_ONLN)));
  {
    char host[256] = {0};
    gethostname(host, sizeof host - 1);
    char date[32];
    const std::time_t now = std::time(nullptr);
    std::strftime(date, sizeof date, "%Y-%m-%d %H:%M", std::localtime(&now));
    m.measured_on = std::string(host) + ", " + date + ", libtorch " + TORCH_VERSION;
  }
  const int saved_threads = at::get_num_threads();
  set_compute_threads(1);  // OpenBLAS too: ranks train with one thread each

  // Collectives: ranks as threads over one store, through shared memory, and Gloo's loopback
  // latency with shared memory off.
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::vector<std::pair<double, double>>> samples(8);
  double tcp_ms = 0;
  std::vector<std::exception_ptr> errors(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        set_compute_threads(1);
        const auto options = ProcessGroupOptions().gloo_hostname("127.0.0.1").timeout(std::chrono::seconds(120));
        auto shm = std::make_shared<ProcessGroup>(store, r, world, ProcessGroupOptions(options).group_name("plan_shm"));
        auto tcp = std::make_shared<ProcessGroup>(store, r, world,
                                                  ProcessGroupOptions(options).group_name("plan_tcp").shared_memory(false));
        DDPKIT_CHECK(shm->uses_shared_memory(), "plan --calibrate: shared memory is off (DDPKIT_SHM=0?); the model ",
                     "needs its costs");
        auto sync = [&] { ProcessGroup::wait(tcp->barrier()); };
        {
          // Copies, codecs and products, every rank at once: in a step the other ranks are busy
          // too, and share the memory bandwidth.
          double copy_rate, cast_rate, fp16_div_rate, int8_rate, encode_rate, decode_rate, gemm_rate;
          double matmul_rate = 0, matmul_rank32_rate = 0;
          sync();
          const int64_t n = 16 << 20;  // 64 MB of fp32
          at::Tensor a = at::rand({n}), b = at::empty({n});
          const double bytes = 4.0 * n;
          copy_rate = bytes / (timed_ms(5, [&] { b.copy_(a); }) * 1e6);
          at::Tensor h = at::empty({n}, at::kHalf);
          cast_rate = bytes / (timed_ms(5, [&] {
                                          h.copy_(a);
                                          b.copy_(h);
                                        }) * 1e6);
          // Halved and doubled: the values stay where they are (no subnormals), two passes.
          fp16_div_rate = 2 * bytes / (timed_ms(3, [&] {
                                         h.div_(2);
                                         h.div_(0.5);
                                       }) * 1e6);
          const int64_t block = 512;
          at::Tensor enc = at::empty({codecs::int8_encoded_bytes(n, block)}, at::kByte);
          int8_rate = bytes / (timed_ms(5, [&] {
                                          codecs::int8_encode(a, n, n, block, enc);
                                          codecs::int8_decode(enc, n, block, b, n, 1.0f, true);
                                        }) * 1e6);
          // PyTorch's quantization hooks' uint8 codec, per channel (rows of 512) as the slower of
          // the two: the bucket's parameters, then codes, and two ranks' parts decoded into their
          // mean, in blocks of 1 MiB as the hook moves them.
          {
            const int64_t cols = 512, block_rows = 512, rows = n / cols, block = block_rows * cols;
            std::vector<at::Tensor> packed(static_cast<size_t>(rows / block_rows));
            std::pair<at::Tensor, at::Tensor> qp;
            encode_rate = bytes / (timed_ms(3, [&] {
                                    qp = codecs::uint8_affine_qparams(a, cols);
                                    for (int64_t k = 0; k < rows / block_rows; ++k)
                                      packed[k] = codecs::uint8_affine_encode(a.narrow(0, k * block, block), block_rows, cols,
                                                                               qp.first.narrow(0, k * block_rows, block_rows),
                                                                               qp.second.narrow(0, k * block_rows, block_rows));
                                  }) * 1e6);
            decode_rate = 2 * bytes / (timed_ms(3, [&] {  // per part decoded
                                    for (int64_t k = 0; k < rows / block_rows; ++k)
                                      codecs::uint8_affine_decode_mean({packed[k], packed[k]}, block_rows, cols,
                                                                       b.narrow(0, k * block, block));
                                  }) * 1e6);
          }
          // A layer's products as training runs them (a Linear 1024 -> 4096 at batch 128: forward,
          // and backward's two), every rank at once. A described model's GFLOP run at this rate;
          // PowerSGD's rate below, which streams its matrix, was 6x too slow for them.
          {
            at::Tensor x = at::rand({128, 1024}), w = at::rand({4096, 1024}), dy = at::rand({128, 4096});
            gemm_rate = 3 * 2.0 * 128 * 1024 * 4096 / (timed_ms(5, [&] {
                                                       at::Tensor y = at::mm(x, w.t());
                                                       at::Tensor dx = at::mm(dy, w);
                                                       at::Tensor dw = at::mm(dy.t(), x);
                                                     }) * 1e6);
          }
          // PowerSGD's products (a 4096 x 4096 matrix against 4 columns, and its transpose back),
          // rank 0 alone: they stream the matrix, and in a step the other ranks are mostly
          // computing meanwhile, not streaming. (Timed with every rank at once, the rate was
          // 5 GFLOP/s and PowerSGD's step came out 36 % over the measured one.)
          // At rank 4 (powerSGD_hook's default) and 32 (batched_powerSGD_hook's): per flop, the
          // second runs several times faster, so one rate cannot stand for both.
          sync();
          if (r == 0) {
            at::Tensor mat = at::rand({4096, 4096});
            auto rate_at = [&](int64_t rank) {
              at::Tensor q = at::rand({4096, rank});
              const double ms = timed_ms(5, [&] {
                at::Tensor p = at::mm(mat, q);
                at::Tensor back = at::mm(mat.t(), p);
              });
              return 2 * 2.0 * 4096 * 4096 * rank / (ms * 1e6);
            };
            matmul_rate = rate_at(4);
            matmul_rank32_rate = rate_at(32);
          }
          sync();
          if (r == 0) {
            m.copy_gbyte_per_s = copy_rate;
            m.cast_gbyte_per_s = cast_rate;
            m.fp16_div_gbyte_per_s = fp16_div_rate;
            m.int8_gbyte_per_s = int8_rate;
            m.uint8_encode_gbyte_per_s = encode_rate;
            m.uint8_decode_gbyte_per_s = decode_rate;
            m.matmul_gflop_per_s = matmul_rate;
            m.matmul_rank32_gflop_per_s = matmul_rank32_rate;
            m.gemm_gflop_per_s = gemm_rate;
          }
        }
        auto time_op = [&](int reps, const std::function<void()>& op) {
          op();
          std::vector<double> ms;
          for (int i = 0; i < reps; ++i) {
            sync();
            const auto t0 = Clock::now();
            op();
            ms.push_back(ms_since(t0));
          }
          return timed_median(ms);
        };
        const double w = world, all = 2 * (w - 1) / w, part = (w - 1) / w;
        // Rounds over the sizes, each size then scored by its median round: two calibrations
        // minutes apart on this VM, one round each, had the in-place allreduce at 45 and 22 GB/s
        // and broadcast at 4 and 12 (a slow spell lands on one round, not on every size's one).
        for (int round = 0; round < kCollectiveRounds; ++round)
        for (int64_t bytes : {int64_t(1) << 20, int64_t(4) << 20, int64_t(16) << 20, int64_t(32) << 20}) {
          const int64_t elems = bytes / 4 / world * world;
          const double b = 4.0 * elems;
          at::Tensor f = at::ones({elems}), out = at::empty({elems}), shard = at::empty({elems / world});
          at::Tensor h = at::ones({elems}, at::kHalf);
          at::Tensor bucket = shm->allreduce_buffer(elems, at::kFloat).fill_(1);
          std::vector<at::Tensor> grads;
          std::vector<int64_t> sizes;
          for (int64_t at = 0, k = 0; k < 4; ++k) {
            const int64_t n = k < 3 ? elems / 4 : elems - at;
            sizes.push_back(n * 4);
            at += n;
          }
          std::shared_ptr<GradientArena> arena = shm->gradient_arena(sizes);
          GradientArena::use(arena);
          for (int64_t s : sizes) grads.push_back(at::ones({s / 4}));
          GradientArena::use(nullptr);
          at::Tensor gathered = at::empty({elems});
          const int reps = bytes >= (16 << 20) ? 5 : 9;
          auto add = [&](int which, double bus, const std::function<void()>& op) {
            const double ms = time_op(reps, op);
            if (r == 0) samples[which].push_back({bus, ms});
          };
          add(0, all * b, [&] { ProcessGroup::wait(shm->allreduce_parts(bucket, grads)); });
          add(1, all * b, [&] { ProcessGroup::wait(shm->allreduce(f)); });
          add(2, all * b / 2, [&] { ProcessGroup::wait(shm->allreduce(h)); });
          add(3, part * b, [&] { ProcessGroup::wait(shm->reduce_scatter(shard, f)); });
          add(4, part * b, [&] { ProcessGroup::wait(shm->allgather_into_tensor(gathered, shard)); });
          add(5, part * b, [&] { ProcessGroup::wait(shm->broadcast(f, 0)); });
          add(6, part * b, [&] { ProcessGroup::wait(shm->alltoall(out, f)); });
        }
        // Gloo's latency: the mean of back-to-back small allreduces, not a median after a barrier.
        // A step pays every collective's wait, including the ones that wait a scheduler tick for
        // a rank's thread to run again, which a median leaves out.
        at::Tensor small = at::ones({1024});
        for (int i = 0; i < 10; ++i) ProcessGroup::wait(tcp->allreduce(small));
        sync();
        const auto t0 = Clock::now();
        const int latency_reps = 200;
        for (int i = 0; i < latency_reps; ++i) ProcessGroup::wait(tcp->allreduce(small));
        if (r == 0) tcp_ms = ms_since(t0) / latency_reps;
        // What Gloo's TCP costs the cores, where no wire limits it (MachineConstants::tcp_gbyte_per_s).
        for (int round = 0; round < kCollectiveRounds; ++round)
        for (int64_t bytes : {int64_t(4) << 20, int64_t(16) << 20, int64_t(32) << 20}) {
          at::Tensor f = at::ones({bytes / 4 / world * world});
          const double tcp_large_ms = time_op(5, [&] { ProcessGroup::wait(tcp->allreduce(f)); });
          if (r == 0) samples[7].push_back({2 * (w - 1) / w * 4.0 * f.numel(), tcp_large_ms});
        }
        sync();
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  set_compute_threads(saved_threads);
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
  m.shm_allreduce_in_place = fit(median_per_size(samples[0]));
  m.shm_allreduce = fit(median_per_size(samples[1]));
  m.shm_allreduce_16bit = fit(median_per_size(samples[2]));
  m.shm_reduce_scatter = fit(median_per_size(samples[3]));
  m.shm_allgather = fit(median_per_size(samples[4]));
  m.shm_broadcast = fit(median_per_size(samples[5]));
  m.shm_alltoall = fit(median_per_size(samples[6]));
  m.tcp_gbyte_per_s = fit(median_per_size(samples[7])).gbyte_per_s;
  // A ring allreduce of 4 KB over 2 ranks is 2(n-1) = 2 latencies.
  m.tcp_latency_us = tcp_ms * 1e3 / (2 * (world - 1));
  return m;
}

}  // namespace plan
}  // namespace ddpkit
