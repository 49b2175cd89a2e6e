// Which of this host's addresses the others reach it at (internal).
#pragma once

#include <string>

namespace ddpkit {

// The local IPv4 address on the route to `host` (a name or an address): the one the other ranks
// can reach this process at, where the host name's own address (Gloo's default) is often not (a
// node whose name resolves to another network, or to nothing in a container). "" when `host`
// does not resolve. Sends nothing.
std::string local_address_towards(const std::string& host, int port);

// Whether `host` names this machine's loopback ("", localhost, 127.x, ::1): peers that meet there
// are all on this host.
bool is_loopback_host(const std::string& host);

}  // namespace ddpkit
