// ZeroRedundancyOptimizer's state: local sizes, consolidation of every rank's shard on one rank,
// state_dict()/load_state_dict(), and ZeroStateDict files. Optimizer state and options travel as
// torch::serialize archives in byte tensors.
#include <ddpkit/zero/zero_redundancy_optimizer.h>

#include <torch/serialize/archive.h>

#include <cstring>
#include <sstream>

namespace ddpkit {

namespace {

using torch::optim::OptimizerOptions;
using torch::optim::OptimizerParamState;

std::string archive_bytes(torch::serialize::OutputArchive& archive) {
  std::ostringstream os;
  archive.save_to(os);
  return os.str();
}

std::string state_bytes(const OptimizerParamState& state) {
  torch::serialize::OutputArchive a;
  state.serialize(a);
  return archive_bytes(a);
}

std::string options_bytes(const OptimizerOptions& options) {
  torch::serialize::OutputArchive a;
  options.serialize(a);
  return archive_bytes(a);
}

at::Tensor bytes_tensor(const std::string& bytes) {
  at::Tensor t = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
  std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
  return t;
}

std::string tensor_bytes(const at::Tensor& t) {
  at::Tensor c = t.contiguous().to(at::kByte);
  return std::string(static_cast<const char*>(c.data_ptr()), static_cast<size_t>(c.numel()));
}

template <class T>
std::unique_ptr<T> from_bytes(const std::string& bytes, std::unique_ptr<T> object) {
  torch::serialize::InputArchive a;
  a.load_from(bytes.data(), bytes.size());
  object->serialize(a);
  return object;
}

}  // namespace

// ---- state ---------------------------------------------------------------------------------

int64_t ZeroRedundancyOptimizer::local_state_bytes() const {
  DDPKIT_CHECK(factory_.state_tensors, "local_state_bytes: the OptimizerFactory has no state_tensors function");
  int64_t bytes = 0;
  for (const auto& kv : local_->state())
    for (const auto& t : factory_.state_tensors(*kv.second))
      if (t.defined()) bytes += t.numel() * static_cast<int64_t>(t.element_size());
  return bytes;
}

int64_t ZeroRedundancyOptimizer::local_numel() const {
  int64_t n = 0;
  if (mode_ == Mode::kBucketShards) {
    for (const auto& b : bucket_shards_) n += b.shard_numel;
  } else {
    for (size_t i = 0; i < params_.size(); ++i)
      if (owner_[i] == pg_->rank()) n += params_[i].numel();
  }
  return n;
}

void ZeroRedundancyOptimizer::consolidate_state_dict(int to) {
  const int world = pg_->size(), me = pg_->rank();
  DDPKIT_CHECK(to >= 0 && to < world, "consolidate_state_dict: rank ", to, " is not in [0, ", world, ")");
  // This rank's states as one archive: key -> the state's own archive bytes.
  std::vector<int64_t> keys;
  std::vector<std::string> blobs;
  auto& state = local_->state();
  if (mode_ == Mode::kBucketShards) {
    for (size_t b = 0; b < bucket_shards_.size(); ++b) {
      auto it = state.find(compat::optimizer_state_key(state, bucket_shards_[b].shard));
      if (it == state.end()) continue;
      keys.push_back(static_cast<int64_t>(b) * world + me);
      blobs.push_back(state_bytes(*it->second));
    }
  } else {
    for (size_t i = 0; i < params_.size(); ++i) {
      if (!shadow_[i].defined()) continue;
      auto it = state.find(compat::optimizer_state_key(state, shadow_[i]));
      if (it == state.end()) continue;
      keys.push_back(static_cast<int64_t>(i));
      blobs.push_back(state_bytes(*it->second));
    }
  }
  torch::serialize::OutputArchive mine;
  mine.write("keys", at::tensor(keys, at::kLong));
  for (size_t k = 0; k < keys.size(); ++k) mine.write("s" + std::to_string(keys[k]), bytes_tensor(blobs[k]));
  const std::string payload = archive_bytes(mine);

  // Gather on every rank (Gloo has no gather with this API's ordering): sizes first, then the
  // payloads padded to the largest.
  at::Tensor size = at::tensor({static_cast<int64_t>(payload.size())}, at::kLong);
  std::vector<at::Tensor> sizes;
  for (int r = 0; r < world; ++r) sizes.push_back(at::empty({1}, at::kLong));
  ProcessGroup::wait(pg_->allgather(sizes, size));
  int64_t longest = 0;
  for (const auto& s : sizes) longest = std::max(longest, s.item<int64_t>());
  at::Tensor padded = at::zeros({longest}, at::kByte);
  std::memcpy(padded.data_ptr(), payload.data(), payload.size());
  std::vector<at::Tensor> all;
  for (int r = 0; r < world; ++r) all.push_back(at::empty({longest}, at::kByte));
  ProcessGroup::wait(pg_->allgather(all, padded));

  consolidated_.reset();
  consolidated_to_ = to;
  if (me != to) return;
  auto dict = std::make_unique<ZeroStateDict>();
  dict->layout = mode_ == Mode::kBucketShards ? "bucket_shards" : "parameters";
  for (int r = 0; r < world; ++r) {
    const std::string bytes = tensor_bytes(all[r].narrow(0, 0, sizes[r].item<int64_t>()));
    torch::serialize::InputArchive in;
    in.load_from(bytes.data(), bytes.size());
    at::Tensor rk;
    in.read("keys", rk);
    for (int64_t k = 0; k < rk.numel(); ++k) {
      const int64_t key = rk[k].item<int64_t>();
      at::Tensor blob;
      in.read("s" + std::to_string(key), blob);
      dict->state[key] = from_bytes(tensor_bytes(blob), factory_.new_state());
    }
  }
  const auto& local_groups = local_->param_groups();
  if (mode_ == Mode::kBucketShards) {
    ZeroStateDict::Group g;
    for (size_t b = 0; b < bucket_shards_.size(); ++b) {
      dict->shard_numel.push_back(bucket_shards_[b].shard_numel);
      for (int r = 0; r < world; ++r) g.params.push_back(static_cast<int64_t>(b) * world + r);
    }
    g.options = local_groups[0].options().clone();
    dict->param_groups.push_back(std::move(g));
  } else {
    for (size_t gi = 0; gi < group_options_.size(); ++gi) {
      ZeroStateDict::Group g;
      for (size_t i = 0; i < params_.size(); ++i)
        if (group_of_[i] == gi) g.params.push_back(static_cast<int64_t>(i));
      g.options = local_groups[gi].options().clone();
      dict->param_groups.push_back(std::move(g));
    }
  }
  consolidated_ = std::move(dict);
}

const ZeroStateDict& ZeroRedundancyOptimizer::state_dict() const {
  DDPKIT_CHECK(consolidated_, "state_dict: the optimizer state has not been consolidated on rank ", pg_->rank(),
               (consolidated_to_ >= 0 ? " (the last consolidate_state_dict sent it to rank " +
                                            std::to_string(consolidated_to_) + ")"
                                      : std::string()),
               "; call consolidate_state_dict(to) on every rank first");
  return *consolidated_;
}

void ZeroRedundancyOptimizer::load_state_dict(const ZeroStateDict& dict) {
  const bool shards = mode_ == Mode::kBucketShards;
  DDPKIT_CHECK(dict.layout == (shards ? "bucket_shards" : "parameters"), "load_state_dict: the dict's layout is '",
               dict.layout, "' but this optimizer's is '", (shards ? "bucket_shards" : "parameters"), "'");
  auto& state = local_->state();
  auto& groups = local_->param_groups();
  if (shards) {
    std::vector<int64_t> mine;
    for (const auto& b : bucket_shards_) mine.push_back(b.shard_numel);
    DDPKIT_CHECK(dict.shard_numel == mine && dict.param_groups.size() == 1 &&
                     dict.param_groups[0].params.size() == bucket_shards_.size() * pg_->size(),
                 "load_state_dict: the dict's ZeRO-2 shards (", dict.shard_numel.size(),
                 " buckets) do not match this optimizer's (", mine.size(),
                 " buckets, world size ", pg_->size(), "); a bucket_shards dict loads only into the same layout");
    for (size_t b = 0; b < bucket_shards_.size(); ++b) {
      const auto key = compat::optimizer_state_key(state, bucket_shards_[b].shard);
      auto it = dict.state.find(static_cast<int64_t>(b) * pg_->size() + pg_->rank());
      if (it == dict.state.end()) {
        state.erase(key);
      } else {
        state[key] = it->second->clone();
      }
    }
    groups[0].set_options(dict.param_groups[0].options->clone());
    return;
  }
  DDPKIT_CHECK(dict.param_groups.size() == group_options_.size(), "load_state_dict: the dict has ",
               dict.param_groups.size(), " parameter groups, this optimizer ", group_options_.size());
  for (size_t g = 0; g < group_options_.size(); ++g) {
    std::vector<int64_t> expected;
    for (size_t i = 0; i < params_.size(); ++i)
      if (group_of_[i] == g) expected.push_back(static_cast<int64_t>(i));
    DDPKIT_CHECK(dict.param_groups[g].params == expected, "load_state_dict: group ", g, " of the dict holds ",
                 dict.param_groups[g].params.size(), " parameters, this optimizer's group ", expected.size(),
                 " (or different indices)");
    DDPKIT_CHECK(dict.param_groups[g].options, "load_state_dict: group ", g, " has no options");
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!shadow_[i].defined()) continue;
    const auto key = compat::optimizer_state_key(state, shadow_[i]);
    auto it = dict.state.find(static_cast<int64_t>(i));
    if (it == dict.state.end()) {
      state.erase(key);
    } else {
      state[key] = it->second->clone();
    }
  }
  for (size_t g = 0; g < group_options_.size(); ++g) {
    groups[g].set_options(dict.param_groups[g].options->clone());
    group_options_[g] = std::shared_ptr<OptimizerOptions>(dict.param_groups[g].options->clone());
  }
}

// ---- ZeroStateDict files -------------------------------------------------------------------

void ZeroStateDict::save(std::ostream& out) const {
  torch::serialize::OutputArchive a;
  a.write("layout", bytes_tensor(layout));
  a.write("shard_numel", at::tensor(shard_numel.empty() ? std::vector<int64_t>{} : shard_numel, at::kLong));
  a.write("groups", at::tensor({static_cast<int64_t>(param_groups.size())}, at::kLong));
  for (size_t g = 0; g < param_groups.size(); ++g) {
    a.write("g" + std::to_string(g) + "_params", at::tensor(param_groups[g].params, at::kLong));
    a.write("g" + std::to_string(g) + "_options", bytes_tensor(options_bytes(*param_groups[g].options)));
  }
  std::vector<int64_t> keys;
  for (const auto& kv : state) {
    keys.push_back(kv.first);
    a.write("s" + std::to_string(kv.first), bytes_tensor(state_bytes(*kv.second)));
  }
  a.write("keys", at::tensor(keys, at::kLong));
  a.save_to(out);
}

ZeroStateDict ZeroStateDict::load(std::istream& in, const OptimizerFactory& factory) {
  torch::serialize::InputArchive a;
  a.load_from(in);
  // A fresh tensor per read: InputArchive::read re-points a defined tensor at the new data in place.
  auto read = [&a](const std::string& key) {
    at::Tensor t;
    a.read(key, t);
    return t;
  };
  auto longs = [](const at::Tensor& t) {
    at::Tensor c = t.to(at::kLong).contiguous();
    return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
  };
  ZeroStateDict d;
  d.layout = tensor_bytes(read("layout"));
  d.shard_numel = longs(read("shard_numel"));
  const int64_t groups = read("groups").item<int64_t>();
  for (int64_t g = 0; g < groups; ++g) {
    Group group;
    group.params = longs(read("g" + std::to_string(g) + "_params"));
    group.options = from_bytes(tensor_bytes(read("g" + std::to_string(g) + "_options")), factory.new_options());
    d.param_groups.push_back(std::move(group));
  }
  for (int64_t key : longs(read("keys")))
    d.state[key] = from_bytes(tensor_bytes(read("s" + std::to_string(key))), factory.new_state());
  return d;
}

}  // namespace ddpkit
