// Domain: making and mapping the segment, waiting on peers, the byte collectives and shared
// buffers. Allreduce is in shm_allreduce.cpp; the segment's layout in shm_segment.h.
#include "shm_domain.h"

#include "futex.h"
#include "peer_memory.h"
#include "shm_segment.h"

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
using namespace layout;
namespace {

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
// to say so lets everyone on, and then owners may close the fds peers opened through /proc. Returns
// the failure some rank published under `prefix`, or that the ranks did not all get there within
// `timeout`; empty if none. Every rank has read the `published` addresses before it comes, so the
// last to leave deletes them with the meeting's own keys.
std::string meet_once_mapped(c10d::Store& store, const std::string& prefix, int local_size,
                             std::chrono::milliseconds timeout, const std::string& failure, const std::string& what,
                             const std::vector<std::string>& published) {
  if (!failure.empty()) store.set(prefix + "error", bytes(failure));
  if (store.add(prefix + "mapped", 1) == local_size) store.set(prefix + "ready", bytes("1"));
  std::string result;
  try {
    store.wait({prefix + "ready"}, timeout);
    result = store.check({prefix + "error"}) ? text(store.get(prefix + "error")) : std::string();
  } catch (const std::exception& e) {
    return "not every local rank mapped " + what + " within " + std::to_string(timeout.count()) + " ms (" + e.what() +
           ")";
  }
  if (store.add(prefix + "left", 1) == local_size) {
    for (const auto& key : published) store.deleteKey(key);
    for (const char* key : {"error", "mapped", "ready", "left"}) store.deleteKey(prefix + key);
  }
  return result;
}

}  // namespace

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
                       error.empty() ? "" : "local rank " + std::to_string(o.local_rank) + ": " + error, "the segment",
                       {key + "/address"});
  if (!failure.empty()) {
    if (base) detail::unmap_peer_memory(base, size);
    if (fd >= 0) close(fd);
    throw std::runtime_error("shared memory: " + failure);
  }
  return std::unique_ptr<Domain>(new Domain(std::move(o), fd, base, size));
}

Domain::Domain(DomainOptions options, int fd, void* base, size_t bytes)
    : options_(std::move(options)), fd_(fd), base_(base), bytes_(bytes) {}

Domain::~Domain() {
  if (base_) detail::unmap_peer_memory(base_, bytes_);
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
      // Gone: its process died, or it shut its group down (a torchft replica leaving). Gloo's
      // words for the same event close it, as callers match on them.
      fail("rank " + std::to_string(group_rank(peer)) + " (on this host) died or shut its group down during "
           "shared-memory " + describe(call_) + " (Connection closed by peer)");
    if (std::chrono::steady_clock::now() > deadline_)
      fail("rank " + std::to_string(group_rank(peer)) + " (on this host) did not take its part in shared-memory " +
           describe(call_) + " within the group's timeout of " + std::to_string(options_.timeout.count()) +
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
    if (b) detail::unmap_peer_memory(b, bytes);
}

std::shared_ptr<SharedBuffer> Domain::allocate(c10d::Store& store, const std::string& key, int64_t id, size_t size,
                                               std::string* why, bool one_region, bool reserve) {
  DDPKIT_CHECK(size > 0, "shared buffer of 0 bytes");
  const int L = options_.local_size, me = options_.local_rank;
  const std::string what = "shared buffer #" + std::to_string(id) + " (" + std::to_string(size) + " bytes)";
  auto buffer = std::make_shared<SharedBuffer>();
  buffer->id = id;
  buffer->bytes = size;
  buffer->base.assign(one_region ? 1 : L, nullptr);
  const bool creates = !one_region || me == 0;
  std::string error;
  void* own = nullptr;
  // Held open until every peer has opened it through /proc (or failed to); the mappings then
  // keep the memory, and it goes with the last of them.
  struct CloseOnExit {
    int fd;
    ~CloseOnExit() {
      if (fd >= 0) close(fd);
    }
  } own_fd{creates ? detail::create_peer_memory("ddpkit-buffer", size, &own, &error, reserve && !one_region) : -1};
  if (own_fd.fd >= 0) buffer->base[me] = static_cast<uint8_t*>(own);
  const std::string prefix = key + "/" + std::to_string(id) + "/";
  const std::string address = !error.empty() ? "!" + error : creates ? detail::peer_memory_address(own_fd.fd) : "-";
  store.set(prefix + std::to_string(me), bytes(std::to_string(size) + " " + address));
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
    if (!failure.empty() || (one_region && p != 0)) continue;
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
  std::vector<std::string> published;
  for (int p = 0; p < L; ++p) published.push_back(prefix + std::to_string(p));
  failure = meet_once_mapped(store, prefix, L, options_.timeout, failure, what, published);
  if (!failure.empty()) {
    if (why) *why = failure;
    return nullptr;
  }
  if (one_region) return buffer;  // not summed over: no collective looks it up
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
