// ReplicaGroupSampler (include/ddpkit/training/replica_group_sampler.h).
#include <ddpkit/training/replica_group_sampler.h>

#include <ddpkit/error.h>

#include <ATen/CPUGeneratorImpl.h>

namespace ddpkit {

ReplicaGroupSampler::ReplicaGroupSampler(int64_t dataset_size, ReplicaGroupSamplerOptions options)
    : dataset_size_(dataset_size), options_(options) {
  const auto& o = options_;
  DDPKIT_CHECK(o.batch_size() >= 1, "ReplicaGroupSampler: batch_size must be >= 1, got ", o.batch_size());
  DDPKIT_CHECK(o.replica_groups() >= 1, "ReplicaGroupSampler: replica_groups must be >= 1, got ", o.replica_groups());
  DDPKIT_CHECK(o.replica_group() >= 0 && o.replica_group() < o.replica_groups(), "ReplicaGroupSampler: replica_group must be in 0..",
               o.replica_groups() - 1, ", got ", o.replica_group());
  DDPKIT_CHECK(o.group_size() >= 1, "ReplicaGroupSampler: group_size must be >= 1, got ", o.group_size());
  DDPKIT_CHECK(o.group_rank() >= 0 && o.group_rank() < o.group_size(), "ReplicaGroupSampler: group_rank must be in 0..",
               o.group_size() - 1, ", got ", o.group_rank());
  data_world_ = o.replica_groups() * o.group_size();
  data_rank_ = o.replica_group() * o.group_size() + o.group_rank();
  per_rank_ = dataset_size / data_world_;
  steps_per_epoch_ = per_rank_ / o.batch_size();
  DDPKIT_CHECK(steps_per_epoch_ >= 1, "ReplicaGroupSampler: batch_size ", o.batch_size(), " is larger than a rank's share (",
               per_rank_, " of ", dataset_size, " samples over ", o.replica_groups(), " groups of ", o.group_size(),
               " ranks)");
}

at::Tensor ReplicaGroupSampler::batch(int64_t step) {
  DDPKIT_CHECK(step >= 0, "ReplicaGroupSampler::batch: step must be >= 0, got ", step);
  const int64_t epoch = step / steps_per_epoch_, i = step % steps_per_epoch_;
  if (epoch != epoch_) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(options_.seed() * 1000 + static_cast<uint64_t>(epoch));
    perm_ = at::randperm(dataset_size_, gen, at::kLong).slice(0, data_rank_, data_world_ * per_rank_, data_world_);
    epoch_ = epoch;
  }
  const int64_t b = options_.batch_size();
  return perm_.slice(0, i * b, (i + 1) * b);
}

}  // namespace ddpkit
