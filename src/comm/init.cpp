// init_process_group and the default group: rendezvous from torchrun-style env or an init
// method, and subgroups of an existing group.
#include <ddpkit/comm/process_group.h>

#include <ddpkit/comm/launch_environment.h>

#include "local_address.h"

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>

#include <cstdlib>
#include <iostream>
#include <mutex>
#include <string>
#include <vector>

namespace ddpkit {

namespace {

std::mutex g_default_mutex;
std::shared_ptr<ProcessGroup> g_default;

// Open MPI across hosts meets at mpirun's host (launch_environment.cpp), where rank 0 serves the
// store: a rank 0 placed elsewhere would leave every rank waiting out the timeout.
void check_rank0_holds_master(const LaunchEnvironment& launch) {
  if (launch.master_addr == "127.0.0.1" || std::getenv("MASTER_ADDR")) return;
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return;
  bool here = false;
  for (ifaddrs* a = list; a && !here; a = a->ifa_next) {
    if (!a->ifa_addr || a->ifa_addr->sa_family != AF_INET) continue;
    char text[INET_ADDRSTRLEN] = {};
    inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ifa_addr)->sin_addr, text, sizeof(text));
    here = launch.master_addr == text;
  }
  freeifaddrs(list);
  DDPKIT_CHECK(here, "init_process_group: Open MPI placed rank 0 on a host other than mpirun's (",
               launch.master_addr, "), where the ranks meet: run mpirun on one of the job's hosts, or pass "
               "-x MASTER_ADDR=<rank 0's host>");
}

std::string env_str(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

}  // namespace

std::shared_ptr<ProcessGroup> init_process_group(const InitOptions& o) {
  // Whatever the options leave open is read from the engine that started this process.
  LaunchEnvironment launch;
  if (o.rank() < 0 || o.world_size() < 0) {
    launch = detect_launch_environment();
    DDPKIT_CHECK(!launch.per_node, "init_process_group: ", launch.summary.substr(8),
                 ": this process is the node's, not a rank; start the node's ranks with `ddpkit launch PROGRAM` "
                 "(it reads the same variables) or torchrun");
  } else if (!o.store() && o.init_method() == "env://") {
    // Rank and world given (as PyTorch's own tests do, beside a lone WORLD_SIZE): only the
    // rendezvous is wanted, from MASTER_ADDR/MASTER_PORT, else from the engine when it is whole.
    try {
      launch = detect_launch_environment();
    } catch (const c10::Error&) {
      launch = LaunchEnvironment();
    }
    if (const char* a = std::getenv("MASTER_ADDR")) launch.master_addr = a;
    if (const char* p = std::getenv("MASTER_PORT")) launch.master_port = std::atoi(p);
    launch.engine.clear();  // nothing to announce: the caller named the rank
  }
  const int rank = o.rank() >= 0 ? o.rank() : launch.rank;
  const int world = o.world_size() >= 0 ? o.world_size() : launch.world_size;
  DDPKIT_CHECK(rank >= 0, "init_process_group: rank unknown: pass InitOptions().rank(r), or start the process "
               "under a launcher (torchrun, ddpkit launch, srun, mpirun: docs/launching.md)");
  DDPKIT_CHECK(world >= 1, "init_process_group: world size unknown: pass InitOptions().world_size(n), or start "
               "the process under a launcher (docs/launching.md)");
  DDPKIT_CHECK(rank < world, "init_process_group: rank ", rank, " is not below world size ", world);
  if (launch.found() && launch.engine != "ddpkit-launch" && rank == 0) std::cerr << launch.summary << std::endl;

  c10::intrusive_ptr<c10d::Store> store = o.store();
  std::string rendezvous_host;  // where the store is served, when over TCP
  int rendezvous_port = 0;
  std::string where = "explicit store";
  if (!store) {
    const std::string& m = o.init_method();
    try {
      if (m.rfind("file://", 0) == 0) {
        where = m;
        store = c10::make_intrusive<c10d::FileStore>(m.substr(7), world);
      } else {
        std::string host;
        int port = -1;
        if (m == "env://") {
          host = launch.master_addr;
          port = launch.master_port;
          DDPKIT_CHECK(!host.empty(), "init_process_group: MASTER_ADDR is not set (init_method env://)");
          DDPKIT_CHECK(port > 0, "init_process_group: MASTER_PORT is not set (init_method env://)");
          if (launch.engine == "openmpi" && rank == 0) check_rank0_holds_master(launch);
        } else if (m.rfind("tcp://", 0) == 0) {
          const auto hp = m.substr(6);
          const auto colon = hp.rfind(':');
          DDPKIT_CHECK(colon != std::string::npos, "init_method '", m, "' lacks a port (tcp://HOST:PORT)");
          host = hp.substr(0, colon);
          port = std::atoi(hp.substr(colon + 1).c_str());
        } else {
          DDPKIT_CHECK(false, "unknown init_method '", m, "' (expected env://, tcp://HOST:PORT or file:///PATH)");
        }
        DDPKIT_CHECK(port > 0 && port < 65536, "init_process_group: port ", port, " is out of range");
        where = "TCPStore " + host + ":" + std::to_string(port);
        rendezvous_host = host;
        rendezvous_port = port;
        c10d::TCPStoreOptions so = compat::tcp_store_options();
        so.port = static_cast<uint16_t>(port);
        // torchrun's convention: with TORCHELASTIC_USE_AGENT_STORE=True the launcher already serves
        // the store at MASTER_PORT (ddpkit's launcher does: no window for another process to take
        // the port between choosing it and rank 0 binding it), so every rank is a client.
        so.isServer = rank == 0 && env_str("TORCHELASTIC_USE_AGENT_STORE") != "True";
        so.numWorkers = static_cast<size_t>(world);
        so.waitWorkers = true;
        so.timeout = o.timeout();
        store = c10::make_intrusive<c10d::TCPStore>(host, so);
        // A restarted set of ranks (torchrun --max-restarts, ddpkit's launcher) meets the same
        // agent store: as PyTorch does, each attempt gets its own key space, or the new ranks read
        // the dead set's keys (a shared-memory segment name, Gloo addresses) and fail or hang.
        const std::string attempt = env_str("TORCHELASTIC_RESTART_COUNT");
        if (!attempt.empty())
          store = c10::make_intrusive<c10d::PrefixStore>("/worker/attempt_" + attempt, store);
      }
    } catch (const c10::Error& e) {
      const std::string msg = e.what_without_backtrace();
      if (msg.rfind("ddpkit: ", 0) == 0) throw;
      throw CommError("ddpkit: init_process_group: rendezvous at " + where + " failed on rank " +
                      std::to_string(rank) + " of " + std::to_string(world) + " (timeout " +
                      std::to_string(o.timeout().count()) + " ms): " + msg);
    }
    store->setTimeout(o.timeout());
  }
  std::string gloo_hostname = o.gloo_hostname();
  if (gloo_hostname.empty() && !std::getenv("GLOO_SOCKET_IFNAME") && !rendezvous_host.empty() &&
      rendezvous_host != "localhost" && rendezvous_host.rfind("127.", 0) != 0)
    gloo_hostname = local_address_towards(rendezvous_host, rendezvous_port);
  auto pg = std::make_shared<ProcessGroup>(store, rank, world,
                                           ProcessGroupOptions()
                                               .backend(o.backend())
                                               .timeout(o.timeout())
                                               .gloo_threads(o.gloo_threads())
                                               .gloo_hostname(gloo_hostname)
                                               .two_phase_min_bytes(o.two_phase_min_bytes())
                                               .gloo_connections(o.gloo_connections())
                                               .piece_bytes(o.piece_bytes())
                                               .shared_memory(o.shared_memory()));
  std::lock_guard<std::mutex> lock(g_default_mutex);
  if (!g_default) g_default = pg;
  return pg;
}

std::shared_ptr<ProcessGroup> default_process_group() {
  std::lock_guard<std::mutex> lock(g_default_mutex);
  DDPKIT_CHECK(g_default, "no default process group: call ddpkit::init_process_group() first");
  return g_default;
}

void destroy_process_group() {
  std::lock_guard<std::mutex> lock(g_default_mutex);
  g_default.reset();
}

std::shared_ptr<ProcessGroup> new_subgroups(const ProcessGroup& parent, int group_size) {
  DDPKIT_CHECK(group_size >= 1 && parent.size() % group_size == 0, "new_subgroups: group size ", group_size,
               " must be positive and divide the world size ", parent.size());
  const int index = parent.rank() / group_size;
  ProcessGroupOptions o = parent.options();
  o.group_name("subgroup" + std::to_string(group_size) + "-" + std::to_string(index));
  return parent.new_subgroup(parent.rank() % group_size, group_size, o);
}

std::vector<std::string> available_backends() {
#ifdef USE_C10D_NCCL
  return {"gloo", "nccl"};
#else
  return {"gloo"};
#endif
}

}  // namespace ddpkit
