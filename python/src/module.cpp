// ddpkit._C: ddpkit's process group, communication hooks and model averager for Python, to
// plug into torch.nn.parallel.DistributedDataParallel. The public API is python/ddpkit/__init__.py;
// this file converts arguments, releases the GIL around anything that waits, and turns ddpkit's
// errors into Python exceptions that name what is wrong.
#include "backend.h"
#ifdef DDPKIT_WITH_FT
#include "ft_bindings.h"
#endif
#include "torch_ddp_hook.h"
#include "torch_fsdp2_comm.h"

#include <ddpkit/comm/launch_environment.h>
#include <ddpkit/comm/process_group.h>
#include <ddpkit/hooks/default_hooks.h>
#include <ddpkit/hooks/post_local_sgd_hook.h>
#include <ddpkit/hooks/powersgd_hook.h>
#include <ddpkit/hooks/quantization_hooks.h>
#ifdef DDPKIT_WITH_PS
#include <ddpkit/ps/parameter_server.h>
#include <ddpkit/ps/trainer_hooks.h>
#endif

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/reducer.hpp>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <pybind11/stl.h>

#include <algorithm>
#include <cstdlib>
#include <set>
#include <sstream>

namespace py = pybind11;

namespace ddpkit {
namespace python {
namespace {

std::string join(const std::vector<std::string>& items) {
  std::ostringstream os;
  for (size_t i = 0; i < items.size(); ++i) os << (i ? ", " : "") << items[i];
  return os.str();
}

// Every hook register_comm_hook accepts, in the order the docs list them.
std::vector<std::string> all_hook_names() {
  std::vector<std::string> names = hooks::hook_names();
  names.push_back("post_local_sgd");
#ifdef DDPKIT_WITH_PS
  for (const char* n : {"rpc", "sparse_rpc", "hybrid"}) names.push_back(n);
#endif
  return names;
}

// Keyword options of one hook: typed getters that record which keys were asked for, and a final
// check that rejects keys no getter asked for, listing those it would have taken.
class Options {
 public:
  Options(std::string hook, py::dict values) : hook_(std::move(hook)), values_(std::move(values)) {}

  int64_t integer(const char* key, int64_t fallback) {
    py::object v = take(key);
    if (!v) return fallback;
    if (py::isinstance<py::bool_>(v) || !py::isinstance<py::int_>(v)) type_error(key, "an int", v);
    return v.cast<int64_t>();
  }
  double real(const char* key, double fallback) {
    py::object v = take(key);
    if (!v) return fallback;
    if (py::isinstance<py::bool_>(v) || !(py::isinstance<py::float_>(v) || py::isinstance<py::int_>(v)))
      type_error(key, "a float", v);
    return v.cast<double>();
  }
  bool boolean(const char* key, bool fallback) {
    py::object v = take(key);
    if (!v) return fallback;
    if (!py::isinstance<py::bool_>(v)) type_error(key, "a bool", v);
    return v.cast<bool>();
  }
  std::string string(const char* key, const std::string& fallback) {
    py::object v = take(key);
    if (!v) return fallback;
    if (!py::isinstance<py::str>(v)) type_error(key, "a str", v);
    return v.cast<std::string>();
  }
  bool has(const char* key) const { return values_.contains(key) && !values_[key].is_none(); }

  void value_error(const char* key, const std::string& why) const {
    throw py::value_error("ddpkit.register_comm_hook: hook '" + hook_ + "': option " + key + " " + why);
  }
  // Call after every getter: an unknown key is a TypeError, as for any Python function.
  void finish() const {
    for (auto item : values_) {
      const auto key = item.first.cast<std::string>();
      if (!asked_.count(key)) {
        std::vector<std::string> known(asked_.begin(), asked_.end());
        throw py::type_error("ddpkit.register_comm_hook: hook '" + hook_ + "' has no option '" + key + "' (" +
                             (known.empty() ? std::string("it takes none") : "its options: " + join(known)) + ")");
      }
    }
  }

 private:
  py::object take(const char* key) {
    asked_.insert(key);
    if (!values_.contains(key)) return py::object();
    py::object v = values_[key];
    return v.is_none() ? py::object() : v;
  }
  [[noreturn]] void type_error(const char* key, const char* expected, const py::object& v) const {
    throw py::type_error("ddpkit.register_comm_hook: hook '" + hook_ + "': option " + key + " must be " + expected +
                         ", got " + std::string(py::str(py::type::of(v).attr("__name__"))) + " " +
                         std::string(py::repr(v)));
  }

  std::string hook_;
  py::dict values_;
  std::set<std::string> asked_;
};

hooks::PowerSGDOptions powersgd_options(Options& o) {
  hooks::PowerSGDOptions p;  // PyTorch's PowerSGDState defaults
  p.matrix_approximation_rank(o.integer("matrix_approximation_rank", p.matrix_approximation_rank()))
      .start_powerSGD_iter(o.integer("start_powerSGD_iter", p.start_powerSGD_iter()))
      .min_compression_rate(o.real("min_compression_rate", p.min_compression_rate()))
      .use_error_feedback(o.boolean("use_error_feedback", p.use_error_feedback()))
      .warm_start(o.boolean("warm_start", p.warm_start()))
      .orthogonalization_epsilon(o.real("orthogonalization_epsilon", p.orthogonalization_epsilon()))
      .compression_stats_logging_frequency(
          o.integer("compression_stats_logging_frequency", p.compression_stats_logging_frequency()))
      .batch_tensors_with_same_shape(o.boolean("batch_tensors_with_same_shape", p.batch_tensors_with_same_shape()));
  const int64_t seed = o.integer("random_seed", 0);
  if (seed < 0) o.value_error("random_seed", "must be >= 0, got " + std::to_string(seed));
  p.random_seed(static_cast<uint64_t>(seed));
  return p;
}

// Builds the hook `name` on `group` from keyword options (their names are PyTorch's where PyTorch
// has the hook). Runs without the GIL only where noted: option parsing needs it.
std::shared_ptr<HookState> make_hook(const std::string& name, std::shared_ptr<ProcessGroup> group, py::dict kwargs,
                                     std::shared_ptr<ProcessGroup> dense_group) {
  // ddpkit.register_comm_hook has checked the name (before making a group: a collective) and
  // passes a group.
  auto state = std::make_shared<HookState>();
  state->name = name;
  state->group = group;
  state->key_base = next_traffic_key_base();
  Options o(name, kwargs);
  const std::string wrapper = o.string("wrapper", "");
  if (!wrapper.empty() && wrapper != "fp16" && wrapper != "bf16")
    o.value_error("wrapper", "must be 'fp16' or 'bf16', got '" + wrapper + "'");

  try {
    if (name == "powersgd" || name == "batched_powersgd") {
      auto options = powersgd_options(o);
      o.finish();
      state->powersgd = std::make_shared<hooks::PowerSGDState>(group, options);
      state->hook = name == "powersgd" ? hooks::powerSGD_hook(state->powersgd)
                                       : hooks::batched_powerSGD_hook(state->powersgd);
    } else if (name == "post_local_sgd") {
      if (!o.has("start_localSGD_iter"))
        o.value_error("start_localSGD_iter", "is required (the iteration where local SGD starts)");
      const int64_t start = o.integer("start_localSGD_iter", 0);
      const bool post_allreduce = o.boolean("post_local_gradient_allreduce", true);
      // PyTorch's default subgroup is the ranks on this machine: torchrun's LOCAL_WORLD_SIZE.
      int64_t subgroup_size = group->size();
      if (const char* local = std::getenv("LOCAL_WORLD_SIZE")) subgroup_size = std::atoll(local);
      subgroup_size = o.integer("subgroup_size", subgroup_size);
      o.finish();
      if (start < 1) o.value_error("start_localSGD_iter", "must be >= 1, got " + std::to_string(start));
      if (post_allreduce && (subgroup_size < 1 || group->size() % subgroup_size != 0))
        o.value_error("subgroup_size", "must divide the world size " + std::to_string(group->size()) + ", got " +
                                           std::to_string(subgroup_size));
      std::shared_ptr<ProcessGroup> subgroup;
      if (post_allreduce) {
        py::gil_scoped_release no_gil;  // a rendezvous
        subgroup = subgroup_size == group->size() ? group : new_subgroups(*group, static_cast<int>(subgroup_size));
      }
      state->local_sgd = std::make_shared<hooks::PostLocalSGDState>(group, subgroup, start);
      state->hook = hooks::post_localSGD_hook(state->local_sgd);
#ifdef DDPKIT_WITH_PS
    } else if (name == "rpc" || name == "sparse_rpc") {
      if (!o.has("server")) o.value_error("server", "is required: the HOST:PORT a `ddpkit ps-server` listens on");
      ps::ClientOptions c;
      c.address(o.string("server", ""))
          .trainer_id(static_cast<int>(o.integer("trainer_id", group->rank())))
          .timeout(std::chrono::milliseconds(static_cast<int64_t>(1000 * o.real("timeout_s", 120))))
          .connect_timeout(std::chrono::milliseconds(static_cast<int64_t>(1000 * o.real("connect_timeout_s", 30))))
          .token(o.string("token", ""))
          .open_session(o.boolean("open_session", true));
      c.tls().root_certificate(o.string("root_certificate", ""));
      o.finish();
      if (c.address().find(':') == std::string::npos)
        o.value_error("server", "must be HOST:PORT, got '" + c.address() + "'");
      {
        py::gil_scoped_release no_gil;  // may wait for the server
        state->client = std::make_shared<ps::ParameterServerClient>(c);
      }
      state->hook = name == "rpc" ? ps::rpc_hook(state->client) : ps::sparse_rpc_hook(state->client, group);
    } else if (name == "hybrid") {
      o.finish();
      state->hook = ps::hybrid_hook(group, dense_group ? dense_group : group);
#endif
    } else {
      hooks::HookOptions options;
      if (name == "int8") {
        options.int8().block(o.integer("block", options.int8().block()));
        options.int8().error_feedback(o.boolean("error_feedback", options.int8().error_feedback()));
        if (options.int8().block() < 1)
          o.value_error("block", "must be >= 1, got " + std::to_string(options.int8().block()));
      } else if (name == "quantize_per_channel") {
        options.perchannel_bucket_size(o.integer("bucket_size", options.perchannel_bucket_size()));
        if (options.perchannel_bucket_size() < 1)
          o.value_error("bucket_size", "must be >= 1, got " + std::to_string(options.perchannel_bucket_size()));
      }
      o.finish();
      state->hook = hooks::make_hook(name, group, options);
    }
  } catch (const c10::Error& e) {
    // ddpkit's own argument checks (DDPKIT_CHECK): a bad option value.
    throw py::value_error("ddpkit.register_comm_hook: hook '" + name + "': " + e.what_without_backtrace());
  }
  if (wrapper == "fp16") state->hook = hooks::fp16_compress_wrapper(state->hook);
  if (wrapper == "bf16") state->hook = hooks::bf16_compress_wrapper(state->hook);
  return state;
}

void install(py::object reducer_object, const std::shared_ptr<HookState>& state) {
  auto reducer = reducer_object.cast<std::shared_ptr<c10d::Reducer>>();
  if (state->installed.exchange(true))
    throw py::value_error("ddpkit: this hook state is already registered on a model; register a new one per model");
  try {
    reducer->register_comm_hook(std::make_unique<TorchDdpHook>(state));
  } catch (const c10::Error& e) {
    state->installed = false;
    throw std::runtime_error(std::string("ddpkit.register_comm_hook: PyTorch's DDP refused the hook: ") +
                             e.what_without_backtrace());
  }
}

py::dict comm_stats_dict(const CommStats& s) {
  py::dict d;
  d["bytes_sent"] = s.bytes_sent;
  d["bytes_received"] = s.bytes_received;
  d["collectives"] = s.collectives;
  d["shm_bytes_sent"] = s.shm_bytes_sent;
  d["shm_bytes_received"] = s.shm_bytes_received;
  return d;
}

py::list bucket_traffic(const HookState& state) {
  std::map<size_t, HookState::Bucket> buckets;
  {
    std::lock_guard<std::mutex> lock(state.mutex);
    buckets = state.buckets;
  }
  py::list out;
  for (const auto& [index, b] : buckets) {
    BucketTraffic t;  // the C++ DDP's per-bucket record, for its compression ratio
    t.traffic = state.group->traffic(state.key_base + static_cast<int64_t>(index));
    t.allreduce_bytes = b.allreduce_bytes;
    py::dict d = comm_stats_dict(t.traffic);
    d["index"] = index;
    d["numel"] = b.numel;
    d["launches"] = b.launches;
    d["allreduce_bytes"] = b.allreduce_bytes;
    d["compression_ratio"] = t.traffic.bytes_sent + t.traffic.shm_bytes_sent ? py::object(py::float_(t.compression_ratio())) : py::object(py::none());
    out.append(d);
  }
  return out;
}

std::vector<at::Tensor> tensor_list(py::iterable items, const char* what) {
  std::vector<at::Tensor> out;
  for (py::handle h : items) {
    if (!THPVariable_Check(h.ptr()))
      throw py::type_error(std::string(what) + ": expected tensors, got " +
                           std::string(py::str(py::type::of(h).attr("__name__"))));
    out.push_back(THPVariable_Unpack(h.ptr()));
  }
  return out;
}

}  // namespace
}  // namespace python
}  // namespace ddpkit

PYBIND11_MODULE(_C, m) {
  using namespace ddpkit;
  using namespace ddpkit::python;
  m.doc() = "ddpkit's native communication hooks for torch.nn.parallel.DistributedDataParallel";
  py::register_exception<CommError>(m, "CommError", PyExc_RuntimeError);
  bind_backend(m);
  bind_fsdp2_comm(m);
#ifdef DDPKIT_WITH_FT
  bind_ft(m);
#endif

  py::class_<ProcessGroup, std::shared_ptr<ProcessGroup>>(m, "ProcessGroup",
      "A ddpkit process group (Gloo): ordered collectives with a timeout; see ddpkit.new_group")
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int world_size, const std::string& name,
                       int gloo_threads, double timeout_s, const std::string& gloo_hostname, bool shared_memory) {
             if (world_size < 1 || rank < 0 || rank >= world_size)
               throw py::value_error("ddpkit.new_group: rank " + std::to_string(rank) + " is not in a world of " +
                                     std::to_string(world_size));
             if (gloo_threads < 1)
               throw py::value_error("ddpkit.new_group: gloo_threads must be >= 1, got " + std::to_string(gloo_threads));
             if (!(timeout_s > 0))
               throw py::value_error("ddpkit.new_group: timeout must be positive, got " + std::to_string(timeout_s) + " s");
             ProcessGroupOptions o;
             o.group_name(name).gloo_threads(gloo_threads).gloo_hostname(gloo_hostname).timeout(
                 std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000)));
             o.shared_memory(shared_memory);
             py::gil_scoped_release no_gil;  // rendezvous with the other ranks
             auto prefixed = c10::make_intrusive<c10d::PrefixStore>("ddpkit", store);
             // Deleted wherever its last reference goes, often a Python thread: see without_gil.
             return std::shared_ptr<ProcessGroup>(new ProcessGroup(prefixed, rank, world_size, o), [](ProcessGroup* g) {
               without_gil([g] { delete g; });
             });
           }),
           py::arg("store"), py::arg("rank"), py::arg("world_size"), py::arg("name"), py::arg("gloo_threads") = 2,
           py::arg("timeout_s") = 300.0, py::arg("gloo_hostname") = "", py::arg("shared_memory") = true)
      .def("rank", &ProcessGroup::rank)
      .def("size", &ProcessGroup::size)
      .def_property_readonly("name", [](const ProcessGroup& g) { return g.options().group_name(); })
      .def_property_readonly("gloo_threads", [](const ProcessGroup& g) { return g.options().gloo_threads(); })
      .def_property_readonly("timeout_s", [](const ProcessGroup& g) { return g.timeout().count() / 1000.0; })
      .def("stats", [](const ProcessGroup& g) { return comm_stats_dict(g.stats()); },
           "Bytes this rank sent and received over the network and through shared memory (nccl-tests' "
           "bus-bandwidth model) and collectives issued")
      .def("reset_stats", &ProcessGroup::reset_stats)
      .def("allreduce",
           [](ProcessGroup& g, const at::Tensor& t) {
             py::gil_scoped_release no_gil;
             ProcessGroup::wait(g.allreduce(t));
           },
           "SUM-allreduce a CPU tensor in place and wait")
      .def("barrier", [](ProcessGroup& g) {
        py::gil_scoped_release no_gil;
        ProcessGroup::wait(g.barrier());
      });

  py::class_<HookState, std::shared_ptr<HookState>>(m, "HookState",
      "What ddpkit.register_comm_hook returns: the hook's state and counters")
      .def_property_readonly("name", [](const HookState& s) { return s.name; })
      .def_property_readonly("group", [](const HookState& s) { return s.group; })
      .def_property_readonly("iter",
          [](const HookState& s) -> int64_t {
            if (s.powersgd) return s.powersgd->iteration();
            if (s.local_sgd) return s.local_sgd->iteration();
            std::lock_guard<std::mutex> lock(s.mutex);
            return s.iterations;
          },
          "Iterations (backward passes) the hook has seen, as PowerSGDState.iter / PostLocalSGDState.iter")
      .def("compression_stats",
           [](const HookState& s) -> py::object {
             if (!s.powersgd)
               throw py::attribute_error("compression_stats: hook '" + s.name + "' is not a PowerSGD hook");
             auto [rate, before, after] = s.powersgd->compression_stats();
             return py::make_tuple(rate, before, after);
           },
           "PowerSGD: (compression rate, numel before, numel after), as PowerSGDState.compression_stats()")
      .def("error",
           [](const HookState& s, size_t bucket) -> py::object {
             if (!s.powersgd) throw py::attribute_error("error: hook '" + s.name + "' is not a PowerSGD hook");
             at::Tensor e = s.powersgd->error(bucket);
             return e.defined() ? py::cast(e) : py::none();
           },
           "PowerSGD: a bucket's error-feedback memory (None before its first compressed step)")
      .def("bucket_traffic", [](const HookState& s) { return bucket_traffic(s); },
           "Per bucket: numel, launches, bytes_sent, bytes_received, collectives, allreduce_bytes (what a "
           "ring allreduce of the same buckets sends) and compression_ratio = allreduce_bytes / bytes_sent")
      .def("launch_stats",
           [](const HookState& s) {
             std::lock_guard<std::mutex> lock(s.mutex);
             py::dict d;
             d["launches"] = s.launches;
             d["python_calls_per_bucket"] = 0;
             d["adapter_us_per_bucket"] = s.launches ? s.adapter_ns / 1e3 / s.launches : 0.0;
             d["launch_us_per_bucket"] = s.launches ? s.launch_ns / 1e3 / s.launches : 0.0;
             return d;
           },
           "Cost of handing a bucket to the hook: wrapping PyTorch's bucket (adapter) and the whole launch "
           "(adapter plus the hook's synchronous part); no Python runs per bucket")
#ifdef DDPKIT_WITH_PS
      .def("ps_traffic",
           [](const HookState& s) -> py::object {
             if (!s.client) return py::none();
             auto t = s.client->traffic();
             py::dict d;
             d["bytes_sent"] = t.bytes_sent;
             d["bytes_received"] = t.bytes_received;
             d["shm_bytes_sent"] = t.shm_bytes_sent;
             d["shm_bytes_received"] = t.shm_bytes_received;
             d["calls"] = t.calls;
             d["doorbell_calls"] = t.doorbell_calls;
             d["shared_memory"] = s.client->uses_shared_memory();
             return d;
           },
           "rpc/sparse_rpc: what this trainer sent to and received from its parameter server: bytes in "
           "messages, bytes through shared memory (a server on this host), calls, and of those the calls "
           "posted in the shared-memory region's mailboxes instead of sent by gRPC")
#endif
      .def("__repr__", [](const HookState& s) {
        return "<ddpkit.HookState '" + s.name + "' on a group of " + std::to_string(s.group->size()) + ">";
      });

  m.def(
      "launch_environment",
      []() {
        const ddpkit::LaunchEnvironment e = ddpkit::detect_launch_environment();
        py::dict d;
        d["engine"] = e.engine;
        d["per_node"] = e.per_node;
        d["rank"] = e.rank;
        d["world_size"] = e.world_size;
        d["local_rank"] = e.local_rank;
        d["local_world_size"] = e.local_world_size;
        d["node_rank"] = e.node_rank;
        d["nnodes"] = e.nnodes;
        d["master_addr"] = e.master_addr;
        d["master_port"] = e.master_port;
        d["summary"] = e.summary;
        return d;
      },
      "The engine that started this process and what it says (docs/launching.md)");
  m.def("hook_names", &all_hook_names, "Every hook ddpkit.register_comm_hook accepts");
  m.def("make_hook", &make_hook, py::arg("name"), py::arg("group"), py::arg("options"),
        py::arg("dense_group") = nullptr);
  m.def("install", &install, py::arg("reducer"), py::arg("state"),
        "Registers a HookState on a DistributedDataParallel's reducer (its C++ hook interface)");

  py::class_<hooks::PeriodicModelAverager, std::shared_ptr<hooks::PeriodicModelAverager>>(m, "PeriodicModelAverager")
      .def(py::init([](int64_t period, int64_t warmup_steps, std::shared_ptr<ProcessGroup> group) {
             if (period < 1) throw py::value_error("PeriodicModelAverager: period must be >= 1, got " + std::to_string(period));
             if (warmup_steps < 0)
               throw py::value_error("PeriodicModelAverager: warmup_steps must be >= 0, got " + std::to_string(warmup_steps));
             return std::make_shared<hooks::PeriodicModelAverager>(period, warmup_steps, std::move(group));
           }),
           py::arg("period"), py::arg("warmup_steps"), py::arg("group"))
      .def("average_parameters",
           [](hooks::PeriodicModelAverager& a, py::iterable params) {
             auto tensors = tensor_list(params, "PeriodicModelAverager.average_parameters");
             py::gil_scoped_release no_gil;
             return a.average_parameters(tensors);
           },
           py::arg("params"), "Counts a step; on the averaging steps averages `params` in place across the group")
      .def_property_readonly("step", &hooks::PeriodicModelAverager::step);

  m.def("average_parameters",
        [](py::iterable params, ProcessGroup& group) {
          auto tensors = tensor_list(params, "average_parameters");
          py::gil_scoped_release no_gil;
          hooks::average_parameters(tensors, group);
        },
        py::arg("params"), py::arg("group"));
}
