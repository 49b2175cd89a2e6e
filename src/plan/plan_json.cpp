// The cost model's JSON (include/ddpkit/plan/cost_model.h): machine constants (--calibrate's file),
// predictions (--json), and models: a profile as --save-profile writes it, or a description a user
// writes for a model this machine cannot profile (docs/plan.md, "Describing a model").
#include <ddpkit/plan/cost_model.h>

#include <ddpkit/error.h>

#include <algorithm>
#include <set>

#include <nlohmann/json.hpp>

namespace ddpkit {
namespace plan {

namespace {
using nlohmann::json;
json path_json(const PathCost& p) { return {{"latency_us", p.latency_us}, {"gbyte_per_s", p.gbyte_per_s}}; }
PathCost path_of(const json& j, const char* name) {
  DDPKIT_CHECK(j.contains(name), "machine constants: no '", name, "' (rerun ddpkit plan --calibrate)");
  PathCost p;
  p.latency_us = j.at(name).at("latency_us").get<double>();
  p.gbyte_per_s = j.at(name).at("gbyte_per_s").get<double>();
  DDPKIT_CHECK(p.gbyte_per_s > 0, "machine constants: '", name, "' has a bandwidth of ", p.gbyte_per_s);
  return p;
}
const std::vector<std::pair<const char*, PathCost MachineConstants::*>> kPaths = {
    {"shm_allreduce_in_place", &MachineConstants::shm_allreduce_in_place},
    {"shm_allreduce", &MachineConstants::shm_allreduce},
    {"shm_allreduce_16bit", &MachineConstants::shm_allreduce_16bit},
    {"shm_reduce_scatter", &MachineConstants::shm_reduce_scatter},
    {"shm_allgather", &MachineConstants::shm_allgather},
    {"shm_broadcast", &MachineConstants::shm_broadcast},
    {"shm_alltoall", &MachineConstants::shm_alltoall}};
const std::vector<std::pair<const char*, double MachineConstants::*>> kRates = {
    {"tcp_latency_us", &MachineConstants::tcp_latency_us},
    {"tcp_efficiency", &MachineConstants::tcp_efficiency},
    {"tcp_gbyte_per_s", &MachineConstants::tcp_gbyte_per_s},
    {"copy_gbyte_per_s", &MachineConstants::copy_gbyte_per_s},
    {"cast_gbyte_per_s", &MachineConstants::cast_gbyte_per_s},
    {"fp16_div_gbyte_per_s", &MachineConstants::fp16_div_gbyte_per_s},
    {"int8_gbyte_per_s", &MachineConstants::int8_gbyte_per_s},
    {"uint8_encode_gbyte_per_s", &MachineConstants::uint8_encode_gbyte_per_s},
    {"uint8_decode_gbyte_per_s", &MachineConstants::uint8_decode_gbyte_per_s},
    {"matmul_gflop_per_s", &MachineConstants::matmul_gflop_per_s},
    {"matmul_rank32_gflop_per_s", &MachineConstants::matmul_rank32_gflop_per_s},
    {"gemm_gflop_per_s", &MachineConstants::gemm_gflop_per_s}};
}  // namespace

std::string to_json(const MachineConstants& m) {
  json j;
  j["cores"] = m.cores;
  for (const auto& p : kPaths) j[p.first] = path_json(m.*(p.second));
  for (const auto& r : kRates) j[r.first] = m.*(r.second);
  j["process_bytes"] = m.process_bytes;
  j["extra_bytes_per_param_byte"] = m.extra_bytes_per_param_byte;
  j["extra_bytes_per_param_byte_gloo"] = m.extra_bytes_per_param_byte_gloo;
  j["memory_model"] = m.memory_model;
  j["measured_on"] = m.measured_on;
  return j.dump(1);
}

std::string rate_missing_from(const std::string& text) {
  const json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || !j.contains("tcp_latency_us")) return "";  // every version wrote it
  for (const auto& r : kRates)
    if (!j.contains(r.first)) return r.first;
  return "";
}

MachineConstants machine_constants_from_json(const std::string& text) {
  json j;
  try {
    j = json::parse(text);
  } catch (const std::exception& e) {
    DDPKIT_CHECK(false, "machine constants: not JSON (", e.what(), ")");
  }
  MachineConstants m;
  try {
    m.cores = j.at("cores").get<int>();
    for (const auto& p : kPaths) m.*(p.second) = path_of(j, p.first);
    for (const auto& r : kRates) m.*(r.second) = j.at(r.first).get<double>();
    m.process_bytes = j.at("process_bytes").get<int64_t>();
    if (j.contains("extra_bytes_per_param_byte")) {
      m.extra_bytes_per_param_byte = j.at("extra_bytes_per_param_byte").get<std::map<std::string, double>>();
      m.memory_model = j.value("memory_model", 1);
    }
    if (j.contains("extra_bytes_per_param_byte_gloo"))
      m.extra_bytes_per_param_byte_gloo = j.at("extra_bytes_per_param_byte_gloo").get<std::map<std::string, double>>();
    m.measured_on = j.value("measured_on", "");
  } catch (const json::exception& e) {
    DDPKIT_CHECK(false, "machine constants: ", e.what(), " (rerun ddpkit plan --calibrate)");
  }
  DDPKIT_CHECK(m.cores >= 1, "machine constants: cores must be >= 1, got ", m.cores);
  DDPKIT_CHECK(m.extra_bytes_per_param_byte.empty() || m.memory_model == MachineConstants::kMemoryModel,
               "machine constants: the strategies' measured extras are residuals of memory model ", m.memory_model,
               ", this ddpkit's is ", MachineConstants::kMemoryModel, " (rerun ddpkit plan --calibrate)");
  return m;
}

std::string to_json(const std::vector<Prediction>& rows) {
  json out = json::array();
  for (const auto& r : rows) {
    const auto& m = r.memory;
    out.push_back({{"strategy", to_string(r.candidate.strategy)},
                   {"hook", to_string(r.candidate.hook)},
                   {"optimizer_in_hook", r.candidate.optimizer_in_hook},
                   {"param_dtype", r.candidate.param_dtype},
                   {"reduce_dtype", r.candidate.reduced_in()},
                   {"bucket_cap_mb", r.candidate.bucket_cap_mb.value_or(0)},
                   {"predicted_step_ms", r.step_ms},
                   {"compute_ms", r.compute_ms},
                   {"exposed_comm_ms", r.exposed_comm_ms},
                   {"wire_bytes_per_step", r.wire_bytes_per_step},
                   {"memory_per_rank_bytes", m.total()},
                   {"memory", {{"process", m.process}, {"data", m.data}, {"parameters", m.parameters},
                               {"gradients", m.gradients}, {"optimizer_state", m.optimizer_state},
                               {"communication", m.communication}, {"activations", m.activations},
                               {"host_shared", m.host_shared}, {"measured_extra", m.measured_extra}, {"while_loading", m.loading}}},
                   {"fits", r.fits}});
  }
  return out.dump(1);
}

// ---- models -----------------------------------------------------------------------------------

namespace {

// Bytes the optimizer's step reads and writes per parameter: the parameter, its gradient and the
// state (SGD's momentum; Adam's two moments).
double optimizer_bytes_per_param(const std::string& optimizer) {
  if (optimizer == "sgd") return 20;
  if (optimizer == "adam" || optimizer == "adamw") return 28;
  DDPKIT_CHECK(false, "model description: optimizer must be sgd, adam or adamw, got '", optimizer, "'");
}

std::vector<int64_t> shape_of(const json& j, const std::string& where) {
  DDPKIT_CHECK(j.is_array(), "model description: ", where, " must be a shape (an array of sizes), got ", j.dump());
  std::vector<int64_t> shape;
  for (const auto& d : j) {
    DDPKIT_CHECK(d.is_number_integer() && d.get<int64_t>() >= 1, "model description: ", where,
                 " must hold positive integer sizes, got ", j.dump());
    shape.push_back(d.get<int64_t>());
  }
  return shape;
}

double positive(const json& j, const char* key) {
  DDPKIT_CHECK(j.at(key).is_number() && j.at(key).get<double>() > 0, "model description: '", key,
               "' must be a positive number, got ", j.at(key).dump());
  return j.at(key).get<double>();
}

// "bf16": the compute under FSDP's mixed precision. Left out: backward twice the forward,
// activations the fp32 ones (a real process's are mostly heap that does not shrink with the
// dtype), gradients ready at the fp32 times scaled to its backward.
ComputeProfile bf16_compute_from_json(const json& j, const ModelProfile& m) {
  DDPKIT_CHECK(j.is_object() && j.contains("forward_ms"), "model description: 'bf16' must be an object with ",
               "forward_ms (and optionally backward_ms, activation_bytes, grad_ready_ms)");
  for (const auto& kv : j.items())
    DDPKIT_CHECK(kv.key() == "forward_ms" || kv.key() == "backward_ms" || kv.key() == "activation_bytes" ||
                     kv.key() == "grad_ready_ms",
                 "model description: bf16 has an unknown key '", kv.key(), "'");
  ComputeProfile c;
  c.forward_ms = positive(j, "forward_ms");
  c.backward_ms = j.contains("backward_ms") ? positive(j, "backward_ms") : 2 * c.forward_ms;
  c.activation_bytes = j.value("activation_bytes", m.activation_bytes);
  DDPKIT_CHECK(c.activation_bytes >= 0, "model description: bf16.activation_bytes must be >= 0");
  if (j.contains("grad_ready_ms")) {
    DDPKIT_CHECK(j.at("grad_ready_ms").is_array() && j.at("grad_ready_ms").size() == m.params.size(),
                 "model description: bf16.grad_ready_ms needs one time per parameter (", m.params.size(), ")");
    c.grad_ready_ms = j.at("grad_ready_ms").get<std::vector<double>>();
  } else {
    for (const auto& p : m.params) c.grad_ready_ms.push_back(p.grad_ready_ms * c.backward_ms / std::max(m.backward_ms, 1e-9));
  }
  return c;
}

}  // namespace

std::string to_json(const ModelProfile& model) {
  json layers = json::array();
  for (size_t i = 0; i < model.params.size();) {
    // One layer per run of parameters in the same unit, in the module's order.
    json shapes = json::array(), ready = json::array();
    const int unit = model.params[i].unit;
    for (; i < model.params.size() && model.params[i].unit == unit; ++i) {
      shapes.push_back(model.params[i].shape);
      ready.push_back(model.params[i].grad_ready_ms);
    }
    layers.push_back({{"unit", unit}, {"params", shapes}, {"grad_ready_ms", ready}});
  }
  json j = {{"name", model.name},
            {"batch", model.batch},
            {"threads", model.threads},
            {"concurrent", model.concurrent},
            {"forward_ms", model.forward_ms},
            {"backward_ms", model.backward_ms},
            {"optimizer_ms", model.optimizer_ms},
            {"activation_bytes", model.activation_bytes},
            {"data_bytes", model.data_bytes},
            {"data_load_bytes", model.data_load_bytes},
            {"layers", layers}};
  if (model.bf16)
    j["bf16"] = {{"forward_ms", model.bf16->forward_ms},
                 {"backward_ms", model.bf16->backward_ms},
                 {"activation_bytes", model.bf16->activation_bytes},
                 {"grad_ready_ms", model.bf16->grad_ready_ms}};
  return j.dump(1);
}

ModelProfile model_profile_from_json(const std::string& text, const MachineConstants& machine,
                                     const std::string& optimizer) {
  json j;
  try {
    j = json::parse(text);
  } catch (const std::exception& e) {
    DDPKIT_CHECK(false, "model description: not JSON (", e.what(), ")");
  }
  DDPKIT_CHECK(j.is_object(), "model description: expected an object, got ", j.dump().substr(0, 80));
  const std::set<std::string> known = {"name", "batch", "threads", "concurrent", "forward_ms", "forward_gflop",
                                       "backward_ms", "backward_gflop", "optimizer_ms", "activation_bytes",
                                       "data_bytes", "data_load_bytes", "layers", "bf16"};
  for (const auto& kv : j.items())
    DDPKIT_CHECK(known.count(kv.key()), "model description: unknown key '", kv.key(), "' (docs/plan.md lists them)");
  ModelProfile m;
  bool ready_given = true;  // every layer gave its gradient-ready times
  try {
    m.name = j.value("name", std::string("described"));
    m.batch = j.value("batch", 1);
    m.threads = j.value("threads", 1);
    m.concurrent = j.value("concurrent", 1);
    DDPKIT_CHECK(m.batch >= 1 && m.threads >= 1 && m.concurrent >= 1,
                 "model description: batch, threads and concurrent must be >= 1");
    m.activation_bytes = j.value("activation_bytes", int64_t{0});
    m.data_bytes = j.value("data_bytes", int64_t{0});
    m.data_load_bytes = j.value("data_load_bytes", int64_t{0});
    DDPKIT_CHECK(m.activation_bytes >= 0 && m.data_bytes >= 0 && m.data_load_bytes >= 0,
                 "model description: byte counts must be >= 0");

    DDPKIT_CHECK(j.contains("layers") && j.at("layers").is_array() && !j.at("layers").empty(),
                 "model description: 'layers' must be a non-empty array of {\"params\": [shapes], ...}");
    int next_unit = 0, units = 0;
    bool indexed = false;
    for (size_t l = 0; l < j.at("layers").size(); ++l) {
      const json& layer = j.at("layers")[l];
      const std::string where = "layers[" + std::to_string(l) + "]";
      DDPKIT_CHECK(layer.is_object() && layer.contains("params") && layer.at("params").is_array(), "model description: ",
                   where, " needs \"params\": an array of shapes");
      for (const auto& kv : layer.items())
        DDPKIT_CHECK(kv.key() == "name" || kv.key() == "params" || kv.key() == "unit" || kv.key() == "repeat" ||
                         kv.key() == "grad_ready_ms",
                     "model description: ", where, " has an unknown key '", kv.key(), "'");
      const int repeat = layer.value("repeat", 1);
      DDPKIT_CHECK(repeat >= 1, "model description: ", where, ".repeat must be >= 1, got ", repeat);
      // unit: true (each repetition a unit of its own, the default), false (the root's), or a
      // unit's index as --save-profile writes it.
      const json unit = layer.value("unit", json(true));
      DDPKIT_CHECK(unit.is_boolean() || (unit.is_number_integer() && unit.get<int>() >= -1), "model description: ",
                   where, ".unit must be true, false or a unit index, got ", unit.dump());
      const json* ready = layer.contains("grad_ready_ms") ? &layer.at("grad_ready_ms") : nullptr;
      DDPKIT_CHECK(!ready || (repeat == 1 && ready->is_array() && ready->size() == layer.at("params").size()),
                   "model description: ", where, ".grad_ready_ms needs one time per parameter and no repeat");
      ready_given = ready_given && ready;
      for (int r = 0; r < repeat; ++r) {
        int index = -1;
        if (unit.is_boolean()) {
          index = unit.get<bool>() ? next_unit++ : -1;
        } else {
          index = unit.get<int>();
          indexed = indexed || index >= 0;
        }
        units = std::max(units, index + 1);
        for (size_t k = 0; k < layer.at("params").size(); ++k) {
          ParamProfile p;
          p.shape = shape_of(layer.at("params")[k], where + ".params[" + std::to_string(k) + "]");
          p.numel = 1;
          for (int64_t d : p.shape) p.numel *= d;
          p.unit = index;
          if (ready) p.grad_ready_ms = (*ready)[k].get<double>();
          m.params.push_back(p);
        }
      }
    }
    DDPKIT_CHECK(!(indexed && next_unit > 0), "model description: give units as true/false or as indices, not both");
    m.unit_numel.assign(static_cast<size_t>(units), 0);
    for (const auto& p : m.params)
      if (p.unit >= 0) m.unit_numel[static_cast<size_t>(p.unit)] += p.numel;

    // Compute: measured times, else floating-point work at the calibrated rate of a layer's
    // products (backward: twice the forward's, as for the matrix products that dominate it).
    DDPKIT_CHECK(j.contains("forward_ms") != j.contains("forward_gflop"),
                 "model description: give one of forward_ms (measured) and forward_gflop (per rank and step)");
    m.forward_ms = j.contains("forward_ms") ? positive(j, "forward_ms")
                                            : positive(j, "forward_gflop") * 1e3 / machine.gemm_gflop_per_s;
    DDPKIT_CHECK(!(j.contains("backward_ms") && j.contains("backward_gflop")),
                 "model description: give backward_ms or backward_gflop, not both");
    if (j.contains("backward_ms")) m.backward_ms = positive(j, "backward_ms");
    else if (j.contains("backward_gflop")) m.backward_ms = positive(j, "backward_gflop") * 1e3 / machine.gemm_gflop_per_s;
    else m.backward_ms = 2 * m.forward_ms;
  } catch (const json::exception& e) {
    DDPKIT_CHECK(false, "model description: ", e.what());
  }
  // copy_gbyte_per_s counts the bytes a copy delivers; each is read and written: two bytes moved.
  const double parameters = static_cast<double>(m.param_bytes()) / 4;
  m.optimizer_ms = j.contains("optimizer_ms") ? positive(j, "optimizer_ms")
                                              : parameters * optimizer_bytes_per_param(optimizer) /
                                                    (2 * machine.copy_gbyte_per_s * 1e6);
  if (!ready_given) {
    // Backward runs the layers in reverse: a parameter's gradient is ready once the backward of
    // everything after it, and its own, has run, in proportion to their parameters.
    double after = 0;
    for (auto it = m.params.rbegin(); it != m.params.rend(); ++it) {
      after += static_cast<double>(it->numel);
      it->grad_ready_ms = m.backward_ms * after / parameters;
    }
  }
  if (j.contains("bf16")) m.bf16 = bf16_compute_from_json(j.at("bf16"), m);
  return m;
}

}  // namespace plan
}  // namespace ddpkit
