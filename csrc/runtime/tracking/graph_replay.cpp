// The capture module's captured graphs and their replays (CapturedGraph, GraphReplay in
// tracking.h): what a graph keeps, and each replay as one scope over what it touches.
#include "graph_capture.h"
#include "launch.h"
#include "scope.h"

#include "../context.h"

#include <algorithm>

namespace torch_pipeline {
namespace tracking {

CapturedGraph::CapturedGraph(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CapturedGraph::~CapturedGraph() = default;

size_t CapturedGraph::kept() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->touched ? impl_->touched->kept.size() : 0;
}

void CapturedGraph::reset() {
  std::shared_ptr<const GraphReplay::Touched> dropped;  // (freed after the lock)
  std::lock_guard<std::mutex> lock(impl_->mutex);
  dropped = std::move(impl_->touched);
}

GraphReplay::GraphReplay(const CapturedGraph& graph) {
  using namespace detail;
  if (!live()) {
    return;
  }
  {
    const CapturedGraph::Impl& g = graph.impl();
    std::lock_guard<std::mutex> lock(g.mutex);
    touched_ = g.touched;
  }
  if (!touched_) {
    return;
  }
  const Touched& t = *touched_;
  // The kept storages' accesses are built already; the others are looked up now, and a kept
  // storage whose memory was let go (resized to nothing) is left out.
  const bool all_data =
      std::all_of(t.kept.begin(), t.kept.end(), [](const at::Tensor& k) { return has_data(k); });
  const bool direct = all_data && t.others.empty();
  std::vector<Access> some;
  if (!direct) {
    some.reserve(t.accesses.size() + t.others.size());
    for (const Access& a : t.accesses) {
      if (has_data(*a.tensor)) some.push_back(a);
    }
    others_.reserve(t.others.size());  // (Access points into it: no reallocation)
    for (const GraphLedger::Other& o : t.others) {
      c10::intrusive_ptr<c10::StorageImpl> impl = o.ref.lock();
      if (impl && impl->data() != nullptr) {
        others_.push_back(tensor_of(c10::Storage(std::move(impl))));
        some.push_back(Access{&others_.back(), o.written});
      }
    }
  }
  const std::vector<Access>& accesses = direct ? t.accesses : some;
  if (accesses.empty()) {
    return;
  }
  count(&Counters::graph_replays);
  if (in_pipeline()) {
    for (const c10::Device& d : t.devices) enter_device(d);
    for (const at::Tensor& o : others_) {
      if (!o.device().is_cpu()) enter_device(o.device());
    }
  }
  open_scope(accesses, launched_, period_, keep_alive_);
}

GraphReplay::~GraphReplay() { close(); }

void GraphReplay::close() {
  if (!launched_.empty()) {
    detail::close_scope(launched_, period_, keep_alive_, nullptr, "a graph replay");
  }
  others_.clear();
  touched_.reset();
}

}  // namespace tracking
}  // namespace torch_pipeline
