#include "peer_memory.h"

#include <ddpkit/runtime/memory_sampler.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <sstream>

namespace ddpkit {
namespace detail {

int create_peer_memory(const char* label, size_t bytes, void** base, std::string* error, bool reserve) {
  const int fd = ::memfd_create(label, MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) {
    *error = std::string("memfd_create failed: ") + std::strerror(errno);
    return -1;
  }
  const off_t size = static_cast<off_t>(bytes);
  int err = ::ftruncate(fd, size) != 0 ? errno : reserve ? ::posix_fallocate(fd, 0, size) : 0;
  if (err != 0) {
    *error = "cannot reserve " + std::to_string(bytes) + " bytes of shared memory: " + std::strerror(err);
  } else if (::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    *error = std::string("cannot seal shared memory: ") + std::strerror(errno);
  } else {
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p != MAP_FAILED) {
      *base = p;
      note_owned_shared_memory(p, bytes, reserve);
      return fd;
    }
    *error = "cannot map " + std::to_string(bytes) + " bytes of shared memory: " + std::strerror(errno);
  }
  ::close(fd);
  return -1;
}

void unmap_peer_memory(void* base, size_t bytes) {
  forget_owned_shared_memory(base);
  ::munmap(base, bytes);
}

std::string peer_memory_address(int fd) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return "";
  std::ostringstream os;
  os << ::getpid() << " " << fd << " " << static_cast<unsigned long long>(st.st_dev) << " "
     << static_cast<unsigned long long>(st.st_ino) << " " << static_cast<unsigned long long>(st.st_size);
  return os.str();
}

bool parse_peer_memory_address(const std::string& text, PeerMemoryAddress* out) {
  std::istringstream in(text);
  PeerMemoryAddress a;
  if (!(in >> a.pid >> a.fd >> a.dev >> a.ino >> a.bytes) || a.pid <= 0 || a.fd < 0 || a.ino == 0) return false;
  std::string rest;
  if (in >> rest) return false;
  *out = a;
  return true;
}

int open_peer_memory(const PeerMemoryAddress& a, std::string* error) {
  const std::string path = "/proc/" + std::to_string(a.pid) + "/fd/" + std::to_string(a.fd);
  const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) {
    const int e = errno;
    *error = "cannot open " + path + ": " + std::strerror(e) +
             (e == ENOENT                ? " (the owner exited, or is in another PID namespace)"
              : e == EACCES || e == EPERM ? " (another user, or the owner is not dumpable)"
                                          : "");
    return -1;
  }
  struct stat st {};
  const int seals = ::fcntl(fd, F_GET_SEALS);
  if (::fstat(fd, &st) != 0 || (a.ino != 0 && (static_cast<unsigned long long>(st.st_dev) != a.dev ||
                                                 static_cast<unsigned long long>(st.st_ino) != a.ino))) {
    *error = path + " is no longer the memory its owner published (fd or pid reused)";
  } else if (seals < 0 || !(seals & F_SEAL_SHRINK) || static_cast<unsigned long long>(st.st_size) != a.bytes) {
    *error = path + " is not a sealed " + std::to_string(a.bytes) + "-byte memfd";
  } else {
    return fd;
  }
  ::close(fd);
  return -1;
}

void* map_peer_memory(const PeerMemoryAddress& a, std::string* error, int* keep_fd) {
  const int fd = open_peer_memory(a, error);
  if (fd < 0) return nullptr;
  void* p = ::mmap(nullptr, static_cast<size_t>(a.bytes), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    const int e = errno;
    *error = "cannot map /proc/" + std::to_string(a.pid) + "/fd/" + std::to_string(a.fd) + ": " + std::strerror(e);
    ::close(fd);
    return nullptr;
  }
  if (keep_fd)
    *keep_fd = fd;
  else
    ::close(fd);
  return p;
}

}  // namespace detail
}  // namespace ddpkit
