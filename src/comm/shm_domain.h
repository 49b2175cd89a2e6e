// Collectives between the ranks of one host through one shared-memory segment (internal:
// ProcessGroup routes to it; see docs/shared_memory.md).
//
// Layout: a header, one control block per local rank (its step counters, each on its own cache
// line, written only by that rank) and two data slots per local rank. A collective is cut into
// steps of at most one slot; step s uses slot s % 2, so filling the next step overlaps peers still
// reading the last one. Each step is three counters, all monotone: `arrived` (my slot holds my
// data), `reduced` (my slice of the sum is in my slot; allreduce only) and `done` (I have read
// what I need from every peer's slot). No lock: a rank only ever writes its own counters and its
// own slots, and waits for peers' counters with a deadline.
//
// Waiting spins briefly, then sleeps on a futex in the segment. A dead peer is noticed through an
// open-file-description lock each rank holds on one byte of the segment (the kernel drops it when
// the process dies, in any PID namespace); a stalled one by the group's timeout. After a failure
// the domain refuses every later collective with the first error: the steps are out of step.
#pragma once

#include <c10/core/ScalarType.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace c10d {
class Store;
}

namespace ddpkit {
namespace shm {

// What a rank's collective is (op, dtype, size, root): written to its peers before its first
// `arrived` of that collective, so a peer that called something else says so instead of
// exchanging the wrong bytes.
struct Announcement {
  uint32_t op = 0;
  int32_t dtype = 0;
  int64_t size = 0;
  int32_t root = 0;
  // Allreduce and allgather: where the data live when they are in a SharedBuffer (its id, and the
  // byte offset in it); -1 otherwise. Not part of the call: ranks that differ here copy as usual.
  int64_t buffer = -1;
  int64_t offset = 0;
  // allreduce_parts: how many of this rank's parts lie in shared buffers, listed in its part
  // table for the step's parity (peers read and write them there).
  int32_t shared_parts = 0;
};

// Where one of a rank's parts lies in a shared buffer: elements [at, at + numel) of the allreduce
// at byte `offset` of buffer `buffer` (its id).
struct SharedPart {
  int64_t at = 0;
  int64_t numel = 0;
  int64_t buffer = -1;
  int64_t offset = 0;
};
constexpr int kMaxSharedParts = 512;  // per collective; further parts go through the buffer

// A peer's listed part as this rank maps it.
struct PeerPart {
  int64_t at = 0;
  int64_t numel = 0;
  uint8_t* data = nullptr;
};

// Memory that every local rank allocated at once (Domain::allocate) and that each maps from
// every peer, so an allreduce over it can sum in place instead of copying through the slots.
// Unmapped when the last tensor over it is gone, which may be after the Domain.
// A one-region buffer (allocate(..., one_region)) is instead one memory every local rank maps.
struct SharedBuffer {
  int64_t id = -1;  // the allocation's number: the same on every local rank
  size_t bytes = 0;
  // By local rank: base[local_rank()] is this rank's own memory. One region: base[0] only, the
  // region as this rank maps it.
  std::vector<uint8_t*> base;
  // Set when a collective that may write into this buffer failed: a peer may still be writing, so
  // memory carved out of it (a GradientArena) is never handed out again.
  std::atomic<bool> poisoned{false};
  SharedBuffer() = default;
  SharedBuffer(const SharedBuffer&) = delete;
  SharedBuffer& operator=(const SharedBuffer&) = delete;
  ~SharedBuffer();
};

// A stretch of this rank's own memory holding elements [at, at + numel) of an allreduce_parts.
struct Part {
  int64_t at = 0;
  int64_t numel = 0;
  void* data = nullptr;
};

struct DomainOptions {
  int local_rank = 0;
  int local_size = 1;
  std::vector<int> group_ranks;  // group rank of each local rank (for error messages)
  std::chrono::milliseconds timeout{300000};
  // Taken from local rank 0, so every rank cuts steps alike; ProcessGroup checks it (a multiple of
  // 64, at least 4096).
  int64_t slot_bytes = 1 << 20;
};

class Domain {
 public:
  // Collective over the local ranks: local rank 0 creates the segment (an unnamed memfd) and
  // publishes its address under `key` in `store`; every rank maps it through /proc and locks its
  // byte. Nothing is ever named in /dev/shm, so nothing can be left there (peer_memory.h).
  static std::unique_ptr<Domain> create(c10d::Store& store, const std::string& key, DomainOptions options);
  ~Domain();
  Domain(const Domain&) = delete;
  Domain& operator=(const Domain&) = delete;

  int local_rank() const { return options_.local_rank; }
  int local_size() const { return options_.local_size; }
  int64_t slot_bytes() const { return options_.slot_bytes; }

  // All in place or into the caller's buffers; each returns when this rank's part is done, or
  // throws std::runtime_error naming the peer that died or did not arrive in time.
  // data <- scale * sum over local ranks (16-bit types accumulate in fp32 and round once).
  void allreduce(void* data, int64_t numel, c10::ScalarType dtype, double scale = 1.0);
  // The same sum, but this rank's values live in `parts` (ascending, covering [0, numel) without
  // gaps: DDP's gradients) and the result is written back there; `data`, inside a buffer from
  // allocate(), is scratch. Where every rank sums in place, a rank copies into its buffer only
  // what its peers sum, reads its own share straight from its parts and writes the sum there, and
  // copies the peers' shares of the sum out of its buffer: per element one read and one write
  // less than filling the buffer, allreduce() and copying back. A part that itself lies in a
  // shared buffer (a GradientArena's) is not copied at all: peers read it and write their shares
  // of the sum into it where it lies. Peers may call allreduce() on the same part of their
  // buffers instead: the result is the same.
  void allreduce_parts(void* data, int64_t numel, c10::ScalarType dtype, double scale, const std::vector<Part>& parts);
  // out (numel) <- sum over local ranks of block local_rank() of their `in`: local_size blocks of
  // numel elements, block j starting at element j * in_stride (default numel).
  void reduce_scatter(const void* in, void* out, int64_t numel, c10::ScalarType dtype, int64_t in_stride = -1);
  // Block r of out <- local rank r's `in` (bytes); block r starts at byte r * out_stride (default bytes).
  void allgather(const void* in, void* out, int64_t bytes, int64_t out_stride = -1);
  // Every rank's data (bytes) <- local rank `root`'s.
  void broadcast(void* data, int64_t bytes, int root);
  // Block r (bytes_per_rank) of `in` goes to local rank r; block r of `out` comes from local rank r.
  void alltoall(const void* in, void* out, int64_t bytes_per_rank);
  void barrier();

  // Collective over the local ranks, in the same order on each (`id` numbers the allocations):
  // each creates zeroed memory of `bytes` (an unnamed memfd), maps every peer's through /proc,
  // and closes its own fd once all have mapped. allreduce() sums in place when every rank passes data at the same offset of the
  // same buffer (what DDP's buckets do). Returns null with the reason in *why when some rank could
  // not reserve or map the space, so every rank falls back alike; throws when a peer does not take
  // part within the timeout.
  // With `one_region`, local rank 0 alone creates `bytes` (unreserved: each page is charged to the
  // rank that first touches it) and every peer maps it: one memory, the same elements on every
  // rank. allreduce() does not sum over such a buffer (holds() is false for it).
  // With `reserve` false each rank's memory is not reserved either: its pages come at first touch,
  // for buffers of which some parts may never be touched (DDP's buckets, whose gradients in a
  // GradientArena sum where they lie).
  std::shared_ptr<SharedBuffer> allocate(c10d::Store& store, const std::string& key, int64_t id, size_t bytes,
                                         std::string* why, bool one_region = false, bool reserve = true);
  // Whether [data, data + bytes) lies in one of this rank's buffers from allocate().
  bool holds(const void* data, int64_t bytes) { return find_buffer(data, bytes) != nullptr; }

 private:
  struct Segment;
  Domain(DomainOptions options, int fd, void* base, size_t bytes);
  // Starts a collective: its deadline, and what this rank announces to its peers.
  void begin(uint32_t op, int64_t size, c10::ScalarType dtype, int root);
  // Waits until every peer is done with step s - 2 (which used the same slot as step s); on a
  // collective's first step, then announces it.
  void claim(uint32_t s, bool first);
  // After `peer` arrived at step s (a collective's first): it must have announced the same call.
  void check(int peer, uint32_t s);
  // Step s's middle and end: arrive and wait for every peer (checking their call on a first
  // step); then be done with the peers' slots and move on.
  void arrive(uint32_t s, bool first);
  void finish(uint32_t s);
  // Copies part j (bytes at src + j * src_stride) of every peer j into part j of my slot for step
  // s (parts part_bytes apart): a reduce-scatter's or an alltoall's fill.
  void pack(uint32_t s, const uint8_t* src, int64_t src_stride, int64_t part_bytes, int64_t bytes);
  void publish(int counter, uint32_t value);
  void wait_peer(int peer, int counter, uint32_t target);
  void wait_all(int counter, uint32_t target);
  bool peer_alive(int peer) const;
  [[noreturn]] void fail(const std::string& message);
  // The shared buffer holding [data, data + bytes) of this rank, if any.
  std::shared_ptr<SharedBuffer> find_buffer(const void* data, int64_t bytes);
  // allreduce_parts: my parts that lie in shared buffers (other than in their place in the call's
  // own), which peers read and write where they lie; the rest go through the call's buffer.
  std::vector<SharedPart> list_shared_parts(const std::vector<Part>& parts, int64_t elt, std::vector<bool>* listed);
  // The parts peer p listed for step s, as this rank maps them (the buffers held in *held); a
  // buffer this rank does not map fails the collective.
  std::vector<PeerPart> map_peer_parts(int p, uint32_t s, int64_t elt, std::vector<std::shared_ptr<SharedBuffer>>* held);
  // After the first arrive of an allreduce or allgather at step s: did every rank announce the
  // same buffer and offset? Then each sums its slice in every rank's buffer (allreduce), or copies
  // every rank's input from where it lies (allgather), and the step ends.
  bool in_place_everywhere(uint32_t s) const;
  // allreduce() and allreduce_parts(); `parts` null when the data are in `data`.
  void allreduce_impl(void* data, int64_t numel, c10::ScalarType dtype, double scale, const std::vector<Part>* parts);
  void allreduce_in_place(const SharedBuffer& buffer, int64_t offset, int64_t numel, c10::ScalarType dtype,
                          double scale, uint32_t s, const std::vector<Part>* parts, const std::vector<bool>& listed);
  // This rank's slice [lo, hi) of an in-place sum of numel elements: whole cache lines.
  std::pair<int64_t, int64_t> in_place_slice(int64_t numel, int64_t elt) const;
  uint8_t* slot(int rank, uint32_t step) const;
  int group_rank(int local) const;

  DomainOptions options_;
  int fd_ = -1;
  void* base_ = nullptr;
  size_t bytes_ = 0;
  uint32_t step_ = 0;  // steps taken: the same on every rank between collectives
  Announcement call_;  // the collective under way, as announced to the peers
  std::chrono::steady_clock::time_point deadline_;
  std::string broken_;  // the first failure; every later collective reports it
  std::mutex buffers_mutex_;  // allocate() runs on the caller's thread, allreduce() on the shm thread
  std::map<const uint8_t*, std::weak_ptr<SharedBuffer>> buffers_;  // by this rank's base address
  std::map<int64_t, std::weak_ptr<SharedBuffer>> buffers_by_id_;
};

}  // namespace shm
}  // namespace ddpkit
