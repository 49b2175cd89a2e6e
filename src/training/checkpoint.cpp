#include <ddpkit/training/checkpoint.h>

#include <ddpkit/ddp/distributed_data_parallel.h>
#include <ddpkit/fsdp/fully_sharded_data_parallel.h>
#include <ddpkit/zero/zero_redundancy_optimizer.h>

#include "optimizer_tensors.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/serialize/archive.h>

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <set>
#include <sstream>

namespace ddpkit {

// ---- bytes ---------------------------------------------------------------------------------------
namespace {

constexpr char kMagic[8] = {'D', 'D', 'P', 'K', 'T', 'N', 'S', '1'};
constexpr size_t kMaxDims = 16;

// 64-bit FNV-1a over 8-byte words: catches truncation and torn or flipped bytes.
uint64_t checksum(const char* data, size_t n) {
  uint64_t h = 0xcbf29ce484222325ULL ^ n;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t w;
    std::memcpy(&w, data + i, 8);
    h = (h ^ w) * 0x100000001b3ULL;
  }
  for (; i < n; ++i) h = (h ^ static_cast<unsigned char>(data[i])) * 0x100000001b3ULL;
  return h;
}

// Writes forward into [data, data + size), refusing to pass its end.
class Writer {
 public:
  Writer(char* data, size_t size) : data_(data), size_(size) {}
  void append(const void* p, size_t n) {
    DDPKIT_CHECK(n <= size_ - pos_, "encode_tensors: the entries outgrew the size computed for them");
    if (n) std::memcpy(data_ + pos_, p, n);
    pos_ += n;
  }
  template <typename T>
  void put(T value) {
    append(&value, sizeof(T));
  }
  size_t written() const { return pos_; }

 private:
  char* data_;
  size_t size_, pos_ = 0;
};

}  // namespace

bool storable_dtype(at::ScalarType t) {
  switch (t) {
    case at::kByte: case at::kChar: case at::kShort: case at::kInt: case at::kLong: case at::kHalf:
    case at::kFloat: case at::kDouble: case at::kBool: case at::kBFloat16:
      return true;
    default:
      return false;
  }
}

namespace {

// Reads forward through `bytes`, refusing to pass its end.
class Reader {
 public:
  Reader(const char* bytes, size_t end, const std::string& what) : bytes_(bytes), end_(end), what_(what) {}
  template <typename T>
  T get(const char* field) {
    T value;
    std::memcpy(&value, take(sizeof(T), field), sizeof(T));
    return value;
  }
  const char* take(uint64_t n, const char* field) {
    DDPKIT_CHECK(n <= end_ - pos_, what_, " is truncated or corrupt: ", field, " needs ", n, " bytes at offset ", pos_,
                 ", ", end_ - pos_, " left");
    const char* p = bytes_ + pos_;
    pos_ += n;
    return p;
  }
  size_t left() const { return end_ - pos_; }

 private:
  const char* bytes_;
  size_t end_, pos_ = 0;
  const std::string& what_;
};

size_t encoded_size(const TensorDict& dict) {
  size_t total = sizeof(kMagic) + 16;
  for (const auto& kv : dict) {
    DDPKIT_CHECK(kv.second.defined(), "encode_tensors: entry '", kv.first, "' is an undefined tensor");
    total += 14 + kv.first.size() + 8 * static_cast<size_t>(kv.second.dim()) +
             static_cast<size_t>(kv.second.numel()) * kv.second.element_size();
  }
  return total;
}

void encode_tensors_into(const TensorDict& dict, char* data, size_t size) {
  DDPKIT_CHECK(size == encoded_size(dict), "encode_tensors_into: ", size, " bytes given for ", encoded_size(dict));
  Writer out(data, size);
  out.append(kMagic, sizeof(kMagic));
  out.put<uint64_t>(dict.size());
  for (const auto& kv : dict) {
    const at::Tensor t = kv.second.detach().cpu().contiguous();
    DDPKIT_CHECK(storable_dtype(t.scalar_type()), "encode_tensors: entry '", kv.first, "' has dtype ", t.scalar_type(),
                 ", which checkpoints do not store");
    DDPKIT_CHECK(static_cast<size_t>(t.dim()) <= kMaxDims, "encode_tensors: entry '", kv.first, "' has ", t.dim(), " dimensions");
    out.put<uint32_t>(static_cast<uint32_t>(kv.first.size()));
    out.append(kv.first.data(), kv.first.size());
    out.put<int8_t>(static_cast<int8_t>(t.scalar_type()));
    out.put<uint8_t>(static_cast<uint8_t>(t.dim()));
    for (int64_t s : t.sizes()) out.put<int64_t>(s);
    const uint64_t nbytes = static_cast<uint64_t>(t.numel()) * t.element_size();
    out.put<uint64_t>(nbytes);
    out.append(t.data_ptr(), nbytes);
  }
  out.put<uint64_t>(checksum(data, out.written()));
}

TensorDict decode_tensor_bytes(const char* bytes, size_t size, const std::string& what) {
  DDPKIT_CHECK(size >= sizeof(kMagic) + 16, what, " is truncated: ", size, " bytes");
  DDPKIT_CHECK(std::memcmp(bytes, kMagic, sizeof(kMagic)) == 0, what, " is not a ddpkit tensor file (bad magic)");
  const size_t body = size - 8;
  uint64_t stored;
  std::memcpy(&stored, bytes + body, 8);
  DDPKIT_CHECK(stored == checksum(bytes, body), what, " is corrupt: checksum mismatch");
  Reader in(bytes, body, what);
  in.take(sizeof(kMagic), "the magic");
  const uint64_t count = in.get<uint64_t>("the entry count");
  DDPKIT_CHECK(count <= in.left() / 14, what, " claims ", count, " entries, more than its size holds");
  TensorDict dict;
  for (uint64_t i = 0; i < count; ++i) {
    const uint32_t key_len = in.get<uint32_t>("a key length");
    const char* key_data = in.take(key_len, "a key");
    std::string key(key_data, key_len);
    DDPKIT_CHECK(!dict.count(key), what, ": entry '", key, "' appears twice");
    const int8_t dtype = in.get<int8_t>("a dtype");
    DDPKIT_CHECK(dtype >= 0 && dtype < static_cast<int8_t>(at::ScalarType::NumOptions) &&
                     storable_dtype(static_cast<at::ScalarType>(dtype)),
                 what, ": entry '", key, "' has an unknown dtype code ", static_cast<int>(dtype));
    const at::ScalarType type = static_cast<at::ScalarType>(dtype);
    const uint8_t ndim = in.get<uint8_t>("a rank");
    DDPKIT_CHECK(ndim <= kMaxDims, what, ": entry '", key, "' has ", static_cast<int>(ndim), " dimensions");
    std::vector<int64_t> sizes(ndim);
    uint64_t numel = 1;
    for (auto& s : sizes) {
      s = in.get<int64_t>("a size");
      DDPKIT_CHECK(s >= 0 && (s == 0 || numel <= (uint64_t{1} << 62) / static_cast<uint64_t>(s)), what, ": entry '", key,
                   "' has an impossible size ", s);
      numel *= static_cast<uint64_t>(s);
    }
    const uint64_t nbytes = in.get<uint64_t>("a byte count");
    DDPKIT_CHECK(nbytes == numel * c10::elementSize(type), what, ": entry '", key, "' holds ", nbytes, " bytes for ",
                 numel, " elements of ", type);
    const char* data = in.take(nbytes, "tensor data");
    at::Tensor t = at::empty(sizes, at::TensorOptions().dtype(type));
    if (nbytes) std::memcpy(t.data_ptr(), data, nbytes);
    dict.emplace(std::move(key), std::move(t));
  }
  DDPKIT_CHECK(in.left() == 0, what, " has ", in.left(), " bytes after its last entry");
  return dict;
}

}  // namespace

std::string encode_tensors(const TensorDict& dict) {
  // Sized once: growing a string of gigabytes by doubling copies (and faults in) it again each time.
  std::string out(encoded_size(dict), '\0');
  encode_tensors_into(dict, out.data(), out.size());
  return out;
}

TensorDict decode_tensors(const std::string& bytes, const std::string& what) {
  return decode_tensor_bytes(bytes.data(), bytes.size(), what);
}

TensorDict entries_under(const TensorDict& entries, const std::string& prefix) {
  TensorDict out;
  // Names are sorted: the matches are one run from the first name not below the prefix.
  for (auto it = entries.lower_bound(prefix); it != entries.end() && it->first.compare(0, prefix.size(), prefix) == 0;
       ++it)
    out[it->first.substr(prefix.size())] = it->second;
  return out;
}

// ---- files ---------------------------------------------------------------------------------------
namespace {

TensorDict with_prefix(const TensorDict& d, const std::string& prefix) {
  TensorDict out;
  for (const auto& kv : d) out[prefix + kv.first] = kv.second;
  return out;
}

const char* kPrefix = "checkpoint-";
const char* kSuffix = ".ddpk";

std::string checkpoint_path(const std::string& dir, int64_t step) {
  char name[64];
  std::snprintf(name, sizeof(name), "%s%010lld%s", kPrefix, static_cast<long long>(step), kSuffix);
  return (std::filesystem::path(dir) / name).string();
}

// The step a checkpoint file name carries, or -1 for other names.
int64_t step_of(const std::string& name) {
  const size_t p = std::strlen(kPrefix), s = std::strlen(kSuffix);
  if (name.size() <= p + s || name.compare(0, p, kPrefix) != 0 || name.compare(name.size() - s, s, kSuffix) != 0) return -1;
  const std::string digits = name.substr(p, name.size() - p - s);
  if (digits.empty() || digits.size() > 18 || !std::all_of(digits.begin(), digits.end(), ::isdigit)) return -1;
  return std::stoll(digits);
}

void write_all(int fd, const std::string& bytes, const std::string& path) {
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    DDPKIT_CHECK(n > 0, "writing ", path, ": ", std::strerror(errno));
    done += static_cast<size_t>(n);
  }
}

// Temp file in the same directory, fsync, rename over the final name, fsync the directory: the final
// name only ever names a whole file, even across a crash of the process or the machine.
void write_atomically(const std::string& dir, const std::string& path, const std::string& bytes) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  DDPKIT_CHECK(!ec, "cannot create checkpoint directory ", dir, ": ", ec.message());
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  DDPKIT_CHECK(fd >= 0, "cannot create ", tmp, ": ", std::strerror(errno));
  try {
    write_all(fd, bytes, tmp);
    DDPKIT_CHECK(::fsync(fd) == 0, "fsync ", tmp, ": ", std::strerror(errno));
  } catch (...) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  ::close(fd);
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int e = errno;
    ::unlink(tmp.c_str());
    DDPKIT_CHECK(false, "rename ", tmp, " to ", path, ": ", std::strerror(e));
  }
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

std::string read_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  DDPKIT_CHECK(fd >= 0, "cannot open ", path, ": ", std::strerror(errno));
  std::string out;
  char buf[1 << 16];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int e = errno;
      ::close(fd);
      DDPKIT_CHECK(n == 0, "reading ", path, ": ", std::strerror(e));
      return out;
    }
    out.append(buf, static_cast<size_t>(n));
  }
}

// Removes all but the newest `keep` checkpoints, and temp files a dead writer left behind.
void prune(const std::string& dir, int keep) {
  const auto all = list_checkpoints(dir);
  for (size_t i = static_cast<size_t>(keep); i < all.size(); ++i) ::unlink(all[i].c_str());
  std::error_code ec;
  const std::string mine = ".tmp." + std::to_string(::getpid());
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind(kPrefix, 0) == 0 && name.find(".tmp.") != std::string::npos &&
        name.compare(name.size() - std::min(name.size(), mine.size()), mine.size(), mine) != 0)
      ::unlink(e.path().c_str());
  }
}

at::Tensor bytes_tensor(const std::string& s, int64_t size) {
  at::Tensor t = at::zeros({size}, at::kByte);
  if (!s.empty()) std::memcpy(t.data_ptr(), s.data(), s.size());
  return t;
}

// Every rank's `mine`, on every rank (sizes first, then the padded bytes).
std::vector<std::string> allgather_bytes(ProcessGroup& pg, const std::string& mine) {
  const int world = pg.size();
  std::vector<at::Tensor> sizes(world);
  for (auto& s : sizes) s = at::empty({1}, at::kLong);
  ProcessGroup::wait(pg.allgather(sizes, at::tensor({static_cast<int64_t>(mine.size())}, at::kLong)));
  int64_t longest = 0;
  for (const auto& s : sizes) longest = std::max(longest, s.item<int64_t>());
  std::vector<at::Tensor> all(world);
  for (auto& t : all) t = at::empty({longest}, at::kByte);
  ProcessGroup::wait(pg.allgather(all, bytes_tensor(mine, longest)));
  std::vector<std::string> out(world);
  for (int r = 0; r < world; ++r)
    out[r].assign(static_cast<const char*>(all[r].data_ptr()), static_cast<size_t>(sizes[r].item<int64_t>()));
  return out;
}

}  // namespace

std::vector<std::string> list_checkpoints(const std::string& dir) {
  std::vector<std::pair<int64_t, std::string>> found;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const int64_t step = step_of(e.path().filename().string());
    if (step >= 0) found.emplace_back(step, e.path().string());
  }
  std::sort(found.begin(), found.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  std::vector<std::string> out;
  for (auto& f : found) out.push_back(std::move(f.second));
  return out;
}

std::string save_checkpoint(ProcessGroup* pg, const std::string& dir, int64_t step, const TensorDict& common,
                            const TensorDict& local, int keep) {
  DDPKIT_CHECK(!dir.empty(), "save_checkpoint: the directory is empty");
  DDPKIT_CHECK(step >= 0, "save_checkpoint: step must be >= 0, got ", step);
  DDPKIT_CHECK(keep >= 1, "save_checkpoint: keep must be >= 1, got ", keep);
  const int world = pg ? pg->size() : 1, rank = pg ? pg->rank() : 0;
  const std::string mine = encode_tensors(local);
  const std::vector<std::string> locals = world > 1 ? allgather_bytes(*pg, mine) : std::vector<std::string>{mine};
  const std::string path = checkpoint_path(dir, step);
  std::string error;
  if (rank == 0) {
    try {
      TensorDict all;
      all["meta/step"] = int_entry(step);
      all["meta/world_size"] = int_entry(world);
      for (const auto& kv : common) all["common/" + kv.first] = kv.second;
      for (int r = 0; r < world; ++r) all["rank" + std::to_string(r)] = bytes_entry(locals[r]);
      write_atomically(dir, path, encode_tensors(all));
      prune(dir, keep);
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  if (world > 1) {
    at::Tensor failed = at::tensor({static_cast<int64_t>(!error.empty())}, at::kLong);
    ProcessGroup::wait(pg->broadcast(failed, 0));
    DDPKIT_CHECK(rank == 0 || failed.item<int64_t>() == 0, "checkpoint ", path,
                 ": rank 0 could not write it (its error says why)");
  }
  DDPKIT_CHECK(error.empty(), "checkpoint ", path, ": ", error);
  return path;
}

std::optional<Checkpoint> load_latest_checkpoint(ProcessGroup* pg, const std::string& dir) {
  const int world = pg ? pg->size() : 1, rank = pg ? pg->rank() : 0;
  std::string bytes, path;
  TensorDict all;  // rank 0 decodes while choosing; the others after the broadcast
  if (rank == 0) {
    for (const auto& p : list_checkpoints(dir)) {
      try {
        bytes = read_file(p);
        all = decode_tensors(bytes, p);
        path = p;
        break;
      } catch (const std::exception& e) {
        std::cerr << "ddpkit: skipping checkpoint " << p << ": " << e.what() << "\n";
        bytes.clear();
      }
    }
  }
  if (world > 1) {
    at::Tensor size = at::tensor({static_cast<int64_t>(bytes.size())}, at::kLong);
    ProcessGroup::wait(pg->broadcast(size, 0));
    if (size.item<int64_t>() > 0) {
      at::Tensor t = bytes_tensor(bytes, size.item<int64_t>());
      ProcessGroup::wait(pg->broadcast(t, 0));
      bytes.assign(static_cast<const char*>(t.data_ptr()), static_cast<size_t>(t.numel()));
    }
  }
  if (bytes.empty()) return std::nullopt;
  if (rank != 0) all = decode_tensors(bytes, "the checkpoint rank 0 sent");
  Checkpoint ck;
  const std::string what = "checkpoint " + path;
  ck.step = int_of(all, "meta/step", what);
  ck.world_size = static_cast<int>(int_of(all, "meta/world_size", what));
  ck.path = checkpoint_path(dir, ck.step);
  ck.common = entries_under(all, "common/");
  if (ck.world_size == world) ck.local = decode_tensors(bytes_of(all, "rank" + std::to_string(rank), what), what);
  return ck;
}

// ---- TrainingState -------------------------------------------------------------------------------
namespace {

// `copy` false: the entries share storage with the model (a snapshot encoded at once).
void put_module(TensorDict& d, torch::nn::Module& m, bool copy = true) {
  for (const auto& kv : m.named_parameters(true))
    d["model/" + kv.key()] = copy ? kv.value().detach().clone() : kv.value().detach();
  for (const auto& kv : m.named_buffers(true)) d["model/" + kv.key()] = copy ? kv.value().detach().clone() : kv.value().detach();
}

void load_module(const TensorDict& d, torch::nn::Module& m, const std::string& what) {
  torch::NoGradGuard no_grad;
  std::set<std::string> names;
  auto load = [&](const std::string& name, at::Tensor& t) {
    const at::Tensor saved = entry_of(d, "model/" + name, what);
    DDPKIT_CHECK(saved.sizes() == t.sizes() && saved.scalar_type() == t.scalar_type(), what, ": ", name, " is ",
                 saved.scalar_type(), saved.sizes(), " there and ", t.scalar_type(), t.sizes(), " in this model");
    t.copy_(saved);
    names.insert(name);
  };
  for (auto& kv : m.named_parameters(true)) load(kv.key(), kv.value());
  for (auto& kv : m.named_buffers(true)) load(kv.key(), kv.value());
  for (const auto& kv : entries_under(d, "model/"))
    DDPKIT_CHECK(names.count(kv.first), what, ": it holds ", kv.first, ", which this model does not have");
}

void put_bucket_layout(TensorDict& d, DistributedDataParallelBase& ddp) {
  // A rebuild that is due runs now, so the layout saved is the one the next steps use.
  ddp.reducer().prepare_for_forward();
  std::vector<int64_t> flat, sizes;
  for (const auto& b : ddp.reducer().bucket_indices()) {
    sizes.push_back(static_cast<int64_t>(b.size()));
    for (size_t v : b) flat.push_back(static_cast<int64_t>(v));
  }
  d["ddp/bucket_sizes"] = at::tensor(sizes, at::kLong);
  d["ddp/buckets"] = at::tensor(flat, at::kLong);
  // Before its first iteration a layout is not final: DDP rebuilds it in gradient-ready order after
  // that iteration (the same order on every replica of the model).
  d["ddp/buckets_final"] = at::tensor({ddp.reducer().buckets_rebuilt() ? int64_t{1} : int64_t{0}}, at::kLong);
}

void load_bucket_layout(const TensorDict& d, DistributedDataParallelBase& ddp, const std::string& what) {
  // A layout saved before the first iteration (a job's first quorum copying the first group's
  // state) is not restored for good: the loading replica rebuilds after its first iteration, as the
  // saving one does, and both come to the same layout. Frozen here, it would keep the initial
  // layout while the source rebuilt, and their buckets would cross mismatched from then on.
  auto final = d.find("ddp/buckets_final");
  if (final != d.end() && final->second.numel() == 1 && final->second.item<int64_t>() == 0) return;
  const at::Tensor sizes = entry_of(d, "ddp/bucket_sizes", what).contiguous();
  const at::Tensor flat = entry_of(d, "ddp/buckets", what).contiguous();
  DDPKIT_CHECK(sizes.scalar_type() == at::kLong && flat.scalar_type() == at::kLong && sizes.dim() == 1 &&
                   flat.dim() == 1 && sizes.sum().item<int64_t>() == flat.numel() && (sizes.numel() == 0 || sizes.min().item<int64_t>() >= 0),
               what, ": malformed DDP bucket layout");
  std::vector<std::vector<size_t>> buckets;
  int64_t k = 0;
  for (int64_t b = 0; b < sizes.numel(); ++b) {
    std::vector<size_t> vars;
    for (int64_t i = 0; i < sizes[b].item<int64_t>(); ++i) {
      const int64_t v = flat[k++].item<int64_t>();
      DDPKIT_CHECK(v >= 0, what, ": negative parameter index in the bucket layout");
      vars.push_back(static_cast<size_t>(v));
    }
    buckets.push_back(std::move(vars));
  }
  ddp.reducer().restore_bucket_layout(buckets);
}

void put_cpu_generator(TensorDict& d) {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  d["rng/cpu"] = gen.get_state();
}

void load_cpu_generator(const TensorDict& d, const std::string& what) {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(entry_of(d, "rng/cpu", what));
}

std::string optimizer_bytes(torch::optim::Optimizer& o) {
  torch::serialize::OutputArchive archive;
  o.save(archive);
  std::ostringstream out;
  archive.save_to(out);
  return out.str();
}

void load_optimizer(const std::string& bytes, torch::optim::Optimizer& o) {
  torch::serialize::InputArchive archive;
  std::istringstream in(bytes);
  archive.load_from(in);
  o.load(archive);
}

}  // namespace

TrainingState& TrainingState::module(std::shared_ptr<torch::nn::Module> module) {
  module_ = std::move(module);
  return *this;
}
TrainingState& TrainingState::optimizer(torch::optim::Optimizer* optimizer) {
  optimizer_ = optimizer;
  return *this;
}
TrainingState& TrainingState::zero(std::shared_ptr<ZeroRedundancyOptimizer> zero) {
  zero_ = std::move(zero);
  return *this;
}
TrainingState& TrainingState::ddp(DistributedDataParallelBase* ddp) {
  ddp_ = ddp;
  return *this;
}
TrainingState& TrainingState::fsdp(FullyShardedDataParallelBase* fsdp) {
  fsdp_ = fsdp;
  return *this;
}
TrainingState& TrainingState::hook_state(std::shared_ptr<hooks::HookState> state) {
  hook_state_ = std::move(state);
  return *this;
}
TrainingState& TrainingState::replicas_differ(bool differ) {
  replicas_differ_ = differ;
  return *this;
}

std::string TrainingState::save(ProcessGroup* pg, const std::string& dir, int64_t step, const TensorDict& extra,
                                const TensorDict& extra_local, int keep) {
  DDPKIT_CHECK(!(optimizer_ && zero_), "TrainingState: give an optimizer or a ZeroRedundancyOptimizer, not both");
  TensorDict common = with_prefix(extra, "extra/"), local = with_prefix(extra_local, "extra/");
  TensorDict& replica = replicas_differ_ ? local : common;
  DDPKIT_CHECK(!(fsdp_ && (module_ || replicas_differ_)), "TrainingState: with fsdp(), give no module() (FSDP saves "
               "the full model itself) and no replicas_differ");
  if (module_) put_module(replica, *module_);
  if (fsdp_) {
    // Collective: every rank takes part in the gathers, rank 0 keeps the result.
    const auto model = fsdp_->full_state_dict(/*rank0_only=*/true);
    for (const auto& kv : model.items()) common["model/" + kv.key()] = kv.value();
    if (optimizer_)
      for (auto& kv : fsdp_->full_optimizer_state_dict(*optimizer_)) common["fsdp/" + kv.first] = std::move(kv.second);
  } else if (optimizer_) {
    replica["optimizer"] = bytes_entry(optimizer_bytes(*optimizer_));
  }
  if (zero_) {
    zero_->consolidate_state_dict(0);
    if (!pg || pg->rank() == 0) {
      std::ostringstream out;
      zero_->state_dict().save(out);
      common["zero"] = bytes_entry(out.str());
    }
  }
  if (ddp_) put_bucket_layout(common, *ddp_);
  if (hook_state_) {
    for (auto& kv : hook_state_->state_dict()) local["hook/" + kv.first] = std::move(kv.second);
  }
  put_cpu_generator(common);
  return save_checkpoint(pg, dir, step, common, local, keep);
}

std::optional<Checkpoint> TrainingState::restore(ProcessGroup* pg, const std::string& dir) {
  auto ck = load_latest_checkpoint(pg, dir);
  if (!ck) return ck;
  const std::string what = "checkpoint " + ck->path;
  const int world = pg ? pg->size() : 1;
  const bool same_world = ck->world_size == world;
  DDPKIT_CHECK(!replicas_differ_ || same_world, what, " was written by ", ck->world_size,
               " ranks whose replicas differ (post-local SGD): resume it with the same number of ranks, not ", world);
  const TensorDict* replica = replicas_differ_ ? &ck->local : &ck->common;
  if (module_) load_module(*replica, *module_, what);
  if (fsdp_) {
    torch::OrderedDict<std::string, at::Tensor> model;
    for (const auto& kv : entries_under(ck->common, "model/")) model.insert(kv.first, kv.second);
    DDPKIT_CHECK(!model.is_empty(), what, " holds no model");
    fsdp_->load_full_state_dict(model);
    if (optimizer_) fsdp_->load_full_optimizer_state_dict(*optimizer_, entries_under(ck->common, "fsdp/"));
  } else if (optimizer_) {
    DDPKIT_CHECK(replica->count("optimizer"), what, " holds no optimizer state (was it written by a ZeRO run?)");
    load_optimizer(bytes_of(*replica, "optimizer", what), *optimizer_);
  }
  if (zero_) {
    std::istringstream in(bytes_of(ck->common, "zero", what + " (ZeRO state; was it written without --zero?)"));
    zero_->load_state_dict(ZeroStateDict::load(in, zero_->factory()));
  }
  if (ddp_) load_bucket_layout(ck->common, *ddp_, what);
  if (hook_state_ && same_world) hook_state_->load_state_dict(entries_under(ck->local, "hook/"));
  load_cpu_generator(ck->common, what);
  return ck;
}

TensorDict TrainingState::snapshot(const TensorDict& extra) const {
  DDPKIT_CHECK(!(optimizer_ && zero_), "TrainingState: give an optimizer or a ZeroRedundancyOptimizer, not both");
  TensorDict d = with_prefix(extra, "extra/");
  if (module_) put_module(d, *module_, /*copy=*/false);
  if (fsdp_)
    for (auto& kv : fsdp_->sharded_state_dict()) d["fsdp_shard/" + kv.first] = kv.second.detach();
  if (optimizer_ && !detail::put_optimizer_tensors(d, *optimizer_, "optimizer/"))
    d["optimizer"] = bytes_entry(optimizer_bytes(*optimizer_));
  if (zero_ && !detail::put_optimizer_tensors(d, zero_->local_optimizer(), "zero_partition/"))
    d["zero_partition"] = bytes_entry(optimizer_bytes(zero_->local_optimizer()));
  if (ddp_) put_bucket_layout(d, *ddp_);
  if (hook_state_)
    for (auto& kv : hook_state_->state_dict()) d["hook/" + kv.first] = std::move(kv.second);
  put_cpu_generator(d);
  return d;
}

TensorDict TrainingState::load_snapshot(const TensorDict& snapshot, const std::string& what) {
  if (module_) load_module(snapshot, *module_, what);
  if (fsdp_) fsdp_->load_sharded_state_dict(entries_under(snapshot, "fsdp_shard/"));
  if (optimizer_ && !detail::load_optimizer_tensors(snapshot, *optimizer_, "optimizer/", what))
    load_optimizer(bytes_of(snapshot, "optimizer", what + " (no optimizer state)"), *optimizer_);
  if (zero_ && !detail::load_optimizer_tensors(snapshot, zero_->local_optimizer(), "zero_partition/", what))
    load_optimizer(bytes_of(snapshot, "zero_partition", what + " (no ZeRO partition)"), zero_->local_optimizer());
  if (ddp_) load_bucket_layout(snapshot, *ddp_, what);
  if (hook_state_) hook_state_->load_state_dict(entries_under(snapshot, "hook/"));
  load_cpu_generator(snapshot, what);
  return entries_under(snapshot, "extra/");
}

}  // namespace ddpkit
