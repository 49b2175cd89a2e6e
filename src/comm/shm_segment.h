// The layout of a Domain's segment, shared by its translation units (shm_domain.cpp: the segment,
// its waits and the byte collectives; shm_allreduce.cpp: allreduce). Internal.
#pragma once

#include "shm_domain.h"

#include <c10/core/ScalarType.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>

namespace ddpkit {
namespace shm {
namespace layout {

constexpr uint64_t kMagic = 0x64647073686d3033ull;  // "ddpshm03"
constexpr int kMaxLocalRanks = 64;                   // codecs::sum_raw's bound on inputs
enum Counter { kArrived = 0, kReduced = 1, kDone = 2 };
enum Op : uint32_t { kAllreduce = 1, kReduceScatter, kAllgather, kBroadcast, kAlltoall, kBarrier };

inline const char* op_name(uint32_t op) {
  switch (op) {
    case kAllreduce: return "allreduce";
    case kReduceScatter: return "reduce_scatter";
    case kAllgather: return "allgather";
    case kBroadcast: return "broadcast";
    case kAlltoall: return "alltoall";
    case kBarrier: return "barrier";
  }
  return "?";
}

// "allreduce of 4096 Float elements": only ever formatted for an error.
inline std::string describe(const Announcement& a) {
  const bool sums = a.op == kAllreduce || a.op == kReduceScatter;
  std::ostringstream os;
  os << op_name(a.op) << " of " << a.size << " " << (sums ? c10::toString(static_cast<c10::ScalarType>(a.dtype)) : "byte")
     << " elements";
  if (a.op == kBroadcast) os << " from local rank " << a.root;
  return os.str();
}

struct alignas(64) Word {
  std::atomic<uint32_t> value{0};
};

struct RankControl {
  Word counters[3];
  Word sleepers;                     // peers asleep (futex) on one of this rank's counters
  alignas(64) Announcement said[2];  // by step parity: a slot's announcement lives as long as it
  SharedPart parts[2][kMaxSharedParts];  // by step parity, said[].shared_parts of them: allreduce_parts
};

struct Header {
  uint64_t magic;
  int64_t slot_bytes;
  int32_t local_size;
};

inline size_t round_up(size_t x, size_t to) { return (x + to - 1) / to * to; }
inline size_t control_offset() { return 64; }
inline size_t data_offset(int local_size) { return round_up(control_offset() + sizeof(RankControl) * local_size, 4096); }
inline size_t segment_bytes(int local_size, int64_t slot_bytes) {
  return data_offset(local_size) + static_cast<size_t>(local_size) * 2 * static_cast<size_t>(slot_bytes);
}

}  // namespace layout

struct Domain::Segment {
  using Header = layout::Header;
  using RankControl = layout::RankControl;
  static Header* header(void* base) { return static_cast<Header*>(base); }
  static RankControl* control(void* base, int r) {
    return reinterpret_cast<RankControl*>(static_cast<uint8_t*>(base) + layout::control_offset()) + r;
  }
};

}  // namespace shm
}  // namespace ddpkit
