// Native reconfigure for the ddpkit backend (backend_reconfigure.h).
#include "backend_reconfigure.h"
#include "comm/local_address.h"  // src/: the library's own route lookup

#include <ddpkit/compat.h>
#include <ddpkit/error.h>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <unistd.h>

#include <cstdlib>
#include <random>
#include <sstream>

namespace ddpkit {
namespace python {
namespace {

const std::string kScheme = "ddpkit://";

std::string interface_address(const std::string& name) {
  struct ifaddrs* all = nullptr;
  DDPKIT_CHECK(getifaddrs(&all) == 0, "ddpkit backend: cannot list this host's interfaces for GLOO_SOCKET_IFNAME");
  std::string found;
  for (struct ifaddrs* i = all; i && found.empty(); i = i->ifa_next) {
    if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET || name != i->ifa_name) continue;
    char text[INET_ADDRSTRLEN] = {};
    inet_ntop(AF_INET, &reinterpret_cast<struct sockaddr_in*>(i->ifa_addr)->sin_addr, text, sizeof text);
    found = text;
  }
  freeifaddrs(all);
  DDPKIT_CHECK(!found.empty(), "ddpkit backend: GLOO_SOCKET_IFNAME=", name, " has no IPv4 address here");
  return found;
}

std::string random_id() {
  std::random_device device;
  std::ostringstream out;
  out << std::hex << device() << device() << device() << device();
  return out.str();
}

struct Endpoint {
  std::string host;
  int port = 0;
};

// "ddpkit://HOST:PORT/ID" -> HOST, PORT; `what` names the handle in errors.
Endpoint parse(const std::string& handle, const std::string& what) {
  const auto bad = [&](const char* why) {
    return std::string("ddpkit backend: reconfigure: ") + what + " (\"" + handle + "\") is not a ddpkit handle: " + why +
           " (a ddpkit group's handles come from get_reconfigure_handle() of groups of the ddpkit backend made with "
           "enable_reconfigure=True)";
  };
  DDPKIT_CHECK(handle.rfind(kScheme, 0) == 0, bad("it does not start with ddpkit://"));
  const std::string rest = handle.substr(kScheme.size());
  const size_t slash = rest.find('/'), colon = rest.rfind(':', slash);
  DDPKIT_CHECK(slash != std::string::npos && colon != std::string::npos && colon > 0 && slash > colon + 1 &&
                   slash + 1 < rest.size(),
               bad("it has no HOST:PORT/ID"));
  Endpoint e;
  e.host = rest.substr(0, colon);
  try {
    e.port = std::stoi(rest.substr(colon + 1, slash - colon - 1));
  } catch (const std::exception&) {
    DDPKIT_CHECK(false, bad("its port is not a number"));
  }
  DDPKIT_CHECK(e.port > 0 && e.port < 65536, bad("its port is out of range"));
  return e;
}

}  // namespace

std::string advertised_address() {
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME")) return interface_address(ifname);
  const char* master = std::getenv("MASTER_ADDR");
  if (is_loopback_host(master ? master : "")) return "127.0.0.1";
  const std::string towards = local_address_towards(master, 1);
  if (!towards.empty()) return towards;
  char name[256] = {};
  gethostname(name, sizeof name - 1);
  return name;
}

ReconfigureEndpoint::ReconfigureEndpoint(std::chrono::milliseconds timeout) {
  const std::string host = advertised_address();
  c10d::TCPStoreOptions so = compat::tcp_store_options();
  so.port = 0;
  so.isServer = true;
  so.waitWorkers = false;
  so.timeout = timeout;
  server_ = c10::make_intrusive<c10d::TCPStore>(host, so);
  handle_ = kScheme + host + ":" + std::to_string(server_->getPort()) + "/" + random_id();
}

Membership ReconfigureEndpoint::place(const std::vector<std::string>& handles) const {
  DDPKIT_CHECK(!handles.empty(), "ddpkit backend: reconfigure got no handles (one per member, this rank's among them)");
  Membership m;
  m.size = static_cast<int>(handles.size());
  m.rank = -1;
  for (int i = 0; i < m.size; ++i) {
    parse(handles[i], "handle " + std::to_string(i));
    if (handles[i] == handle_) {
      DDPKIT_CHECK(m.rank < 0, "ddpkit backend: reconfigure: this rank's handle appears twice (", i, " and ", m.rank, ")");
      m.rank = i;
    }
  }
  DDPKIT_CHECK(m.rank >= 0, "ddpkit backend: reconfigure: this rank's handle (", handle_, ") is not among the ",
               m.size, " handles given; pass every member's get_reconfigure_handle(), this rank's included");
  const Endpoint first = parse(handles[0], "handle 0");
  m.store_host = first.host;
  m.store_port = first.port;
  return m;
}

std::shared_ptr<ProcessGroup> ReconfigureEndpoint::connect(const Membership& m, int64_t uuid,
                                                           ProcessGroupOptions options) {
  const std::string address = m.store_host + ":" + std::to_string(m.store_port);
  if (!client_ || client_address_ != address) {
    client_ = compat::tcp_store_client(m.store_host, m.store_port, options.timeout());
    client_address_ = address;
  }
  client_->setTimeout(options.timeout());
  const std::string name = "ddpkit.reconfigure." + std::to_string(uuid);
  auto store = c10::make_intrusive<c10d::PrefixStore>(name, client_);
  // Gloo listens on the address the first member reaches this host at (loopback where all are here).
  if (options.gloo_hostname().empty() && !std::getenv("GLOO_SOCKET_IFNAME")) {
    const std::string towards =
        is_loopback_host(m.store_host) ? "127.0.0.1" : local_address_towards(m.store_host, m.store_port);
    if (!towards.empty()) options.gloo_hostname(towards);
  }
  options.group_name(name);
  try {
    return std::make_shared<ProcessGroup>(store, m.rank, m.size, options);
  } catch (...) {
    client_.reset();
    throw;
  }
}

}  // namespace python
}  // namespace ddpkit
