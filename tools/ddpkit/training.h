// Models and the progress bar shared by `ddpkit train` and `ddpkit bench`.
#pragma once

#include "cli.h"

#include <ddpkit/comm/process_group.h>
#include <ddpkit/ddp/distributed_data_parallel.h>
#include <ddpkit/fsdp/fully_sharded_data_parallel.h>
#include <ddpkit/hooks/optimizer_hook.h>
#include <ddpkit/zero/zero_redundancy_optimizer.h>
#include <torch/torch.h>

#include <unistd.h>

#include <chrono>
#include <limits>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

namespace ddpkit {
struct Divergence;
namespace cli {

struct MlpImpl : torch::nn::Module {
  explicit MlpImpl(const std::vector<int64_t>& dims) {
    for (size_t i = 0; i + 1 < dims.size(); ++i)
      layers.push_back(register_module("fc" + std::to_string(i), torch::nn::Linear(dims[i], dims[i + 1])));
  }
  at::Tensor forward(at::Tensor x) {
    for (size_t i = 0; i < layers.size(); ++i) {
      x = fsdp::forward_unit(layers[i], x);  // a plain call unless FSDP shards the layer
      if (i + 1 < layers.size()) x = torch::relu(x);
    }
    return x;
  }
  std::vector<torch::nn::Linear> layers;
};

struct CnnImpl : torch::nn::Module {
  explicit CnnImpl(int64_t classes)
      : conv1(register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 16, 5)))),
        conv2(register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(16, 32, 5)))),
        fc1(register_module("fc1", torch::nn::Linear(32 * 4 * 4, 128))),
        fc2(register_module("fc2", torch::nn::Linear(128, classes))) {}
  at::Tensor forward(at::Tensor x) {
    x = x.view({-1, 1, 28, 28});
    x = torch::max_pool2d(torch::relu(fsdp::forward_unit(conv1, x)), 2);
    x = torch::max_pool2d(torch::relu(fsdp::forward_unit(conv2, x)), 2);
    x = torch::relu(fsdp::forward_unit(fc1, x.flatten(1)));
    return fsdp::forward_unit(fc2, x);
  }
  torch::nn::Conv2d conv1, conv2;
  torch::nn::Linear fc1, fc2;
};

// One block of a GPT-style decoder: pre-norm causal self-attention and an MLP, each added back
// to its input.
struct GptBlockImpl : torch::nn::Module {
  GptBlockImpl(int64_t d_model, int64_t heads, int64_t feedforward) : heads(heads) {
    TORCH_CHECK(d_model % heads == 0, "--d-model (", d_model, ") must be a multiple of --heads (", heads, ")");
    ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d_model})));
    qkv = register_module("qkv", torch::nn::Linear(d_model, 3 * d_model));
    proj = register_module("proj", torch::nn::Linear(d_model, d_model));
    ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d_model})));
    fc1 = register_module("fc1", torch::nn::Linear(d_model, feedforward));
    fc2 = register_module("fc2", torch::nn::Linear(feedforward, d_model));
  }
  // x [B, T, d]; mask [T, T], -inf above the diagonal.
  at::Tensor forward(at::Tensor x, at::Tensor mask) {
    const int64_t b = x.size(0), t = x.size(1), d = x.size(2), dh = d / heads;
    auto parts = qkv(ln1(x)).view({b, t, 3, heads, dh}).permute({2, 0, 3, 1, 4});  // [3, B, H, T, dh]
    at::Tensor scores = at::matmul(parts[0], parts[1].transpose(-2, -1)) / std::sqrt(static_cast<double>(dh)) + mask;
    at::Tensor attended = at::matmul(torch::softmax(scores, -1), parts[2]).transpose(1, 2).reshape({b, t, d});
    x = x + proj(attended);
    return x + fc2(torch::gelu(fc1(ln2(x))));
  }
  int64_t heads;
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  torch::nn::Linear qkv{nullptr}, proj{nullptr}, fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(GptBlock);

// A GPT-style decoder-only language model over bytes: token and position embeddings, `layers`
// blocks (each an FSDP unit, marked with fsdp::forward_unit), a final norm and a linear head.
// Input [B, T] byte ids, output [B, T, vocab] logits for the next byte.
struct GptImpl : torch::nn::Module {
  GptImpl(int64_t vocab, int64_t d_model, int64_t heads, int64_t layers, int64_t length) {
    tokens = register_module("tokens", torch::nn::Embedding(vocab, d_model));
    positions = register_module("positions", torch::nn::Embedding(length, d_model));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int64_t i = 0; i < layers; ++i) blocks->push_back(GptBlock(d_model, heads, 4 * d_model));
    ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d_model})));
    head = register_module("head", torch::nn::Linear(d_model, vocab));
  }
  at::Tensor forward(const at::Tensor& x) {
    const int64_t t = x.size(1);
    at::Tensor h = tokens(x) + positions(torch::arange(t, x.options().dtype(torch::kLong)));
    // In the activations' dtype: a model computed in bf16 (the plan's profile of FSDP's mixed
    // precision) adds it to bf16 scores.
    at::Tensor mask = torch::full({t, t}, -std::numeric_limits<float>::infinity(), h.options()).triu(1);
    for (const auto& block : *blocks) h = fsdp::forward_unit(block->as<GptBlockImpl>(), h, mask);
    return head(ln_f(h));
  }
  torch::nn::Embedding tokens{nullptr}, positions{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::LayerNorm ln_f{nullptr};
  torch::nn::Linear head{nullptr};
};

// Type-erased model: forward plus the module, and the submodules FSDP may make units (each called
// through fsdp::forward_unit in the forward).
struct Model {
  std::shared_ptr<torch::nn::Module> module;
  std::function<at::Tensor(const at::Tensor&)> forward;
  std::vector<std::shared_ptr<torch::nn::Module>> units;
  bool language_model = false;  // output [B, T, vocab] against labels [B, T]
};

// The parameter-server benchmark's DummyModel / DummyModelSparse: EmbeddingBag (mean; sparse or
// dense gradients) over index bags, then `layers` Linear(dim, dim), softmax (as the seed).
struct DummyModelImpl : torch::nn::Module {
  DummyModelImpl(int64_t num_embeddings, int64_t embedding_dim, int64_t dense_input, int64_t dense_output,
                 int64_t layers, bool sparse) {
    bag = register_module("embedding", torch::nn::EmbeddingBag(torch::nn::EmbeddingBagOptions(num_embeddings, embedding_dim)
                                                                  .mode(torch::kMean)
                                                                  .sparse(sparse)));
    for (int64_t i = 0; i < layers; ++i)
      dense->push_back(torch::nn::Linear(i == 0 ? dense_input : dense_output, dense_output));
    register_module("dense_seq", dense);
  }
  at::Tensor forward(const at::Tensor& x) { return torch::softmax(dense->forward(bag(x)), 1); }
  torch::nn::EmbeddingBag bag{nullptr};
  torch::nn::Sequential dense;
};

// A small causal transformer language model: token + position embeddings, pre-built encoder
// layers under a causal mask, a linear head to the vocabulary. Input [B, T] token ids, output
// [B, T, vocab] logits.
struct TransformerLMImpl : torch::nn::Module {
  TransformerLMImpl(int64_t vocab, int64_t d_model, int64_t heads, int64_t layers, int64_t feedforward, int64_t length)
      : length(length) {
    tokens = register_module("tokens", torch::nn::Embedding(vocab, d_model));
    positions = register_module("positions", torch::nn::Embedding(length, d_model));
    encoder = register_module(
        "encoder", torch::nn::TransformerEncoder(torch::nn::TransformerEncoderOptions(
                                                     torch::nn::TransformerEncoderLayerOptions(d_model, heads)
                                                         .dim_feedforward(feedforward)
                                                         .dropout(0.0),
                                                     layers)));
    head = register_module("head", torch::nn::Linear(d_model, vocab));
  }
  at::Tensor forward(const at::Tensor& x) {
    const int64_t t = x.size(1);
    at::Tensor h = tokens(x) + positions(torch::arange(t, x.options().dtype(torch::kLong)));
    // Position i attends to positions <= i.
    at::Tensor mask = torch::full({t, t}, -std::numeric_limits<float>::infinity()).triu(1);
    h = encoder(h.transpose(0, 1), mask).transpose(0, 1);
    return head(h);
  }
  int64_t length;
  torch::nn::Embedding tokens{nullptr}, positions{nullptr};
  torch::nn::TransformerEncoder encoder{nullptr};
  torch::nn::Linear head{nullptr};
};

// Classification, or next-byte prediction over [B, T] (in fp32 under mixed precision).
inline at::Tensor model_loss(const Model& model, const at::Tensor& out, const at::Tensor& y) {
  if (model.language_model) return torch::cross_entropy_loss(out.reshape({-1, out.size(-1)}).to(at::kFloat), y.reshape({-1}));
  return torch::cross_entropy_loss(out.to(at::kFloat), y);
}

// What `ddpkit train` and `ddpkit plan` read from the same flags (--model, --dataset, --mlp-dims,
// the transformer's sizes): the data set, checked, and the model built on it.
// `own` plus the defaults of the flags that name the model and its data (--model, --dataset,
// --mlp-dims, the transformer's sizes, --batch-size, --optimizer, --threads, ...).
std::map<std::string, std::string> with_model_flag_defaults(std::map<std::string, std::string> own);
std::string checked_dataset(const Flags& f, const std::string& model_name);
struct RunData {
  Split data;
  std::vector<int64_t> dims;  // the MLP's layer sizes (synthetic, fashion-mnist)
};
RunData load_run_data(const Flags& f, const std::string& model_name, const std::string& dataset);
Model build_model(const Flags& f, const std::string& model_name, const std::vector<int64_t>& dims, int64_t num_classes);
// --optimizer sgd|adam|adamw at `lr`, as train steps it (SGD: momentum 0.9, ddpkit's one-pass
// optim::SGD; optim::Adam/AdamW, without temporaries): the factory (plain and ZeRO) and the
// per-parameter twin for --optimizer-in-hook.
struct OptimizerChoice {
  OptimizerFactory factory;
  std::shared_ptr<hooks::FunctionalOptimizer> functional;
};
OptimizerChoice choose_optimizer(const std::string& name, double lr);

// ---- what `ddpkit train` scores and prints (train_output.cpp) ----

// Every rank scores its share of `test` (through `sharded` when FSDP holds the parameters) and
// the sums are allreduced over `pg`: every rank gets the whole test set's accuracy and mean loss.
struct TestScore {
  double accuracy = 0, loss = 0;
};
TestScore evaluate(const Model& model, const Dataset& test, FullyShardedDataParallelBase* sharded, ProcessGroup* pg);
// Per bucket: elements, bytes moved and received per step, and the ratio to a plain allreduce;
// *compression_ratio gets the whole model's.
std::string bucket_traffic_table(const DistributedDataParallelBase& ddp, int64_t steps_run, double* compression_ratio);
// --bucket-cap-mb/--piece-kb auto: what rank 0 timed, the choice marked.
std::string tuning_table(const OnlineTuningResult& r);
// What stopped the run, and which flag of the hook in use is the likely cure.
std::string divergence_message(const Flags& f, const Divergence& d, int64_t powersgd_rank, double lr);

// The run as the last line reports it, one JSON object (report_json).
struct TrainReport {
  std::string hook, optimizer, zero, model, fsdp;
  std::string shared_memory;  // "host", "hierarchical", or "" (none)
  int world = 1, batch = 1;
  int64_t steps = 0, steps_run = 0;  // the step reached; the steps this process ran
  double train_seconds = 0;
  std::vector<double> step_ms, forward_ms, backward_ms, optimizer_ms;
  std::vector<double> minor_faults;  // per step, this rank's minor page faults
  std::vector<ReducerTimes> reducer;  // DDP: rank 0's Reducer, each step's own times
  int64_t tuned_from = -1;  // first step under online tuning's choice (-1: none)
  CommStats traffic;
  double compression_ratio = 0;
  double bucket_cap_mb = -1;  // -1: no DDP
  int64_t piece_kb = 0;
  const OnlineTuningResult* tuning = nullptr;
  double accuracy = -1, test_perplexity = -1, final_loss = 0;  // -1: not measured
  // peak_rss_bytes: VmHWM, every page the rank maps, the largest rank's. peak_pss_bytes: each page
  // counted once across the host's processes (runtime/memory_sampler.h), the largest rank's; and
  // mean_peak_pss_bytes, the mean over ranks: which rank a shared page counts for is arbitrary, so
  // strategies compare on the mean.
  int64_t optimizer_state_bytes = 0, peak_rss_bytes = 0, peak_pss_bytes = 0, mean_peak_pss_bytes = 0, resumed_from = -1;
  int checkpoints_written = 0;
};
std::string report_json(const TrainReport& r);

class Progress {
 public:
  Progress(bool enabled) : enabled_(enabled), tty_(isatty(STDERR_FILENO)) {}
  void update(const std::string& label, int64_t done, int64_t total, double loss, double ms) {
    if (!enabled_) return;
    const auto now = std::chrono::steady_clock::now();
    if (done != total && now - last_ < std::chrono::milliseconds(tty_ ? 100 : 5000)) return;
    last_ = now;
    const int width = 30;
    const int filled = total ? static_cast<int>(width * done / total) : width;
    std::ostringstream os;
    os << (tty_ ? "\r" : "") << label << " [" << std::string(filled, '#') << std::string(width - filled, '.') << "] "
       << std::setw(3) << (total ? 100 * done / total : 100) << "% " << done << "/" << total << " loss "
       << std::fixed << std::setprecision(4) << loss << " " << std::setprecision(1) << ms << " ms/step";
    std::cerr << os.str() << (tty_ ? "" : "\n") << std::flush;
  }
  void finish() {
    if (enabled_ && tty_) std::cerr << "\n";
  }

 private:
  bool enabled_, tty_;
  std::chrono::steady_clock::time_point last_{};
};

}  // namespace cli
}  // namespace ddpkit
