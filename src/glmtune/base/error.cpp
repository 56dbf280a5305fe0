#include "glmtune/base/error.h"

namespace glmtune {
namespace {
std::string compose(const std::string& what, const std::string& where, const std::string& fix) {
  std::string msg = where.empty() ? what : where + ": " + what;
  if (!fix.empty()) msg += "\n  fix: " + fix;
  return msg;
}
}  // namespace

Error::Error(std::string what, std::string where, std::string fix)
    : std::runtime_error(compose(what, where, fix)),
      what_(std::move(what)),
      where_(std::move(where)),
      fix_(std::move(fix)) {}

void throw_internal(const char* file, int line, const std::string& message) {
  throw InternalError(
      fmt::format("internal error at {}:{}: {} (this is a glmtune bug; please report it)", file,
                  line, message));
}

}  // namespace glmtune
