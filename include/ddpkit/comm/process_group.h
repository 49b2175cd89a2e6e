// Process groups: c10d stores + a transport chosen when the group is made (shared memory within a
// host, Gloo between hosts, hierarchical across them, NCCL where libtorch has CUDA), with a
// timeout on everything and one ordered issuing thread per group.
//
// Why the issuing thread: Gloo pairs collectives across ranks by a sequence number taken when a
// collective is *issued*. If two threads issue (the autograd thread and a future callback, say),
// ranks can number them differently and exchange the wrong buffers or hang. Every collective
// issued through a ddpkit::ProcessGroup is therefore handed to its sequencer, which issues them
// one by one in the order they were handed over; a multi-step algorithm (the low-precision
// allreduce below, or a user's chain via run_ordered) runs entirely on that thread, so its
// steps are issued in the same order on every rank. See docs/threading.md.
#pragma once

#include <ddpkit/comm/host_topology.h>
#include <ddpkit/compat.h>
#include <ddpkit/error.h>

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <torch/arg.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

namespace ddpkit {

using FuturePtr = c10::intrusive_ptr<c10::ivalue::Future>;
class GradientArena;  // ddpkit/comm/gradient_arena.h

namespace detail {
// The c10d backend under a group, with the lock its calls take (ProcessGroup::with_backend).
struct BackendCall {
  std::unique_lock<std::mutex> lock;  // held for Gloo, empty otherwise
  compat::Backend* backend;
};
}  // namespace detail

// A future that will hold one tensor, placed on `device` (CUDA futures must name their device).
FuturePtr make_tensor_future(c10::Device device = c10::kCPU);
// A future that is already complete with `value`.
FuturePtr completed_future(const at::Tensor& value);
// Completes with `value` once every future in `all` has completed, or with the first error.
FuturePtr when_all(const std::vector<FuturePtr>& all, const at::Tensor& value);

// Bytes this rank put on (and took off) the wire, by the bus-bandwidth model of nccl-tests: an
// allreduce of B bytes over n ranks counts 2(n-1)/n*B each way, alltoall and broadcast (n-1)/n*B of
// the full tensor, allgather (n-1)*B of one rank's input. A sparse allreduce counts (n-1) times this
// rank's indices and values (Gloo pads every rank's part to the largest, so this is a lower bound).
// Bytes moved through shared memory between ranks of one host are counted apart, by the same
// model: bytes_sent/bytes_received are what went over the network.
struct CommStats {
  uint64_t bytes_sent = 0;
  uint64_t bytes_received = 0;
  uint64_t collectives = 0;
  uint64_t shm_bytes_sent = 0;
  uint64_t shm_bytes_received = 0;
};

// Attributes traffic to `key` (the Reducer uses the bucket index) while alive on this thread:
// collectives issued through a ProcessGroup meanwhile, including those a run_ordered job issues
// later on the sequencer, count towards ProcessGroup::traffic(key). Keys are per process group.
class TrafficScope {
 public:
  explicit TrafficScope(int64_t key);
  ~TrafficScope();
  TrafficScope(const TrafficScope&) = delete;
  TrafficScope& operator=(const TrafficScope&) = delete;
  static int64_t current();  // -1: none

 private:
  int64_t previous_;
};

// A reduction moved as two alltoalls per piece (ProcessGroup::two_phase): the caller's codec
// encodes, reduces and decodes; the group moves the bytes and overlaps the pieces.
struct TwoPhaseJob {
  // The four buffers hold `pieces` consecutive equal blocks, each of size() equal chunks: chunk r
  // of a send block goes to rank r, chunk r of a receive block comes from rank r. Any dtype Gloo
  // moves (fp16/bf16 travel as bytes). recv1 and send2 may be one buffer, as may send1 and recv2.
  int64_t pieces = 1;
  at::Tensor send1, recv1, send2, recv2;
  // Called once per piece, in piece order. encode fills block p of send1 (on the sequencer, just
  // before it is sent; empty when send1 already holds the data); reduce turns block p of recv1
  // (every rank's chunk rank()) into block p of send2 (on the sequencer); decode takes block p of
  // recv2 into the result (on a Gloo thread as the piece lands; empty when recv2 is the result).
  std::function<void(int64_t)> encode, reduce, decode;
};

struct ProcessGroupOptions {
  // "gloo" (CPU tensors) or "nccl" (CUDA tensors; only when libtorch was built with CUDA).
  TORCH_ARG(std::string, backend) = "gloo";
  // Bound on every collective and on the rendezvous. A dead or missing peer surfaces as a
  // CommError within this time.
  TORCH_ARG(std::chrono::milliseconds, timeout) = std::chrono::minutes(5);
  // Gloo worker threads (collectives in flight at once).
  TORCH_ARG(int, gloo_threads) = 2;
  // TCP connections (Gloo devices/contexts) per peer pair. Gloo gives each collective one context
  // (round robin), so with N > 1 a large fp32 allreduce is split into N slices that travel
  // concurrently on separate connections and worker threads.
  TORCH_ARG(int, gloo_connections) = 1;
  // Gloo connects a pair of ranks the first time a collective needs it, instead of every pair
  // when the group is made (a full mesh: N-1 connections and store reads per rank, which at tens
  // of hosts dominate a short-lived group's cost: ft::Manager's cross groups at many sites).
  // Collectives are then rings and trees: allreduce by recursive doubling (small) or a ring,
  // broadcast by a binomial tree, allgather by a ring, so a rank connects to 2 + log2(N) peers;
  // alltoall, reduce_scatter and two-phase collectives still need every pair (made at their first
  // call). One collective runs at a time; monitored_barrier and with_backend() are refused.
  // Gloo only. docs/scale.md has the costs.
  TORCH_ARG(bool, lazy_connections) = false;
  // Address Gloo listens on. Empty: GLOO_SOCKET_IFNAME's interface if set, 127.0.0.1 when
  // MASTER_ADDR is a loopback address or unset, else the address this host's name resolves to.
  TORCH_ARG(std::string, gloo_hostname) = "";
  // Gloo fp32/fp64 SUM allreduces of at least this many bytes use the two-phase alltoall path
  // instead of Gloo's ring. Off (0) by default: alone it wins at 1-16 MB, but inside a DDP step
  // its blocking first phase delays later buckets (docs/performance.md). fp16/bf16 always use it.
  TORCH_ARG(int64_t, two_phase_min_bytes) = 0;
  // Two-phase collectives (fp16/bf16 allreduce, the int8 hook) move their data in pieces of about
  // this many bytes per peer, so a piece's encode/sum/decode overlaps other pieces' transfers.
  // Whole-bucket messages of 8-16 MB also lost 40% of a 1 Gbit/s rate-limited link to TCP
  // (bench/netns_hooks.sh, docs/performance.md).
  TORCH_ARG(int64_t, piece_bytes) = 1 << 20;
  // Key prefix in the store, so several groups can share one store.
  TORCH_ARG(std::string, group_name) = "default";
  // Ranks on one host (topology()) exchange through a shared-memory segment of the group instead
  // of loopback TCP: all collectives when every rank is on one host; with several hosts,
  // allreduce is hierarchical (shared memory within hosts, Gloo between them). Used only where
  // every rank of the host agrees; DDPKIT_SHM=0 in the environment turns it off too. CPU only.
  TORCH_ARG(bool, shared_memory) = true;
  // Bytes per rank per step of the shared-memory path (two such slots per rank are mapped).
  TORCH_ARG(int64_t, shm_slot_bytes) = 1 << 20;
  // Before each collective the ranks compare what they are about to call (collective, dtype,
  // size, op or root); where they differ every rank fails with a CommError naming each rank's
  // call. Without it a size mismatch on Gloo aborts the process (Gloo's own check, on its I/O
  // thread). One small allgather per collective: for debugging. DDPKIT_CHECK_COLLECTIVES=1 or
  // TORCH_DISTRIBUTED_DEBUG=DETAIL in the environment turn it on too (the latter as it does
  // PyTorch's own check).
  TORCH_ARG(bool, check_collectives) = false;
  // abort() may fail the collectives in flight at once (a caller that learns of a lost peer
  // sooner than the timeout: fault-tolerant training across replica groups, ddpkit/ft). One
  // more future per collective.
  TORCH_ARG(bool, abortable) = false;
};

class ProcessGroup {
 public:
  ProcessGroup(c10::intrusive_ptr<c10d::Store> store, int rank, int world_size,
               ProcessGroupOptions options = {});
  ~ProcessGroup();
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  int rank() const;
  int size() const;
  const std::string& backend_name() const;
  std::chrono::milliseconds timeout() const;
  const c10::intrusive_ptr<c10d::Store>& store() const;
  // The options it was made with (piece_bytes: see piece_bytes() for the current value).
  const ProcessGroupOptions& options() const;
  // Piece size of two-phase collectives, per peer. set_piece_bytes changes it for collectives
  // issued afterwards, here and in the between-hosts group (online tuning sets it between steps).
  int64_t piece_bytes() const;
  void set_piece_bytes(int64_t bytes);
  // Which of this group's ranks share a host (same machine id, boot id, network and PID namespace),
  // found through the store when the group was made.
  const HostTopology& topology() const;
  // The transport chosen when the group was made, from the topology and the options:
  // "shared memory" (every rank on one host), "hierarchical (shared memory within hosts, ...
  // across)", "gloo + two-phase allreduce", "gloo" (one rank) or "nccl". docs/design.md.
  std::string transport_name() const;
  // Whether collectives between this host's ranks go through shared memory (see the option),
  // and whether allreduce across hosts is hierarchical.
  bool uses_shared_memory() const;
  bool hierarchical() const;
  // Fails every collective in flight on this rank, and every later one, with a CommError naming
  // `reason`; the group is unusable afterwards. Needs ProcessGroupOptions::abortable. The
  // transport's own work ends by itself (its peers answer or its timeout passes); destroying the
  // group waits for that.
  void abort(const std::string& reason);
  // A group of some of this group's ranks, over this group's store (torch.distributed.new_group):
  // rank `rank` of `world_size`, with `options` as given but named "<this group's name>/<label>.<n>",
  // where `label` is options.group_name() and n counts the subgroups made from this group so far.
  // A construction never meets the store keys of another, earlier or later, as when a
  // FullyShardedDataParallel is built again. The ranks of one subgroup pass the same label, ranks
  // of different subgroups made in the same call different ones ("host0", "host1"), and each rank
  // makes this group's subgroups in the same order (as new_group requires), so that they agree on n.
  std::shared_ptr<ProcessGroup> new_subgroup(int rank, int world_size, ProcessGroupOptions options) const;
  // A zeroed CPU tensor of `numel` elements for this group's allreduce. Where this host's ranks
  // share memory (and the group is on one host) it lives in a segment every local rank maps, so
  // an allreduce that every local rank issues on the same part of its own such tensor (DDP's
  // buckets) sums in place, without copying through the shared slots. Collective over this
  // host's ranks: each calls it in the same order with the same size. Plain memory otherwise,
  // or (with one warning) when the memory cannot be reserved or shared.
  at::Tensor allreduce_buffer(int64_t numel, at::ScalarType dtype);
  // One zeroed CPU tensor of `numel` elements that all of this host's ranks map: the same memory,
  // so each sees what any writes (ordered by a collective, such as barrier()). Each page is charged
  // to the rank that first touches it. Collective over this host's ranks like allreduce_buffer.
  // Undefined where the group's ranks do not all share memory on one host, or (with one warning)
  // when it cannot be mapped: the caller keeps its own memory then.
  at::Tensor host_shared_tensor(int64_t numel, at::ScalarType dtype);
  // Whether an allreduce on `buffer` (from allreduce_buffer) sums in place in shared memory.
  bool sums_in_place(const at::Tensor& buffer) const;
  // Memory for gradients of these sizes (bytes) that every local rank maps: see GradientArena.
  // Room for one block of each size, plus one more of the largest. Collective over this host's
  // ranks like allreduce_buffer; null where buffers do not sum in place, or (with one warning)
  // when the memory cannot be reserved or shared.
  std::shared_ptr<GradientArena> gradient_arena(const std::vector<int64_t>& block_bytes);
  // Allreduce of the concatenation of `parts` (dense, contiguous, of buffer's dtype and device,
  // their numel adding up to buffer's), with `buffer` from allreduce_buffer() as scratch: each
  // part ends up holding `scale` times the sum. Where sums_in_place(buffer), a rank copies into
  // its buffer only the shares its peers sum, sums its own share straight from its parts into
  // them, and copies the peers' shares back: DDP's gradients reduced without filling the bucket
  // and copying it back. Elsewhere the parts are copied into `buffer`, allreduced and copied back.
  // The future's value is `buffer`, whose contents are then unspecified.
  FuturePtr allreduce_parts(const at::Tensor& buffer, const std::vector<at::Tensor>& parts, double scale = 1.0);

  // Collectives. All are asynchronous and in place where the c10d one is; each returns a future
  // whose value is the result tensor, or whose error is a CommError naming the operation.
  // allreduce supports float16/bfloat16 SUM on Gloo too (Gloo has no bf16 and a slow fp16 sum):
  // chunks are exchanged in the low-precision type and summed in fp32 (see two_phase_allreduce).
  FuturePtr allreduce(const at::Tensor& tensor, c10d::ReduceOp op = c10d::ReduceOp::SUM);
  FuturePtr broadcast(const at::Tensor& tensor, int root);
  // outputs[r] receives rank r's input; all shapes equal. On Gloo (CPU), as on alltoall and
  // reduce_scatter: one point-to-point message per peer each way, all at once, which outran Gloo's
  // allgather and alltoall on loopback and on shaped links (src/comm/gloo_exchange.cpp); each
  // contiguous output receives its block where it lies. The future's value is `input`.
  FuturePtr allgather(const std::vector<at::Tensor>& outputs, const at::Tensor& input);
  // The same into one contiguous tensor (torch's all_gather_into_tensor): block r of `output`
  // (world size x input's elements) receives rank r's input, with no copy through scratch where
  // ranks share memory or Gloo receives it. The future's value is `output`.
  FuturePtr allgather_into_tensor(const at::Tensor& output, const at::Tensor& input);
  // Equal split along dim 0: chunk r of input goes to rank r; chunk r of output comes from rank r.
  FuturePtr alltoall(const at::Tensor& output, const at::Tensor& input);
  // SUM reduce-scatter: output (input.numel() / size() elements) receives chunk rank() of the
  // elementwise sum of every rank's input. NCCL runs its own; on Gloo (no reduce_scatter in 1.13)
  // one alltoall hands chunk r to rank r, which sums the copies (in fp32 for fp16/bf16). Either
  // way each rank sends (n-1)/n of its input.
  FuturePtr reduce_scatter(const at::Tensor& output, const at::Tensor& input);
  FuturePtr barrier();
  // torch.distributed.monitored_barrier, as Gloo runs it: every other rank reports to rank 0,
  // which waits up to `timeout` in all and then lets them go. A rank that does not come within it
  // fails rank 0's barrier with "Rank 2 failed to pass monitoredBarrier in T ms" (the first such
  // rank; with wait_all_ranks each gets `timeout` and all are named: "Ranks 1, 2 failed ..."),
  // and the others' with "Rank 1 successfully reached monitoredBarrier, but received errors while
  // waiting for send/recv from rank 0". Gloo point to point, in order with this group's
  // collectives; Gloo groups only. The future's value is an empty tensor.
  FuturePtr monitored_barrier(std::chrono::milliseconds timeout, bool wait_all_ranks = false);
  // Runs `job` (see TwoPhaseJob) on the sequencer: phase 1 of the first pieces goes out at once,
  // and as each lands it is reduced and its phase 2 sent while later pieces travel. The future
  // completes with `value` once every piece is decoded; a failure names `what`. Per piece each
  // rank sends (n-1)/n of each phase's block, counted like alltoall.
  FuturePtr two_phase(std::shared_ptr<TwoPhaseJob> job, const at::Tensor& value, const std::string& what);
  // How many pieces two_phase should cut `bytes_per_rank` (what one rank sends to all peers in
  // one phase) into, by piece_bytes(): at least 1.
  int64_t pieces_for(uint64_t bytes_per_rank) const;

  // Runs `fn` on the sequencer: collectives it issues (through this group) are ordered with all
  // others, and it may block on them. Its return value completes the returned future.
  FuturePtr run_ordered(std::function<at::Tensor()> fn, c10::Device device = c10::kCPU);
  // Like run_ordered, for a chain whose last step need not be waited for on the sequencer: `fn`
  // returns a future (typically a collective it issued, with local work chained by then()), and
  // the returned future completes with that future's value or error.
  FuturePtr run_ordered_async(std::function<FuturePtr()> fn, c10::Device device = c10::kCPU);

  // Waits for a future from this API and returns its tensor, rethrowing its error.
  static at::Tensor wait(const FuturePtr& future);

  CommStats stats() const;
  // Traffic of collectives issued under TrafficScope(key); zeros for a key never used.
  CommStats traffic(int64_t key) const;
  void reset_stats();

  // Calls f(backend) with the underlying c10d backend, for collectives ddpkit does not wrap
  // (issuing on it directly bypasses the ordering guarantee above). Every call into a Gloo
  // backend goes through here, one at a time across the process: libtorch's Gloo records each
  // collective in one process-wide flight recorder whose table of groups it fills without a lock
  // (libtorch after 2.6), so two groups' first collectives at once corrupt it
  // (docs/threading.md, "Calls into Gloo"). Gloo's calls only enqueue; none waits.
  template <typename F>
  auto with_backend(F&& f) -> decltype(f(std::declval<compat::Backend&>())) {
    detail::BackendCall call = backend_call();
    return f(*call.backend);
  }
  // Point-to-point tags from here up carry ddpkit's own allgathers and alltoalls on Gloo: a
  // program's send/recv through with_backend() must use smaller ones.
  static constexpr int kFirstInternalTag = 0x5D000000;

 private:
  struct Impl;  // src/comm/process_group.cpp: the transport and what it shares (group_core.h)
  detail::BackendCall backend_call();
  std::unique_ptr<Impl> impl_;
};

// How to find the peers. With no store and init_method "env://", the torchrun variables
// MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE are read (rank/world_size given here win).
struct InitOptions {
  TORCH_ARG(std::string, backend) = "gloo";
  TORCH_ARG(std::chrono::milliseconds, timeout) = std::chrono::minutes(5);
  TORCH_ARG(int, rank) = -1;
  TORCH_ARG(int, world_size) = -1;
  // "env://", "tcp://HOST:PORT" (TCPStore, rank 0 serves) or "file:///PATH" (FileStore).
  TORCH_ARG(std::string, init_method) = "env://";
  // An explicit store (e.g. c10d::HashStore shared by rank threads) overrides init_method.
  TORCH_ARG(c10::intrusive_ptr<c10d::Store>, store) = {};
  TORCH_ARG(int, gloo_threads) = 2;
  TORCH_ARG(std::string, gloo_hostname) = "";
  TORCH_ARG(int64_t, two_phase_min_bytes) = 0;  // see ProcessGroupOptions
  TORCH_ARG(int, gloo_connections) = 1;         // see ProcessGroupOptions
  TORCH_ARG(int64_t, piece_bytes) = 1 << 20;    // see ProcessGroupOptions
  TORCH_ARG(bool, shared_memory) = true;        // see ProcessGroupOptions
};

// Rendezvous and create a process group; the first one created also becomes the default group.
std::shared_ptr<ProcessGroup> init_process_group(const InitOptions& options = {});
// The group made by the first init_process_group (error if none).
std::shared_ptr<ProcessGroup> default_process_group();
void destroy_process_group();

// Splits `parent` into consecutive groups of `group_size` ranks (ranks 0..k-1, k..2k-1, ...) and
// returns the calling rank's group, with the parent's options. Every rank of `parent` must call it.
// (torch.distributed.new_subgroups.)
std::shared_ptr<ProcessGroup> new_subgroups(const ProcessGroup& parent, int group_size);

// Which backends this build of libtorch offers ("gloo", and "nccl" with CUDA).
std::vector<std::string> available_backends();

}  // namespace ddpkit
