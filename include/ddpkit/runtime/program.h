// A program's main() on ddpkit: what its body throws becomes one line on stderr and an exit
// status, as the ddpkit CLI does, instead of std::terminate and a stack trace.
//
//   int main(int argc, char** argv) {
//     return ddpkit::run_main("my_trainer", [&] { return train(argc, argv); }, [] { return kUsage; });
//   }
#pragma once

#include <functional>
#include <string>

namespace ddpkit {

// Runs `body` and returns its status. What it throws is printed in one write(2) (ranks share a
// launcher's stderr) and mapped to a status:
//   UsageError  "<program>: <what>", a blank line and usage() (when given)  2
//   CommError   its message (it names the operation, rank and world)         3
//   c10::Error  its message without the backtrace (DDPKIT_CHECK's "ddpkit: ...")  1
//   other std::exception  "<program>: <what>"                                1
int run_main(const std::string& program, const std::function<int()>& body,
             const std::function<std::string()>& usage = {});

// `text` to stderr in one write(2), after flushing std::cerr: a message sent in pieces
// interleaves with another rank's mid-line.
void print_error(const std::string& text);

}  // namespace ddpkit
