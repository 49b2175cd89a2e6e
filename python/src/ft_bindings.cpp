// ddpkit._C.ft and ddpkit._C.diloco: the Manager and DiLoCo for Python (python/ddpkit/ft.py and
// diloco.py are the public API). Everything that waits on other groups runs with the GIL released;
// the state callbacks a heal or a checkpoint calls take it back.
#include "ft_bindings.h"

#include <ddpkit/codecs/codec.h>
#include <ddpkit/diloco/diloco.h>
#include <ddpkit/ft/lighthouse.h>
#include <ddpkit/ft/manager.h>

#include <torch/csrc/utils/pybind.h>

#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include <chrono>
#include <memory>

namespace py = pybind11;

namespace ddpkit {
namespace python {
namespace {

std::chrono::milliseconds ms_of(double seconds, const char* what) {
  if (!(seconds > 0)) throw py::value_error(std::string(what) + " must be > 0 seconds, got " + std::to_string(seconds));
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
}

ft::StateScope scope_of(const std::string& name) {
  if (name == "shared") return ft::StateScope::kShared;
  if (name == "shared_per_rank") return ft::StateScope::kSharedPerRank;
  if (name == "local") return ft::StateScope::kLocal;
  throw py::value_error("ddpkit.ft: scope is 'shared', 'shared_per_rank' or 'local', got '" + name + "'");
}

// A Python save/load pair as the Manager calls it (from the thread in start_step, GIL released).
// The functions are released under the GIL too: the Manager may drop them on any thread.
struct PyCallbacks {
  std::shared_ptr<py::object> save, load;
  PyCallbacks(py::object s, py::object l)
      : save(new py::object(std::move(s)), release), load(new py::object(std::move(l)), release) {}
  static void release(py::object* o) {
    py::gil_scoped_acquire gil;
    delete o;
  }
};

py::dict round_times_dict(const ft::Lighthouse::RoundTimes& t) {
  py::dict d;
  d["rounds"] = t.rounds;
  d["sampled"] = t.sampled;
  d["intake_p50_ms"] = t.intake_p50_ms;
  d["intake_p99_ms"] = t.intake_p99_ms;
  d["replies_p50_ms"] = t.replies_p50_ms;
  d["replies_p99_ms"] = t.replies_p99_ms;
  d["replies_max_ms"] = t.replies_max_ms;
  d["whole_rounds"] = t.whole_rounds;
  d["whole_replies_max_ms"] = t.whole_replies_max_ms;
  return d;
}

// The keys are the CLI's JSON fields of the same meaning (tools/ddpkit/train_ft.cpp, train_diloco.cpp);
// docs/python.md lists them.
py::dict manager_stats(const ft::ManagerStats& s) {
  py::dict d;
  d["quorums"] = s.quorums;
  d["reconfigurations"] = s.reconfigurations;
  d["reconfiguration_seconds"] = s.reconfiguration_seconds;
  d["longest_reconfiguration_seconds"] = s.longest_reconfiguration_seconds;
  d["heals"] = s.heals;
  d["init_syncs"] = s.init_syncs;
  d["heal_bytes"] = s.heal_bytes;
  d["heal_seconds"] = s.heal_seconds;
  d["heal_fetch_seconds"] = s.heal_fetch_seconds;
  d["serve_seconds"] = s.serve_seconds;
  d["heals_single_copy"] = s.heals_single_copy;
  d["heal_route"] = s.heal_route;
  d["steps_committed"] = s.steps_committed;
  d["steps_not_committed"] = s.steps_not_committed;
  d["steps_healing"] = s.steps_healing;
  d["quorum_wait_seconds"] = s.quorum_wait_seconds;
  d["snapshot_seconds"] = s.snapshot_seconds;
  d["last_error"] = s.last_error;
  d["cross_transport"] = s.cross_transport;
  d["cross_bytes_sent"] = s.cross_bytes_sent;
  return d;
}

py::dict diloco_stats(const diloco::DiLoCoStats& s) {
  py::dict d;
  d["inner_steps"] = s.inner_steps;
  d["outer_syncs"] = s.syncs;
  d["sync_retries"] = s.sync_retries;
  d["heals"] = s.heals;
  d["checksum_mismatches"] = s.checksum_mismatches;
  d["last_checksum_mismatch"] = s.last_checksum_mismatch;
  d["last_sites"] = s.last_sites;
  d["last_sites_weighted"] = s.last_sites_weighted;
  d["sync_blocked_seconds"] = s.blocked_seconds;
  d["longest_sync_blocked_seconds"] = s.longest_blocked_seconds;
  d["longest_later_sync_blocked_seconds"] = s.longest_later_blocked_seconds;
  d["sync_transfer_seconds"] = s.transfer_seconds;
  d["site_gather_seconds"] = s.site_gather_seconds;
  d["sync_wait_seconds"] = s.wait_seconds;
  d["last_error"] = s.last_error;
  return d;
}

}  // namespace

void bind_ft(py::module& root) {
  py::module m = root.def_submodule("ft", "ddpkit's fault-tolerant Manager (see ddpkit.ft)");
  static py::exception<ft::JobFinished> job_finished(m, "JobFinished", root.attr("CommError"));
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const ft::JobFinished& e) {
      PyErr_SetString(job_finished.ptr(), e.what());
    }
  });
  py::class_<ft::Lighthouse>(m, "Lighthouse")
      .def(py::init([](const std::string& address, int min_replicas, double join_timeout_s, int expected_groups,
                       double heartbeat_timeout_s, const std::string& token, py::object on_event) {
             ft::LighthouseOptions o;
             o.address(address)
                 .min_replicas(min_replicas)
                 .join_timeout(ms_of(join_timeout_s, "join_timeout"))
                 .expected_groups(expected_groups)
                 .heartbeat_timeout(ms_of(heartbeat_timeout_s, "heartbeat_timeout"))
                 .token(token);
             if (!on_event.is_none()) {
               // Called on the lighthouse's ticker thread: the GIL is taken for the call, and an
               // exception it raises is reported (sys.unraisablehook), not passed into the lighthouse.
               PyCallbacks cb(on_event, py::none());
               o.on_event([cb](const std::string& event) {
                 py::gil_scoped_acquire gil;
                 try {
                   (*cb.save)(event);
                 } catch (py::error_already_set& e) {
                   e.discard_as_unraisable("ddpkit.ft.Lighthouse on_event");
                 }
               });
             }
             auto lh = std::make_unique<ft::Lighthouse>(std::move(o));
             lh->start();
             return lh;
           }),
           py::arg("address"), py::arg("min_replicas"), py::arg("join_timeout_s"), py::arg("expected_groups"),
           py::arg("heartbeat_timeout_s"), py::arg("token"), py::arg("on_event") = py::none())
      .def_property_readonly("address", &ft::Lighthouse::address)
      .def_property_readonly("quorums_formed", &ft::Lighthouse::quorums_formed)
      .def_property_readonly("round_times", [](const ft::Lighthouse& lh) { return round_times_dict(lh.round_times()); })
      .def("shutdown", &ft::Lighthouse::shutdown, py::call_guard<py::gil_scoped_release>());
  py::class_<ft::Manager>(m, "Manager")
      .def(py::init([](std::shared_ptr<ProcessGroup> group, const std::string& lighthouse, const std::string& group_id,
                       const std::string& token, double quorum_timeout_s, double cross_group_timeout_s,
                       double heartbeat_interval_s, int cross_gloo_threads, int heal_connections,
                       bool cross_lazy_connections, bool init_sync, const std::string& quorum_mode) {
             if (quorum_mode != "async" && quorum_mode != "sync")
               throw py::value_error("ddpkit.ft.Manager: quorum_mode is 'async' or 'sync', got '" + quorum_mode + "'");
             ft::ManagerOptions o;
             o.lighthouse(lighthouse)
                 .group_id(group_id)
                 .token(token)
                 .quorum_timeout(ms_of(quorum_timeout_s, "quorum_timeout"))
                 .cross_group_timeout(ms_of(cross_group_timeout_s, "cross_group_timeout"))
                 .heartbeat_interval(ms_of(heartbeat_interval_s, "heartbeat_interval"))
                 .cross_gloo_threads(cross_gloo_threads)
                 .heal_connections(heal_connections)
                 .cross_lazy_connections(cross_lazy_connections)
                 .init_sync(init_sync)
                 .quorum_mode(quorum_mode == "sync" ? ft::QuorumMode::kSync : ft::QuorumMode::kAsync);
             py::gil_scoped_release nogil;  // collective over the group
             return std::make_unique<ft::Manager>(std::move(group), std::move(o));
           }),
           py::arg("group"), py::arg("lighthouse"), py::arg("group_id"), py::arg("token"), py::arg("quorum_timeout_s"),
           py::arg("cross_group_timeout_s"), py::arg("heartbeat_interval_s"), py::arg("cross_gloo_threads"),
           py::arg("heal_connections"), py::arg("cross_lazy_connections") = false, py::arg("init_sync") = true,
           py::arg("quorum_mode") = "async")
      .def("register_state",
           [](ft::Manager& mgr, const std::string& key, py::object save, py::object load, const std::string& scope) {
             PyCallbacks cb(std::move(save), std::move(load));
             mgr.register_state(
                 key,
                 [cb] {
                   py::gil_scoped_acquire gil;
                   return (*cb.save)().cast<TensorDict>();
                 },
                 [cb](const TensorDict& d) {
                   py::gil_scoped_acquire gil;
                   (*cb.load)(py::cast(d));
                 },
                 scope_of(scope));
           },
           py::arg("key"), py::arg("save"), py::arg("load"), py::arg("scope"))
      .def("unregister_state", &ft::Manager::unregister_state)
      .def("start_step", py::overload_cast<>(&ft::Manager::start_step), py::call_guard<py::gil_scoped_release>())
      .def("allreduce", &ft::Manager::allreduce, py::call_guard<py::gil_scoped_release>())
      .def("should_commit", &ft::Manager::should_commit, py::call_guard<py::gil_scoped_release>())
      .def("fail_step", &ft::Manager::fail_step)
      .def("request_heal", &ft::Manager::request_heal)
      .def("close", &ft::Manager::close, py::arg("leave") = true, py::call_guard<py::gil_scoped_release>())
      .def("resume_at", &ft::Manager::resume_at)
      .def("save_checkpoint", &ft::Manager::save_checkpoint, py::arg("dir"), py::arg("keep") = 3,
           py::call_guard<py::gil_scoped_release>())
      .def("restore_checkpoint", &ft::Manager::restore_checkpoint, py::arg("dir"),
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("step", &ft::Manager::step)
      .def_property_readonly("replica_rank", &ft::Manager::replica_rank)
      .def_property_readonly("replica_count", &ft::Manager::replica_count)
      .def_property_readonly("group_id", &ft::Manager::group_id)
      .def_property_readonly("group", &ft::Manager::group)
      .def("stats", [](const ft::Manager& mgr) { return manager_stats(mgr.stats()); });

  py::module d = root.def_submodule("diloco", "ddpkit's DiLoCo (see ddpkit.diloco)");
  d.def("codec_names", &codecs::codec_names);
  d.def("fragments_of", &diloco::fragments_of, py::arg("layers"), py::arg("count"), py::arg("layout"));
  py::class_<diloco::DiLoCo>(d, "DiLoCo")
      .def(py::init([](ft::Manager& manager, std::vector<std::vector<at::Tensor>> fragments, int64_t sync_every,
                       double outer_lr, double outer_momentum, bool nesterov, const std::string& codec,
                       bool error_feedback, int64_t fragment_delay, double fragment_alpha, double round_seconds,
                       bool parameters_sharded, int64_t piece_bytes) {
             diloco::DiLoCoOptions o;
             o.sync_every(sync_every)
                 .outer_lr(outer_lr)
                 .outer_momentum(outer_momentum)
                 .nesterov(nesterov)
                 .codec(codec)
                 .error_feedback(error_feedback)
                 .fragment_delay(fragment_delay)
                 .fragment_alpha(fragment_alpha)
                 .round_seconds(round_seconds)
                 .parameters_sharded(parameters_sharded)
                 .piece_bytes(piece_bytes);
             return std::make_unique<diloco::DiLoCo>(manager, std::move(fragments), std::move(o));
           }),
           py::keep_alive<1, 2>(),  // the Manager outlives its DiLoCo
           py::arg("manager"), py::arg("fragments"), py::arg("sync_every"), py::arg("outer_lr"),
           py::arg("outer_momentum"), py::arg("nesterov"), py::arg("codec"), py::arg("error_feedback"),
           py::arg("fragment_delay"), py::arg("fragment_alpha"), py::arg("round_seconds"),
           py::arg("parameters_sharded"), py::arg("piece_bytes"))
      .def("start", &diloco::DiLoCo::start, py::call_guard<py::gil_scoped_release>())
      .def("after_inner_step", &diloco::DiLoCo::after_inner_step, py::call_guard<py::gil_scoped_release>())
      .def("finish", &diloco::DiLoCo::finish, py::call_guard<py::gil_scoped_release>())
      .def("global_parameters", &diloco::DiLoCo::global_parameters)
      .def_property_readonly("fragments", &diloco::DiLoCo::fragments)
      .def_property_readonly("outer_steps", &diloco::DiLoCo::outer_steps)
      .def("stats", [](const diloco::DiLoCo& dl) { return diloco_stats(dl.stats()); });
}

}  // namespace python
}  // namespace ddpkit
