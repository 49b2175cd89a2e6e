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

HostTopology discover_host_topology(c10d::Store& store, const std::string& prefix, int rank, int world,
                                    std::chrono::milliseconds timeout) {
  const std::string mine = this_host_key() + (ScopedHostKey::current().empty() ? "" : "#" + ScopedHostKey::current());
  store.set(prefix + "/host/" + std::to_string(rank), std::vector<uint8_t>(mine.begin(), mine.end()));
  std::vector<std::string> names;
  for (int r = 0; r < world; ++r) names.push_back(prefix + "/host/" + std::to_string(r));
  try {
    store.wait(names, timeout);
  } catch (const std::exception& e) {
    std::string missing;
    for (int r = 0; r < world; ++r)
      if (!store.check({names[r]})) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
    throw CommError("ddpkit: host topology under '" + prefix + "' on rank " + std::to_string(rank) + " of " +
                    std::to_string(world) + ": rank(s) " + missing + " did not publish their host within " +
                    std::to_string(timeout.count()) + " ms (" + e.what() + ")");
  }
  // The others' keys in one batch (over a long round trip each get costs two).
  std::vector<std::string> others;
  for (int r = 0; r < world; ++r)
    if (r != rank) others.push_back(names[r]);
  const auto values = compat::multi_get(store, others);
  std::vector<std::string> keys;
  for (int r = 0, i = 0; r < world; ++r) {
    if (r == rank) {
      keys.push_back(mine);
      continue;
    }
    keys.emplace_back(values[i].begin(), values[i].end());
    ++i;
  }
  return topology_from_keys(keys, rank);
}

}  // namespace ddpkit
