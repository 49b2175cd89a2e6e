// The lighthouse's client (include/ddpkit/ft/lighthouse.h): quorum asks as deltas against the
// quorum it holds, heartbeats for one rank or for a whole group.
#include <ddpkit/ft/lighthouse.h>

#include <ddpkit/error.h>

#include "../ps/grpc_common.h"
#include "lighthouse.grpc.pb.h"
#include "wire.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <iostream>
#include <mutex>
#include <optional>
#include <thread>

namespace ddpkit {
namespace ft {

struct LighthouseClient::Impl {
  LighthouseClientOptions options;
  std::unique_ptr<wire::Lighthouse::Stub> stub;
  // The last full quorum and the lighthouse that formed it: the next ask names it, and a reply
  // with the same participants leaves them out.
  std::mutex known_mu;
  std::optional<Quorum> known;
  std::string known_lighthouse;

  void prepare(grpc::ClientContext& ctx, std::chrono::milliseconds deadline) const {
    ctx.set_deadline(std::chrono::system_clock::now() + deadline);
    ps::add_token(ctx, options.token());
  }
  Beat beat(const wire::HeartbeatRequest& req);
  [[noreturn]] void fail(const char* what, const grpc::Status& s) const {
    throw CommError("ddpkit: lighthouse " + options.address() + ": " + what + " failed (" +
                    std::to_string(static_cast<int>(s.error_code())) + "): " + s.error_message());
  }
};

LighthouseClient::LighthouseClient(LighthouseClientOptions options) : impl_(std::make_unique<Impl>()) {
  ps::hold_grpc_runtime();
  DDPKIT_CHECK(!options.address().empty(), "lighthouse client: no address given (host:port)");
  impl_->options = std::move(options);
  const auto creds = ps::channel_credentials(impl_->options.tls().root_certificate());
  grpc::ChannelArguments args;
  // Heartbeats must not wait out a reconnect backoff after the lighthouse restarts.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 500);
  // A full quorum of thousands of groups passes gRPC's default 4 MB.
  args.SetMaxReceiveMessageSize(256 * 1024 * 1024);
  impl_->stub = wire::Lighthouse::NewStub(grpc::CreateCustomChannel(impl_->options.address(), creds, args));
}

LighthouseClient::~LighthouseClient() = default;

Quorum LighthouseClient::quorum(const GroupInfo& self, std::chrono::milliseconds timeout, bool broken) {
  wire::QuorumRequest req;
  wire::to_wire(self, req.mutable_member());
  req.set_broken(broken);
  {
    std::lock_guard<std::mutex> lock(impl_->known_mu);
    if (impl_->known) {
      req.set_known_quorum_id(impl_->known->quorum_id);
      req.set_known_lighthouse(impl_->known_lighthouse);
    }
  }
  wire::QuorumReply reply;
  // A lighthouse that is away (restarting) is asked again until the timeout.
  const auto give_up = std::chrono::steady_clock::now() + timeout;
  bool refused_before = false;
  for (;;) {
    grpc::ClientContext ctx;
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(give_up - std::chrono::steady_clock::now());
    req.set_timeout_ms(std::max<int64_t>(1, left.count()));
    impl_->prepare(ctx, std::max(left, std::chrono::milliseconds(1)) + impl_->options.rpc_timeout());
    const grpc::Status s = impl_->stub->Quorum(&ctx, req, &reply);
    if (s.ok()) break;
    if (s.error_code() == grpc::StatusCode::FAILED_PRECONDITION)
      throw JobFinished("ddpkit: lighthouse " + impl_->options.address() + ": " + s.error_message());
    if (s.error_code() != grpc::StatusCode::UNAVAILABLE || std::chrono::steady_clock::now() >= give_up)
      impl_->fail("quorum", s);
    if (!refused_before) {
      // Said at once: a wrong address is refused at every try, and the timeout may be a minute away.
      refused_before = true;
      std::cerr << "ddpkit: group " << self.group_id << ": the lighthouse at " << impl_->options.address()
                << " cannot be reached (" << s.error_message() << "); asking again every 100 ms for "
                << std::max<int64_t>(0, left.count()) << " ms more (the quorum timeout)" << std::endl;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  std::lock_guard<std::mutex> lock(impl_->known_mu);
  if (reply.delta()) {
    DDPKIT_CHECK(impl_->known && impl_->known_lighthouse == reply.lighthouse(), "lighthouse ",
                 impl_->options.address(), " answered quorum ", reply.quorum_id(),
                 " as a delta against a quorum this client does not hold");
    reply = wire::apply_delta(reply, *impl_->known);  // the whole quorum, checked below as one sent whole
  }
  const std::string bad = wire::check_reply(reply);
  DDPKIT_CHECK(bad.empty(), "lighthouse ", impl_->options.address(), " sent a malformed quorum: ", bad);
  Quorum q = wire::from_wire(reply);
  DDPKIT_CHECK(q.replica_rank(self.group_id) >= 0, "lighthouse ", impl_->options.address(),
               " sent a quorum without group ", self.group_id, " in it");
  impl_->known = q;
  impl_->known_lighthouse = reply.lighthouse();
  return q;
}

LighthouseClient::Beat LighthouseClient::heartbeat(const std::string& group_id, int rank, const std::string& incarnation) {
  wire::HeartbeatRequest req;
  req.set_group_id(group_id);
  req.set_rank(rank);
  req.set_incarnation(incarnation);
  return impl_->beat(req);
}

LighthouseClient::Beat LighthouseClient::heartbeat_for_group(const std::string& group_id, const std::string& incarnation,
                                                             const std::vector<int64_t>& rank_ages_ms) {
  DDPKIT_CHECK(!rank_ages_ms.empty(), "lighthouse client: a group's heartbeat needs every rank's age (rank 0's first)");
  wire::HeartbeatRequest req;
  req.set_group_id(group_id);
  req.set_rank(0);
  req.set_incarnation(incarnation);
  for (int64_t age : rank_ages_ms) req.add_rank_ages_ms(std::max<int64_t>(0, age));
  return impl_->beat(req);
}

void LighthouseClient::leave(const std::string& group_id, const std::string& incarnation, int64_t step) {
  wire::LeaveRequest req;
  req.set_group_id(group_id);
  req.set_incarnation(incarnation);
  req.set_step(step);
  wire::LeaveReply reply;
  grpc::ClientContext ctx;
  impl_->prepare(ctx, impl_->options.rpc_timeout());
  const grpc::Status s = impl_->stub->Leave(&ctx, req, &reply);
  if (!s.ok()) impl_->fail("leave", s);
}

LighthouseClient::Beat LighthouseClient::Impl::beat(const wire::HeartbeatRequest& req) {
  wire::HeartbeatReply reply;
  grpc::ClientContext ctx;
  prepare(ctx, options.rpc_timeout());
  const grpc::Status s = stub->Heartbeat(&ctx, req, &reply);
  if (!s.ok()) fail("heartbeat", s);
  Beat b;
  b.quorum_id = reply.quorum_id();
  for (const auto& g : reply.lost()) b.lost.push_back(g);
  return b;
}

}  // namespace ft
}  // namespace ddpkit
