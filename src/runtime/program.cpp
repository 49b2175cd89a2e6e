#include <ddpkit/error.h>
#include <ddpkit/runtime/program.h>

#include <unistd.h>

#include <iostream>

namespace ddpkit {

void print_error(const std::string& text) {
  std::cerr.flush();
  for (size_t done = 0; done < text.size();) {
    const ssize_t n = ::write(STDERR_FILENO, text.data() + done, text.size() - done);
    if (n <= 0) break;
    done += static_cast<size_t>(n);
  }
}

int run_main(const std::string& program, const std::function<int()>& body, const std::function<std::string()>& usage) {
  try {
    return body();
  } catch (const UsageError& e) {
    print_error(program + ": " + e.what() + "\n" + (usage ? "\n" + usage() : std::string()));
    return 2;
  } catch (const CommError& e) {
    print_error(std::string(e.what()) + "\n");
    return 3;
  } catch (const c10::Error& e) {
    print_error(std::string(e.what_without_backtrace()) + "\n");
    return 1;
  } catch (const std::exception& e) {
    print_error(program + ": " + e.what() + "\n");
    return 1;
  }
}

}  // namespace ddpkit
