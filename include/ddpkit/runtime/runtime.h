// Process-wide settings that suit training: glibc's allocator thresholds, and compute threads.
//
// Allocator:
// A large model's gradients, activations and communication buffers are tens of MB each. glibc
// serves blocks above its mmap threshold (dynamic, at most 32 MB) with fresh mappings and returns
// them on free, so every step faults the same memory in again page by page; on a 25M-parameter
// MLP a quarter of the step went to page faults. Raising the mmap and trim thresholds keeps freed
// blocks in the heap for reuse, and libtorch's blocks of 1 MiB and more go to a LargeBlockCache
// (block_cache.h): reused by size, out of the heap, so the peak does not hang on where in the heap
// the small ones fell. The cost: up to the threshold of freed memory stays with the process
// instead of going back to the system.
//
// It is a process-wide choice, so the library never makes it on its own: call this once, early in
// main (before threads allocate), as `ddpkit train` does. No-op on a libc other than glibc.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace ddpkit {

struct AllocatorTuning {
  bool mmap_threshold = false;  // M_MMAP_THRESHOLD was set by this call
  bool trim_threshold = false;  // M_TRIM_THRESHOLD was set by this call
  bool large_block_cache = false;  // libtorch's large CPU blocks go to installed_large_block_cache()
};

// Sets M_MMAP_THRESHOLD and M_TRIM_THRESHOLD to `threshold_bytes` (default 1 GiB), and installs the
// large block cache keeping up to `threshold_bytes` of freed blocks, except where the user already
// chose through glibc's MALLOC_MMAP_THRESHOLD_ (then no cache either) / MALLOC_TRIM_THRESHOLD_
// variables, or DDPKIT_MALLOC_TUNING=0 is set. Returns what it set.
AllocatorTuning tune_allocator_for_training(std::size_t threshold_bytes = std::size_t{1} << 30);

// Compute threads: at::set_num_threads(n), and the same limit for OpenBLAS's own thread pool when
// OpenBLAS is loaded. libtorch passes the limit on to OpenBLAS only when it was built against
// OpenBLAS itself; Debian 13's libtorch 2.6 links the generic libblas.so.3 (OpenBLAS behind the
// alternatives), so every rank would keep one BLAS thread per core and ranks sharing a host would
// oversubscribe its cores. Use this instead of at::set_num_threads.
// Returns true when OpenBLAS was found and limited too.
bool set_compute_threads(int n);

// Empty, or advice when the OpenBLAS behind libtorch did not recognise this CPU and fell back to its
// generic Prescott (SSE3) kernels although the CPU has AVX2/AVX-512 (Debian 12's OpenBLAS 0.3.21
// does so on CPUs newer than it): matrix products then run several times slower. The advice names
// the OPENBLAS_CORETYPE to set; OpenBLAS reads that variable when it loads, so only a new process
// can take it.
std::string blas_kernel_advice();
// The OPENBLAS_CORETYPE that advice names ("SkylakeX", "Haswell"), or "" when OpenBLAS recognised
// this CPU (or is not loaded). `ddpkit` sets it for itself and the ranks it starts when unset.
std::string blas_coretype_for_this_cpu();

// The median of `values` (the mean of the middle two for an even count); 0 when there are none.
double median(std::vector<double> values);

// This process's resident memory, its high-water mark (VmHWM: shared memory this process touched
// counts, as the kernel charges it), and open file descriptors (from /proc/self), for spotting
// leaks in long runs (`ddpkit train --report-resources N`) and memory per rank (peak_rss_bytes).
struct ProcessResources {
  int64_t rss_bytes = 0;
  // The anonymous part of rss_bytes (RssAnon: heap, stacks, private mappings), without the
  // library code and files mapped in (RssFile, RssShmem). A pip torch's libraries fault in
  // hundreds of MB of code during a first step, which is no memory a step needs.
  int64_t anon_rss_bytes = 0;
  int64_t peak_rss_bytes = 0;
  int64_t open_fds = 0;
};
ProcessResources process_resources();

}  // namespace ddpkit
