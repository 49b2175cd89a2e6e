// What a new quorum's cross group costs at many sites: every site (one rank, a thread of this
// process with a host key of its own, over loopback TCP as between hosts: no shared memory) makes
// the group through one TCPStore, as ft::Manager does after a quorum change, then runs a small
// all-reduce, then DiLoCo's outer weighted mean of a pseudo-gradient. Per site count it prints
// the slowest site's times, and the sockets and threads each site holds.
//
//   build/cross_group_sites [--sites 8,16,32,64] [--connections all,lazy] [--numel 1048576]
//                           [--codecs fp32,int4] [--repeat 3]
//
// connections: all, Gloo's full mesh made with the group (every site connects to every other);
// lazy, ProcessGroupOptions::lazy_connections (pairs made when a collective first needs them:
// the small all-reduce's log2 N + 1 partners, every peer at the first outer mean).
// build: store connect to group ready;
// first: the first all-reduce of 256 floats; next: the median of the next --repeat ones;
// mean <codec>: the median weighted mean of --numel floats (the pseudo-gradient) moved as codec
// bytes. Sites share this machine's cores, so the times beyond a few sites are CPU-bound here;
// the connection and thread counts are the design's, whatever the machine.
#include <ddpkit/codecs/codec.h>
#include <ddpkit/compat.h>
#include <ddpkit/comm/process_group.h>
#include <ddpkit/diloco/outer_allreduce.h>
#include <ddpkit/error.h>

#include "host_key_override.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/torch.h>

#include <dirent.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <iostream>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

using namespace ddpkit;
using Clock = std::chrono::steady_clock;

namespace {

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

// Entries of /proc/self/fd that are sockets, and threads of this process.
int sockets_open() {
  int n = 0;
  DIR* d = opendir("/proc/self/fd");
  if (!d) return -1;
  while (dirent* e = readdir(d)) {
    char target[256] = {0};
    const std::string path = std::string("/proc/self/fd/") + e->d_name;
    if (readlink(path.c_str(), target, sizeof(target) - 1) > 0 && std::string(target).rfind("socket:", 0) == 0) ++n;
  }
  closedir(d);
  return n;
}

int threads_running() {
  int n = 0;
  DIR* d = opendir("/proc/self/task");
  if (!d) return -1;
  while (dirent* e = readdir(d))
    if (e->d_name[0] != '.') ++n;
  closedir(d);
  return n;
}

class Latch {
 public:
  explicit Latch(int n) : left_(n) {}
  void arrive_and_wait() {
    std::unique_lock<std::mutex> lock(mu_);
    if (--left_ == 0) {
      cv_.notify_all();
      return;
    }
    cv_.wait(lock, [&] { return left_ == 0; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int left_;
};

double ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? -1 : v[v.size() / 2];
}

void wait_ok(const FuturePtr& f) {
  f->wait();
  if (f->hasError()) f->value();  // rethrows
}

struct SiteTimes {
  double build = 0, first = 0, next = 0;
  std::vector<double> mean;  // per codec
};

void run(int sites, bool lazy, int64_t numel, const std::vector<std::string>& codec_names, int repeat) {
  c10d::TCPStoreOptions so = compat::tcp_store_options();
  so.port = 0;
  so.isServer = true;
  so.waitWorkers = false;
  so.timeout = std::chrono::seconds(120);
  auto server = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", so);
  const int sockets_before = sockets_open(), threads_before = threads_running();
  std::vector<SiteTimes> times(static_cast<size_t>(sites));
  std::vector<std::shared_ptr<ProcessGroup>> groups(static_cast<size_t>(sites));
  Latch connected(sites), built(sites), counted(sites + 1), meant(sites + 1), go_on(sites + 1);
  std::vector<std::thread> threads;
  for (int s = 0; s < sites; ++s) {
    threads.emplace_back([&, s] {
      SiteTimes& t = times[static_cast<size_t>(s)];
      try {
        // Each site a host of its own, as in a job (they are threads of one machine here).
        ScopedHostKey host("site-" + std::to_string(s));
        auto store = c10::make_intrusive<c10d::PrefixStore>(
            "q" + std::to_string(sites),
            compat::tcp_store_client("127.0.0.1", server->getPort(), std::chrono::seconds(120)));
        connected.arrive_and_wait();
        const auto t0 = Clock::now();
        auto pg = std::make_shared<ProcessGroup>(store, s, sites,
                                                 ProcessGroupOptions()
                                                     .shared_memory(false)
                                                     .lazy_connections(lazy)
                                                     .gloo_hostname("127.0.0.1")
                                                     .timeout(std::chrono::seconds(120))
                                                     .group_name("cross-" + std::to_string(sites)));
        const auto t1 = Clock::now();
        at::Tensor small = torch::ones({256});
        wait_ok(pg->allreduce(small));
        const auto t2 = Clock::now();
        t.build = ms(t1 - t0);
        t.first = ms(t2 - t0);
        groups[static_cast<size_t>(s)] = pg;
        built.arrive_and_wait();
        counted.arrive_and_wait();  // the main thread counts sockets and threads meanwhile
        std::vector<double> next;
        for (int i = 0; i < repeat; ++i) {
          const auto a = Clock::now();
          wait_ok(pg->allreduce(small));
          next.push_back(ms(Clock::now() - a));
        }
        t.next = median(next);
        at::Tensor values = torch::randn({numel});
        for (const auto& name : codec_names) {
          auto codec = codecs::make_codec(name);
          std::vector<double> means;
          for (int i = 0; i < repeat; ++i) {
            at::Tensor v = values.clone();
            wait_ok(pg->barrier());
            const auto a = Clock::now();
            wait_ok(diloco::weighted_mean(pg.get(), v, 1.0f, codec));
            means.push_back(ms(Clock::now() - a));
          }
          t.mean.push_back(median(means));
        }
        meant.arrive_and_wait();  // the main thread counts again: the means needed every pair
        go_on.arrive_and_wait();
      } catch (const std::exception& e) {
        std::cerr << "site " << s << ": " << e.what() << std::endl;
        std::exit(1);
      }
    });
  }
  counted.arrive_and_wait();
  const int sockets = sockets_open() - sockets_before, threads_now = threads_running() - threads_before;
  meant.arrive_and_wait();
  const int sockets_after_mean = sockets_open() - sockets_before, threads_after_mean = threads_running() - threads_before;
  go_on.arrive_and_wait();
  for (auto& t : threads) t.join();
  groups.clear();
  auto slowest = [&](auto field) {
    double m = 0;
    for (const auto& t : times) m = std::max(m, field(t));
    return m;
  };
  std::printf("%6s %6d %10.1f %10.1f %9.2f", lazy ? "lazy" : "all", sites, slowest([](const SiteTimes& t) { return t.build; }),
              slowest([](const SiteTimes& t) { return t.first; }), slowest([](const SiteTimes& t) { return t.next; }));
  for (size_t c = 0; c < codec_names.size(); ++c)
    std::printf(" %12.1f", slowest([c](const SiteTimes& t) { return t.mean[c]; }));
  // Each site's store connection is counted too (one per site); a Gloo pair is one socket on each end.
  std::printf(" %10.1f %10.1f %12.1f %12.1f\n", static_cast<double>(sockets) / sites,
              static_cast<double>(threads_now) / sites, static_cast<double>(sockets_after_mean) / sites,
              static_cast<double>(threads_after_mean) / sites);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  std::string sites_list = "8,16,32,64", codec_list = "fp32,int4", connections_list = "all,lazy";
  int64_t numel = 1 << 20;
  int repeat = 3;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 >= argc) {
      std::cerr << "usage: cross_group_sites [--sites 8,16,32,64] [--connections all,lazy] [--numel N] "
                   "[--codecs fp32,int4] [--repeat R]\n";
      return 2;
    }
    const std::string v = argv[++i];
    if (a == "--sites") sites_list = v;
    else if (a == "--numel") numel = std::stoll(v);
    else if (a == "--codecs") codec_list = v;
    else if (a == "--connections") connections_list = v;
    else if (a == "--repeat") repeat = std::stoi(v);
    else {
      std::cerr << "cross_group_sites: unknown flag " << a << "\n";
      return 2;
    }
  }
  struct rlimit files;
  if (getrlimit(RLIMIT_NOFILE, &files) == 0) {
    files.rlim_cur = files.rlim_max;
    setrlimit(RLIMIT_NOFILE, &files);
  }
  const auto codec_names = split(codec_list);
  std::printf("cross group of N sites (one rank each, threads of one process, loopback TCP, no shared memory): "
              "slowest site's ms; weighted mean of %lld floats; %u cores\n",
              static_cast<long long>(numel), std::thread::hardware_concurrency());
  std::printf("%6s %6s %10s %10s %9s", "conn", "sites", "build ms", "+first ms", "next ms");
  for (const auto& c : codec_names) std::printf(" %12s", ("mean " + c + " ms").c_str());
  std::printf(" %10s %10s %12s %12s\n", "sock/site", "thr/site", "sock (mean)", "thr (mean)");
  for (const auto& c : split(connections_list)) {
    if (c != "all" && c != "lazy") {
      std::cerr << "cross_group_sites: --connections takes all and/or lazy, got " << c << "\n";
      return 2;
    }
    for (const auto& s : split(sites_list)) run(std::stoi(s), c == "lazy", numel, codec_names, repeat);
  }
  return 0;
}
