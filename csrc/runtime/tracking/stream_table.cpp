// The streams part of a live period (see stream_table.h).
#include "stream_table.h"

#include "graph_capture.h"
#include "life.h"
#include "observer.h"

#include "../devices.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <algorithm>

namespace torch_pipeline {
namespace tracking {
namespace detail {

StreamEntry& StreamTable::acquire_slow(const c10::Stream& s) {
  auto it = by_stream_.find(s);
  if (it != by_stream_.end()) {
    last_ = it->second.get();
    return *last_;
  }
  auto entry = std::make_unique<StreamEntry>(next_id_++, s);
  for (const auto& [from, event] : baseline_) {
    if (from.device() == s.device() && from != s) {
      event.block(s);
      count(&Counters::waits);
    }
  }
  if (!backend_checks(s.device_type())) {
    want_sampled_check();  // (Note [The sampled check is installed on demand])
  }
  StreamEntry& out = *entry;
  by_id_.emplace(out.id, entry.get());
  by_stream_.emplace(s, std::move(entry));
  last_ = &out;
  return out;
}

StreamEntry* StreamTable::find_slow(core::StreamId id) {
  const auto it = by_id_.find(id);
  if (it == by_id_.end()) {
    return nullptr;
  }
  last_ = it->second;
  return last_;
}

StreamEntry* StreamTable::find(const c10::Stream& stream) {
  const auto it = by_stream_.find(stream);
  return it == by_stream_.end() ? nullptr : it->second.get();
}

StreamEntry& StreamTable::at(core::StreamId id) { return *by_id_.at(id); }

void StreamTable::record_baseline() {
  for (const c10::Device& d : initialized_accelerator_devices()) {
    const auto* impl = c10::impl::getDeviceGuardImpl(d.type());
    for (const c10::Stream& s : {impl->getStream(d), impl->getDefaultStream(d)}) {
      if (captures_now(s)) {
        continue;
      }
      const bool seen = std::any_of(baseline_.begin(), baseline_.end(),
                                    [&](const auto& b) { return b.first == s; });
      if (!seen) {
        baseline_.emplace_back(s, c10::Event(d.type()));
        baseline_.back().second.record(s);
      }
    }
  }
}

void StreamTable::barrier() {
  std::vector<std::pair<c10::Stream, c10::Event>> ends;
  std::vector<c10::Stream> waiters;
  for (const auto& [stream, entry] : by_stream_) {
    ends.emplace_back(stream, c10::Event(stream.device_type()));
    ends.back().second.record(stream);
    waiters.push_back(stream);
    const auto* impl = c10::impl::getDeviceGuardImpl(stream.device_type());
    for (const c10::Stream& s :
         {impl->getDefaultStream(stream.device()), impl->getStream(stream.device())}) {
      if (std::find(waiters.begin(), waiters.end(), s) == waiters.end()) {
        waiters.push_back(s);
      }
    }
  }
  for (const c10::Stream& stream : waiters) {
    for (const auto& [from, event] : ends) {
      if (from != stream && from.device() == stream.device()) {
        event.block(stream);
      }
    }
  }
}

void StreamTable::clear() {
  last_ = nullptr;
  by_stream_.clear();
  by_id_.clear();
  baseline_.clear();
}

}  // namespace detail
}  // namespace tracking
}  // namespace torch_pipeline
