// The async-collectives module (see collectives.h): Works of c10d ops and the tensors they write,
// until work.wait(). Touches LiveState::async_works through its methods (and its own lock).
#include "collectives.h"

#include "../op_facts.h"

#include <algorithm>

namespace torch_pipeline {
namespace tracking {
namespace detail {

namespace {
// The Work among an op's outputs (directly or in a tuple), or nullptr.
const void* returned_work(c10::ArrayRef<c10::IValue> outputs) {
  for (const c10::IValue& v : outputs) {
    if (const void* work = torchbind_target(v)) {
      return work;
    }
    if (v.isTuple()) {
      for (const c10::IValue& x : v.toTupleRef().elements()) {
        if (const void* work = torchbind_target(x)) {
          return work;
        }
      }
    }
  }
  return nullptr;
}
}  // namespace

void note_async_collective(c10::ArrayRef<c10::IValue> outputs, std::vector<at::Tensor>& written) {
  const void* work = returned_work(outputs);
  if (work == nullptr || written.empty()) {
    return;
  }
  // (a Work forgotten to make room is dropped here, after the part's lock)
  state().async_works.add(work, std::move(written));
}

}  // namespace detail

void work_waited(const void* work) {
  using namespace detail;
  if (!live() || work == nullptr) {
    return;
  }
  std::optional<std::vector<at::Tensor>> written = state().async_works.take(work);
  if (!written) {
    return;
  }
  // The current streams have waited for the work: its tensors are written there, now.
  TrackScope scope({}, *written);
}

}  // namespace tracking
}  // namespace torch_pipeline
