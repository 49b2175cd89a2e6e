// The strategies and hooks the planner knows, by the names the CLI and the JSON use, and the
// candidates `ddpkit plan` ranks (include/ddpkit/plan/cost_model.h).
#include <ddpkit/error.h>
#include <ddpkit/plan/cost_model.h>

#include <string>
#include <utility>

namespace ddpkit {
namespace plan {

namespace {

constexpr std::pair<Strategy, const char*> kStrategyNames[] = {
    {Strategy::kDdp, "ddp"},           {Strategy::kZero1, "zero1"},         {Strategy::kZero2, "zero2"},
    {Strategy::kFullShard, "full_shard"}, {Strategy::kShardGradOp, "shard_grad_op"}, {Strategy::kNoShard, "no_shard"},
    {Strategy::kHybridShard, "hybrid_shard"}};
constexpr std::pair<Hook, const char*> kHookNames[] = {
    {Hook::kNone, "none"},
    {Hook::kAllreduce, "allreduce"},
    {Hook::kFp16, "fp16"},
    {Hook::kBf16, "bf16"},
    {Hook::kFp16Wrapper, "fp16_wrapper"},
    {Hook::kBf16Wrapper, "bf16_wrapper"},
    {Hook::kInt8, "int8"},
    {Hook::kQuantizePerTensor, "quantize_per_tensor"},
    {Hook::kQuantizePerChannel, "quantize_per_channel"},
    {Hook::kPowerSgd, "powersgd"},
    {Hook::kBatchedPowerSgd, "batched_powersgd"},
    {Hook::kPostLocalSgd, "post_local_sgd"},
    {Hook::kNoop, "noop"}};

template <typename T, size_t N>
const char* name_in(const std::pair<T, const char*> (&names)[N], T value) {
  for (const auto& [v, name] : names)
    if (v == value) return name;
  return "?";
}

template <typename T, size_t N>
T value_in(const std::pair<T, const char*> (&names)[N], const std::string& name, const char* what) {
  std::string known;
  for (const auto& [v, n] : names) {
    if (name == n) return v;
    known += (known.empty() ? "" : ", ") + std::string(n);
  }
  DDPKIT_CHECK(false, "plan: unknown ", what, " '", name, "' (", known, ")");
  return names[0].first;
}

}  // namespace

const char* to_string(Strategy s) { return name_in(kStrategyNames, s); }
const char* to_string(Hook h) { return name_in(kHookNames, h); }
Strategy parse_strategy(const std::string& name) { return value_in(kStrategyNames, name, "strategy"); }
Hook parse_hook(const std::string& name) { return value_in(kHookNames, name, "hook"); }
bool is_fsdp(Strategy s) {
  return s == Strategy::kFullShard || s == Strategy::kShardGradOp || s == Strategy::kNoShard ||
         s == Strategy::kHybridShard;
}

std::vector<Candidate> candidates(const JobSpec& job) {
  std::vector<Candidate> out;
  auto add = [&](Strategy s, Hook h) {
    Candidate c;
    c.strategy = s;
    c.hook = h;
    out.push_back(c);
  };
  for (Hook h : {Hook::kNone, Hook::kAllreduce, Hook::kFp16, Hook::kBf16, Hook::kInt8, Hook::kPowerSgd})
    add(Strategy::kDdp, h);
  add(Strategy::kZero1, Hook::kNone);
  add(Strategy::kZero2, Hook::kNone);
  for (Strategy s : {Strategy::kFullShard, Strategy::kShardGradOp, Strategy::kNoShard})
    for (Hook h : {Hook::kNone, Hook::kBf16}) add(s, h);
  if (job.hosts > 1)
    for (Hook h : {Hook::kNone, Hook::kBf16}) add(Strategy::kHybridShard, h);
  return out;
}

std::string measured_extra_key(const Candidate& c) {
  return std::string(to_string(c.strategy)) + "/" + to_string(c.hook) +
         (c.mixed_precision() ? "+mp_" + c.param_dtype : "");
}

std::vector<Candidate> other_hook_candidates() {
  std::vector<Candidate> out;
  for (Hook h : {Hook::kFp16Wrapper, Hook::kBf16Wrapper, Hook::kQuantizePerTensor, Hook::kQuantizePerChannel,
                 Hook::kBatchedPowerSgd, Hook::kPostLocalSgd, Hook::kNoop}) {
    Candidate c;
    c.hook = h;
    out.push_back(c);
  }
  return out;
}

}  // namespace plan
}  // namespace ddpkit
