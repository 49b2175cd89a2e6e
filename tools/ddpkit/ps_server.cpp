// ddpkit ps-server: one parameter server as its own process, until SIGINT/SIGTERM.
#include "cli.h"

#include <ddpkit/ps/parameter_server.h>

#include <signal.h>
#include <unistd.h>

#include <cerrno>

#include <cstdlib>
#include <fstream>
#include <iostream>
#include <sstream>

namespace ddpkit {
namespace cli {

const char* kPsServerUsage = R"(usage: ddpkit ps-server --trainer-ids 0,1 [flags]

Serves gradient averaging for the trainers named by --trainer-ids until SIGINT or SIGTERM.

flags:
  --address HOST:PORT      where to listen (default 127.0.0.1:29600; port 0 picks one)
  --trainer-ids LIST       trainer ids served, e.g. 0,1 (or --trainers N for 0..N-1)
  --trainers N             shorthand for --trainer-ids 0..N-1
  --class NAME             average (sum as gradients arrive) | average_batch (sum at the end,
                           in trainer order)
  --max-message-mb N       largest accepted request (default 1024)
  --bucket-timeout-s N     fail a bucket some trainers never sent after N s (default 60)
  --token-file PATH        require this shared secret (also DDPKIT_PS_TOKEN) from every caller
  --tls-cert PATH          PEM certificate chain; with --tls-key, serve TLS
  --tls-key PATH           PEM private key
  --rank N                 rank reported in metrics (default 0)
)";

std::string read_token(const std::string& path, const char* env) {
  if (path.empty()) {
    const char* value = std::getenv(env);
    return value ? value : "";
  }
  std::ifstream in(path);
  if (!in) throw UsageError("--token-file '" + path + "' cannot be read");
  std::string token;
  std::getline(in, token);
  if (token.empty()) throw UsageError("--token-file '" + path + "' is empty");
  return token;
}

namespace {
int g_signal_pipe[2] = {-1, -1};
void on_stop_signal(int sig) {
  const unsigned char byte = static_cast<unsigned char>(sig);
  (void)!write(g_signal_pipe[1], &byte, 1);
}
}  // namespace

// SIGINT/SIGTERM may land on any thread (OpenBLAS starts its own at load time, before any mask
// could be set): the handler only writes the signal number to a pipe the waiting thread reads.
void catch_stop_signals() {
  if (g_signal_pipe[0] < 0 && pipe(g_signal_pipe) != 0) throw std::runtime_error("pipe() failed");
  struct sigaction action {};
  action.sa_handler = on_stop_signal;
  sigemptyset(&action.sa_mask);
  sigaction(SIGINT, &action, nullptr);
  sigaction(SIGTERM, &action, nullptr);
}

int wait_for_stop_signal() {
  unsigned char sig = 0;
  while (read(g_signal_pipe[0], &sig, 1) < 0 && errno == EINTR) {
  }
  return sig;
}

int run_ps_server(const std::vector<std::string>& args) {
  Flags f(args,
          {{"address", "127.0.0.1:29600"}, {"trainer-ids", ""}, {"trainers", "0"}, {"class", "average"},
           {"max-message-mb", "1024"}, {"bucket-timeout-s", "60"}, {"token-file", ""}, {"tls-cert", ""},
           {"tls-key", ""}, {"rank", "0"}},
          {});
  std::vector<int> ids;
  if (!f.str("trainer-ids").empty()) {
    if (f.integer("trainers") != 0) throw UsageError("give --trainer-ids or --trainers, not both");
    std::stringstream list(f.str("trainer-ids"));
    for (std::string item; std::getline(list, item, ',');) {
      char* end = nullptr;
      const long id = std::strtol(item.c_str(), &end, 10);
      if (item.empty() || *end || id < 0) throw UsageError("--trainer-ids expects trainer ids >= 0 separated by commas, got '" + f.str("trainer-ids") + "'");
      ids.push_back(static_cast<int>(id));
    }
  } else {
    if (f.integer("trainers") < 1) throw UsageError("name the trainers served: --trainer-ids 0,1 or --trainers 2");
    for (int t = 0; t < f.integer("trainers"); ++t) ids.push_back(t);
  }
  ps::ServerKind kind;
  try {
    kind = ps::server_kind_from_name(f.str("class"));
  } catch (const c10::Error&) {
    throw UsageError("--class must be average or average_batch, got '" + f.str("class") + "'");
  }
  if (f.real("max-message-mb") <= 0 || f.real("max-message-mb") > 2047) throw UsageError("--max-message-mb must be in (0, 2047]");
  if (f.real("bucket-timeout-s") <= 0) throw UsageError("--bucket-timeout-s must be positive");
  if (f.str("tls-cert").empty() != f.str("tls-key").empty()) throw UsageError("--tls-cert and --tls-key go together");

  catch_stop_signals();

  ps::ParameterServer server(ps::ServerOptions()
                                 .address(f.str("address"))
                                 .trainer_ids(ids)
                                 .kind(kind)
                                 .rank(f.integer("rank"))
                                 .max_message_bytes(static_cast<int64_t>(f.real("max-message-mb") * 1024 * 1024))
                                 .bucket_timeout(std::chrono::milliseconds(static_cast<int64_t>(f.real("bucket-timeout-s") * 1000)))
                                 .token(read_token(f.str("token-file")))
                                 .tls(ps::TlsFiles().certificate(f.str("tls-cert")).private_key(f.str("tls-key"))));
  server.start();
  std::cout << "ddpkit ps-server: listening on " << server.address() << " (" << ps::server_kind_name(kind)
            << ", trainers " << f.str("trainer-ids") << (f.str("trainer-ids").empty() ? "0.." + std::to_string(ids.size() - 1) : "")
            << (f.str("tls-cert").empty() ? ", plaintext" : ", TLS") << ")" << std::endl;
  const int sig = wait_for_stop_signal();
  const auto c = server.counters();
  server.shutdown();
  std::cout << "ddpkit ps-server: stopped by signal " << sig << " after averaging " << c.buckets_averaged
            << " buckets (" << c.gradients_received << " gradients, " << c.bytes_received << " bytes in and "
            << c.bytes_sent << " out in messages, " << c.shm_bytes_received << " in and " << c.shm_bytes_sent
            << " out through shared memory)" << std::endl;
  return 0;
}

}  // namespace cli
}  // namespace ddpkit
