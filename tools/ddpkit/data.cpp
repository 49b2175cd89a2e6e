#include "cli.h"

#include <ddpkit/error.h>

#include <ATen/CPUGeneratorImpl.h>
#include <zlib.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>

namespace ddpkit {
namespace cli {
namespace {

// Reads a whole file, gunzipping it if it is gzip (zlib reads plain files transparently too).
std::vector<uint8_t> read_maybe_gzip(const std::string& path) {
  gzFile f = gzopen(path.c_str(), "rb");
  DDPKIT_CHECK(f != nullptr, "cannot open ", path);
  std::vector<uint8_t> out;
  uint8_t buf[1 << 16];
  int n;
  while ((n = gzread(f, buf, sizeof buf)) > 0) out.insert(out.end(), buf, buf + n);
  int err = 0;
  const char* msg = gzerror(f, &err);
  const bool failed = n < 0 || (err != Z_OK && err != Z_STREAM_END);
  const std::string why = msg ? msg : "";
  gzclose(f);
  DDPKIT_CHECK(!failed, "cannot read ", path, ": ", why);
  return out;
}

uint32_t be32(const uint8_t* p) { return (uint32_t(p[0]) << 24) | (uint32_t(p[1]) << 16) | (uint32_t(p[2]) << 8) | p[3]; }

std::string find_file(const std::string& dir, const std::string& stem) {
  for (const char* suffix : {".gz", ""}) {
    const std::string path = dir + "/" + stem + suffix;
    if (std::ifstream(path).good()) return path;
  }
  DDPKIT_CHECK(false, "Fashion-MNIST file ", stem, "[.gz] not found in ", dir,
               " (install Debian's dataset-fashion-mnist, or pass --data-dir)");
  return {};
}

at::Tensor read_images(const std::string& path) {
  auto bytes = read_maybe_gzip(path);
  DDPKIT_CHECK(bytes.size() >= 16 && be32(bytes.data()) == 0x803, path, " is not an IDX image file");
  const int64_t n = be32(&bytes[4]), rows = be32(&bytes[8]), cols = be32(&bytes[12]);
  DDPKIT_CHECK(static_cast<int64_t>(bytes.size()) == 16 + n * rows * cols, path, " is truncated");
  at::Tensor t = at::empty({n, rows * cols}, at::kByte);
  std::memcpy(t.data_ptr<uint8_t>(), bytes.data() + 16, n * rows * cols);
  // Scale to [0,1], then normalise with Fashion-MNIST's mean/std.
  return (t.to(at::kFloat).div_(255.0f).sub_(0.2860f)).div_(0.3530f);
}

at::Tensor read_labels(const std::string& path) {
  auto bytes = read_maybe_gzip(path);
  DDPKIT_CHECK(bytes.size() >= 8 && be32(bytes.data()) == 0x801, path, " is not an IDX label file");
  const int64_t n = be32(&bytes[4]);
  DDPKIT_CHECK(static_cast<int64_t>(bytes.size()) == 8 + n, path, " is truncated");
  at::Tensor t = at::empty({n}, at::kByte);
  std::memcpy(t.data_ptr<uint8_t>(), bytes.data() + 8, n);
  return t.to(at::kLong);
}

}  // namespace

Split load_fashion_mnist(const std::string& dir) {
  Split s;
  s.train.inputs = read_images(find_file(dir, "train-images-idx3-ubyte"));
  s.train.labels = read_labels(find_file(dir, "train-labels-idx1-ubyte"));
  s.test.inputs = read_images(find_file(dir, "t10k-images-idx3-ubyte"));
  s.test.labels = read_labels(find_file(dir, "t10k-labels-idx1-ubyte"));
  DDPKIT_CHECK(s.train.inputs.size(0) == s.train.labels.size(0), "Fashion-MNIST train images and labels differ in count");
  DDPKIT_CHECK(s.test.inputs.size(0) == s.test.labels.size(0), "Fashion-MNIST test images and labels differ in count");
  s.train.num_classes = s.test.num_classes = 10;
  return s;
}

Split load_text_corpus(const std::string& dir, int64_t length, double test_fraction) {
  std::vector<std::string> files;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.find('.') == std::string::npos && std::filesystem::is_regular_file(e.path())) files.push_back(e.path().string());
  }
  if (ec || files.empty())
    throw UsageError("no text files in " + dir + (ec ? " (" + ec.message() + ")" : "") +
                     ": install Debian's fortunes package (scripts/install-deps.sh) or name another --text-dir");
  std::sort(files.begin(), files.end());
  std::string text;
  for (const auto& f : files) {
    std::ifstream in(f, std::ios::binary);
    text.append(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  const int64_t windows = static_cast<int64_t>(text.size() - 1) / length;
  if (windows < 2) throw UsageError(dir + " holds too little text for --seq-len " + std::to_string(length));
  at::Tensor bytes = at::empty({static_cast<int64_t>(text.size())}, at::kByte);
  std::memcpy(bytes.data_ptr(), text.data(), text.size());
  auto split = [&](int64_t first, int64_t count) {
    Dataset d;
    d.inputs = bytes.narrow(0, first * length, count * length).view({count, length}).clone();
    d.labels = bytes.narrow(0, first * length + 1, count * length).view({count, length}).clone();
    d.num_classes = 256;
    return d;
  };
  const int64_t test = std::max<int64_t>(1, static_cast<int64_t>(windows * test_fraction));
  Split s;
  s.train = split(0, windows - test);
  s.test = split(windows - test, test);
  return s;
}

Split make_synthetic(int64_t features, int64_t classes, int64_t train_size, int64_t test_size, uint64_t seed) {
  DDPKIT_CHECK(features > 0 && classes > 1, "synthetic data needs features > 0 and classes > 1");
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  at::Tensor teacher = at::randn({features, classes}, gen, at::kFloat);
  auto make = [&](int64_t n) {
    Dataset d;
    d.inputs = at::randn({n, features}, gen, at::kFloat);
    d.labels = at::matmul(d.inputs, teacher).argmax(1);
    d.num_classes = classes;
    return d;
  };
  Split s;
  s.train = make(train_size);
  s.test = make(test_size);
  return s;
}

}  // namespace cli
}  // namespace ddpkit
