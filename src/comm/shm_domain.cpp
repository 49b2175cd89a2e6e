#include "shm_domain.h"

#include "futex.h"
#include "peer_memory.h"

#include <ddpkit/codecs/cast.h>
#include <ddpkit/error.h>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <fcntl.h>
#include <immintrin.h>
#include <sched.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <sstream>
#include <stdexcept>

namespace ddpkit {
namespace shm {
namespace {

constexpr uint64_t kMagic = 0x64647073686d3033ull;  // "ddpshm03"
constexpr int kMaxLocalRanks = 64;                   // codecs::sum_raw's bound on inputs
enum Counter { kArrived = 0, kReduced = 1, kDone = 2 };
enum Op : uint32_t { kAllreduce = 1, kReduceScatter, kAllgather, kBroadcast, kAlltoall, kBarrier };

const char* op_name(uint32_t op) {
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
std::string describe(const Announcement& a) {
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

size_t round_up(size_t x, size_t to) { return (x + to - 1) / to * to; }
size_t control_offset() { return 64; }
size_t data_offset(int local_size) { return round_up(control_offset() + sizeof(RankControl) * local_size, 4096); }
size_t segment_bytes(int local_size, int64_t slot_bytes) {
  return data_offset(local_size) + static_cast<size_t>(local_size) * 2 * static_cast<size_t>(slot_bytes);
}

bool reached(uint32_t value, uint32_t target) { return static_cast<int32_t>(value - target) >= 0; }

std::string errno_text(int e) { return std::strerror(e); }

// Holds each rank's liveness lock: the kernel drops it when the process dies.
bool lock_byte(int fd, int index) {
  struct flock fl {};
  fl.l_type = F_WRLCK;
  fl.l_whence = SEEK_SET;
  fl.l_start = index;
  fl.l_len = 1;
  return fcntl(fd, F_OFD_SETLK, &fl) == 0;
}

std::string text(const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); }
std::vector<uint8_t> bytes(const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); }

// After each local rank has mapped what its peers created (or failed to, `failure`): the last
// to say so lets everyone on, and then owners may close the fds peers opened through /proc. Returns the failure some rank published
// under `prefix`, or that the ranks did not all get there within `timeout`; empty if none.
std::string meet_once_mapped(c10d::Store& store, const std::string& prefix, int local_size,
                             std::chrono::milliseconds timeout, const std::string& failure, const std::string& what) {
  if (!failure.empty()) store.set(prefix + "error", bytes(failure));
  if (store.add(prefix + "mapped", 1) == local_size) store.set(prefix + "ready", bytes("1"));
  try {
    store.wait({prefix + "ready"}, timeout);
    return store.check({prefix + "error"}) ? text(store.get(prefix + "error")) : std::string();
  } catch (const std::exception& e) {
    return "not every local rank mapped " + what + " within " + std::to_string(timeout.count()) + " ms (" + e.what() +
           ")";
  }
}

}  // namespace

struct Domain::Segment {
  static Header* header(void* base) { return static_cast<Header*>(base); }
  static RankControl* control(void* base, int r) {
    return reinterpret_cast<RankControl*>(static_cast<uint8_t*>(base) + control_offset()) + r;
  }
};

std::unique_ptr<Domain> Domain::create(c10d::Store& store, const std::string& key, DomainOptions o) {
  DDPKIT_CHECK(o.local_size >= 1 && o.local_rank >= 0 && o.local_rank < o.local_size, "shared memory: local rank ",
               o.local_rank, " of ", o.local_size);
  DDPKIT_CHECK(o.local_size <= kMaxLocalRanks, "shared memory supports at most ", kMaxLocalRanks,
               " ranks per host, got ", o.local_size);
  const bool leader = o.local_rank == 0;
  std::string error;
  int fd = -1;
  void* base = nullptr;
  size_t size = 0;
  if (leader) {
    size = segment_bytes(o.local_size, o.slot_bytes);
    fd = detail::create_peer_memory("ddpkit-shm", size, &base, &error);
    if (fd >= 0) {
      new (base) Header{kMagic, o.slot_bytes, o.local_size};
      for (int r = 0; r < o.local_size; ++r) new (Segment::control(base, r)) RankControl();
    }
    store.set(key + "/address", bytes(error.empty() ? detail::peer_memory_address(fd) : "!" + error));
  } else {
    try {
      store.wait({key + "/address"}, o.timeout);
    } catch (const std::exception& e) {
      throw std::runtime_error("shared memory: local rank 0 did not publish the segment within " +
                               std::to_string(o.timeout.count()) + " ms (" + e.what() + ")");
    }
    const std::string said = text(store.get(key + "/address"));
    if (!said.empty() && said[0] == '!') throw std::runtime_error("shared memory: local rank 0: " + said.substr(1));
    detail::PeerMemoryAddress address;
    if (!detail::parse_peer_memory_address(said, &address)) {
      error = "local rank 0 published no segment address (\"" + said + "\")";
    } else if (address.bytes < sizeof(Header)) {
      error = "local rank 0's segment is too small to be one";
    } else if (!(base = detail::map_peer_memory(address, &error, &fd))) {
      error = "local rank 0's segment: " + error;
    } else {
      size = address.bytes;
      const Header* h = Segment::header(base);
      if (h->magic != kMagic || h->local_size != o.local_size || size < segment_bytes(h->local_size, h->slot_bytes)) {
        error = "local rank 0's segment does not match this group (" + std::to_string(o.local_size) + " local ranks)";
      } else {
        o.slot_bytes = h->slot_bytes;
      }
    }
  }
  if (error.empty() && !lock_byte(fd, o.local_rank)) error = "cannot lock the segment: " + errno_text(errno);
  const std::string failure =
      meet_once_mapped(store, key + "/", o.local_size, o.timeout,
                       error.empty() ? "" : "local rank " + std::to_string(o.local_rank) + ": " + error, "the segment");
  if (!failure.empty()) {
    if (base) munmap(base, size);
    if (fd >= 0) close(fd);
    throw std::runtime_error("shared memory: " + failure);
  }
  return std::unique_ptr<Domain>(new Domain(std::move(o), fd, base, size));
}

Domain::Domain(DomainOptions options, int fd, void* base, size_t bytes)
    : options_(std::move(options)), fd_(fd), base_(base), bytes_(bytes) {}

Domain::~Domain() {
  if (base_) munmap(base_, bytes_);
  if (fd_ >= 0) close(fd_);
}

uint8_t* Domain::slot(int rank, uint32_t step) const {
  return static_cast<uint8_t*>(base_) + data_offset(options_.local_size) +
         (static_cast<size_t>(rank) * 2 + (step & 1)) * static_cast<size_t>(options_.slot_bytes);
}

void Domain::fail(const std::string& message) {
  broken_ = message;
  {
    std::lock_guard<std::mutex> lock(buffers_mutex_);
    for (auto& [base, weak] : buffers_)
      if (auto b = weak.lock()) b->poisoned.store(true);
  }
  throw std::runtime_error(message);
}

bool Domain::peer_alive(int peer) const {
  struct flock fl {};
  fl.l_type = F_WRLCK;
  fl.l_whence = SEEK_SET;
  fl.l_start = peer;
  fl.l_len = 1;
  if (fcntl(fd_, F_OFD_GETLK, &fl) != 0) return true;  // cannot tell: the deadline still holds
  return fl.l_type != F_UNLCK;
}

void Domain::publish(int counter, uint32_t value) {
  RankControl* me = Segment::control(base_, options_.local_rank);
  me->counters[counter].value.store(value, std::memory_order_seq_cst);
  if (me->sleepers.value.load(std::memory_order_seq_cst) > 0)
    detail::futex_wake_all(me->counters[counter].value);
}

int Domain::group_rank(int local) const {
  return options_.group_ranks.empty() ? local : options_.group_ranks[local];
}

void Domain::wait_peer(int peer, int counter, uint32_t target) {
  RankControl* p = Segment::control(base_, peer);
  std::atomic<uint32_t>& word = p->counters[counter].value;
  if (reached(word.load(std::memory_order_acquire), target)) return;
  // Peers usually arrive within microseconds: spin, then yield, then sleep.
  for (int i = 0; i < 2000; ++i) {
    _mm_pause();
    if (reached(word.load(std::memory_order_acquire), target)) return;
  }
  const auto yield_until = std::chrono::steady_clock::now() + std::chrono::microseconds(100);
  while (std::chrono::steady_clock::now() < yield_until) {
    sched_yield();
    if (reached(word.load(std::memory_order_acquire), target)) return;
  }
  for (int round = 1;; ++round) {
    p->sleepers.value.fetch_add(1, std::memory_order_seq_cst);
    const uint32_t seen = word.load(std::memory_order_seq_cst);
    if (!reached(seen, target)) {
      const timespec nap{0, 2 * 1000 * 1000};  // a missed wake costs at most this
      detail::futex_wait(word, seen, nap);
    }
    p->sleepers.value.fetch_sub(1, std::memory_order_seq_cst);
    if (reached(word.load(std::memory_order_acquire), target)) return;
    if (round % 16 == 0 && !peer_alive(peer))
      fail("rank " + std::to_string(group_rank(peer)) + " (on this host) died during shared-memory " + describe(call_));
    if (std::chrono::steady_clock::now() > deadline_)
      fail("rank " + std::to_string(group_rank(peer)) + " (on this host) did not take its part in shared-memory " +
           describe(call_) + " within " + std::to_string(options_.timeout.count()) +
           " ms (stopped, hung, or not calling the same collective)");
  }
}

void Domain::wait_all(int counter, uint32_t target) {
  for (int p = 0; p < options_.local_size; ++p)
    if (p != options_.local_rank) wait_peer(p, counter, target);
}

void Domain::begin(uint32_t op, int64_t size, c10::ScalarType dtype, int root) {
  call_ = Announcement{op, static_cast<int32_t>(dtype), size, root};
  if (!broken_.empty()) throw std::runtime_error("shared memory is unusable after an earlier failure: " + broken_);
  deadline_ = std::chrono::steady_clock::now() + options_.timeout;
}

void Domain::claim(uint32_t s, bool first) {
  wait_all(kDone, s - 1);
  if (first) Segment::control(base_, options_.local_rank)->said[s & 1] = call_;
}

void Domain::check(int peer, uint32_t s) {
  const Announcement a = Segment::control(base_, peer)->said[s & 1];
  // Byte collectives announce dtype Byte on every rank; sums announce theirs.
  if (a.op == call_.op && a.size == call_.size && a.root == call_.root && a.dtype == call_.dtype) return;
  fail("rank " + std::to_string(group_rank(peer)) + " (on this host) called " + describe(a) + " where this rank called " +
       describe(call_) + ": every rank must issue the same collectives in the same order");
}

void Domain::arrive(uint32_t s, bool first) {
  publish(kArrived, s + 1);
  wait_all(kArrived, s + 1);
  if (first)
    for (int p = 0; p < options_.local_size; ++p)
      if (p != options_.local_rank) check(p, s);
}

void Domain::finish(uint32_t s) {
  publish(kDone, s + 1);
  step_ = s + 1;
}

void Domain::pack(uint32_t s, const uint8_t* src, int64_t src_stride, int64_t part_bytes, int64_t bytes) {
  uint8_t* mine = slot(options_.local_rank, s);
  for (int j = 0; j < options_.local_size; ++j)
    if (j != options_.local_rank && bytes > 0) std::memcpy(mine + j * part_bytes, src + j * src_stride, bytes);
}

// ---- collectives ---------------------------------------------------------------------------------
// Each step: claim my slot, fill it, arrive; wait for every peer to arrive; read their slots; done.

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
  const int L = options_.local_size, me = options_.local_rank;
  const int64_t align = std::max<int64_t>(1, 64 / elt);
  const int64_t q = ((numel + L - 1) / L + align - 1) / align * align;
  return {std::min(numel, me * q), std::min(numel, (me + 1) * q)};
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
    const int64_t q = ((c + L - 1) / L + align - 1) / align * align;  // slice: c / L, rounded up to `align`
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
      int k = 0;
      inputs[k++] = base + (off + me * q) * elt;
      for (int p = 0; p < L; ++p)
        if (p != me) inputs[k++] = slot(p, s) + me * q * elt;
      codecs::sum_raw(dtype, inputs, k, mine + me * q * elt, len(me), scale);
    }
    publish(kReduced, s + 1);
    wait_all(kReduced, s + 1);
    for (int j = 0; j < L; ++j)
      if (len(j) > 0) std::memcpy(base + (off + j * q) * elt, slot(j, s) + j * q * elt, len(j) * elt);
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

uint8_t* Domain::peer_element(int p, uint32_t s, const SharedBuffer& buffer, int64_t offset, int64_t i, int64_t elt,
                              int64_t* run) {
  const RankControl* peer = Segment::control(base_, p);
  const int n = std::min<int>(kMaxSharedParts, std::max<int>(0, peer->said[s & 1].shared_parts));
  const SharedPart* table = peer->parts[s & 1];
  // The table is ascending in `at`: the last entry starting at or before i.
  const SharedPart* e = std::upper_bound(table, table + n, i, [](int64_t x, const SharedPart& t) { return x < t.at; });
  if (e != table && i < (e - 1)->at + (e - 1)->numel) {
    const SharedPart& t = *(e - 1);
    std::shared_ptr<SharedBuffer> b;
    {
      std::lock_guard<std::mutex> lock(buffers_mutex_);
      auto it = buffers_by_id_.find(t.buffer);
      if (it != buffers_by_id_.end()) b = it->second.lock();
    }
    const int64_t bytes = (t.at + t.numel - i) * elt;
    if (!b || t.offset < 0 || static_cast<size_t>(t.offset + (i - t.at) * elt + bytes) > b->bytes)
      fail("rank " + std::to_string(group_rank(p)) + " (on this host) named a part in shared buffer #" +
           std::to_string(t.buffer) + " that this rank does not map, during shared-memory " + describe(call_));
    *run = t.at + t.numel - i;
    return b->base[p] + t.offset + (i - t.at) * elt;  // the mapping outlives the collective: the peer holds it
  }
  *run = (e == table + n ? call_.size : e->at) - i;
  return buffer.base[p] + offset + i * elt;
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
        theirs[p] = peer_element(p, s, buffer, offset, i, elt, &run);
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

void Domain::reduce_scatter(const void* in, void* out, int64_t numel, c10::ScalarType dtype, int64_t in_stride) {
  if (in_stride < 0) in_stride = numel;
  DDPKIT_CHECK(codecs::sums_raw(dtype), "shared-memory reduce_scatter: no sum for ", dtype);
  begin(kReduceScatter, numel, dtype, 0);
  const int L = options_.local_size, me = options_.local_rank;
  const int64_t elt = static_cast<int64_t>(c10::elementSize(dtype));
  const auto* src = static_cast<const uint8_t*>(in);
  auto* dst = static_cast<uint8_t*>(out);
  const int64_t per_step = std::max<int64_t>(1, options_.slot_bytes / elt / L);  // one part per rank
  const void* inputs[kMaxLocalRanks];
  for (int64_t off = 0, first = 1; first || off < numel; first = 0) {
    const int64_t c = std::min(per_step, numel - off);
    const uint32_t s = step_;
    claim(s, first);
    pack(s, src + off * elt, in_stride * elt, per_step * elt, c * elt);
    arrive(s, first);
    if (c > 0) {
      int k = 0;
      inputs[k++] = src + (me * in_stride + off) * elt;
      for (int p = 0; p < L; ++p)
        if (p != me) inputs[k++] = slot(p, s) + me * per_step * elt;
      codecs::sum_raw(dtype, inputs, k, dst + off * elt, c);
    }
    finish(s);
    off += c;
  }
}

void Domain::allgather(const void* in, void* out, int64_t bytes, int64_t out_stride) {
  if (out_stride < 0) out_stride = bytes;
  begin(kAllgather, bytes, c10::ScalarType::Byte, 0);
  const int L = options_.local_size, me = options_.local_rank;
  const auto* src = static_cast<const uint8_t*>(in);
  auto* dst = static_cast<uint8_t*>(out);
  for (int64_t off = 0, first = 1; first || off < bytes; first = 0) {
    const int64_t c = std::min<int64_t>(options_.slot_bytes, bytes - off);
    const uint32_t s = step_;
    claim(s, first);
    if (c > 0) std::memcpy(slot(me, s), src + off, c);  // empty tensors: null pointers
    arrive(s, first);
    for (int p = 0; p < L && c > 0; ++p) std::memcpy(dst + p * out_stride + off, p == me ? src + off : slot(p, s), c);
    finish(s);
    off += c;
  }
}

void Domain::broadcast(void* data, int64_t bytes, int root) {
  DDPKIT_CHECK(root >= 0 && root < options_.local_size, "shared-memory broadcast: root ", root, " outside 0..",
               options_.local_size - 1);
  begin(kBroadcast, bytes, c10::ScalarType::Byte, root);
  const int me = options_.local_rank;
  auto* base = static_cast<uint8_t*>(data);
  for (int64_t off = 0, first = 1; first || off < bytes; first = 0) {
    const int64_t c = std::min<int64_t>(options_.slot_bytes, bytes - off);
    const uint32_t s = step_;
    if (me == root) {
      claim(s, first);
      if (c > 0) std::memcpy(slot(me, s), base + off, c);  // empty tensors: null pointers
      publish(kArrived, s + 1);
    } else {
      wait_peer(root, kArrived, s + 1);
      if (first) check(root, s);
      if (c > 0) std::memcpy(base + off, slot(root, s), c);
    }
    finish(s);
    off += c;
  }
}

void Domain::alltoall(const void* in, void* out, int64_t bytes_per_rank) {
  begin(kAlltoall, bytes_per_rank, c10::ScalarType::Byte, 0);
  const int L = options_.local_size, me = options_.local_rank;
  const auto* src = static_cast<const uint8_t*>(in);
  auto* dst = static_cast<uint8_t*>(out);
  const int64_t m = bytes_per_rank;
  const int64_t per_step = options_.slot_bytes / L / 64 * 64;
  if (m > 0) std::memcpy(dst + me * m, src + me * m, m);
  for (int64_t off = 0, first = 1; first || off < m; first = 0) {
    const int64_t c = std::min(per_step, m - off);
    const uint32_t s = step_;
    claim(s, first);
    pack(s, src + off, m, per_step, c);
    arrive(s, first);
    for (int p = 0; p < L; ++p)
      if (p != me && c > 0) std::memcpy(dst + p * m + off, slot(p, s) + me * per_step, c);
    finish(s);
    off += c;
  }
}

void Domain::barrier() {
  begin(kBarrier, 0, c10::ScalarType::Byte, 0);
  const uint32_t s = step_;
  claim(s, true);
  arrive(s, true);
  finish(s);
}

// ---- shared buffers ------------------------------------------------------------------------------

SharedBuffer::~SharedBuffer() {
  for (uint8_t* b : base)
    if (b) munmap(b, bytes);
}

std::shared_ptr<SharedBuffer> Domain::allocate(c10d::Store& store, const std::string& key, int64_t id, size_t size,
                                               std::string* why) {
  DDPKIT_CHECK(size > 0, "shared buffer of 0 bytes");
  const int L = options_.local_size, me = options_.local_rank;
  const std::string what = "shared buffer #" + std::to_string(id) + " (" + std::to_string(size) + " bytes)";
  auto buffer = std::make_shared<SharedBuffer>();
  buffer->id = id;
  buffer->bytes = size;
  buffer->base.assign(L, nullptr);
  std::string error;
  void* own = nullptr;
  // Held open until every peer has opened it through /proc (or failed to); the mappings then
  // keep the memory, and it goes with the last of them.
  struct CloseOnExit {
    int fd;
    ~CloseOnExit() {
      if (fd >= 0) close(fd);
    }
  } own_fd{detail::create_peer_memory("ddpkit-buffer", size, &own, &error)};
  if (own_fd.fd >= 0) buffer->base[me] = static_cast<uint8_t*>(own);
  const std::string prefix = key + "/" + std::to_string(id) + "/";
  store.set(prefix + std::to_string(me),
            bytes(std::to_string(size) + " " + (error.empty() ? detail::peer_memory_address(own_fd.fd) : "!" + error)));
  std::string failure = error.empty() ? "" : "local rank " + std::to_string(me) + ": " + error;
  for (int p = 0; p < L; ++p) {
    if (p == me) continue;
    try {
      store.wait({prefix + std::to_string(p)}, options_.timeout);
    } catch (const std::exception& e) {
      throw std::runtime_error("shared memory: rank " + std::to_string(group_rank(p)) + " (on this host) did not allocate " +
                               what + " within " + std::to_string(options_.timeout.count()) + " ms (" + e.what() + ")");
    }
    const std::string said = text(store.get(prefix + std::to_string(p)));
    const size_t space = said.find(' ');
    if (space == std::string::npos || said.substr(0, space) != std::to_string(size)) {
      throw std::runtime_error("shared memory: rank " + std::to_string(group_rank(p)) + " (on this host) allocated " +
                               said.substr(0, space) + " bytes as shared buffer #" + std::to_string(id) +
                               " where this rank allocated " + std::to_string(size) +
                               ": every rank must allocate the same buffers in the same order");
    }
    const std::string where = said.substr(space + 1);
    if (!failure.empty()) continue;
    detail::PeerMemoryAddress address;
    std::string why_not;
    if (!where.empty() && where[0] == '!') {
      failure = "rank " + std::to_string(group_rank(p)) + " (on this host): " + where.substr(1);
    } else if (!detail::parse_peer_memory_address(where, &address) || address.bytes != size) {
      failure = "rank " + std::to_string(group_rank(p)) + " (on this host) published no address of " +
                std::to_string(size) + " bytes (\"" + where + "\")";
    } else if (void* mapped = detail::map_peer_memory(address, &why_not)) {
      buffer->base[p] = static_cast<uint8_t*>(mapped);
    } else {
      failure = "local rank " + std::to_string(me) + ": rank " + std::to_string(group_rank(p)) + "'s buffer: " + why_not;
    }
  }
  failure = meet_once_mapped(store, prefix, L, options_.timeout, failure, what);
  if (!failure.empty()) {
    if (why) *why = failure;
    return nullptr;
  }
  std::lock_guard<std::mutex> lock(buffers_mutex_);
  for (auto it = buffers_.begin(); it != buffers_.end();) it = it->second.expired() ? buffers_.erase(it) : std::next(it);
  buffers_[buffer->base[me]] = buffer;
  for (auto it = buffers_by_id_.begin(); it != buffers_by_id_.end();)
    it = it->second.expired() ? buffers_by_id_.erase(it) : std::next(it);
  buffers_by_id_[buffer->id] = buffer;
  return buffer;
}

std::shared_ptr<SharedBuffer> Domain::find_buffer(const void* data, int64_t bytes) {
  const auto* p = static_cast<const uint8_t*>(data);
  std::lock_guard<std::mutex> lock(buffers_mutex_);
  auto it = buffers_.upper_bound(p);
  if (it == buffers_.begin()) return nullptr;
  std::shared_ptr<SharedBuffer> b = std::prev(it)->second.lock();
  const uint8_t* own = b ? b->base[options_.local_rank] : nullptr;
  if (!b || p + bytes > own + b->bytes) return nullptr;
  return b;
}

}  // namespace shm
}  // namespace ddpkit
