// What both examples share: flags, the model and its data (yours would be your own).
#pragma once

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <stdexcept>
#include <string>

// --name value pairs; flag(name, default) reads one, and an unknown flag is an error.
struct ExampleFlags {
  std::map<std::string, std::string> values;
  ExampleFlags(int argc, char** argv, std::map<std::string, std::string> defaults) : values(std::move(defaults)) {
    for (int i = 1; i + 1 < argc; i += 2) {
      const std::string name = std::string(argv[i]).substr(2);
      if (!values.count(name)) throw std::invalid_argument("unknown flag " + std::string(argv[i]));
      values[name] = argv[i + 1];
    }
  }
  std::string str(const std::string& name) const { return values.at(name); }
  long integer(const std::string& name) const { return std::stol(values.at(name)); }
};

// A small classifier: each Linear is one layer (DiLoCo's fragments are made of layers).
struct NetImpl : torch::nn::Module {
  NetImpl() {
    torch::manual_seed(0);  // every group starts from the same parameters
    fc1 = register_module("fc1", torch::nn::Linear(32, 64));
    fc2 = register_module("fc2", torch::nn::Linear(64, 64));
    fc3 = register_module("fc3", torch::nn::Linear(64, 10));
  }
  at::Tensor forward(at::Tensor x) { return fc3(torch::tanh(fc2(torch::tanh(fc1(x))))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
};
TORCH_MODULE(Net);

// Inputs and the labels a fixed random teacher gives them: the same on every rank.
inline std::pair<at::Tensor, at::Tensor> example_data(int64_t samples = 8192) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1);
  at::Tensor x = at::randn({samples, 32}, gen);
  return {x, x.matmul(at::randn({32, 10}, gen)).argmax(1)};
}

// FNV-1a over the parameters: equal models print equal checksums.
inline std::string checksum(const std::vector<at::Tensor>& params) {
  uint64_t h = 1469598103934665603ull;
  for (const auto& p : params) {
    const at::Tensor c = p.detach().contiguous();
    const auto* b = static_cast<const unsigned char*>(c.data_ptr());
    for (int64_t i = 0; i < c.nbytes(); ++i) h = (h ^ b[i]) * 1099511628211ull;
  }
  char out[17];
  std::snprintf(out, sizeof(out), "%016llx", static_cast<unsigned long long>(h));
  return out;
}
