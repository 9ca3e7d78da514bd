// The dispatcher path's unboxed kernels (Note [Unboxed observer kernels]): for the operators CPU
// code calls most, a kernel at the observer's key that tells a host-only call from its unboxed
// arguments and redispatches it unboxed; any other call is observed as the boxed fallback
// (observe_dispatch.cpp) observes it, with its arguments boxed on the kernel's frame and the op
// run unboxed. Touches nothing of the tracker's state but through the observer.
//
// Note [Unboxed observer kernels]: a boxed fallback boxes every argument into a stack and the
// kernel below unboxes it again: about 600 instructions on a CPU torch.add, half of what an
// 8-element add costs. A host-only op (host_only_op: no device tensor or device argument, no
// tensor that may stand for others, no watched host memory, no pins) needs nothing from the
// tracker, so these kernels check the same on the arguments as they are and call the next
// kernel directly. Any other call needs op_start's boxed view of its arguments, but not a
// heap-allocated stack nor an unboxing below: they are boxed into an array on this frame (tensors
// borrowed; the plain arguments op_start reads nothing of, int lists among them, as None; no
// host_only_op again) and the op runs unboxed (an operator whose return is not a tensor, a
// scalar, a tuple of tensors or nothing goes to the boxed fallback). The list is what CPU-side
// code (data loading, metrics, the optimizer's CPU state, the host side of copies) and model steps
// call most; an operator not on it is observed exactly as before, only boxed. Each argument type is
// one of the overloads of host_arg below, or a type that holds no tensor and no device (kPlainArg):
// an operator whose schema holds another type does not compile here, so no tensor can hide in an
// argument the check skips.
#include "observe_dispatch.h"
#include "observer.h"
#include "state.h"

#include <ATen/Functions.h>
#include <ATen/core/boxing/impl/boxing.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <array>
#include <optional>
#include <string_view>
#include <tuple>
#include <type_traits>

namespace torch_pipeline {
namespace tracking {
namespace detail {

namespace {

// Types that hold no tensor and no device (a generator's device is not where the op runs).
template <class T>
struct PlainArg
    : std::bool_constant<
          std::is_arithmetic_v<T> || std::is_enum_v<T> || std::is_same_v<T, c10::Scalar> ||
          std::is_same_v<T, c10::SymInt> || std::is_same_v<T, c10::IntArrayRef> ||
          std::is_same_v<T, c10::SymIntArrayRef> || std::is_same_v<T, c10::string_view> ||
          std::is_same_v<T, std::string_view> || std::is_same_v<T, at::Generator> ||
          std::is_same_v<T, c10::OptionalArrayRef<int64_t>> ||
          std::is_same_v<T, c10::OptionalArrayRef<c10::SymInt>>> {};
template <class T>
struct PlainArg<std::optional<T>> : PlainArg<T> {};
template <size_t N>
struct PlainArg<std::array<bool, N>> : std::true_type {};  // (output masks)
template <class T>
constexpr bool kPlainArg = PlainArg<std::remove_cv_t<std::remove_reference_t<T>>>::value;
// Plain arguments op_start reads nothing of (all but flags: a non_blocking flag is a bool) and
// boxes as None: an int list boxed for real is a heap-allocated list.
template <class T>
constexpr bool kUnreadArg =
    kPlainArg<T> && !std::is_arithmetic_v<std::remove_cv_t<std::remove_reference_t<T>>>;

bool host_arg(const at::Tensor& t) { return host_tensor(t); }
bool host_arg(const std::optional<at::Tensor>& t) { return !t.has_value() || host_arg(*t); }
bool host_arg(at::TensorList ts) {
  for (const at::Tensor& t : ts) {
    if (!host_arg(t)) {
      return false;
    }
  }
  return true;
}
bool host_arg(const at::ITensorListRef& ts) {
  for (const at::Tensor& t : ts) {
    if (!host_arg(t)) {
      return false;
    }
  }
  return true;
}
bool host_arg(const c10::List<std::optional<at::Tensor>>& ts) {
  for (size_t i = 0; i < ts.size(); ++i) {
    if (!host_arg(ts.get(i))) {
      return false;
    }
  }
  return true;
}
bool host_arg(at::Device d) { return d.is_cpu(); }
bool host_arg(const std::optional<at::Device>& d) { return !d.has_value() || d->is_cpu(); }
template <class T, std::enable_if_t<kPlainArg<T>, int> = 0>
bool host_arg(const T&) {
  return true;
}

// The returns the unboxed observing path boxes for op_end: one tensor (a value or a reference), a
// scalar, a tuple of tensors (each boxed on its own, as a boxed kernel leaves them on the stack)
// or none. An operator with another return is observed by the boxed fallback.
template <class T>
struct Returns {
  static constexpr bool kHandled =
      std::is_same_v<std::decay_t<T>, at::Tensor> || std::is_same_v<T, c10::Scalar>;
  static constexpr size_t kSize = 1;
  // Returns whether the value is borrowed.
  static bool box(const T& r, c10::IValue* out) {
    if constexpr (std::is_same_v<std::decay_t<T>, at::Tensor>) {
      new (out) c10::IValue(c10::MaybeOwnedTraits<at::Tensor>::createBorrow(r));
      return true;
    } else {
      new (out) c10::IValue(r);
      return false;
    }
  }
};
template <>
struct Returns<void> {
  static constexpr bool kHandled = true;
  static constexpr size_t kSize = 0;
};
template <class... Ts>
struct Returns<std::tuple<Ts...>> {
  static constexpr bool kHandled = (std::is_same_v<std::decay_t<Ts>, at::Tensor> && ...);
  static constexpr size_t kSize = sizeof...(Ts);
  static bool box(const std::tuple<Ts...>& r, c10::IValue* out) {
    std::apply(
        [&](const auto&... t) {
          ((new (out++) c10::IValue(c10::MaybeOwnedTraits<at::Tensor>::createBorrow(t))), ...);
        },
        r);
    return true;
  }
};

// An op's arguments boxed on the caller's frame (no heap stack), destroyed by clear().
// NB: a tensor is boxed borrowed (c10's MaybeOwnedTraits<IValue>: no reference count taken or
// dropped, two atomic operations each), which is safe because the values never outlive the
// arguments or the result they borrow from: op_start and op_end copy what they keep.
template <size_t N>
class Boxed {
  static_assert(N <= 64, "one bit per value in `borrowed`");

 public:
  Boxed() = default;
  Boxed(const Boxed&) = delete;
  Boxed& operator=(const Boxed&) = delete;
  ~Boxed() { clear(); }
  c10::IValue* data() { return reinterpret_cast<c10::IValue*>(bytes_); }
  // One argument boxed for op_start (see kUnreadArg).
  template <class T>
  void add(const T& arg) {
    c10::IValue* out = data() + size;
    if constexpr (kUnreadArg<T>) {
      new (out) c10::IValue();
    } else if constexpr (std::is_same_v<T, at::Tensor>) {
      new (out) c10::IValue(c10::MaybeOwnedTraits<at::Tensor>::createBorrow(arg));
      borrowed |= uint64_t{1} << size;
    } else {
      new (out) c10::IValue(arg);
    }
    ++size;
  }
  void clear() {
    for (size_t i = 0; i < size; ++i) {
      if ((borrowed >> i) & 1) {
        c10::MaybeOwnedTraits<c10::IValue>::destroyBorrow(data()[i]);  // (to None: nothing dropped)
      }
      data()[i].~IValue();
    }
    size = 0;
    borrowed = 0;
  }
  size_t size = 0;        // constructed values
  uint64_t borrowed = 0;  // the values that borrow a tensor, a bit each

 private:
  alignas(c10::IValue) unsigned char bytes_[(N == 0 ? 1 : N) * sizeof(c10::IValue)];
};

template <class Op, class Sig = typename Op::schema>
struct Unboxed;

template <class Op, class Ret, class... Args>
struct Unboxed<Op, Ret(Args...)> {
  static Ret call(c10::DispatchKeySet keys, Args... args) {
    const c10::DispatchKeySet below =
        keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kObserverKey);
    if (C10_UNLIKELY(!g_dispatch_observing.load(std::memory_order_acquire))) {
      c10::impl::tls_set_dispatch_key_included(kObserverKey, false);  // (as the fallback does)
      return Op::redispatch(below, std::forward<Args>(args)...);
    }
    if (!host_memory_observed() && (host_arg(args) && ...)) {
      count(&Counters::ops);
      c10::impl::ExcludeDispatchKeyGuard callees(kBothKeys);
      return Op::redispatch(below, std::forward<Args>(args)...);
    }
    static const c10::OperatorHandle op =
        c10::Dispatcher::singleton().findSchemaOrThrow(Op::name, Op::overload_name);
    if constexpr (Returns<Ret>::kHandled) {
      // NB: an operator's facts are kept for the rest of the process (op_facts.h), and these
      // operators are never deregistered: looked up once, not per call.
      static const OpFacts& facts = op_facts(op);
      return observe_unboxed(facts, below, args...);
    } else {
      return c10::impl::BoxedKernelWrapper<Ret(Args...)>::call(
          c10::BoxedKernel::makeFromFunction<&observe_boxed>(), op, keys,
          std::forward<Args>(args)...);
    }
  }

  // What the boxed fallback does for a call it observes (observe_fallback), with the arguments
  // boxed on this frame for op_start and the op run unboxed (Note [Unboxed observer kernels]).
  static Ret observe_unboxed(const OpFacts& facts, c10::DispatchKeySet below, Args... args) {
    constexpr size_t kBoxed = sizeof...(Args);  // (no TensorOptions in an _ops schema: one each)
    Boxed<kBoxed> boxed;
    (boxed.add(args), ...);
    const c10::ArrayRef<c10::IValue> inputs(boxed.data(), kBoxed);
    const auto run = [&]() -> Ret { return Op::redispatch(below, std::forward<Args>(args)...); };
    // (no host_only_op: call() found a device argument already.) The tracker's own work runs with
    // both keys excluded, and so do the callees of an op it claims (run_taken): for such an op one
    // exclusion covers op_start, the op and op_end.
    std::optional<c10::impl::ExcludeDispatchKeyGuard> tracker_ops(std::in_place, kBothKeys);
    const Taken taken = op_start(facts, inputs);
    boxed.clear();  // (op_start copies what it keeps; the op may now change its arguments)
    const bool excluded = taken == Taken::kClaimed || taken == Taken::kInside;
    if (!excluded) {
      tracker_ops.reset();
    }
    const auto run_or_end = [&]() -> Ret {
      try {
        return excluded ? run() : run_taken(taken, run);
      } catch (...) {
        if (!excluded) {
          tracker_ops.emplace(kBothKeys);
        }
        op_end(taken, {});
        throw;
      }
    };
    if constexpr (std::is_void_v<Ret>) {
      run_or_end();
      if (!excluded) {
        tracker_ops.emplace(kBothKeys);
      }
      op_end(taken, {});
    } else {
      Ret result = run_or_end();
      Boxed<Returns<Ret>::kSize> outputs;
      if (Returns<Ret>::box(result, outputs.data())) {
        outputs.borrowed = (uint64_t{1} << Returns<Ret>::kSize) - 1;
      }
      outputs.size = Returns<Ret>::kSize;
      if (!excluded) {
        tracker_ops.emplace(kBothKeys);
      }
      op_end(taken, c10::ArrayRef<c10::IValue>(outputs.data(), outputs.size));
      return result;
    }
  }
};

template <class Op>
void add(torch::Library& lib) {
  std::string name = Op::name;
  if (*Op::overload_name != '\0') {
    name = name + "." + Op::overload_name;
  }
  lib.impl(name.c_str(), torch::CppFunction::makeFromUnboxedFunction(TORCH_FN(Unboxed<Op>::call)));
}

template <class... Ops>
void add_all(torch::Library& lib) {
  (add<Ops>(lib), ...);
}

}  // namespace

void register_unboxed_kernels(torch::Library& lib) {
  namespace ops = at::_ops;
  // Arithmetic and comparisons.
  add_all<ops::add_Tensor, ops::add__Tensor, ops::add_Scalar, ops::add__Scalar, ops::sub_Tensor,
          ops::sub__Tensor, ops::mul_Tensor, ops::mul__Tensor, ops::mul_Scalar, ops::mul__Scalar,
          ops::div_Tensor, ops::div__Tensor, ops::div_Scalar, ops::div__Scalar, ops::neg,
          ops::pow_Tensor_Scalar, ops::pow_Tensor_Tensor, ops::exp, ops::log, ops::sqrt, ops::rsqrt,
          ops::abs, ops::clamp, ops::relu, ops::sigmoid, ops::tanh, ops::eq_Tensor, ops::eq_Scalar,
          ops::ne_Scalar, ops::lt_Scalar, ops::le_Scalar, ops::gt_Scalar, ops::ge_Scalar,
          ops::where_self, ops::masked_fill_Scalar, ops::addcmul_, ops::addcdiv_,
          ops::lerp__Scalar>(lib);
  // Reductions and linear algebra.
  add_all<ops::sum, ops::sum_dim_IntList, ops::mean, ops::mean_dim, ops::max, ops::min, ops::argmax,
          ops::mm, ops::bmm, ops::addmm, ops::matmul>(lib);
  // Layers of a model step and their backward (the outermost op at this key: conv2d, batch_norm
  // and relu's backward decompose above it), the optimizer's foreach updates.
  add_all<ops::convolution, ops::convolution_backward, ops::native_batch_norm,
          ops::native_batch_norm_backward, ops::threshold_backward, ops::_foreach_add__List,
          ops::_foreach_add__Scalar, ops::_foreach_mul__Scalar>(lib);
  // Views, copies and shapes.
  add_all<ops::view, ops::reshape, ops::t, ops::transpose_int, ops::permute, ops::select_int,
          ops::slice_Tensor, ops::unsqueeze, ops::squeeze_dim, ops::expand, ops::contiguous,
          ops::as_strided, ops::flatten_using_ints, ops::detach, ops::alias, ops::clone, ops::copy_,
          ops::cat, ops::stack, ops::index_select, ops::index_Tensor, ops::_to_copy, ops::to_dtype,
          ops::to_device, ops::to_dtype_layout, ops::lift_fresh, ops::item,
          ops::_local_scalar_dense>(lib);
  // Factories and fills.
  add_all<ops::empty_memory_format, ops::empty_strided, ops::empty_like, ops::zeros_like,
          ops::ones_like, ops::zeros, ops::ones, ops::full, ops::fill__Scalar, ops::zero_,
          ops::arange_start_step, ops::normal_, ops::uniform_>(lib);
}

}  // namespace detail
}  // namespace tracking
}  // namespace torch_pipeline
