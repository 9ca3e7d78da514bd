// The async-collectives room (see collectives.h): Works of c10d ops and the tensors they write,
// until work.wait(). Touches LiveState::async_works.
#include "collectives.h"

#include "../op_facts.h"

#include <algorithm>

namespace torch_pipeline {
namespace tracking {
namespace detail {

namespace {
constexpr size_t kAsyncWorksKept = 1024;

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
  std::vector<at::Tensor> dropped;  // released after the lock (declared before it)
  LiveState& st = state();
  std::lock_guard<std::mutex> lock(st.mutex);
  if (st.async_works.size() >= kAsyncWorksKept) {
    dropped = std::move(st.async_works.front().second);  // never waited for: forgotten
    st.async_works.pop_front();
  }
  st.async_works.emplace_back(work, std::move(written));
}

}  // namespace detail

void work_waited(const void* work) {
  using namespace detail;
  if (!live() || work == nullptr) {
    return;
  }
  std::vector<at::Tensor> written;
  {
    LiveState& st = state();
    std::lock_guard<std::mutex> lock(st.mutex);
    auto& works = st.async_works;
    auto it =
        std::find_if(works.begin(), works.end(), [&](const auto& w) { return w.first == work; });
    if (it == works.end()) {
      return;
    }
    written = std::move(it->second);
    works.erase(it);
  }
  // The current streams have waited for the work: its tensors are written there, now.
  TrackScope scope({}, written);
}

}  // namespace tracking
}  // namespace torch_pipeline
