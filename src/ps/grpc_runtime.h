// gRPC's library lifetime. gRPC shuts itself down when its last object goes, on a detached
// thread; if main() returns meanwhile, that thread races the exit's static destructors and
// crashes. Every server and client calls hold_grpc_runtime() first: it keeps gRPC initialised
// until static destruction, where it shuts down blocking.
#pragma once

#include <grpc/grpc.h>


namespace ddpkit {
namespace ps {

inline void hold_grpc_runtime() {
  struct Runtime {
    Runtime() { grpc_init(); }
    ~Runtime() { grpc_shutdown_blocking(); }
  };
  static Runtime runtime;
}

// HTTP/2 settings for multi-megabyte messages, applied to both ends (`set(name, value)`):
// gRPC's defaults (16 KB frames, a 64 KB initial window grown by BDP probing) cap a loopback
// connection well below memory bandwidth for gradient-sized messages (16 MB rounds between two
// trainers and a server: 45 ms with the defaults, 33 ms with these; build/ps_server_bench).
template <typename Set>
void apply_bulk_transport_args(Set&& set) {
  set(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, 16 * 1024 * 1024 - 1);
  set(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 64 * 1024 * 1024);
  set(GRPC_ARG_HTTP2_WRITE_BUFFER_SIZE, 64 * 1024 * 1024);
  set(GRPC_ARG_TCP_MAX_READ_CHUNK_SIZE, 16 * 1024 * 1024);
  set(GRPC_ARG_TCP_MIN_READ_CHUNK_SIZE, 1024 * 1024);
  set(GRPC_ARG_HTTP2_BDP_PROBE, 0);
}

}  // namespace ps
}  // namespace ddpkit
