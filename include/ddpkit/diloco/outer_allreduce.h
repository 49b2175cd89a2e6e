// DiLoCo's outer all-reduce: the weighted mean of every site's pseudo-gradient, moved as codec
// bytes with two quantizations in all, whatever the number of sites.
//
// The values are cut into pieces of size() chunks. Phase 1 (a reduce-scatter): each rank encodes
// chunk r once and sends it, with its weight, to rank r, which decodes the size() copies and sums
// them in fp32, each times weight / (sum of weights). Phase 2 (an all-gather): the owner encodes
// its mean once and sends it to everyone; every rank (the owner too) decodes the same bytes, so
// the result is bit-identical on all ranks. A ring that re-quantizes at every hop (PCCL, prime)
// adds one rounding per hop instead: its error grows with the ranks (bench/codec_bench.cpp).
// ProcessGroup::two_phase overlaps one piece's codec work with the others' transfers.
#pragma once

#include <ddpkit/codecs/codec.h>
#include <ddpkit/comm/process_group.h>

#include <memory>
#include <vector>

namespace ddpkit {
namespace diloco {

// How weighted_mean lays `numel` values out over `world` ranks in `pieces` pieces (a group's
// pieces_for(codec.encoded_bytes(numel) * (world - 1) / world)), and the bytes it sends.
struct OuterAllreduceLayout {
  int64_t pieces = 1, chunk = 0;       // elements per chunk: pieces x world chunks cover numel
  int64_t phase1_slot = 0, phase2_slot = 0;  // bytes per chunk on the wire in each phase
  // Bytes one rank sends to its peers: pieces * (world - 1) * (phase1_slot + phase2_slot), i.e.
  // 2(n-1)/n of the encoded values, plus a 16-byte trailer (weight, checksum) per phase-1 chunk.
  int64_t bytes_sent_per_rank = 0;
};
OuterAllreduceLayout outer_allreduce_layout(int64_t numel, int world, const codecs::Codec& codec, int64_t pieces);

struct WeightedMeanResult {
  double total_weight = 0;   // the sum of every rank's weight (0: the values were zeroed)
  int ranks_weighted = 0;    // ranks with a weight above 0
  // Whether every rank with a weight above 0 passed the same `checksum` (the owners compare them).
  bool checksums_agree = true;
  // The weighted ranks whose checksum differs from the one most of them passed (on a tie, the one
  // the lowest of the tied ranks passed), ascending: their values are left out of the mean, as if
  // their weight were 0. Every rank sees every rank's checksum, so all of them name the same ranks.
  std::vector<int> disagreeing;
};

// Error feedback for both quantizations (DiLoCoOptions::error_feedback): what each encoding rounded
// away, for the caller to add back next round, so a coarse codec's errors cancel over rounds
// instead of adding up. Float32, contiguous, one value per value.
struct MeanErrorFeedback {
  // Written: values - decode(this rank's phase-1 encoding of them). A retry sends the same values
  // and writes it again; the caller keeps the attempt that committed.
  at::Tensor sent;
  // Read and written at the positions this rank owns in phase 2 (where it encodes the mean): added
  // to the mean before it is encoded, then replaced by what that encoding lost. Other positions
  // are left as they are, so ownership may move between rounds (another world size). Untouched
  // when every weight is 0.
  at::Tensor mean;
};

// In place on every rank of `group`: values = sum_r weight_r * values_r / sum_r weight_r (zeros when
// every weight is 0), each value carried as `codec` bytes. `values`: contiguous float32 CPU. A null
// group is this rank alone (its own values, or zeros at weight 0).
// `checksum` travels beside (each owner compares the weighted ranks'): callers pass a hash of the
// state that must be equal everywhere. The future completes with `values`; on a CommError the
// values are unspecified. `result` (and `feedback`, when given) are filled before the future
// completes.
FuturePtr weighted_mean(ProcessGroup* group, const at::Tensor& values, float weight,
                        std::shared_ptr<const codecs::Codec> codec, uint64_t checksum = 0,
                        std::shared_ptr<WeightedMeanResult> result = nullptr,
                        std::shared_ptr<MeanErrorFeedback> feedback = nullptr);

}  // namespace diloco
}  // namespace ddpkit
