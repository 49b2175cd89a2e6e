#include "shared_region.h"

#include "../comm/peer_memory.h"

#include <ddpkit/error.h>

#include "parameter_server.pb.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <random>

namespace ddpkit {
namespace ps {
namespace {

std::string random_bytes(size_t n) {
  std::random_device rd;
  std::string out(n, '\0');
  for (auto& c : out) c = static_cast<char>(rd());
  return out;
}

}  // namespace

SharedRegion::SharedRegion(int64_t slot_bytes, int slots) {
  DDPKIT_CHECK(slot_bytes > 0 && slot_bytes % 64 == 0 && slots > 0 && slots <= kMaxMailboxes,
               "shared-memory region: bad slot layout (", slots, " slots of ", slot_bytes, " bytes)");
  slot_bytes_ = slot_bytes;
  mailboxes_ = slots;
  bytes_ = first_slot() + slot_bytes * slots;
  void* p = nullptr;
  std::string error;
  fd_ = detail::create_peer_memory("ddpkit-ps", static_cast<size_t>(bytes_), &p, &error);
  if (fd_ < 0) throw CommError("ddpkit ps: cannot set up a shared-memory region: " + error);
  base_ = static_cast<uint8_t*>(p);
  cookie_ = random_bytes(kCookieBytes);
  std::memcpy(base_, cookie_.data(), kCookieBytes);
  const std::string id = random_bytes(sizeof(id_));
  std::memcpy(&id_, id.data(), sizeof(id_));
  for (int s = slots - 1; s >= 0; --s) free_.push_back(first_slot() + s * slot_bytes);
}

std::shared_ptr<SharedRegion> SharedRegion::attach(int64_t pid, int fd, int64_t bytes, const std::string& cookie,
                                                   int mailboxes, std::string* error) {
  if (pid <= 0 || fd < 0 || mailboxes < 0 || mailboxes > kMaxMailboxes ||
      bytes <= kHeaderBytes + mailboxes * kMailboxBytes || bytes > (int64_t(1) << 36) ||
      cookie.size() != static_cast<size_t>(kCookieBytes)) {
    *error = "malformed offer (pid " + std::to_string(pid) + ", fd " + std::to_string(fd) + ", " +
             std::to_string(bytes) + " bytes, " + std::to_string(mailboxes) + " mailboxes)";
    return nullptr;
  }
  // The offer names no inode: the cookie below tells the trainer's region from anything else.
  detail::PeerMemoryAddress address;
  address.pid = static_cast<long>(pid);
  address.fd = fd;
  address.bytes = static_cast<unsigned long long>(bytes);
  void* p = detail::map_peer_memory(address, error);
  if (!p) return nullptr;
  std::shared_ptr<SharedRegion> region(new SharedRegion());
  region->base_ = static_cast<uint8_t*>(p);
  region->bytes_ = bytes;
  region->mailboxes_ = mailboxes;
  if (std::memcmp(region->base_, cookie.data(), kCookieBytes) != 0) {
    *error = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(fd) +
             " is not the trainer's region (cookie differs: another host or PID namespace)";
    return nullptr;
  }
  return region;
}

SharedRegion::~SharedRegion() {
  if (base_) detail::unmap_peer_memory(base_, bytes_);
  if (fd_ >= 0) ::close(fd_);
}

void SharedRegion::offer(wire::SharedMemoryOffer* out) const {
  out->set_pid(::getpid());
  out->set_fd(fd_);
  out->set_bytes(bytes_);
  out->set_region(id_);
  out->set_cookie(cookie_);
  out->set_mailboxes(mailboxes_);
}

int64_t SharedRegion::acquire() {
  std::lock_guard<std::mutex> lock(mu_);
  if (free_.empty()) return -1;
  const int64_t offset = free_.back();
  free_.pop_back();
  return offset;
}

void SharedRegion::release(int64_t offset) {
  std::lock_guard<std::mutex> lock(mu_);
  free_.push_back(offset);
}

}  // namespace ps
}  // namespace ddpkit
