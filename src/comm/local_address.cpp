// local_address_towards (local_address.h).
#include "local_address.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

namespace ddpkit {

std::string local_address_towards(const std::string& host, int port) {
  addrinfo hints{}, *found = nullptr;
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) != 0 || !found) return "";
  std::string local;
  const int fd = ::socket(AF_INET, SOCK_DGRAM, 0);
  // A UDP connect sends nothing: it only asks the kernel which route, hence which source address.
  if (fd >= 0 && ::connect(fd, found->ai_addr, found->ai_addrlen) == 0) {
    sockaddr_in mine{};
    socklen_t len = sizeof(mine);
    char text[INET_ADDRSTRLEN] = {};
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&mine), &len) == 0 &&
        inet_ntop(AF_INET, &mine.sin_addr, text, sizeof(text)))
      local = text;
  }
  if (fd >= 0) ::close(fd);
  freeaddrinfo(found);
  return local;
}

bool is_loopback_host(const std::string& host) {
  return host.empty() || host == "localhost" || host.rfind("127.", 0) == 0 || host == "::1";
}

}  // namespace ddpkit
