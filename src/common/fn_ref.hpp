// A non-owning reference to a callable, for functions that call it before
// they return (the thread pool's loops). std::function copies a lambda that
// captures more than two pointers onto the heap, so every parallel loop of
// a forward allocated; a FnRef is two pointers and never allocates. The
// callable must outlive the FnRef: pass a lambda straight into the call
// (a temporary lives until the call returns), never store a FnRef to one.
#pragma once

#include <type_traits>
#include <utility>

namespace ep_moe {

template <class Sig>
class FnRef;

template <class R, class... Args>
class FnRef<R(Args...)> {
 public:
  template <class F, class = std::enable_if_t<!std::is_same<std::decay_t<F>, FnRef>::value &&
                                              std::is_invocable_r<R, F&, Args...>::value>>
  FnRef(F&& f) noexcept  // NOLINT(google-explicit-constructor): stands in for a callable argument
      : obj_(const_cast<void*>(static_cast<const void*>(std::addressof(f)))), call_([](void* o, Args... args) -> R {
          return (*static_cast<std::remove_reference_t<F>*>(o))(std::forward<Args>(args)...);
        }) {}

  R operator()(Args... args) const { return call_(obj_, std::forward<Args>(args)...); }

 private:
  void* obj_;
  R (*call_)(void*, Args...);
};

}  // namespace ep_moe
