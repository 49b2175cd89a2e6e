// DiLoCo's outer all-reduce (include/ddpkit/diloco/outer_allreduce.h) on ProcessGroup::two_phase.
#include <ddpkit/diloco/outer_allreduce.h>
#include <ddpkit/error.h>

#include <cstring>
#include <map>
#include <mutex>

namespace ddpkit {
namespace diloco {
namespace {

constexpr int64_t kTrailer = 16;  // float weight, 4 bytes of zeros, uint64 checksum

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

struct Job {
  at::Tensor flat, send1, recv1, send2, recv2;
  std::shared_ptr<const codecs::Codec> codec;
  int64_t world = 1, me = 0, numel = 0, chunk = 0, s1 = 0, s2 = 0, enc = 0;
  float weight = 0;
  uint64_t checksum = 0;
  std::shared_ptr<WeightedMeanResult> result;
  std::shared_ptr<MeanErrorFeedback> feedback;
  mutable std::mutex result_mu;

  int64_t offset(int64_t p, int64_t r) const { return std::min((p * world + r) * chunk, numel); }
  int64_t valid(int64_t p, int64_t r) const { return std::min(chunk, numel - offset(p, r)); }
  at::Tensor slot1(const at::Tensor& t, int64_t p, int64_t r) const { return t.narrow(0, (p * world + r) * s1, s1); }
  at::Tensor slot2(const at::Tensor& t, int64_t p, int64_t r) const { return t.narrow(0, (p * world + r) * s2, s2); }

  void encode(int64_t p) const {
    for (int64_t r = 0; r < world; ++r) {
      at::Tensor slot = slot1(send1, p, r);
      // The last chunks are short: the codec pads them with zeros.
      const at::Tensor lost = feedback ? feedback->sent.narrow(0, offset(p, r), valid(p, r)) : at::Tensor();
      codec->encode_padded(flat.narrow(0, offset(p, r), valid(p, r)), chunk, slot.narrow(0, 0, enc), 1.0f, lost);
      uint8_t* trailer = slot.data_ptr<uint8_t>() + s1 - kTrailer;
      std::memset(trailer, 0, kTrailer);
      std::memcpy(trailer, &weight, sizeof(float));
      std::memcpy(trailer + 8, &checksum, sizeof(uint64_t));
    }
  }

  void reduce(int64_t p) const {
    std::vector<float> weights(static_cast<size_t>(world));
    std::vector<uint64_t> sums(static_cast<size_t>(world));
    for (int64_t r = 0; r < world; ++r) {
      const uint8_t* trailer = slot1(recv1, p, r).data_ptr<uint8_t>() + s1 - kTrailer;
      std::memcpy(&weights[r], trailer, sizeof(float));
      std::memcpy(&sums[r], trailer + 8, sizeof(uint64_t));
    }
    // The checksum most weighted ranks passed (ties: the lowest such rank's); the others' values
    // stay out of the mean: a site whose global parameters differ would pull every site off.
    std::map<uint64_t, int> votes;
    for (int64_t r = 0; r < world; ++r)
      if (weights[r] > 0) ++votes[sums[r]];
    uint64_t majority = 0;
    int most = 0;
    for (int64_t r = 0; r < world; ++r)
      if (weights[r] > 0 && votes[sums[r]] > most) {
        most = votes[sums[r]];
        majority = sums[r];
      }
    std::vector<int> disagreeing;
    for (int64_t r = 0; r < world; ++r)
      if (weights[r] > 0 && sums[r] != majority) {
        disagreeing.push_back(static_cast<int>(r));
        weights[r] = 0;
      }
    double total = 0;
    int weighted = 0;
    for (int64_t r = 0; r < world; ++r)
      if (weights[r] > 0) {
        total += weights[r];
        ++weighted;
      }
    at::Tensor mean = at::zeros({chunk}, at::kFloat);
    bool started = false;
    for (int64_t r = 0; r < world && total > 0; ++r) {
      if (!(weights[r] > 0)) continue;  // a weight-0 rank (a site that just healed) adds nothing
      codec->decode(slot1(recv1, p, r).narrow(0, 0, enc), mean, static_cast<float>(weights[r] / total), started);
      started = true;
    }
    at::Tensor mine = slot2(send2, p, me);
    const int64_t v = valid(p, me);
    if (feedback && total > 0 && v > 0) {
      // The mean plus what this owner's last encodings of these positions lost; then this one's.
      at::Tensor carried = feedback->mean.narrow(0, offset(p, me), v);
      mean.narrow(0, 0, v).add_(carried);
      codec->encode_padded(mean.narrow(0, 0, v), chunk, mine.narrow(0, 0, enc), 1.0f, carried);
    } else {
      codec->encode(mean, mine.narrow(0, 0, enc));
    }
    for (int64_t r = 0; r < world; ++r)
      if (r != me) slot2(send2, p, r).copy_(mine);
    if (result) {  // every piece finds the same; pieces may be reduced on several threads
      std::lock_guard<std::mutex> lock(result_mu);
      result->total_weight = total;
      result->ranks_weighted = weighted;
      result->checksums_agree = disagreeing.empty();
      result->disagreeing = disagreeing;
    }
  }

  void decode(int64_t p) const {
    for (int64_t r = 0; r < world; ++r) {
      const int64_t v = valid(p, r);
      if (v <= 0) continue;
      codec->decode_prefix(slot2(recv2, p, r).narrow(0, 0, enc), chunk, flat.narrow(0, offset(p, r), v));
    }
  }
};

}  // namespace

OuterAllreduceLayout outer_allreduce_layout(int64_t numel, int world, const codecs::Codec& codec, int64_t pieces) {
  DDPKIT_CHECK(world >= 1, "outer all-reduce: world size must be >= 1, got ", world);
  DDPKIT_CHECK(numel >= 0, "outer all-reduce: numel must be >= 0, got ", numel);
  DDPKIT_CHECK(pieces >= 1, "outer all-reduce: pieces must be >= 1, got ", pieces);
  OuterAllreduceLayout l;
  if (numel == 0 || world == 1) return l;
  l.pieces = pieces;
  const int64_t per_chunk = (numel + world * l.pieces - 1) / (world * l.pieces);
  l.chunk = round_up(std::max<int64_t>(per_chunk, 1), codec.block());
  l.phase2_slot = round_up(codec.encoded_bytes(l.chunk), 8);
  l.phase1_slot = l.phase2_slot + kTrailer;
  l.bytes_sent_per_rank = l.pieces * (world - 1) * (l.phase1_slot + l.phase2_slot);
  return l;
}

FuturePtr weighted_mean(ProcessGroup* group, const at::Tensor& values, float weight,
                        std::shared_ptr<const codecs::Codec> codec, uint64_t checksum,
                        std::shared_ptr<WeightedMeanResult> result, std::shared_ptr<MeanErrorFeedback> feedback) {
  DDPKIT_CHECK(codec, "outer all-reduce: no codec");
  DDPKIT_CHECK(values.device().is_cpu() && values.scalar_type() == at::kFloat && values.is_contiguous(),
               "outer all-reduce: values must be contiguous float32 on the CPU, got ", values.scalar_type(), " on ",
               values.device());
  DDPKIT_CHECK(weight >= 0 && std::isfinite(weight), "outer all-reduce: the weight must be finite and >= 0, got ", weight);
  const int world = group ? group->size() : 1;
  at::Tensor flat = values.view({-1});
  if (feedback) {
    for (const at::Tensor* t : {&feedback->sent, &feedback->mean})
      DDPKIT_CHECK(t->defined() && t->device().is_cpu() && t->scalar_type() == at::kFloat && t->is_contiguous() &&
                       t->numel() == flat.numel(),
                   "outer all-reduce: error feedback needs contiguous float32 CPU tensors of ", flat.numel(),
                   " values (sent, mean)");
  }
  if (world == 1 || flat.numel() == 0) {
    // Alone, nothing is encoded: nothing is lost.
    if (feedback) feedback->sent.zero_();
    if (!(weight > 0)) flat.zero_();
    if (result) {
      result->total_weight = weight;
      result->ranks_weighted = weight > 0 ? 1 : 0;
    }
    return completed_future(values);
  }
  // Each phase sends (n-1)/n of the encoded values, cut as the group cuts two-phase collectives.
  const uint64_t per_rank = static_cast<uint64_t>(codec->encoded_bytes(flat.numel())) * (world - 1) / world;
  const OuterAllreduceLayout l = outer_allreduce_layout(flat.numel(), world, *codec, group->pieces_for(per_rank));
  auto job = std::make_shared<Job>();
  job->flat = flat;
  job->codec = std::move(codec);
  job->world = world;
  job->me = group->rank();
  job->numel = flat.numel();
  job->chunk = l.chunk;
  job->s1 = l.phase1_slot;
  job->s2 = l.phase2_slot;
  job->enc = job->codec->encoded_bytes(l.chunk);
  job->weight = weight;
  job->checksum = checksum;
  job->result = std::move(result);
  job->feedback = std::move(feedback);
  if (job->result) *job->result = WeightedMeanResult{};
  // Fresh buffers: an aborted collective may still write into them after its future failed.
  job->send1 = at::empty({l.pieces * world * l.phase1_slot}, at::kByte);
  job->recv1 = at::empty({l.pieces * world * l.phase1_slot}, at::kByte);
  job->send2 = at::empty({l.pieces * world * l.phase2_slot}, at::kByte);
  job->recv2 = at::empty({l.pieces * world * l.phase2_slot}, at::kByte);
  auto two = std::make_shared<TwoPhaseJob>();
  two->pieces = l.pieces;
  two->send1 = job->send1;
  two->recv1 = job->recv1;
  two->send2 = job->send2;
  two->recv2 = job->recv2;
  two->encode = [job](int64_t p) { job->encode(p); };
  two->reduce = [job](int64_t p) { job->reduce(p); };
  two->decode = [job](int64_t p) { job->decode(p); };
  return group->two_phase(std::move(two), values,
                         "the outer all-reduce (" + job->codec->name() + ", " + std::to_string(job->numel) + " values)");
}

}  // namespace diloco
}  // namespace ddpkit
