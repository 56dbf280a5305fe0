#pragma once
// One callable from several lambdas, each taking the calls its parameters match (std::visit's
// idiom; here for the parameter lists' visitors, ops/linear.h).

namespace glmtune {

template <typename... Fs>
struct Overloaded : Fs... {
  using Fs::operator()...;
};

}  // namespace glmtune
