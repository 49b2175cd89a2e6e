// `ddpkit train`'s flags, parsed and checked before any rank starts (train_flags.cpp).
#pragma once

#include "cli.h"

#include <ddpkit/ddpkit.h>

#include <string>
#include <vector>

namespace ddpkit {
namespace cli {

struct TrainFlags {
  std::string model, hook, dataset, fsdp_name, optimizer, zero_level, checkpoint_dir;
  bool use_fsdp = false, use_ddp = true, optimizer_in_hook = false;
  ShardingStrategy fsdp_strategy = ShardingStrategy::kFullShard;
  compat::optional<at::ScalarType> fsdp_param_dtype, fsdp_reduce_dtype;
  ZeroOverlap zero_overlap = ZeroOverlap::kNone;
  int nproc = 2, epochs = 3, max_steps = 0, batch = 64, threads = 1, piece_kb = 1024;
  int checkpoint_every = 100, max_restarts = 0, report_every = 0;
  double lr = 0.05, cap = 25;
  bool tune_caps = false, tune_pieces = false;
  int64_t powersgd_rank = 4;
  // --fault-tolerant: R replica groups (this process's index among them, -1: launch them all),
  // the fewest that may train on, and the lighthouse ("" : start one).
  bool fault_tolerant = false;
  int replica_groups = 1, replica_group = -1, min_replicas = 1;
  bool cross_lazy_connections = false;  // ft::ManagerOptions::cross_lazy_connections
  std::string quorum_mode = "async";     // ft::ManagerOptions::quorum_mode: async or sync
  int heal_connections = 1;  // connections of a heal's pair group (ft::ManagerOptions::heal_connections)
  std::string lighthouse;
  // --diloco H: DiLoCo across the replica groups (0: off), its outer optimizer and codec, and
  // Streaming DiLoCo's fragments (diloco::DiLoCoOptions).
  int64_t diloco = 0, fragments = 1, fragment_delay = 0;
  double outer_lr = 0.7, outer_momentum = 0.9, fragment_alpha = 0.0, round_seconds = 0;
  std::string outer_codec = "fp32", fragment_layout = "strided";
  bool outer_error_feedback = false;
};

// The flags `ddpkit train` takes, with their defaults.
Flags parse_train_flags(const std::vector<std::string>& args);
// Each flag and their combinations checked: a UsageError naming the flag that is wrong.
TrainFlags check_train_flags(const Flags& f);

}  // namespace cli
}  // namespace ddpkit
