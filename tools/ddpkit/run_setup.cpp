// The model and data a run's flags name, shared by `ddpkit train` and `ddpkit plan` (training.h).
#include "cli.h"
#include "training.h"

#include <ddpkit/optim/adam.h>
#include <ddpkit/optim/sgd.h>

namespace ddpkit {
namespace cli {

std::map<std::string, std::string> with_model_flag_defaults(std::map<std::string, std::string> own) {
  own.insert({{"model", "mlp"}, {"dataset", ""}, {"mlp-dims", ""}, {"layers", "4"}, {"d-model", "256"}, {"heads", "4"},
              {"seq-len", "64"}, {"batch-size", "64"}, {"optimizer", "sgd"}, {"threads", "1"},
              {"fsdp-min-unit-params", "100000"}, {"synthetic-size", "8192"},
              {"data-dir", "/usr/share/datasets/fashion-mnist"}, {"text-dir", "/usr/share/games/fortunes"}});
  return own;
}

std::string checked_dataset(const Flags& f, const std::string& model_name) {
  if (model_name != "mlp" && model_name != "cnn" && model_name != "transformer")
    throw UsageError("--model must be mlp, cnn or transformer, got '" + model_name + "'");
  const std::string dataset = !f.str("dataset").empty() ? f.str("dataset") : model_name == "transformer" ? "text" : "fashion-mnist";
  if (dataset != "fashion-mnist" && dataset != "synthetic" && dataset != "text")
    throw UsageError("--dataset must be fashion-mnist, synthetic or text, got '" + dataset + "'");
  if ((dataset == "text") != (model_name == "transformer"))
    throw UsageError("--dataset text goes with --model transformer, and only it");
  if (model_name != "mlp" && !f.str("mlp-dims").empty()) throw UsageError("--mlp-dims applies to --model mlp only");
  for (const char* flag : {"layers", "d-model", "heads", "seq-len"})
    if (f.integer(flag) < 1) throw UsageError(std::string("--") + flag + " must be >= 1");
  return dataset;
}

RunData load_run_data(const Flags& f, const std::string& model_name, const std::string& dataset) {
  RunData r;
  if (dataset == "text") {
    r.data = load_text_corpus(f.str("text-dir"), f.integer("seq-len"));
  } else if (dataset == "fashion-mnist") {
    r.data = load_fashion_mnist(f.str("data-dir"));
    r.dims = f.str("mlp-dims").empty() ? std::vector<int64_t>{784, 512, 256, 10} : f.int_list("mlp-dims");
    if (r.dims.front() != 784 || r.dims.back() != 10)
      throw UsageError("--mlp-dims for fashion-mnist must start with 784 and end with 10");
  } else {
    r.dims = f.str("mlp-dims").empty() ? std::vector<int64_t>{1024, 4096, 4096, 1024} : f.int_list("mlp-dims");
    if (model_name == "cnn") r.dims = {784, 10};
    if (r.dims.size() < 2) throw UsageError("--mlp-dims needs at least two sizes");
    const int64_t n = f.integer("synthetic-size");
    if (n < 1) throw UsageError("--synthetic-size must be >= 1");
    r.data = make_synthetic(r.dims.front(), r.dims.back(), n, std::max<int64_t>(n / 4, 1), 1234);
  }
  return r;
}

Model build_model(const Flags& f, const std::string& model_name, const std::vector<int64_t>& dims, int64_t num_classes) {
  Model model;
  if (model_name == "mlp") {
    auto m = std::make_shared<MlpImpl>(dims);
    model.module = m;
    model.forward = [m](const at::Tensor& x) { return m->forward(x); };
    for (auto& l : m->layers) model.units.push_back(l.ptr());
  } else if (model_name == "cnn") {
    auto m = std::make_shared<CnnImpl>(num_classes);
    model.module = m;
    model.forward = [m](const at::Tensor& x) { return m->forward(x); };
    model.units = {m->conv1.ptr(), m->conv2.ptr(), m->fc1.ptr(), m->fc2.ptr()};
  } else {
    auto m = std::make_shared<GptImpl>(256, f.integer("d-model"), f.integer("heads"), f.integer("layers"), f.integer("seq-len"));
    model.module = m;
    model.forward = [m](const at::Tensor& x) { return m->forward(x); };
    for (const auto& b : *m->blocks) model.units.push_back(b);
    model.language_model = true;
  }
  return model;
}

OptimizerChoice choose_optimizer(const std::string& name, double lr) {
  if (name == "sgd") {
    const auto o = torch::optim::SGDOptions(lr).momentum(0.9);
    return {optimizer_factory<optim::SGD>(o), hooks::functional_sgd(o)};  // torch::optim::SGD's results in one pass
  }
  if (name == "adam") {
    const auto o = torch::optim::AdamOptions(lr);
    return {optimizer_factory<optim::Adam>(o), hooks::functional_adam(o)};  // libtorch's results, no temporaries
  }
  if (name == "adamw") {
    const auto o = torch::optim::AdamWOptions(lr);
    return {optimizer_factory<optim::AdamW>(o), hooks::functional_adamw(o)};
  }
  throw UsageError("--optimizer must be sgd, adam or adamw, got '" + name + "'");
}

}  // namespace cli
}  // namespace ddpkit
