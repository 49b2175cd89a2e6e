// Allreduce between the ranks of one host (Domain::allreduce and allreduce_parts): through the
// slots, or in place in shared buffers, with parts that may lie in private memory or in other
// shared buffers (docs/shared_memory.md, "DDP's buckets sum in place").
#include "shm_domain.h"

#include "shm_segment.h"

#include <ddpkit/codecs/cast.h>
#include <ddpkit/error.h>

#include <algorithm>
#include <cstring>
#include <iterator>
#include <memory>
#include <mutex>
#include <vector>

namespace ddpkit {
namespace shm {
using namespace layout;

namespace {

// Copies elements [lo, hi) between `parts` and `buffer` (element i at buffer + i * elt), into
// the buffer or out of it; skips parts marked in `skip` (if given) and a part that is the buffer
// itself.
void copy_parts(const std::vector<Part>& parts, uint8_t* buffer, int64_t elt, int64_t lo, int64_t hi, bool into_buffer,
                const std::vector<bool>* skip = nullptr) {
  for (size_t k = 0; k < parts.size(); ++k) {
    const Part& p = parts[k];
    const int64_t a = std::max(lo, p.at), b = std::min(hi, p.at + p.numel);
    if (a >= b || (skip && (*skip)[k])) continue;
    uint8_t* own = static_cast<uint8_t*>(p.data) + (a - p.at) * elt;
    uint8_t* in_buffer = buffer + a * elt;
    if (own == in_buffer) continue;
    if (into_buffer) {
      std::memcpy(in_buffer, own, (b - a) * elt);
    } else {
      std::memcpy(own, in_buffer, (b - a) * elt);
    }
  }
}

// Each rank sums one slice of `count` elements: count / L, rounded up to whole cache lines.
int64_t slice_elements(int64_t count, int L, int64_t elt) {
  const int64_t align = std::max<int64_t>(1, 64 / elt);
  return ((count + L - 1) / L + align - 1) / align * align;
}

}  // namespace

void Domain::allreduce(void* data, int64_t numel, c10::ScalarType dtype, double scale) {
  allreduce_impl(data, numel, dtype, scale, nullptr);
}

void Domain::allreduce_parts(void* data, int64_t numel, c10::ScalarType dtype, double scale,
                             const std::vector<Part>& parts) {
  int64_t next = 0;
  for (const Part& p : parts) {
    DDPKIT_CHECK(p.at == next && p.numel >= 0 && (p.data || p.numel == 0), "shared-memory allreduce_parts: part at ",
                 p.at, " (", p.numel, " elements) does not follow element ", next);
    next += p.numel;
  }
  DDPKIT_CHECK(next == numel, "shared-memory allreduce_parts: parts hold ", next, " elements, the allreduce ", numel);
  DDPKIT_CHECK(find_buffer(data, numel * static_cast<int64_t>(c10::elementSize(dtype))),
               "shared-memory allreduce_parts: the scratch is not in a shared buffer");
  allreduce_impl(data, numel, dtype, scale, &parts);
}

std::pair<int64_t, int64_t> Domain::in_place_slice(int64_t numel, int64_t elt) const {
  const int64_t q = slice_elements(numel, options_.local_size, elt);
  return {std::min(numel, options_.local_rank * q), std::min(numel, (options_.local_rank + 1) * q)};
}

std::vector<SharedPart> Domain::list_shared_parts(const std::vector<Part>& parts, int64_t elt,
                                                  std::vector<bool>* listed) {
  std::vector<SharedPart> table;
  listed->assign(parts.size(), false);
  for (size_t k = 0; k < parts.size() && table.size() < static_cast<size_t>(kMaxSharedParts); ++k) {
    const Part& p = parts[k];
    if (p.numel == 0) continue;
    const std::shared_ptr<SharedBuffer> b = find_buffer(p.data, p.numel * elt);
    const uint8_t* own = static_cast<const uint8_t*>(p.data);
    if (!b || (b->id == call_.buffer && own == b->base[options_.local_rank] + call_.offset + p.at * elt)) continue;
    table.push_back(SharedPart{p.at, p.numel, b->id, own - b->base[options_.local_rank]});
    (*listed)[k] = true;
  }
  return table;
}

void Domain::allreduce_impl(void* data, int64_t numel, c10::ScalarType dtype, double scale,
                            const std::vector<Part>* parts) {
  DDPKIT_CHECK(codecs::sums_raw(dtype), "shared-memory allreduce: no sum for ", dtype);
  begin(kAllreduce, numel, dtype, 0);
  const int L = options_.local_size, me = options_.local_rank;
  const int64_t elt = static_cast<int64_t>(c10::elementSize(dtype));
  auto* base = static_cast<uint8_t*>(data);
  const std::shared_ptr<SharedBuffer> shared = find_buffer(base, numel * elt);
  if (shared) {
    call_.buffer = shared->id;
    call_.offset = base - shared->base[me];
  }
  // Each rank sums one slice of every step's chunk: slices are whole cache lines.
  const int64_t align = std::max<int64_t>(1, 64 / elt);
  const int64_t per_step = std::max<int64_t>(align * L, options_.slot_bytes / elt / (align * L) * (align * L));
  const auto [lo, hi] = in_place_slice(numel, elt);
  const int64_t first_chunk = std::min(per_step, numel);
  // Parts that lie in shared buffers are read and written there by peers: listed in my part table
  // (written once the step's parity is mine), not copied.
  std::vector<bool> listed;
  std::vector<SharedPart> table;
  if (parts) {
    table = list_shared_parts(*parts, elt, &listed);
    call_.shared_parts = static_cast<int32_t>(table.size());
    // Peers read my buffer outside my slice, and the first step's slot is filled from the buffer
    // before the path is known: those go in now; the rest only if the slots are taken.
    copy_parts(*parts, base, elt, 0, first_chunk, true);
    copy_parts(*parts, base, elt, std::max(first_chunk, hi), numel, true, &listed);
    if (first_chunk < lo) copy_parts(*parts, base, elt, first_chunk, lo, true, &listed);
  }
  const void* inputs[kMaxLocalRanks];
  for (int64_t off = 0, first = 1; first || off < numel; first = 0) {
    const int64_t c = std::min(per_step, numel - off);
    const int64_t q = slice_elements(c, L, elt);
    auto len = [&](int j) { return std::max<int64_t>(0, std::min(c, (j + 1) * q) - j * q); };
    const uint32_t s = step_;
    claim(s, first);
    if (first && !table.empty()) std::copy(table.begin(), table.end(), Segment::control(base_, me)->parts[s & 1]);
    uint8_t* mine = slot(me, s);
    for (int j = 0; j < L; ++j)
      if (j != me && len(j) > 0) std::memcpy(mine + j * q * elt, base + (off + j * q) * elt, len(j) * elt);
    arrive(s, first);
    // The first step's slot was filled all the same: which path to take is known only now.
    if (first && in_place_everywhere(s))
      return allreduce_in_place(*shared, call_.offset, numel, dtype, scale, s, parts, listed);
    if (first && parts) copy_parts(*parts, base, elt, first_chunk, numel, true);
    if (len(me) > 0) {
      // My slice is summed where it lies and copied to my slot for the peers while still in cache:
      // a cold read of the slice less than summing into the slot and copying it back out.
      uint8_t* own = base + (off + me * q) * elt;
      int k = 0;
      inputs[k++] = own;
      for (int p = 0; p < L; ++p)
        if (p != me) inputs[k++] = slot(p, s) + me * q * elt;
      codecs::sum_raw(dtype, inputs, k, own, len(me), scale);
      std::memcpy(mine + me * q * elt, own, len(me) * elt);
    }
    publish(kReduced, s + 1);
    wait_all(kReduced, s + 1);
    for (int j = 0; j < L; ++j)
      if (j != me && len(j) > 0) std::memcpy(base + (off + j * q) * elt, slot(j, s) + j * q * elt, len(j) * elt);
    finish(s);
    off += c;
  }
  if (parts) copy_parts(*parts, base, elt, 0, numel, false);
}

bool Domain::in_place_everywhere(uint32_t s) const {
  if (call_.buffer < 0) return false;
  for (int p = 0; p < options_.local_size; ++p) {
    const Announcement& a = Segment::control(base_, p)->said[s & 1];
    if (a.buffer != call_.buffer || a.offset != call_.offset) return false;
  }
  return true;
}

std::vector<PeerPart> Domain::map_peer_parts(int p, uint32_t s, int64_t elt,
                                             std::vector<std::shared_ptr<SharedBuffer>>* held) {
  const RankControl* peer = Segment::control(base_, p);
  const int n = std::min<int>(kMaxSharedParts, std::max<int>(0, peer->said[s & 1].shared_parts));
  std::vector<PeerPart> out;
  int64_t bad = -1;  // the buffer of an entry this rank cannot map
  {
    std::lock_guard<std::mutex> lock(buffers_mutex_);
    for (int k = 0; k < n && bad < 0; ++k) {
      const SharedPart t = peer->parts[s & 1][k];
      auto it = buffers_by_id_.find(t.buffer);
      std::shared_ptr<SharedBuffer> b = it == buffers_by_id_.end() ? nullptr : it->second.lock();
      if (!b || t.offset < 0 || static_cast<size_t>(t.offset + t.numel * elt) > b->bytes) {
        bad = t.buffer;
        break;
      }
      out.push_back(PeerPart{t.at, t.numel, b->base[p] + t.offset});
      held->push_back(std::move(b));
    }
  }
  if (bad >= 0)
    fail("rank " + std::to_string(group_rank(p)) + " (on this host) named a part in shared buffer #" +
         std::to_string(bad) + " that this rank does not map, during shared-memory " + describe(call_));
  return out;
}

// Every rank's data are in place in its own buffer (or, with `parts`, its own slice in its parts
// and the rest in its buffer or its listed parts), and every rank maps every peer's buffers: rank
// j sums slice j of all of them and writes the sum into its own copy and every peer's. A rank
// reads and writes only its slice of peers' memory, so no two ranks touch the same bytes;
// `reduced` says a rank's slice is everywhere. Per element that is L reads and L writes across
// the host, against the slot path's copy in, sum and copy out. A peer that called allreduce() on
// its buffer sums here too: what each rank leaves in the others' memory is the same.
void Domain::allreduce_in_place(const SharedBuffer& buffer, int64_t offset, int64_t numel, c10::ScalarType dtype,
                                double scale, uint32_t s, const std::vector<Part>* parts,
                                const std::vector<bool>& listed) {
  const int L = options_.local_size, me = options_.local_rank;
  const int64_t elt = static_cast<int64_t>(c10::elementSize(dtype));
  const int64_t align = std::max<int64_t>(1, 64 / elt);
  const auto [lo, hi] = in_place_slice(numel, elt);
  // Chunks small enough that the copies out read the sum from cache.
  const int64_t chunk = std::max<int64_t>(align, std::min<int64_t>(options_.slot_bytes, 256 << 10) / elt);
  // The parts peers listed, mapped once (and held for the collective): the sums take no lock.
  std::vector<std::vector<PeerPart>> peer_parts(L);
  std::vector<std::shared_ptr<SharedBuffer>> held;
  for (int p = 0; p < L; ++p)
    if (p != me) peer_parts[p] = map_peer_parts(p, s, elt, &held);
  // Where peer p keeps element i: in a listed part, or its buffer; *run elements on alike.
  auto where = [&](int p, int64_t i, int64_t* run) -> uint8_t* {
    const std::vector<PeerPart>& t = peer_parts[p];  // ascending in `at`
    auto e = std::upper_bound(t.begin(), t.end(), i, [](int64_t x, const PeerPart& q) { return x < q.at; });
    if (e != t.begin() && i < std::prev(e)->at + std::prev(e)->numel) {
      *run = std::prev(e)->at + std::prev(e)->numel - i;
      return std::prev(e)->data + (i - std::prev(e)->at) * elt;
    }
    *run = (e == t.end() ? numel : e->at) - i;
    return buffer.base[p] + offset + i * elt;
  };
  const void* inputs[kMaxLocalRanks];
  uint8_t* theirs[kMaxLocalRanks];
  // Elements [from, to) of my slice, whose own copy is at `own`.
  auto sum = [&](int64_t from, int64_t to, uint8_t* own) {
    for (int64_t i = from; i < to;) {
      int64_t n = std::min(chunk, to - i);
      int k = 0;
      inputs[k++] = own;  // first: `out` may alias inputs, and the order matches the slot path's
      for (int p = 0; p < L; ++p) {
        if (p == me) continue;
        int64_t run = 0;
        theirs[p] = where(p, i, &run);
        n = std::min(n, run);
        inputs[k++] = theirs[p];
      }
      codecs::sum_raw(dtype, inputs, k, own, n, scale);
      for (int p = 0; p < L; ++p)
        if (p != me) std::memcpy(theirs[p], own, n * elt);
      own += n * elt;
      i += n;
    }
  };
  if (!parts) {
    sum(lo, hi, buffer.base[me] + offset + lo * elt);
  } else {
    for (const Part& p : *parts) {
      const int64_t a = std::max(lo, p.at), b = std::min(hi, p.at + p.numel);
      if (a < b) sum(a, b, static_cast<uint8_t*>(p.data) + (a - p.at) * elt);
    }
  }
  publish(kReduced, s + 1);
  wait_all(kReduced, s + 1);
  if (parts) {
    // Peers wrote their shares into my listed parts where they lie; the rest are in my buffer.
    uint8_t* mine = buffer.base[me] + offset;
    copy_parts(*parts, mine, elt, 0, lo, false, &listed);
    copy_parts(*parts, mine, elt, hi, numel, false, &listed);
  }
  finish(s);
}

}  // namespace shm
}  // namespace ddpkit
