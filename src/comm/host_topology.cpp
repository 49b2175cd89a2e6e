#include <ddpkit/comm/host_topology.h>
#include <ddpkit/compat.h>
#include <ddpkit/error.h>

#include "host_key_override.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <map>

namespace ddpkit {
namespace {

std::string first_line(const char* path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

}  // namespace

int HostTopology::local_rank() const {
  const auto& ranks = local_ranks();
  return static_cast<int>(std::find(ranks.begin(), ranks.end(), rank) - ranks.begin());
}

namespace {
thread_local std::string t_host_label;
}

ScopedHostKey::ScopedHostKey(std::string label) : previous_(t_host_label) { t_host_label = std::move(label); }
ScopedHostKey::~ScopedHostKey() { t_host_label = previous_; }
const std::string& ScopedHostKey::current() { return t_host_label; }

std::string this_host_key() {
  std::string machine = first_line("/etc/machine-id");
  if (machine.empty()) {
    char name[256] = {0};
    gethostname(name, sizeof(name) - 1);
    machine = name;
  }
  auto ns = [](const char* path) {
    struct stat st {};
    return stat(path, &st) == 0 ? std::to_string(st.st_ino) : std::string("?");
  };
  return machine + "/" + first_line("/proc/sys/kernel/random/boot_id") + "/" + ns("/proc/self/ns/net") + "/" +
         ns("/proc/self/ns/pid");
}

HostTopology topology_from_keys(const std::vector<std::string>& keys, int rank) {
  DDPKIT_CHECK(rank >= 0 && rank < static_cast<int>(keys.size()), "host topology: rank ", rank, " outside 0..",
               keys.size() - 1);
  HostTopology t;
  t.rank = rank;
  std::map<std::string, int> index;  // key -> host, numbered in order of each host's lowest rank
  for (size_t r = 0; r < keys.size(); ++r) {
    auto [it, added] = index.emplace(keys[r], static_cast<int>(t.ranks_of_host.size()));
    if (added) t.ranks_of_host.emplace_back();
    t.ranks_of_host[it->second].push_back(static_cast<int>(r));
    t.host_of_rank.push_back(it->second);
  }
  return t;
}

namespace {

// Every rank's key, the others' read from the store (the general case: N-1 keys a rank).
std::vector<std::string> every_host_key(c10d::Store& store, const std::vector<std::string>& names, int rank,
                                        const std::string& mine) {
  std::vector<std::string> others;
  for (int r = 0; r < static_cast<int>(names.size()); ++r)
    if (r != rank) others.push_back(names[r]);
  const auto values = compat::multi_get(store, others);  // one batch: over a long round trip each get costs two
  std::vector<std::string> keys;
  for (int r = 0, i = 0; r < static_cast<int>(names.size()); ++r) {
    if (r == rank) {
      keys.push_back(mine);
      continue;
    }
    keys.emplace_back(values[i].begin(), values[i].end());
    ++i;
  }
  return keys;
}

}  // namespace

HostTopology discover_host_topology(c10d::Store& store, const std::string& prefix, int rank, int world,
                                    std::chrono::milliseconds timeout) {
  const std::string mine = this_host_key() + (ScopedHostKey::current().empty() ? "" : "#" + ScopedHostKey::current());
  std::vector<std::string> names;
  for (int r = 0; r < world; ++r) names.push_back(prefix + "/host/" + std::to_string(r));
  store.set(names[rank], std::vector<uint8_t>(mine.begin(), mine.end()));
  // Hosts counted, not listed: the first rank on a host counts it, and the last rank to arrive says
  // so. When there are as many hosts as ranks (a cross group: one rank per replica group, each on
  // its own hosts) every rank knows the topology from two counters, O(1) store calls, instead of
  // reading every rank's key (at 64 sites the group's build was mostly these reads:
  // bench/cross_group_sites, docs/scale.md).
  if (store.add(prefix + "/on/" + mine, 1) == 1) store.add(prefix + "/hosts", 1);
  if (store.add(prefix + "/arrived", 1) == world) store.set(prefix + "/all", std::vector<uint8_t>{1});
  try {
    store.wait({prefix + "/all"}, timeout);
  } catch (const std::exception& e) {
    std::string missing;
    for (int r = 0; r < world; ++r)
      if (!store.check({names[r]})) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
    throw CommError("ddpkit: host topology under '" + prefix + "' on rank " + std::to_string(rank) + " of " +
                    std::to_string(world) + ": rank(s) " + missing + " did not publish their host within " +
                    std::to_string(timeout.count()) + " ms (" + e.what() + ")");
  }
  if (store.add(prefix + "/hosts", 0) == world) {
    HostTopology t;
    t.rank = rank;
    for (int r = 0; r < world; ++r) {
      t.host_of_rank.push_back(r);
      t.ranks_of_host.push_back({r});
    }
    return t;
  }
  return topology_from_keys(every_host_key(store, names, rank, mine), rank);
}

}  // namespace ddpkit
