// What the fault-tolerant loops of `ddpkit train` share (train_ft.cpp, train_diloco.cpp).
#pragma once

#include "cli.h"
#include "train_build.h"
#include "train_flags.h"

#include <ddpkit/ft/manager.h>
#include <ddpkit/training/replica_group_sampler.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

namespace ddpkit {
namespace cli {

inline std::string group_name(int g) {
  char id[32];
  std::snprintf(id, sizeof(id), "replica-%03d", g);
  return id;
}

// FNV-1a over the parameters' bytes: equal replicas print equal checksums.
inline std::string parameter_checksum(const std::vector<at::Tensor>& params) {
  uint64_t h = 1469598103934665603ull;
  for (const auto& p : params) {
    const at::Tensor c = p.detach().contiguous();
    const auto* b = static_cast<const unsigned char*>(c.data_ptr());
    for (int64_t i = 0; i < c.numel() * static_cast<int64_t>(c.element_size()); ++i) h = (h ^ b[i]) * 1099511628211ull;
  }
  std::ostringstream os;
  os << std::hex << std::setw(16) << std::setfill('0') << h;
  return os.str();
}

// DDPKIT_FT_FAULT=PHASE:STEP:GROUP:RANK[:ATTEMPT][,...], for tests: this process SIGKILLs itself
// at the first PHASE (forward, backward, or one of ft::ManagerOptions::on_phase's) of a step >= STEP
// when it is rank RANK of group GROUP (or of any group: *) in its launcher's ATTEMPT-th start
// (TORCHELASTIC_RESTART_COUNT; default 0, so a restarted group does not die again).
class FaultPoints {
 public:
  FaultPoints(int group, int rank) {
    const char* spec = std::getenv("DDPKIT_FT_FAULT");
    if (!spec || !*spec) return;
    const char* restarts = std::getenv("TORCHELASTIC_RESTART_COUNT");
    const int attempt_now = restarts && *restarts ? std::atoi(restarts) : 0;
    std::stringstream list(spec);
    for (std::string one; std::getline(list, one, ',');) {
      std::vector<std::string> f;
      std::stringstream fields(one);
      for (std::string x; std::getline(fields, x, ':');) f.push_back(x);
      Point p;
      int g = -1, r = 0, attempt = 0;
      try {
        if (f.size() != 4 && f.size() != 5) throw std::invalid_argument("fields");
        p.phase = f[0];
        p.step = std::stoll(f[1]);
        g = f[2] == "*" ? -1 : std::stoi(f[2]);
        r = std::stoi(f[3]);
        attempt = f.size() == 5 ? std::stoi(f[4]) : 0;
      } catch (const std::exception&) {
        throw UsageError("DDPKIT_FT_FAULT must be PHASE:STEP:GROUP:RANK[:ATTEMPT][,...], got '" + one + "'");
      }
      if ((g < 0 || g == group) && r == rank && attempt == attempt_now) points_.push_back(p);
    }
  }
  bool armed() const { return !points_.empty(); }
  // at() as the Managers' and DiLoCo's on_phase take it; empty when nothing is armed.
  std::function<void(const std::string&, int64_t)> hook() const {
    if (!armed()) return nullptr;
    return [this](const std::string& phase, int64_t step) { at(phase, step); };
  }
  void at(const std::string& phase, int64_t step) const {
    for (const Point& p : points_) {
      if (phase != p.phase || step < p.step) continue;
      std::cerr << "ddpkit: DDPKIT_FT_FAULT: dying at " << phase << ", step " << step << std::endl;
      raise(SIGKILL);
    }
  }

 private:
  struct Point {
    std::string phase;
    int64_t step = 0;
  };
  std::vector<Point> points_;
};

// The Manager of one rank of replica group t.replica_group (`ddpkit train --fault-tolerant`).
inline ft::ManagerOptions group_manager_options(const TrainFlags& t, const FaultPoints& fault,
                                                std::chrono::milliseconds timeout) {
  return ft::ManagerOptions()
      .lighthouse(t.lighthouse)
      .group_id(group_name(t.replica_group))
      .token(read_token("", "DDPKIT_FT_TOKEN"))
      .quorum_timeout(timeout)
      .cross_group_timeout(std::min(timeout, std::chrono::milliseconds(30000)))
      .heal_connections(t.heal_connections)
      .cross_lazy_connections(t.cross_lazy_connections)
      .quorum_mode(t.quorum_mode == "sync" ? ft::QuorumMode::kSync : ft::QuorumMode::kAsync)
      .on_phase(fault.hook());
}

inline std::chrono::milliseconds timeout_of(const Flags& f) {
  return std::chrono::milliseconds(int64_t{f.integer("timeout-s")} * 1000);
}

// This rank's share of the training data: group g's rank r reads share g*W + r of R*W.
inline ReplicaGroupSampler group_sampler(const Flags& f, const TrainFlags& t, const Split& data, const ProcessGroup& pg) {
  return ReplicaGroupSampler(data.train.inputs.size(0), ReplicaGroupSamplerOptions()
                                                            .batch_size(t.batch)
                                                            .replica_groups(t.replica_groups)
                                                            .replica_group(t.replica_group)
                                                            .group_size(pg.size())
                                                            .group_rank(pg.rank())
                                                            .seed(static_cast<uint64_t>(f.integer("seed"))));
}

// One forward and backward of `run` on the samples `idx` (gradients reset first); the loss.
inline at::Tensor forward_backward(Training& run, const Dataset& train, const at::Tensor& idx, const FaultPoints& fault,
                                   int64_t step) {
  at::Tensor x = train.inputs.index_select(0, idx), y = train.labels.index_select(0, idx);
  if (run.model.language_model) x = x.to(at::kLong), y = y.to(at::kLong);
  for (auto& p : run.params) p.mutable_grad().reset();
  fault.at("forward", step);
  at::Tensor loss = model_loss(run.model, run.forward(x), y);
  fault.at("backward", step);
  loss.backward();
  return loss;
}

inline void optimizer_step(Training& run) {
  if (run.zero)
    run.zero->step();
  else
    run.optimizer->step();
}

inline double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace cli
}  // namespace ddpkit
