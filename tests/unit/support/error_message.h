#pragma once
// The message of the glmtune::Error a call throws (a test failure, and "", when it throws none).

#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "glmtune/base/error.h"

namespace glmtune::test {

inline std::string message_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a glmtune::Error";
  return "";
}

}  // namespace glmtune::test
