// `ddpkit bench` configurations and workloads (seed: configurations/*.json, data/, models/).
#include "bench.h"
#include "training.h"

#include <fstream>
#include <numeric>
#include <random>
#include <sstream>

namespace ddpkit {
namespace cli {
namespace bench {
namespace {

enum class Type { kInt, kNumber, kBool, kString, kIntList };

const char* type_name(Type t) {
  switch (t) {
    case Type::kInt: return "an integer";
    case Type::kNumber: return "a number";
    case Type::kBool: return "true or false";
    case Type::kString: return "a string";
    case Type::kIntList: return "a list of integers";
  }
  return "";
}

bool has_type(const nlohmann::json& v, Type t) {
  switch (t) {
    case Type::kInt: return v.is_number_integer();
    case Type::kNumber: return v.is_number();
    case Type::kBool: return v.is_boolean();
    case Type::kString: return v.is_string();
    case Type::kIntList:
      if (!v.is_array() || v.empty()) return false;
      for (const auto& e : v)
        if (!e.is_number_integer()) return false;
      return true;
  }
  return false;
}

using Schema = std::vector<std::pair<std::string, Type>>;

// Every class a configuration may name, with the keys its "configurations" must hold.
const std::map<std::string, std::map<std::string, Schema>>& schemas() {
  static const std::map<std::string, std::map<std::string, Schema>> s = {
      {"data",
       {{"DummyData", {{"max_val", Type::kInt}, {"sample_count", Type::kInt}, {"sample_length", Type::kInt},
                       {"sparsity_percentage", Type::kInt}}},
        {"FashionMNIST", {{"dir", Type::kString}}},
        {"SyntheticTokens", {{"vocab_size", Type::kInt}, {"sequence_length", Type::kInt}, {"sample_count", Type::kInt},
                             {"seed", Type::kInt}}}}},
      {"model",
       {{"DummyModel", {{"num_embeddings", Type::kInt}, {"embedding_dim", Type::kInt}, {"dense_input_size", Type::kInt},
                        {"dense_output_size", Type::kInt}, {"dense_layers_count", Type::kInt}, {"sparse", Type::kBool}}},
        {"MLP", {{"dims", Type::kIntList}}},
        {"CNN", {{"classes", Type::kInt}}},
        {"TransformerLM", {{"vocab_size", Type::kInt}, {"d_model", Type::kInt}, {"heads", Type::kInt}, {"layers", Type::kInt},
                           {"feedforward", Type::kInt}, {"sequence_length", Type::kInt}}}}},
      {"trainer",
       {{"DdpTrainer", {{"lr", Type::kNumber}, {"bucket_cap_mb", Type::kNumber}, {"criterion", Type::kString},
                        {"iteration_step", Type::kString}, {"powersgd_rank", Type::kInt},
                        {"powersgd_start_iter", Type::kInt}}}}},
      {"server",
       {{"AverageParameterServer", {{"bucket_timeout_s", Type::kNumber}, {"max_message_mb", Type::kNumber}}},
        {"AverageBatchParameterServer", {{"bucket_timeout_s", Type::kNumber}, {"max_message_mb", Type::kNumber}}}}},
  };
  return s;
}

std::string joined(const std::vector<std::string>& v) {
  std::string out;
  for (const auto& s : v) out += (out.empty() ? "" : ", ") + s;
  return out;
}

int64_t positive(const ConfigEntry& e, const std::string& key) {
  const int64_t v = e.conf.at(key).get<int64_t>();
  if (v < 1) throw UsageError(e.file + ": " + e.id + ".configurations." + key + " must be >= 1, got " + std::to_string(v));
  return v;
}

// Index bags drawn from a random (100 - sparsity)% of 0..max_val-1; labels uniform (seed DummyData).
void dummy_data(const ConfigEntry& e, uint64_t seed, Workload& w) {
  const int64_t max_val = positive(e, "max_val"), count = positive(e, "sample_count"), length = positive(e, "sample_length");
  const int64_t sparsity = e.conf.at("sparsity_percentage").get<int64_t>();
  if (sparsity < 0 || sparsity > 99)
    throw UsageError(e.file + ": " + e.id + ".configurations.sparsity_percentage must be in 0..99");
  std::mt19937_64 rng(seed);
  std::vector<int64_t> values(max_val);
  std::iota(values.begin(), values.end(), 0);
  std::shuffle(values.begin(), values.end(), rng);
  const int64_t used = std::max<int64_t>(1, max_val * (100 - sparsity) / 100);
  std::uniform_int_distribution<int64_t> pick(0, used - 1), label(0, max_val - 1);
  w.inputs = at::empty({count, length}, at::kLong);
  int64_t* p = w.inputs.data_ptr<int64_t>();
  for (int64_t i = 0; i < count * length; ++i) p[i] = values[pick(rng)];
  w.targets = at::empty({count}, at::kLong);
  for (int64_t i = 0; i < count; ++i) w.targets.data_ptr<int64_t>()[i] = label(rng);
}

// Sequences from a fixed random Markov chain in which each token has four likely successors: a
// language model can learn it, so the loss curve falls.
void synthetic_tokens(const ConfigEntry& e, Workload& w) {
  const int64_t vocab = positive(e, "vocab_size"), length = positive(e, "sequence_length"), count = positive(e, "sample_count");
  std::mt19937_64 rng(static_cast<uint64_t>(e.conf.at("seed").get<int64_t>()));
  std::uniform_int_distribution<int64_t> any(0, vocab - 1);
  std::vector<std::array<int64_t, 4>> next(vocab);
  for (auto& n : next)
    for (auto& t : n) t = any(rng);
  std::uniform_int_distribution<int> which(0, 3);
  std::uniform_real_distribution<double> noise(0, 1);
  at::Tensor seq = at::empty({count, length + 1}, at::kLong);
  int64_t* p = seq.data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i) {
    int64_t t = any(rng);
    for (int64_t j = 0; j <= length; ++j) {
      p[i * (length + 1) + j] = t;
      t = noise(rng) < 0.1 ? any(rng) : next[t][which(rng)];
    }
  }
  w.inputs = seq.narrow(1, 0, length).contiguous();
  w.targets = seq.narrow(1, 1, length).contiguous();
}

}  // namespace

const std::vector<std::string>& criteria() {
  static const std::vector<std::string> v{"cel"};
  return v;
}
const std::vector<std::string>& iteration_steps() {
  static const std::vector<std::string> v{"basic_iteration_step"};
  return v;
}

ConfigEntry load_entry(const std::string& file, const std::string& kind, const std::string& id) {
  std::ifstream in(file);
  if (!in) throw UsageError(kind + " configuration file '" + file + "' cannot be read");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const nlohmann::json::parse_error& e) {
    throw UsageError(kind + " configuration file '" + file + "' is not valid JSON: " + e.what());
  }
  if (!j.is_object()) throw UsageError(file + ": expected an object of {id: {\"" + kind + "_class\": ..., \"configurations\": {...}}}");
  if (!j.contains(id)) {
    std::vector<std::string> ids;
    for (auto it = j.begin(); it != j.end(); ++it) ids.push_back(it.key());
    throw UsageError(file + ": no " + kind + " configuration '" + id + "' (known: " + joined(ids) + ")");
  }
  const auto& entry = j.at(id);
  const std::string class_key = kind + "_class";
  if (!entry.is_object() || !entry.contains(class_key) || !entry.at(class_key).is_string() ||
      !entry.contains("configurations") || !entry.at("configurations").is_object())
    throw UsageError(file + ": " + id + " needs \"" + class_key + "\" (a string) and \"configurations\" (an object)");
  ConfigEntry out{file, kind, id, entry.at(class_key).get<std::string>(), entry.at("configurations")};
  const auto& classes = schemas().at(kind);
  auto schema = classes.find(out.cls);
  if (schema == classes.end()) {
    std::vector<std::string> known;
    for (const auto& [name, s] : classes) known.push_back(name);
    throw UsageError(file + ": " + id + " names unknown " + class_key + " '" + out.cls + "' (known: " + joined(known) + ")");
  }
  std::vector<std::string> expected;
  for (const auto& [key, type] : schema->second) {
    expected.push_back(key);
    if (!out.conf.contains(key))
      throw UsageError(file + ": " + id + ".configurations lacks \"" + key + "\" (" + type_name(type) + ")");
    if (!has_type(out.conf.at(key), type))
      throw UsageError(file + ": " + id + ".configurations." + key + " must be " + type_name(type) + ", got " +
                       out.conf.at(key).dump());
  }
  for (auto it = out.conf.begin(); it != out.conf.end(); ++it)
    if (std::find(expected.begin(), expected.end(), it.key()) == expected.end())
      throw UsageError(file + ": " + id + ".configurations has unknown key \"" + it.key() + "\" (" + out.cls +
                       " takes: " + joined(expected) + ")");
  return out;
}

Workload make_workload(const ConfigEntry& data, const ConfigEntry& model, uint64_t seed) {
  Workload w;
  auto mismatch = [&](const std::string& why) {
    return UsageError("model " + model.id + " (" + model.cls + ") cannot train on data " + data.id + " (" + data.cls +
                      "): " + why);
  };
  const auto& m = model.conf;
  const auto& d = data.conf;
  if (model.cls == "DummyModel") {
    if (data.cls != "DummyData") throw mismatch("DummyModel takes DummyData");
    const int64_t max_val = d.at("max_val").get<int64_t>();
    if (m.at("num_embeddings").get<int64_t>() < max_val || m.at("dense_output_size").get<int64_t>() < max_val)
      throw mismatch("num_embeddings and dense_output_size must be >= max_val (" + std::to_string(max_val) + ")");
    if (m.at("embedding_dim") != m.at("dense_input_size")) throw mismatch("embedding_dim must equal dense_input_size");
    dummy_data(data, seed, w);
    torch::manual_seed(seed);
    auto net = std::make_shared<DummyModelImpl>(positive(model, "num_embeddings"), positive(model, "embedding_dim"),
                                                positive(model, "dense_input_size"), positive(model, "dense_output_size"),
                                                positive(model, "dense_layers_count"), m.at("sparse").get<bool>());
    w.module = net;
    w.forward = [net](const at::Tensor& x) { return net->forward(x); };
    w.loss = [](const at::Tensor& out, const at::Tensor& y) { return torch::nn::functional::cross_entropy(out, y); };
    w.sparse_gradients = m.at("sparse").get<bool>();
  } else if (model.cls == "MLP" || model.cls == "CNN") {
    if (data.cls != "FashionMNIST") throw mismatch(model.cls + " takes FashionMNIST");
    Split split = load_fashion_mnist(d.at("dir").get<std::string>());
    w.inputs = split.train.inputs;
    w.targets = split.train.labels;
    torch::manual_seed(seed);
    if (model.cls == "MLP") {
      const auto dims = m.at("dims").get<std::vector<int64_t>>();
      if (dims.size() < 2 || dims.front() != 784 || dims.back() != split.train.num_classes)
        throw mismatch("dims must start with 784 and end with " + std::to_string(split.train.num_classes));
      auto net = std::make_shared<MlpImpl>(dims);
      w.module = net;
      w.forward = [net](const at::Tensor& x) { return net->forward(x); };
    } else {
      if (m.at("classes").get<int64_t>() != split.train.num_classes)
        throw mismatch("classes must be " + std::to_string(split.train.num_classes));
      auto net = std::make_shared<CnnImpl>(split.train.num_classes);
      w.module = net;
      w.forward = [net](const at::Tensor& x) { return net->forward(x); };
    }
    w.loss = [](const at::Tensor& out, const at::Tensor& y) { return torch::nn::functional::cross_entropy(out, y); };
  } else {  // TransformerLM
    if (data.cls != "SyntheticTokens") throw mismatch("TransformerLM takes SyntheticTokens");
    if (m.at("vocab_size") != d.at("vocab_size") || m.at("sequence_length") != d.at("sequence_length"))
      throw mismatch("vocab_size and sequence_length must match");
    if (positive(model, "d_model") % positive(model, "heads")) throw mismatch("d_model must be a multiple of heads");
    synthetic_tokens(data, w);
    torch::manual_seed(seed);
    auto net = std::make_shared<TransformerLMImpl>(positive(model, "vocab_size"), positive(model, "d_model"),
                                                   positive(model, "heads"), positive(model, "layers"),
                                                   positive(model, "feedforward"), positive(model, "sequence_length"));
    w.module = net;
    w.forward = [net](const at::Tensor& x) { return net->forward(x); };
    w.loss = [](const at::Tensor& out, const at::Tensor& y) {
      return torch::nn::functional::cross_entropy(out.reshape({-1, out.size(-1)}), y.reshape({-1}));
    };
  }
  int64_t params = 0;
  for (const auto& p : w.module->parameters()) params += p.numel();
  std::ostringstream os;
  os << model.id << " (" << params << " parameters" << (w.sparse_gradients ? ", sparse embedding" : "") << ") on "
     << data.id << " (" << w.inputs.size(0) << " samples)";
  w.description = os.str();
  return w;
}

TrainerConfig trainer_config(const ConfigEntry& e) {
  TrainerConfig t;
  t.lr = e.conf.at("lr").get<double>();
  t.bucket_cap_mb = e.conf.at("bucket_cap_mb").get<double>();
  t.criterion = e.conf.at("criterion").get<std::string>();
  t.iteration_step = e.conf.at("iteration_step").get<std::string>();
  t.powersgd_rank = static_cast<int>(positive(e, "powersgd_rank"));
  t.powersgd_start_iter = static_cast<int>(e.conf.at("powersgd_start_iter").get<int64_t>());
  if (!(t.lr > 0) || !(t.bucket_cap_mb > 0)) throw UsageError(e.file + ": " + e.id + ": lr and bucket_cap_mb must be positive");
  if (std::find(criteria().begin(), criteria().end(), t.criterion) == criteria().end())
    throw UsageError(e.file + ": " + e.id + ": unknown criterion '" + t.criterion + "' (known: " + joined(criteria()) + ")");
  if (std::find(iteration_steps().begin(), iteration_steps().end(), t.iteration_step) == iteration_steps().end())
    throw UsageError(e.file + ": " + e.id + ": unknown iteration_step '" + t.iteration_step + "' (known: " +
                     joined(iteration_steps()) + ")");
  return t;
}

ServerConfig server_config(const ConfigEntry& e) {
  ServerConfig s;
  s.server_class = e.cls;
  s.bucket_timeout_s = e.conf.at("bucket_timeout_s").get<double>();
  s.max_message_mb = e.conf.at("max_message_mb").get<double>();
  if (!(s.bucket_timeout_s > 0) || !(s.max_message_mb > 0) || s.max_message_mb > 2047)
    throw UsageError(e.file + ": " + e.id + ": bucket_timeout_s must be positive and max_message_mb in (0, 2047]");
  return s;
}

}  // namespace bench
}  // namespace cli
}  // namespace ddpkit
