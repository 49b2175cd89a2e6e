// Which samples each rank reads, across replica groups: PyTorch's DistributedSampler over the
// job's R groups of W ranks (torchft's DistributedSampler over replica group and rank).
//
// Group g's rank r reads share g*W + r of R*W of every epoch: one permutation per epoch, drawn
// from `seed` and the epoch alike on every rank, rank k taking k, k + R*W, ... (the tail that does
// not fill every rank's share is dropped). A batch depends only on the step, so a heal or a resume
// needs only the step to read on where its source or checkpoint was. While a group is out, its
// share of those steps is skipped; a plain job is R = 1.
//
//   ReplicaGroupSampler sampler(data.size(0), ReplicaGroupSamplerOptions()
//                                   .batch_size(32).replica_groups(R).replica_group(g)
//                                   .group_size(pg->size()).group_rank(pg->rank()));
//   at::Tensor idx = sampler.batch(step);   // dataset indices of this rank's batch at `step`
#pragma once

#include <ATen/ATen.h>
#include <torch/arg.h>

#include <cstdint>

namespace ddpkit {

struct ReplicaGroupSamplerOptions {
  TORCH_ARG(int64_t, batch_size) = 1;   // per rank
  TORCH_ARG(int, replica_groups) = 1;   // R
  TORCH_ARG(int, replica_group) = 0;    // g, in [0, R)
  TORCH_ARG(int, group_size) = 1;       // W: ranks of each group
  TORCH_ARG(int, group_rank) = 0;       // r, in [0, W)
  TORCH_ARG(uint64_t, seed) = 0;        // the epoch's permutation: seed * 1000 + epoch
};

class ReplicaGroupSampler {
 public:
  // Throws, naming the option, when the options are out of range or a rank's share of
  // `dataset_size` samples holds less than one batch.
  ReplicaGroupSampler(int64_t dataset_size, ReplicaGroupSamplerOptions options);

  // The dataset indices (int64) of this rank's batch at job step `step` (>= 0, over epochs).
  at::Tensor batch(int64_t step);
  int64_t epoch_of(int64_t step) const { return step / steps_per_epoch_; }
  int64_t steps_per_epoch() const { return steps_per_epoch_; }
  int64_t samples_per_rank() const { return per_rank_; }  // of each epoch
  int64_t dataset_size() const { return dataset_size_; }
  int data_world() const { return data_world_; }            // R * W
  int data_rank() const { return data_rank_; }              // g * W + r
  const ReplicaGroupSamplerOptions& options() const { return options_; }

 private:
  int64_t dataset_size_;
  ReplicaGroupSamplerOptions options_;
  int data_world_, data_rank_;
  int64_t per_rank_, steps_per_epoch_;
  int64_t epoch_ = -1;  // of perm_
  at::Tensor perm_;     // this rank's share of epoch_'s permutation
};

}  // namespace ddpkit
