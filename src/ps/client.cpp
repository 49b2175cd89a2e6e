// The trainer's side: one channel per server; AverageGradient through gRPC's callback API, so a
// hook returns at once and its future completes on a gRPC thread (client_average.cpp). Here: the
// client's setup, its session and shared-memory offer, and the blocking calls.
#include "client_impl.h"

#include "../comm/shm_switch.h"

#include <iostream>

namespace ddpkit {
namespace ps {
namespace {


const char* code_name(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::OK: return "OK";
    case grpc::StatusCode::CANCELLED: return "CANCELLED";
    case grpc::StatusCode::UNKNOWN: return "UNKNOWN";
    case grpc::StatusCode::INVALID_ARGUMENT: return "INVALID_ARGUMENT";
    case grpc::StatusCode::DEADLINE_EXCEEDED: return "DEADLINE_EXCEEDED";
    case grpc::StatusCode::NOT_FOUND: return "NOT_FOUND";
    case grpc::StatusCode::ALREADY_EXISTS: return "ALREADY_EXISTS";
    case grpc::StatusCode::PERMISSION_DENIED: return "PERMISSION_DENIED";
    case grpc::StatusCode::RESOURCE_EXHAUSTED: return "RESOURCE_EXHAUSTED";
    case grpc::StatusCode::FAILED_PRECONDITION: return "FAILED_PRECONDITION";
    case grpc::StatusCode::ABORTED: return "ABORTED";
    case grpc::StatusCode::OUT_OF_RANGE: return "OUT_OF_RANGE";
    case grpc::StatusCode::UNIMPLEMENTED: return "UNIMPLEMENTED";
    case grpc::StatusCode::INTERNAL: return "INTERNAL";
    case grpc::StatusCode::UNAVAILABLE: return "UNAVAILABLE";
    case grpc::StatusCode::DATA_LOSS: return "DATA_LOSS";
    case grpc::StatusCode::UNAUTHENTICATED: return "UNAUTHENTICATED";
    default: return "UNKNOWN_CODE";
  }
}

bool loopback(const std::string& address) {
  const std::string host = address.substr(0, address.rfind(':'));
  return host == "localhost" || host.rfind("127.", 0) == 0 || host == "[::1]";
}

}  // namespace

std::string failure_message(const std::string& address, const std::string& what, const grpc::Status& s) {
  return "ddpkit ps: " + what + " on " + address + " failed: " + code_name(s.error_code()) + ": " + s.error_message();
}

void ParameterServerClient::Impl::offer_shared_memory(wire::SessionRequest* request) {
  if (!options.shared_memory() || options.chunk_bytes() <= 0 || !shared_memory_allowed_by_environment()) return;
  try {
    region = std::make_unique<SharedRegion>((options.chunk_bytes() + 63) / 64 * 64, options.shared_memory_slots());
  } catch (const CommError& e) {
    shared_memory_refused = e.what();
    return;
  }
  region->offer(request->mutable_shared_memory());
}

void ParameterServerClient::Impl::settle_shared_memory() {
  if (!region) return;
  wire::SessionEvent event;
  if (!session->answer(options.connect_timeout(), &event))
    shared_memory_refused = "the session did not answer the offer";
  else if (!event.shared_memory())
    shared_memory_refused = event.shared_memory_refused();
  else {
    if (event.doorbell())
      doorbell = std::make_unique<DoorbellClient>(region.get(), options.timeout(),
                                                  [s = session.get()] { return !s->ended(); });
    return;
  }
  region.reset();
  // On one host the offer should be taken: say why not, once, rather than run slower unnoticed.
  if (loopback(options.address()))
    std::cerr << "ddpkit ps: trainer " << options.trainer_id() << ": the server at " << options.address()
              << " did not take shared memory (" << shared_memory_refused << "); gradients go in gRPC messages\n";
}

ParameterServerClient::ParameterServerClient(ClientOptions options) : impl_(std::make_unique<Impl>()) {
  hold_grpc_runtime();
  impl_->options = std::move(options);
  const auto& o = impl_->options;
  DDPKIT_CHECK(o.address().find(':') != std::string::npos, "parameter server address '", o.address(), "' is not host:port");
  DDPKIT_CHECK(o.timeout().count() > 0, "parameter server client: timeout must be positive");
  DDPKIT_CHECK(o.max_message_bytes() > 0 && o.max_message_bytes() <= (int64_t(1) << 31) - 1,
               "parameter server client: max_message_bytes must be in 1..2^31-1");
  DDPKIT_CHECK(o.chunk_bytes() >= 0, "parameter server client: chunk_bytes must be >= 0, got ", o.chunk_bytes());
  DDPKIT_CHECK(o.chunks_in_flight() >= 1, "parameter server client: chunks_in_flight must be >= 1, got ",
               o.chunks_in_flight());
  DDPKIT_CHECK(o.shared_memory_slots() >= 1 && o.shared_memory_slots() <= SharedRegion::kMaxMailboxes,
               "parameter server client: shared_memory_slots must be in 1..", SharedRegion::kMaxMailboxes, ", got ",
               o.shared_memory_slots());
  const auto creds = channel_credentials(o.tls().root_certificate());
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(static_cast<int>(o.max_message_bytes()));
  args.SetMaxSendMessageSize(static_cast<int>(o.max_message_bytes()));
  // One channel per client: trainers sharing a process must not share a TCP connection.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  apply_bulk_transport_args([&](const char* name, int value) { args.SetInt(name, value); });
  impl_->channel = grpc::CreateCustomChannel(o.address(), creds, args);
  if (!impl_->channel->WaitForConnected(std::chrono::system_clock::now() + o.connect_timeout()))
    throw CommError("ddpkit ps: could not connect to the parameter server at " + o.address() + " within " +
                    std::to_string(o.connect_timeout().count()) + " ms");
  impl_->stub = wire::ParameterServer::NewStub(impl_->channel);
  impl_->generic = std::make_unique<grpc::GenericStub>(impl_->channel);
  if (o.open_session()) {
    impl_->session = std::make_unique<Impl::Session>();
    add_token(impl_->session->ctx, o.token());
    wire::SessionRequest request;
    request.set_trainer_id(o.trainer_id());
    impl_->offer_shared_memory(&request);
    impl_->session->start(impl_->stub.get(), std::move(request));
    impl_->settle_shared_memory();
  }
}

ParameterServerClient::~ParameterServerClient() {
  if (impl_->doorbell) impl_->doorbell->close();
  impl_->flight->cancel_and_wait();
  if (impl_->session) impl_->session->stop();
}

ParameterServerClient::Traffic ParameterServerClient::traffic() const {
  Traffic t;
  t.bytes_sent = impl_->counters->sent;
  t.bytes_received = impl_->counters->received;
  t.shm_bytes_sent = impl_->counters->shm_sent;
  t.shm_bytes_received = impl_->counters->shm_received;
  t.calls = impl_->counters->calls;
  t.doorbell_calls = impl_->counters->doorbell_calls;
  return t;
}

int ParameterServerClient::trainer_id() const { return impl_->options.trainer_id(); }
bool ParameterServerClient::uses_shared_memory() const { return impl_->region != nullptr; }
const std::string& ParameterServerClient::shared_memory_refused() const { return impl_->shared_memory_refused; }
const std::string& ParameterServerClient::address() const { return impl_->options.address(); }

void ParameterServerClient::reset_state() {
  wire::ResetReply reply;
  impl_->call("ResetState", [&](grpc::ClientContext& ctx) { return impl_->stub->ResetState(&ctx, {}, &reply); });
}

ParameterServerClient::ServerMetrics ParameterServerClient::get_metrics() {
  wire::MetricsReply reply;
  impl_->call("GetMetrics", [&](grpc::ClientContext& ctx) { return impl_->stub->GetMetrics(&ctx, {}, &reply); });
  ServerMetrics out;
  out.server_rank = reply.server_rank();
  for (const auto& m : reply.metrics()) out.series[m.name()] = std::vector<double>(m.elapsed_ms().begin(), m.elapsed_ms().end());
  for (const auto& e : reply.events()) out.events.push_back({e.type(), e.key(), e.name(), e.start_us(), e.duration_us()});
  out.counters.buckets_averaged = reply.buckets_averaged();
  out.counters.gradients_received = reply.gradients_received();
  out.counters.bytes_received = reply.bytes_received();
  out.counters.bytes_sent = reply.bytes_sent();
  out.counters.seconds_since_reset = reply.seconds_since_reset();
  out.counters.peak_bytes_held = reply.peak_bytes_held();
  out.counters.shm_bytes_received = reply.shm_bytes_received();
  out.counters.shm_bytes_sent = reply.shm_bytes_sent();
  return out;
}

}  // namespace ps
}  // namespace ddpkit
