#include <ddpkit/error.h>
#include <ddpkit/runtime/block_cache.h>
#include <ddpkit/runtime/runtime.h>

#include <ATen/Parallel.h>

#include <dirent.h>
#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <cstring>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace ddpkit {

namespace {
// Where the heap's layout moved peaks by whole blocks (gradients of a few MB and up), and below
// which blocks are many and small enough for glibc's bins.
constexpr std::size_t kLargeBlockBytes = std::size_t{1} << 20;
}  // namespace

AllocatorTuning tune_allocator_for_training(std::size_t threshold_bytes) {
  AllocatorTuning done;
#if defined(__GLIBC__)
  const char* off = std::getenv("DDPKIT_MALLOC_TUNING");
  if (off && std::strcmp(off, "0") == 0) return done;
  // mallopt takes an int, and returns 1 when glibc accepted the value.
  const int value = threshold_bytes > static_cast<std::size_t>(INT_MAX) ? INT_MAX : static_cast<int>(threshold_bytes);
  // A user's own mmap threshold says how large blocks are served: no cache either.
  if (!std::getenv("MALLOC_MMAP_THRESHOLD_")) {
    done.mmap_threshold = mallopt(M_MMAP_THRESHOLD, value) == 1;
    done.large_block_cache = install_large_block_cache(kLargeBlockBytes, threshold_bytes);
  }
  if (!std::getenv("MALLOC_TRIM_THRESHOLD_")) done.trim_threshold = mallopt(M_TRIM_THRESHOLD, value) == 1;
#else
  (void)threshold_bytes;
#endif
  return done;
}

bool set_compute_threads(int n) {
  DDPKIT_CHECK(n >= 1, "set_compute_threads: thread count must be >= 1, got ", n);
  at::set_num_threads(n);
  // Looked up at run time: ddpkit does not link OpenBLAS, and the BLAS behind libtorch varies.
  using SetThreads = void (*)(int);
  auto openblas = reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
  if (openblas) openblas(n);
  return openblas != nullptr;
}

std::string blas_coretype_for_this_cpu() {
  using CoreName = char* (*)();
  auto corename = reinterpret_cast<CoreName>(dlsym(RTLD_DEFAULT, "openblas_get_corename"));
  const char* core = corename ? corename() : nullptr;
  if (!core || std::strcmp(core, "Prescott") != 0) return "";
  return __builtin_cpu_supports("avx512f") ? "SkylakeX" : __builtin_cpu_supports("avx2") ? "Haswell" : "";
}

std::string blas_kernel_advice() {
  const std::string better = blas_coretype_for_this_cpu();
  if (better.empty()) return "";
  return std::string("OpenBLAS did not recognise this CPU and runs its generic Prescott kernels, which multiply "
                     "matrices several times slower than its ") +
         (better == "SkylakeX" ? "AVX-512" : "AVX2") + " ones; set OPENBLAS_CORETYPE=" + better +
         " in the environment of every rank (and of any PyTorch run compared with it)";
}

double median(std::vector<double> values) {
  if (values.empty()) return 0;
  const size_t n = values.size();
  std::sort(values.begin(), values.end());
  return n % 2 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

ProcessResources process_resources() {
  ProcessResources r;
  if (FILE* f = std::fopen("/proc/self/statm", "r")) {
    long long size = 0, resident = 0;
    if (std::fscanf(f, "%lld %lld", &size, &resident) == 2) r.rss_bytes = resident * sysconf(_SC_PAGESIZE);
    std::fclose(f);
  }
  if (FILE* f = std::fopen("/proc/self/status", "r")) {
    char line[256];
    long long kb = 0;
    while (std::fgets(line, sizeof line, f))
      if (std::sscanf(line, "VmHWM: %lld kB", &kb) == 1) r.peak_rss_bytes = kb * 1024;
      else if (std::sscanf(line, "RssAnon: %lld kB", &kb) == 1) r.anon_rss_bytes = kb * 1024;
    std::fclose(f);
  }
  if (DIR* d = opendir("/proc/self/fd")) {
    while (dirent* e = readdir(d))
      if (e->d_name[0] != '.') ++r.open_fds;
    closedir(d);
    --r.open_fds;  // the directory stream's own descriptor
  }
  return r;
}

}  // namespace ddpkit
