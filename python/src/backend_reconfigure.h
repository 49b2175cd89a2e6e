// Native reconfigure for the ddpkit backend (c10d's fault-tolerance API, torch >= 2.14): a group
// made with enable_reconfigure=True names this rank in a handle, and reconfigure() builds a new
// ddpkit::ProcessGroup over the members an ordered list of handles names (shared memory within a
// host, Gloo between hosts), rendezvousing at the first member's endpoint. Included by
// backend.cpp only; it is compiled for every torch, used where the c10d API exists.
#pragma once

#include <ddpkit/comm/process_group.h>

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

namespace ddpkit {
namespace python {

// Where this rank's place in a membership is, from the members' handles.
struct Membership {
  int rank = 0;
  int size = 0;
  std::string store_host;  // the first member's endpoint: the rendezvous
  int store_port = 0;
};

// This rank's endpoint: a store it hosts on the address the other members reach it at, and the
// handle that names it ("ddpkit://HOST:PORT/ID", ID new per endpoint, so a rank that restarts is
// a new member).
class ReconfigureEndpoint {
 public:
  explicit ReconfigureEndpoint(std::chrono::milliseconds timeout);
  const std::string& handle() const { return handle_; }
  // This rank's place among `handles` (in that order); names what is wrong with them.
  Membership place(const std::vector<std::string>& handles) const;
  // A ddpkit group of the membership, made with `options` (its name and the address Gloo listens
  // on set here), rendezvousing under a prefix of its own (`uuid`) at the first member's store.
  // Bounded by options.timeout(); collective over the members. Not thread-safe (the backend
  // serializes reconfigures).
  std::shared_ptr<ProcessGroup> connect(const Membership& m, int64_t uuid, ProcessGroupOptions options);

 private:
  c10::intrusive_ptr<c10d::TCPStore> server_;
  std::string handle_;
  // The connection to the last rendezvous store, kept for the next reconfigure: a new TCPStore
  // connection per reconfigure met c10d's 5 s stall in a client's first exchange about one time in
  // ten (torch 2.15, either server). Dropped after a failed rendezvous, whose abandoned wait may
  // still be answered on it.
  std::string client_address_;
  c10::intrusive_ptr<c10d::TCPStore> client_;
};

// The address other hosts reach this one at: GLOO_SOCKET_IFNAME's, else 127.0.0.1 where
// MASTER_ADDR is loopback or unset, else the one on the route to MASTER_ADDR, else the host name's.
std::string advertised_address();

}  // namespace python
}  // namespace ddpkit
