#include "cli.h"

#include <ddpkit/error.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <thread>

namespace ddpkit {
namespace cli {

// ---- flags ---------------------------------------------------------------------------------------
Flags::Flags(std::vector<std::string> args, std::map<std::string, std::string> defaults, std::vector<std::string> switches)
    : values_(std::move(defaults)) {
  for (const auto& s : switches) switches_[s] = false;
  for (size_t i = 0; i < args.size(); ++i) {
    std::string a = args[i];
    if (a.rfind("--", 0) != 0) throw UsageError("unexpected argument '" + a + "'");
    a = a.substr(2);
    std::string value;
    bool has_value = false;
    if (auto eq = a.find('='); eq != std::string::npos) {
      value = a.substr(eq + 1);
      a = a.substr(0, eq);
      has_value = true;
    }
    if (switches_.count(a)) {
      if (has_value) throw UsageError("--" + a + " takes no value");
      switches_[a] = true;
      continue;
    }
    if (!values_.count(a)) throw UsageError("unknown flag --" + a);
    if (!has_value) {
      if (i + 1 >= args.size()) throw UsageError("--" + a + " needs a value");
      value = args[++i];
    }
    values_[a] = value;
  }
}

std::string Flags::str(const std::string& name) const { return values_.at(name); }

int Flags::integer(const std::string& name) const {
  const std::string& v = values_.at(name);
  char* end = nullptr;
  const long x = std::strtol(v.c_str(), &end, 10);
  if (v.empty() || *end) throw UsageError("--" + name + " expects an integer, got '" + v + "'");
  return static_cast<int>(x);
}

double Flags::real(const std::string& name) const {
  const std::string& v = values_.at(name);
  char* end = nullptr;
  const double x = std::strtod(v.c_str(), &end);
  if (v.empty() || *end) throw UsageError("--" + name + " expects a number, got '" + v + "'");
  return x;
}

bool Flags::on(const std::string& name) const { return switches_.at(name); }

std::vector<int64_t> Flags::int_list(const std::string& name) const {
  std::vector<int64_t> out;
  const std::string& v = values_.at(name);
  size_t start = 0;
  while (start <= v.size() && !v.empty()) {
    size_t comma = v.find(',', start);
    const std::string item = v.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    char* end = nullptr;
    const long long x = std::strtoll(item.c_str(), &end, 10);
    if (item.empty() || *end || x <= 0) throw UsageError("--" + name + " expects positive integers separated by commas, got '" + v + "'");
    out.push_back(x);
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return out;
}

// ---- launcher ------------------------------------------------------------------------------------
bool in_distributed_env() { return std::getenv("RANK") && std::getenv("WORLD_SIZE"); }

namespace {

int free_port() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  DDPKIT_CHECK(fd >= 0, "socket(): ", std::strerror(errno));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  DDPKIT_CHECK(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0, "bind(): ", std::strerror(errno));
  socklen_t len = sizeof addr;
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  const int port = ntohs(addr.sin_port);
  close(fd);
  return port;
}

volatile sig_atomic_t g_interrupted = 0;
void on_signal(int) { g_interrupted = 1; }

}  // namespace

int launch_local(int nproc, const std::vector<std::string>& argv) {
  DDPKIT_CHECK(nproc >= 1, "--nproc must be >= 1, got ", nproc);
  const std::string port = std::getenv("MASTER_PORT") ? std::getenv("MASTER_PORT") : std::to_string(free_port());
  std::vector<pid_t> children;
  for (int r = 0; r < nproc; ++r) {
    const pid_t pid = fork();
    DDPKIT_CHECK(pid >= 0, "fork(): ", std::strerror(errno));
    if (pid == 0) {
      setenv("MASTER_ADDR", "127.0.0.1", 1);
      setenv("MASTER_PORT", port.c_str(), 1);
      setenv("RANK", std::to_string(r).c_str(), 1);
      setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      setenv("WORLD_SIZE", std::to_string(nproc).c_str(), 1);
      setenv("LOCAL_WORLD_SIZE", std::to_string(nproc).c_str(), 1);
      std::vector<char*> args;
      for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
      args.push_back(nullptr);
      execv("/proc/self/exe", args.data());
      std::cerr << "ddpkit: exec failed: " << std::strerror(errno) << "\n";
      _exit(127);
    }
    children.push_back(pid);
  }
  signal(SIGINT, on_signal);
  signal(SIGTERM, on_signal);
  int exit_code = 0;
  size_t alive = children.size();
  bool stopping = false;
  auto stop_all = [&](int sig) {
    for (pid_t c : children)
      if (c > 0) kill(c, sig);
  };
  auto stop_deadline = std::chrono::steady_clock::time_point::max();
  while (alive > 0) {
    int status = 0;
    const pid_t pid = waitpid(-1, &status, WNOHANG);
    if (pid > 0) {
      for (auto& c : children)
        if (c == pid) c = -1;
      --alive;
      const int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      if (code != 0 && exit_code == 0) {
        exit_code = code;
        if (!stopping) {
          std::cerr << "ddpkit: a rank exited with status " << code << "; stopping the others\n";
          stopping = true;
          stop_all(SIGTERM);
          stop_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
        }
      }
      continue;
    }
    if (g_interrupted && !stopping) {
      stopping = true;
      exit_code = 130;
      stop_all(SIGTERM);
      stop_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    }
    if (std::chrono::steady_clock::now() > stop_deadline) {
      stop_all(SIGKILL);
      stop_deadline = std::chrono::steady_clock::time_point::max();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return exit_code;
}

}  // namespace cli
}  // namespace ddpkit
