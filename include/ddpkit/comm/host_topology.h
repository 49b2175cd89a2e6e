// Which ranks of a group share a host, decided per group from facts every rank publishes in the
// group's store (not from LOCAL_WORLD_SIZE, which is wrong for subgroups): the machine id, the
// boot id, the network namespace and the PID namespace. Ranks equal in all four can share memory
// (they reach each other's memory through /proc/<pid>) and see one network stack; ranks in
// different network namespaces count as different hosts (so the multi-host tests, one namespace
// per "host", see the topology a real cluster has), and so do containers with their own PIDs.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <string>
#include <vector>

namespace ddpkit {

struct HostTopology {
  std::vector<int> host_of_rank;                // host index per rank (hosts numbered by lowest rank)
  std::vector<std::vector<int>> ranks_of_host;  // ascending ranks per host
  int rank = 0;

  int host() const { return host_of_rank.at(rank); }
  int hosts() const { return static_cast<int>(ranks_of_host.size()); }
  const std::vector<int>& local_ranks() const { return ranks_of_host.at(host()); }
  int local_rank() const;  // position of `rank` among its host's ranks
  int local_size() const { return static_cast<int>(local_ranks().size()); }
  bool single_host() const { return hosts() == 1; }
};

// This process's "machine-id/boot-id/netns-inode/pidns-inode" (the machine id falls back to the
// host name where /etc/machine-id is missing).
std::string this_host_key();

// The topology of `world` ranks whose host keys are `keys` (keys[r] for rank r).
HostTopology topology_from_keys(const std::vector<std::string>& keys, int rank);

// Publishes this_host_key() under `prefix` in `store`, waits (at most `timeout`) for every rank's
// and returns the topology. Every rank of the group must call it. A rank that never publishes is
// a CommError naming the ranks missing.
HostTopology discover_host_topology(c10d::Store& store, const std::string& prefix, int rank, int world,
                                    std::chrono::milliseconds timeout);

}  // namespace ddpkit
